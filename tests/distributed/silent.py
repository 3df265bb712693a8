"""A process of a two-process run that goes silent (SIGSTOP after a first collective),
for the heartbeat timeout: `python -m tests.distributed.silent PORT PROCESS SECONDS`."""

import os
import signal
import sys

from jaxagent import distributed

port, process, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
distributed.initialize(f"127.0.0.1:{port}", 2, process, heartbeat_timeout_s=seconds)
print(process, distributed.gather_json({"process": process}), flush=True)
if process == 1:
  os.kill(os.getpid(), signal.SIGSTOP)
distributed.gather_json({"process": process})  # (waits on the silent one)
print("the collective ended", flush=True)

"""A real environment worker process (`python -m envs.server`) for tests: started on a free
loopback port, its log in a file, its folder removed with the process object."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import weakref

import httpx

from tests.conftest import REPO


def start_worker(tmp_path, *args, user=None):
  """`python -m envs.server` on a free loopback port (as `user`, a uid, where given);
  returns (process, url, workspace root)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  parent = tempfile.mkdtemp(prefix="jaxagent-test-")
  os.chmod(parent, 0o711)  # sandbox uids pass through to their workspaces
  as_user = []
  if user is not None:
    os.chown(parent, user, user)
    as_user = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"]
  root = os.path.join(parent, "workspaces")
  # The log goes to a file: a pipe nobody reads would fill and stall the worker.
  log = open(os.path.join(parent, "worker.log"), "w+")
  proc = subprocess.Popen([*as_user, sys.executable, "-m", "envs.server", "--port", str(port),
                           "--workspace-root", root, *args], cwd=REPO,
                          stdout=log, stderr=subprocess.STDOUT, text=True)
  proc.log = log
  # Removed with the process object (a test-distributing worker runs no atexit handlers:
  # each start left its folder and log in /tmp).
  weakref.finalize(proc, shutil.rmtree, parent, True)
  url = f"http://127.0.0.1:{port}"
  for _ in range(300):
    try:
      if httpx.get(f"{url}/health", timeout=1).status_code == 200:
        return proc, url, root
    except httpx.HTTPError:
      pass
    if proc.poll() is not None:
      raise AssertionError(f"worker exited: {worker_log(proc)}")
    time.sleep(0.1)
  proc.kill()
  raise AssertionError("worker did not start")


def worker_log(proc) -> str:
  proc.log.seek(0)
  return proc.log.read()

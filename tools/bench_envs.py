"""Environment tier under load: concurrent python_tests episodes against a real worker.

Starts `python -m envs.server --sandboxes N` on a loopback port and, for each
concurrency level, plays that many python_tests episodes at once (scripted:
two of three write the reference solution, the rest a wrong one, half of those
crashing at import), each reset -> write_file -> DONE -> verify -> close over
HTTP. Prints one JSON line per level:

  {"concurrency", "episodes", "verdicts": {status: count}, "errors", "episodes_per_s",
   "verify_p50_s", "verify_p99_s", "episode_p50_s", "episode_p99_s", "wall_s",
   "loop_held_s"}

(`loop_held_s`: the seconds the worker's event loop was held meanwhile by code that did
not await, from its /metrics `env_loop_held_seconds_total`; every session waited for them.)

then a table. Every episode must end with a verdict (pass, fail, timeout; infra_error
only for injected faults): `errors` counts episodes that ended without one.

`--commands K --command-s S` starts each episode with a turn of K `run_python` calls
that each sleep S seconds (the policy's own load, each within its sandbox wall limit:
at the worker's defaults, `--concurrency 40 --commands 4 --command-s 9.5` crowds its 8
slots for minutes; a call the crowd makes slower must still end in a verdict).

`--worker-user UID` runs the worker as that user (from root), and `--filesystems
own,disk` runs the levels once per `--workspace-filesystem` of a worker that is not
root (each row then names its `filesystem`), then prints one line
`{"own_over_disk": {concurrency: ratio of episodes_per_s}}`.

  python tools/bench_envs.py --concurrency 8,64,200 --sandboxes 8
  python tools/bench_envs.py --concurrency 8,200 --worker-user 65534 --filesystems own,disk
  python tools/bench_envs.py --concurrency 40 --commands 4 --command-s 9.5
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxagent.cli_args import positive_int, positive_ints  # noqa: E402

from envs.base import TaskSpec  # noqa: E402
from envs.play import play_episode  # noqa: E402
from envs.python_tasks_data import TASKS  # noqa: E402
from envs.server import RemoteEnv  # noqa: E402


def start_worker(sandboxes: int, extra: list[str], user: int | None = None
                 ) -> tuple[subprocess.Popen, str]:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  parent = tempfile.mkdtemp(prefix="jaxagent-bench-")
  os.chmod(parent, 0o711)
  as_user = []
  if user is not None:
    os.chown(parent, user, user)
    as_user = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"]
  proc = subprocess.Popen([*as_user, sys.executable, "-m", "envs.server", "--port", str(port),
                           "--sandboxes", str(sandboxes), "--workspace-root",
                           os.path.join(parent, "ws"), *extra],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  url = f"http://127.0.0.1:{port}"
  for _ in range(300):
    try:
      if httpx.get(f"{url}/health", timeout=1).status_code == 200:
        return proc, url
    except httpx.HTTPError:
      time.sleep(0.1)
  proc.kill()
  raise SystemExit("the worker did not start")


def script(i: int, commands: int = 0, command_s: float = 0.0) -> tuple[TaskSpec, list[str]]:
  name, _, reference, _, _ = TASKS[i % len(TASKS)]
  content = reference
  if i % 3 == 0:  # a wrong answer; every other one also crashes at import
    fn = reference.split("def ", 1)[1].split("(", 1)[0]
    content = reference + f"\n\ndef {fn}(*args):\n    return 'wrong'\n" + (
        "raise SystemExit(3)\n" if i % 2 else "")
  call = json.dumps({"name": "write_file", "arguments": {"path": "solution.py",
                                                         "content": content}})
  sleep = json.dumps({"name": "run_python", "arguments": {
      "code": f"import time; time.sleep({command_s})"}})
  return (TaskSpec(f"python_tests/{name}", "python_tests", {"task": name}),
          [f"<tool_call>{sleep}</tool_call>" * commands] * (commands > 0)
          + [f"<tool_call>{call}</tool_call>", "DONE"])


async def one(url: str, i: int, commands: int = 0, command_s: float = 0.0) -> dict:
  task, actions = script(i, commands, command_s)
  t0 = time.perf_counter()
  try:
    final = await play_episode(RemoteEnv(url, timeout_s=600), task,
                               lambda turn: actions[turn] if turn < len(actions) else None)
  except Exception as e:  # no verdict: the failure this benchmark looks for
    return {"error": f"{type(e).__name__}: {e}"[:200], "episode_s": time.perf_counter() - t0}
  return {"status": final["verdict"]["status"], "verify_s": final["verify_s"],
          "episode_s": time.perf_counter() - t0}


def loop_held_s(url: str) -> float | None:
  """The worker's `env_loop_held_seconds_total` (None: a worker without it)."""
  for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
    if line.startswith("env_loop_held_seconds_total "):
      return float(line.split()[1])
  return None


async def level(url: str, concurrency: int, commands: int = 0, command_s: float = 0.0) -> dict:
  held = loop_held_s(url)
  t0 = time.perf_counter()
  results = await asyncio.gather(*(one(url, i, commands, command_s)
                                   for i in range(concurrency)))
  wall = time.perf_counter() - t0
  await asyncio.sleep(0.5)  # (a hold under way at the end is counted once it ends)
  held_after = loop_held_s(url)
  verify = [r["verify_s"] for r in results if "verify_s" in r]
  episode = [r["episode_s"] for r in results]
  errors = [r["error"] for r in results if "error" in r]
  return {"concurrency": concurrency, "commands": commands, "command_s": command_s,
          "episodes": len(results),
          "verdicts": dict(collections.Counter(r["status"] for r in results if "status" in r)),
          "errors": len(errors), "first_error": errors[0] if errors else None,
          "episodes_per_s": round(len(results) / wall, 2),
          "verify_p50_s": round(float(np.percentile(verify, 50)), 3) if verify else None,
          "verify_p99_s": round(float(np.percentile(verify, 99)), 3) if verify else None,
          "episode_p50_s": round(float(np.percentile(episode, 50)), 3),
          "episode_p99_s": round(float(np.percentile(episode, 99)), 3),
          "wall_s": round(wall, 2),
          "loop_held_s": None if held is None else round(held_after - held, 2)}


def main() -> int:
  p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--concurrency", default="8,64,200", type=positive_ints)
  p.add_argument("--sandboxes", type=positive_int, default=8)
  p.add_argument("--server", help="use this running worker instead of starting one")
  p.add_argument("--commands", type=int, choices=range(0, 5), default=0, metavar="K",
                 help="a first turn of K run_python calls (0 to 4, a turn's cap)")
  p.add_argument("--command-s", type=float, default=1.0, metavar="S",
                 help="how long each of those sleeps (within the sandbox's 10 s wall limit)")
  p.add_argument("--worker-user", type=int, default=None,
                 help="start the worker as this uid (the benchmark runs as root)")
  p.add_argument("--filesystems", default=None,
                 help="comma-separated --workspace-filesystem choices (own, disk, auto) to "
                      "run the levels under in turn, each with a worker of its own")
  args, extra = p.parse_known_args()
  levels = args.concurrency
  filesystems = args.filesystems.split(",") if args.filesystems else [None]
  if args.server is not None and args.filesystems:
    p.error("--filesystems starts its own workers: not with --server")
  rows = []
  for fs in filesystems:
    proc = None
    url = args.server
    if url is None:
      proc, url = start_worker(args.sandboxes, extra + (
          ["--workspace-filesystem", fs] if fs else []), args.worker_user)
    try:
      for c in levels:
        row = asyncio.run(level(url, c, args.commands, args.command_s))
        if fs:
          row = {"filesystem": fs, **row}
        rows.append(row)
        print(json.dumps(row), flush=True)
    finally:
      if proc is not None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
  if {"own", "disk"} <= set(filesystems):
    rate = {(r["filesystem"], r["concurrency"]): r["episodes_per_s"] for r in rows}
    print(json.dumps({"own_over_disk": {c: round(rate["own", c] / rate["disk", c], 3)
                                        for c in levels}}), flush=True)
  print(f"\n{'filesystem':>10} {'concurrency':>11} {'episodes/s':>10} {'verify p50':>10} "
        f"{'verify p99':>10} {'loop held s':>11} {'errors':>6}  verdicts")
  for r in rows:
    print(f"{r.get('filesystem') or '-':>10} {r['concurrency']:>11} {r['episodes_per_s']:>10} "
          f"{r['verify_p50_s']!s:>10} {r['verify_p99_s']!s:>10} {r['loop_held_s']!s:>11} "
          f"{r['errors']:>6}  {r['verdicts']}")
  return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())

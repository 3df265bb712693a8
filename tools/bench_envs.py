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

  python tools/bench_envs.py --concurrency 8,64,200 --sandboxes 8
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


def start_worker(sandboxes: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  parent = tempfile.mkdtemp(prefix="jaxagent-bench-")
  os.chmod(parent, 0o711)
  proc = subprocess.Popen([sys.executable, "-m", "envs.server", "--port", str(port),
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


def script(i: int) -> tuple[TaskSpec, list[str]]:
  name, _, reference, _, _ = TASKS[i % len(TASKS)]
  content = reference
  if i % 3 == 0:  # a wrong answer; every other one also crashes at import
    fn = reference.split("def ", 1)[1].split("(", 1)[0]
    content = reference + f"\n\ndef {fn}(*args):\n    return 'wrong'\n" + (
        "raise SystemExit(3)\n" if i % 2 else "")
  call = json.dumps({"name": "write_file", "arguments": {"path": "solution.py",
                                                         "content": content}})
  return (TaskSpec(f"python_tests/{name}", "python_tests", {"task": name}),
          [f"<tool_call>{call}</tool_call>", "DONE"])


async def one(url: str, i: int) -> dict:
  task, actions = script(i)
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


async def level(url: str, concurrency: int) -> dict:
  held = loop_held_s(url)
  t0 = time.perf_counter()
  results = await asyncio.gather(*(one(url, i) for i in range(concurrency)))
  wall = time.perf_counter() - t0
  await asyncio.sleep(0.5)  # (a hold under way at the end is counted once it ends)
  held_after = loop_held_s(url)
  verify = [r["verify_s"] for r in results if "verify_s" in r]
  episode = [r["episode_s"] for r in results]
  errors = [r["error"] for r in results if "error" in r]
  return {"concurrency": concurrency, "episodes": len(results),
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
  args, extra = p.parse_known_args()
  levels = args.concurrency
  proc = None
  url = args.server
  if url is None:
    proc, url = start_worker(args.sandboxes, extra)
  rows = []
  try:
    for c in levels:
      row = asyncio.run(level(url, c))
      rows.append(row)
      print(json.dumps(row), flush=True)
  finally:
    if proc is not None:
      proc.send_signal(signal.SIGTERM)
      proc.wait(timeout=60)
  print(f"\n{'concurrency':>11} {'episodes/s':>10} {'verify p50':>10} {'verify p99':>10} "
        f"{'loop held s':>11} {'errors':>6}  verdicts")
  for r in rows:
    print(f"{r['concurrency']:>11} {r['episodes_per_s']:>10} {r['verify_p50_s']!s:>10} "
          f"{r['verify_p99_s']!s:>10} {r['loop_held_s']!s:>11} {r['errors']:>6}  "
          f"{r['verdicts']}")
  return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())

"""How long a killed command takes to exit past its wall limit, measured in one run as
the sandbox tore it down before (the baseline: its PID namespace's init killed, the rest
left to its exit, the CPU quota held), with every process killed at once but the quota
held, and now (every process killed at once, then the quota lifted: `Sandbox._fast_exit`).

  python tools/bench_teardown.py [--json] [--wall-s 10] [--cpus 1]

The command is the red team's slow teardown: one process splits its memory into ~64k
mappings and forks into 64 processes, then sleeps until the wall limit kills it. Every
fork copies each mapping, so the kernel's teardown of the 64 address spaces is long,
and it is charged to the sandbox's CPU cgroup. Needs root and a writable CPU cgroup.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Splits a touched anonymous mapping into ~2 x 12k mappings and an untouched one into
# ~2 x 20k more (max_map_count is 65530), then forks 6 times (64 processes; each fork
# copies every mapping, its page tables and anon_vma chains), and sleeps. Needs no
# privileges; the sandbox's memory cgroup (1 GiB) is not reached by it.
SLOW_TEARDOWN = r"""
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
N1, N2 = 12000, 20000
touched = libc.mmap(None, N1 * 8192, 3, 0x22, -1, 0)
libc.memset(touched, 1, N1 * 8192)
for i in range(N1):
  libc.mprotect(touched + i * 8192, 4096, 1)
untouched = libc.mmap(None, N2 * 8192, 3, 0x22, -1, 0)
for i in range(N2):
  libc.mprotect(untouched + i * 8192, 4096, 1)
for _ in range(6):
  try:
    os.fork()
  except OSError:
    pass
print("forked", flush=True)
while True:
  time.sleep(1)
"""


MODES = ("now", "killed_held", "before")


async def one(mode: str, wall_s: float, cpus: float) -> dict:
  from envs.isolation import Limits
  from envs.pool import SandboxPool
  from envs.sandbox import Sandbox

  async def nothing(self):
    return None

  pool = SandboxPool(1, limits=Limits(wall_s=wall_s, cpus=cpus))
  kept = Sandbox._unthrottle, Sandbox._fast_exit
  if mode != "now":  # (the quota held through every teardown)
    Sandbox._unthrottle = lambda self: None
  if mode == "before":  # (nor the processes killed at once)
    Sandbox._fast_exit = nothing
  try:
    async with pool.acquire() as sb:
      if sb._cpu_cgroup is None:
        return {"bench": "teardown", "mode": mode, "skipped": "no writable CPU cgroup"}
      t0 = time.perf_counter()
      r = await sb.run_python(SLOW_TEARDOWN)
      took = time.perf_counter() - t0
      return {"bench": "teardown", "mode": mode, "cpus": cpus, "wall_limit_s": wall_s,
              "took_s": round(took, 2), "past_wall_s": round(took - wall_s, 2),
              "timed_out": r.timed_out, "forked": "forked" in r.stdout,
              "oom_kills": r.oom_kills, "error": r.error}
  finally:
    Sandbox._unthrottle, Sandbox._fast_exit = kept
    pool.close()


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--json", action="store_true", help="JSON lines only")
  p.add_argument("--wall-s", type=float, default=10.0,
                 help="the command's wall limit (python_tests' own; the payload needs ~5 s)")
  p.add_argument("--cpus", type=float, default=1.0, help="the sandbox's CPU quota")
  args = p.parse_args()
  if os.geteuid() != 0:
    print(json.dumps({"bench": "teardown", "skipped": "needs root (a CPU cgroup)"}))
    return
  rows = [asyncio.run(one(m, args.wall_s, args.cpus)) for m in MODES]
  for row in rows:
    print(json.dumps(row), flush=True)
  if all("past_wall_s" in r for r in rows):
    now = max(rows[0]["past_wall_s"], 1e-3)
    ratios = {f"{r['mode']}_over_now": round(r["past_wall_s"] / now, 1) for r in rows[1:]}
    print(json.dumps({"bench": "teardown", **ratios}))
    if not args.json:
      print(f"\n{'mode':12} {'took s':>8} {'past wall s':>12} {'OOM kills':>10}")
      for r in rows:
        print(f"{r['mode']:12} {r['took_s']:8.2f} {r['past_wall_s']:12.2f} "
              f"{r['oom_kills']:10d}")
      print("  ".join(f"{k}: {v}x" for k, v in ratios.items()) + " (time past the wall limit)")


if __name__ == "__main__":
  main()

"""A sandbox's memory and CPU cgroups: made, bounded, joined, counted and removed.

Each sandbox gets a memory cgroup (all its processes' memory together, with the kernel's
memory they hold) and a CPU cgroup (its share of the host's cores), under the host's
cgroup root as root, or under cgroups delegated to a worker that is not root
(`check_delegated_cgroups`), cgroup v1 or v2 alike. A command joins them by a prefix
(`join_cgroups`). Their counters tell a sandbox's own OOM kills from the host's
(`oom_attribution`); `available_memory_bytes` is what the host and the cgroups above
this worker leave free. What a killed worker left is removed at the next start
(`remove_stale_cgroups`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import subprocess
import time
from typing import Optional, Sequence

from envs.isolation import warn_once

log = logging.getLogger(__name__)


_CGROUP_ROOT = "/sys/fs/cgroup"


_CPU_PERIOD_US = 100_000


def _cgroup(name: str, controller: str, v1_knobs: dict, v2_knobs: dict,
            parents: Sequence[str] = ()) -> Optional[str]:
  """A cgroup `name` of `controller` for a sandbox's processes with `knobs` written, or
  None where the host cannot make one. Under a cgroup delegated to this worker (`parents`,
  the operator's: a v1 hierarchy of the controller, or v2 with it in the subtree) even
  when it is not root; else, as root, below the hierarchy's root (v1's of that
  controller, or v2's with it enabled). A delegated one that fails raises OSError: its
  bound was asked for."""
  delegated = [(os.path.join(parent, name), knobs) for parent in parents
               for knobs in (_delegates(parent, controller, v1_knobs, v2_knobs),) if knobs]
  candidates = list(delegated)
  if not parents and os.geteuid() == 0:
    if os.path.isdir(os.path.join(_CGROUP_ROOT, controller)):
      candidates.append((os.path.join(_CGROUP_ROOT, controller, name), v1_knobs))
    try:
      with open(os.path.join(_CGROUP_ROOT, "cgroup.subtree_control")) as f:
        if controller in f.read().split():
          candidates.append((os.path.join(_CGROUP_ROOT, name), v2_knobs))
    except OSError:
      pass
  failed = None
  for path, knobs in candidates:
    existed = os.path.isdir(path)  # (v2: the memory cgroup's, which must stay)
    try:
      os.makedirs(path, exist_ok=True)
      for knob, value in knobs.items():
        with open(os.path.join(path, knob), "w") as f:
          f.write(str(value))
      return path
    except OSError as e:
      failed = failed or OSError(e.errno, f"cannot make the sandbox's {controller} cgroup "
                                          f"{path}: {e.strerror}")
      if not existed:
        with contextlib.suppress(OSError):
          os.rmdir(path)
  if delegated and failed is not None:
    raise failed
  return None


def _delegates(parent: str, controller: str, v1_knobs: dict, v2_knobs: dict) -> dict:
  """The knobs to write below `parent` for `controller` (v1's where `parent` is in that
  controller's hierarchy, v2's where the controller is enabled in its subtree); {}:
  neither."""
  if os.path.exists(os.path.join(parent, next(iter(v1_knobs)))):
    return v1_knobs
  try:
    with open(os.path.join(parent, "cgroup.subtree_control")) as f:
      return v2_knobs if controller in f.read().split() else {}
  except OSError:
    return {}


def check_delegated_cgroups(parents: Sequence[str]) -> list[str]:
  """The controllers (memory, cpu) the cgroups at `parents` give sandboxes; raises
  ValueError naming what is wrong: not a cgroup this worker may write, or neither
  controller. A probe cgroup is made and removed below each."""
  found = []
  for parent in parents:
    if not os.path.isdir(parent):
      raise ValueError(f"cgroup {parent}: not a directory (a cgroup delegated to this "
                       "worker, as /sys/fs/cgroup/memory/<dir> or a v2 <dir> with memory "
                       "in its cgroup.subtree_control)")
    controllers = [c for c in ("memory", "cpu") if _delegates(parent, c, *_knobs(c, 1))]
    if not controllers:
      raise ValueError(f"cgroup {parent}: neither the memory nor the cpu controller is "
                       "there (v1: the controller's hierarchy; v2: enabled in its "
                       "cgroup.subtree_control)")
    # A probe does what a sandbox's cgroups need: made with their bounds (the defaults'),
    # a process moved into them, removed.
    name = f"jaxagent-probe-{os.getpid()}"
    made: list[str] = []
    try:
      try:
        for path in (memory_cgroup(name, 1 << 30, [parent]), cpu_cgroup(name, 1.0, [parent])):
          if path is not None and path not in made:  # (v2: one for both)
            made.append(path)
        moved = subprocess.run([*join_cgroups(made), "true"], capture_output=True,
                               text=True, timeout=30)
        if moved.returncode != 0:
          raise OSError(errno.EACCES, "cannot move a process into a cgroup in it: " + (
              moved.stderr.strip().rpartition(": ")[2] or f"exit {moved.returncode}"))
      finally:
        for path in made:  # (the moved process is reaped: its cgroup frees at once, or nearly)
          if not remove_cgroup(path, wait_s=0.5):
            raise OSError(errno.EBUSY, f"cannot remove the probe cgroup {path}")
    except (OSError, subprocess.SubprocessError) as e:
      raise ValueError(f"cgroup {parent}: this worker (uid {os.geteuid()}) "
                       f"{getattr(e, 'strerror', None) or e} (delegate it to the worker's "
                       "user: chown it; on v2 its cgroup.procs and cgroup.subtree_control "
                       "too, and the worker's own cgroup and this one need a common "
                       "ancestor whose cgroup.procs the worker may write)") from None
    found += controllers
  return sorted(set(found))


def memory_cgroup(name: str, limit: int, parents: Sequence[str] = (),
                  socket_bytes: int = 0) -> Optional[str]:
  """Holds a sandbox's processes to `limit` bytes together (None: cannot), and on cgroup
  v1 their TCP and UDP buffers to `socket_bytes` (`Limits.socket_bytes`; 0: not set). That
  bound is a hardening the cgroup works without: where the kernel refuses it (built
  without it, or a v1 file it no longer has) it is logged once, not raised."""
  path = _cgroup(name, "memory", *_knobs("memory", limit), parents=parents)
  tcp = path and os.path.join(path, "memory.kmem.tcp.limit_in_bytes")
  if socket_bytes > 0 and tcp and os.path.exists(tcp):
    try:
      with open(tcp, "w") as f:
        f.write(str(socket_bytes))
    except OSError as e:
      warn_once("cannot bound a sandbox's socket buffers (memory.kmem.tcp.limit_in_bytes: "
                 f"{e.strerror}): its TCP and UDP buffers count against the host's tcp_mem "
                 "/ udp_mem only")
  return path


def cgroup_counter(path: str, key: Optional[str]) -> int:
  """The number a cgroup file holds (`key`: on its line `key N`)."""
  with open(path) as f:
    if key is None:
      return int(f.read())
    for line in f:
      name, _, n = line.partition(" ")
      if name == key:
        return int(n)
  raise KeyError(key)


def oom_attribution(before: tuple[int, int], after: tuple[int, int], *,
                    host_kills_are_infra: bool) -> tuple[int, int]:
  """(the command's own OOM kills, the host's) from `Sandbox.oom_counts` around it.

  Kills while the sandbox's cgroup reached its limit are its own (the solution filled
  it). Kills without that are the host's OOM killer's: the infrastructure's where
  `host_kills_are_infra` (`SandboxPool.memory_fits`: the operator says the host's memory
  is the pool's, and its limits fit it); elsewhere a sandbox filling its own share could
  have caused them, and calling them infrastructure would let a failing solution buy a
  re-roll, so they count as its own."""
  limit_hits, kills = after[0] - before[0], after[1] - before[1]
  if kills <= 0:
    return 0, 0
  if limit_hits > 0 or not host_kills_are_infra:
    return kills, 0
  return 0, kills


def available_memory_bytes() -> int:
  """Memory free for this process and its sandboxes: /proc/meminfo's MemAvailable, less
  where a memory cgroup above them leaves less: the hierarchy's root as this process
  sees it (a container's own, under a cgroup namespace or Docker's v1 mount) and every
  cgroup on this process's path (0: cannot tell)."""
  free = []
  with contextlib.suppress(OSError, ValueError, KeyError):
    with open("/proc/meminfo") as f:
      info = {k: v.split() for k, _, v in (line.partition(":") for line in f)}
    free.append(int(info["MemAvailable"][0]) << 10)
  paths = {"v2": [""], "v1": [""]}
  with contextlib.suppress(OSError):
    with open("/proc/self/cgroup") as f:
      for line in f:
        _, controllers, path = line.rstrip("\n").split(":", 2)
        version = "v2" if controllers == "" else "v1" if "memory" in controllers.split(
            ",") else None
        parts = [p for p in path.split("/") if p]
        if version:
          paths[version] += ["/".join(parts[:i + 1]) for i in range(len(parts))]
  for version, (base, limit, usage) in (
      ("v2", (_CGROUP_ROOT, "memory.max", "memory.current")),
      ("v1", (os.path.join(_CGROUP_ROOT, "memory"), "memory.limit_in_bytes",
              "memory.usage_in_bytes"))):
    for path in paths[version]:
      with contextlib.suppress(OSError, ValueError):  # ("max": no limit; not there)
        where = os.path.join(base, path)
        free.append(cgroup_counter(os.path.join(where, limit), None)
                    - cgroup_counter(os.path.join(where, usage), None))
  return max(0, min(free)) if free else 0


def usable_cpus() -> float:
  """The CPUs this process may use: those it may run on, bounded by the CPU quota of its
  own cgroup and their parents' (a container's limit), v1 or v2."""
  try:
    cpus = float(len(os.sched_getaffinity(0)))
  except (AttributeError, OSError):
    cpus = float(os.cpu_count() or 1)
  try:
    with open("/proc/self/cgroup") as f:
      lines = f.read().splitlines()
  except OSError:
    return cpus
  for line in lines:
    _, controllers, path = line.split(":", 2)
    if controllers and "cpu" not in controllers.split(","):
      continue
    base = os.path.join(_CGROUP_ROOT, controllers)  # (v2's line names none)
    if controllers and not os.path.isdir(base):
      base = os.path.join(_CGROUP_ROOT, "cpu")
    while True:  # (the nearest bound up the tree and beyond: the smallest)
      where = os.path.join(base, path.lstrip("/"))
      with contextlib.suppress(OSError, ValueError, IndexError):
        if controllers:
          with open(os.path.join(where, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
          with open(os.path.join(where, "cpu.cfs_period_us")) as f:
            period = int(f.read())
        else:
          with open(os.path.join(where, "cpu.max")) as f:
            quota_text, period_text = f.read().split()
          quota = -1 if quota_text == "max" else int(quota_text)
          period = int(period_text)
        if quota > 0 and period > 0:
          cpus = min(cpus, quota / period)
      if path in ("", "/"):
        break
      path = os.path.dirname(path.rstrip("/"))
  return max(cpus, 0.01)


def starved_s(path: str, cpus: float, elapsed_s: float) -> Optional[float]:
  """How long the processes of the CPU cgroup at `path` were kept from the `cpus` CPUs
  they are owed over `elapsed_s`: their tasks' waits on a run queue (schedstat), at most
  what they fell short of `cpus x elapsed_s` in CPU time (stat). A sleeper waits on no run
  queue, and processes at their own quota had what they are owed: neither is starved.
  None where they cannot be read (none left)."""
  tick = os.sysconf("SC_CLK_TCK")
  used = waited = 0.0
  try:
    with open(os.path.join(path, "cgroup.procs")) as f:
      pids = [int(p) for p in f.read().split()]
  except (OSError, ValueError):
    return None
  if not pids:
    return None
  for pid in pids:
    with contextlib.suppress(OSError, ValueError, IndexError):
      with open(f"/proc/{pid}/stat") as f:  # (past the name, which may hold spaces)
        fields = f.read().rsplit(")", 1)[1].split()
      used += sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
      for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError, ValueError, IndexError):
          with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            waited += int(f.read().split()[1]) / 1e9
  return max(0.0, min(waited, cpus * elapsed_s - used))


def cpu_cgroup(name: str, cpus: float, parents: Sequence[str] = ()) -> Optional[str]:
  """Holds a sandbox's processes to `cpus` CPUs' time together (None: cannot, or `cpus`
  0)."""
  if cpus <= 0:
    return None
  return _cgroup(name, "cpu", *_knobs("cpu", cpus), parents=parents)


def _knobs(controller: str, value) -> tuple[dict, dict]:
  """(v1's, v2's) files and values that set `controller`'s bound to `value`."""
  if controller == "memory":
    return {"memory.limit_in_bytes": value}, {"memory.max": value}
  quota = _quota_us(value)
  return ({"cpu.cfs_period_us": _CPU_PERIOD_US, "cpu.cfs_quota_us": quota},
          {"cpu.max": f"{quota} {_CPU_PERIOD_US}"})


def _quota_us(cpus: float) -> int:
  """A period's CPU time for `cpus` CPUs (at least the kernel's 1 ms)."""
  return max(1000, int(cpus * _CPU_PERIOD_US))


def set_cpu_quota(path: str, cpus: float) -> None:
  """Sets the quota of the CPU cgroup at `path` (from `cpu_cgroup`) to `cpus` CPUs; 0
  lifts it. Raises OSError where the cgroup is gone."""
  quota = _quota_us(cpus) if cpus > 0 else None
  if os.path.exists(os.path.join(path, "cpu.max")):  # v2
    knob, value = "cpu.max", f"{quota or 'max'} {_CPU_PERIOD_US}"
  else:
    knob, value = "cpu.cfs_quota_us", quota or -1
  with open(os.path.join(path, knob), "w") as f:
    f.write(str(value))


def join_cgroups(paths: Sequence[Optional[str]]) -> list[str]:
  """A command prefix that moves itself into the cgroups at `paths` (None: none), then
  execs the rest (its descendants stay there); nothing without one."""
  paths = list(dict.fromkeys(p for p in paths if p is not None))  # (v2: one for both)
  if not paths:
    return []
  joins = " && ".join(f'echo $$ > "${i + 1}/cgroup.procs"' for i in range(len(paths)))
  return ["/bin/sh", "-c", f'{joins} && shift {len(paths)} && exec "$@"', "sh", *paths]


def remove_cgroup(path: str, wait_s: float = 10.0) -> bool:
  """Removes a sandbox's cgroup once its processes are gone, killing any left (a
  timed-out command's, still exiting in its PID namespace after bwrap was killed: a
  worker that is not root has no uid to kill them by). A single rmdir left both cgroups
  of such a command behind, 3 times in 3 (red team), and v1 allows 65,535 memory
  cgroups. False (and a warning) where it is still there after `wait_s`."""
  deadline = time.monotonic() + wait_s
  while True:
    try:
      os.rmdir(path)
      return True
    except FileNotFoundError:
      return True
    except OSError as e:
      if e.errno != errno.EBUSY or time.monotonic() > deadline:
        log.warning("could not remove the sandbox cgroup %s: %s", path, e.strerror)
        return False
    with contextlib.suppress(OSError, ValueError):
      with open(os.path.join(path, "cgroup.procs")) as f:
        for pid in f.read().split():
          with contextlib.suppress(OSError):
            os.kill(int(pid), 9)
    time.sleep(0.05)


_SANDBOX_CGROUP = re.compile(r"jaxagent-(?:probe-)?(\d+)(?:-.*)?")


def remove_stale_cgroups(parents: Sequence[str]) -> list[str]:
  """Removes the cgroups that a worker no longer running left below the delegated cgroups
  `parents` (`jaxagent-<its pid>-<workspace>`, or its probe's: it was killed before it
  released its sandboxes), killing what still runs in them; returns those removed. The
  pid is looked for in this process's PID namespace: workers that share a delegated
  cgroup must share one too (`launch local`'s do), or one would take another's live
  sandboxes for stale."""
  removed = []
  for parent in parents:
    with contextlib.suppress(OSError):
      for name in sorted(os.listdir(parent)):
        match = _SANDBOX_CGROUP.fullmatch(name)
        path = os.path.join(parent, name)
        if match is None or int(match[1]) == os.getpid() or not os.path.isdir(path):
          continue
        try:
          os.kill(int(match[1]), 0)
          continue  # (alive: its own, or another user's)
        except PermissionError:
          continue
        except ProcessLookupError:
          pass
        if remove_cgroup(path):
          removed.append(path)
  if removed:
    log.info("removed %d cgroups that workers no longer running left: %s", len(removed),
             ", ".join(removed[:4]) + (" ..." if len(removed) > 4 else ""))
  return removed

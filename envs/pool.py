"""A worker's workspaces and the cap on its commands running at once (`SandboxPool`).

Each episode acquires a fresh `envs.sandbox.Sandbox` (a workspace of its own, with a uid
of its own as root) and grading takes another; `size` commands run at once over all of
them. The pool decides once what its workspaces are on (`envs.sandbox.Sandbox`'s
`own_filesystem`), prepares the host for them (delegated cgroups, the process limit of a
non-root worker, a root directory that sandbox uids may pass through but not list),
removes what crashed workers left behind, and says whether its limits fit the host's
memory (`memory_bound`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import re
import subprocess
import tempfile
import time
import uuid
from typing import Callable, Optional, Sequence

from envs import hostfs, waits
from envs.cgroups import (available_memory_bytes, check_delegated_cgroups, remove_stale_cgroups,
                          usable_cpus)
from envs.isolation import (ISOLATIONS, IsolationUnavailable, Limits, detect_isolation,
                            nproc_room, owner_tag)
from envs.sandbox import FILESYSTEMS, Sandbox, workspace_filesystem
from jaxagent.errors import InfraError

log = logging.getLogger(__name__)


# A pool's workspace: `<the worker's pid>-<12 hex digits>` (`SandboxPool.create`).
_WORKSPACE_NAME = re.compile(r"(\d+)-[0-9a-f]{12}")


# What a worker leaves in the temporary directory, named by its owner tag (`<pid>-<8 hex
# digits>`, `isolation.owner_tag`): its pool's default root, its sandboxes' logs
# (commands' output and /tmp), its empty file to mount; and its lock, held while it lives.
_LEFT = re.compile(r"jaxagent-(?:sandboxes|logs|sandbox-empty)-(\d+)-([0-9a-f]{8})-.+")
_OWNER_LOCK = re.compile(r"jaxagent-owner-(\d+)-([0-9a-f]{8})\.lock")


def _running(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # (running, as another user)
    pass
  return True


def _owner_alive(tmp: str, pid: str, token: str) -> bool:
  """Whether the process tagged `<pid>-<token>` lives: its lock held, in any PID
  namespace; without a lock file (it ended cleanly, or never made one), its pid running
  here."""
  try:
    fd = os.open(os.path.join(tmp, f"jaxagent-owner-{pid}-{token}.lock"),
                 os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
  except FileNotFoundError:
    return _running(int(pid))
  try:
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    return False
  except BlockingIOError:
    return True
  finally:
    os.close(fd)


def _sweep(folder: str, patterns: Sequence[re.Pattern], what: str, alive: Callable,
           remove: Callable) -> list[str]:
  """Calls `remove(entry)` on each entry of `folder` that one of `patterns` matches
  (in their order) and whose owner is not `alive(match)`, and says how many went
  (those `remove` says it removed)."""
  gone = []
  entries = list(os.scandir(folder))
  for pattern in patterns:
    for entry in entries:
      match = pattern.fullmatch(entry.name)
      if match is None or alive(match):
        continue  # (running: another worker's)
      with contextlib.suppress(OSError):  # (one that cannot be removed stops no start)
        if remove(entry):
          gone.append(entry.name)
  if gone:
    log.warning("sandbox: removed %d %s that workers no longer running left in %s",
                len(gone), what, folder)
  return gone


def remove_left_by_dead_workers(tmp: Optional[str] = None) -> list[str]:
  """Removes what workers of this user no longer running left in the temporary
  directory `tmp` (a pool's default root is a new folder at each start, so a crashed
  worker's workspaces, their tmpfs mounted as root, and its commands' logs were never
  swept: they stayed until the host's disk or memory was full; a red team): the folders
  of owners whose lock is free (in any PID namespace), then those locks."""
  tmp = tmp or tempfile.gettempdir()
  own = owner_tag()

  def alive(match) -> bool:
    return f"{match[1]}-{match[2]}" == own or _owner_alive(tmp, match[1], match[2])

  def remove(entry) -> bool:
    if entry.stat(follow_symlinks=False).st_uid != os.geteuid():
      return False
    if entry.name.endswith(".lock"):
      if not entry.is_file(follow_symlinks=False):
        return False
      os.unlink(entry.path)
      return True
    if not entry.is_dir(follow_symlinks=False):
      return False
    if entry.name.startswith("jaxagent-sandboxes-"):
      _remove_stale_workspaces(entry.path)  # (their quota tmpfs unmounted first)
    hostfs.remove_tree(entry.path)
    return not os.path.lexists(entry.path)

  return _sweep(tmp, (_LEFT, _OWNER_LOCK), "folders and locks", alive, remove)


def _remove_stale_workspaces(root: str) -> list[str]:
  """Removes the workspaces in `root` of workers no longer running (killed before they
  released them: on a `--workspace-root` that was there, kept at close, they piled up
  with each crash until its volume was full; red team 7), with their tmpfs as root; the
  other entries are left. Workers that share a root must share a PID namespace."""
  def alive(match) -> bool:
    return int(match[1]) == os.getpid() or _running(int(match[1]))

  def remove(entry) -> bool:
    if os.path.ismount(entry.path):  # (a root worker's quota tmpfs)
      subprocess.run(["umount", "-l", entry.path], capture_output=True)
    hostfs.remove_tree(entry.path)
    return not os.path.lexists(entry.path)

  return _sweep(root, (_WORKSPACE_NAME,), "workspaces", alive, remove)


class SandboxPool:
  """Workspaces on demand, and a cap on the commands running at once.

  `acquire()` gives every caller a fresh workspace of its own (an episode keeps one for
  its whole session; grading takes another), up to `max_workspaces`, and never waits
  for another caller's workspace. `size` bounds how many commands run at once, over
  all workspaces: a command waits for a slot only while others run, as long as the pool
  frees slots, and fails after `slot_timeout_s` in which none was freed (stuck). Unisolated execution (`rlimits`) is refused unless
  `allow_unisolated`. `own_filesystem`: as `Sandbox`'s, decided once for the pool
  (`filesystem` says which).
  """

  def __init__(self, size: int, *, root: Optional[str] = None, limits: Limits = Limits(),
               isolation: Optional[str] = None, max_workspaces: int = 1024,
               allow_unisolated: bool = False, slot_timeout_s: float = 60.0,
               host_oom_is_infra: bool = False, cgroup_parents: Sequence[str] = (),
               own_filesystem: Optional[bool] = None):
    if size < 1:
      raise ValueError(f"pool size must be >= 1, got {size}")
    # Cgroups delegated to this worker, each sandbox's memory and CPU cgroups made below
    # them: a worker that is not root has no other way to bound all of a sandbox's
    # processes together (and the kernel's memory they hold: pipes, sockets).
    self.cgroup_parents = tuple(os.path.abspath(p) for p in cgroup_parents)
    self.cgroup_controllers = check_delegated_cgroups(self.cgroup_parents)
    remove_stale_cgroups(self.cgroup_parents)
    self.isolation = isolation or detect_isolation()
    if self.isolation not in ISOLATIONS:
      raise ValueError(f"unknown isolation {self.isolation!r}; one of {ISOLATIONS}")
    if self.isolation == "rlimits" and not allow_unisolated:
      raise IsolationUnavailable(
          "this host cannot isolate untrusted code (no bubblewrap, and not root for mount "
          "namespaces): install bubblewrap (apt-get install bubblewrap), or allow "
          "unisolated execution explicitly (env.allow_unisolated=true, "
          "--allow-unisolated), which lets tool code read and write this host")
    self.size = size
    self.limits = limits
    # Commands at once that may use more CPUs together than this host has share them:
    # each runs slower than alone, and a correct solution slowed by its neighbours ran
    # past its wall limit, scored a timeout (red team 44: three sandboxes' tool calls
    # burning CPU on a 2-CPU host timed out a sibling's 12 s solution at 20 s). A
    # command's wall limit is stretched by the CPU time it was kept from
    # (`Sandbox._longer`); where it has no CPU cgroup to say, by the sharing its pool's
    # commands running made (`stretch`), up to this. Its CPU limit, its own time, is not.
    self.host_cpus = usable_cpus()
    self.cpus_each = limits.cpus or self.host_cpus  # (0: unbounded, every CPU)
    self.wall_stretch = max(1.0, size * self.cpus_each / self.host_cpus)
    if self.wall_stretch > 1.0:
      log.warning("sandbox pool: %d commands at once of %g CPUs each share this host's %g "
                  "CPUs: a command's wall limit is stretched by the CPU time it is kept from "
                  "(up to %.2fx by its pool's sharing where no CPU cgroup says), so that one "
                  "slowed by the others is not timed out for it "
                  "(env.sandboxes %d keeps them whole)", size, self.cpus_each, self.host_cpus,
                  self.wall_stretch, max(1, int(self.host_cpus // self.cpus_each)))
    self._busy_s = 0.0  # commands running, integrated over time (`stretch`)
    self._busy_at = time.monotonic()
    if os.geteuid() != 0 and self.isolation == "bwrap":
      # (the worker's threads, each workspace's holder, each command's processes)
      nproc_room(256 + max_workspaces + size * (limits.processes + 4))
    kind = workspace_filesystem(self.isolation, own_filesystem)
    self.own_filesystem = {"tmpfs": None, "held": True, "disk": False}[kind]
    self.filesystem = FILESYSTEMS[kind]
    self.max_workspaces = max_workspaces
    self.slot_timeout_s = slot_timeout_s
    # (removed at close where the pool made it; a folder that was there keeps what else
    # it holds: an operator's files there were removed with it, red team 6)
    self._made_root = root is None or not os.path.exists(root)
    if root is None:
      remove_left_by_dead_workers()
    self.root = os.path.abspath(root or tempfile.mkdtemp(
        prefix=f"jaxagent-sandboxes-{owner_tag()}-"))
    os.makedirs(self.root, exist_ok=True)
    if not self._made_root:
      _remove_stale_workspaces(self.root)
    os.chmod(self.root, 0o711)  # sandbox uids may pass through to their workspace, not list it
    probe = os.path.join(self.root, f".probe-{owner_tag()}")
    try:  # (a root no workspace can be made in, /proc, started a worker whose every
      # episode failed in the infrastructure: a red team)
      os.mkdir(probe, 0o700)
      os.rmdir(probe)
    except OSError as e:
      raise ValueError(f"the workspace root {self.root}: a workspace cannot be made there "
                       f"({e.strerror or e})") from None
    if os.geteuid() == 0 and self.isolation != "rlimits":
      hostfs.check_traversable(self.root)  # at start, not at each episode
    self.live: set[Sandbox] = set()
    # A kill by the host's OOM killer is the infrastructure's only where the operator says
    # the host's memory is this pool's (`host_oom_is_infra`: one worker on it, nothing
    # else large) and the pool's limits fit what was free at start (`oom_attribution`).
    self.host_oom_is_infra = host_oom_is_infra
    self.host_memory = available_memory_bytes()
    self._overcommit_said = False
    if host_oom_is_infra and self.memory_bound() > self.host_memory:
      self._say_overcommitted()
    self._semaphores: dict = {}  # one per event loop (a test may run several in turn)
    self.running = 0
    self.peak_running = 0
    self.waits = 0
    self.last_freed = time.monotonic()  # when a command last gave its slot back

  def _semaphore(self) -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    sem = self._semaphores.get(loop)
    if sem is None:
      self._semaphores = {loop: asyncio.Semaphore(self.size)}
      sem = self._semaphores[loop]
    return sem

  @contextlib.asynccontextmanager
  async def slot(self):
    """One of the `size` execution slots."""
    sem = self._semaphore()
    if sem.locked():
      self.waits += 1
    async with sem:
      self._count_busy()
      self.running += 1
      self.peak_running = max(self.peak_running, self.running)
      try:
        yield
      finally:
        self._count_busy()
        self.running -= 1
        self.last_freed = time.monotonic()

  def _count_busy(self) -> None:
    now = time.monotonic()
    self._busy_s += self.running * (now - self._busy_at)
    self._busy_at = now

  def stretch(self) -> Callable[[], float]:
    """For a command starting now: a function that gives its wall limit's stretch so far,
    the CPUs its pool's commands running meanwhile wanted over the host's (1 alone, up to
    `wall_stretch`)."""
    self._count_busy()
    t0, busy0 = self._busy_at, self._busy_s

    def so_far() -> float:
      self._count_busy()
      if self._busy_at <= t0:
        return 1.0
      running = (self._busy_s - busy0) / (self._busy_at - t0)
      return min(self.wall_stretch, max(1.0, running * self.cpus_each / self.host_cpus))

    return so_far

  def create(self) -> Sandbox:
    """A new workspace (blocking: a mount and a uid lease)."""
    if len(self.live) >= self.max_workspaces:
      raise InfraError("sandbox", f"sandbox pool is at its limit of {self.max_workspaces} "
                       "workspaces")
    sb = Sandbox(os.path.join(self.root, f"{os.getpid()}-{uuid.uuid4().hex[:12]}"),
                 limits=self.limits,
                 isolation=self.isolation, slots=self.slot, slot_timeout_s=self.slot_timeout_s,
                 progress=lambda: self.last_freed, memory_fits=self.memory_fits,
                 cgroup_parents=self.cgroup_parents, own_filesystem=self.own_filesystem,
                 stretch=self.stretch)
    self.live.add(sb)
    return sb

  def memory_bound(self) -> int:
    """The most memory the pool's sandboxes can hold now: each command running at once
    its memory cgroup's limit and its /tmp and /dev/shm (two tmpfs of `tmp_bytes`, filled
    only while it runs), each live workspace its files (its tmpfs quota)."""
    lim = self.limits
    return (self.size * (lim.group_memory_bytes + 2 * lim.tmp_bytes)
            + len(self.live) * lim.disk_bytes)

  def memory_fits(self) -> bool:
    """Whether a kill by the host's OOM killer is the infrastructure's: the operator said
    the host's memory is this pool's, and its sandboxes cannot fill it by themselves."""
    if not self.host_oom_is_infra:
      return False
    fits = self.memory_bound() <= self.host_memory
    if not fits and not self._overcommit_said:
      self._say_overcommitted()
    return fits

  def _say_overcommitted(self) -> None:
    self._overcommit_said = True
    lim = self.limits
    log.warning(
        "the sandbox pool's limits may overcommit this host's memory: %d commands at once x "
        "%d MiB (Limits.group_memory_bytes + 2 x tmp_bytes) + %d workspaces x %d MiB of "
        "files (disk_bytes) > %d MiB free at start. A command the host's OOM killer takes is then "
        "scored as its own failure (a solution could have caused it); lower the pool's "
        "size (--sandboxes) or the limits to make such kills infrastructure errors",
        self.size, (lim.group_memory_bytes + 2 * lim.tmp_bytes) >> 20, len(self.live),
        lim.disk_bytes >> 20, self.host_memory >> 20)

  def release(self, sb: Sandbox) -> None:
    self.live.discard(sb)
    sb.destroy()

  @contextlib.asynccontextmanager
  async def acquire(self):
    # The thread goes on when its caller is cancelled meanwhile (an episode dropped as
    # stale, a DELETE): its sandbox is awaited and released, not left live for good
    # (red team 22: the pool filled with them).
    made = asyncio.ensure_future(asyncio.to_thread(self.create))
    try:
      sb = await asyncio.shield(made)
    except asyncio.CancelledError:
      with contextlib.suppress(Exception):
        await waits.to_the_end(self._release_made(made))
      raise
    try:
      yield sb
    finally:
      await waits.to_the_end(asyncio.to_thread(self.release, sb))

  async def _release_made(self, made: asyncio.Future) -> None:
    sb = await made
    await asyncio.to_thread(self.release, sb)

  @property
  def in_use(self) -> int:
    return len(self.live)

  def close(self) -> None:
    for sb in list(self.live):
      self.release(sb)
    if self._made_root:
      hostfs.remove_tree(self.root)

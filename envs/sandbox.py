"""Isolated execution of untrusted commands in a per-episode workspace.

Each command runs as a subprocess with a wall-clock timeout and resource
limits (CPU seconds, address space, processes, file size, open files), a
scrubbed environment, and the strongest isolation the host has:

- `bwrap` (bubblewrap; `apt-get install bubblewrap`), as root or not: new user,
  network, PID, IPC and UTS namespaces; a read-only view of /usr and /etc only
  (no /root, /home, /run, project files or host /tmp), private /tmp and
  /dev/shm, the workspace the one writable place, mounted at /workspace; no
  capabilities. As root each workspace also runs as an unprivileged uid of its
  own.
- `mountns` (root without bubblewrap; util-linux `unshare`, `chroot`,
  `setpriv`): the same view built by hand: new mount, network, PID, IPC and UTS
  namespaces, a fresh root of read-only binds of /usr and /etc, private /proc,
  /dev, /tmp and /dev/shm, the workspace at /workspace, then a drop to the
  workspace's uid with no capabilities and `no_new_privs`.
- `rlimits` (neither): resource limits, timeouts and a scrubbed environment
  only. Untrusted code can read and write the host here, so a pool refuses
  this mode unless the caller allows unisolated execution explicitly.

In both namespace modes a seccomp filter (compiled by libseccomp, through
`pyseccomp`) makes the syscalls tool code never needs fail with EPERM
(`SECCOMP_DENIED`: ptrace, io_uring, bpf, keyctl, perf_event_open, mount, module
loading, memfds and SysV shared memory, ...; clone() into new namespaces; prlimit on
another process; fallocate but as posix_fallocate calls it or to punch a hole); bubblewrap
installs it itself, the mountns mode with a few lines of ctypes before it drops
privileges.

`detect_isolation()` says which one this host gets. Sandbox uids are unique on
the host: each is held by an advisory lock on a file in `UID_LOCK_DIR` for the
sandbox's lifetime, so two pools or two workers never share one. As root a
workspace is a tmpfs of `Limits.disk_bytes` (its disk quota); a worker that is not
root holds one in a user namespace of its own where the kernel allows it
(`HeldTmpfs`), and otherwise watches each command's use of the host's disk
(`Sandbox.over_disk`). The host never
`chown`s what the sandbox left in its workspace (it writes its own files
through a fresh inode it owns, then renames). In the namespace modes a command
is the init of its PID namespace (with `pid1=True`, exactly the given command),
so it outlives nothing it started and the processes it starts cannot signal it.

Every execution is recorded (`ExecResult`): command, exit code or signal,
duration, and stdout / stderr cut to a budget with their full size and sha256.

The isolation itself (the modes, the seccomp filter, limits and cgroups, uids) is
`envs.isolation`; this module runs commands in it and keeps their workspaces. The host's
side of a workspace's files is `envs.hostfs`, the disk watch `envs.diskwatch`, and a
worker's many workspaces `envs.pool.SandboxPool`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import math
import os
import select
import shutil
import socket
import signal
import stat
import subprocess
import tempfile
import threading
import time
import uuid
from typing import Callable, Optional, Sequence

from envs import diskwatch, hostfs, waits
from envs.cgroups import (cgroup_counter, cpu_cgroup, join_cgroups, memory_cgroup,
                          oom_attribution, remove_cgroup, set_cpu_quota, starved_s)
from envs.isolation import (ISOLATIONS, SETPRIV, SETUP_DONE, HeldTmpfs, IsolationUnavailable,
                            Limits, UidLease, confine, detect_isolation, held_tmpfs_refused,
                            nproc_inside, owner_tag, processes_of, scrubbed_env,
                            seccomp_program, seccomp_program_fd, setup_finished,
                            system_python, wrap)
from jaxagent.errors import InfraError

log = logging.getLogger(__name__)


_PAGE = 4096  # tmpfs (the quota) allocates whole pages


# A command's wall timer that fires this late found the event loop held (by another
# call's code): the command gets this long again to be seen ending before it is read as
# timed out (its exit may have come in time, unseen).
HELD_LOOP_S = 0.1
# The most a command's wall limit is stretched for the CPU time it was kept from (a host
# this starved is the operator's to mend).
MAX_STRETCH = 4.0


class ExitClock:
  """When a process ended, as a thread of its own saw it (waiting on the process's
  pidfd): the event loop that runs the command may see the exit late, held by another
  call's code or by the host's load. A command seen ending in the held loop's grace
  (`HELD_LOOP_S`) that ended past its wall limit is timed out, as it is when the loop is
  not held (it was read as its own exit: a command that stalled the host, or a slow
  solution on a loaded machine, could pass past its limit: a reviewer)."""

  def __init__(self, pid: int):
    self.at: Optional[float] = None  # (time.perf_counter's)
    self.done = threading.Event()
    try:
      fd = os.pidfd_open(pid)
    except (OSError, AttributeError):  # (reaped already, or no pidfds here: unknown)
      self.done.set()
      return
    threading.Thread(target=self._wait, args=(fd,), daemon=True,
                     name="jaxagent-exit-clock").start()

  def _wait(self, fd: int) -> None:
    try:
      look = select.poll()  # (not select(): a busy worker's descriptors pass 1024)
      look.register(fd, select.POLLIN)
      look.poll()  # (readable once the process has ended)
      self.at = time.perf_counter()
    except OSError:
      pass
    finally:
      os.close(fd)
      self.done.set()

  def ended_by(self, t: float, wait_s: float = 1.0) -> bool:
    """Whether the process ended by `t` (a perf_counter time); True when not known.
    Called once its end has been seen, so the thread's own look is due."""
    self.done.wait(wait_s)
    return self.at is None or self.at <= t


def _read_all(fd: int) -> bytes:
  """What a pipe whose writers are gone holds (never waiting for more)."""
  os.set_blocking(fd, False)
  chunks = []
  with contextlib.suppress(BlockingIOError):
    while chunk := os.read(fd, 1 << 16):
      chunks.append(chunk)
  return b"".join(chunks)


def _last_line(path: str, limit: int = 300) -> str:
  """The last line of the text file at `path` (its last `limit` characters at most)."""
  with contextlib.suppress(OSError), open(path, "rb") as f:
    f.seek(max(0, os.fstat(f.fileno()).st_size - 4 * limit))
    lines = f.read().decode(errors="replace").strip().splitlines()
    return lines[-1][-limit:] if lines else ""
  return ""


class WorkspaceTooLarge(ValueError):
  """A workspace's files hold more bytes than a snapshot (or a grading copy) may."""


@dataclasses.dataclass
class ExecResult:
  command: list[str]
  exit_code: Optional[int]  # None when killed by a signal
  signal: Optional[int]
  duration_s: float
  timed_out: bool  # the wall timeout, or the CPU limit (SIGXCPU)
  stdout: str
  stderr: str
  stdout_bytes: int
  stderr_bytes: int
  stdout_sha256: str
  stderr_sha256: str
  isolation: str
  error: Optional[str] = None  # the sandbox could not run the command (infrastructure)
  # Processes the kernel killed while it ran, its memory cgroup's limit reached (and
  # those the host's OOM killer took, unless they are the infrastructure's: an `error`;
  # see `oom_attribution`).
  oom_kills: int = 0
  # Without a quota of its own (a worker not run as root): why the workspace went past
  # its bounds on the host's disk while the command ran (it was stopped, and the
  # workspace emptied), else None. The command's doing, never the infrastructure's.
  disk_exceeded: Optional[str] = None

  @property
  def ok(self) -> bool:
    return self.error is None and not self.timed_out and self.exit_code == 0

  @property
  def truncated(self) -> bool:
    return len(self.stdout.encode()) < self.stdout_bytes or len(self.stderr.encode()) < (
        self.stderr_bytes)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)



def _all_ended(pidfds: Sequence[int], timeout: float) -> None:
  """Waits (at most `timeout` seconds) until the processes of `pidfds` have ended, and
  closes the descriptors."""
  deadline = time.monotonic() + timeout
  try:
    for fd in pidfds:
      look = select.poll()
      look.register(fd, select.POLLIN)  # (readable once it has ended)
      look.poll(max(0, int((deadline - time.monotonic()) * 1000)))
  finally:
    for fd in pidfds:
      os.close(fd)


def _children(pid: int) -> list[int]:
  try:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
      return [int(x) for x in f.read().split()]
  except FileNotFoundError:
    return []




# What a workspace's own files can make a host's read of them fail with (a mode that
# shuts the host out, a name too long for the host's path, a loop): those entries are
# left out. Any other failure (no descriptors left, no memory, an I/O error, the
# workspace itself gone) is the host's: grading what was left (nothing, where the
# workspace was gone) failed a sound answer as its ModuleNotFoundError (a red team).
_POLICY_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.ELOOP, errno.ENAMETOOLONG,
                            errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ENXIO})


def _unread(e: OSError, whole: bool = False) -> None:
  """Raises the infrastructure's error for a failed read of the workspace's files (of
  the workspace itself: `whole`), unless it is one the files themselves cause."""
  if whole or e.errno not in _POLICY_ERRNOS:
    raise InfraError("sandbox", f"reading the workspace's files: {e}") from e


class Sandbox:
  """A workspace directory and a way to run commands in it, isolated and limited.

  `uid`: as root in a namespace mode, the uid commands run as; None takes a host-unique
  one (`UidLease`). `own_filesystem`, for a worker that is not root under bubblewrap:
  the workspace is a tmpfs of `Limits.disk_bytes` held in a user namespace of the
  worker's (`HeldTmpfs`; True: or fail), or a directory on the host's disk that the disk
  watch bounds (False); None, the first where this host allows it (`held_tmpfs_works`).
  `slots`: an async context manager factory that bounds how many
  commands run at once (a pool's); a command waits for one as long as the pool frees
  slots (`progress`: when it last did), and fails after `slot_timeout_s` without one.
  """

  def __init__(self, workspace: str, *, uid: Optional[int] = None,
               limits: Limits = Limits(), isolation: Optional[str] = None,
               slots=None, slot_timeout_s: float = 60.0,
               progress: Optional[Callable[[], float]] = None,
               memory_fits: Callable[[], bool] = lambda: False,
               cgroup_parents: Sequence[str] = (),
               own_filesystem: Optional[bool] = None,
               stretch: Optional[Callable[[], Callable[[], float]]] = None):
    # Where the workspace is: `mountpoint` in the namespaces commands run in, and the
    # path the host reaches it by (the same, but through a held tmpfs's holder).
    self.mountpoint = self.host_path = os.path.abspath(workspace)
    self._root = ""  # (what `host_path` adds in front of `mountpoint`)
    self._memory_fits = memory_fits  # its pool's limits fit the host (`oom_attribution`)
    self.isolation = isolation or detect_isolation()
    if self.isolation not in ISOLATIONS:
      raise ValueError(f"unknown isolation {self.isolation!r}; one of {ISOLATIONS}")
    self.limits = limits
    self._stretch = stretch  # (its pool's: `SandboxPool.stretch`)
    self._slots = slots
    self.slot_timeout_s = slot_timeout_s
    self._progress = progress  # when a slot was last freed (time.monotonic)
    self._lease = None
    # Writes and the close take turns: a tool's write whose step was cancelled ran on
    # in its thread past the close, and made the workspace again on the host's disk,
    # out of any quota and of its pool's count (a red team).
    self._io = threading.Lock()
    self.closed = False
    self._logs: Optional[str] = None  # (commands' output; held: their /tmp mountpoints)
    self._mounted = False  # (a root worker's tmpfs)
    self._held: Optional[HeldTmpfs] = None
    self._cgroup: Optional[str] = None  # memory
    self._cpu_cgroup: Optional[str] = None
    self._unthrottled = False  # the CPU quota lifted for a teardown (`_unthrottle`)
    self.uid = None
    if os.geteuid() == 0 and self.isolation != "rlimits":
      if uid is None:
        self._lease = UidLease()
        uid = self._lease.uid
      self.uid = uid
    try:  # (a lease taken, then a failure here: its lock held for the worker's life)
      held = workspace_filesystem(self.isolation, own_filesystem) == "held"
      os.makedirs(self.host_path, mode=0o700, exist_ok=False)
    except BaseException:
      if self._lease is not None:
        self._lease.release()
      raise
    try:
      if self.uid is not None:
        hostfs.check_traversable(os.path.dirname(self.host_path))
        self._kill_uid()  # nothing of an earlier holder of this uid survives
        # The quota: a tmpfs of disk_bytes owned by the sandbox uid.
        subprocess.run(["mount", "-t", "tmpfs", "-o",
                        f"size={limits.disk_bytes},nr_inodes={limits.max_inodes},mode=0700,"
                        f"uid={self.uid},gid={self.uid},nosuid,nodev", "jaxagent-ws",
                        self.host_path],
                       check=True, capture_output=True)
        self._mounted = True
      elif held:
        self._logs = tempfile.mkdtemp(prefix=f"jaxagent-logs-{owner_tag()}-")  # (its
        # commands' /tmp too; its worker's tag: `pool.remove_left_by_dead_workers`)
        self._held = HeldTmpfs(self.mountpoint, limits.disk_bytes, limits.max_inodes,
                               scratch=self._logs, tmp_size=limits.tmp_bytes)
        self._root = self._held.root
        self.host_path = self._root + self.mountpoint
      if self.uid is not None or cgroup_parents:
        # (as root, below each hierarchy's root or the delegated cgroups; not root, only
        # below cgroups delegated to the worker: `SandboxPool`'s `cgroup_parents`)
        name = f"jaxagent-{self.uid}" if self.uid is not None else \
            f"jaxagent-{os.getpid()}-{os.path.basename(self.mountpoint)}"
        self._cgroup = memory_cgroup(name, limits.group_memory_bytes, cgroup_parents,
                                     limits.socket_bytes)
        self._cpu_cgroup = cpu_cgroup(name, limits.cpus, cgroup_parents)
      if self._logs is None:
        self._logs = tempfile.mkdtemp(prefix=f"jaxagent-logs-{owner_tag()}-")  # outside
        # the workspace
      if not self.has_quota:  # (for the disk watch)
        diskwatch.learn_maps_device(os.path.dirname(self.host_path))
        diskwatch.UNQUOTED.add(id(self))
    except BaseException:
      self._release()
      hostfs.remove_tree(self.mountpoint)  # (a pool's root kept no empty folder per failure)
      raise
    self.history: list[ExecResult] = []

  @property
  def has_quota(self) -> bool:
    """The workspace is a filesystem of its own, of `Limits.disk_bytes` (a tmpfs, mounted
    as root or held in a user namespace): a full one is its files' doing; without one
    it is the host's disk."""
    return self._mounted or self._held is not None

  # -- files (host side) -------------------------------------------------------------------

  @property
  def workdir(self) -> str:
    """The workspace as commands see it."""
    return "/workspace" if self.isolation in ("bwrap", "mountns") else self.host_path

  @property
  def python(self) -> str:
    """The interpreter inside the sandbox (the system Python: it is visible there)."""
    return system_python() or "python3"

  def _resolve(self, rel: str, follow_last: bool = True) -> str:
    """`rel` on the host, refused outside the workspace. `follow_last=False`: the name
    itself, even where the sandbox left a link there (the link is what gets replaced)."""
    joined = os.path.normpath(os.path.join(self.mountpoint, rel))
    path = (hostfs.realpath_in(self._root, joined) if follow_last else os.path.join(
        hostfs.realpath_in(self._root, os.path.dirname(joined)), os.path.basename(joined)))
    if not path.startswith(self.mountpoint + os.sep) or not os.path.basename(path):
      raise ValueError(f"path {rel!r} is outside the workspace")
    return self._root + path

  def write_file(self, rel: str, content: str | bytes) -> None:
    """Writes a file as the host. Commands are not running (they never outlive a run), so
    the path cannot change under us; the file is a new inode of the sandbox's, renamed
    into place: a link the sandbox left at that name is replaced, never followed."""
    data = content.encode() if isinstance(content, str) else bytes(content)
    if len(data) > self.limits.write_bytes:
      raise ValueError(f"{rel!r} is {len(data)} bytes; files are capped at "
                       f"{self.limits.write_bytes} bytes")
    try:
      with self._io, hostfs.named(rel):
        if self.closed:
          raise InfraError("sandbox", f"writing {rel!r}: the workspace is closed")
        self._write(self._resolve(rel, follow_last=False), data)
    except OSError as e:
      if e.errno in (errno.EIO, errno.EROFS) or (
          e.errno in (errno.ENOSPC, errno.EDQUOT) and not self.has_quota):
        # The host's failure, not the policy's (a workspace without a quota of its own
        # sits on the host's disk): told to the model as a tool's error, a correct answer
        # written to a full disk was graded a fail (red team 42; grading's copy already
        # said it so, red team 28).
        raise InfraError("sandbox", f"writing {rel!r} in the workspace: {e.strerror} "
                                    "(the host's disk)") from e
      raise

  def _write(self, path: str, data: bytes) -> None:
    parent = os.path.dirname(path)
    missing = []
    d = parent
    while not os.path.isdir(d):
      if not d.startswith(self.host_path + os.sep) and self.isolation != "rlimits":
        # (never made again: it is gone. Without namespaces the command may have removed
        # it, as the host's user: made again, as before, not the infrastructure's)
        raise InfraError("sandbox", f"the workspace {self.host_path} is gone")
      missing.append(d)
      d = os.path.dirname(d)
    for d in reversed(missing):
      os.mkdir(d, 0o700)
      if self.uid is not None:
        os.chown(d, self.uid, self.uid, follow_symlinks=False)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=".jaxagent-")
    try:
      with os.fdopen(fd, "wb") as f:
        if self.uid is not None:
          os.fchown(f.fileno(), self.uid, self.uid)
        os.fchmod(f.fileno(), 0o644)
        f.write(data)
      os.replace(tmp, path)
    except BaseException:
      with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
      raise

  def read_file(self, rel: str) -> bytes:
    """A regular file's bytes (anything else the command left there, a FIFO that would
    block the host for ever included, is refused: red team 6)."""
    with hostfs.named(rel):
      fd = os.open(self._resolve(rel), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW |
                   os.O_CLOEXEC)
      with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
          raise ValueError(f"{rel!r} is not a regular file")
        return f.read()

  def files(self, max_bytes: Optional[int] = None, max_files: int = 256,
            max_depth: int = 32) -> dict[str, bytes]:
    """A snapshot of the workspace's regular files (symlinks, special files and files over
    `max_bytes` skipped, by default over what `write_file` writes: a snapshot is written
    into a fresh workspace to be graded, where a file the episode's code made larger
    must not fail the grading as the infrastructure; at most `max_files`, directories at
    most `max_depth` deep).

    The walk is iterative (a policy's 1,000 nested directories must not exhaust the
    host's recursion limit). Files are counted by the memory pages their bytes take
    as read, so neither sparse files nor hard links (one inode, many names: each is
    copied) pass for small ones: past the workspace quota (which the files must fit
    in again to be graded), or past the quota's inodes (`Limits.max_inodes` entries
    walked, directories included), it raises `WorkspaceTooLarge`. Without a quota of its
    own it also counts what the workspace takes on the disk, unreadable files and ones
    too large to copy included, against `disk_bytes` (directories whose mode shuts their
    owner out are opened first). Entries the host cannot read (a name too long for the
    host's longer path, a mode that shuts the host out) and paths over `hostfs.MAX_PATH_CHARS`
    are left out, never an error."""
    budget = self.limits.disk_bytes
    max_bytes = self.limits.write_bytes if max_bytes is None else max_bytes
    if not self.has_quota:  # (what it takes on the host's disk, files too large to copy
      # or the host cannot read included, red team 28's reviewer: 184 MB in a directory
      # of mode 000 passed unseen, and stayed; walked by descriptors, below a path past
      # PATH_MAX too, red team 30)
      why = self.over_disk()
      if why is not None:
        raise WorkspaceTooLarge(f"the workspace takes {why}")
    if self._held is not None and not self._held.alive:
      raise InfraError("sandbox", f"the workspace's filesystem is gone: its holder (host "
                                  f"pid {self._held.pid}) ended, exit {self._held.exit_code}")
    out, total, seen = {}, 0, 0
    stack = [(self.host_path, 0)]
    while stack:
      root, depth = stack.pop()
      try:
        entries = sorted(hostfs.scandir_opened(root, self.uid is None), key=lambda e: e.name)
      except OSError as e:
        # (without namespaces the command runs in the workspace as the host's user, and
        # can remove or replace it: its doing, graded as no files, not a re-roll; a
        # reviewer, a red team)
        _unread(e, root == self.host_path and self.isolation != "rlimits")
        continue
      # Every entry walked counts, directories too: past the quota's inodes (a workspace
      # without its own filesystem, a worker not run as root, has none) the walk is
      # the policy's doing, not a grading that runs past its deadline and is re-rolled
      # as the infrastructure's (red team 28: 527k empty directories, 15 s a walk).
      seen += len(entries)
      if seen > self.limits.max_inodes:
        raise WorkspaceTooLarge(f"the workspace holds over {self.limits.max_inodes} "
                                "files and directories")
      subdirs = []
      for entry in entries:
        rel = os.path.relpath(entry.path, self.host_path)
        try:
          if entry.is_symlink() or len(rel) > hostfs.MAX_PATH_CHARS:
            continue
          if entry.is_dir(follow_symlinks=False):
            if depth + 1 < max_depth:
              subdirs.append((entry.path, depth + 1))
            continue
          if (not entry.is_file(follow_symlinks=False)
              or entry.stat(follow_symlinks=False).st_size > max_bytes):
            continue
          if len(out) >= max_files:
            return out
          with open(entry.path, "rb") as f:
            data = f.read(max_bytes)
        except OSError as e:
          _unread(e)
          continue
        total += -(-len(data) // _PAGE) * _PAGE
        if total > budget:
          raise WorkspaceTooLarge(f"the workspace's files take over {budget} bytes")
        out[rel] = data
      stack.extend(reversed(subdirs))  # depth first, in name order
    return out

  def wipe(self) -> None:
    """Empties the workspace (and kills anything left running as its uid)."""
    self._kill_uid()
    self._empty()
    self.history.clear()

  def _empty(self) -> None:
    hostfs.remove_tree(self.host_path, keep_root=True)

  def over_disk(self, pid: Optional[int] = None, open_up: bool = True,
                spare_init: bool = False, start: Optional[tuple[int, int]] = None
                ) -> Optional[str]:
    """Why the workspace is past its quota's bounds on the host's disk (more than
    `Limits.max_inodes` files and directories, more than `disk_bytes` taken, files that
    the processes of command `pid` hold open or mapped after unlinking them included,
    or more than `hostfs.MAX_DEPTH` directories deep; a process of it whose files the host may
    not read, but its trusted init with `spare_init`: `diskwatch.unlinked_bytes`), or None. The
    walk (by descriptors: `hostfs.walk`) stops once past them. For a workspace without a quota
    of its own, where nothing else bounds it. `open_up`: directories whose mode shuts
    their owner out are opened (not while a command runs: its files are its own until it
    ends). `start` (what the workspace took and the disk had free when the command
    started, `_taken` and statvfs): where a directory is shut to the look, or mapped
    files it cannot size are spared, a disk that lost more than the workspace shows,
    past what every workspace of this process may take (`diskwatch.shut_allowance`), is past the
    bounds too."""
    budget, shut, spared, on_disk = self.limits.disk_bytes, [], 0, 0
    try:
      if pid is not None:
        on_disk, spared = diskwatch.unlinked_bytes(
            diskwatch.process_tree(pid), os.stat(self.host_path).st_dev, self.limits.file_bytes,
            pid if spare_init else None, budget)
      taken, seen, deep = self._tally(open_up, shut, budget - on_disk)
      on_disk += taken
      if seen > self.limits.max_inodes:
        return f"over {self.limits.max_inodes} files and directories"
      if deep:
        return f"over {hostfs.MAX_DEPTH} directories deep"
    except diskwatch.Hidden as e:
      return str(e)
    except OSError:
      pass  # (the workspace itself gone: nothing of it on the disk)
    if on_disk > budget:
      return f"over {budget} bytes on disk"
    if (shut or spared) and start is not None:
      with contextlib.suppress(OSError):
        # (what the disk lost that the workspace does not show: its files freed at the
        # start count back, so that they cannot make room for what it hides)
        lost = start[1] - diskwatch.free_bytes(self.host_path) - (on_disk - start[0])
        if lost > (allowance := diskwatch.shut_allowance(budget)):
          what = (f"{spared} removed files mapped whose size it cannot read" if not shut else
                  "the workspace" if shut[0] == self.host_path else f"directory {shut[0]!r}")
          return (f"{what} hidden from the disk watch while the disk lost {lost} bytes more "
                  f"than the workspace shows (over {allowance})")
    return None

  def _tally(self, open_up: bool, shut: list, limit: float) -> tuple[int, int, bool]:
    """(bytes on disk, entries, too deep) of the workspace's files by a walk (`hostfs.walk`)
    that stops once past `limit` bytes, past `Limits.max_inodes` entries or `hostfs.MAX_DEPTH`
    directories deep; entries its mode shuts to this process are named in `shut` (a
    directory that opens while its entries cannot be read: 0600). A workspace gone
    midway counts what was seen."""
    taken = seen = 0
    try:
      for entry in hostfs.walk(self.host_path, open_up, shut=shut):
        seen += 1
        if seen > self.limits.max_inodes:
          break
        try:
          taken += entry.stat(follow_symlinks=False).st_blocks * 512
        except PermissionError:
          shut.append(entry.name)
        except OSError:
          pass
        if taken > limit:
          break
    except hostfs.TooDeep:
      return taken, seen, True
    except OSError:
      pass  # (the workspace itself gone: nothing more of it on the disk)
    return taken, seen, False

  def _taken(self) -> int:
    """What the workspace's files take on the disk as a running command's look sees them
    (no directory opened up)."""
    return self._tally(False, [], math.inf)[0]

  async def _watch_disk(self, proc, over: list, spare_init: bool) -> None:
    """Stops a running command whose workspace goes past its bounds on the host's disk
    (`over_disk`; no quota of its own: without the watch a command filled the host's
    disk until its time ran out, and every other sandbox's grading failed meanwhile).
    A look is due 0.1 s after the last, or ten times as long as it took, at most 1 s
    (two threads serve every sandbox's looks: under load they queue). A directory shut
    to its owner is not opened while the command runs (the look after it ends counts
    what it holds), but the disk's free space is watched meanwhile (`over_disk`'s
    `start`: a red team's command held 1 GiB so for its whole time)."""
    loop, pause = asyncio.get_running_loop(), 0.1

    def baseline() -> Optional[tuple[int, int]]:
      taken = self._taken()  # (first: files freed in between then count as hidden)
      with contextlib.suppress(OSError):
        return taken, diskwatch.free_bytes(self.host_path)
      return None

    start = await loop.run_in_executor(diskwatch.WATCH_THREADS, baseline)

    def look():
      t = time.perf_counter()
      return self.over_disk(proc.pid, False, spare_init, start), time.perf_counter() - t

    while True:
      await asyncio.sleep(pause)
      why, took = await loop.run_in_executor(diskwatch.WATCH_THREADS, look)
      pause = min(1.0, max(0.1, 10 * took))
      if why is not None:
        over.append(why)
        # (to its end: the command's own end cancels this watch, and a termination cut
        # there left the namespace's last processes writing as its workspace was emptied)
        await waits.to_the_end(self._terminate(proc))
        return

  def destroy(self) -> None:
    with self._io:  # (a write under way ends first; none begins after)
      if self.closed:  # (again: its uid may be another sandbox's by now)
        return
      self.closed = True
    try:
      self._kill_uid()
    finally:  # (a failed kill left the tmpfs, the cgroups and the uid's lease for good)
      try:
        self._release()  # unmounts the quota tmpfs first, so only the mountpoint is removed
      finally:
        hostfs.remove_tree(self.mountpoint)

  def _release(self) -> None:
    diskwatch.UNQUOTED.discard(id(self))
    if self._logs:
      shutil.rmtree(self._logs, ignore_errors=True)
      self._logs = None
    if self._mounted:
      subprocess.run(["umount", "-l", self.host_path], capture_output=True)
      self._mounted = False
    if self._held is not None:
      self._held.close()
      self._held = None
      self.host_path, self._root = self.mountpoint, ""
    for cgroup in {self._cgroup, self._cpu_cgroup} - {None}:
      remove_cgroup(cgroup)
    self._cgroup = self._cpu_cgroup = None
    if self._lease is not None:
      self._lease.release()
      self._lease = None

  def _kill_uid(self, timeout: float = 5.0) -> None:
    """Kills every process of the sandbox's uid (what a fork bomb or setsid left behind)
    and waits until they are gone, so the next command starts with a clean slate."""
    if self.uid is None:
      return
    deadline = time.time() + timeout
    while processes_of(self.uid):
      self._kill_all_of_uid()
      self._unthrottle()
      if time.time() > deadline:
        return
      time.sleep(0.02)

  def _kill_all_of_uid(self) -> None:
    # `kill -1` as the sandbox uid signals exactly the processes of that uid (a fork
    # under way either ends before the signal or is refused).
    subprocess.run([SETPRIV, f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups",
                    "--", "/bin/kill", "-KILL", "-1"], capture_output=True)

  async def _fast_exit(self) -> None:
    """A killed command's processes each sent SIGKILL now (a PID namespace's init has
    them signalled only as it exits, and that is the command itself under `pid1`), then
    the quota lifted for their exit (`_unthrottle`)."""
    if self.uid is not None:
      await asyncio.to_thread(self._kill_all_of_uid)
      self._unthrottle()

  def _unthrottle(self) -> None:
    """Lifts the CPU quota for the exit of processes already killed, until `_throttle`
    (which the next command's start makes sure of).

    The kernel's teardown of a killed process's address space is charged to its CPU
    cgroup: 64 processes each holding ~64k mappings, left to their PID namespace init's
    exit under a 1-CPU quota, took 35-56 s past the wall limit; each killed at once,
    4.5-6 s with the quota held and ~2.4 s with it lifted (`tools/bench_teardown.py`),
    the lifted teardown taking less of the host's CPU in all (4.2 CPU-s against 72.8).
    A command that stalled its own kill so made a wrong answer's call outlast the env
    worker's wall bound: a 504, an infrastructure error, re-rolled instead of scored
    (red team). Lifted only once every process of the uid has been sent SIGKILL: they
    run no code of their own."""
    if self._cpu_cgroup is not None and not self._unthrottled:
      with contextlib.suppress(OSError):
        set_cpu_quota(self._cpu_cgroup, 0)
        self._unthrottled = True

  def _throttle(self) -> None:
    """The sandbox's CPU quota again (`_unthrottle`). Raises OSError where it cannot be
    set (a command must not start without it)."""
    if self._cpu_cgroup is not None and self._unthrottled:
      set_cpu_quota(self._cpu_cgroup, self.limits.cpus)
      self._unthrottled = False

  # -- execution ------------------------------------------------------------------------

  async def run(self, argv: Sequence[str], *, timeout: Optional[float] = None,
                stdin: Optional[bytes] = None, pid1: bool = False,
                trusted_init: bool = False, keep_stdout: Optional[int] = None) -> ExecResult:
    """Runs `argv` in the workspace; never raises for the command's own failures.

    Waits for an execution slot first (at most `slot_timeout_s`; past it the result is an
    infrastructure error). `pid1`: the command itself is its PID namespace's init (in the
    namespace modes), which processes it starts cannot kill or signal. `trusted_init`
    (with `pid1`): that init is the caller's own code, which may make itself not dumpable
    (the grader's harness); any other process of the command that does, or that runs a
    program its user may not read, hides its files from a non-root worker's disk watch
    and is stopped for it (`over_disk`). `keep_stdout`: the bytes of stdout kept (the
    grader's report; by default `Limits.output_budget`, as stderr's).
    """
    if trusted_init and not pid1:
      raise ValueError("trusted_init is the init of pid1=True")
    argv = [str(a) for a in argv]
    t_wait = time.perf_counter()
    slot = self._slots() if self._slots is not None else contextlib.nullcontext()
    # One place in the queue, kept however long the wait (first come, first served).
    acquire = asyncio.ensure_future(slot.__aenter__())
    try:
      with waits.waiting(), waits.queued():  # others' load: not the command's own time
        while True:
          t_look = time.monotonic()
          done, _ = await asyncio.wait({acquire}, timeout=self.slot_timeout_s)
          if done:
            acquire.result()
            break
          # A full pool that runs (slots freed meanwhile) is waited on as long as it
          # takes: a run whose own episodes crowd it goes slower, no command is failed
          # for it. One that freed nothing for slot_timeout_s is stuck: infrastructure.
          if self._progress is None or self._progress() <= t_look:
            raise TimeoutError
    except BaseException as e:  # stuck, or the caller gave up: leave the queue
      acquire.cancel()
      await asyncio.wait({acquire})
      if not acquire.cancelled() and acquire.exception() is None:  # got it meanwhile
        await slot.__aexit__(None, None, None)
      if not isinstance(e, TimeoutError):
        raise
      result = ExecResult(argv, None, None, time.perf_counter() - t_wait, False, "", "",
                          0, 0, "", "", self.isolation,
                          f"no execution slot within {self.slot_timeout_s:.0f}s "
                          "(no command of the pool ended meanwhile)")
      self.history.append(result)
      return result
    try:
      with waits.commanding():  # (the policy's time, its teardown included)
        return await self._run(argv, timeout, stdin, pid1, trusted_init,
                               keep_stdout or self.limits.output_budget)
    finally:
      await slot.__aexit__(None, None, None)

  async def _run(self, argv, timeout, stdin, pid1, trusted_init, keep_stdout) -> ExecResult:
    wall = limit = self.limits.wall_s if timeout is None else timeout
    tag = uuid.uuid4().hex[:8]
    out_path = os.path.join(self._logs, f"{tag}.out")
    err_path = os.path.join(self._logs, f"{tag}.err")
    # mountns builds the run's private root here (root-owned; nothing else needs it).
    run_dir = (tempfile.mkdtemp(prefix=f"run-{tag}-", dir=self._logs)
               if self.isolation == "mountns" else self._logs)
    t0 = time.perf_counter()
    timed_out, error, code, sig, unstarted = False, None, None, None, False
    over: list[str] = []  # (the disk watch's finding)
    ooms = self.oom_counts()
    program = seccomp_program(not trusted_init) if self.isolation == "bwrap" else None
    seccomp_fd = None
    # bwrap says on this pipe whether its setup finished (`setup_finished`): without it,
    # a mount refused or the held workspace's namespaces gone was shown to the policy as
    # its own command's exit 1 (a red team).
    status_r, status_w = os.pipe() if self.isolation == "bwrap" else (None, None)
    try:
      with open(out_path, "wb") as out, open(err_path, "wb") as err:
        diskwatch.reserve(out.fileno(), keep_stdout)
        self._throttle()  # (lifted for an earlier command's teardown, or a wipe's)
        seccomp_fd = seccomp_program_fd(program) if program is not None else None
        command = wrap(self.isolation, self.mountpoint, argv, uid=self.uid, limits=self.limits,
                        run_dir=run_dir, pid1=pid1, seccomp_fd=seccomp_fd,
                        dumpable=not trusted_init, held=self._held, status_fd=status_w)
        # mountns: `unshare` and the mounts need root; setpriv drops to the uid inside.
        uid = self.uid if self.isolation == "bwrap" else None
        cpu = max(self.limits.cpu_s, math.ceil(wall) + 1)
        proc = await asyncio.create_subprocess_exec(
            *join_cgroups([self._cgroup, self._cpu_cgroup]),
            *confine(self.limits, uid, cpu, nproc=not nproc_inside(self.isolation, self.uid)),
            *command,
            stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            stdout=out, stderr=err, cwd=self.host_path, env=scrubbed_env(self.workdir),
            start_new_session=True,
            pass_fds=tuple(fd for fd in (seccomp_fd, status_w) if fd is not None))
        if status_w is not None:
          os.close(status_w)  # (bwrap holds it now: its end is the pipe's)
          status_w = None
        watch = None if self.has_quota else asyncio.ensure_future(self._watch_disk(proc, over,
                                                                               trusted_init))
        clock = ExitClock(proc.pid)
        talk = asyncio.ensure_future(proc.communicate(stdin))
        try:
          t_wall = time.perf_counter()
          # The wall limit, stretched by the CPU time the command was kept from
          # (`_longer`; the CPU limit, the command's own time, is not).
          stretched = self._stretch() if self._stretch is not None else (lambda: 1.0)
          while True:
            done, _ = await asyncio.wait(
                {talk}, timeout=max(0.0, t_wall + limit - time.perf_counter()))
            longer = None if done else await self._longer(wall, t_wall, stretched)
            if longer is None or longer <= limit + 0.05:
              break
            limit = longer
          if not done and time.perf_counter() - t_wall - limit >= HELD_LOOP_S:
            # The loop was held past the wall limit (another call's code): an exit that
            # came in time is seen on its next turns, not read as a timeout (a sibling's
            # hold made a 0.1 s command under a 1 s limit a TIMEOUT verdict: red team).
            done, _ = await asyncio.wait({talk}, timeout=HELD_LOOP_S)
            if done and not await asyncio.to_thread(clock.ended_by, t_wall + limit):
              timed_out = True  # (it ended, but past its limit)
          if done:
            talk.result()
          else:
            timed_out = True
            talk.cancel()
            await asyncio.wait({talk})
            await self._terminate(proc)
        except BaseException:  # cancelled (its caller gave up): nothing outlives the run
          talk.cancel()
          await waits.to_the_end(self._terminate(proc))
          raise
        finally:
          if watch is not None:
            watch.cancel()
            await asyncio.wait({watch})
        rc = proc.returncode
        code, sig = (rc, None) if rc >= 0 else (None, -rc)
        timed_out = timed_out or sig == signal.SIGXCPU
        if (self.isolation == "mountns" and not timed_out
            and not os.path.exists(os.path.join(run_dir, SETUP_DONE))):
          error = f"the sandbox's setup failed (exit {rc})"
        if status_r is not None and not timed_out and rc >= 0 and not setup_finished(
            _read_all(status_r)):  # (non-blocking: its writer has ended)
          # (a signal's end, bwrap's or the OOM killer's, is no setup failure: bwrap kept
          # its status for the command's end; nothing the command does exits it otherwise)
          error = (f"the sandbox's setup failed (exit {rc}): "
                   f"{_last_line(err_path)}")
    except (OSError, ValueError) as e:  # could not start: an infrastructure failure
      error, unstarted = f"{type(e).__name__}: {e}", True
    finally:
      for fd in (seccomp_fd, status_r, status_w):
        if fd is not None:
          os.close(fd)
      try:
        await waits.to_the_end(asyncio.to_thread(self._kill_uid))
        if self._held is not None and self._held.alive:  # (fresh for the next command)
          await asyncio.to_thread(self._held_scratch_emptied)
      finally:
        with contextlib.suppress(OSError):  # (else the next command's start sets it)
          self._throttle()
        if run_dir != self._logs:
          shutil.rmtree(run_dir, ignore_errors=True)
    # (its files went with it; a command that could not start may have met it dying: its
    # root gone before its exit is seen, a FileNotFoundError under /proc/PID/root)
    if self._held is not None and (not self._held.alive or (
        unstarted and await asyncio.to_thread(self._held.ends_within, 1.0))):
      error = (f"the workspace's filesystem is gone: its holder (host pid "
               f"{self._held.pid}) ended, exit {self._held.exit_code}")
    # Files sent over a unix socket that the command's processes left in its own queue (a
    # cycle none of them holds) are in no process's descriptors or mappings: they keep
    # their blocks until the kernel's collector runs, at the next close of a unix socket
    # somewhere on the host (1 GiB stayed 40 s after a command ended, red team). Close one.
    with contextlib.suppress(OSError):
      for end in socket.socketpair():
        end.close()
    disk = None
    if not self.has_quota and error is None:  # (a last look: a command shorter than one)
      disk = over[0] if over else await asyncio.to_thread(self.over_disk)
      if disk is not None:
        await asyncio.to_thread(self._empty)
    duration = time.perf_counter() - t0
    own_kills, host_kills = oom_attribution(ooms, self.oom_counts(),
                                            host_kills_are_infra=self._memory_fits())
    if host_kills and error is None:
      error = (f"the host ran out of memory: its OOM killer (not this sandbox's limit) killed "
               f"{host_kills} of the command's processes")
    outs = [hostfs.digest(p, budget) if os.path.exists(p) else ("", 0, "")
            for p, budget in ((out_path, keep_stdout), (err_path, self.limits.output_budget))]
    for p in (out_path, err_path):
      with contextlib.suppress(FileNotFoundError):
        os.unlink(p)
    stderr = outs[1][0]
    if disk is not None:
      stderr += (f"\n[sandbox] past the workspace's bounds on disk ({disk}): the command "
                 "was stopped and the workspace's files removed\n")
    result = ExecResult(argv, code, sig, duration, timed_out, outs[0][0], stderr, outs[0][1],
                        outs[1][1], outs[0][2], outs[1][2], self.isolation, error,
                        own_kills, disk)
    self.history.append(result)
    return result

  def oom_counts(self) -> tuple[int, int]:
    """(times the sandbox's memory cgroup reached its limit, processes of it any OOM
    killer took), counted since the cgroup was made; (0, 0) without a cgroup."""
    if self._cgroup is None:
      return 0, 0
    # cgroup v2: memory.events' `oom` (the limit reached, an allocation about to fail)
    # and `oom_kill` (by any killer, the host's too); v1: memory.failcnt (the limit
    # reached) and memory.oom_control's `oom_kill`.
    for events, limit_key, kills in (("memory.events", "oom", "memory.events"),
                                     ("memory.failcnt", None, "memory.oom_control")):
      try:
        limit = cgroup_counter(os.path.join(self._cgroup, events), limit_key)
        return limit, cgroup_counter(os.path.join(self._cgroup, kills), "oom_kill")
      except (OSError, ValueError, KeyError):
        continue
    return 0, 0

  async def _terminate(self, proc) -> None:
    """Kills a timed-out command so that its own parent reaps it (no orphans, no zombies),
    and waits until nothing of it runs."""
    inits = []
    try:
      if self.isolation in ("bwrap", "mountns"):
        # Killing the PID namespace's init takes down everything inside; bwrap (or
        # unshare) reaps it and exits. (A sandbox uid is had only in these modes:
        # `_fast_exit` kills its every process at once.)
        for child in _children(proc.pid):
          with contextlib.suppress(OSError):
            inits.append(os.pidfd_open(child))
          with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
      with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
      await self._fast_exit()
      try:
        await asyncio.wait_for(proc.wait(), timeout=5)
      except asyncio.TimeoutError:
        with contextlib.suppress(ProcessLookupError):
          os.kill(proc.pid, signal.SIGKILL)
        await proc.wait()
      if inits:
        # bwrap, killed too, may end first: the init ends only once the kernel has ended
        # everything else in its namespace, and until then they still write (the next
        # command found up to 101 files its timed-out predecessor's processes made in
        # /tmp after it was emptied: red team 7).
        ended, inits = inits, []  # (the thread closes them, cancelled or not)
        await asyncio.to_thread(_all_ended, ended, 5.0)
    finally:  # (cancelled before: a descriptor a kill, for the worker's life)
      for fd in inits:
        os.close(fd)

  def _held_scratch_emptied(self) -> None:
    """Empties the /tmp and /dev/shm of a held workspace's commands."""
    for scratch in (self._held.tmp, self._held.shm):
      hostfs.remove_tree(self._root + scratch, keep_root=True)
      with contextlib.suppress(OSError):  # (a command that shut it: opened to empty it)
        os.chmod(self._root + scratch, 0o1777)

  async def _longer(self, wall: float, t_wall: float, stretched: Callable[[], float]) -> float:
    """The wall limit of a command started at `t_wall`, as far as it was kept from the
    host's CPUs: by its own starvation where its CPU cgroup can say (`starved_s`; the
    pool's commands running meanwhile lent a stretch to one that slept, and a brute force
    beside them had that much more CPU time), else by its pool's sharing (`stretched`)."""
    if self._cpu_cgroup is not None and self.limits.cpus > 0:
      starved = await asyncio.to_thread(starved_s, self._cpu_cgroup, self.limits.cpus,
                                        time.perf_counter() - t_wall)
      if starved is not None:
        return min(wall + starved, wall * MAX_STRETCH)
    return wall * stretched()

  async def run_python(self, code: str, *, timeout: Optional[float] = None,
                       filename: str = "_run.py") -> ExecResult:
    self.write_file(filename, code)
    return await self.run([self.python, filename], timeout=timeout)

  def describe(self) -> dict:
    return {"isolation": self.isolation, "uid": self.uid, "limits": dataclasses.asdict(self.limits),
            "workdir": self.workdir,
            "filesystem": FILESYSTEMS["tmpfs" if self._mounted else "held"
                                      if self._held is not None else "disk"],
            "cgroups": [c for c in (self._cgroup, self._cpu_cgroup) if c is not None],
            "seccomp": seccomp_program() is not None and (
                self.isolation == "bwrap" or (self.isolation == "mountns"
                                              and system_python() is not None))}


# What each kind of workspace filesystem (`workspace_filesystem`) is called where a worker
# or a sandbox says it (`SandboxPool.filesystem`, `Sandbox.describe`).
FILESYSTEMS = {"tmpfs": "a tmpfs", "held": "a tmpfs held in a user namespace",
               "disk": "the host's disk, watched"}


def workspace_filesystem(isolation: str, own_filesystem: Optional[bool]) -> str:
  """What a workspace of this worker is on: "tmpfs" (a root worker's, mounted on the
  host), "held" (a non-root worker's `HeldTmpfs`) or "disk" (the host's, watched).
  `own_filesystem` as `Sandbox`'s; asked for where it cannot be had, IsolationUnavailable."""
  if os.geteuid() == 0 and isolation != "rlimits":
    return "tmpfs"
  if own_filesystem is False:
    return "disk"
  why = ("needs bwrap isolation, not " + isolation if isolation != "bwrap" else
         held_tmpfs_refused())
  if why is None:
    return "held"
  if own_filesystem:
    raise IsolationUnavailable(f"workspaces cannot have a filesystem of their own: {why}")
  return "disk"

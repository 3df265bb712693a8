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
`envs.isolation`; this module runs commands in it and keeps their workspaces.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import errno
import functools
import hashlib
import logging
import math
import mmap
import os
import re
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

from envs import waits
from envs.isolation import (FALLOC_FL_KEEP_SIZE, ISOLATIONS, SETPRIV, SETUP_DONE,
                            HeldTmpfs, IsolationUnavailable, Limits,
                            UidLease, available_memory_bytes,
                            cgroup_counter, check_delegated_cgroups, confine, cpu_cgroup,
                            detect_isolation, held_tmpfs_refused, join_cgroups,
                            memory_cgroup, nproc_inside, nproc_room, oom_attribution,
                            processes_of,
                            remove_cgroup, remove_stale_cgroups,
                            scrubbed_env, seccomp_program, seccomp_program_fd, set_cpu_quota,
                            system_python, wrap)
from jaxagent.errors import InfraError

log = logging.getLogger(__name__)


# A snapshot's longest relative path: a grading copy under another (longer) host
# directory, with its temporary names, stays within PATH_MAX.
MAX_PATH_CHARS = 1024
_PAGE = 4096  # tmpfs (the quota) allocates whole pages


def _opened(path: str) -> None:
  """Opens directory `path` to its owner (to list, to read its entries' sizes, to empty)
  when its mode shuts the owner out (000; 600 lists names whose sizes cannot be read: a
  reviewer); a link is left as it is."""
  st = os.lstat(path)
  if stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) & 0o700 != 0o700:
    os.chmod(path, 0o700)


def _scandir_opened(path: str, open_up: bool) -> list:
  """The entries of directory `path`, opened to its owner first when `open_up` (a
  workspace of the host's own user: a sandbox without a uid of its own)."""
  if open_up:
    _opened(path)
  return list(os.scandir(path))


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# A workspace deeper than this many directories is past its bounds (a walk holds a
# descriptor a level).
MAX_DEPTH = 256


def _open_dir(name: str, dir_fd: Optional[int], open_up: bool = True) -> int:
  """A descriptor of directory `name` (in directory `dir_fd`; a link is never followed),
  opened to its owner first, when `open_up`, if its mode shuts the owner out (a sandbox
  that is not its own uid can leave directories of mode 000, 600 or 400 on the host's
  disk). By descriptors no path is longer than a name: a tree past PATH_MAX is reached
  whole (by paths, what it held was skipped, and stayed), and a directory swapped for a
  link meanwhile is not followed out of the workspace (red team 30)."""
  try:
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
  except PermissionError:
    if not open_up:
      raise
    handle = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
      if not stat.S_ISDIR(os.fstat(handle).st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", name)
      os.chmod(f"/proc/self/fd/{handle}", 0o700)  # (the inode opened, whatever the name)
    finally:
      os.close(handle)
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
  if open_up:
    try:
      if stat.S_IMODE(os.fstat(fd).st_mode) & 0o700 != 0o700:
        os.fchmod(fd, 0o700)
    except OSError:
      os.close(fd)
      raise
  return fd


class _TooDeep(Exception):
  pass


def _walk(root: str, open_up: bool = True, max_depth: int = MAX_DEPTH,
          shut: Optional[list] = None):
  """Every entry under directory `root`, depth first, by descriptors (`_open_dir`; an
  entry's `stat` reads it in its directory); what cannot be opened is skipped (and, with
  `shut`, what its mode shuts to this process is named there, `root` itself included).
  `_TooDeep` past `max_depth` levels. One descriptor is held a level."""
  frames: list = []  # [descriptor, subdirectories still to walk, depth]
  try:
    fd: Optional[int] = _open_dir(root, None, open_up)
  except PermissionError:
    if shut is None:
      raise
    shut.append(root)
    return
  depth = 1
  try:
    while True:
      if fd is not None:
        subdirs = []
        with os.scandir(fd) as entries:
          for entry in entries:
            yield entry
            with contextlib.suppress(OSError):
              if entry.is_dir(follow_symlinks=False):
                subdirs.append(entry.name)
        frames.append([fd, subdirs, depth])
        fd = None
      while frames and not frames[-1][1]:
        os.close(frames.pop()[0])
      if not frames:
        return
      parent, subdirs, level = frames[-1]
      name = subdirs.pop()
      if level > max_depth:  # (entering the directory nested max_depth + 1 deep)
        raise _TooDeep
      try:
        fd, depth = _open_dir(name, parent, open_up), level + 1
      except OSError as e:
        fd = None
        if shut is not None and isinstance(e, PermissionError):
          shut.append(name)
  finally:
    for frame in frames:
      os.close(frame[0])
    if fd is not None:
      os.close(fd)


def _remove_tree(path: str, keep_root: bool = False) -> None:
  """Removes what is under directory `path`, and `path` unless `keep_root`, by
  descriptors and without recursion: each subdirectory's entries are moved up into
  `path` (renamed) until none is left, so any depth is removed holding two descriptors
  (`shutil.rmtree` raised RecursionError past ~1000 levels, and skipped names past
  PATH_MAX: what they held stayed on the host's disk, red team 30); directories whose
  mode shuts their owner out are opened first. Never raises: what cannot be removed is
  logged."""
  tag, n, last = uuid.uuid4().hex[:8], 0, None
  try:
    root = _open_dir(path, None)
  except FileNotFoundError:
    return
  except OSError as e:
    log.warning("sandbox: could not remove %s: %s", path, e)
    return
  try:
    while True:
      with os.scandir(root) as it:
        entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
      if not entries:
        break
      moved = False
      for name, is_dir in entries:
        try:
          if is_dir:
            sub = _open_dir(name, root)
            try:
              with os.scandir(sub) as it:
                inner = [e.name for e in it]
              for child in inner:
                n += 1
                try:
                  os.rename(child, f".jaxagent-rm-{tag}-{n}", src_dir_fd=sub,
                            dst_dir_fd=root)
                except PermissionError:  # a directory moves only if its owner may write
                  # it (its `..` is rewritten): a reviewer's 0500 one stayed, and its files
                  os.close(_open_dir(child, sub))
                  os.rename(child, f".jaxagent-rm-{tag}-{n}", src_dir_fd=sub,
                            dst_dir_fd=root)
            finally:
              os.close(sub)
            os.rmdir(name, dir_fd=root)
          else:
            os.unlink(name, dir_fd=root)
          moved = True
        except FileNotFoundError:
          moved = True
        except OSError as e:
          last = e
      if not moved:
        log.warning("sandbox: could not empty %s: %s", path, last)
        break
  except OSError as e:
    log.warning("sandbox: could not empty %s: %s", path, e)
  finally:
    os.close(root)
  if not keep_root:
    try:
      os.rmdir(path)
    except FileNotFoundError:
      pass
    except OSError as e:
      log.warning("sandbox: could not remove %s: %s", path, e)


@contextlib.contextmanager
def _named(rel: str):
  """A host-side file operation's OSError names the workspace's path `rel`, not the
  host's: tool errors reach the policy, and the host's path told it the host's layout
  (with a held tmpfs, its holder's pid: red team 6)."""
  try:
    yield
  except OSError as e:
    if e.errno is None:
      raise
    raise OSError(e.errno, e.strerror, rel) from None


def _realpath_in(root: str, path: str, most_links: int = 40) -> str:
  """`os.path.realpath(path)` for a process whose root is `root` ("" for this one's, or a
  `/proc/<pid>/root`): links are read through `root`, and an absolute one's target
  starts from it too, as the kernel resolves it for that process (`realpath` of a path
  under `/proc/<pid>/root` reads that link as "/", and so ends on the host's own
  path). Missing names are kept as they are, as `realpath` keeps them."""
  done, todo, links = "", [p for p in path.split("/") if p], 0
  while todo:
    name = todo.pop(0)
    if name in ("", "."):
      continue
    if name == "..":
      done = done.rsplit("/", 1)[0]
      continue
    try:
      target = os.readlink(root + done + "/" + name)
    except OSError:  # not a link, or not there
      done += "/" + name
      continue
    links += 1
    if links > most_links:
      raise OSError(errno.ELOOP, "too many levels of symbolic links", path)
    todo[:0] = [p for p in target.split("/") if p]
    if target.startswith("/"):
      done = ""
  return done or "/"


def _process_tree(pid: int, most: int = 4096) -> list[int]:
  """`pid` and its descendants (every thread's children), at most `most`."""
  out, stack = [], [pid]
  while stack and len(out) < most:
    p = stack.pop()
    out.append(p)
    try:
      tasks = os.listdir(f"/proc/{p}/task")
    except OSError:
      continue
    for t in tasks:
      try:
        with open(f"/proc/{p}/task/{t}/children") as f:
          stack += [int(x) for x in f.read().split()]
      except (OSError, ValueError):
        continue
  return out


class _Hidden(Exception):
  """What of a command the disk watch may not read, or not in time (the reason)."""


def _not_dumpable(task: str, spare: Optional[int]) -> Optional[str]:
  """What to call the task at `task` (/proc/<pid>/task/<tid>), whose /proc files the host
  was refused, if it hides them (it is not dumpable), or None where it is leaving (a task
  without memory, exiting or a zombie, has its /proc files owned by root too, and its
  descriptors about to go) or is of the trusted init `spare` (a host pid: the grader's
  harness, not dumpable so that the solution cannot reach it; its PID namespace's init
  where the command has one, else the command's own first process)."""
  try:
    with open(f"{task}/status") as f:  # (readable by all)
      status = f.read()
  except OSError:
    return None  # (gone)
  if "\nVmSize:" not in status:
    return None
  if spare is not None and (re.search(r"\nNStgid:.*\s1\n", status)
                            or re.search(rf"\nTgid:\s{spare}\n", status)):
    return None
  name = status.partition("\n")[0].partition(":")[2].strip()
  return f"{name!r} (host pid {os.path.basename(task)})"


# Files a non-root worker may not size (mapped, the descriptor closed, the name gone) that
# count only as far as one of their mappings reaches, a command's first few: libraries
# that a process loaded are rebuilt (the linker unlinks the old file while it stays
# mapped; 8 rebuilt ones stopped a command that held under 1 MiB).
_UNSIZED_SPARED = 16
# Lines of /proc/<pid>/maps a look reads for a command, all its processes together (a
# Python process maps a few hundred regions; a look reads 60,000 in about 35 ms).
_MAPPINGS_READ = 200_000
_DELETED_MAPPING = re.compile(
    r"^([0-9a-f]+)-([0-9a-f]+) \S+ ([0-9a-f]+) ([0-9a-f]+:[0-9a-f]+) (\d+) +.* \(deleted\)$",
    re.M)


def _refused(task: str, spare: Optional[int]) -> None:
  """Raises `_Hidden` where the host was refused the /proc files of `task` because it
  hides them (`_not_dumpable`); returns where it is leaving or spared."""
  if (hiding := _not_dumpable(task, spare)) is not None:
    raise _Hidden(f"process {hiding} hides its open files from the disk watch "
                  "(not dumpable)")


def _unlinked_bytes(pids: Sequence[int], device: int, unsized: int,
                    spare: Optional[int] = None, stop_past: float = math.inf
                    ) -> tuple[int, int]:
  """What the files and directories of `device` that processes `pids` hold (open, mapped,
  or as a task's working directory or root) and that no name holds any more take on it
  (an unlinked file's blocks are freed only when the last descriptor and mapping of it
  go; a removed directory's with its last holder). Read thread by thread: a process whose
  first thread has ended shows no descriptors of its own, while its other threads hold
  them (a `pthread_exit` from the main thread hid 64 MiB so), and a thread may have a
  descriptor table of its own. A mapped file whose size the host may not read
  (`/proc/<pid>/map_files`: only root follows its links) counts as `unsized` bytes, the
  most a command may write to one file (`Limits.file_bytes`, RLIMIT_FSIZE; the seccomp
  filter refuses the fallocate modes that take blocks past a file's length or grow it
  past the limit), but `_UNSIZED_SPARED` of them, as far as one of their mappings reaches
  (how many: the second number returned; what they hide is left to `over_disk`'s watch
  of the disk's free space). Raises
  `_Hidden` for a thread whose descriptors the host may not read (not dumpable: it runs
  a program its user may not read), but a trusted init's (`spare`: `_not_dumpable`).
  Returns early once what it counts of such files is past `stop_past`."""
  total, seen, mapped = 0, set(), {}  # (inode numbers; a readable task of each process)

  def count(path: str) -> None:
    nonlocal total
    try:
      st = os.stat(path)
    except OSError:
      return
    if ((stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)) and st.st_nlink == 0
            and st.st_dev == device and st.st_ino not in seen):
      seen.add(st.st_ino)
      total += st.st_blocks * 512

  for p in pids:
    try:
      tasks = os.listdir(f"/proc/{p}/task")
    except OSError:
      continue  # (gone)
    for t in tasks:
      task = f"/proc/{p}/task/{t}"
      try:
        fds = os.listdir(f"{task}/fd")
      except PermissionError:
        _refused(task, spare)
        continue
      except OSError:
        continue
      mapped.setdefault(p, task)  # (a process's threads share one memory)
      for fd in fds:
        count(f"{task}/fd/{fd}")
      count(f"{task}/cwd")
      count(f"{task}/root")
  # Mapped, the descriptor closed: /proc/<pid>/maps names them "(deleted)" (a red team
  # held 3.2 GiB of the host's disk so against a 32 MiB quota, unseen by the look above).
  # Read up to `_MAPPINGS_READ` lines in all, whose removed files' are picked out by a
  # regular expression: 16 processes mapping a removed file 60,000 times each made a
  # look take 3 s, and every sandbox's looks wait on two threads.
  want = _MAPS_DEVICES.get(device) or f"{os.major(device):02x}:{os.minor(device):02x}"
  reach: dict[int, int] = {}  # (of each file not sized: as far as one mapping reaches)
  lines, sizable = 0, os.geteuid() == 0  # (only root may stat /proc/<pid>/map_files)
  for p, task in mapped.items():
    try:
      with open(f"{task}/maps") as f:
        maps = f.read()
    except PermissionError:
      _refused(task, spare)
      continue
    except OSError:
      continue
    lines += maps.count("\n")
    if lines > _MAPPINGS_READ:
      raise _Hidden(f"its processes map over {_MAPPINGS_READ} regions, more than the disk "
                    "watch reads")
    if " (deleted)\n" not in maps:
      continue
    # ((dev, inode) -> its first mapping's start, end, offset)
    files = {m[3:]: m[:3] for m in reversed(_DELETED_MAPPING.findall(maps))}
    for (dev, inode), (start, stop, offset) in files.items():
      ino = int(inode)
      if dev != want or ino in seen or ino in reach:
        continue
      if sizable:
        try:
          st = os.stat(f"/proc/{p}/map_files/{start}-{stop}")
          if st.st_nlink == 0:
            seen.add(ino)
            total += st.st_blocks * 512
          continue
        except OSError:
          pass  # (remapped meanwhile: a red team resized its mappings to miss the stat)
      reach[ino] = int(offset, 16) + int(stop, 16) - int(start, 16)
      if len(reach) > _UNSIZED_SPARED and total + (len(reach) - _UNSIZED_SPARED) * unsized \
          > stop_past:  # (past it: enough)
        return total + (len(reach) - _UNSIZED_SPARED) * unsized, _UNSIZED_SPARED
  for i, bound in enumerate(sorted(reach.values())):
    total += min(bound, unsized) if i < _UNSIZED_SPARED else unsized
  return total, min(len(reach), _UNSIZED_SPARED)


# Workspaces without a quota of their own that live in this process (ids): while a
# command shuts a directory to the disk watch, the disk may lose what they may all take.
_UNQUOTED: set = set()


def _free_bytes(path: str) -> int:
  """What the disk holding `path` has free for a process that is not root."""
  st = os.statvfs(path)
  return st.f_bavail * st.f_frsize


def _shut_allowance(budget: int) -> int:
  """What the disk may lose while a command shuts a directory to the watch: what every
  workspace of this process without a quota may take (others' commands write too)."""
  return budget * max(1, len(_UNQUOTED))


# How /proc/<pid>/maps names a device (by the st_dev of a directory on it): as stat does,
# but where a stacked filesystem maps the file of the one below (overlayfs, on kernels
# whose maps show the upper layer's device). Learned by `_learn_maps_device`.
_MAPS_DEVICES: dict[int, str] = {}


def _learn_maps_device(directory: str) -> None:
  """Maps a probe file in `directory` (in this process) to see how /proc/self/maps names
  its device; where that fails, the device is named as stat names it."""
  device = os.stat(directory).st_dev
  if device in _MAPS_DEVICES:
    return
  said = f"{os.major(device):02x}:{os.minor(device):02x}"
  with contextlib.suppress(OSError, ValueError):
    fd, path = tempfile.mkstemp(dir=directory, prefix=".jaxagent-maps-")
    try:
      os.write(fd, b"\0")
      with mmap.mmap(fd, 1):
        with open("/proc/self/maps") as f:
          for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == os.path.realpath(path):
              said = fields[3]
    finally:
      os.close(fd)
      os.unlink(path)
  _MAPS_DEVICES[device] = said


@functools.cache
def _libc_fallocate():
  """libc's fallocate(2), or None where the C library has none."""
  try:
    fn = ctypes.CDLL(None, use_errno=True).fallocate
  except (AttributeError, OSError):
    return None
  fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
  fn.restype = ctypes.c_int
  return fn


def reserve(fd: int, size: int) -> bool:
  """Takes `size` bytes of disk for the file `fd` before anything is written to it (its
  length stays 0): writes within them cannot fail for a full disk. A command's stdout
  log, which carries the harness's report: storage that the solution holds where the
  disk watch cannot see it (a non-root worker cannot read a non-dumpable process's
  /proc/<pid>/fd) filled the disk, the report failed to be written, and a wrong answer
  read as the harness's death (an infrastructure error, re-rolled: red team). False
  where the filesystem does not preallocate; OSError (ENOSPC) where the disk is full
  already, before the command (the host's failure)."""
  fallocate = _libc_fallocate()
  if fallocate is None:
    return False
  if fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, size) == 0:
    return True
  err = ctypes.get_errno()
  if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
    return False
  raise OSError(err, f"reserving {size} bytes for a command's output: {os.strerror(err)}")


# The disk watches' looks (`Sandbox._watch_disk`): threads of their own, so that slow
# looks (a policy's large tree) never hold up the event loop's other work.
_WATCH_THREADS = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="jaxagent-disk")
# A command's wall timer that fires this late found the event loop held (by another
# call's code): the command gets this long again to be seen ending before it is read as
# timed out (its exit may have come in time, unseen).
HELD_LOOP_S = 0.1


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


# -- a seccomp filter -----------------------------------------------------------------------


def _check_traversable(path: str) -> None:
  """The sandbox uid must be able to reach its workspace through every parent directory."""
  path = os.path.abspath(path)
  while True:
    if not os.stat(path).st_mode & 0o001:
      raise ValueError(f"{path} is not traversable by the sandbox uid (needs o+x); put "
                       "workspaces under a directory of mode 711, as SandboxPool does")
    parent = os.path.dirname(path)
    if parent == path:
      return
    path = parent


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


def _digest(path: str, budget: int) -> tuple[str, int, str]:
  """(first `budget` bytes as text, full size, sha256) of an output file."""
  h = hashlib.sha256()
  size = 0
  head = b""
  with open(path, "rb") as f:
    while chunk := f.read(1 << 20):
      if len(head) < budget:
        head += chunk[:budget - len(head)]
      size += len(chunk)
      h.update(chunk)
  return head.decode("utf-8", errors="replace"), size, h.hexdigest()


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
               own_filesystem: Optional[bool] = None):
    # Where the workspace is: `mountpoint` in the namespaces commands run in, and the
    # path the host reaches it by (the same, but through a held tmpfs's holder).
    self.mountpoint = self.host_path = os.path.abspath(workspace)
    self._root = ""  # (what `host_path` adds in front of `mountpoint`)
    self._memory_fits = memory_fits  # its pool's limits fit the host (`oom_attribution`)
    self.isolation = isolation or detect_isolation()
    if self.isolation not in ISOLATIONS:
      raise ValueError(f"unknown isolation {self.isolation!r}; one of {ISOLATIONS}")
    self.limits = limits
    self._slots = slots
    self.slot_timeout_s = slot_timeout_s
    self._progress = progress  # when a slot was last freed (time.monotonic)
    self._lease = None
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
    held = _workspace_filesystem(self.isolation, own_filesystem) == "held"
    os.makedirs(self.host_path, mode=0o700, exist_ok=False)
    try:
      if self.uid is not None:
        _check_traversable(os.path.dirname(self.host_path))
        self._kill_uid()  # nothing of an earlier holder of this uid survives
        # The quota: a tmpfs of disk_bytes owned by the sandbox uid.
        subprocess.run(["mount", "-t", "tmpfs", "-o",
                        f"size={limits.disk_bytes},nr_inodes={limits.max_inodes},mode=0700,"
                        f"uid={self.uid},gid={self.uid},nosuid,nodev", "jaxagent-ws",
                        self.host_path],
                       check=True, capture_output=True)
        self._mounted = True
      elif held:
        self._logs = tempfile.mkdtemp(prefix="jaxagent-logs-")  # (its commands' /tmp too)
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
        self._logs = tempfile.mkdtemp(prefix="jaxagent-logs-")  # outside the workspace
      if not self.has_quota:  # (for the disk watch)
        _learn_maps_device(os.path.dirname(self.host_path))
        _UNQUOTED.add(id(self))
    except BaseException:
      self._release()
      _remove_tree(self.mountpoint)  # (a pool's root kept no empty folder per failure)
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
    path = (_realpath_in(self._root, joined) if follow_last else os.path.join(
        _realpath_in(self._root, os.path.dirname(joined)), os.path.basename(joined)))
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
    with _named(rel):
      self._write(self._resolve(rel, follow_last=False), data)

  def _write(self, path: str, data: bytes) -> None:
    parent = os.path.dirname(path)
    missing = []
    d = parent
    while not os.path.isdir(d):
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
    with _named(rel):
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
    host's longer path, a mode that shuts the host out) and paths over `MAX_PATH_CHARS`
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
    out, total, seen = {}, 0, 0
    stack = [(self.host_path, 0)]
    while stack:
      root, depth = stack.pop()
      try:
        entries = sorted(_scandir_opened(root, self.uid is None), key=lambda e: e.name)
      except OSError:
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
          if entry.is_symlink() or len(rel) > MAX_PATH_CHARS:
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
        except OSError:
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
    _remove_tree(self.host_path, keep_root=True)

  def over_disk(self, pid: Optional[int] = None, open_up: bool = True,
                spare_init: bool = False, start: Optional[tuple[int, int]] = None
                ) -> Optional[str]:
    """Why the workspace is past its quota's bounds on the host's disk (more than
    `Limits.max_inodes` files and directories, more than `disk_bytes` taken, files that
    the processes of command `pid` hold open or mapped after unlinking them included,
    or more than `MAX_DEPTH` directories deep; a process of it whose files the host may
    not read, but its trusted init with `spare_init`: `_unlinked_bytes`), or None. The
    walk (by descriptors: `_walk`) stops once past them. For a workspace without a quota
    of its own, where nothing else bounds it. `open_up`: directories whose mode shuts
    their owner out are opened (not while a command runs: its files are its own until it
    ends). `start` (what the workspace took and the disk had free when the command
    started, `_taken` and statvfs): where a directory is shut to the look, or mapped
    files it cannot size are spared, a disk that lost more than the workspace shows,
    past what every workspace of this process may take (`_shut_allowance`), is past the
    bounds too."""
    budget, shut, spared, on_disk = self.limits.disk_bytes, [], 0, 0
    try:
      if pid is not None:
        on_disk, spared = _unlinked_bytes(
            _process_tree(pid), os.stat(self.host_path).st_dev, self.limits.file_bytes,
            pid if spare_init else None, budget)
      taken, seen, deep = self._tally(open_up, shut, budget - on_disk)
      on_disk += taken
      if seen > self.limits.max_inodes:
        return f"over {self.limits.max_inodes} files and directories"
      if deep:
        return f"over {MAX_DEPTH} directories deep"
    except _Hidden as e:
      return str(e)
    except OSError:
      pass  # (the workspace itself gone: nothing of it on the disk)
    if on_disk > budget:
      return f"over {budget} bytes on disk"
    if (shut or spared) and start is not None:
      with contextlib.suppress(OSError):
        # (what the disk lost that the workspace does not show: its files freed at the
        # start count back, so that they cannot make room for what it hides)
        lost = start[1] - _free_bytes(self.host_path) - (on_disk - start[0])
        if lost > (allowance := _shut_allowance(budget)):
          what = (f"{spared} removed files mapped whose size it cannot read" if not shut else
                  "the workspace" if shut[0] == self.host_path else f"directory {shut[0]!r}")
          return (f"{what} hidden from the disk watch while the disk lost {lost} bytes more "
                  f"than the workspace shows (over {allowance})")
    return None

  def _tally(self, open_up: bool, shut: list, limit: float) -> tuple[int, int, bool]:
    """(bytes on disk, entries, too deep) of the workspace's files by a walk (`_walk`)
    that stops once past `limit` bytes, past `Limits.max_inodes` entries or `MAX_DEPTH`
    directories deep; entries its mode shuts to this process are named in `shut` (a
    directory that opens while its entries cannot be read: 0600). A workspace gone
    midway counts what was seen."""
    taken = seen = 0
    try:
      for entry in _walk(self.host_path, open_up, shut=shut):
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
    except _TooDeep:
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
        return taken, _free_bytes(self.host_path)
      return None

    start = await loop.run_in_executor(_WATCH_THREADS, baseline)

    def look():
      t = time.perf_counter()
      return self.over_disk(proc.pid, False, spare_init, start), time.perf_counter() - t

    while True:
      await asyncio.sleep(pause)
      why, took = await loop.run_in_executor(_WATCH_THREADS, look)
      pause = min(1.0, max(0.1, 10 * took))
      if why is not None:
        over.append(why)
        await self._terminate(proc)
        return

  def destroy(self) -> None:
    self._kill_uid()
    self._release()  # unmounts the quota tmpfs first, so only the mountpoint is removed
    _remove_tree(self.mountpoint)

  def _release(self) -> None:
    _UNQUOTED.discard(id(self))
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
                trusted_init: bool = False) -> ExecResult:
    """Runs `argv` in the workspace; never raises for the command's own failures.

    Waits for an execution slot first (at most `slot_timeout_s`; past it the result is an
    infrastructure error). `pid1`: the command itself is its PID namespace's init (in the
    namespace modes), which processes it starts cannot kill or signal. `trusted_init`
    (with `pid1`): that init is the caller's own code, which may make itself not dumpable
    (the grader's harness); any other process of the command that does, or that runs a
    program its user may not read, hides its files from a non-root worker's disk watch
    and is stopped for it (`over_disk`).
    """
    if trusted_init and not pid1:
      raise ValueError("trusted_init is the init of pid1=True")
    argv = [str(a) for a in argv]
    t_wait = time.perf_counter()
    slot = self._slots() if self._slots is not None else contextlib.nullcontext()
    # One place in the queue, kept however long the wait (first come, first served).
    acquire = asyncio.ensure_future(slot.__aenter__())
    try:
      with waits.waiting():  # others' load: not the command's own time
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
        return await self._run(argv, timeout, stdin, pid1, trusted_init)
    finally:
      await slot.__aexit__(None, None, None)

  async def _run(self, argv, timeout, stdin, pid1, trusted_init) -> ExecResult:
    wall = self.limits.wall_s if timeout is None else timeout
    tag = uuid.uuid4().hex[:8]
    out_path = os.path.join(self._logs, f"{tag}.out")
    err_path = os.path.join(self._logs, f"{tag}.err")
    # mountns builds the run's private root here (root-owned; nothing else needs it).
    run_dir = (tempfile.mkdtemp(prefix=f"run-{tag}-", dir=self._logs)
               if self.isolation == "mountns" else self._logs)
    t0 = time.perf_counter()
    timed_out, error, code, sig = False, None, None, None
    over: list[str] = []  # (the disk watch's finding)
    ooms = self.oom_counts()
    program = seccomp_program(not trusted_init) if self.isolation == "bwrap" else None
    seccomp_fd = None
    try:
      with open(out_path, "wb") as out, open(err_path, "wb") as err:
        reserve(out.fileno(), self.limits.output_budget)
        self._throttle()  # (lifted for an earlier command's teardown, or a wipe's)
        seccomp_fd = seccomp_program_fd(program) if program is not None else None
        command = wrap(self.isolation, self.mountpoint, argv, uid=self.uid, limits=self.limits,
                        run_dir=run_dir, pid1=pid1, seccomp_fd=seccomp_fd,
                        dumpable=not trusted_init, held=self._held)
        # mountns: `unshare` and the mounts need root; setpriv drops to the uid inside.
        uid = self.uid if self.isolation == "bwrap" else None
        cpu = max(self.limits.cpu_s, math.ceil(wall) + 1)
        proc = await asyncio.create_subprocess_exec(
            *join_cgroups([self._cgroup, self._cpu_cgroup]),
            *confine(self.limits, uid, cpu, nproc=not nproc_inside(self.isolation, self.uid)),
            *command,
            stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            stdout=out, stderr=err, cwd=self.host_path, env=scrubbed_env(self.workdir),
            start_new_session=True, pass_fds=() if seccomp_fd is None else (seccomp_fd,))
        watch = None if self.has_quota else asyncio.ensure_future(self._watch_disk(proc, over,
                                                                               trusted_init))
        clock = ExitClock(proc.pid)
        talk = asyncio.ensure_future(proc.communicate(stdin))
        try:
          t_wall = time.perf_counter()
          done, _ = await asyncio.wait({talk}, timeout=wall)
          if not done and time.perf_counter() - t_wall - wall >= HELD_LOOP_S:
            # The loop was held past the wall limit (another call's code): an exit that
            # came in time is seen on its next turns, not read as a timeout (a sibling's
            # hold made a 0.1 s command under a 1 s limit a TIMEOUT verdict: red team).
            done, _ = await asyncio.wait({talk}, timeout=HELD_LOOP_S)
            if done and not await asyncio.to_thread(clock.ended_by, t_wall + wall):
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
    except (OSError, ValueError) as e:  # could not start: an infrastructure failure
      error = f"{type(e).__name__}: {e}"
    finally:
      if seccomp_fd is not None:
        os.close(seccomp_fd)
      try:
        await waits.to_the_end(asyncio.to_thread(self._kill_uid))
        if self._held is not None and self._held.alive:  # (fresh for the next command)
          await asyncio.to_thread(self._held_scratch_emptied)
      finally:
        with contextlib.suppress(OSError):  # (else the next command's start sets it)
          self._throttle()
        if run_dir != self._logs:
          shutil.rmtree(run_dir, ignore_errors=True)
    if self._held is not None and not self._held.alive:  # (its files went with it)
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
    outs = [_digest(p, self.limits.output_budget) if os.path.exists(p) else ("", 0, "")
            for p in (out_path, err_path)]
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
      await asyncio.to_thread(_all_ended, inits, 5.0)

  def _held_scratch_emptied(self) -> None:
    """Empties the /tmp and /dev/shm of a held workspace's commands."""
    for scratch in (self._held.tmp, self._held.shm):
      _remove_tree(self._root + scratch, keep_root=True)
      with contextlib.suppress(OSError):  # (a command that shut it: opened to empty it)
        os.chmod(self._root + scratch, 0o1777)

  async def run_python(self, code: str, *, timeout: Optional[float] = None,
                       filename: str = "_run.py") -> ExecResult:
    self.write_file(filename, code)
    return await self.run([self.python, filename], timeout=timeout)

  def describe(self) -> dict:
    return {"isolation": self.isolation, "uid": self.uid, "limits": dataclasses.asdict(self.limits),
            "workdir": self.workdir,
            "filesystem": ("tmpfs" if self._mounted else "tmpfs in a user namespace"
                           if self._held is not None else "the host's disk, watched"),
            "cgroups": [c for c in (self._cgroup, self._cpu_cgroup) if c is not None],
            "seccomp": seccomp_program() is not None and (
                self.isolation == "bwrap" or (self.isolation == "mountns"
                                              and system_python() is not None))}


def _workspace_filesystem(isolation: str, own_filesystem: Optional[bool]) -> str:
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


# A pool's workspace: `<the worker's pid>-<12 hex digits>` (`SandboxPool.create`).
_WORKSPACE_NAME = re.compile(r"(\d+)-[0-9a-f]{12}")


def _remove_stale_workspaces(root: str) -> list[str]:
  """Removes the workspaces in `root` of workers no longer running (killed before they
  released them: on a `--workspace-root` that was there, kept at close, they piled up
  with each crash until its volume was full; red team 7), with their tmpfs as root; the
  other entries are left. Workers that share a root must share a PID namespace."""
  gone = []
  for entry in os.scandir(root):
    match = _WORKSPACE_NAME.fullmatch(entry.name)
    if match is None or int(match.group(1)) == os.getpid():
      continue
    try:
      os.kill(int(match.group(1)), 0)
      continue  # (running: another worker's)
    except ProcessLookupError:
      pass
    except PermissionError:
      continue  # (running, as another user)
    if os.path.ismount(entry.path):  # (a root worker's quota tmpfs)
      subprocess.run(["umount", "-l", entry.path], capture_output=True)
    _remove_tree(entry.path)
    gone.append(entry.name)
  if gone:
    log.warning("sandbox: removed %d workspaces that workers no longer running left in %s",
                len(gone), root)
  return gone


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
    if os.geteuid() != 0 and self.isolation == "bwrap":
      # (the worker's threads, each workspace's holder, each command's processes)
      nproc_room(256 + max_workspaces + size * (limits.processes + 4))
    kind = _workspace_filesystem(self.isolation, own_filesystem)
    self.own_filesystem = {"tmpfs": None, "held": True, "disk": False}[kind]
    self.filesystem = {"tmpfs": "a tmpfs", "held": "a tmpfs held in a user namespace",
                       "disk": "the host's disk, watched"}[kind]
    self.max_workspaces = max_workspaces
    self.slot_timeout_s = slot_timeout_s
    # (removed at close where the pool made it; a folder that was there keeps what else
    # it holds: an operator's files there were removed with it, red team 6)
    self._made_root = root is None or not os.path.exists(root)
    self.root = os.path.abspath(root or tempfile.mkdtemp(prefix="jaxagent-sandboxes-"))
    os.makedirs(self.root, exist_ok=True)
    if not self._made_root:
      _remove_stale_workspaces(self.root)
    os.chmod(self.root, 0o711)  # sandbox uids may pass through to their workspace, not list it
    if os.geteuid() == 0 and self.isolation != "rlimits":
      _check_traversable(self.root)  # at start, not at each episode
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
      self.running += 1
      self.peak_running = max(self.peak_running, self.running)
      try:
        yield
      finally:
        self.running -= 1
        self.last_freed = time.monotonic()

  def create(self) -> Sandbox:
    """A new workspace (blocking: a mount and a uid lease)."""
    if len(self.live) >= self.max_workspaces:
      raise InfraError("sandbox", f"sandbox pool is at its limit of {self.max_workspaces} "
                       "workspaces")
    sb = Sandbox(os.path.join(self.root, f"{os.getpid()}-{uuid.uuid4().hex[:12]}"),
                 limits=self.limits,
                 isolation=self.isolation, slots=self.slot, slot_timeout_s=self.slot_timeout_s,
                 progress=lambda: self.last_freed, memory_fits=self.memory_fits,
                 cgroup_parents=self.cgroup_parents, own_filesystem=self.own_filesystem)
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
      _remove_tree(self.root)

"""The disk watch: bounds of a workspace that has no filesystem of its own.

A worker that is not root, on a host whose kernel refuses it a user namespace to hold a
tmpfs in (`envs.isolation.HeldTmpfs`), keeps workspaces as directories on the host's
disk. `Sandbox.over_disk` then looks, while each command runs, at what the workspace
takes: its files by a walk (`envs.hostfs.walk`) and what its processes hold that no name
holds any more (`unlinked_bytes`: open, mapped, or as a working directory), plus the
disk's free space while a command shuts a directory to the walk (`shut_allowance`). The
looks run on threads of their own (`WATCH_THREADS`). `reserve` takes a command's output
log's disk before it runs, so a full disk cannot cut the grader's report.

Its known gaps (files in flight over a socket, concurrent writers' effect on free space)
are the reason a held tmpfs is preferred wherever the kernel allows one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import functools
import math
import mmap
import os
import re
import stat
import tempfile
from typing import Optional, Sequence

from envs.isolation import FALLOC_FL_KEEP_SIZE


def process_tree(pid: int, most: int = 4096) -> list[int]:
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


class Hidden(Exception):
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
MAPPINGS_READ = 200_000
_DELETED_MAPPING = re.compile(
    r"^([0-9a-f]+)-([0-9a-f]+) \S+ ([0-9a-f]+) ([0-9a-f]+:[0-9a-f]+) (\d+) +.* \(deleted\)$",
    re.M)


def _refused(task: str, spare: Optional[int]) -> None:
  """Raises `Hidden` where the host was refused the /proc files of `task` because it
  hides them (`_not_dumpable`); returns where it is leaving or spared."""
  if (hiding := _not_dumpable(task, spare)) is not None:
    raise Hidden(f"process {hiding} hides its open files from the disk watch "
                  "(not dumpable)")


def unlinked_bytes(pids: Sequence[int], device: int, unsized: int,
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
  `Hidden` for a thread whose descriptors the host may not read (not dumpable: it runs
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
  # Read up to `MAPPINGS_READ` lines in all, whose removed files' are picked out by a
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
    if lines > MAPPINGS_READ:
      raise Hidden(f"its processes map over {MAPPINGS_READ} regions, more than the disk "
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
UNQUOTED: set = set()


def free_bytes(path: str) -> int:
  """What the disk holding `path` has free for a process that is not root."""
  st = os.statvfs(path)
  return st.f_bavail * st.f_frsize


def shut_allowance(budget: int) -> int:
  """What the disk may lose while a command shuts a directory to the watch: what every
  workspace of this process without a quota may take (others' commands write too)."""
  return budget * max(1, len(UNQUOTED))


# How /proc/<pid>/maps names a device (by the st_dev of a directory on it): as stat does,
# but where a stacked filesystem maps the file of the one below (overlayfs, on kernels
# whose maps show the upper layer's device). Learned by `learn_maps_device`.
_MAPS_DEVICES: dict[int, str] = {}


def learn_maps_device(directory: str) -> None:
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
WATCH_THREADS = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="jaxagent-disk")

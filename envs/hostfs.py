"""The host's side of a workspace's files: reached by descriptors, never through a link.

A sandbox's workspace is written by untrusted code while the host lists, copies, sizes and
removes it. Every operation here opens directories one name at a time with `O_NOFOLLOW`
(`open_dir`), so a directory swapped for a link is not followed out of the workspace and
no path is longer than a name (a tree past PATH_MAX is reached whole); directories whose
mode shuts their owner out are opened to it first where the host owns them. Links inside
a held filesystem (`/proc/<holder>/root`) are resolved as its own processes see them
(`realpath_in`). Errors name the workspace's path, never the host's (`named`).

Used by `envs.sandbox.Sandbox`, `envs.pool.SandboxPool` and the disk watch
(`envs.diskwatch`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import stat
import uuid
from typing import Optional

log = logging.getLogger(__name__)


# A snapshot's longest relative path: a grading copy under another (longer) host
# directory, with its temporary names, stays within PATH_MAX.
MAX_PATH_CHARS = 1024


def _opened(path: str) -> None:
  """Opens directory `path` to its owner (to list, to read its entries' sizes, to empty)
  when its mode shuts the owner out (000; 600 lists names whose sizes cannot be read: a
  reviewer); a link is left as it is."""
  st = os.lstat(path)
  if stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) & 0o700 != 0o700:
    os.chmod(path, 0o700)


def scandir_opened(path: str, open_up: bool) -> list:
  """The entries of directory `path`, opened to its owner first when `open_up` (a
  workspace of the host's own user: a sandbox without a uid of its own)."""
  if open_up:
    _opened(path)
  return list(os.scandir(path))


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# A workspace deeper than this many directories is past its bounds (a walk holds a
# descriptor a level).
MAX_DEPTH = 256


def open_dir(name: str, dir_fd: Optional[int], open_up: bool = True) -> int:
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


class TooDeep(Exception):
  pass


def walk(root: str, open_up: bool = True, max_depth: int = MAX_DEPTH,
          shut: Optional[list] = None):
  """Every entry under directory `root`, depth first, by descriptors (`open_dir`; an
  entry's `stat` reads it in its directory); what cannot be opened is skipped (and, with
  `shut`, what its mode shuts to this process is named there, `root` itself included).
  `TooDeep` past `max_depth` levels. One descriptor is held a level."""
  frames: list = []  # [descriptor, subdirectories still to walk, depth]
  try:
    fd: Optional[int] = open_dir(root, None, open_up)
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
        raise TooDeep
      try:
        fd, depth = open_dir(name, parent, open_up), level + 1
      except OSError as e:
        fd = None
        if shut is not None and isinstance(e, PermissionError):
          shut.append(name)
  finally:
    for frame in frames:
      os.close(frame[0])
    if fd is not None:
      os.close(fd)


def remove_tree(path: str, keep_root: bool = False) -> None:
  """Removes what is under directory `path`, and `path` unless `keep_root`, by
  descriptors and without recursion: each subdirectory's entries are moved up into
  `path` (renamed) until none is left, so any depth is removed holding two descriptors
  (`shutil.rmtree` raised RecursionError past ~1000 levels, and skipped names past
  PATH_MAX: what they held stayed on the host's disk, red team 30); directories whose
  mode shuts their owner out are opened first. Never raises: what cannot be removed is
  logged."""
  tag, n, last = uuid.uuid4().hex[:8], 0, None
  try:
    root = open_dir(path, None)
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
            sub = open_dir(name, root)
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
                  os.close(open_dir(child, sub))
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
def named(rel: str):
  """A host-side file operation's OSError names the workspace's path `rel`, not the
  host's: tool errors reach the policy, and the host's path told it the host's layout
  (with a held tmpfs, its holder's pid: red team 6)."""
  try:
    yield
  except OSError as e:
    if e.errno is None:
      raise
    raise OSError(e.errno, e.strerror, rel) from None


def realpath_in(root: str, path: str, most_links: int = 40) -> str:
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


def check_traversable(path: str) -> None:
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


def digest(path: str, budget: int) -> tuple[str, int, str]:
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

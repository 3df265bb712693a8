"""How a sandbox's commands are isolated on this host (`envs.sandbox` runs them).

- The modes, strongest first (`available_isolations`): `bwrap` (bubblewrap's
  namespaces), `mountns` (the same view built by hand with util-linux as root) and
  `rlimits` (limits only); `wrap` puts a command inside the one chosen.
- What a sandbox sees of the host: /usr and /etc read-only, the environments' own code
  under them hidden (`hidden_paths`), a scrubbed environment.
- The seccomp filter both namespace modes install (`SECCOMP_DENIED`).
- Resource limits (`Limits`; `confine`: prlimit). The memory and CPU cgroups that bound
  a sandbox's processes together, where the host allows them, and the kernel's OOM
  kills told apart, are `envs.cgroups`.
- Host-unique sandbox uids (`UidLease`).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import fcntl
import functools
import json
import logging
import os
import resource
import select
import shlex
import shutil
import subprocess
import tempfile
import time
from typing import Optional, Sequence

from jaxagent.errors import InfraError

log = logging.getLogger(__name__)


@functools.cache
def warn_once(message: str) -> None:
  """Logs `message` as a warning, once a process."""
  log.warning(message)


SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"


_HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


_PRLIMIT = shutil.which("prlimit", path=_HOST_PATH) or "prlimit"


SETPRIV = shutil.which("setpriv", path=_HOST_PATH) or "setpriv"


UID_BASE = 100_000


UID_COUNT = 50_000


ISOLATIONS = ("bwrap", "mountns", "rlimits")


UID_LOCK_DIR = "/run/jaxagent-sandbox-uids" if os.path.isdir("/run") else os.path.join(
    tempfile.gettempdir(), "jaxagent-sandbox-uids")


_SYSTEM_DIRS = ("/usr", "/etc")


_ROOT_LINKS = ("/bin", "/lib", "/lib64", "/sbin", "/lib32", "/libx32")


_DEVICES = ("null", "zero", "full", "random", "urandom")


def hidden_paths() -> list[tuple[str, bool]]:
  """(path, is a directory) of the environments' own code and data that lie under the
  system directories a sandbox shows: the `envs` package and the package (or module
  file and its compiled copies) of every registered environment. A pip install (the
  image's) puts them under /usr, where tool code could read a task's hidden cases and
  reference solution; the sandbox mounts an empty directory or file over each."""
  import importlib.util
  import sys

  from envs.base import ENVS

  names = {"envs", *(getattr(c, "__module__", "") for c in ENVS.values())}
  found: dict[str, bool] = {}
  for name in sorted(n for n in names if n):
    top = sys.modules.get(name.split(".")[0])
    path = getattr(top, "__file__", None)
    if path is None:
      continue
    if os.path.basename(path) == "__init__.py":
      found[os.path.realpath(os.path.dirname(path))] = True
    else:
      found[os.path.realpath(path)] = False
      try:
        cached = importlib.util.cache_from_source(path)
      except (NotImplementedError, ValueError):
        cached = None
      if cached is not None:
        stem = os.path.basename(cached).split(".")[0]
        folder = os.path.dirname(cached)
        for f in (os.listdir(folder) if os.path.isdir(folder) else ()):
          if f.split(".")[0] == stem and f.endswith(".pyc"):
            found[os.path.realpath(os.path.join(folder, f))] = False
  shown = [os.path.realpath(d) for d in _SYSTEM_DIRS]
  return sorted((p, is_dir) for p, is_dir in found.items()
                if any(p.startswith(d + os.sep) for d in shown))


_OWNER: Optional[tuple[str, int]] = None  # (this process's tag, its lock's descriptor)


def owner_tag() -> str:
  """`<pid>-<8 hex digits>`: what names the folders this process leaves in the temporary
  directory (`jaxagent-<kind>-<tag>-...`). Its lock file there, `jaxagent-owner-<tag>.lock`,
  is held (flock) for the process's life: a sweep by a worker in another PID namespace,
  where this pid says nothing, tells by it that the folders' owner is alive
  (`envs.pool.remove_left_by_dead_workers`)."""
  global _OWNER
  if _OWNER is None or not _OWNER[0].startswith(f"{os.getpid()}-"):  # (a fork: its own)
    tag = f"{os.getpid()}-{os.urandom(4).hex()}"
    path = os.path.join(tempfile.gettempdir(), f"jaxagent-owner-{tag}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    atexit.register(lambda: os.path.exists(path) and os.unlink(path))
    _OWNER = (tag, fd)
  return _OWNER[0]


@functools.lru_cache(maxsize=None)
def _empty_file() -> str:
  """An empty read-only file of this process's own, mounted over hidden module files."""
  folder = tempfile.mkdtemp(prefix=f"jaxagent-sandbox-empty-{owner_tag()}-")
  atexit.register(shutil.rmtree, folder, True)  # (one a process: it was left in /tmp)
  os.chmod(folder, 0o755)
  path = os.path.join(folder, "empty")
  os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444))
  return path


class IsolationUnavailable(RuntimeError):
  """The host cannot isolate untrusted code and unisolated execution was not allowed."""


@dataclasses.dataclass(frozen=True)
class Limits:
  wall_s: float = 10.0
  # CPU seconds per process. A run's CPU limit is never below its wall timeout + 1 s, so a
  # busy loop meets the wall timeout first and is a timeout, not a crash.
  cpu_s: int = 10
  memory_bytes: int = 1 << 30  # address space
  # Per sandbox: its uid's (as root), its user namespace's (bwrap, not root; see
  # `_bwrap_argv`)
  processes: int = 64
  file_bytes: int = 16 << 20  # largest file a command may write (stdout/stderr included)
  open_files: int = 256
  output_budget: int = 16 << 10  # bytes of stdout/stderr kept in the record
  # The workspace's quota, as root: a tmpfs, so it counts against memory (at most
  # sessions x disk_bytes).
  disk_bytes: int = 32 << 20
  tmp_bytes: int = 16 << 20  # the private /tmp and /dev/shm
  # Files and directories in the workspace, /tmp and /dev/shm each (as root): each costs
  # kernel memory that the tmpfs size does not count.
  max_inodes: int = 16384
  write_bytes: int = 1 << 20  # largest file the host writes for a tool call
  # Memory of all a sandbox's processes together (its tmpfs pages included): a memory
  # cgroup, where the host allows one (root, a writable memory controller; not root, a
  # cgroup delegated to the worker: `SandboxPool`'s `cgroup_parents`). Without it only
  # `memory_bytes` per process holds, `processes` times over, and the kernel's buffers
  # of their pipes and sockets are not bounded (docs/environments.md).
  group_memory_bytes: int = 1 << 30
  # TCP and UDP buffers of all a sandbox's processes together, within group_memory_bytes:
  # cgroup v1 counts them only where a memory cgroup's memory.kmem.tcp.limit_in_bytes is
  # set, and else only against the host-wide net.ipv4.tcp_mem / udp_mem, which one
  # sandbox took to its hard limit (the host's loopback round trips went 2 ms -> 2 s; red
  # team). cgroup v2 counts them in memory.max. 0: not set.
  socket_bytes: int = 64 << 20
  # CPU time all a sandbox's processes get together, in CPUs (a CPU cgroup's quota, where
  # the host allows one; 0: unbounded): 64 busy processes of one sandbox must not starve
  # the host's other sandboxes and graders (their start-up would time out: infra errors).
  cpus: float = 1.0


# -- isolation modes ------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def available_isolations() -> tuple[str, ...]:
  """Every isolation mode that works on this host, strongest first ("rlimits" always)."""
  modes = []
  probe = tempfile.mkdtemp(prefix="jaxagent-probe-")
  try:
    os.chmod(probe, 0o755)
    uid = UID_BASE if os.geteuid() == 0 else None
    for mode in ("bwrap", "mountns"):
      if mode == "bwrap" and not shutil.which("bwrap"):
        continue
      if mode == "mountns" and not (os.geteuid() == 0 and all(
          shutil.which(t, path=_HOST_PATH) for t in ("unshare", "chroot", "setpriv", "mount"))):
        continue
      try:
        r = subprocess.run(confine(Limits(), uid if mode == "bwrap" else None,
                                    nproc=not nproc_inside(mode, uid))
                           + wrap(mode, probe, ["/bin/true"], uid=uid, limits=Limits(),
                                   run_dir=probe),
                           env=scrubbed_env("/workspace"), capture_output=True, timeout=20)
        if r.returncode == 0:
          modes.append(mode)
      except (OSError, subprocess.SubprocessError):
        pass
  finally:
    shutil.rmtree(probe, ignore_errors=True)
  return tuple(modes) + ("rlimits",)


def detect_isolation() -> str:
  """The strongest isolation that works on this host: bwrap, mountns or rlimits."""
  return available_isolations()[0]


def scrubbed_env(home: str) -> dict:
  return {"PATH": SANDBOX_PATH, "HOME": home, "TMPDIR": "/tmp", "LANG": "C.UTF-8",
          "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}


# Syscalls tool code never needs and that open the kernel's rarely used, often attacked
# surface (Docker's default profile refuses much the same): they fail with EPERM.
SECCOMP_DENIED = (
    "acct", "add_key", "bpf", "clock_adjtime", "clock_settime", "delete_module",
    "finit_module", "fsconfig", "fsmount", "fsopen", "fspick", "init_module",
    "io_uring_enter", "io_uring_register", "io_uring_setup", "ioperm", "iopl", "kcmp",
    "kexec_file_load", "kexec_load", "keyctl", "lookup_dcookie", "mount", "mount_setattr",
    "move_mount", "name_to_handle_at", "open_by_handle_at", "open_tree", "open_tree_attr",
    "perf_event_open",
    "pivot_root", "process_vm_readv", "process_vm_writev", "ptrace", "quotactl",
    "quotactl_fd", "reboot", "request_key", "setns", "settimeofday", "swapoff", "swapon",
    "syslog", "umount2", "unshare", "uselib", "userfaultfd", "vhangup",
    # Memory that no process's address space holds, so that RLIMIT_AS does not bound it
    # where no memory cgroup does (a worker that is not root): a memfd written and never
    # mapped, a SysV shared memory segment or message queue that outlives its attachments.
    # A red team's solution held 2 GiB so with 9 MB resident; having lowered its
    # oom_score_adj, it brought the host's OOM killer onto the worker (an infrastructure
    # error: its wrong answer re-rolled). POSIX shared memory (/dev/shm: a tmpfs of
    # `Limits.tmp_bytes`) and semaphores, which multiprocessing uses, stay.
    "memfd_create", "memfd_secret", "msgget", "shmat", "shmget")


# clone() asking for a new namespace of any kind fails too; clone3 (whose flags sit in
# memory a filter cannot read) answers ENOSYS, so that libc falls back to clone().
_CLONE_NEW_NAMESPACES = 0x7E02_0080  # CLONE_NEW{NS,CGROUP,UTS,IPC,USER,PID,NET,TIME}
FALLOC_FL_KEEP_SIZE = 1
_POSIX_FADV_DONTNEED, _MADV_COLD, _MADV_PAGEOUT = 4, 20, 21
_PR_SET_DUMPABLE = 4
_XATTR_SETTERS = ("setxattr", "lsetxattr", "fsetxattr", "setxattrat")


@functools.cache
def seccomp_program(dumpable: bool = True) -> Optional[bytes]:
  """The compiled filter (BPF, for this host's architecture; other ABIs' syscalls kill
  the process), or None where libseccomp is missing. Kept in memory: each command gets
  its own copy (nothing on disk that a cleaner could remove from under a worker).
  `dumpable`: prctl(PR_SET_DUMPABLE, 0) answers success and does nothing (ssh-agent and
  gpg-agent call it, and a process that is not dumpable hides its files from a non-root
  worker's disk watch, which stops it); False for a command whose trusted init must not
  be dumpable (the grader's harness: `Sandbox.run`'s trusted_init)."""
  if (made := _new_filter()) is None:
    return None
  flt, sc = made
  eperm = sc.ERRNO(errno.EPERM)
  for name in SECCOMP_DENIED:
    _deny(flt, eperm, name)
  for bit in range(32):  # any one of them set
    flag = 1 << bit
    if flag & _CLONE_NEW_NAMESPACES:
      flt.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
  with contextlib.suppress(ValueError, RuntimeError, OSError):
    flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
  # Resource limits of another process: a solution lowered its grader's (the init of
  # its namespace, same uid) RLIMIT_FSIZE, and the grader died writing its report, an
  # infrastructure error instead of its fail. A process's own (pid 0, as setrlimit and
  # util-linux prlimit pass it) stay its own to set.
  with contextlib.suppress(ValueError, RuntimeError, OSError):
    flt.add_rule(eperm, "prlimit64", sc.Arg(0, sc.NE, 0))
  # fallocate only as posix_fallocate calls it (mode 0, bounded by RLIMIT_FSIZE) or to
  # punch a hole (FALLOC_FL_PUNCH_HOLE | KEEP_SIZE: frees blocks): KEEP_SIZE alone takes
  # blocks past a file's length and INSERT_RANGE grows a file past RLIMIT_FSIZE (8 GiB in
  # one file, red team), where a non-root worker's disk watch counts a file it may not
  # size (mapped, its descriptor closed) at the most a file may take
  # (`envs.diskwatch.unlinked_bytes`). EOPNOTSUPP: callers take it for a filesystem
  # without the mode.
  with contextlib.suppress(ValueError, RuntimeError, OSError):
    flt.add_rule(sc.ERRNO(errno.EOPNOTSUPP), "fallocate", sc.Arg(1, sc.EQ, FALLOC_FL_KEEP_SIZE))
    for bit in range(2, 32):
      flt.add_rule(sc.ERRNO(errno.EOPNOTSUPP), "fallocate",
                   sc.Arg(1, sc.MASKED_EQ, 1 << bit, 1 << bit))
  # Advice that drops pages of the host's page cache, of files any sandbox reads (the
  # interpreter's own: 1,406 of /usr's files dropped by one command, red team 44), so
  # that other sandboxes' commands read them from the disk again: success, doing
  # nothing, as advice may be ignored (64-bit ABIs' argument orders).
  with contextlib.suppress(ValueError, RuntimeError, OSError):
    flt.add_rule(sc.ERRNO(0), "fadvise64", sc.Arg(3, sc.EQ, _POSIX_FADV_DONTNEED))
  with contextlib.suppress(ValueError, RuntimeError, OSError):
    for advice in (_MADV_COLD, _MADV_PAGEOUT):
      flt.add_rule(sc.ERRNO(0), "madvise", sc.Arg(2, sc.EQ, advice))
  with contextlib.suppress(ValueError, RuntimeError, OSError):  # (another process's, or
    # its own through a pidfd: a reviewer)
    for advice in (_MADV_COLD, _MADV_PAGEOUT):
      flt.add_rule(sc.ERRNO(0), "process_madvise", sc.Arg(3, sc.EQ, advice))
  # Extended attributes are kernel memory that a tmpfs's size does not count: a red
  # team's one process stored 3 GiB of them on each of /tmp and /dev/shm in 7 s (a
  # non-root worker has no memory cgroup to charge them to). EOPNOTSUPP, as a filesystem
  # without them answers: copies that keep attributes (shutil.copy2, cp -a) go on.
  for name in _XATTR_SETTERS:
    _deny(flt, sc.ERRNO(errno.EOPNOTSUPP), name)
  if dumpable:
    _keep_dumpable(flt, sc)
  return _compiled(flt)


@functools.cache
def seccomp_keep_dumpable() -> Optional[bytes]:
  """A filter of its own, stacked on a command's, under which prctl(PR_SET_DUMPABLE, 0)
  answers success and does nothing: a trusted init that made itself not dumpable loads it
  for the processes it starts (the grader's harness: a solution's tests that started
  ssh-agent stopped its grading). None where libseccomp is missing."""
  if (made := _new_filter()) is None:
    return None
  flt, sc = made
  _keep_dumpable(flt, sc)
  return _compiled(flt)


# Syscalls newer than the libseccomp that may compile the filter (2.5.4 names neither:
# its rule for "setxattrat" failed, unsaid, and POSIX ACLs set through it held 77 MB of
# the host's kernel memory in 0.12 s, red team 7), by the number every architecture but
# alpha gives them (the kernel's shared table from 424 on).
_NEW_SYSCALLS = {"setxattrat": 463, "open_tree_attr": 467}


def _deny(flt, action, name: str) -> None:
  """A rule that answers `action` to syscall `name`: by its number where this libseccomp
  does not know the name; nothing where the architecture has no such syscall."""
  try:
    flt.add_rule(action, name)
  except (ValueError, RuntimeError, OSError):
    if name in _NEW_SYSCALLS:
      with contextlib.suppress(ValueError, RuntimeError, OSError):
        flt.add_rule(action, _NEW_SYSCALLS[name])


def _new_filter():
  """(an empty filter that allows every syscall, the pyseccomp module), or None where
  libseccomp is missing."""
  try:
    import pyseccomp as sc  # ctypes over the system's libseccomp.so.2
    return sc.SyscallFilter(defaction=sc.ALLOW), sc
  except (ImportError, OSError, RuntimeError):
    return None


def _keep_dumpable(flt, sc) -> None:
  with contextlib.suppress(ValueError, RuntimeError, OSError):
    flt.add_rule(sc.ERRNO(0), "prctl", sc.Arg(0, sc.EQ, _PR_SET_DUMPABLE), sc.Arg(1, sc.EQ, 0))


def _compiled(flt) -> bytes:
  with tempfile.TemporaryFile() as f:
    flt.export_bpf(f)
    f.seek(0)
    return f.read()


def seccomp_program_fd(program: bytes) -> int:
  """A fresh in-memory file holding `program`, at offset 0 (bwrap reads it to the end)."""
  fd = os.memfd_create("jaxagent-seccomp")
  os.write(fd, program)
  os.lseek(fd, 0, os.SEEK_SET)
  return fd


# Installs the filter at /.seccomp.bpf (inside the mountns root), then execs the rest:
# what bubblewrap's --seccomp does, for the mode built by hand.
_SECCOMP_LOADER = """\
import ctypes, os, sys
data = open("/.seccomp.bpf", "rb").read()
class Prog(ctypes.Structure):
  _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
buf = ctypes.create_string_buffer(data, len(data))
prog = Prog(len(data) // 8, ctypes.cast(buf, ctypes.c_void_p))
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.byref(prog), 0, 0):
  sys.exit("seccomp: " + os.strerror(ctypes.get_errno()))
os.execv(sys.argv[1], sys.argv[1:])
"""


@functools.cache
def _bwrap_can_disable_userns() -> bool:
  """bubblewrap >= 0.8 can stop the sandbox from creating user namespaces of its own."""
  try:
    r = subprocess.run(["bwrap", "--help"], capture_output=True, text=True, timeout=10)
  except (OSError, subprocess.SubprocessError):
    return False
  return "--disable-userns" in r.stdout + r.stderr


def nproc_inside(mode: str, uid: Optional[int]) -> bool:
  """Whether a sandbox's process limit is set inside it rather than by `confine`: under
  bubblewrap without a uid of its own (a worker that is not root), inside its user
  namespace, where the kernel (5.14 on) counts only that sandbox's processes against it.
  Set outside, it would count every process and thread of the worker's user on the host
  (the worker's own, every other sandbox's): one sandbox holding its limit would stop
  every other from starting (graders: infra errors). The kernel still counts each user
  namespace above a sandbox's against the limit its maker had: the worker's user on the
  host, all of its processes (threads, held tmpfs holders, every sandbox's), against the
  worker's own limit (`nproc_room`)."""
  return mode == "bwrap" and uid is None


def nproc_room(need: int) -> None:
  """Raises this process's RLIMIT_NPROC (`ulimit -u`) to its hard limit, which the user
  namespaces its sandboxes are made in take as theirs: under a finite one (100), two
  sandboxes of 60 processes got 54 and 31, and the worker's next thread failed (red team
  6). Says so where even the hard limit is below `need`, what the worker's sandboxes
  may run together."""
  soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
  if soft != hard:
    with contextlib.suppress(ValueError, OSError):
      resource.setrlimit(resource.RLIMIT_NPROC, (hard, hard))
  if hard != resource.RLIM_INFINITY and hard < need:
    warn_once(f"sandbox: this user's process limit (RLIMIT_NPROC, ulimit -u) is {hard}, "
               f"below the {need} processes the worker and its sandboxes may run: a "
               "sandbox's fork fails (its command's failure) once the user's processes on "
               "the host reach it; raise the hard limit, or run fewer sandboxes at once")


def _bwrap_argv(workspace: str, argv: Sequence[str], limits: Limits, pid1: bool,
                seccomp_fd: Optional[int] = None, uid: Optional[int] = None,
                held: Optional[HeldTmpfs] = None, status_fd: Optional[int] = None) -> list[str]:
  if nproc_inside("bwrap", uid):
    argv = [_PRLIMIT, f"--nproc={limits.processes}", "--", *argv]
  out = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv"]
  if status_fd is not None:
    # bwrap writes `"exit-code"` there once the command has ended, only if its setup
    # finished and the command was exec'd (`setup_finished`); the command never holds
    # the descriptor, so it cannot write one.
    out += ["--json-status-fd", str(status_fd)]
  if held is not None:
    # Inside the holder's user namespace the worker is its root: the command runs as the
    # worker's own ids, as it would without one, with every capability dropped; its /tmp
    # and /dev/shm are the holder's tmpfs mounts, bounded in inodes too (`HeldTmpfs`).
    out = held.enter() + out + [
        "--uid", str(os.getuid()), "--gid", str(os.getgid()), "--cap-drop", "ALL"]
  if seccomp_fd is not None:  # bwrap installs it (with no_new_privs) just before the exec
    out += ["--seccomp", str(seccomp_fd)]
  if _bwrap_can_disable_userns():
    # No nested user namespaces: the kernel surface they open (mounts, capabilities
    # within them) is closed to tool code.
    out += ["--unshare-user", "--disable-userns"]
  if pid1:
    out.append("--as-pid-1")
  for path in _SYSTEM_DIRS:
    out += ["--ro-bind", path, path]
  for path, is_dir in hidden_paths():  # (the environments' own code: an empty view)
    out += (["--perms", "0555", "--tmpfs", path, "--remount-ro", path] if is_dir
            else ["--ro-bind", _empty_file(), path])
  for path in _ROOT_LINKS:
    if os.path.islink(path):
      out += ["--symlink", os.readlink(path), path]
    elif os.path.isdir(path):
      out += ["--ro-bind", path, path]
  out += ["--proc", "/proc", "--dev", "/dev"]
  for path, held_at in (("/tmp", held and held.tmp), ("/dev/shm", held and held.shm)):
    out += (["--bind", held_at, path] if held_at else
            ["--size", str(limits.tmp_bytes), "--tmpfs", path])
  out += [# (/dev is a tmpfs of half the host's memory: a command wrote 1 GiB there, red
          # team 30; its devices work read-only, /dev/shm is a mount of its own)
          "--remount-ro", "/dev",
          "--bind", workspace, "/workspace", "--remount-ro", "/"]
  for k, v in scrubbed_env("/workspace").items():
    out += ["--setenv", k, v]
  # Into the workspace once exec'd, not by bwrap's `--chdir` (its setup, run as the
  # command's uid): a command that took its workspace's permissions away (`chmod 000
  # /workspace`) failed the next one's setup, an infrastructure error it could buy at
  # will (a reviewer); its own doing now, as the command's exit.
  return out + ["--", "/bin/sh", "-c", 'cd /workspace && exec "$@"', "sandbox", *argv]


def setup_finished(status: bytes) -> bool:
  """Whether bwrap's `--json-status-fd` output `status` says its command was exec'd (an
  `"exit-code"` document, written at the command's end, only after a finished setup)."""
  for line in status.decode(errors="replace").splitlines():
    with contextlib.suppress(ValueError):
      document = json.loads(line)
      if isinstance(document, dict) and "exit-code" in document:
        return True
  return False


_NSENTER = shutil.which("nsenter", path=_HOST_PATH) or "nsenter"
_UNSHARE = shutil.which("unshare", path=_HOST_PATH) or "unshare"


class HeldTmpfs:
  """A tmpfs of `size` bytes and at most `inodes` files at `path`, for a worker that is
  not root: mounted in a mount namespace of a user namespace the worker owns (what
  bubblewrap itself needs of the kernel), which one process holds (`unshare`, then a
  `cat` that reads a pipe only the worker writes: it ends when `close` closes that pipe,
  or when the worker dies, and the filesystem with it).

  The host reaches it at `self.root + path` (the holder's `/proc/<pid>/root`: the
  worker may, the holder being its own, dumpable process), never at `path` itself,
  where the host sees the empty directory under it. A command joins the holder's
  namespaces first (`enter`), then bubblewrap binds `path` as the workspace. Its files
  take the worker's memory, as a root worker's tmpfs does, not the host's disk: no
  command can write more than `size` there, hide what it wrote from a look, or leave
  it in flight once the holder is gone."""

  def __init__(self, path: str, size: int, inodes: int, timeout: float = 10.0,
               scratch: Optional[str] = None, tmp_size: int = 0):
    self.path = path
    # With `scratch` (a directory of the worker's), the commands' /tmp and /dev/shm too:
    # tmpfs mounts of `tmp_size` and `inodes` over two empty directories there, seen in
    # the holder's namespace only, emptied after each command (`Sandbox.run`).
    # Bubblewrap's own `--tmpfs` bounds no inodes: a red team's 1.5M empty files there
    # took 6.85 GB of the host's kernel memory in 13 s.
    self.tmp = self.shm = None
    mounts = [("jaxagent-ws", f"size={size},nr_inodes={inodes},mode=0700,nosuid,nodev", path)]
    if scratch is not None:
      self.tmp, self.shm = os.path.join(scratch, "tmp"), os.path.join(scratch, "shm")
      for label, d in (("jaxagent-tmp", self.tmp), ("jaxagent-shm", self.shm)):
        os.makedirs(d, mode=0o700, exist_ok=True)
        mounts.append((label, f"size={tmp_size},nr_inodes={inodes},mode=1777,nosuid,nodev",
                       d))
    self._proc = subprocess.Popen(
        [_UNSHARE, "--user", "--map-root-user", "--mount", "--propagation", "private",
         "--", "/bin/sh", "-c",
         'while [ $# -gt 0 ]; do mount -t tmpfs -o "$2" "$1" "$3" || exit 1; shift 3; done; '
         'echo up; exec cat >/dev/null',
         "holder", *[part for mount in mounts for part in mount]],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True, bufsize=0)  # (unbuffered: `select` sees every line)
    said, deadline = b"", time.monotonic() + timeout
    while not said.endswith(b"up\n"):  # (whatever came before: a preload's noise)
      left = deadline - time.monotonic()
      if left <= 0 or not select.select([self._proc.stdout], [], [], left)[0]:
        said += b"(no answer in time)"
        break
      line = self._proc.stdout.readline()
      if not line:  # (it ended)
        break
      said += line
    if not said.endswith(b"up\n"):
      self.close()  # (not read past here: the holder, had it mounted, waits in `cat`)
      raise IsolationUnavailable(
          f"could not mount a tmpfs for {path} in a user namespace of this user: "
          f"{said.decode(errors='replace').strip()[-2000:]}")
    self._proc.stdout.close()
    self.root = f"/proc/{self.pid}/root"  # (the pid stays ours until `close` reaps it)

  def enter(self) -> list[str]:
    """The command prefix that joins the holder's user and mount namespaces."""
    return [_NSENTER, "-t", str(self.pid), "--user", "--mount",
            "--preserve-credentials", "--"]

  @property
  def pid(self) -> int:
    return self._proc.pid

  def _ended(self):
    """How the holder ended (a `waitid` result), or None. It is left unreaped: its pid
    stays this process's, so `root` never names another process's root."""
    if self._proc.returncode is not None:
      return self._proc.returncode
    try:
      return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
      return -1

  @property
  def alive(self) -> bool:
    return self._ended() is None

  def ends_within(self, timeout_s: float) -> bool:
    """Whether the holder is seen ended within `timeout_s` (a holder being killed has
    lost its root before its exit can be waited for)."""
    deadline = time.monotonic() + timeout_s
    while self.alive:
      if time.monotonic() >= deadline:
        return False
      time.sleep(0.01)
    return True

  @property
  def exit_code(self) -> Optional[int]:
    ended = self._ended()
    return ended if ended is None or isinstance(ended, int) else (
        ended.si_status if ended.si_code == os.CLD_EXITED else -ended.si_status)

  def close(self, timeout: float = 5.0) -> None:
    """Ends the holder: the tmpfs goes with its namespace (once nothing still in it
    holds it)."""
    for pipe in (self._proc.stdin, self._proc.stdout):
      with contextlib.suppress(OSError):
        pipe.close()
    try:
      self._proc.wait(timeout)
    except subprocess.TimeoutExpired:
      self._proc.kill()
      self._proc.wait()


def held_tmpfs_works() -> bool:
  """Whether this user (not root) can hold a workspace's tmpfs (`HeldTmpfs`) and run
  bubblewrap inside it (`held_tmpfs_refused` says why not)."""
  return held_tmpfs_refused() is None


@functools.cache
def held_tmpfs_refused() -> Optional[str]:
  """Why this user cannot hold a workspace's tmpfs and run bubblewrap inside it (the
  kernel lets it create no user namespace, or `unshare`, `nsenter` or bwrap is not
  there), or None where it can. Tried once a process; where it cannot, the reason is
  logged and workspaces fall back to the disk watch (`envs.diskwatch`)."""
  if os.geteuid() == 0:
    return "as root a workspace is a tmpfs mounted on the host"
  folder = tempfile.mkdtemp(prefix="jaxagent-held-probe-")
  held = None
  try:
    os.mkdir(os.path.join(folder, "ws"), 0o700)
    held = HeldTmpfs(os.path.join(folder, "ws"), 1 << 20, 64)
    with open(held.root + held.path + "/probe", "w") as f:
      f.write("held")
    r = subprocess.run(held.enter() + ["bwrap", "--unshare-all", "--ro-bind", "/", "/",
                                       "--uid", str(os.getuid()), "--cap-drop", "ALL",
                                       "--", "/bin/cat", held.path + "/probe"],
                       capture_output=True, timeout=30)
    if r.returncode != 0 or r.stdout != b"held":
      raise IsolationUnavailable(f"bwrap inside it: exit {r.returncode}, "
                                 f"{r.stderr.decode(errors='replace').strip()}")
    return None
  except (OSError, subprocess.SubprocessError, IsolationUnavailable) as e:
    log.warning("sandbox: workspaces get no filesystem of their own (%s); the disk watch "
                "bounds them instead", e)
    return str(e)
  finally:
    if held is not None:
      held.close()
    shutil.rmtree(folder, ignore_errors=True)


# Written by the mountns setup script beside the private root just before it enters
# it: a run that exits without it failed in the setup (the infrastructure), not in the
# command (which cannot reach the file: it is outside its root).
SETUP_DONE = "setup-done"


def system_python() -> Optional[str]:
  """A Python interpreter under the system directories a sandbox sees: Debian's, or the
  official python image's (/usr/local: the mountns mode's seccomp loader needs one, and
  the image has no /usr/bin/python3, so its sandboxes ran unfiltered)."""
  for path in ("/usr/bin/python3", "/usr/local/bin/python3"):
    if os.path.exists(path):
      return path
  return None


def _mountns_script(root: str, workspace: str, uid: int, limits: Limits,
                    seccomp: Optional[str] = None) -> str:
  """Shell run as root inside fresh namespaces: builds a private root at `root` (only
  read-only system directories, private /proc, /dev, /tmp, /dev/shm and the workspace),
  then enters it as `uid` with no capabilities and execs the command ("$@")."""
  q = shlex.quote
  # The host's tools by absolute path (the scrubbed PATH has no sbin).
  lines = ["set -e", f"export PATH={q(_HOST_PATH)}", f"mount -t tmpfs -o mode=0755,size=1m jaxagent-root {q(root)}"]
  for path in _SYSTEM_DIRS:
    lines += [f"mkdir -p {q(root + path)}", f"mount --rbind {q(path)} {q(root + path)}",
              f"mount -o remount,bind,ro {q(root + path)}"]
  for path, is_dir in hidden_paths():  # (the environments' own code: an empty view)
    lines.append(f"mount -t tmpfs -o ro,mode=0555,size=4k jaxagent-hidden {q(root + path)}"
                 if is_dir else f"mount --bind {q(_empty_file())} {q(root + path)}")
  for path in _ROOT_LINKS:
    if os.path.islink(path):
      lines.append(f"ln -s {q(os.readlink(path))} {q(root + path)}")
    elif os.path.isdir(path):
      lines += [f"mkdir {q(root + path)}", f"mount --rbind {q(path)} {q(root + path)}",
                f"mount -o remount,bind,ro {q(root + path)}"]
  dev = root + "/dev"
  lines += [f"mkdir {q(root + '/proc')} {q(dev)} {q(root + '/tmp')} {q(root + '/workspace')}",
            f"mount -t proc -o nosuid,nodev,noexec proc {q(root + '/proc')}",
            f"mount -t tmpfs -o mode=0755,size=64k,nosuid jaxagent-dev {q(dev)}"]
  for name in _DEVICES:
    lines += [f"touch {q(dev + '/' + name)}", f"mount --bind /dev/{name} {q(dev + '/' + name)}"]
  lines += [f"ln -s /proc/self/fd {q(dev + '/fd')}",
            f"ln -s /proc/self/fd/0 {q(dev + '/stdin')}",
            f"ln -s /proc/self/fd/1 {q(dev + '/stdout')}",
            f"ln -s /proc/self/fd/2 {q(dev + '/stderr')}",
            f"mkdir {q(dev + '/shm')}",
            f"mount -t tmpfs -o mode=1777,size={limits.tmp_bytes},nr_inodes={limits.max_inodes},"
            f"nosuid,nodev jaxagent-shm {q(dev + '/shm')}",
            f"mount -t tmpfs -o mode=1777,size={limits.tmp_bytes},nr_inodes={limits.max_inodes},"
            f"nosuid,nodev jaxagent-tmp {q(root + '/tmp')}",
            f"mount --bind {q(workspace)} {q(root + '/workspace')}"]
  loader, python = "", system_python()
  if seccomp is not None and python is not None:
    lines.append(f"cp {q(seccomp)} {q(root + '/.seccomp.bpf')}")
    loader = f"{q(python)} -I -S -c {q(_SECCOMP_LOADER)} "
  lines += [f"mount -o remount,ro,bind {q(root)}",
            f"touch {q(os.path.join(os.path.dirname(root), SETUP_DONE))}",
            # setpriv drops to the uid; no capabilities survive, nothing can regain them.
            f"export PATH={SANDBOX_PATH}",
            f"exec {q(shutil.which('chroot', path=_HOST_PATH))} {q(root)} {loader}"
            f"/usr/bin/setpriv --reuid={uid} --regid={uid} "
            "--clear-groups --inh-caps=-all --bounding-set=-all --no-new-privs -- "
            "/bin/sh -c 'cd /workspace && exec \"$@\"' sandbox \"$@\""]
  return "\n".join(lines)


def wrap(mode: str, workspace: str, argv: Sequence[str], *, uid: Optional[int],
          limits: Limits, run_dir: str, pid1: bool = False,
          seccomp_fd: Optional[int] = None, dumpable: bool = True,
          held: Optional[HeldTmpfs] = None, status_fd: Optional[int] = None) -> list[str]:
  """The host command that runs `argv` in `workspace` under isolation `mode` (the
  seccomp filter: bwrap's from `seccomp_fd`, mountns's `seccomp_program(dumpable)`
  written into `run_dir`). `held`: the workspace is that tmpfs, mounted at `workspace`
  in its holder's namespaces, which bwrap joins first (bwrap only). `status_fd`: where
  bwrap says the command's exit, once its setup finished (`setup_finished`)."""
  if mode == "bwrap":
    return _bwrap_argv(workspace, argv, limits, pid1, seccomp_fd, uid, held, status_fd)
  if held is not None:
    raise ValueError(f"a held workspace filesystem needs bwrap isolation, not {mode}")
  if mode == "mountns":
    if uid is None:
      raise ValueError("mountns isolation needs a sandbox uid (root)")
    root = os.path.join(run_dir, "root")
    os.makedirs(root, exist_ok=True)
    program, bpf = seccomp_program(dumpable), None
    if program is not None:
      bpf = os.path.join(run_dir, "seccomp.bpf")
      with open(bpf, "wb") as f:
        f.write(program)
    # --fork: the script is the new PID namespace's init, and so is the command it execs.
    return [_UNSHARE, "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child",
            "--propagation", "private", "--", "/bin/sh", "-c",
            _mountns_script(root, workspace, uid, limits, bpf), "sandbox", *argv]
  return list(argv)


def confine(limits: Limits, uid: Optional[int], cpu_s: Optional[int] = None,
             nproc: bool = True) -> list[str]:
  """The command prefix that sets the resource limits (the process limit unless not
  `nproc`), then drops to `uid` (util-linux `prlimit` and `setpriv`). A prefix, not a
  `preexec_fn`: Python code between fork and exec can deadlock in a process with other
  threads (JAX's), and without it the subprocess starts with vfork."""
  cpu = cpu_s or limits.cpu_s
  argv = [_PRLIMIT, "--core=0", f"--cpu={cpu}:{cpu + 1}",
          f"--as={limits.memory_bytes}", f"--fsize={limits.file_bytes}",
          f"--nofile={limits.open_files}", *[f"--nproc={limits.processes}"] * nproc, "--"]
  if uid is not None:
    argv += [SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
  return argv


# -- host-unique uids -----------------------------------------------------------------------


class UidLease:
  """A sandbox uid no other pool or worker on this host holds: an exclusive `flock` on
  `UID_LOCK_DIR/<uid>.lock`, kept until `release()` (or the holder's death)."""

  _next = 0  # where this process starts looking

  def __init__(self, first: int = UID_BASE + 1, count: int = UID_COUNT):
    os.makedirs(UID_LOCK_DIR, mode=0o700, exist_ok=True)
    for i in range(count):
      uid = first + (UidLease._next + i) % count
      fd = os.open(os.path.join(UID_LOCK_DIR, f"{uid}.lock"),
                   os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        os.close(fd)
        continue
      UidLease._next = (UidLease._next + i + 1) % count
      self.uid, self._fd = uid, fd
      return
    raise InfraError("sandbox", f"no free sandbox uid in {first}..{first + count - 1}")

  def release(self) -> None:
    if self._fd is not None:
      os.close(self._fd)
      self._fd = None


def processes_of(uid: int) -> list[int]:
  """Live (not zombie) processes owned by `uid`."""
  pids = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        if os.stat(f"/proc/{entry}").st_uid != uid:
          continue
        with open(f"/proc/{entry}/stat") as f:
          state = f.read().rsplit(")", 1)[1].split()[0]
        if state != "Z":
          pids.append(int(entry))
      except (FileNotFoundError, ProcessLookupError, IndexError):
        pass
  return pids

"""Isolated execution of untrusted commands in a per-episode workspace.

Each command runs as a subprocess with a wall-clock timeout and resource
limits (CPU seconds, address space, processes, file size, open files), a
scrubbed environment, and as much isolation as the host allows, strongest
first:

- `bwrap` (bubblewrap; `apt-get install bubblewrap`): a new user, network, PID,
  IPC and UTS namespace; a read-only view of /usr and /etc only (no /root, no
  /home, no project files, no /tmp) with the workspace the one writable
  directory, mounted at /workspace; an unprivileged uid of its own per
  sandbox; no capabilities. A network connection fails: the namespace has only
  a loopback with nothing listening.
- `netns-setuid` (root without bwrap; util-linux `unshare` and `setpriv`): a
  new network namespace and an unprivileged uid per sandbox. The host file
  system stays visible, so world-writable places (/tmp) stay writable and
  world-readable files readable.
- `rlimits` (neither): resource limits, timeouts and a scrubbed environment
  only; no network or file-system isolation.

`detect_isolation()` says which one this host gets. Every execution is
recorded (`ExecResult`): command, exit code or signal, duration, and stdout /
stderr cut to a budget with their full size and sha256.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from typing import Optional, Sequence

SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
UID_BASE = 100_000


@dataclasses.dataclass(frozen=True)
class Limits:
  wall_s: float = 10.0
  cpu_s: int = 10
  memory_bytes: int = 1 << 30  # address space
  processes: int = 64  # per sandbox uid
  file_bytes: int = 16 << 20  # largest file a command may write (stdout/stderr included)
  open_files: int = 256
  output_budget: int = 16 << 10  # bytes of stdout/stderr kept in the record


@dataclasses.dataclass
class ExecResult:
  command: list[str]
  exit_code: Optional[int]  # None when killed by a signal
  signal: Optional[int]
  duration_s: float
  timed_out: bool
  stdout: str
  stderr: str
  stdout_bytes: int
  stderr_bytes: int
  stdout_sha256: str
  stderr_sha256: str
  isolation: str
  error: Optional[str] = None  # the sandbox could not run the command (infrastructure)

  @property
  def ok(self) -> bool:
    return self.error is None and not self.timed_out and self.exit_code == 0

  @property
  def truncated(self) -> bool:
    return len(self.stdout.encode()) < self.stdout_bytes or len(self.stderr.encode()) < (
        self.stderr_bytes)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


@functools.lru_cache(maxsize=None)
def detect_isolation() -> str:
  """The strongest isolation that works on this host: bwrap, netns-setuid or rlimits."""
  if shutil.which("bwrap") and os.geteuid() == 0:
    probe = tempfile.mkdtemp(prefix="jaxagent-probe-")
    try:
      os.chown(probe, UID_BASE, UID_BASE)
      argv = _bwrap_argv(probe, ["/bin/true"])
      r = subprocess.run(argv, preexec_fn=_preexec(Limits(), UID_BASE), capture_output=True,
                         timeout=20)
      if r.returncode == 0:
        return "bwrap"
    except (OSError, subprocess.SubprocessError):
      pass
    finally:
      shutil.rmtree(probe, ignore_errors=True)
  if os.geteuid() == 0 and shutil.which("unshare") and shutil.which("setpriv"):
    r = subprocess.run(["unshare", "--net", "/bin/true"], capture_output=True)
    if r.returncode == 0:
      return "netns-setuid"
  return "rlimits"


def _bwrap_argv(workspace: str, argv: Sequence[str]) -> list[str]:
  out = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv"]
  for path in ("/usr", "/etc"):
    out += ["--ro-bind", path, path]
  for path in ("/bin", "/lib", "/lib64", "/sbin", "/lib32", "/libx32"):
    if os.path.islink(path):
      out += ["--symlink", os.readlink(path), path]
    elif os.path.isdir(path):
      out += ["--ro-bind", path, path]
  out += ["--proc", "/proc", "--dev", "/dev", "--bind", workspace, "/workspace",
          "--remount-ro", "/", "--chdir", "/workspace"]
  for k, v in _scrubbed_env("/workspace").items():
    out += ["--setenv", k, v]
  return out + ["--", *argv]


def _scrubbed_env(home: str) -> dict:
  return {"PATH": SANDBOX_PATH, "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
          "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}


def _preexec(limits: Limits, uid: Optional[int]):
  """Runs in the child before exec: resource limits, then drop to `uid`."""

  def fn():
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
    if uid is not None:
      os.setgroups([])
      os.setgid(uid)
      os.setuid(uid)

  return fn


def _processes_of(uid: int) -> list[int]:
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
  """A workspace directory and a way to run commands in it, isolated and limited."""

  def __init__(self, workspace: str, *, uid: Optional[int] = None,
               limits: Limits = Limits(), isolation: Optional[str] = None):
    self.host_path = os.path.abspath(workspace)
    os.makedirs(self.host_path, mode=0o700, exist_ok=True)
    self.isolation = isolation or detect_isolation()
    self.uid = uid if (uid is not None and os.geteuid() == 0
                       and self.isolation != "rlimits") else None
    self.limits = limits
    if self.uid is not None:
      _check_traversable(os.path.dirname(self.host_path))
    self.history: list[ExecResult] = []
    self._logs = tempfile.mkdtemp(prefix="jaxagent-logs-")  # outside the workspace
    self._own()

  # -- files (host side) -------------------------------------------------------------------

  @property
  def workdir(self) -> str:
    """The workspace as commands see it."""
    return "/workspace" if self.isolation == "bwrap" else self.host_path

  @property
  def python(self) -> str:
    """The interpreter inside the sandbox (the system Python: it is visible there)."""
    return "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else "python3"

  def _own(self) -> None:
    if self.uid is not None:
      for root, dirs, files in os.walk(self.host_path):
        for name in [root] + [os.path.join(root, n) for n in dirs + files]:
          os.lchown(name, self.uid, self.uid)

  def _resolve(self, rel: str) -> str:
    path = os.path.realpath(os.path.join(self.host_path, rel))
    if not (path == self.host_path or path.startswith(self.host_path + os.sep)):
      raise ValueError(f"path {rel!r} is outside the workspace")
    return path

  def write_file(self, rel: str, content: str | bytes) -> None:
    path = self._resolve(rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
      f.write(content.encode() if isinstance(content, str) else content)
    self._own()

  def read_file(self, rel: str) -> bytes:
    with open(self._resolve(rel), "rb") as f:
      return f.read()

  def files(self, max_bytes: int = 1 << 20) -> dict[str, bytes]:
    """A snapshot of the workspace's regular files (symlinks and huge files skipped)."""
    out = {}
    for root, _, names in os.walk(self.host_path):
      for name in names:
        path = os.path.join(root, name)
        if os.path.islink(path) or not os.path.isfile(path) or os.path.getsize(path) > max_bytes:
          continue
        with open(path, "rb") as f:
          out[os.path.relpath(path, self.host_path)] = f.read()
    return out

  def wipe(self) -> None:
    """Empties the workspace (and kills anything left running as its uid)."""
    self._kill_uid()
    for name in os.listdir(self.host_path):
      path = os.path.join(self.host_path, name)
      if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
      else:
        os.unlink(path)
    self.history.clear()

  def destroy(self) -> None:
    self._kill_uid()
    shutil.rmtree(self.host_path, ignore_errors=True)
    shutil.rmtree(self._logs, ignore_errors=True)

  def _kill_uid(self, timeout: float = 5.0) -> None:
    """Kills every process of the sandbox's uid (what a fork bomb or setsid left behind)
    and waits until they are gone, so the next command starts with a clean slate."""
    if self.uid is None:
      return
    deadline = time.time() + timeout
    while True:
      # `kill -1` as the sandbox uid signals exactly the processes of that uid.
      subprocess.run(["/bin/kill", "-KILL", "-1"], preexec_fn=_preexec(Limits(), self.uid),
                     capture_output=True)
      if not _processes_of(self.uid) or time.time() > deadline:
        return
      time.sleep(0.02)

  # -- execution ------------------------------------------------------------------------

  def _argv(self, argv: Sequence[str]) -> list[str]:
    if self.isolation == "bwrap":
      return _bwrap_argv(self.host_path, argv)
    if self.isolation == "netns-setuid":
      return ["unshare", "--net", "--", *argv]  # the uid drop happens in preexec
    return list(argv)

  async def run(self, argv: Sequence[str], *, timeout: Optional[float] = None,
                stdin: Optional[bytes] = None) -> ExecResult:
    """Runs `argv` in the workspace; never raises for the command's own failures."""
    argv = [str(a) for a in argv]
    wall = self.limits.wall_s if timeout is None else timeout
    tag = uuid.uuid4().hex[:8]
    out_path = os.path.join(self._logs, f"{tag}.out")
    err_path = os.path.join(self._logs, f"{tag}.err")
    t0 = time.perf_counter()
    timed_out, error, code, sig = False, None, None, None
    try:
      with open(out_path, "wb") as out, open(err_path, "wb") as err:
        # netns-setuid: `unshare` needs root, so the uid drop comes after it, via setpriv.
        command = self._argv(argv)
        uid = self.uid
        if self.isolation == "netns-setuid" and uid is not None:
          command = ["unshare", "--net", "--", "setpriv", f"--reuid={uid}", f"--regid={uid}",
                     "--clear-groups", "--", *argv]
          uid = None
        env = _scrubbed_env(self.workdir)
        proc = await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            stdout=out, stderr=err, cwd=self.host_path, env=env, start_new_session=True,
            preexec_fn=_preexec(self.limits, uid))
        try:
          await asyncio.wait_for(proc.communicate(stdin), timeout=wall)
        except asyncio.TimeoutError:
          timed_out = True
          await self._terminate(proc)
        rc = proc.returncode
        code, sig = (rc, None) if rc >= 0 else (None, -rc)
    except (OSError, ValueError) as e:  # could not start: an infrastructure failure
      error = f"{type(e).__name__}: {e}"
    finally:
      self._kill_uid()
    duration = time.perf_counter() - t0
    outs = [_digest(p, self.limits.output_budget) if os.path.exists(p) else ("", 0, "")
            for p in (out_path, err_path)]
    for p in (out_path, err_path):
      with contextlib.suppress(FileNotFoundError):
        os.unlink(p)
    result = ExecResult(argv, code, sig, duration, timed_out, outs[0][0], outs[1][0], outs[0][1],
                        outs[1][1], outs[0][2], outs[1][2], self.isolation, error)
    self.history.append(result)
    return result

  async def _terminate(self, proc) -> None:
    """Kills a timed-out command so that its own parent reaps it (no orphans, no zombies)."""
    if self.isolation == "bwrap":
      # Killing the PID namespace's init takes down everything inside; bwrap reaps
      # it and exits.
      for child in _children(proc.pid):
        with contextlib.suppress(ProcessLookupError):
          os.kill(child, signal.SIGKILL)
    elif self.uid is not None:
      self._kill_uid()
    else:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
      await asyncio.wait_for(proc.wait(), timeout=5)
    except asyncio.TimeoutError:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
      await proc.wait()

  async def run_python(self, code: str, *, timeout: Optional[float] = None,
                       filename: str = "_run.py") -> ExecResult:
    self.write_file(filename, code)
    return await self.run([self.python, filename], timeout=timeout)

  def describe(self) -> dict:
    return {"isolation": self.isolation, "uid": self.uid, "limits": dataclasses.asdict(self.limits),
            "workdir": self.workdir}


class SandboxPool:
  """Pre-created workspaces handed out under a concurrency cap, wiped on return.

  A burst of episodes waits for a free sandbox instead of creating hundreds at once.
  """

  def __init__(self, size: int, *, root: Optional[str] = None, limits: Limits = Limits(),
               isolation: Optional[str] = None, uid_base: int = UID_BASE + 1):
    if size < 1:
      raise ValueError(f"pool size must be >= 1, got {size}")
    self.root = root or tempfile.mkdtemp(prefix="jaxagent-sandboxes-")
    os.chmod(self.root, 0o711)  # sandbox uids may pass through to their workspace, not list it
    self._free: asyncio.Queue | None = None
    self.sandboxes = [Sandbox(os.path.join(self.root, f"ws{i}"), uid=uid_base + i, limits=limits,
                              isolation=isolation) for i in range(size)]
    self.in_use = 0
    self.waits = 0

  def _queue(self) -> asyncio.Queue:
    if self._free is None:
      self._free = asyncio.Queue()
      for sb in self.sandboxes:
        self._free.put_nowait(sb)
    return self._free

  @contextlib.asynccontextmanager
  async def acquire(self):
    q = self._queue()
    if q.empty():
      self.waits += 1
    sb = await q.get()
    self.in_use += 1
    try:
      yield sb
    finally:
      self.in_use -= 1
      sb.wipe()
      q.put_nowait(sb)

  def close(self) -> None:
    for sb in self.sandboxes:
      sb.destroy()
    shutil.rmtree(self.root, ignore_errors=True)

"""The sandbox's limits, exercised for real on this machine."""

import ast
import asyncio
import contextlib
import errno
import hashlib
import json
import http.server
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from tests.conftest import REPO

from envs.isolation import (IsolationUnavailable, Limits, UidLease, available_isolations,
                            detect_isolation)
from envs.pool import SandboxPool
from envs.sandbox import Sandbox

ISOLATION = detect_isolation()
# Every namespace mode this host has: CI (root, bubblewrap installed) runs both.
MODES = [m for m in available_isolations() if m != "rlimits"]
needs_isolation = pytest.mark.skipif(not MODES, reason="no namespace isolation on this host")
LIMITS = Limits(wall_s=3.0, cpu_s=10, memory_bytes=512 << 20, processes=32,
                file_bytes=1 << 20, output_budget=1000, disk_bytes=8 << 20)


_SCRATCH: list[str] = []


def scratch_dir() -> str:
  """A directory under /tmp (sandbox uids pass through it: pytest's own are private),
  removed after this module's tests (a test-distributing worker ends without running
  atexit's handlers)."""
  root = tempfile.mkdtemp(prefix="jaxagent-test-")
  _SCRATCH.append(root)
  return root


@pytest.fixture(autouse=True, scope="module")
def remove_scratch():
  yield
  while _SCRATCH:
    shutil.rmtree(_SCRATCH.pop(), ignore_errors=True)


@pytest.fixture(params=MODES or ["rlimits"])
def sandbox(request):
  root = scratch_dir()
  os.chmod(root, 0o711)
  sb = Sandbox(os.path.join(root, "ws"), limits=LIMITS, isolation=request.param)
  yield sb
  sb.destroy()
  shutil.rmtree(root, ignore_errors=True)


def run(sb, code, **kw):
  return asyncio.run(sb.run_python(code, **kw))


def test_runs_and_records(sandbox):
  r = run(sandbox, "print('hello'); open('out.txt', 'w').write('x')")
  assert r.ok and r.stdout == "hello\n" and r.exit_code == 0
  assert sandbox.read_file("out.txt") == b"x"
  assert r.stdout_sha256 == hashlib.sha256(b"hello\n").hexdigest()
  assert sandbox.history[-1] is r and r.isolation == sandbox.isolation
  assert r.command[-1] == "_run.py"
  assert sandbox.has_quota == (os.geteuid() == 0 and sandbox.isolation != "rlimits")


def test_infinite_loop_is_killed_at_the_timeout(sandbox):
  t0 = time.time()
  r = run(sandbox, "while True: pass", timeout=1.5)
  assert r.timed_out and not r.ok
  assert 1.4 < time.time() - t0 < 8
  assert run(sandbox, "print(1)").ok  # the sandbox still works


def test_a_command_that_ended_in_time_is_not_timed_out_by_a_held_loop(sandbox):
  """Another call's code holds the event loop across a command's wall limit: the
  command, which ended well inside it, is not read as timed out (it was: its grading a
  TIMEOUT verdict, reward 0, for a sibling's hold; red team). One that runs on is, and
  so is one that ended past the limit while the loop was held (it was read as its own
  exit, `ok`: a reviewer)."""

  async def main(code):
    async def sibling():
      await asyncio.sleep(0.7)  # (the command has started by then, and runs on)
      time.sleep(3.2)  # holds the loop (past the 2 s limit) without taking a core

    held = asyncio.ensure_future(sibling())
    r = await sandbox.run_python(code, timeout=2.0)
    await held
    return r

  r = asyncio.run(main("import time; time.sleep(1.0); print('done')"))
  assert r.ok and not r.timed_out and r.stdout == "done\n", r
  r = asyncio.run(main("while True: pass"))
  assert r.timed_out and not r.ok
  # (ends ~2.4 s in, past the limit, seen ~3.9 s in)
  r = asyncio.run(main("import time; time.sleep(2.3); print('late')"))
  assert r.timed_out and not r.ok and r.stdout == "late\n", r


def test_the_exit_clock_notes_when_a_process_ended():
  """(the held loop's grace reads a command's end by it; a worker's descriptors past
  1024, which select() refuses, must not blind it)"""
  import resource

  from envs.sandbox import ExitClock

  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  if hard != resource.RLIM_INFINITY and hard < 2048:
    pytest.skip("descriptors limited below 2048 here")
  resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
  held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
  try:
    t = time.perf_counter()
    proc = subprocess.Popen(["sleep", "0.3"])
    clock = ExitClock(proc.pid)
    proc.wait()
    assert clock.ended_by(t + 5) and not clock.ended_by(t + 0.2), clock.at - t
  finally:
    for fd in held:
      os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
  gone = subprocess.Popen(["true"])
  gone.wait()
  assert ExitClock(gone.pid).ended_by(0.0)  # (reaped before it looked: not known, in time)


def test_memory_hog_is_contained(sandbox):
  r = run(sandbox, "x = bytearray(2 << 30)\nprint('allocated')")
  assert r.exit_code != 0 and "MemoryError" in r.stderr and "allocated" not in r.stdout


def test_fork_bomb_is_contained(sandbox):
  bomb = "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass\n"
  t0 = time.time()
  r = run(sandbox, bomb, timeout=2)
  assert not r.ok and time.time() - t0 < 15
  after = run(sandbox, "print('alive')")
  assert after.ok and after.stdout == "alive\n"


def test_output_is_cut_to_the_budget_with_full_size_and_hash(sandbox):
  r = run(sandbox, "import sys; sys.stdout.write('y' * 5000)")
  assert r.stdout_bytes == 5000 and len(r.stdout) == 1000 and r.truncated
  assert r.stdout_sha256 == hashlib.sha256(b"y" * 5000).hexdigest()


def test_stderr_is_cut_to_the_budget_too(sandbox):
  """A solution that floods stderr (a traceback in a loop) is kept to the same budget as
  stdout, its full size and hash recorded: the host keeps no more of it."""
  r = run(sandbox, "import sys\nfor _ in range(500): sys.stderr.write('Traceback!' * 10)")
  assert r.stderr_bytes == 50000 and len(r.stderr) == 1000 and r.truncated, len(r.stderr)
  assert r.stderr_sha256 == hashlib.sha256(b"Traceback!" * 5000).hexdigest()


def test_a_command_reads_nothing_of_its_hosts_stdin(sandbox):
  """A command without stdin of its own reads an empty one, not the host process's (a
  worker's stdin, whatever its launcher piped to it, would reach every solution)."""
  r, w = os.pipe()
  os.write(w, b"the host's secret")
  os.close(w)
  saved = os.dup(0)
  os.dup2(r, 0)
  try:
    out = run(sandbox, "import sys\nprint(repr(sys.stdin.read()))")
  finally:
    os.dup2(saved, 0)
    os.close(saved)
    os.close(r)
  assert out.exit_code == 0 and out.stdout.strip() == "''", (out.stdout, out.stderr)


@needs_isolation
def test_a_command_cannot_start_more_processes_than_its_limit(sandbox):
  """Sleepers spawned to hold the host's process table (each one a process of the
  sandbox's) are refused past `Limits.processes`: the fork fails with EAGAIN."""
  code = ("import subprocess\nprocs = []\ntry:\n  for _ in range(2 * 32):\n"
          "    procs.append(subprocess.Popen(['sleep', '30']))\n"
          "except OSError as e:\n  print('refused', e.errno)\nprint(len(procs))\n"
          "for p in procs:\n  p.kill()\n")
  r = run(sandbox, code, timeout=10)
  assert r.stdout.startswith("refused 11\n"), (r.stdout, r.stderr)
  assert int(r.stdout.split()[-1]) < LIMITS.processes


@needs_isolation
def test_a_command_cannot_hold_more_open_files_than_its_limit(sandbox):
  """Descriptors opened by the thousand (kernel memory no tmpfs counts) stop with EMFILE
  at `Limits.open_files`."""
  code = ("import os\nfds = []\ntry:\n  for _ in range(4096):\n"
          "    fds.append(os.open('/dev/null', os.O_RDONLY))\n"
          "except OSError as e:\n  print('refused', e.errno, len(fds))\n")
  r = run(sandbox, code)
  assert r.stdout.startswith("refused 24 "), (r.stdout, r.stderr)
  assert int(r.stdout.split()[-1]) < LIMITS.open_files


@pytest.mark.parametrize("mode", MODES or ["rlimits"])
def test_a_run_leaves_no_files_on_the_host_and_destroy_removes_its_folder(mode):
  """Each command's output files (up to `Limits.file_bytes` each, on the host's disk) and
  the mount-namespace mode's private root are removed once it is recorded, not kept for
  the episode's every command; `destroy` removes the sandbox's own folder."""
  root = scratch_dir()
  os.chmod(root, 0o711)
  sb = Sandbox(os.path.join(root, "ws"), limits=LIMITS, isolation=mode)
  try:
    logs = sb._logs
    for _ in range(2):
      r = run(sb, "import sys; print('x' * 100000); sys.stderr.write('y' * 100000)")
      assert r.ok and r.stdout_bytes == 100001, r
      assert [f for f in os.listdir(logs) if f not in ("tmp", "shm")] == []
  finally:
    sb.destroy()
  assert not os.path.exists(logs)
  shutil.rmtree(root, ignore_errors=True)


@needs_isolation
def test_tmp_and_dev_shm_hold_no_more_than_their_size(sandbox):
  """A command that fills /tmp and /dev/shm (memory the workspace quota does not count)
  meets ENOSPC at `Limits.tmp_bytes` in each, not at half of the host's memory."""
  code = ("import os\nfor where in ('/tmp', '/dev/shm'):\n  n = 0\n  try:\n"
          "    for i in range(64):\n"
          "      with open(f'{where}/f{i}', 'wb') as f:\n        f.write(b'0' * (1 << 20))\n"
          "      n += 1\n"
          "  except OSError as e:\n    print(where, 'full', e.errno, n)\n"
          "  else:\n    print(where, 'all', n)\n")
  r = run(sandbox, code, timeout=10)
  lines = r.stdout.splitlines()
  assert len(lines) == 2, (r.stdout, r.stderr)
  for where, line in zip(("/tmp", "/dev/shm"), lines):
    w, full, errno_, n = line.split()
    assert (w, full, errno_) == (where, "full", "28") and int(n) <= LIMITS.tmp_bytes >> 20, line


def test_file_size_limit(sandbox):
  r = run(sandbox, "open('big', 'wb').write(b'0' * (4 << 20))")
  assert r.exit_code != 0
  assert os.path.getsize(os.path.join(sandbox.host_path, "big")) <= LIMITS.file_bytes


def test_environment_is_scrubbed(sandbox, monkeypatch):
  monkeypatch.setenv("SECRET_TOKEN", "hunter2")
  r = run(sandbox, "import os; print(sorted(os.environ))")
  assert "SECRET_TOKEN" not in r.stdout and "PATH" in r.stdout


@needs_isolation
def test_writing_outside_the_workspace_fails(sandbox, tmp_path):
  for target in ("/etc/escape.txt", "/usr/escape.txt", str(tmp_path / "escape.txt"),
                 "../escape.txt", "/escape.txt"):
    r = run(sandbox, f"open({target!r}, 'w').write('x')")
    assert r.exit_code != 0, target
  assert not os.path.exists(tmp_path / "escape.txt")
  assert not os.path.exists("/tmp/escape.txt")


@needs_isolation
def test_project_and_home_are_invisible(sandbox):
  r = run(sandbox, "import os; print(os.path.exists('/root'), os.path.exists('/work'), "
                   "os.path.exists('/home'), os.getuid())")
  assert r.stdout.split()[:3] == ["False", "False", "False"]
  assert r.stdout.split()[3] != "0"


@needs_isolation
def test_network_connections_fail(sandbox):
  server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
  port = server.server_address[1]
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    code = ("import socket\n"
            f"try:\n  socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "  print('connected')\nexcept OSError as e:\n  print('refused', e)\n")
    r = run(sandbox, code)
    assert r.stdout.startswith("refused")
    r = run(sandbox, "import socket\ntry:\n  socket.create_connection(('1.1.1.1', 80), timeout=2)"
                     "\n  print('connected')\nexcept OSError as e:\n  print('refused', e)\n")
    assert r.stdout.startswith("refused")
  finally:
    server.shutdown()


def test_unreachable_workspace_is_a_clear_error(tmp_path):
  if os.geteuid() != 0 or not MODES:
    pytest.skip("only a sandbox uid can be locked out")
  locked = tmp_path / "locked"
  locked.mkdir(mode=0o700)
  with pytest.raises(ValueError, match="not traversable"):
    Sandbox(str(locked / "ws"), limits=LIMITS, isolation=MODES[0])


def test_paths_outside_the_workspace_are_refused_on_the_host(sandbox):
  with pytest.raises(ValueError, match="outside the workspace"):
    sandbox.write_file("../x.txt", "no")
  with pytest.raises(ValueError, match="capped"):
    sandbox.write_file("big.txt", b"x" * (LIMITS.write_bytes + 1))


def test_a_path_into_a_sibling_named_like_the_workspace_is_refused(sandbox):
  """`../ws-evil/x` resolves to a path that starts with the workspace's own as a string:
  the host neither writes nor reads there."""
  sibling = sandbox.host_path + "-evil"  # (where the host would write it)
  rel = "../" + os.path.basename(sibling) + "/x.txt"
  with pytest.raises(ValueError, match="outside the workspace"):
    sandbox.write_file(rel, "planted")
  assert not os.path.exists(sibling)
  os.makedirs(sibling)
  with open(os.path.join(sibling, "x.txt"), "w") as f:
    f.write("host data")
  with pytest.raises(ValueError, match="outside the workspace"):
    sandbox.read_file(rel)


def test_a_timed_out_unisolated_commands_children_are_killed_with_it():
  """Without namespaces (`rlimits`) a command's children are not in a PID namespace that
  dies with it: the whole process group is killed at the timeout, not the leader only (a
  sleeper it started would outlive its run)."""
  root = scratch_dir()
  sb = Sandbox(os.path.join(root, "ws"), limits=LIMITS, isolation="rlimits")
  pid = None
  try:
    code = ("import subprocess, time\np = subprocess.Popen(['sleep', '60'])\n"
            "open('child.pid', 'w').write(str(p.pid))\ntime.sleep(60)\n")
    r = run(sb, code, timeout=3)
    assert r.timed_out and not r.ok
    pid = int(sb.read_file("child.pid"))
    deadline = time.time() + 3
    while time.time() < deadline:
      try:
        with open(f"/proc/{pid}/stat") as f:
          if f.read().rsplit(")", 1)[1].split()[0] == "Z":
            break
      except FileNotFoundError:
        break
      time.sleep(0.05)
    else:
      raise AssertionError(f"the command's child {pid} outlived its timeout")
    pid = None
  finally:
    if pid is not None:
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 9)
    sb.destroy()
    shutil.rmtree(root, ignore_errors=True)


@needs_isolation
def test_the_host_is_out_of_view(sandbox):
  """No project tree, no host processes, private /tmp and /dev/shm, no host sockets."""
  listener = socket.socket(socket.AF_UNIX)
  path = os.path.join(tempfile.gettempdir(), f"jaxagent-test-{os.getpid()}.sock")
  listener.bind(path)
  listener.listen()
  try:
    code = ("import os, socket\n"
            "procs = [p for p in os.listdir('/proc') if p.isdigit()]\n"
            "cmds = [open(f'/proc/{p}/cmdline', 'rb').read() for p in procs]\n"
            "open('/tmp/left.txt', 'w').write('x'); open('/dev/shm/left', 'w').write('x')\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            f"try:\n  s.connect({path!r}); print('connected')\nexcept OSError:\n  print('no socket')\n"
            f"print(len(procs), any(b'pytest' in c for c in cmds), os.path.exists({REPO!r}),"
            " os.path.exists('/work'), os.path.exists('/run'), os.getuid())\n")
    r = run(sandbox, code)
    assert r.ok, r.stderr
    lines = r.stdout.split("\n")
    assert lines[0] == "no socket"
    n, pytest_seen, repo, work, run_dir, uid = lines[1].split()
    assert int(n) <= 3 and (pytest_seen, repo, work, run_dir) == ("False",) * 4
    assert uid != "0"
    # /tmp and /dev/shm were the run's own: gone with it, never on the host.
    assert not os.path.exists("/tmp/left.txt") and not os.path.exists("/dev/shm/left")
    assert run(sandbox, "import os; print(os.listdir('/tmp'), os.listdir('/dev/shm'))"
               ).stdout == "[] []\n"
    # /dev holds its devices, no files (bwrap's is a tmpfs of half the host's memory: a
    # command wrote 1 GiB there, red team 30).
    r = run(sandbox, "open('/dev/null', 'w').write('x')\ntry:\n  open('/dev/x', 'w')\n"
                     "except OSError as e:\n  print(e.errno)")
    assert r.ok and r.stdout.strip() in ("30", "13"), (r.stdout, r.stderr)
  finally:
    listener.close()
    os.unlink(path)


@needs_isolation
def test_the_hosts_sysv_semaphores_are_out_of_view(sandbox):
  """SysV semaphores (which the seccomp filter leaves to multiprocessing) are the
  sandbox's own IPC namespace's: a set the host (or another sandbox) made under a known
  key is not found, so a command can neither read nor change it."""
  import ctypes

  libc = ctypes.CDLL(None, use_errno=True)
  key = 0x6A610000 + os.getpid() % 0xFFFF
  semid = libc.semget(key, 1, 0o1666)  # IPC_CREAT | 0666
  assert semid >= 0, os.strerror(ctypes.get_errno())
  try:
    r = run(sandbox, "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                     f"print(libc.semget({key}, 0, 0), ctypes.get_errno())\n")
    assert r.ok and r.stdout == f"-1 {errno.ENOENT}\n", (r.stdout, r.stderr)
  finally:
    libc.semctl(semid, 0, 0)  # IPC_RMID


@needs_isolation
def test_workspace_quota(sandbox):
  if os.geteuid() != 0:
    pytest.skip("the quota is a tmpfs mount (root)")
  code = ("import os\nn = 0\ntry:\n  for i in range(64):\n"
          "    open(f'f{i}', 'wb').write(b'0' * (1 << 20)); n += 1\n"
          "except OSError as e:\n  print('full', e.errno)\nprint(n)\n")
  r = run(sandbox, code)
  assert r.stdout.startswith("full 28"), r.stdout + r.stderr  # ENOSPC
  assert sum(len(v) for v in sandbox.files().values()) <= LIMITS.disk_bytes


@needs_isolation
def test_the_workspace_and_tmp_hold_a_bounded_number_of_files(sandbox):
  """Each file or directory costs kernel memory that a tmpfs's size does not count (a
  red-team held 600 MB of memory with empty directories in a 32 MB workspace): the
  workspace (and the mount-namespace mode's /tmp and /dev/shm) hold `max_inodes`."""
  if os.geteuid() != 0:
    pytest.skip("the quota is a tmpfs mount (root)")
  code = ("import os, sys\nfor where in sys.argv[1:] or ['.', '/tmp']:\n  n = 0\n  try:\n"
          "    for i in range(40000):\n      os.mkdir(os.path.join(where, f'd{i}')); n += 1\n"
          "  except OSError as e:\n    print(where, 'full', e.errno, n)\n  else:\n"
          "    print(where, 'all', n)\n")
  r = run(sandbox, code, timeout=20)
  lines = r.stdout.splitlines()
  assert lines[0].startswith(". full 28 ") and int(lines[0].split()[-1]) < 16384, r.stdout
  if sandbox.isolation == "mountns":
    assert lines[1].startswith("/tmp full 28 "), r.stdout
  assert set(sandbox.files()) == {"_run.py"}  # and empty directories


def test_a_snapshot_of_a_workspace_of_many_directories_is_the_policys_doing():
  """A workspace without a quota of its own (a worker not run as root) held 527k empty
  directories: each walk of it took 15 s, and a grading past its deadline is re-rolled
  as the infrastructure's (red team 28). Past `max_inodes` entries walked, directories
  counted, the snapshot raises `WorkspaceTooLarge` (graded a fail)."""
  from envs.sandbox import WorkspaceTooLarge

  root = scratch_dir()
  sb = Sandbox(os.path.join(root, "ws"), limits=Limits(max_inodes=64), isolation="rlimits")
  try:
    sb.write_file("solution.py", "x = 1\n")
    for i in range(20):
      os.makedirs(os.path.join(sb.host_path, f"d{i}", "e"))
    assert set(sb.files()) == {"solution.py"}  # 41 entries
    for i in range(20, 40):
      os.makedirs(os.path.join(sb.host_path, f"d{i}", "e"))
    with pytest.raises(WorkspaceTooLarge, match="over 64 files and directories"):
      sb.files()  # 81 entries
  finally:
    sb.destroy()


def skip_unless_nobody_runs_python() -> None:
  """Skips a test that runs this interpreter as user 65534 where it cannot: not root, or
  an interpreter or a checkout that user cannot load (pyenv's Python under /root, whose
  libpython it cannot read; a repository in a directory shut to others)."""
  if os.geteuid() != 0 or not shutil.which("setpriv"):
    pytest.skip("needs root to act as another user")
  r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                      sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                      "import envs.sandbox", REPO], capture_output=True, text=True, timeout=60)
  if r.returncode != 0:
    pytest.skip(f"user 65534 cannot run {sys.executable} and import {REPO}'s envs: "
                f"{r.stderr.strip()[-200:]}")


def nobodys_scratch_dir() -> str:
  """A `scratch_dir` of user 65534's (skips where that user cannot run this Python)."""
  skip_unless_nobody_runs_python()
  root = scratch_dir()
  os.chown(root, 65534, 65534)
  return root


def python_as_nobody(code: str, *args: str, timeout: float = 60
                     ) -> subprocess.CompletedProcess:
  """Runs `code` with `args` in this interpreter as user 65534 (output as text)."""
  return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                         sys.executable, "-c", code, *args],
                        capture_output=True, text=True, timeout=timeout)


def _nobodys_disk() -> str:
  """A tmpfs of 256 MiB that user 65534 may write (nothing else writes there); skips the
  test where that user cannot run this interpreter, or no tmpfs can be mounted."""
  skip_unless_nobody_runs_python()
  top = tempfile.mkdtemp(prefix="jaxagent-test-")
  os.chmod(top, 0o755)
  disk = os.path.join(top, "disk")
  os.mkdir(disk)
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m,mode=0777", "jaxagent-test",
                     disk], capture_output=True).returncode != 0:
    shutil.rmtree(top)
    pytest.skip("cannot mount a tmpfs here")
  return disk


def _remove_disk(disk: str) -> None:
  subprocess.run(["umount", "-l", disk], check=False)
  shutil.rmtree(os.path.dirname(disk), ignore_errors=True)


def run_as_nobody_on_a_tmpfs(script: str, *args: str, own_filesystem: bool = False
                              ) -> subprocess.CompletedProcess:
  """Runs `script` with `args` in a sandbox of a worker that is user 65534, its workspaces
  on a tmpfs of 256 MiB (nothing else writes there), and prints whether it ran clean, its
  `disk_exceeded`, and the MiB its disk holds more than before, half a second after.
  `own_filesystem`: the pool's (False: the disk watch bounds the workspace)."""
  disk = _nobodys_disk()
  code = ("import asyncio, os, sys\nsys.path.insert(0, sys.argv[2])\n"
          "from envs.pool import SandboxPool\nfrom envs.sandbox import Limits\n"
          "pool = SandboxPool(1, root=sys.argv[1], limits=Limits(wall_s=20, cpu_s=20),\n"
          f"                   own_filesystem={own_filesystem})\n"
          "def used():\n  s = os.statvfs(sys.argv[1])\n"
          "  return (s.f_blocks - s.f_bfree) * s.f_frsize >> 20\n"
          "async def main():\n"
          "  async with pool.acquire() as sb:\n"
          "    sb.write_file('script.py', sys.argv[3])\n"
          "    before = used()\n"
          "    r = await sb.run([sb.python, 'script.py', *sys.argv[4:]], timeout=20)\n"
          "    await asyncio.sleep(0.5)\n"
          "    print(r.ok, r.disk_exceeded, used() - before)\n"
          "asyncio.run(main())\npool.close()\n")
  try:
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           sys.executable, "-c", code, os.path.join(disk, "ws"), REPO, script,
                           *args],
                          capture_output=True, text=True, timeout=120)
  finally:
    _remove_disk(disk)


# Fills what it can of its workspace in each way the disk watch missed: below a
# directory shut to its owner, in removed files held by a mapping only, in files in
# flight over a unix socket; then says what it wrote, how large its filesystem is, who it
# runs as and with what capabilities, and waits (the host looks at its disk meanwhile).
FILLS_ITS_WORKSPACE = r'''
import array, ctypes, errno, os, socket, sys, time
libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long)
os.mkdir("d")
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
written, failed = 0, None
try:
  for i in range(64):
    fd = os.open(f"d/f{i}", os.O_RDWR | os.O_CREAT, 0o600)
    for _ in range(4):
      written += os.write(fd, b"x" * (1 << 20))
    if i % 3 == 1:
      libc.mmap(None, 4096, 1, 1, fd, 0)
      os.unlink(f"d/f{i}")
    elif i % 3 == 2:
      a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
      os.unlink(f"d/f{i}")
    os.close(fd)
    os.chmod("d", 0o300)
    os.chmod("d", 0o700)
except OSError as e:
  failed = errno.errorcode[e.errno]
os.chmod("d", 0o300)
st = os.statvfs(".")
caps = [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")]
print(written >> 20, failed, st.f_blocks * st.f_frsize >> 20, os.getuid(), caps[0], flush=True)
time.sleep(3)
'''


# Makes empty files in /tmp and /dev/shm until refused (bubblewrap's own tmpfs mounts
# bound no inodes: a red team's 1.5M took 6.85 GB of kernel memory), then says what
# stopped each and how many it made.
FILLS_TMP_WITH_INODES = r'''
import errno, os
said = []
for d in ("/tmp", "/dev/shm"):
  n = 0
  try:
    for n in range(1, 1 << 20):
      os.close(os.open(f"{d}/f{n}", os.O_CREAT | os.O_WRONLY, 0o600))
  except OSError as e:
    said.append((errno.errorcode[e.errno], n - 1))
print(said[0][0], said[1][0], said[0][1], said[1][1])
'''


@needs_isolation
def test_a_non_root_workers_workspace_is_a_tmpfs_of_its_own():
  """A worker that is not root has no quota of a filesystem, and its disk watch was a
  heuristic each red team found a way past (a shut directory, files a mapping holds,
  files in flight: up to 4 GiB held for a command's time). Where the kernel lets it
  make user namespaces (bubblewrap needs as much), each workspace is a tmpfs of
  `disk_bytes` held in one of its own (`envs.isolation.HeldTmpfs`): the command writes
  ENOSPC at its size in every one of those ways, nothing of it reaches the host's disk,
  it runs as the worker's user with no capabilities, and the tmpfs is gone with the
  workspace, or with the worker; a holder that ended is the infrastructure's failure."""
  disk = _nobodys_disk()
  code = ("import asyncio, os, sys\nsys.path.insert(0, sys.argv[2])\n"
          "from envs.isolation import held_tmpfs_works\n"
          "from envs.pool import SandboxPool\nfrom envs.sandbox import Limits\n"
          "if not held_tmpfs_works():\n  print('unavailable'); sys.exit()\n"
          "pool = SandboxPool(1, root=sys.argv[1], limits=Limits(wall_s=20, cpu_s=20))\n"
          "def used():\n  s = os.statvfs(sys.argv[1])\n"
          "  return (s.f_blocks - s.f_bfree) * s.f_frsize >> 20\n"
          "async def main():\n"
          "  async with pool.acquire() as sb:\n"
          "    print(pool.filesystem, sb.describe()['filesystem'], sb.has_quota)\n"
          "    sb.write_file('fill.py', sys.argv[3])\n"
          "    before = used()\n"
          "    run = asyncio.ensure_future(sb.run([sb.python, 'fill.py'], timeout=20))\n"
          "    await asyncio.sleep(2)\n"
          "    during = used() - before\n"
          "    r = await run\n"
          "    print(r.ok, r.disk_exceeded, during, r.stdout.strip())\n"
          "    print(sorted(sb.files(max_bytes=8 << 20)))\n"
          "    holder = sb._held._proc.pid\n"
          "    said = [(await sb.run([sb.python, '-c', sys.argv[4]], timeout=20)).stdout.strip()\n"
          "            for _ in range(2)]  # (the second finds them empty again)\n"
          "    print(*said, said[0] == said[1])\n"
          "  print(os.path.exists(f'/proc/{holder}'), os.listdir(sys.argv[1]))\n"
          "  sb = pool.create()\n"
          "  os.kill(sb._held.pid, 9)\n"
          "  print(sb._held.ends_within(20), end=' ')  # (ended: a loaded host is slow to say so)\n"
          "  r = await sb.run(['true'])\n"
          "  print(r.error)\n"
          "  pool.release(sb)\n"
          "  sb = pool.create()\n"
          "  print(sb._held._proc.pid, flush=True)\n"
          "  os._exit(0)  # (a worker's death)\n"
          "asyncio.run(main())\n")
  try:
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        sys.executable, "-c", code, os.path.join(disk, "ws"), REPO,
                        FILLS_ITS_WORKSPACE, FILLS_TMP_WITH_INODES],
                       capture_output=True, text=True, timeout=120)
    if r.stdout.strip() == "unavailable":
      pytest.skip("this kernel lets no user namespace of user 65534 mount a tmpfs")
    lines = r.stdout.splitlines()
    assert len(lines) == 7, r.stdout + r.stderr[-2000:]
    assert lines[0] == "a tmpfs held in a user namespace a tmpfs held in a user namespace True"
    ok, exceeded, during, wrote, failed, size, uid, caps = lines[1].split()
    # (a page or two of the 32 MiB go to directories; each way of hiding filled it)
    assert (exceeded, during, failed, size, uid, caps) == (
        "None", "0", "ENOSPC", "32", "65534", "0000000000000000"), lines[1]
    assert 28 <= int(wrote) <= 32, lines[1]
    kept = ast.literal_eval(lines[2])  # (every third file stays in the workspace)
    assert {"fill.py", "d/f0", "d/f3"} <= set(kept) and not {"d/f1", "d/f2"} & set(kept), kept
    # /tmp and /dev/shm: fresh for each command, bounded in inodes too
    assert lines[3] == f"ENOSPC ENOSPC {16384 - 1} {16384 - 1} " * 2 + "True", lines[3]
    assert lines[4] == "False []", lines[4]  # (the holder and the mountpoint gone)
    # A holder that ended took the workspace with it: the infrastructure's failure.
    assert re.fullmatch(r"True the workspace's filesystem is gone: its holder \(host pid \d+\) "
                        r"ended, exit -9", lines[5]), lines[5]
    holder = int(lines[6])
    deadline = time.time() + 10
    while time.time() < deadline and _running(holder):
      time.sleep(0.05)
    assert not _running(holder)
  finally:
    _remove_disk(disk)


def test_a_holder_that_says_more_or_never_comes_up_neither_hangs_nor_leaves_a_folder(
    tmp_path):
  """A holder that printed anything before its "up" (an LD_PRELOAD's complaint at each
  exec) hung the worker reading to an end that never came, and a workspace whose holder
  failed left its empty folder in the pool's root each time (red team 7). What comes
  before "up" is passed over; a holder that never says it is given up on in time; a
  failed workspace leaves nothing."""
  from envs import isolation

  talker, mute = tmp_path / "talker", tmp_path / "mute"
  talker.write_text("#!/bin/sh\necho noise\necho up\nexec cat >/dev/null\n")
  mute.write_text("#!/bin/sh\necho noise\nexec cat >/dev/null\n")
  for f in (talker, mute):
    f.chmod(0o755)
  os.mkdir(tmp_path / "ws")
  real = isolation._UNSHARE
  try:
    isolation._UNSHARE = str(talker)
    held = isolation.HeldTmpfs(str(tmp_path / "ws"), 1 << 20, 64)
    assert held.alive
    held.close()
    assert not held.alive
    isolation._UNSHARE = str(mute)
    t = time.monotonic()
    with pytest.raises(isolation.IsolationUnavailable, match=r"noise\n\(no answer in time\)"):
      isolation.HeldTmpfs(str(tmp_path / "ws"), 1 << 20, 64, timeout=1.0)
    assert time.monotonic() - t < 10
  finally:
    isolation._UNSHARE = real
  if "bwrap" not in MODES:
    return
  root = nobodys_scratch_dir()
  code = ("import sys\nsys.path.insert(0, sys.argv[2])\n"
          "from envs import isolation\nfrom envs.pool import SandboxPool\n"
          "if not isolation.held_tmpfs_works():\n  print('unavailable'); sys.exit()\n"
          "pool = SandboxPool(1, root=sys.argv[1], own_filesystem=True)\n"
          "isolation._UNSHARE = '/bin/false'\n"
          "for _ in range(3):\n  try:\n    pool.create()\n"
          "  except isolation.IsolationUnavailable as e:\n    print('refused')\n"
          "import os\nprint(os.listdir(sys.argv[1]))\npool.close()\n")
  r = python_as_nobody(code, root, REPO)
  if r.stdout.strip() != "unavailable":
    assert r.stdout.split("\n")[:4] == ["refused"] * 3 + ["[]"], r.stdout + r.stderr


def _running(pid: int) -> bool:
  """Whether process `pid` exists and has not ended (a zombie has)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def test_a_process_of_the_sandbox_uid_left_on_the_host_is_killed_before_the_next_command(
    sandbox):
  """A process running as the sandbox's uid outside its namespaces (a crashed worker's
  command, or one a PID namespace did not hold) would share the next command's uid: it
  could write into its workspace, signal it or hold its process limit. Each run, a wipe
  and a new sandbox of the uid kill every process of it."""
  if sandbox.uid is None:
    pytest.skip("only a sandbox uid is killed whole")
  from envs.isolation import SETPRIV, processes_of

  lease, made = UidLease(), None  # (a uid of no sandbox yet: the next one made with it)
  try:
    for step in ("run", "wipe", "create"):
      uid = lease.uid if step == "create" else sandbox.uid
      stray = subprocess.Popen([SETPRIV, f"--reuid={uid}", f"--regid={uid}",
                                "--clear-groups", "--", "sleep", "60"])
      try:
        deadline = time.time() + 5
        while stray.pid not in processes_of(uid):  # (setpriv has dropped to it)
          assert time.time() < deadline
          time.sleep(0.01)
        if step == "run":
          assert run(sandbox, "print('next')").stdout == "next\n"
        elif step == "wipe":
          sandbox.wipe()
        else:
          made = Sandbox(os.path.join(os.path.dirname(sandbox.mountpoint), "ws2"), uid=uid,
                         limits=LIMITS, isolation=sandbox.isolation)
        assert stray.wait(timeout=5) == -9, step
      finally:
        stray.kill()
        stray.wait()
        if made is not None:
          made.destroy()
  finally:
    lease.release()


@needs_isolation
def test_a_snapshot_of_hard_links_to_one_file_counts_each_name(sandbox):
  """One 1 MiB file under many names takes 1 MiB of the quota but each name is copied: a
  snapshot past the workspace's quota (which a grading copy must fit in again) raises
  `WorkspaceTooLarge`, not a snapshot of 13 MiB into an 8 MiB workspace."""
  from envs.sandbox import WorkspaceTooLarge

  r = run(sandbox, "import os\nopen('big', 'wb').write(b'0' * (1 << 20))\n"
                   "for i in range(12):\n  os.link('big', f'name{i}')\n")
  assert r.ok, r.stderr
  with pytest.raises(WorkspaceTooLarge, match="files take over"):
    sandbox.files(max_bytes=1 << 20)


def test_a_command_the_host_cannot_start_is_the_infrastructures_error(sandbox):
  """A start that fails on the host (here an argument the kernel cannot take) is an
  `error` (the infrastructure's, retried), not an exit of the command's."""
  r = asyncio.run(sandbox.run(["/bin/true", "no\0way"]))
  assert r.error is not None and r.error.startswith("ValueError"), r
  assert not r.ok and r.exit_code is None and not r.timed_out


def test_host_never_chowns_through_a_link(sandbox, tmp_path):
  """A hard link (or symlink) the sandbox left in its workspace is replaced, not followed."""
  if os.geteuid() != 0 or sandbox.uid is None:
    pytest.skip("ownership only changes with a sandbox uid")
  victim = tmp_path / "victim.txt"
  victim.write_text("host data")
  os.chmod(victim, 0o600)
  link = os.path.join(sandbox.host_path, "solution.py")
  try:
    os.link(victim, link)  # what a shared-filesystem sandbox could do
  except OSError:  # the workspace is its own file system (tmpfs): use a symlink instead
    os.symlink(victim, link)
  sandbox.write_file("solution.py", "def f(): pass\n")
  sandbox.write_file("sub/dir/x.py", "x = 1\n")
  st = os.stat(victim)
  assert (st.st_uid, victim.read_text()) == (0, "host data")
  assert sandbox.read_file("solution.py") == b"def f(): pass\n"
  assert os.stat(os.path.join(sandbox.host_path, "sub/dir")).st_uid == sandbox.uid


def test_host_reads_regular_files_only_and_names_the_workspaces_paths(sandbox):
  """A FIFO the command left where the host reads a file blocked the host's thread for
  ever; a host-side error told the policy the host's path (held: its holder's pid). Only
  regular files are read, and an error names the workspace's path (red team 6)."""
  r = run(sandbox, "import os; os.mkfifo('pipe'); os.symlink('pipe', 'link'); "
                   "open('plain', 'w').write('x')")
  assert r.ok, r.stderr
  for name in ("pipe", "link"):
    with pytest.raises(ValueError, match="is not a regular file"):
      sandbox.read_file(name)
  with pytest.raises(OSError) as e:  # (its folder is a file)
    sandbox.write_file("plain/below.txt", "y")
  assert e.value.filename == "plain/below.txt" and sandbox.mountpoint not in str(e.value)
  with pytest.raises(FileNotFoundError) as e:
    sandbox.read_file("missing")
  assert str(e.value) == "[Errno 2] No such file or directory: 'missing'"


def test_a_pool_over_a_folder_that_was_there_leaves_its_other_files():
  """A pool removed its whole root at close: an operator's `--workspace-root` of an
  existing folder lost what else it held (red team 6). Only what the pool made goes, and
  what workers no longer running left there (a crash's workspaces piled up, red team 7);
  a running worker's stay."""
  root = scratch_dir()  # (traversable by sandbox uids)
  with open(os.path.join(root, "keep.txt"), "w") as f:
    f.write("mine")
  ended = subprocess.Popen(["true"])
  ended.wait()
  for pid in (ended.pid, 1):
    os.makedirs(os.path.join(root, f"{pid}-0123456789ab", "d"))
    with open(os.path.join(root, f"{pid}-0123456789ab", "d", "f"), "wb") as f:
      f.write(b"x" * 4096)
  pool = SandboxPool(1, root=root, isolation=(MODES or ["rlimits"])[0], allow_unisolated=True)
  assert sorted(os.listdir(root)) == ["1-0123456789ab", "keep.txt"]
  sb = pool.create()
  sb.write_file("a.txt", "x")
  pool.close()
  assert sorted(os.listdir(root)) == ["1-0123456789ab", "keep.txt"]


def test_what_a_crashed_worker_left_in_the_temporary_directory_is_swept():
  """A pool's default root is a new folder at each start, so a crashed worker's
  workspaces (their tmpfs mounted as root) and its commands' logs were never swept
  (a red team): a pool on the default root removes the folders of workers no longer
  running, told by their lock (held for a worker's life, in any PID namespace: a pid
  alone said a live worker of another namespace was gone; a reviewer) or, without one,
  by their pid; a running one's stay, and anything else."""
  import fcntl

  from envs.isolation import owner_tag
  from envs.pool import remove_left_by_dead_workers

  tmp = scratch_dir()
  ended = subprocess.Popen(["true"])
  ended.wait()
  gone_here, gone_there, alive_there = (f"{ended.pid}-0123abcd", "1-deadbeef",
                                        f"{ended.pid}-feedface")
  left = [f"jaxagent-sandboxes-{gone_here}-abc", f"jaxagent-logs-{gone_here}-x",
          f"jaxagent-sandbox-empty-{gone_there}-y", f"jaxagent-owner-{gone_there}.lock"]
  kept = [f"jaxagent-logs-{alive_there}-x", f"jaxagent-owner-{alive_there}.lock",
          f"jaxagent-logs-{owner_tag()}-x", "jaxagent-logs-z", "other",
          f"jaxagent-logs-{gone_here}-link"]
  for name in left + kept:
    if name.endswith(".lock"):
      open(os.path.join(tmp, name), "w").close()
    elif name.endswith("-link"):
      os.symlink(os.path.join(tmp, "other"), os.path.join(tmp, name))
    else:
      os.makedirs(os.path.join(tmp, name))
  workspace = os.path.join(tmp, left[0], f"{ended.pid}-0123456789ab", "d")
  os.makedirs(workspace)
  with open(os.path.join(workspace, "f"), "wb") as f:
    f.write(b"x" * 4096)
  held = os.open(os.path.join(tmp, f"jaxagent-owner-{alive_there}.lock"), os.O_RDWR)
  try:
    fcntl.flock(held, fcntl.LOCK_EX)  # (a live worker of another PID namespace)
    assert sorted(remove_left_by_dead_workers(tmp)) == sorted(left)
  finally:
    os.close(held)
  assert sorted(os.listdir(tmp)) == sorted(kept)
  pool = SandboxPool(1, isolation="rlimits", allow_unisolated=True)
  try:
    assert os.path.basename(pool.root).startswith(f"jaxagent-sandboxes-{owner_tag()}-")
    sb = pool.create()
    assert os.path.basename(sb._logs).startswith(f"jaxagent-logs-{owner_tag()}-")
  finally:
    pool.close()


def test_a_non_root_worker_raises_its_process_limit_to_the_hard_one():
  """The user namespaces a non-root worker's sandboxes are made in take its RLIMIT_NPROC
  as theirs: under a finite one every sandbox, holder and worker thread shared it (two
  sandboxes of 60 processes under 100 got 54 and 31; red team 6). The worker raises it
  to the hard limit, and says so where that is below what its sandboxes may run."""
  code = ("import logging, resource, sys\nsys.path.insert(0, sys.argv[1])\n"
          "logging.basicConfig(format='%(message)s')\n"
          "from envs.isolation import nproc_room\n"
          "nproc_room(10)\nprint(resource.getrlimit(resource.RLIMIT_NPROC))\n"
          "nproc_room(5000)\n")
  r = subprocess.run(["prlimit", "--nproc=50:4000", sys.executable, "-c", code, REPO],
                     capture_output=True, text=True, timeout=60)
  assert r.stdout.strip() == "(4000, 4000)", r.stdout + r.stderr
  assert "this user's process limit (RLIMIT_NPROC, ulimit -u) is 4000, below the 5000" \
      in r.stderr, r.stderr


def test_uids_are_unique_across_pools_and_processes():
  if os.geteuid() != 0:
    pytest.skip("sandbox uids are for root")
  a, b = UidLease(), UidLease()
  held = subprocess.run(
      [sys.executable, "-c", "from envs.sandbox import UidLease; import sys, time\n"
       "l = UidLease(); print(l.uid, flush=True); sys.stdin.read()"],
      cwd=REPO, input="", capture_output=True, text=True, timeout=60)
  other = int(held.stdout.split()[0])
  try:
    assert len({a.uid, b.uid}) == 2
    assert other not in (a.uid, b.uid) or held.returncode == 0  # the child had ended
    p1, p2 = SandboxPool(1, limits=LIMITS), SandboxPool(1, limits=LIMITS)
    try:
      s1, s2 = p1.create(), p2.create()
      assert s1.uid != s2.uid and s1.uid is not None
    finally:
      p1.close()
      p2.close()
  finally:
    a.release()
    b.release()
  with _a_uid_held_by_another_process() as taken:  # (a live holder keeps its uid)
    leases = [UidLease() for _ in range(3)]
    assert taken not in [l.uid for l in leases]
    for l in leases:
      l.release()


@contextlib.contextmanager
def _a_uid_held_by_another_process():
  """The uid a `UidLease` of another process holds while in the block."""
  proc = subprocess.Popen(
      [sys.executable, "-c", "from envs.sandbox import UidLease; import sys\n"
       "l = UidLease(); print(l.uid, flush=True); sys.stdin.read()"],
      cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  try:
    yield int(proc.stdout.readline())
  finally:
    proc.stdin.close()
    proc.wait(timeout=30)


def test_a_uid_another_process_holds_is_never_leased_even_where_the_search_starts_at_it(
    monkeypatch):
  """Two workers that share a uid share their sandboxes' processes (each kills and
  signals the other's): the lock decides, not where this process happens to look first."""
  if os.geteuid() != 0:
    pytest.skip("sandbox uids are for root")
  from envs.isolation import UID_BASE

  with _a_uid_held_by_another_process() as taken:
    monkeypatch.setattr(UidLease, "_next", taken - (UID_BASE + 1))
    lease = UidLease()
    try:
      assert lease.uid != taken
    finally:
      lease.release()


def test_pool_caps_running_commands_and_gives_clean_workspaces():
  pool = SandboxPool(2, limits=LIMITS, isolation=(MODES or ["rlimits"])[0],
                     allow_unisolated=True)

  async def episode(i):
    async with pool.acquire() as sb:
      assert sb.files() == {}  # a clean workspace every time
      sb.write_file(f"f{i}.txt", "data")
      r = await sb.run_python("import time; time.sleep(0.2)")
      assert r.ok, r.stderr
      return sb.host_path

  async def main():
    return await asyncio.gather(*(episode(i) for i in range(6)))

  try:
    paths = asyncio.run(main())
    assert len(set(paths)) == 6 and not any(os.path.exists(p) for p in paths)
    assert pool.peak_running == 2 and pool.waits >= 1 and pool.in_use == 0
  finally:
    pool.close()


def test_a_crowded_pool_that_runs_is_waited_on_past_the_slot_timeout():
  """Six commands on one slot, each waiting behind the ones before it for longer than
  the 0.5 s slot timeout: the pool frees a slot meanwhile, so every command waits its
  turn and runs (a run whose own episodes crowd the pool goes slower; before, its
  commands failed as infrastructure and its episodes were dropped: red-team)."""
  pool = SandboxPool(1, limits=LIMITS, isolation=(MODES or ["rlimits"])[0],
                     allow_unisolated=True, slot_timeout_s=0.5)

  async def main():
    async with pool.acquire() as sb:
      return await asyncio.gather(*(sb.run(["sleep", "0.3"]) for _ in range(6)))

  try:
    results = asyncio.run(main())
    assert all(r.ok for r in results), [r.error for r in results]
    assert pool.peak_running == 1 and pool.waits >= 4
  finally:
    pool.close()


def test_a_wait_for_a_slot_has_a_deadline():
  """... but a pool that frees no slot for slot_timeout_s is stuck: infrastructure."""
  pool = SandboxPool(1, limits=LIMITS, isolation=(MODES or ["rlimits"])[0],
                     allow_unisolated=True, slot_timeout_s=0.5)

  async def main():
    async with pool.acquire() as a, pool.acquire() as b:
      slow = asyncio.ensure_future(a.run_python("import time; time.sleep(2)"))
      await asyncio.sleep(0.3)
      waited = await b.run_python("print(1)")
      return await slow, waited

  try:
    slow, waited = asyncio.run(main())
    assert slow.ok and waited.error and "no execution slot" in waited.error
  finally:
    pool.close()


def test_an_acquire_cancelled_while_its_workspace_is_made_releases_it():
  """The workspace is made in a thread, which goes on when its caller is cancelled (an
  episode dropped as stale): it is released when made (red team 22: left live for good,
  the pool filled with them and every episode failed as infrastructure)."""
  pool = SandboxPool(1, limits=LIMITS, isolation=(MODES or ["rlimits"])[0],
                     allow_unisolated=True)
  make = pool.create

  def slow_create():
    time.sleep(0.3)
    return make()

  pool.create = slow_create

  async def main():
    for _ in range(3):
      entered = []

      async def episode():
        async with pool.acquire():
          entered.append(1)

      t = asyncio.ensure_future(episode())
      await asyncio.sleep(0.1)  # (its workspace is being made)
      t.cancel()
      with pytest.raises(asyncio.CancelledError):
        await t
      assert not entered
    await asyncio.sleep(0.6)

  try:
    asyncio.run(main())
    assert pool.in_use == 0
  finally:
    pool.close()


def test_unisolated_execution_is_refused_unless_allowed():
  with pytest.raises(IsolationUnavailable, match="allow"):
    SandboxPool(1, isolation="rlimits")
  SandboxPool(1, isolation="rlimits", allow_unisolated=True).close()


def test_isolation_is_reported():
  assert ISOLATION in ("bwrap", "mountns", "rlimits")
  root = scratch_dir()
  os.chmod(root, 0o711)
  sb = Sandbox(root + "/ws", limits=LIMITS)
  try:
    d = sb.describe()
    assert d["isolation"] == ISOLATION and d["limits"]["wall_s"] == 3.0
  finally:
    sb.destroy()
    os.rmdir(root)


def test_a_command_cancelled_twice_is_killed_before_its_run_ends(monkeypatch):
  """A second cancellation while a cancelled command is being killed (an episode cut,
  then its worker session closed) must not end the run, and free its slot, before the
  command is dead (`asyncio.shield` alone let it)."""
  root = scratch_dir()
  os.chmod(root, 0o711)
  sb = Sandbox(os.path.join(root, "ws"), limits=LIMITS, isolation="rlimits")
  marker = f"jaxagent_twice_probe_{os.getpid()}"
  terminate = Sandbox._terminate

  async def slow_terminate(self, proc):
    await asyncio.sleep(1.0)  # a kill that takes a while
    await terminate(self, proc)

  monkeypatch.setattr(Sandbox, "_terminate", slow_terminate)

  def alive() -> str:
    return subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout

  async def go():
    task = asyncio.ensure_future(sb.run_python(f"import time\n{marker} = 1\ntime.sleep(30)\n",
                                               filename=f"{marker}.py"))
    await asyncio.sleep(1.0)
    task.cancel()
    await asyncio.sleep(0.3)
    task.cancel()  # during the kill
    with pytest.raises(asyncio.CancelledError):
      await task
    return alive()

  try:
    assert asyncio.run(go()).strip() == ""  # dead when the run ended
  finally:
    subprocess.run(["pkill", "-f", marker])
    sb.destroy()
    shutil.rmtree(root, ignore_errors=True)


def test_to_the_end_finishes_its_cleanup_and_then_raises_the_cancellation():
  from envs import waits

  done = []

  async def cleanup():
    await asyncio.sleep(0.3)
    done.append(True)
    return 7

  async def go():
    inner = asyncio.ensure_future(waits.to_the_end(cleanup()))
    for _ in range(3):
      await asyncio.sleep(0.05)
      inner.cancel()
    with pytest.raises(asyncio.CancelledError):
      await inner
    assert done == [True]
    return await waits.to_the_end(cleanup())

  assert asyncio.run(go()) == 7


def test_a_cancelled_command_is_killed_not_left_running():
  """A command whose caller gives up (an episode deadline, a closed worker session) is
  killed before its slot is freed; without a sandbox uid to sweep (bubblewrap as
  non-root, here the rlimits mode) it was left running past its wall limit (red-team)."""
  root = scratch_dir()
  os.chmod(root, 0o711)
  sb = Sandbox(os.path.join(root, "ws"), limits=LIMITS, isolation="rlimits")
  marker = f"jaxagent_cancel_probe_{os.getpid()}"

  async def go():
    task = asyncio.ensure_future(sb.run_python(f"import time\n{marker} = 1\ntime.sleep(30)\n",
                                               filename=f"{marker}.py"))
    await asyncio.sleep(1.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
      await task

  try:
    asyncio.run(go())
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    assert left.strip() == ""
  finally:
    subprocess.run(["pkill", "-f", marker])
    sb.destroy()
    shutil.rmtree(root, ignore_errors=True)


@needs_isolation
def test_the_environments_own_code_is_out_of_view_where_system_dirs_hold_it(sandbox,
                                                                            monkeypatch):
  """A pip install (the image's) puts `envs` (every task's hidden cases and reference
  solution) under /usr, which sandboxes see: one solution.py imported them and passed
  every python_tests task (red team). The packages and module files of registered
  environments (with their compiled copies) that lie under a system directory are
  mounted over with an empty view; the rest of that directory stays visible."""
  import importlib
  import importlib.util
  import py_compile
  import sys

  from envs import base, isolation as isolation_mod

  system = tempfile.mkdtemp(prefix="jaxagent-test-sys-", dir="/var/tmp")
  site = os.path.join(system, "site")
  os.makedirs(os.path.join(site, "secretpkg"))
  for name, text in (("secretpkg/__init__.py", "ANSWERS = 'hidden cases'\n"),
                     ("secretpkg/tasks.py", "REFERENCE = 'solution'\n"),
                     ("lone_env.py", "ANSWER = 42\n"), ("other.txt", "visible\n")):
    with open(os.path.join(site, name), "w") as f:
      f.write(text)
  monkeypatch.syspath_prepend(site)
  try:
    importlib.import_module("secretpkg.tasks")
    importlib.import_module("lone_env")
    lone = os.path.join(site, "lone_env.py")  # its compiled copy, as an install leaves it
    py_compile.compile(lone, cfile=importlib.util.cache_from_source(lone))
    for root, dirs, files in os.walk(system):
      for n in [root, *(os.path.join(root, f) for f in files)]:
        os.chmod(n, 0o755)
    monkeypatch.setitem(base.ENVS, "hidden_a", type("A", (), {"__module__": "secretpkg.tasks"}))
    monkeypatch.setitem(base.ENVS, "hidden_b", type("B", (), {"__module__": "lone_env"}))
    monkeypatch.setattr(isolation_mod, "_SYSTEM_DIRS", (*isolation_mod._SYSTEM_DIRS, system))
    pyc = [f for f in os.listdir(os.path.join(site, "__pycache__")) if f.startswith("lone_env")]
    assert pyc
    code = ("import os\n"
            "def read(p):\n  try:\n    return open(p, 'rb').read()\n"
            "  except OSError as e:\n    return type(e).__name__\n"
            f"site = {site!r}\n"
            "print(sorted(os.listdir(site + '/secretpkg')))\n"
            "print(read(site + '/secretpkg/__init__.py'), read(site + '/lone_env.py'),"
            f" read(site + '/__pycache__/' + {pyc[0]!r}), read(site + '/other.txt'))\n")
    r = run(sandbox, code)
    assert r.ok, r.stderr
    listing, contents = r.stdout.splitlines()
    assert listing == "[]"
    assert contents == "FileNotFoundError b'' b'' b'visible\\n'", contents
  finally:
    for name in ("secretpkg.tasks", "secretpkg", "lone_env"):
      sys.modules.pop(name, None)
    shutil.rmtree(system, ignore_errors=True)


def test_commands_sharing_too_few_cpus_have_their_wall_limits_stretched():
  """Red team 44: sandboxes' commands at once that may use more CPUs than the host has
  share them, and a correct solution slowed by a sibling's CPU-burning tool calls ran
  past its wall limit: a timeout, scored (a 12 s solution timed out at 20 s, 4 sandboxes
  on 2 CPUs). The pool stretches a command's wall limit by the sharing it meets: here two
  commands of one CPU each on one CPU (a process pinned to it), a burner beside a
  solution of 1 s of CPU under a 1.5 s limit. A command alone is not stretched (always
  stretched, one forking to its CPU quota had that much more CPU time: a reviewer), nor
  one beside a command that sleeps (counted as sharing, a sibling's sleep lent a brute
  force of 2.2 CPU-seconds the time to pass its 1.5 s)."""
  code = (
      "import asyncio, json, os, sys\n"
      "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
      "from envs.isolation import Limits\n"
      "from envs.pool import SandboxPool\n"
      "pool = SandboxPool(2, limits=Limits(wall_s=1.5, cpu_s=10), isolation=sys.argv[1],\n"
      "                   allow_unisolated=True)\n"
      "BURN = ('import time\\nt, n = time.process_time(), 0\\n'\n"
      "        'while time.process_time() - t < {}:\\n  n += 1\\n'\n"
      "        '  if n % 100000 == 0: print(round(time.process_time() - t, 2), flush=True)\\n'\n"
      "        'print(\"done\")')\n"
      "GROUPS = []\n"
      "async def run(seconds, code=BURN):\n"
      "  async with pool.acquire() as sb:\n"
      "    GROUPS.append(sb._cpu_cgroup is not None)\n"
      "    return await sb.run_python(code.format(seconds))\n"
      "async def beside_a_sleeper():\n"
      "  return await asyncio.gather(run(4, 'import time\\ntime.sleep({})'), run(2.2))\n"
      "async def main():\n"
      "  return await asyncio.gather(run(60), run(1.0))\n"
      "try:\n"
      "  burner, solution = asyncio.run(main())\n"
      "  alone = asyncio.run(run(60))\n"
      "  _, forced = asyncio.run(beside_a_sleeper())\n"
      "finally:\n"
      "  pool.close()\n"
      "last = lambda r: (r.stdout.strip().splitlines() or ['0'])[-1]\n"
      "print(json.dumps({'stretch': pool.wall_stretch, 'groups': all(GROUPS),\n"
      "                  **{k: [r.timed_out, last(r), r.duration_s] for k, r in (\n"
      "                      ('burner', burner), ('solution', solution), ('alone', alone),\n"
      "                      ('forced', forced))}}))\n")
  out = subprocess.run([sys.executable, "-c", code, (MODES or ["rlimits"])[0]], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  got = json.loads(out.stdout.splitlines()[-1])
  assert got["stretch"] == 2.0 and got["burner"][0], got
  # The solution, slowed past its limit beside the burner, passed: the stretch kept it.
  assert got["solution"][:2] == [False, "done"] and got["solution"][2] > 1.5, got
  # A burner alone had no more CPU time than its limit's (always stretched, it had 3 s);
  # one beside a sleeper (its slot counted as sharing) neither, where a CPU cgroup says
  # how long a command was kept from its CPU (without one, its pool's sharing does). By
  # CPU time, not wall: the other tests' processes may share this CPU.
  assert got["alone"][0] and float(got["alone"][1]) < 1.9, got
  if got["groups"]:
    assert got["forced"][0] and got["forced"][1] != "done" and float(got["forced"][1]) < 1.9, got
  assert "stretched by the CPU time it is kept from (up to 2.00x" in out.stderr


def test_a_wall_limit_is_stretched_at_most_max_stretch_times(sandbox, monkeypatch):
  """However long a command's CPU cgroup says it was kept from its CPU (siblings of the
  same policy burning the host's CPUs beside it), its wall limit grows at most
  `MAX_STRETCH` times: a brute force gets no unbounded time from a starved host."""
  from envs import sandbox as sandbox_module

  if sandbox._cpu_cgroup is None:
    pytest.skip("no CPU cgroup here")
  monkeypatch.setattr(sandbox_module, "starved_s", lambda *a: 1000.0)
  got = asyncio.run(sandbox._longer(2.0, time.perf_counter(), lambda: 1.0))
  assert got == 2.0 * sandbox_module.MAX_STRETCH == 8.0
  monkeypatch.setattr(sandbox_module, "starved_s", lambda *a: 0.5)
  assert asyncio.run(sandbox._longer(2.0, time.perf_counter(), lambda: 1.0)) == 2.5


def test_a_pool_holds_exactly_its_workspaces_and_frees_each_on_release():
  """`max_workspaces` live at once, not one more (each is a mount and a uid lease); a
  released one is removed and frees its place at once, and close releases the rest."""
  from jaxagent.errors import InfraError

  pool = SandboxPool(1, limits=LIMITS, isolation=(MODES or ["rlimits"])[0],
                     allow_unisolated=True, max_workspaces=2)
  try:
    a, b = pool.create(), pool.create()
    assert pool.in_use == 2 and a.host_path != b.host_path
    with pytest.raises(InfraError, match="at its limit of 2 workspaces"):
      pool.create()
    pool.release(a)
    assert pool.in_use == 1 and not os.path.exists(a.host_path)
    c = pool.create()
    assert pool.in_use == 2
  finally:
    pool.close()
  assert pool.in_use == 0
  assert not any(os.path.exists(sb.host_path) for sb in (a, b, c))


def test_a_host_oom_kill_is_the_infrastructures_only_where_the_operator_says_so():
  """A command the host's OOM killer takes is an infrastructure error (re-rolled) only
  where the operator said the host's memory is the pool's and its limits fit it; else
  it is the command's own failure (a solution that filled the host is a wrong answer,
  not a re-roll). The bound counts each live workspace's files."""
  kw = dict(limits=LIMITS, isolation=(MODES or ["rlimits"])[0], allow_unisolated=True)
  mine, shared = SandboxPool(1, host_oom_is_infra=True, **kw), SandboxPool(1, **kw)
  try:
    assert not shared.memory_fits()
    empty = mine.memory_bound()
    sb = mine.create()
    assert mine.memory_bound() == empty + LIMITS.disk_bytes
    mine.host_memory = mine.memory_bound()
    assert mine.memory_fits()
    mine.host_memory -= 1
    assert not mine.memory_fits()
    mine.release(sb)
  finally:
    mine.close()
    shared.close()


def test_a_pool_removes_only_the_workspaces_of_workers_no_longer_running(monkeypatch):
  """At start, a pool on an existing root removes what dead workers left there; a
  running worker's workspaces stay, another user's too (a signal to it not permitted),
  and entries not named as a pool's workspace are an operator's, kept."""
  root = scratch_dir()  # (traversable by sandbox uids)
  for name in ("424242-aaaaaaaaaaaa", "434343-bbbbbbbbbbbb", "515151-cccccccccccc",
               "notes"):
    os.makedirs(os.path.join(root, name))

  def kill(pid, sig):  # (424242 runs as another user, 434343 as this one, 515151 is gone)
    if pid == 424242:
      raise PermissionError(1, "Operation not permitted")
    if pid == 515151:
      raise ProcessLookupError(3, "No such process")

  with monkeypatch.context() as m:
    m.setattr(os, "kill", kill)
    pool = SandboxPool(1, root=str(root), limits=LIMITS,
                       isolation=(MODES or ["rlimits"])[0], allow_unisolated=True)
  pool.close()
  assert sorted(os.listdir(root)) == ["424242-aaaaaaaaaaaa", "434343-bbbbbbbbbbbb", "notes"]


def test_a_write_after_the_close_makes_no_workspace_again(sandbox):
  """A tool's write whose step was cancelled ran on in its thread past the close and
  made the workspace again on the host's disk, out of any quota and of its pool's count
  (a red team); a close twice is a close once."""
  from jaxagent.errors import InfraError

  sandbox.write_file("solution.py", "x = 1\n")
  sandbox.destroy()
  with pytest.raises(InfraError, match="closed"):
    sandbox.write_file("solution.py", "x" * 1000)
  assert not os.path.exists(sandbox.mountpoint)
  sandbox.destroy()


@needs_isolation
def test_a_workspace_gone_is_the_infrastructures_not_an_empty_one(sandbox):
  """The files of a workspace gone (its holder dead, its filesystem gone) read as none,
  and grading none failed a sound answer as its ModuleNotFoundError (a red team). Under
  namespaces the command cannot remove its workspace (a mount point): gone, it is the
  infrastructure's."""
  from jaxagent.errors import InfraError

  sandbox.write_file("solution.py", "x = 1\n")
  assert sandbox.files() == {"solution.py": b"x = 1\n"}
  if sandbox.uid is not None:  # (its quota tmpfs)
    subprocess.run(["umount", "-l", sandbox.host_path], check=True)
  shutil.rmtree(sandbox.host_path)
  with pytest.raises(InfraError, match="reading the workspace's files"):
    sandbox.files()
  with pytest.raises(InfraError, match="is gone"):
    sandbox.write_file("sub/solution.py", "x = 2\n")
  assert not os.path.exists(sandbox.host_path)


def test_a_workspace_its_command_removed_is_its_doing_not_the_infrastructures():
  """Without namespaces a command runs in its workspace as the host's user and can
  remove it: graded as no files, as before, not the infrastructure's error, which would
  have re-rolled a losing episode whose code wiped its workspace (a reviewer)."""
  root = scratch_dir()
  sb = Sandbox(os.path.join(root, "ws"), limits=LIMITS, isolation="rlimits")
  try:
    sb.write_file("solution.py", "x = 1\n")
    r = run(sb, "import os, shutil; shutil.rmtree(os.getcwd())")
    assert r.exit_code == 0 and not os.path.exists(sb.host_path), r
    assert sb.files() == {}
    sb.write_file("solution.py", "x = 2\n")  # (made again, as before)
    assert sb.files() == {"solution.py": b"x = 2\n"}
    r = run(sb, "import os, shutil; d = os.getcwd(); shutil.rmtree(d); open(d, 'w')")
    assert r.exit_code == 0 and os.path.isfile(sb.host_path), r  # (replaced by a file)
    assert sb.files() == {}
  finally:
    sb.destroy()


def test_a_termination_cut_short_leaves_no_descriptor_open():
  """A command's own end cancelled the disk watch terminating it: the descriptors of its
  namespace's inits stayed open for the worker's life (a red team)."""
  root = scratch_dir()
  sb = Sandbox(os.path.join(root, "ws"), limits=LIMITS, isolation="rlimits")
  sb.isolation = "bwrap"  # (its namespace's init: the command's child, as bwrap's)

  async def main():
    proc = await asyncio.create_subprocess_exec("sh", "-c", "sleep 30 & wait",
                                                start_new_session=True)
    await asyncio.sleep(0.3)
    before = len(os.listdir("/proc/self/fd"))
    terminating = asyncio.ensure_future(sb._terminate(proc))
    await asyncio.sleep(0)
    terminating.cancel()
    with contextlib.suppress(asyncio.CancelledError):
      await terminating
    assert len(os.listdir("/proc/self/fd")) == before
    await proc.wait()

  try:
    asyncio.run(main())
  finally:
    sb.isolation = "rlimits"
    sb.destroy()

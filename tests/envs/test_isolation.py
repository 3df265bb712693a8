"""The isolation under a sandbox: bubblewrap for a non-root worker, uids and process
limits per sandbox, user namespaces refused, memory and CPU time limited for all of a
sandbox's processes together (cgroups), the host's OOM kills, the seccomp filter and
a mount namespace's failed setup. The shared fixtures are test_sandbox.py's."""

import asyncio
import contextlib
import errno
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from envs.isolation import Limits
from envs.pool import SandboxPool
from envs.sandbox import Sandbox
from tests.conftest import REPO
from tests.envs.test_sandbox import (  # noqa: F401 (remove_scratch and sandbox: fixtures)
  ISOLATION, LIMITS, MODES, needs_isolation, remove_scratch, run, sandbox, scratch_dir)


def test_a_non_root_worker_uses_bubblewrap(tmp_path):
  """A worker that is not root still gets namespaces from bubblewrap (user namespaces)."""
  if os.geteuid() != 0 or "bwrap" not in MODES or not os.path.exists("/usr/bin/python3"):
    pytest.skip("needs root (to become another user), bubblewrap and the system Python")
  code_dir = scratch_dir()
  os.chmod(code_dir, 0o755)  # the module alone, readable by the unprivileged user
  shutil.copy(os.path.join(REPO, "envs", "sandbox.py"), code_dir)
  script = ("import asyncio, os, sys, tempfile\n"
            f"sys.path.insert(0, {code_dir!r})\n"
            "import sandbox as S\n"
            "root = tempfile.mkdtemp(); os.chmod(root, 0o711)\n"
            "sb = S.Sandbox(root + '/ws')\n"
            "r = asyncio.run(sb.run([sb.python, '-c', 'import os; print(os.getuid(), "
            "sorted(os.listdir(\"/\")), os.path.exists(\"/root\"))']))\n"
            "print(sb.isolation, r.stdout.strip())\n"
            "sb.destroy()\n")
  try:
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        "/usr/bin/python3", "-c", script], capture_output=True, text=True,
                       timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
  finally:
    shutil.rmtree(code_dir, ignore_errors=True)
  assert r.returncode == 0, r.stderr
  isolation, uid, *rest = r.stdout.strip().split(" ", 2)
  assert isolation == "bwrap" and uid == "65534"
  assert "'workspace'" in rest[0] and "'root'" not in rest[0] and rest[0].endswith("False")


def test_a_non_root_workers_sandboxes_each_have_their_own_process_limit():
  """Without root every sandbox runs as the worker's user, and RLIMIT_NPROC set outside
  counted every process and thread of that user: one sandbox holding 60 processes (or a
  worker of 70 threads) stopped every other from starting, and other episodes' correct
  answers were graded as infra errors (red team). The limit is set inside each
  sandbox's user namespace now: it still holds there, for that sandbox alone."""
  if os.geteuid() != 0 or "bwrap" not in MODES or not os.path.exists("/usr/bin/python3"):
    pytest.skip("needs root (to become another user), bubblewrap and the system Python")
  forker = ("import os, time\nn = 0\nfor i in range(200):\n  try:\n"
            "    if os.fork() == 0:\n      time.sleep(6); os._exit(0)\n    n += 1\n"
            "  except OSError:\n    break\nprint(n, flush=True)\ntime.sleep(6)\n")
  script = ("import asyncio, os, sys, tempfile, threading, time\n"
            f"sys.path.insert(0, {REPO!r})\n"
            "from envs.pool import SandboxPool\nfrom envs.sandbox import Limits\n"
            "stop = threading.Event()\n"
            "for _ in range(70):  # a worker's own threads (JAX's, an executor's)\n"
            "  threading.Thread(target=stop.wait, daemon=True).start()\n"
            "async def main():\n"
            "  pool = SandboxPool(2, root=tempfile.mkdtemp(), limits=Limits(wall_s=10))\n"
            "  async with pool.acquire() as a, pool.acquire() as b:\n"
            f"    a.write_file('fork.py', {forker!r})\n"
            "    held = asyncio.ensure_future(a.run_python(open(a.host_path + '/fork.py').read(),"
            " timeout=9))\n"
            "    await asyncio.sleep(2.5)\n"
            "    beside = await b.run_python('print(\"beside\")')\n"
            "    print(pool.isolation, (await held).stdout.split()[0], beside.stdout.strip(),"
            " beside.error)\n"
            "  pool.close()\n"
            "asyncio.run(main())\n")
  r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                      "/usr/bin/python3", "-c", script], capture_output=True, text=True,
                     timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"}, cwd="/tmp")
  assert r.returncode == 0, r.stderr[-2000:]
  isolation, forked, beside, error = r.stdout.split()
  assert isolation == "bwrap" and beside == "beside" and error == "None", r.stdout
  assert 50 < int(forked) < Limits().processes, r.stdout  # the limit holds in the sandbox


@pytest.mark.skipif("bwrap" not in MODES, reason="bubblewrap is not on this host")
def test_tool_code_cannot_open_user_namespaces_under_bubblewrap():
  """`unshare -r` (a user namespace of its own, with capabilities inside it: more of the
  kernel in reach) fails inside the sandbox."""
  from envs.isolation import _bwrap_can_disable_userns

  if not _bwrap_can_disable_userns():
    pytest.skip("this bubblewrap has no --disable-userns (before 0.8)")
  r, ok = _unshared_in_bwrap()
  assert r.exit_code not in (0, None), (r.stdout, r.stderr)
  assert ok.ok and ok.stdout == "still runs\n"


def _unshared_in_bwrap():
  """What `unshare -r true` gave in a bubblewrap sandbox, and a command run after it."""
  root = scratch_dir()
  os.chmod(root, 0o711)
  sb = Sandbox(os.path.join(root, "ws"), limits=LIMITS, isolation="bwrap")
  try:
    return asyncio.run(sb.run(["unshare", "-r", "true"])), run(sb, "print('still runs')")
  finally:
    sb.destroy()
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.skipif("bwrap" not in MODES, reason="bubblewrap is not on this host")
def test_user_namespaces_stay_refused_under_bubblewrap_without_the_seccomp_filter(
    monkeypatch):
  """bubblewrap's own --disable-userns holds where no seccomp filter does (a host without
  libseccomp): `unshare -r` still fails, refused by bubblewrap's own bound (a count of
  user namespaces that is spent: ENOSPC), not by the host."""
  from envs import sandbox as sandbox_module
  from envs.isolation import _bwrap_can_disable_userns

  if not _bwrap_can_disable_userns():
    pytest.skip("this bubblewrap has no --disable-userns (before 0.8)")
  if subprocess.run(["unshare", "-r", "true"], capture_output=True).returncode != 0:
    pytest.skip("this host refuses user namespaces itself")
  monkeypatch.setattr(sandbox_module, "seccomp_program", lambda *a, **k: None)
  r, _ = _unshared_in_bwrap()
  assert r.exit_code not in (0, None), (r.stdout, r.stderr)
  assert os.strerror(errno.ENOSPC) in r.stderr, (r.stdout, r.stderr)


@needs_isolation
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the probe uses x86_64 numbers")
def test_a_raw_clone_into_a_new_user_namespace_is_refused_by_the_filter(sandbox):
  """Tool code that calls clone(CLONE_NEWUSER) itself, not through unshare(1), is refused
  by the seccomp filter (EPERM), and so is unshare(CLONE_NEWUSER), in either namespace
  mode."""
  if not sandbox.describe()["seccomp"]:
    pytest.skip("no seccomp filter here")
  code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
          "r = libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)\n"  # clone(NEWUSER | SIGCHLD)
          "if r == 0:\n  os._exit(0)\n"
          "print('cloned' if r > 0 else os.strerror(ctypes.get_errno()))\n"
          "r = libc.syscall(272, 0x10000000)\n"  # unshare(CLONE_NEWUSER)
          "print('unshared' if r == 0 else os.strerror(ctypes.get_errno()))\n")
  r = run(sandbox, code)
  assert r.ok and r.stdout == (os.strerror(errno.EPERM) + "\n") * 2, (r.stdout, r.stderr)


@needs_isolation
def test_memory_is_limited_for_all_of_a_sandboxs_processes_together(sandbox):
  """Three processes of 200 MB each stay under the per-process address-space limit
  (512 MiB) but not under a 256 MiB limit for the sandbox as a whole, which a memory
  cgroup enforces where the host allows one (root with a writable controller)."""
  from envs.cgroups import memory_cgroup

  if sandbox._cgroup is None:
    assert memory_cgroup(f"jaxagent-{sandbox.uid or 0}", 1 << 30) is None \
        or sandbox.uid is None
    pytest.skip("no writable memory cgroup on this host")
  with open(os.path.join(sandbox._cgroup, "memory.limit_in_bytes")
            if os.path.exists(os.path.join(sandbox._cgroup, "memory.limit_in_bytes"))
            else os.path.join(sandbox._cgroup, "memory.max"), "w") as f:
    f.write(str(256 << 20))
  code = ("import os, sys, time\nkids = []\nfor i in range(3):\n  pid = os.fork()\n"
          "  if pid == 0:\n    b = bytearray(200 << 20)\n    for j in range(0, len(b), 4096):\n"
          "      b[j] = 1\n    time.sleep(1)\n    os._exit(0)\n  kids.append(pid)\n"
          "ok = sum(os.waitpid(p, 0)[1] == 0 for p in kids)\nprint('completed', ok)\n")
  sandbox._memory_fits = lambda: True  # host kills would be the infrastructure's
  r = run(sandbox, code, timeout=20)
  assert "completed" in r.stdout, r.stderr[-500:]
  assert int(r.stdout.split()[-1]) < 3, r.stdout  # the cgroup's OOM killer took one
  # ... for the sandbox's own limit: the solution's doing, not the host's
  assert r.oom_kills >= 1 and r.error is None, (r.oom_kills, r.error)
  assert run(sandbox, "print('alive')").stdout == "alive\n"


# Fills TCP (24 connections over the sandbox's loopback, 8 MiB buffers asked for) or UDP
# (24 receivers that never read) and says how many MiB it queued.
SOCKET_FILL = r'''
import socket, sys
def fill(s, buf=b"x" * 65536):
  s.setblocking(False)
  n = 0
  while True:
    try:
      n += s.send(buf)
    except OSError:
      return n
total, keep = 0, []
if sys.argv[1] == "tcp":
  listener = socket.socket()
  listener.bind(("127.0.0.1", 0))
  listener.listen(64)
  for i in range(24):
    c = socket.create_connection(listener.getsockname())
    s, _ = listener.accept()
    keep += [c, s]
    for x in (c, s):
      x.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
      x.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    total += fill(c) + fill(s)
else:
  w = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
  w.setblocking(False)
  for i in range(24):
    q = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    q.bind(("127.0.0.1", 0))
    q.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    keep.append(q)
    for j in range(4000):
      try:
        total += w.sendto(b"x" * 1000, q.getsockname())
      except OSError:
        break
print(total >> 20)
'''


@pytest.mark.skipif(os.geteuid() != 0 or "bwrap" not in MODES or not os.path.exists(
    "/sys/fs/cgroup/memory/memory.kmem.tcp.limit_in_bytes"),
                    reason="needs root, bubblewrap and cgroup v1's kmem.tcp")
def test_a_sandboxs_tcp_and_udp_buffers_are_bounded_by_its_cgroup():
  """TCP and UDP buffers over a sandbox's own loopback counted only against the host's
  tcp_mem / udp_mem (cgroup v1 counts them in a memory cgroup only with its kmem.tcp set):
  one sandbox held 503 MiB of TCP buffers and took the host to its hard limit (red team:
  the host's loopback round trips went 2 ms -> 2 s). Its cgroup holds them to
  `Limits.socket_bytes` (measured: 15 MiB at 16)."""
  root = scratch_dir()
  os.chmod(root, 0o711)
  sb = Sandbox(os.path.join(root, "ws"), isolation="bwrap",
               limits=Limits(wall_s=20, cpu_s=20, socket_bytes=8 << 20))
  try:
    if sb._cgroup is None:
      pytest.skip("no memory cgroup for the sandbox here")
    knob = os.path.join(sb._cgroup, "memory.kmem.tcp.limit_in_bytes")
    assert int(open(knob).read()) == 8 << 20
    sb.write_file("fill.py", SOCKET_FILL)
    queued = {}
    for kind in ("tcp", "udp"):
      r = asyncio.run(sb.run([sb.python, "fill.py", kind], timeout=20))
      assert r.ok, (r.stdout, r.stderr[-1000:])
      queued[kind] = int(r.stdout)
    used = int(open(os.path.join(sb._cgroup, "memory.kmem.tcp.max_usage_in_bytes")).read())
  finally:
    sb.destroy()
    shutil.rmtree(root, ignore_errors=True)
  # (the kernel charges a little past the bound before it pushes back; unbounded, the
  # same command queued 503 MiB of TCP)
  assert queued["tcp"] <= 16 and used <= 12 << 20, (queued, used)


THREE_OF_200_MB = (
    "import os, sys, time\nkids = []\nfor i in range(3):\n  pid = os.fork()\n"
    "  if pid == 0:\n    b = bytearray(200 << 20)\n    for j in range(0, len(b), 4096):\n"
    "      b[j] = 1\n    time.sleep(1)\n    os._exit(0)\n  kids.append(pid)\n"
    "ok = sum(os.waitpid(p, 0)[1] == 0 for p in kids)\nprint('completed', ok)\n")


def test_a_worker_that_is_not_root_bounds_a_sandbox_in_a_delegated_cgroup():
  """A worker that is not root had no memory cgroup: a sandbox's processes were bounded
  one by one (RLIMIT_AS), 64 times over, and the kernel's buffers they held not at all
  (a red team's High finding: the host's OOM killer took the worker). Given a cgroup
  delegated to it (`--cgroup`, `cgroup_parents`), it holds each sandbox below it: as
  user 65534, three processes of 200 MB under a 256 MiB bound for the sandbox, one is
  the cgroup's OOM kill, the command's own failure. A cgroup it cannot write is named."""
  from tests.envs.test_sandbox import skip_unless_nobody_runs_python

  skip_unless_nobody_runs_python()
  hierarchy = "/sys/fs/cgroup/memory"
  if not os.path.exists(os.path.join(hierarchy, "memory.limit_in_bytes")):
    mine = open("/proc/self/cgroup").read().splitlines()
    hierarchy = "/sys/fs/cgroup" + next((l.split(":", 2)[2] for l in mine if l.startswith("0::")), "")
  parent = os.path.join(hierarchy, f"jaxagent-test-{os.getpid()}")
  try:
    os.mkdir(parent)
  except OSError as e:
    pytest.skip(f"cannot make a cgroup here: {e}")
  root = scratch_dir()
  try:
    if not os.path.exists(os.path.join(parent, "memory.limit_in_bytes")):
      with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
        f.write("+memory")  # (v2: may fail where the worker's cgroup holds processes)
    for name in [""] + (["cgroup.procs", "cgroup.subtree_control"]
                        if not os.path.exists(os.path.join(parent, "tasks")) else []):
      os.chown(os.path.join(parent, name), 65534, 65534)
    os.chown(root, 65534, 65534)
    code = f"""import asyncio, os, sys
sys.path.insert(0, sys.argv[2])
from envs.pool import SandboxPool
from envs.sandbox import Limits
for parent in ('/proc', os.path.dirname(sys.argv[3])):  # (no cgroup; root's)
  try:
    SandboxPool(1, cgroup_parents=[parent])
  except ValueError as e:
    print(e)
pool = SandboxPool(1, root=sys.argv[1], cgroup_parents=[sys.argv[3]],
                   limits=Limits(wall_s=20, cpu_s=20, group_memory_bytes=256 << 20,
                                 memory_bytes=512 << 20))
async def main():
  async with pool.acquire() as sb:
    print(os.geteuid(), sb.uid, [os.path.dirname(c) for c in sb.describe()['cgroups']])
    tcp = os.path.join(sb._cgroup, 'memory.kmem.tcp.limit_in_bytes')
    print(open(tcp).read().strip() if os.path.exists(tcp) else 'v2')
    r = await sb.run_python({THREE_OF_200_MB!r}, timeout=20)
    print(r.stdout.strip(), r.oom_kills >= 1, r.error)
asyncio.run(main())
pool.close()
print([n for n in os.listdir(sys.argv[3]) if n.startswith('jaxagent-')])
"""
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          sys.executable, "-c", code, root, REPO, parent],
                         capture_output=True, text=True, timeout=120)
  finally:
    shutil.rmtree(root, ignore_errors=True)
    for child in os.listdir(parent):
      if os.path.isdir(os.path.join(parent, child)):
        with contextlib.suppress(OSError):
          os.rmdir(os.path.join(parent, child))
    with contextlib.suppress(OSError):
      os.rmdir(parent)
  lines = out.stdout.splitlines()
  assert len(lines) == 6, (out.stdout, out.stderr[-2000:])
  assert lines[0].startswith("cgroup /proc: neither the memory nor the cpu controller")
  assert lines[1].startswith(f"cgroup {os.path.dirname(parent)}: this worker (uid 65534) "
                             "cannot make the sandbox's memory cgroup"), lines[1]
  assert "Permission denied" in lines[1], lines[1]
  assert lines[2] == f"65534 None ['{parent}']", lines
  assert lines[3] in (str(Limits().socket_bytes), "v2"), lines  # (its TCP and UDP bound)
  completed, killed, error = lines[4].rsplit(" ", 2)
  assert int(completed.split()[-1]) < 3 and killed == "True" and error == "None", lines
  assert lines[5] == "[]", lines  # (its cgroups removed with it)


def _joined(cgroup: str) -> None:
  """Waits (at most 2 s) until a process is in `cgroup`."""
  for _ in range(100):
    if open(os.path.join(cgroup, "cgroup.procs")).read().split():
      return
    time.sleep(0.02)


def test_a_sandboxs_cgroup_is_removed_once_the_processes_left_in_it_are_killed():
  """A timed-out command's processes, still exiting when a worker that is not root
  released its sandbox, kept the rmdir of its cgroups from working: they were left
  behind, every time (red team). They are killed, and the cgroup removed."""
  from envs.cgroups import join_cgroups, remove_cgroup

  hierarchy = "/sys/fs/cgroup/memory"
  path = os.path.join(hierarchy, f"jaxagent-test-rm-{os.getpid()}")
  try:
    os.mkdir(path)
  except OSError as e:
    pytest.skip(f"cannot make a v1 memory cgroup here: {e}")
  proc = subprocess.Popen([*join_cgroups([path]), "sleep", "60"])
  try:
    _joined(path)
    reaper = threading.Thread(target=proc.wait)
    reaper.start()
    assert remove_cgroup(path, wait_s=5.0)
    reaper.join(timeout=5)
    assert not os.path.exists(path) and proc.returncode == -9
  finally:
    proc.kill()
    with contextlib.suppress(OSError):
      os.rmdir(path)


def test_cgroups_a_worker_no_longer_running_left_are_removed_when_a_pool_starts():
  """A worker killed before it released its sandboxes left their cgroups (and what ran in
  them) below its delegated cgroup, and v1 allows 65,535 memory cgroups. A pool given
  that cgroup removes those whose worker is gone; a live worker's stay."""
  from envs.cgroups import join_cgroups

  parent = os.path.join("/sys/fs/cgroup/memory", f"jaxagent-test-stale-{os.getpid()}")
  try:
    os.mkdir(parent)
  except OSError as e:
    pytest.skip(f"cannot make a v1 memory cgroup here: {e}")
  gone = subprocess.Popen(["true"])
  gone.wait()
  stale, live, probe, other = (os.path.join(parent, n) for n in (
      f"jaxagent-{gone.pid}-ws1", f"jaxagent-{os.getppid()}-ws2",
      f"jaxagent-probe-{gone.pid}", "not-ours"))
  for path in (stale, live, probe, other):
    os.mkdir(path)
  left = subprocess.Popen([*join_cgroups([stale]), "sleep", "60"])
  try:
    _joined(stale)
    SandboxPool(1, cgroup_parents=[parent], allow_unisolated=True).close()
    assert not os.path.exists(stale) and not os.path.exists(probe)
    assert os.path.isdir(live) and os.path.isdir(other)
    assert left.wait(timeout=5) == -9
  finally:
    left.kill()
    for path in (stale, live, probe, other, parent):
      with contextlib.suppress(OSError):
        os.rmdir(path)


def test_a_kill_by_the_hosts_oom_killer_is_infrastructure_only_where_the_limits_fit():
  """The kernel counts a sandbox's OOM kills whoever made them; those made while its
  cgroup never reached its limit are the host's OOM killer's. They are an
  infrastructure error where the pool's limits fit the host's free memory, and the
  command's own where they may overcommit it (a solution filling its own share could
  have caused them: calling them infrastructure would buy it a re-roll)."""
  from envs.cgroups import oom_attribution

  for fits in (True, False):
    assert oom_attribution((3, 1), (3, 1), host_kills_are_infra=fits) == (0, 0)
    assert oom_attribution((3, 1), (5, 2), host_kills_are_infra=fits) == (1, 0)  # its limit
  assert oom_attribution((3, 1), (3, 3), host_kills_are_infra=True) == (0, 2)
  assert oom_attribution((3, 1), (3, 3), host_kills_are_infra=False) == (2, 0)

  root = scratch_dir()
  os.chmod(root, 0o711)
  for fits in (True, False):
    sb = Sandbox(os.path.join(root, f"ws{fits}"), limits=LIMITS, isolation=ISOLATION,
                 memory_fits=lambda fits=fits: fits)
    counts = iter([(0, 0), (0, 1)])  # the kernel's counters around the command
    sb.oom_counts = lambda: next(counts)
    try:
      r = run(sb, "print('x')")
    finally:
      sb.destroy()
    if fits:
      assert r.error and "host ran out of memory" in r.error and r.oom_kills == 0, r
    else:
      assert r.error is None and r.oom_kills == 1, r
  shutil.rmtree(root, ignore_errors=True)


def test_host_oom_kills_are_infrastructure_only_where_the_operator_says_and_limits_fit(
    caplog):
  """The pool's bound (commands at once x their memory limit and /tmp and /dev/shm, live
  workspaces x their file quotas) against the memory free at start (the host's, a container's cgroup
  above it): a host OOM kill is the infrastructure's only where the operator says the
  host's memory is the pool's (`host_oom_is_infra`; free memory seen by two workers
  started together, or a container's limit missed, would let a failing solution buy a
  re-roll) and the bound fits; an overcommitted pool says so."""
  small = Limits(group_memory_bytes=64 << 20)
  for said in (False, True):
    pool = SandboxPool(1, limits=small, isolation=ISOLATION, allow_unisolated=True,
                       host_oom_is_infra=said)
    try:
      assert pool.memory_fits() is said and 0 < pool.memory_bound() < pool.host_memory
      bound, sb = pool.memory_bound(), pool.create()  # a live workspace holds its files
      assert pool.memory_bound() == bound + pool.limits.disk_bytes
      pool.release(sb)
    finally:
      pool.close()
  with caplog.at_level("WARNING", logger="envs.pool"):
    pool = SandboxPool(2, limits=Limits(group_memory_bytes=1 << 50), isolation=ISOLATION,
                       allow_unisolated=True, host_oom_is_infra=True)
  try:
    assert not pool.memory_fits() and "overcommit this host's memory" in caplog.text
    assert pool.memory_bound() == 2 * ((1 << 50) + 2 * pool.limits.tmp_bytes)
  finally:
    pool.close()


def test_free_memory_counts_a_memory_cgroup_above_the_worker(tmp_path, monkeypatch):
  """A container's limit sits on its cgroup hierarchy's root as the worker sees it (v2
  under a cgroup namespace, whose worker is in a child with no limit of its own; v1
  under Docker, whose /proc/self/cgroup names a path the mount does not have) or on a
  cgroup above the worker: the least any of them leaves is what is free."""
  import envs.cgroups as S

  root = tmp_path / "cgroup"
  for path, limit, used in (("", 512 << 20, 100 << 20), ("box", "max", 99 << 20),
                            ("box/worker", "max", 1 << 20)):
    (root / path).mkdir(parents=True, exist_ok=True)
    (root / path / "memory.max").write_text(f"{limit}\n")
    (root / path / "memory.current").write_text(f"{used}\n")
  fake_self = tmp_path / "self-cgroup"
  fake_self.write_text("0::/box/worker\n")
  real_open = open

  def fake_open(path, *a, **kw):
    return real_open(fake_self if path == "/proc/self/cgroup" else path, *a, **kw)

  monkeypatch.setattr(S, "_CGROUP_ROOT", str(root))
  monkeypatch.setattr("builtins.open", fake_open)
  assert S.available_memory_bytes() == (512 - 100) << 20
  (root / "box" / "memory.max").write_text(f"{150 << 20}\n")  # a tighter one on the path
  assert S.available_memory_bytes() == (150 - 99) << 20



@needs_isolation
def test_cpu_time_is_limited_for_all_of_a_sandboxs_processes_together():
  """Four processes spinning for 1.5 s get half a CPU's time together (`Limits.cpus`, a
  CPU cgroup's quota where the host allows one): a sandbox cannot starve the host's other
  sandboxes and graders (red-team)."""
  root = scratch_dir()
  os.chmod(root, 0o711)
  sb = Sandbox(os.path.join(root, "ws"), limits=Limits(cpus=0.5), isolation=MODES[0])
  try:
    if sb._cpu_cgroup is None:
      pytest.skip("no writable CPU cgroup on this host")
    code = ("import os, time\nkids = []\nfor i in range(4):\n  pid = os.fork()\n"
            "  if pid == 0:\n    t = time.time()\n    while time.time() - t < 1.5:\n"
            "      pass\n    os._exit(0)\n  kids.append(pid)\n"
            "for p in kids:\n  os.waitpid(p, 0)\nt = os.times()\n"
            "print(t.children_user + t.children_system)\n")
    r = run(sb, code, timeout=20)
    assert r.ok, r.stderr[-500:]
    assert float(r.stdout) < 0.5 * 1.5 + 0.45, r.stdout  # 6 s of spinning, unbounded
  finally:
    sb.destroy()
    shutil.rmtree(root, ignore_errors=True)


def _cpu_quota(sb) -> str:
  path = sb._cpu_cgroup
  knob = "cpu.max" if os.path.exists(os.path.join(path, "cpu.max")) else "cpu.cfs_quota_us"
  with open(os.path.join(path, knob)) as f:
    return f.read().split()[0]


@needs_isolation
def test_the_cpus_a_process_may_use_count_its_cgroups_quota():
  """A pool's wall stretch is by the CPUs this process may use: a container's CPU quota
  (its cgroup's, or a parent's) counts, not only the CPUs it may run on."""
  from envs.cgroups import cpu_cgroup, join_cgroups, remove_cgroup, usable_cpus

  path = cpu_cgroup(f"jaxagent-test-quota-{os.getpid()}", 0.5) if os.geteuid() == 0 else None
  if path is None:
    pytest.skip("no writable CPU cgroup on this host")
  try:
    out = subprocess.run([*join_cgroups([path]), sys.executable, "-c",
                          "from envs.cgroups import usable_cpus; print(usable_cpus())"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-1000:]
    assert float(out.stdout) == 0.5 and usable_cpus() >= 1.0, out.stdout
  finally:
    remove_cgroup(path)


def test_a_killed_commands_exit_is_not_held_to_the_cpu_quota_and_the_next_command_is():
  """The kernel's teardown of killed processes is charged to their CPU cgroup: the quota
  is lifted while they exit and set again before the sandbox's next command."""
  root = scratch_dir()
  os.chmod(root, 0o711)
  sb = Sandbox(os.path.join(root, "ws"), limits=Limits(cpus=0.5, wall_s=1),
               isolation=MODES[0])
  try:
    if sb._cpu_cgroup is None:
      pytest.skip("no writable CPU cgroup on this host")
    held = _cpu_quota(sb)
    lifted = []
    unthrottle = sb._unthrottle

    def seen():
      unthrottle()
      lifted.append(_cpu_quota(sb))
    sb._unthrottle = seen
    r = run(sb, "import os, time\nos.fork()\ntime.sleep(30)\n")
    assert r.timed_out and lifted and lifted[0] in ("max", "-1"), (r, lifted)
    assert held == "50000" and _cpu_quota(sb) == held and not sb._unthrottled
    # A quota left lifted (a cleanup cancelled twice, a wipe) is set again as the next
    # command starts: it spins for 0.6 s of wall time on half a CPU.
    sb.wipe()
    sb._unthrottle()
    assert _cpu_quota(sb) in ("max", "-1")
    spin = ("import os, time\nt = time.time()\nwhile time.time() - t < 0.6:\n  pass\n"
            "print(os.times().user)\n")
    r = run(sb, spin, timeout=10)
    assert r.ok and _cpu_quota(sb) == held, r.stderr[-300:]
    assert float(r.stdout) < 0.6 * 0.5 + 0.15, r.stdout  # (unbounded: 0.6)
  finally:
    sb.destroy()
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@needs_isolation
def test_a_command_cannot_stall_its_own_kill_past_the_wall_limit():
  """64 processes of ~64k mappings each, killed at the wall limit, took 35-56 s past it
  to exit, left to their PID namespace init's exit under the sandbox's 1-CPU quota: the
  call outlasted the env worker's wall bound, a 504, and a wrong answer was re-rolled
  instead of scored (red team). Each killed at once, the quota lifted for their exit,
  they are gone in ~2.4 s (`tools/bench_teardown.py`)."""
  from tools.bench_teardown import SLOW_TEARDOWN
  root = scratch_dir()
  os.chmod(root, 0o711)
  sb = Sandbox(os.path.join(root, "ws"), limits=Limits(cpus=1, wall_s=10), isolation=MODES[0])
  try:
    if sb._cpu_cgroup is None:
      pytest.skip("no writable CPU cgroup on this host")
    r = run(sb, SLOW_TEARDOWN)
    # (as before: 35-56 s past the wall limit here, with 12-25 OOM kills. Whether
    # every process prints "forked" before the OOM kills varies, so it is not asserted.)
    assert r.duration_s < 10 + 20, r
    # Mostly a timeout. On a loaded machine the event loop wakes past the wall limit and
    # gives the command HELD_LOOP_S more to be seen ending; if the OOM kills of its own
    # memory limit had ended it within the limit, it is that exit (137): a failed command
    # either way, never an infrastructure error (fresh-clone CI, beside another test).
    assert r.timed_out or (r.exit_code == 137 and r.oom_kills > 0), r
    assert not r.ok and r.error is None, r
  finally:
    sb.destroy()
    shutil.rmtree(root, ignore_errors=True)


SECCOMP_PROBE = r'''
import ctypes, errno, multiprocessing, os, subprocess, threading
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *args):
  r = libc.syscall(nr, *args)
  return errno.errorcode.get(ctypes.get_errno(), "?") if r == -1 else str(r)
# x86_64 numbers; without the filter these answer 0, EFAULT, EINVAL, EINVAL, EFAULT.
print(call(101, 0, 0, 0, 0), call(425, 1, 0), call(321, 0, 0, 0), call(250, 0, 0),
      call(298, 0, 0, 0, 0, 0))
print(subprocess.run(["echo", "child"], capture_output=True, text=True).stdout.strip())
t = threading.Thread(target=print, args=("thread",)); t.start(); t.join()
with multiprocessing.Pool(2) as pool:
  print(sum(pool.map(abs, [-1, -2])))
# memory outside every address space: a memfd, SysV shm (at, get), a message queue
# (shmget and msgget with IPC_PRIVATE, IPC_CREAT | 0600: an id without the filter)
try:
  os.memfd_create("m")
  memfd = "made"
except OSError as e:
  memfd = errno.errorcode[e.errno]
print(memfd, call(29, 0, 1 << 20, 0o1600), call(30, 0, 0, 0), call(68, 0, 0o1600))
# what stays: POSIX shared memory (in /dev/shm) and a ctypes callback (libffi's closures)
from multiprocessing import shared_memory
shm = shared_memory.SharedMemory(create=True, size=4096)
shm.buf[0] = 7
other = shared_memory.SharedMemory(shm.name)
print(other.buf[0], ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 5)())
other.close(); shm.close(); shm.unlink()
# extended attributes (kernel memory no tmpfs size counts) answer EOPNOTSUPP, as a
# filesystem without them does; a copy that keeps them goes on
import shutil
open("/tmp/a", "w").close()
try:
  os.setxattr("/tmp/a", "user.x", b"x" * 1000)
  xattr = "set"
except OSError as e:
  xattr = errno.errorcode[e.errno]
# (setxattrat, 463, is newer than libseccomp 2.5.4, which refused its rule by name: set
# by number; without the filter these arguments answer EFAULT or EINVAL)
print(xattr, call(463, -100, 0, 0, 0, 0, 0), shutil.copy2("/tmp/a", "/tmp/b"))
'''


@needs_isolation
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the probe uses x86_64 numbers")
def test_a_seccomp_filter_refuses_the_kernels_rarely_needed_syscalls(sandbox):
  """ptrace, io_uring, bpf, keyctl and perf_event_open (the kernel surface that tool code
  never needs and exploits often do) fail with EPERM, and so do memfds, SysV shared memory
  and message queues (memory that RLIMIT_AS does not bound: a red team held 2 GiB with
  9 MB resident), and setting extended attributes answers EOPNOTSUPP (kernel memory no
  tmpfs size counts: 3 GiB on each of /tmp and /dev/shm in 7 s, red team 6); processes,
  threads, pools, POSIX shared memory, ctypes callbacks and shutil.copy2 run."""
  from envs.isolation import seccomp_program

  if seccomp_program() is None:
    pytest.skip("no libseccomp on this host")
  r = run(sandbox, SECCOMP_PROBE, timeout=10)
  assert r.ok, r.stderr
  assert r.stdout.split("\n")[:7] == ["EPERM EPERM EPERM EPERM EPERM", "child", "thread", "3",
                                      "EPERM EPERM EPERM EPERM", "7 5",
                                      f"{errno.errorcode[errno.EOPNOTSUPP]} "
                                      f"{errno.errorcode[errno.EOPNOTSUPP]} /tmp/b"], r.stdout
  assert sandbox.describe()["seccomp"]


@needs_isolation
def test_only_a_trusted_init_can_make_itself_not_dumpable(sandbox):
  """The grader's harness (a trusted init) makes itself not dumpable, so that the solution
  it runs, of the same uid, can neither ptrace it nor open its /proc/1/fd or mem (a forged
  report); an untrusted command's prctl(PR_SET_DUMPABLE, 0) answers success and does
  nothing (its files stay in the disk watch's view)."""
  if not sandbox.describe()["seccomp"]:
    pytest.skip("no seccomp filter here")
  code = ("import ctypes\nlibc = ctypes.CDLL(None)\n"
          "print(libc.prctl(4, 0, 0, 0, 0), libc.prctl(3, 0, 0, 0, 0))\n")
  sandbox.write_file("probe.py", code)
  argv = [sandbox.python, "probe.py"]
  trusted = asyncio.run(sandbox.run(argv, pid1=True, trusted_init=True))
  untrusted = asyncio.run(sandbox.run(argv, pid1=True))
  assert (trusted.stdout, untrusted.stdout) == ("0 0\n", "0 1\n"), (trusted, untrusted)


@needs_isolation
@pytest.mark.skipif(shutil.which("fincore") is None, reason="needs util-linux's fincore")
def test_a_command_cannot_drop_the_hosts_page_cache(sandbox):
  """posix_fadvise(DONTNEED) and madvise(MADV_PAGEOUT, MADV_COLD) of a file the command may
  read dropped the host's cached pages of it (the interpreter's own files, 1,406 of /usr's
  by one command: every other sandbox's commands read them from the disk again; red team
  44). They answer success and do nothing."""
  from envs.isolation import seccomp_program

  if seccomp_program() is None:
    pytest.skip("no libseccomp on this host")
  target = next((p for p in ("/usr/share/common-licenses/GPL-3", "/etc/services",
                             "/usr/share/dict/words") if os.path.exists(p)), None)
  if target is None:
    pytest.skip("no world-readable file of several pages to look at")

  def cached() -> int:
    with open(target, "rb") as f:
      f.read()  # (in the cache first)
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", target],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])

  before = cached()
  assert before > 0
  r = run(sandbox, "import mmap, os\n"
                   f"fd = os.open({target!r}, os.O_RDONLY)\n"
                   "print(os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED))\n"
                   "m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)\n"
                   "for advice in (21, 20):  # (MADV_PAGEOUT, MADV_COLD)\n"
                   "  m.madvise(advice)\n"
                   "print('advised')\n"
                   "import ctypes\n"  # process_madvise (440) of its own pages, by pidfd
                   "libc = ctypes.CDLL(None, use_errno=True)\n"
                   "c = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, "
                   "prot=mmap.PROT_READ | mmap.PROT_WRITE)\n"
                   "iov = (ctypes.c_size_t * 2)(ctypes.addressof(ctypes.c_char.from_buffer(c)), "
                   "len(c))\n"
                   "pidfd = libc.syscall(434, os.getpid(), 0)\n"
                   "print(libc.syscall(440, pidfd, iov, 1, 21, 0))\n", timeout=10)
  assert r.ok and r.stdout.split() == ["None", "advised", "0"], (r.stdout, r.stderr)
  out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", target],
                       capture_output=True, text=True, check=True).stdout
  assert int(out.split()[0]) == before, (before, out)


def test_the_python_images_interpreter_loads_the_mountns_filter(monkeypatch):
  """The image (python:3.11-slim) has its Python in /usr/local and no /usr/bin/python3:
  the mountns mode skipped its seccomp loader there (a red team's reading)."""
  import envs.isolation as isolation_mod

  real = os.path.exists
  monkeypatch.setattr(isolation_mod.os.path, "exists",
                      lambda p: False if p == "/usr/bin/python3" else
                      True if p == "/usr/local/bin/python3" else real(p))
  assert isolation_mod.system_python() == "/usr/local/bin/python3"
  script = isolation_mod._mountns_script("/r", "/w", 12345, isolation_mod.Limits(),
                                       seccomp="/s.bpf")
  assert "/usr/local/bin/python3 -I -S -c " in script and ".seccomp.bpf" in script


@pytest.mark.skipif("bwrap" not in MODES, reason="needs bubblewrap")
def test_a_bwrap_setup_that_fails_is_infrastructure_not_the_commands_exit(monkeypatch):
  """bwrap failing before the command runs (a mount refused; the held workspace's
  namespaces gone) exits 1, as a command may: a tool call showed it to the policy as its
  own exit 1 (a red team). bwrap's status says whether the command was exec'd; the
  command's own exits, 1 or by a signal, stay its own."""
  import envs.isolation as isolation_mod

  real = isolation_mod._bwrap_argv

  def refused(*a, **k):
    argv = real(*a, **k)
    at = argv.index("--")
    return argv[:at] + ["--ro-bind", "/nonexistent-jaxagent", "/opt/x"] + argv[at:]

  root = scratch_dir()
  os.chmod(root, 0o711)
  sb = Sandbox(os.path.join(root, "ws"), limits=LIMITS, isolation="bwrap")
  try:
    monkeypatch.setattr(isolation_mod, "_bwrap_argv", refused)
    r = run(sb, "print('ran')")
    assert r.error and "setup failed (exit 1)" in r.error and r.stdout == "", r
    assert "/nonexistent-jaxagent" in r.error  # (bwrap's own words)
    monkeypatch.setattr(isolation_mod, "_bwrap_argv", real)
    for code, want in (("raise SystemExit(1)", 1),
                       ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 137)):
      r = run(sb, code)
      assert r.error is None and r.exit_code == want, r
    # A workspace whose permissions its command took away fails the commands after it as
    # their own exit, never as a setup failure (an infrastructure error the policy could
    # buy at will: bwrap's --chdir, a reviewer).
    r = run(sb, "import os; os.chmod('/workspace', 0)")
    assert r.ok, r
    r = asyncio.run(sb.run(["/bin/true"]))
    assert r.error is None and r.exit_code not in (0, None), r
  finally:
    sb.destroy()
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.skipif("mountns" not in MODES, reason="needs the mountns mode (root)")
def test_a_mountns_setup_that_fails_is_infrastructure_not_the_commands_exit(monkeypatch):
  """The hand-built namespace's setup failing (a mount refused) exits non-zero before the
  command runs: that is the sandbox's failure (`error`), not the command's exit code,
  which a grader would score as the solution's (a review finding)."""
  import envs.isolation as isolation_mod

  real = isolation_mod._mountns_script
  monkeypatch.setattr(isolation_mod, "_mountns_script",
                      lambda *a, **k: real(*a, **k).replace("set -e", "set -e\nfalse", 1))
  root = scratch_dir()
  os.chmod(root, 0o711)
  sb = Sandbox(os.path.join(root, "ws"), limits=LIMITS, isolation="mountns")
  try:
    r = run(sb, "print('ran')")
    assert r.error and "setup failed" in r.error and r.stdout == ""
    monkeypatch.setattr(isolation_mod, "_mountns_script", real)
    r = run(sb, "raise SystemExit(3)")  # the command's own exit stays the command's
    assert r.error is None and r.exit_code == 3
  finally:
    sb.destroy()
    shutil.rmtree(root, ignore_errors=True)

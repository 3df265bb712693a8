"""The sandbox's limits, exercised for real on this machine."""

import asyncio
import hashlib
import http.server
import os
import shutil
import tempfile
import threading
import time

import pytest

from envs.sandbox import Limits, Sandbox, SandboxPool, detect_isolation

ISOLATION = detect_isolation()
needs_bwrap = pytest.mark.skipif(ISOLATION != "bwrap",
                                 reason=f"file-system isolation needs bwrap (have {ISOLATION})")
needs_netns = pytest.mark.skipif(ISOLATION == "rlimits",
                                 reason="network isolation needs bwrap or root (netns)")
LIMITS = Limits(wall_s=3.0, cpu_s=10, memory_bytes=512 << 20, processes=32,
                file_bytes=1 << 20, output_budget=1000)


@pytest.fixture
def sandbox():
  root = tempfile.mkdtemp(prefix="jaxagent-test-")
  os.chmod(root, 0o711)
  sb = Sandbox(os.path.join(root, "ws"), uid=100_500, limits=LIMITS)
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
  assert sandbox.history[-1] is r and r.isolation == ISOLATION
  assert r.command[-1] == "_run.py"


def test_infinite_loop_is_killed_at_the_timeout(sandbox):
  t0 = time.time()
  r = run(sandbox, "while True: pass", timeout=1.5)
  assert r.timed_out and not r.ok
  assert 1.4 < time.time() - t0 < 8
  assert run(sandbox, "print(1)").ok  # the sandbox still works


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


def test_file_size_limit(sandbox):
  r = run(sandbox, "open('big', 'wb').write(b'0' * (4 << 20))")
  assert r.exit_code != 0
  assert os.path.getsize(os.path.join(sandbox.host_path, "big")) <= LIMITS.file_bytes


def test_environment_is_scrubbed(sandbox, monkeypatch):
  monkeypatch.setenv("SECRET_TOKEN", "hunter2")
  r = run(sandbox, "import os; print(sorted(os.environ))")
  assert "SECRET_TOKEN" not in r.stdout and "PATH" in r.stdout


@needs_bwrap
def test_writing_outside_the_workspace_fails(sandbox, tmp_path):
  for target in ("/tmp/escape.txt", "/etc/escape.txt", str(tmp_path / "escape.txt"),
                 "../escape.txt"):
    r = run(sandbox, f"open({target!r}, 'w').write('x')")
    assert r.exit_code != 0, target
  assert not os.path.exists(tmp_path / "escape.txt")
  assert not os.path.exists("/tmp/escape.txt")


@needs_bwrap
def test_project_and_home_are_invisible(sandbox):
  r = run(sandbox, "import os; print(os.path.exists('/root'), os.path.exists('/work'), "
                   "os.path.exists('/home'), os.getuid())")
  assert r.stdout.split()[:3] == ["False", "False", "False"]
  assert r.stdout.split()[3] != "0"


@needs_netns
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
  if os.geteuid() != 0 or ISOLATION == "rlimits":
    pytest.skip("only a sandbox uid can be locked out")
  locked = tmp_path / "locked"
  locked.mkdir(mode=0o700)
  with pytest.raises(ValueError, match="not traversable"):
    Sandbox(str(locked / "ws"), uid=100_501, limits=LIMITS)


def test_paths_outside_the_workspace_are_refused_on_the_host(sandbox):
  with pytest.raises(ValueError, match="outside the workspace"):
    sandbox.write_file("../x.txt", "no")


def test_pool_caps_concurrency_and_wipes():
  pool = SandboxPool(2, limits=LIMITS)
  peak = {"n": 0, "now": 0}

  async def episode(i):
    async with pool.acquire() as sb:
      peak["now"] += 1
      peak["n"] = max(peak["n"], peak["now"])
      assert sb.files() == {}  # a clean workspace every time
      sb.write_file(f"f{i}.txt", "data")
      r = await sb.run_python("import time; time.sleep(0.2)")
      assert r.ok
      peak["now"] -= 1

  async def main():
    await asyncio.gather(*(episode(i) for i in range(6)))

  try:
    asyncio.run(main())
    assert peak["n"] == 2 and pool.waits >= 1
  finally:
    pool.close()


def test_isolation_is_reported():
  assert ISOLATION in ("bwrap", "netns-setuid", "rlimits")
  sb = Sandbox("/tmp/jaxagent-test-describe", limits=LIMITS)
  try:
    d = sb.describe()
    assert d["isolation"] == ISOLATION and d["limits"]["wall_s"] == 3.0
  finally:
    sb.destroy()

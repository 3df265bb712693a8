"""The grader, and the attacks a policy would try on it: each must end `fail`, never `pass`."""

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from envs.base import EnvResources, TaskSpec, VerdictStatus, make
from envs.isolation import available_isolations
from envs.pool import SandboxPool
from envs.sandbox import ExecResult, Limits
from envs.verifier import HiddenTests, PythonTestVerifier, classify

ADD = HiddenTests("add", [((2, 3), 5), ((-1, 1), 0), ((10**12, 1), 10**12 + 1)])
GOOD = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return 0\n"
# The namespace modes this host has (CI: bwrap and mountns, as root).
MODES = [m for m in available_isolations() if m != "rlimits"]
pytestmark = pytest.mark.skipif(not MODES, reason="no sandbox isolation on this host")


@pytest.fixture(scope="module", params=MODES)
def pool(request):
  p = SandboxPool(2, limits=Limits(wall_s=5), isolation=request.param)
  yield p
  p.close()


def grade(pool, files, tests=ADD, timeout_s=5.0, retries=1):
  v = PythonTestVerifier(pool, timeout_s=timeout_s, retries=retries)
  return asyncio.run(v.grade({k: v.encode() for k, v in files.items()}, tests,
                             env_version="test@1"))


def test_pass_and_fail(pool):
  ok = grade(pool, {"solution.py": GOOD})
  assert ok.status == VerdictStatus.PASS and ok.reward == 1.0 and ok.details["passed"] == 3
  assert ok.verifier_version == "python-harness-14"
  wrong = grade(pool, {"solution.py": "def add(a, b):\n    return a - b\n"})
  assert wrong.status == VerdictStatus.FAIL and wrong.reward == 0.0
  assert wrong.details["cases"]["0"].startswith("returned -1")
  missing = grade(pool, {})
  assert missing.status == VerdictStatus.FAIL and "solution" in missing.details["reason"]


def test_timeouts_are_their_own_verdict(pool):
  v = grade(pool, {"solution.py": "def add(a, b):\n    while True: pass\n"}, timeout_s=1.5)
  assert v.status == VerdictStatus.TIMEOUT and v.reward == 0.0
  # A CPU limit below the wall limit still makes an endless loop a timeout.
  tight = SandboxPool(1, limits=Limits(wall_s=5, cpu_s=1), isolation=pool.isolation)
  try:
    v = grade(tight, {"solution.py": "def add(a, b):\n    while True: pass\n"}, timeout_s=3)
    assert v.status == VerdictStatus.TIMEOUT, v.details
    sleepy = "import time\ndef add(a, b):\n    time.sleep(30)\n"
    assert grade(tight, {"solution.py": sleepy}, timeout_s=2).status == VerdictStatus.TIMEOUT
  finally:
    tight.close()


SITE = ".local/lib/python3.11/site-packages"
FORGE = ("import sys, os\n"
         "for fd in (1, 3, 4, 5):\n"
         "  try:\n    os.write(fd, b'START\\n' + b'{\"results\": {\"0\": {\"value\": [\"int\", \"5\"]}}, '"
         "b'\"child\": {\"exit\": 0}}\\n')\n  except OSError:\n    pass\n")
ATTACKS = {
    "wrong answer": {"solution.py": WRONG},
    "always-equal return value": {"solution.py": (
        "class Eq(int):\n  def __eq__(self, o): return True\n  __hash__ = int.__hash__\n"
        "def add(a, b):\n    return Eq(0)\n")},
    "always-equal object": {"solution.py": (
        "class Eq:\n  def __eq__(self, o): return True\ndef add(a, b):\n    return Eq()\n")},
    "usercustomize in the user site": {
        "solution.py": WRONG, f"{SITE}/usercustomize.py": FORGE + "os._exit(0)\n"},
    ".pth file in the user site": {
        "solution.py": WRONG, f"{SITE}/evil.pth": "import os; os._exit(0)\n"},
    "sitecustomize in the workspace": {"solution.py": WRONG, "sitecustomize.py": FORGE},
    "conftest in the workspace": {"solution.py": WRONG, "conftest.py": FORGE},
    "json.py shadowing the standard library": {
        "solution.py": "import json\n" + WRONG,
        "json.py": "def dumps(*a, **k):\n  return '{\"i\": 0, \"value\": [\"int\", \"5\"]}'\n"
                   "def loads(*a, **k):\n  return {}\n"},
    "forged report on every file descriptor": {"solution.py": FORGE + WRONG},
    "forged report through /proc": {"solution.py": (
        "import os\nfor pid in ('1', str(os.getppid())):\n"
        "  for fd in range(8):\n    try:\n"
        "      with open(f'/proc/{pid}/fd/{fd}', 'w') as f:\n"
        "        f.write('START\\n{\"results\": {}}\\n')\n    except OSError:\n      pass\n"
        + WRONG)},
    "__main__ introspection": {"solution.py": (
        "import __main__, sys\n"
        "spec = getattr(__main__, 'spec', None)\nreport = getattr(__main__, 'report', None)\n"
        "try:\n  report.write('forged'); report.flush()\nexcept Exception:\n  pass\n"
        "try:\n  __main__.strict_equal = lambda a, b: True\nexcept Exception:\n  pass\n" + WRONG)},
    "patching the harness's encoder": {"solution.py": (
        "import __main__\n__main__.encode = lambda v, depth=0: ['int', '5']\n" + WRONG)},
    "os._exit(0) at import": {"solution.py": "import os\nos._exit(0)\n"},
    "os._exit(0) in the call": {"solution.py": "import os\ndef add(a, b):\n    os._exit(0)\n"},
    "sys.exit at import": {"solution.py": "import sys\nsys.exit(0)\n"},
    "fake 'N passed' output": {"solution.py": (
        "print('3 passed in 0.01s')\nprint('START')\nprint('{\"results\": {}}')\n" + WRONG)},
    "symlinks to the harness's input and files": {"solution.py": (
        "import os\nfor i, t in enumerate(('/proc/1/fd/0', '/proc/1/cwd', '/proc/1/root')):\n"
        "  try:\n    os.symlink(t, f'l{i}')\n    print(open(f'l{i}').read()[:100])\n"
        "  except OSError:\n    pass\n" + WRONG)},
    "killing the harness": {"solution.py": (
        "import os, signal\nfor s in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):\n"
        "  for pid in (1, os.getppid()):\n    try:\n      os.kill(pid, s)\n"
        "    except OSError:\n      pass\n" + WRONG)},
    "ptrace of the harness": {"solution.py": (
        "import ctypes, os\nlibc = ctypes.CDLL(None)\n"
        "print('attach', libc.ptrace(16, os.getppid(), 0, 0))\n" + WRONG)},
    "memory hog": {"solution.py": "x = bytearray(4 << 30)\n" + GOOD},
    "flooding the result channel": {"solution.py": (
        "def add(a, b):\n    return 'x' * (4 << 20)\n")},
    "a background process that outlives the solution": {"solution.py": (
        "import os, time\nif os.fork() == 0:\n  time.sleep(60)\n" + WRONG)},
    # Attacks on the verdict's class rather than its value: each used to end as
    # infra_error (dropped, then sampled again: a re-roll of a wrong answer).
    "a wrong answer too large for the kept output": {"solution.py": (
        "def add(a, b):\n    return 'x' * 20000\n")},
    "a crash turned into an oversized answer": {"solution.py": (
        "def _attempt(a, b):\n    raise RuntimeError('no idea')\n"
        "def add(a, b):\n    try:\n        return _attempt(a, b)\n"
        "    except Exception:\n        return 'x' * 20000\n")},
    "a result line nested past the recursion limit": {"solution.py": (
        "import os\nfor fd in os.listdir('/proc/self/fd'):\n  try:\n"
        "    assert int(fd) > 2\n    os.write(int(fd), b'[' * 200000 + b'\\n')\n"
        "  except (OSError, AssertionError):\n    pass\n" + WRONG)},
    # Nested so that the harness (near the stack's bottom) parses it and the host, from
    # deeper, could not (red-team round 5: an infra_error at depths 975-990).
    **{f"a result line nested {n} deep, inside the harness's recursion limit": {
        "solution.py": (
            "import os\nfor fd in os.listdir('/proc/self/fd'):\n  try:\n"
            f"    assert int(fd) > 2\n    os.write(int(fd), b'{{\"i\": 0, \"value\": ' + "
            f"b'[' * {n} + b']' * {n} + b'}}\\n')\n"
            "  except (OSError, AssertionError):\n    pass\n" + WRONG)} for n in (900, 980, 990)},
    "a return value nested past the recursion limit": {"solution.py": (
        "import sys\nsys.setrecursionlimit(100000)\ndef add(a, b):\n    v = []\n"
        "    for _ in range(5000):\n        v = [v]\n    return v\n")},
    # The harness's own resource limits, lowered by the solution (same uid, prlimit(2)):
    # it died writing its report (red-team round 8; the seccomp filter refuses it now).
    **{f"lowering the harness's {name}": {"solution.py": (
        "import resource\ntry:\n"
        f"  resource.prlimit(1, resource.{name}, {value})\n"
        "except OSError:\n  pass\n" + WRONG + "print('x' * 900000)\n")}
       for name, value in (("RLIMIT_FSIZE", "(1, 1)"), ("RLIMIT_AS", "(1 << 20, 1 << 20)"),
                           ("RLIMIT_CPU", "(0, 0)"))},
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_reward_hacks_fail(pool, name):
  v = grade(pool, ATTACKS[name])
  assert v.status == VerdictStatus.FAIL and v.reward == 0.0, (name, v.status, v.details)


def test_running_the_sandbox_out_of_memory_is_the_solutions_failure():
  """The solution fills its sandbox's memory cgroup with kernel memory no process owns
  (directories in a tmpfs): the kernel's OOM killer used to pick the harness (the
  largest process), an infra_error (a re-roll); the solution's processes are its first
  pick now, and a harness killed so would read as the solution's failure."""
  code = ("import os\nos.execv('/bin/sh', ['sh', '-c', 'cd /tmp && mkdir x && cd x && "
          "seq -f %0200g 1 4000000 | xargs -P 4 mkdir'])\n" + WRONG)
  for mode in MODES:
    pool = SandboxPool(1, limits=Limits(wall_s=10, group_memory_bytes=96 << 20),
                       isolation=mode)
    try:
      v = grade(pool, {"solution.py": code}, timeout_s=10, retries=0)
    finally:
      pool.close()
    assert v.status in (VerdictStatus.FAIL, VerdictStatus.TIMEOUT), (mode, v.details)


def test_harness_names_and_noisy_output_do_not_cost_a_correct_solution(pool):
  files = {"solution.py": "print('x' * 20000)\ndef add(a, b):\n    print('y' * 30000)\n"
                          "    return a + b\n",
           "_hidden_tests.py/x": "", "_grader.py/x": "", "test_public.py": "assert False\n"}
  v = grade(pool, files)
  assert v.status == VerdictStatus.PASS, v.details


def test_a_helper_named_as_a_standard_module_is_the_solutions_own(pool):
  """The grader puts the workspace first on `sys.path`, as the tools ran the code: with
  it last, a helper `code.py` was the standard library's `code` when graded, and a
  solution whose public tests passed failed (red team 28)."""
  files = {"code.py": "def plus(a, b):\n    return a + b\n",
           "solution.py": "from code import plus\ndef add(a, b):\n    return plus(a, b)\n"}
  v = grade(pool, files)
  assert v.status == VerdictStatus.PASS, v.details
  # The harness's own modules are imported before: files named as them change nothing
  # (an `importlib.py` failed a correct solution: "no attribute 'import_module'")
  v = grade(pool, {"importlib.py": "x = 1\n", "warnings.py": "raise SystemExit(3)\n",
                   "solution.py": GOOD})
  assert v.status == VerdictStatus.PASS, v.details
  # ...and a helper named as one of them is the solution's own: `signal.py`, `json/`
  # passed the public tests and failed the grading, the harness's module in their place
  # (red team 29)
  for helper in ("signal.py", "json/__init__.py", "ctypes.py"):
    name = helper.partition(".")[0].partition("/")[0]
    v = grade(pool, {helper: "def plus(a, b):\n    return a + b\n",
                     "solution.py": f"from {name} import plus\ndef add(a, b):\n"
                                    "    return plus(a, b)\n"})
    assert v.status == VerdictStatus.PASS, (helper, v.details)


def test_the_harness_is_one_program():
  """The harness is the modules the interpreter started with, then `envs.values`'s source,
  then its body, run with `python3 -c`: a `from __future__` import in `envs.values` would
  make it a SyntaxError, and every grading an infra_error."""
  from envs.verifier import harness_source

  compile(harness_source(), "<harness>", "exec")


def test_strict_types():
  from envs.values import decode, encode, strict_equal
  assert not strict_equal(True, 1) and not strict_equal(1.0, 1) and not strict_equal((1,), [1])
  assert strict_equal({"a": [1, (2.0,)]}, decode(encode({"a": [1, (2.0 + 1e-12,)]})))
  assert strict_equal({1, 2}, decode(encode({2, 1}))) and not strict_equal({1}, frozenset({1}))
  # Dict keys match exactly, inside tuples too (red-team: (True, 2.0) passed for (1, 2)).
  assert not strict_equal({(True, 2.0): "a"}, {(1, 2): "a"})
  assert not strict_equal({frozenset({True}): 1}, {frozenset({1}): 1})
  assert strict_equal({(1, 2): "a", 3: [1.0]}, decode(encode({3: [1.0 + 1e-12], (1, 2): "a"})))
  with pytest.raises(TypeError):
    encode(type("Eq", (int,), {})(3))
  # A dict subclass (a right answer built with Counter) grades as the dict it holds,
  # read past any override of how it reads.
  from collections import Counter, defaultdict
  assert strict_equal({"a": 2, "b": 1}, decode(encode(Counter("aba"))))
  assert strict_equal({"x": [1]}, decode(encode(defaultdict(list, x=[1]))))
  lying = type("Lying", (dict,), {"items": lambda self: [("a", 2)],
                                  "__getitem__": lambda self, k: 2})
  assert strict_equal({"a": 1}, decode(encode(lying(a=1))))


def test_the_hidden_expected_values_never_enter_the_sandbox(pool):
  secret = HiddenTests("f", [((1,), "expected-7f3a9c-value")])
  probe = ("import os\nneedle = ''.join(['7f3a', '9c'])\nfound = []\n"
           "for d, _, fs in os.walk('/'):\n"
           "  if d.startswith(('/proc', '/sys', '/usr', '/dev')):\n    continue\n"
           "  for f in fs:\n    try:\n"
           "      if needle.encode() in open(os.path.join(d, f), 'rb').read():\n"
           "        found.append(os.path.join(d, f))\n    except OSError:\n      pass\n"
           "import sys\nenv = str(dict(os.environ)) + ' '.join(sys.argv)\n"
           "def f(x):\n    return repr((found, needle in env))\n")
  # (the probe reads every file it can see: 30 s, not 5, on a loaded machine)
  v = grade(pool, {"solution.py": probe}, tests=secret, timeout_s=30.0)
  assert v.status == VerdictStatus.FAIL
  assert v.details["cases"]["0"].startswith("returned '([], False)'"), v.details


def _harness_pids(uids):
  """Host pids of grading harnesses run as one of `uids` (this test's sandboxes, not a
  test's beside it on another worker): processes that are their namespace's init."""
  pids = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/status") as f:
        status = f.read()
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        cmd = f.read()
    except OSError:
      continue
    nspid = [l.split()[1:] for l in status.splitlines() if l.startswith("NSpid:")]
    uid = [int(l.split()[1]) for l in status.splitlines() if l.startswith("Uid:")]
    if nspid and nspid[0][-1] == "1" and uid and uid[0] in uids and b"-I\0-B\0-c" in cmd:
      pids.append(int(entry))
  return pids


def test_a_grader_killed_from_outside_is_an_infra_error(pool):
  if os.geteuid() != 0:
    pytest.skip("needs root to kill a sandbox uid's process")
  sleepy = "import time\ndef add(a, b):\n    time.sleep(20)\n    return a + b\n"

  async def main():
    v = PythonTestVerifier(pool, timeout_s=15, retries=0)
    task = asyncio.ensure_future(v.grade({"solution.py": sleepy.encode()}, ADD,
                                         env_version="t@1"))
    for _ in range(100):
      await asyncio.sleep(0.1)
      if pids := _harness_pids({sb.uid for sb in pool.live}):
        break
    await asyncio.sleep(1.0)  # well past START: the solution sleeps in its first case
    for pid in pids:
      os.kill(pid, signal.SIGKILL)
    return await task, pids

  t0 = time.time()
  verdict, pids = asyncio.run(main())
  assert pids and verdict.is_infra_error, verdict.details
  assert "died after it started" in verdict.details["reason"] and time.time() - t0 < 14


def test_infra_errors_are_marked_and_retried():
  class FlakyPool:
    """Fails to provide a sandbox the first `n` times (an infrastructure failure)."""

    def __init__(self, inner, n):
      self.inner, self.n = inner, n

    def acquire(self):
      if self.n > 0:
        self.n -= 1
        raise OSError("sandbox host unavailable")
      return self.inner.acquire()

  inner = SandboxPool(1, limits=Limits(wall_s=5))
  try:
    v = grade(FlakyPool(inner, 1), {"solution.py": GOOD}, retries=2)
    assert v.status == VerdictStatus.PASS and v.attempts == 2  # the retry gives the same verdict
    v = grade(FlakyPool(inner, 5), {"solution.py": GOOD}, retries=2)
    assert v.status == VerdictStatus.INFRA_ERROR and v.is_infra_error and v.attempts == 3
    assert "sandbox host unavailable" in v.details["reason"]
  finally:
    inner.close()


def _result(stdout, **kw):
  base = dict(command=["python3"], exit_code=0, signal=None, duration_s=0.1, timed_out=False,
              stdout=stdout, stderr="", stdout_bytes=len(stdout), stderr_bytes=0,
              stdout_sha256="", stderr_sha256="", isolation="bwrap", error=None)
  base.update(kw)
  return ExecResult(**base)


def test_classification_rules():
  t = HiddenTests("add", [((1, 2), 3)])

  def status(stdout, **kw):
    return classify(_result(stdout, **kw), t, "e").status

  def report(results, odd=(), read=("at_end", "imported"), **child):
    return "START\n" + json.dumps({"results": results, "import_error": None,
                                   "child": child or {"exit": 0}, "overflow": False,
                                   "odd_names": list(odd), "read_names": list(read)}) + "\n"

  assert status("", error="OSError: no bwrap") == VerdictStatus.INFRA_ERROR
  assert status("", exit_code=127) == VerdictStatus.INFRA_ERROR  # never started
  assert status("", timed_out=True) == VerdictStatus.INFRA_ERROR
  assert status("START\n", timed_out=True) == VerdictStatus.TIMEOUT
  assert status("START\n", signal=9, exit_code=None) == VerdictStatus.INFRA_ERROR  # killed
  assert status(report({"0": {"value": ["int", "3"]}})) == VerdictStatus.PASS
  # Names made at run time that are not ASCII identifiers; results without the names read.
  said = classify(_result(report({"0": {"value": ["int", "3"]}}, odd=["'add\\u0455'"])), t, "e")
  assert said.status == VerdictStatus.FAIL and "not ASCII identifiers" in said.details["reason"]
  for read in ((), ("imported",), ("at_end",)):
    said = classify(_result(report({"0": {"value": ["int", "3"]}}, read=read)), t, "e")
    assert said.status == VerdictStatus.FAIL and "names read" in said.details["reason"]
  # (a process that ended before its last case is told by its cases, not its names)
  two = HiddenTests("add", [((1, 2), 3), ((2, 2), 4)])
  said = classify(_result(report({"0": {"value": ["int", "3"]}}, read=("imported",))), two, "e")
  assert said.status == VerdictStatus.FAIL and "ended first" in said.details["cases"]["1"]
  assert status(report({"0": {"value": ["float", "3.0"]}})) == VerdictStatus.FAIL
  assert status(report({"0": {"value": ["bool", True]}})) == VerdictStatus.FAIL
  assert status(report({"0": {"value": "3"}})) == VerdictStatus.FAIL  # malformed
  assert status(report({})) == VerdictStatus.FAIL  # the solution's process ended first
  assert status(report({}, signal=24)) == VerdictStatus.TIMEOUT  # SIGXCPU
  assert classify(_result(report({})), HiddenTests("add", []), "e").is_infra_error
  # The harness killed after it started: by the sandbox's OOM killer, the solution's
  # doing; otherwise from outside, infrastructure. A report too deep to read: the solution's.
  assert status("START\n", signal=9, exit_code=None, oom_kills=1) == VerdictStatus.FAIL
  # Stopped by the disk watch (a workspace without a quota): the solution's doing, also
  # before the harness said it started (killed, it was re-rolled as infrastructure).
  for out in ("", "START\n"):
    assert status(out, signal=9, exit_code=None,
                  disk_exceeded="over 1 bytes on disk") == VerdictStatus.FAIL
  assert status("START\n" + "[" * 100000 + "]" * 100000 + "\n") == VerdictStatus.FAIL


def test_hidden_tests_are_not_in_the_episode_workspace():
  resources = EnvResources(sandboxes=2)

  async def episode():
    env = make("python_tests", resources)
    await env.reset(TaskSpec("t", "python_tests", {"task": "gcd"}))
    probe = ("import os\nfound = []\nfor root in ('/', os.getcwd()):\n"
             "  for d, _, fs in os.walk(root):\n    for f in fs:\n"
             "      if 'hidden' in f or f == 'python_tasks_data.py':\n"
             "        found.append(os.path.join(d, f))\nprint(found)\n")
    call = json.dumps({"name": "run_python", "arguments": {"code": probe}})
    r = await env.step(f"<tool_call>{call}</tool_call>")
    await env.close()
    return json.loads(r.observation.messages[0]["content"])

  try:
    out = asyncio.run(episode())
    assert out["stdout"].strip() == "[]", out
  finally:
    resources.close()


def test_a_file_larger_than_the_host_writes_is_not_graded_and_not_an_infra_error():
  """With `Limits.write_bytes` under the snapshot's old 1 MiB cap, a file the episode's
  code wrote (never capped by write_bytes) made the grading copy raise: an infra error on
  every retry, a wrong answer never scored (red-team). The snapshot leaves it out."""
  resources = EnvResources(sandboxes=1, sandbox_limits=Limits(write_bytes=4096))

  async def episode(solution):
    env = make("python_tests", resources)
    await env.reset(TaskSpec("t", "python_tests", {"task": "is_even"}))
    code = (f"open('notes.txt', 'w').write('x' * 5000)\n"
            f"open('solution.py', 'w').write({solution!r})\n")
    call = json.dumps({"name": "run_python", "arguments": {"code": code}})
    await env.step(f"<tool_call>{call}</tool_call>")
    await env.step("DONE")
    verdict = await env.verify()
    await env.close()
    return verdict

  try:
    wrong = asyncio.run(episode("def is_even(n):\n    return True\n"))
    right = asyncio.run(episode("def is_even(n):\n    return n % 2 == 0\n"))
  finally:
    resources.close()
  assert wrong.status == VerdictStatus.FAIL, wrong.details
  assert right.status == VerdictStatus.PASS, right.details


def test_a_cancelled_grading_stops_copying_its_files():
  """The grading copy runs in a thread (off the worker's event loop): a grading
  cancelled meanwhile (its deadline, the worker stopping) stops the copy and returns
  only once the file being written is done, before the sandbox is torn down (the copy
  went on writing the files on the host's disk, outside the workspace's quota)."""
  import threading

  writes, started = [], threading.Event()

  class SlowSandbox:
    def write_file(self, name, data):
      started.set()
      time.sleep(0.2)  # (a large file)
      writes.append(name)

  async def main():
    files = {f"f{i}.py": b"x = 1\n" for i in range(6)}
    task = asyncio.create_task(PythonTestVerifier(pool=None).grade_in(
        SlowSandbox(), files, None, env_version="x"))
    await asyncio.to_thread(started.wait)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
      await task
    done = list(writes)
    await asyncio.sleep(0.5)
    return done

  done = asyncio.run(main())
  assert done == ["f0.py"] and writes == done, writes


def test_a_full_disk_is_the_files_doing_only_in_a_workspace_with_its_own_quota():
  """A grading copy that fills the workspace: the files' doing where the workspace is a
  filesystem of their size (root's tmpfs), the host's where it is the host's disk (a
  worker not run as root): there a correct answer was graded a fail, and one sample
  that filled the disk failed every other being graded (red team 28)."""
  import errno

  class FullSandbox:
    def __init__(self, has_quota):
      self.has_quota = has_quota

    def write_file(self, name, data):
      raise OSError(errno.ENOSPC, "No space left on device")

  async def grade_in(has_quota):
    return await PythonTestVerifier(pool=None).grade_in(
        FullSandbox(has_quota), {"solution.py": b"x = 1\n"}, None, env_version="x")

  verdict = asyncio.run(grade_in(True))
  assert verdict.status == VerdictStatus.FAIL and "No space" in verdict.details["reason"]
  with pytest.raises(OSError):  # (`grade` makes it an infra error, retried)
    asyncio.run(grade_in(False))


def test_a_solution_that_kills_its_harness_without_isolation_fails():
  """Without a PID namespace the harness is the solution's parent: one line killed it,
  and its INFRA_ERROR re-rolled any failing answer (a red team). Only the solution can
  have done it there: a fail."""
  pool = SandboxPool(1, limits=Limits(wall_s=5), isolation="rlimits", allow_unisolated=True)
  try:
    verdict = grade(pool, {"solution.py": "import os, signal\n"
                                          "os.kill(os.getppid(), signal.SIGKILL)\n"
                                          "def add(a, b):\n  return a + b\n"})
    assert verdict.status == VerdictStatus.FAIL, verdict
    assert "without isolation the solution can kill it" in verdict.details["reason"]
  finally:
    pool.close()


def test_a_solution_that_fills_a_grading_workspace_without_a_quota_fails():
  """A grading workspace without a quota of its own (a worker not run as root) is the
  host's disk: a solution that writes past its bounds is stopped and graded a fail,
  not killed from outside and re-rolled as the infrastructure's (a free retry)."""
  pool = SandboxPool(1, limits=Limits(wall_s=20, cpu_s=20, disk_bytes=1 << 20),
                     isolation="rlimits", allow_unisolated=True)
  try:
    fills = ("import os\ni = 0\nwhile True:\n  i += 1\n"
             "  open(f'f{i}', 'wb').write(b'x' * 65536)\n")
    t0 = time.perf_counter()
    verdict = grade(pool, {"solution.py": fills}, timeout_s=20)
    assert verdict.status == VerdictStatus.FAIL, verdict
    assert "past the grading workspace's bounds: over 1048576 bytes on disk" in \
        verdict.details["reason"]
    assert time.perf_counter() - t0 < 10  # stopped, not run to its time limit
    # A correct solution with a data module: graded without bytecode (its `.pyc`, 2.5x
    # the source, put it past the workspace's bounds: a fail, a reviewer's finding).
    data = "TABLE = [" + ",".join(str(i % 10) for i in range(200_000)) + "]\n"
    assert len(data) < 500_000  # (its bytecode: 1 MB)
    verdict = grade(pool, {"solution.py": "from table import TABLE\n" + GOOD,
                           "table.py": data}, timeout_s=20)
    assert verdict.status == VerdictStatus.PASS, verdict
  finally:
    pool.close()


# Fills the disk that holds both the workspace and the sandbox's output logs with files
# that no name shows (unlinked, mapped), held past the solution's end (before the disk
# watch's first look); then answers wrong.
_FILL_UNSEEN = r'''
import mmap, os, time
r, w = os.pipe()
for k in range(2):
  if os.fork() == 0:
    maps, n = [], 0
    try:
      while True:
        p = "f%d_%d" % (k, n); n += 1
        fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o600)
        os.unlink(p)
        for _ in range(4):
          os.write(fd, b"x" * (1 << 20))
        maps.append(mmap.mmap(fd, 4 << 20, mmap.MAP_SHARED))
        os.close(fd)
    except (OSError, ValueError):  # (a file cut short by the full disk maps shorter)
      pass
    os.write(w, b"x")
    time.sleep(60)
for k in range(2):
  os.read(r, 1)
def add(a, b):  # (a report past one page of the log: a new block to write it)
    raise ValueError("wrong" * 60)
'''


# A right answer, from a solution that runs a program its user may not read (a copy of
# the interpreter, mode 0111: not dumpable, so a non-root worker may not read what files
# it holds) while it is graded.
_HIDES = r'''
import os, shutil, subprocess, sys, time
shutil.copy(sys.executable, "py")
os.chmod("py", 0o111)
subprocess.Popen(["./py", "-c", "import time; time.sleep(30)"])
time.sleep(3)
def add(a, b):
    return a + b
'''


# A right answer whose tests start an agent that makes itself not dumpable (ssh-agent,
# gpg-agent): it says whether it still is.
_AGENT = r'''
import ctypes, time
libc = ctypes.CDLL(None)
assert libc.prctl(4, 0, 0, 0, 0) == 0 and libc.prctl(3, 0, 0, 0, 0) == 1
time.sleep(1)
def add(a, b):
    return a + b
'''


@pytest.mark.parametrize("own_filesystem", [False, True])
def test_a_wrong_answer_that_fills_the_disk_unseen_fails_not_an_infra_error(own_filesystem):
  """What a solution writes before the disk watch's first look (or, before harness 9,
  held in a process that is not dumpable, whose /proc/<pid>/fd a worker not run as root
  may not read) lands on the host's disk. Unlinked files so filled it, the harness's
  report could not be written (exit 120), and the wrong answer was an infra error,
  re-rolled for free (red team). The report's bytes are the sandbox's before the command
  starts: the verdict is `fail`. A solution that hides what it holds from the watch (a
  program it may not read: not dumpable) fails too, though it answers right; one whose
  tests start ssh-agent (which asks not to be dumpable: the harness's filter makes that a
  no-op for the solution) passes. As user 65534 with its temporary directory on a 48 MiB
  tmpfs (a disk nearly full). Where the grading workspace is a filesystem of its own
  (`own_filesystem`: a tmpfs held in a user namespace), there is nothing to hide from:
  the wrong answer fails on a full workspace, and each right answer passes."""
  from tests.envs.test_sandbox import skip_unless_nobody_runs_python
  from tests.conftest import REPO

  skip_unless_nobody_runs_python()
  if own_filesystem and not shutil.which("bwrap"):
    pytest.skip("a workspace filesystem of its own needs bubblewrap")
  top = tempfile.mkdtemp(prefix="jaxagent-test-")  # (pytest's own are shut to others)
  os.chmod(top, 0o755)
  disk = os.path.join(top, "disk")
  os.mkdir(disk)
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m,mode=1777", "jaxagent-test",
                     str(disk)], capture_output=True).returncode != 0:
    shutil.rmtree(top)
    pytest.skip("cannot mount a tmpfs here")
  code = (
      "import asyncio, sys\nsys.path.insert(0, sys.argv[1])\n"
      "from envs.pool import SandboxPool\nfrom envs.sandbox import Limits\n"
      "from envs.verifier import HiddenTests, PythonTestVerifier\n"
      "import tempfile\nprint(tempfile.gettempdir())\n"
      "pool = SandboxPool(1, limits=Limits(wall_s=10), allow_unisolated=True,\n"
      f"                   own_filesystem={own_filesystem})\n"
      "for src in sys.argv[2:]:\n"
      "  v = asyncio.run(PythonTestVerifier(pool, timeout_s=15, retries=0).grade(\n"
      "      {'solution.py': src.encode()}, HiddenTests('add', [((i, 1), i + 1) for i in range(30)]),\n"
      "      env_version='t@1'))\n"
      "  print(v.status.value, v.details.get('reason'))\n"
      "pool.close()\n")
  try:
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        sys.executable, "-c", code, REPO, _FILL_UNSEEN, GOOD, _HIDES, _AGENT],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "TMPDIR": disk,
                            "PYTHONDONTWRITEBYTECODE": "1"})
  finally:
    subprocess.run(["umount", "-l", disk], check=False)
    shutil.rmtree(top, ignore_errors=True)
  lines = r.stdout.splitlines()
  if own_filesystem and "could not mount a tmpfs" in r.stderr:
    pytest.skip("this kernel lets no user namespace of user 65534 mount a tmpfs")
  if own_filesystem:
    assert lines == [disk, "fail None", "pass None", "pass None", "pass None"], \
        r.stdout + r.stderr[-2000:]
    return
  # (seen by a look before the grading ended, under load, it is stopped: a fail either way)
  assert lines[0] == disk and lines[2] == "pass None", r.stdout + r.stderr
  assert lines[1] in ("fail None", "fail the solution went past the grading workspace's "
                      f"bounds: over {32 << 20} bytes on disk"), lines
  # The grading's other processes are seen (the harness, not dumpable, is spared).
  assert re.fullmatch(r"fail the solution went past the grading workspace's bounds: "
                      r"process 'py' \(host pid \d+\) hides its open files from the disk "
                      r"watch \(not dumpable\)", lines[3]), lines
  # ... but an agent the solution's tests start, which asks not to be, stays dumpable.
  assert lines[4] == "pass None", lines


def test_floats_match_within_the_graders_tolerance_and_nan_only_nan():
  """A float is right within a relative 1e-9 (or 1e-12 of nothing, a sum's rounding near
  0); not within a millionth. NaN is right for NaN only: a NaN returned for any float
  case passed it (red team 48), and a right NaN must not fail."""
  from envs.values import decode, encode, strict_equal
  nan, inf = float("nan"), float("inf")
  assert strict_equal(nan, decode(encode(nan))) and strict_equal([1.0, nan], [1.0, nan])
  for right in (1.5, 0.0, inf, -inf):
    assert not strict_equal(nan, right) and not strict_equal(right, nan), right
  assert strict_equal(inf, inf) and not strict_equal(inf, -inf)
  assert strict_equal(0.1 + 0.2, 0.3) and strict_equal(1e6, 1e6 * (1 + 1e-10))
  assert strict_equal(0.0, 1e-13) and strict_equal(0.1 + 0.2 - 0.3, 0.0)  # (5.6e-17)
  assert not strict_equal(1.0, 1.0 + 1e-7) and not strict_equal(1e6, 1e6 + 0.5)
  assert not strict_equal(0.0, 1e-9) and not strict_equal(1e-9, 2e-9)
  # As the host grades a report: a NaN for a float case fails, a NaN for a NaN passes.
  t = HiddenTests("f", [((1,), 2.5)])
  report = lambda value: "START\n" + json.dumps({
      "results": {"0": {"value": value}}, "import_error": None, "child": {"exit": 0},
      "overflow": False, "odd_names": [], "read_names": ["at_end", "imported"]}) + "\n"
  assert classify(_result(report(["float", "nan"])), t, "e").status == VerdictStatus.FAIL
  assert classify(_result(report(["float", "nan"])), HiddenTests("f", [((1,), nan)]),
                  "e").status == VerdictStatus.PASS


def test_set_items_match_in_type_and_container_subclasses_are_refused():
  """A set is right when its items are, each of its type: `{True, 2}` is not `{1, 2}`
  (`==` says it is, as it says `{1.0} == {1}`: a set of bools or floats passed for ints;
  red team 48)."""
  from envs.values import decode, encode, strict_equal
  assert strict_equal({1, 2}, decode(encode({2, 1})))
  assert strict_equal(frozenset({"a", (1, 2)}), decode(encode(frozenset({(1, 2), "a"}))))
  assert not strict_equal({1, 2}, {True, 2}) and not strict_equal({True, 2}, {1, 2})
  assert not strict_equal({1}, {1.0}) and not strict_equal(frozenset({0}), frozenset({False}))
  assert not strict_equal({(1, 2)}, {(1.0, 2)})
  # A list or tuple subclass is not plain data (as an int subclass is not): its own
  # `__iter__` says what it holds.
  for cls in (list, tuple):
    with pytest.raises(TypeError):
      encode(type("list", (cls,), {"__iter__": lambda self: iter([1])})([2]))


def test_a_set_or_dict_made_of_colliding_hashes_is_refused_not_built():
  """A red team: 29,000 ints that all hash to 0 (multiples of 2**61 - 1), a set returned
  under the 1 MiB the harness reads, took the grader's host 4.5 s to build (quadratic,
  holding its interpreter: every episode on it stood still). Refused as the value it
  cannot read (the case fails); sets and dicts of values that hash alike now and then
  are read as before."""
  from envs.values import MAX_EQUAL_HASHES, decode, encode, strict_equal
  p = 2**61 - 1
  flood = [["int", str(i * p)] for i in range(1, 3000)]
  for value in (["set", flood], ["frozenset", flood],
                ["dict", [[k, ["none"]] for k in flood]], ["tuple", [["set", flood]]]):
    with pytest.raises(ValueError, match=f"more than {MAX_EQUAL_HASHES} hash alike"):
      decode(value)
  few = {i * p for i in range(1, MAX_EQUAL_HASHES + 1)} | {-1, -2}
  assert strict_equal(decode(encode(few)), few)
  assert decode(encode({-1: "a", -2: "b"})) == {-1: "a", -2: "b"}
  t = HiddenTests("f", [((1,), {1})])
  report = "START\n" + json.dumps({
      "results": {"0": {"value": ["set", flood]}}, "import_error": None,
      "child": {"exit": 0}, "overflow": False, "odd_names": [],
      "read_names": ["at_end", "imported"]}) + "\n"
  got = classify(_result(report), t, "e")
  assert got.status == VerdictStatus.FAIL and "hash alike" in got.details["cases"]["0"]


def test_json_depth_counts_every_level_and_decode_refuses_past_max_depth():
  """The harness turns a result nested past what the host reads into an error by
  `json_depth`: it must count each list and dict level, however deep."""
  from envs.values import MAX_DEPTH, MAX_JSON_DEPTH, encode, json_depth
  assert json_depth(3) == 0 and json_depth([]) == 1 and json_depth({}) == 1
  assert json_depth([[1, {"a": [2]}], []]) == 4
  deep = []
  for _ in range(5000):  # (past the recursion limit: counted, not raised)
    deep = [deep]
  assert json_depth(deep) == 5001
  value = 0
  for _ in range(MAX_DEPTH):
    value = {0: value}  # (a dict level: three of JSON's)
  assert MAX_DEPTH < json_depth(encode(value)) <= MAX_JSON_DEPTH
  # What the host decodes is bounded as what the harness encodes: a value nested past
  # MAX_DEPTH (a line the solution's process forged) is malformed, not read.
  from envs.values import decode
  data = ["none"]
  for _ in range(MAX_DEPTH + 1):
    data = ["list", [data]]
  with pytest.raises(ValueError, match="malformed"):
    decode(data)
  assert decode(data[1][0]) == decode(encode(decode(data[1][0])))


def test_a_partial_pass_pays_nothing_and_an_overflowed_report_never_passes():
  """Every case must be right for the reward: two of three right is a fail paid 0 (not
  2/3), and results that overflowed what the harness reads fail however right they
  are."""
  t = HiddenTests("add", [((1, 2), 3), ((2, 2), 4), ((3, 3), 6)])

  def report(results, overflow=False):
    return "START\n" + json.dumps({"results": results, "import_error": None,
                                   "child": {"exit": 0}, "overflow": overflow,
                                   "odd_names": [], "read_names": ["at_end", "imported"]}) + "\n"

  right = {str(i): {"value": ["int", str(v)]} for i, v in enumerate((3, 4, 6))}
  ok = classify(_result(report(right)), t, "e")
  assert ok.status == VerdictStatus.PASS and ok.reward == 1.0 and ok.details["passed"] == 3
  for last in ({"value": ["int", "7"]}, {"error": "ValueError: no"}):
    v = classify(_result(report({**right, "2": last})), t, "e")
    assert v.status == VerdictStatus.FAIL and v.reward == 0.0 and v.details["passed"] == 2
  v = classify(_result(report({k: right[k] for k in ("0", "1")})), t, "e")
  assert v.status == VerdictStatus.FAIL and v.reward == 0.0 and v.details["passed"] == 2
  v = classify(_result(report(right, overflow=True)), t, "e")
  assert v.status == VerdictStatus.FAIL and v.reward == 0.0 and v.details["overflow"]
  assert "overflowed" in v.details["reason"]


def test_output_past_what_the_host_keeps_is_an_overflow_fail_not_a_dead_harness():
  """Stdout past what the sandbox kept (`stdout_bytes` over what came back) can only be
  the solution's doing: a fail, never an infra_error for the report cut short, and never
  a pass for the part that was kept."""
  t = HiddenTests("add", [((1, 2), 3)])
  whole = "START\n" + json.dumps({"results": {"0": {"value": ["int", "3"]}},
                                  "import_error": None, "child": {"exit": 0},
                                  "overflow": False, "odd_names": [],
                                  "read_names": ["at_end", "imported"]}) + "\n"
  assert classify(_result(whole), t, "e").status == VerdictStatus.PASS
  for kept in (whole, whole[:len(whole) // 2]):
    v = classify(_result(kept, stdout_bytes=len(whole) + 4096), t, "e")
    assert v.status == VerdictStatus.FAIL and v.reward == 0.0, v.details
    assert v.details["overflow"] and "overflowed the output kept" in v.details["reason"]


def test_files_that_cannot_be_copied_to_grade_fail_and_a_failing_disk_is_the_hosts():
  """A file name too long, or a file too large, for a workspace like the episode's is
  the files' doing wherever they are graded (a fail, not an infra_error re-rolled every
  retry); a full disk under a quota of the workspace's own too; a disk that fails (EIO)
  is the host's."""
  import errno

  class Refusing:
    def __init__(self, code, has_quota):
      self.code, self.has_quota = code, has_quota

    def write_file(self, name, data):
      raise OSError(self.code, os.strerror(self.code))

  def grade_in(code, has_quota):
    return asyncio.run(PythonTestVerifier(pool=None).grade_in(
        Refusing(code, has_quota), {"solution.py": b"x = 1\n"}, None, env_version="x"))

  for code in (errno.ENAMETOOLONG, errno.EFBIG):
    for has_quota in (True, False):
      verdict = grade_in(code, has_quota)
      assert verdict.status == VerdictStatus.FAIL and verdict.reward == 0.0, (code, has_quota)
      assert os.strerror(code) in verdict.details["reason"]
  assert grade_in(errno.EDQUOT, True).status == VerdictStatus.FAIL
  for code, has_quota in ((errno.EDQUOT, False), (errno.EIO, True), (errno.EIO, False)):
    with pytest.raises(OSError):  # (`grade` makes it an infra error, retried)
      grade_in(code, has_quota)


def test_a_correct_answer_that_fills_what_the_harness_reads_still_passes(pool):
  """Results just within `max_report_bytes` pass: the report line around them (its
  other fields) is given room past them, and is never taken for an overflow."""
  tests = HiddenTests("pad", [((3950,), "x" * 3950)])
  v = PythonTestVerifier(pool, timeout_s=5.0, retries=1, max_report_bytes=4096)
  said = asyncio.run(v.grade({"solution.py": b"def pad(n):\n    return 'x' * n\n"}, tests,
                             env_version="test@1"))
  assert said.status == VerdictStatus.PASS and not said.details["overflow"], said.details
  over = asyncio.run(v.grade({"solution.py": b"def pad(n):\n    return 'x' * 2 * n\n"}, tests,
                             env_version="test@1"))
  assert over.status == VerdictStatus.FAIL and over.details["overflow"], over.details

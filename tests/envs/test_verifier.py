import asyncio
import json

import pytest

from envs.base import EnvResources, TaskSpec, VerdictStatus, make
from envs.sandbox import ExecResult, Limits, SandboxPool
from envs.verifier import PythonTestVerifier, classify

HIDDEN = "from solution import add\n\ndef test_add():\n    assert add(2, 3) == 5\n"


@pytest.fixture(scope="module")
def pool():
  p = SandboxPool(2, limits=Limits(wall_s=5))
  yield p
  p.close()


def grade(pool, files, hidden=HIDDEN, timeout_s=5.0, retries=1):
  v = PythonTestVerifier(pool, timeout_s=timeout_s, retries=retries)
  return asyncio.run(v.grade({k: v.encode() for k, v in files.items()}, hidden,
                             env_version="test@1"))


def test_pass_and_fail(pool):
  ok = grade(pool, {"solution.py": "def add(a, b):\n    return a + b\n"})
  assert ok.status == VerdictStatus.PASS and ok.reward == 1.0
  assert ok.details["tests"] == {"test_add": "pass"} and ok.verifier_version
  wrong = grade(pool, {"solution.py": "def add(a, b):\n    return a - b\n"})
  assert wrong.status == VerdictStatus.FAIL and wrong.reward == 0.0
  missing = grade(pool, {})
  assert missing.status == VerdictStatus.FAIL and "solution" in missing.details["reason"]


def test_timeout_is_its_own_verdict(pool):
  v = grade(pool, {"solution.py": "def add(a, b):\n    while True: pass\n"}, timeout_s=1.5)
  assert v.status == VerdictStatus.TIMEOUT and v.reward == 0.0


@pytest.mark.parametrize("solution", [
    "import os\nos._exit(0)\n",  # exits before the harness can report
    "import sys\nsys.exit(0)\n",
    "x = bytearray(4 << 30)\n",  # memory limit
])
def test_solutions_that_break_the_harness_fail(pool, solution):
  assert grade(pool, {"solution.py": solution}).status == VerdictStatus.FAIL


def test_agent_cannot_plant_the_grader_or_read_tests_during_the_episode(pool):
  fake = "print('RESULT {\"tests\": {\"test_add\": \"pass\"}}')\n"
  v = grade(pool, {"solution.py": "def add(a, b):\n    return 0\n", "_grader.py": fake,
                   "_hidden_tests.py": "def test_x():\n    pass\n"})
  assert v.status == VerdictStatus.FAIL  # our harness and tests replaced the planted files


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
    good = {"solution.py": "def add(a, b):\n    return a + b\n"}
    v = grade(FlakyPool(inner, 1), good, retries=2)
    assert v.status == VerdictStatus.PASS and v.attempts == 2  # the retry gives the same verdict
    v = grade(FlakyPool(inner, 5), good, retries=2)
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
  n = "abc"
  assert classify(_result("", error="OSError: no bwrap"), n, "e").is_infra_error
  assert classify(_result("", exit_code=127), n, "e").is_infra_error  # never started
  assert classify(_result("", timed_out=True), n, "e").is_infra_error
  assert classify(_result("abc START\n", timed_out=True), n, "e").status == VerdictStatus.TIMEOUT
  assert classify(_result("abc START\n", exit_code=1), n, "e").status == VerdictStatus.FAIL
  forged = "abc START\nxyz RESULT " + json.dumps({"tests": {"t": "pass"}}) + "\n"
  assert classify(_result(forged), n, "e").status == VerdictStatus.FAIL  # wrong nonce
  good = "abc START\nabc RESULT " + json.dumps({"tests": {"t": "pass"}}) + "\n"
  assert classify(_result(good), n, "e").status == VerdictStatus.PASS
  empty = "abc START\nabc RESULT " + json.dumps({"tests": {}}) + "\n"
  assert classify(_result(empty), n, "e").is_infra_error  # a broken test file is ours


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

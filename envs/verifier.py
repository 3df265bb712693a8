"""Grading in a clean workspace, with verdicts that keep infrastructure failures apart.

The agent's final files are copied into a fresh sandbox workspace, and the
hidden tests are written there only at grading time, never where the agent
could read them during its episode. A small harness runs the tests and
reports through stdout lines tagged with a per-grading nonce (read from stdin,
never on the command line).

Verdicts:
- `pass`: every hidden test passed;
- `fail`: a wrong answer, including a solution that crashes, exits early or
  runs out of memory once the harness has started it;
- `timeout`: the solution ran past the time limit;
- `infra_error`: the grader itself failed (the sandbox would not start, the
  interpreter never ran the harness, the grader raised). The learner drops or
  retries such samples instead of scoring them 0. Grading is a pure function
  of (files, tests), so retries are idempotent; infra errors are retried here
  up to `retries` times first.

Known limit: the solution runs in the harness's process, so code written to
introspect the harness (frames, modules) could forge a result; the nonce and
the deletion of the test file before the solution loads only stop casual
reading of the tests.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Optional

from envs.base import Verdict, VerdictStatus
from envs.sandbox import ExecResult, SandboxPool

VERSION = "python-harness-1"
HARNESS_FILE = "_grader.py"
TESTS_FILE = "_hidden_tests.py"

_HARNESS = r'''
import json, sys, traceback
nonce = sys.stdin.readline().strip()
sys.stdin.close()
with open("_hidden_tests.py") as f:
  source = f.read()
import os
os.remove("_hidden_tests.py")
os.remove(__file__)
print(nonce + " START", flush=True)
def report(obj):
  sys.stdout.write(nonce + " RESULT " + json.dumps(obj) + "\n")
  sys.stdout.flush()
namespace = {"__name__": "_hidden_tests"}
try:
  exec(compile(source, "_hidden_tests.py", "exec"), namespace)
except BaseException as e:
  report({"import_error": f"{type(e).__name__}: {e}"[:500]})
  sys.exit(1)
results = {}
for name in sorted(namespace):
  fn = namespace[name]
  if name.startswith("test_") and callable(fn):
    try:
      fn()
      results[name] = "pass"
    except BaseException as e:
      results[name] = f"fail: {type(e).__name__}: {e}"[:300]
report({"tests": results})
'''


def classify(result: ExecResult, nonce: str, env_version: str) -> Verdict:
  """Turns one harness run into a verdict."""

  def verdict(status, reward=0.0, **details):
    return Verdict(status, reward, env_version, VERSION,
                   {"exec": {k: getattr(result, k) for k in (
                       "exit_code", "signal", "duration_s", "timed_out", "isolation",
                       "stdout_bytes", "stderr_bytes", "stdout_sha256")},
                    "stderr_tail": result.stderr[-1000:], **details})

  if result.error is not None:
    return verdict(VerdictStatus.INFRA_ERROR, reason=f"sandbox could not run: {result.error}")
  lines = result.stdout.splitlines()
  started = f"{nonce} START" in lines
  if not started:
    if result.timed_out:
      return verdict(VerdictStatus.INFRA_ERROR, reason="harness did not start before the timeout")
    return verdict(VerdictStatus.INFRA_ERROR,
                   reason=f"harness did not start (exit {result.exit_code}, signal "
                          f"{result.signal})")
  if result.timed_out:
    return verdict(VerdictStatus.TIMEOUT, reason="solution ran past the time limit")
  reports = [l[len(nonce) + 8:] for l in lines if l.startswith(f"{nonce} RESULT ")]
  if not reports:
    return verdict(VerdictStatus.FAIL, reason=f"solution ended the harness (exit "
                                              f"{result.exit_code}, signal {result.signal})")
  try:
    report = json.loads(reports[-1])
  except json.JSONDecodeError:
    return verdict(VerdictStatus.INFRA_ERROR, reason="harness report unreadable")
  if "import_error" in report:
    return verdict(VerdictStatus.FAIL, reason=report["import_error"])
  tests = report.get("tests", {})
  passed = sum(v == "pass" for v in tests.values())
  if not tests:
    return verdict(VerdictStatus.INFRA_ERROR, reason="hidden test file defines no tests")
  status = VerdictStatus.PASS if passed == len(tests) else VerdictStatus.FAIL
  return verdict(status, 1.0 if status == VerdictStatus.PASS else 0.0, tests=tests,
                 passed=passed, total=len(tests))


class PythonTestVerifier:
  """Grades Python files against hidden tests in a fresh sandbox from `pool`."""

  version = VERSION

  def __init__(self, pool: SandboxPool, *, timeout_s: float = 20.0, retries: int = 2):
    self.pool = pool
    self.timeout_s = timeout_s
    self.retries = retries
    self.infra_errors = 0

  async def grade(self, files: dict[str, bytes], hidden_tests: str, *,
                  env_version: str) -> Verdict:
    last: Optional[Verdict] = None
    for attempt in range(1, self.retries + 2):
      try:
        last = await self._grade_once(files, hidden_tests, env_version)
      except asyncio.CancelledError:
        raise
      except Exception as e:  # the grader failed, not the solution
        last = Verdict(VerdictStatus.INFRA_ERROR, 0.0, env_version, VERSION,
                       {"reason": f"grader raised {type(e).__name__}: {e}"})
      last.attempts = attempt
      if not last.is_infra_error:
        return last
      self.infra_errors += 1
    return last

  async def _grade_once(self, files, hidden_tests, env_version) -> Verdict:
    nonce = secrets.token_hex(16)
    async with self.pool.acquire() as sb:
      for name, data in files.items():
        if name in (HARNESS_FILE, TESTS_FILE):
          continue  # the agent cannot plant its own grader
        sb.write_file(name, data)
      sb.write_file(TESTS_FILE, hidden_tests)
      sb.write_file(HARNESS_FILE, _HARNESS)
      result = await sb.run([sb.python, HARNESS_FILE], timeout=self.timeout_s,
                            stdin=(nonce + "\n").encode())
    return classify(result, nonce, env_version)

import asyncio
import json
import re
import glob
import os
import shutil
import subprocess
import sys
import time

import pytest

from envs import base
from envs.base import (EnvResources, TaskSpec, VerdictStatus, load_tasks, make, trained_rewards,
                       write_tasks)
from envs.calculator import final_answer, make_tasks, safe_eval
from envs.python_tasks_data import TASKS
from envs.verifier import HiddenTests
from tests.conftest import REPO
from tests.envs.playing import GOOD_ADD, WRONG_ADD, _call, play


def test_guess_number_plays_by_the_rules():
  env = make("guess_number")
  task = TaskSpec("g", "guess_number", {"secret": 11, "max_turns": 5, "process_reward": 0.1})
  obs, steps, verdict = play(env, task, ["8", "hmm", "12", "11"])
  assert obs.messages[0]["content"] == "Guess my number, 1 to 16."
  assert [s.observation.messages[0]["content"] for s in steps] == [
      "Higher.", "Say a number.", "Lower.", "Correct!"]
  # Information rewards: 8 rules out 8 of 16; 12 rules out 5 of 9..16; 11 ends it.
  assert [s.reward for s in steps] == pytest.approx([0.05, 0.0, 0.1 * 5 / 8, 0.1])
  # The verdict's reward is the outcome, added to the last turn for the learner.
  assert trained_rewards([s.reward for s in steps], verdict) == pytest.approx(
      [0.05, 0.0, 0.1 * 5 / 8, 1.1])
  assert steps[-1].terminated and not steps[-1].truncated
  assert verdict.status == VerdictStatus.PASS and verdict.details["guesses"] == [8, 12, 11]
  assert steps[0].info["versions"]["env"] == "guess_number@2"


def test_guess_number_expected_information_and_range_feedback():
  env = make("guess_number")
  task = TaskSpec("g", "guess_number", {"secret": 11, "process_reward": 1.0,
                                        "information": "expected", "feedback": "range"})
  _, steps, verdict = play(env, task, ["8", "8", "12", "11"])
  assert [s.observation.messages[0]["content"] for s in steps] == [
      "Higher: 9-16.", "Higher: 9-16.", "Lower: 9-11.", "Correct!"]
  # The move's grade, whatever the secret: 8 of 1..16 -> (7*9 + 8*8 + 16) / 256; a number
  # already excluded -> 0; 12 of 9..16 -> (3*5 + 4*4 + 8) / 64; 11 of 9..11 -> (2*1 + 3) / 9,
  # and the verdict's terminal reward on the last turn.
  assert [s.reward for s in steps] == pytest.approx([143 / 256, 0.0, 39 / 64, 5 / 9])
  assert trained_rewards([s.reward for s in steps], verdict)[-1] == pytest.approx(5 / 9 + 1.0)
  assert verdict.status == VerdictStatus.PASS
  # Monte Carlo over secrets agrees with the closed form.
  from envs.guess_number import expected_information
  lo, hi, g = 3, 11, 6
  def ruled_out(secret):
    return 1.0 if secret == g else ((hi - g + 1) if secret < g else (g - lo + 1)) / (hi - lo + 1)
  assert expected_information(lo, hi, g) == pytest.approx(
      sum(ruled_out(x) for x in range(lo, hi + 1)) / (hi - lo + 1))
  with pytest.raises(ValueError, match="information"):
    play(make("guess_number"), TaskSpec("g", "guess_number", {"information": "lucky"}), [])


def test_guess_number_truncates_at_the_turn_budget():
  env = make("guess_number")
  _, steps, verdict = play(env, TaskSpec("g", "guess_number", {"secret": 3, "max_turns": 2}),
                           ["9", "9", "9"])
  assert len(steps) == 2 and steps[-1].truncated and not steps[-1].terminated
  assert steps[-1].info["truncation"] == "turn_budget"
  assert verdict.status == VerdictStatus.FAIL


def test_calculator_with_tool_calls():
  env = make("calculator")
  task = TaskSpec("c", "calculator", {"expression": "12 * 7 + 3"})
  call = json.dumps({"name": "calculate", "arguments": {"expression": "12 * 7 + 3"}})
  obs, steps, verdict = play(env, task, [f"<tool_call>{call}</tool_call>",
                                         "<tool_call>{oops}</tool_call>", "ANSWER: 87"])
  assert obs.tools[0]["function"]["name"] == "calculate"
  assert steps[0].observation.messages[0]["content"] == "87"
  assert steps[1].info["invalid_tool_calls"] == 1 and not steps[1].terminated
  assert steps[2].terminated and steps[2].reward == 0.0
  assert verdict.status == VerdictStatus.PASS and verdict.reward == 1.0
  _, _, wrong = play(make("calculator"), task, ["ANSWER: 86"])
  assert wrong.status == VerdictStatus.FAIL


@pytest.mark.parametrize("text, want", [
    ("ANSWER: 87", 87.0), ("answer: -11.", -11.0), ("It is 87.\nANSWER: 87\nThanks!", 87.0),
    ("ANSWER: 1\nANSWER: 2.5", 2.5), ("calculate_82_66", None), ("82 + 66 = 148", None),
    ("The result is 87", None), ("ANSWER: 87abc", None), ("ANSWER: 12 * 7 = 84", None),
    ("ANSWER:", None), ("MY ANSWER: 3", None), ("ANSWER: " + "9" * 400, None),
    ("ANSWER: 3580\r\n", 3580.0), ("x\r\nANSWER: 12.\r\n", 12.0), ("ANSWER: 1\r2", None),
    ("ANSWER: 9007199515875293", 9007199515875293), ("ANSWER: 7.000", 7)])
def test_calculator_reads_only_an_answer_line(text, want):
  assert final_answer(text) == want


def test_calculator_compares_whole_numbers_exactly():
  """Compared as floats within 1e-6, an answer off by one past 2**53 passed (red team);
  whole numbers compare exactly, whatever their size, and a task whose answer is past a
  float's range (no answer can be read that large) is refused, not a crash."""
  task = TaskSpec("c", "calculator", {"expression": "94906267 * 94906267 + 4"})
  for said, want in (("9007199515875292", "fail"), ("9007199515875294", "fail"),
                     ("9007199515875293", "pass"), ("9007199515875293.0", "pass")):
    _, _, verdict = play(make("calculator"), task, [f"ANSWER: {said}"])
    assert verdict.status.value == want, said
  _, _, verdict = play(make("calculator"), TaskSpec("c", "calculator", {"expression": "7 / 2"}),
                       ["ANSWER: 3.5"])
  assert verdict.status == VerdictStatus.PASS
  # (red team) a reply with a fraction for a whole answer; a quotient whose float rounds
  # (its exact value a whole number); a third to 7 places; zeros before a number
  for expression, said, want in (
      ("123456789 * 987654321 * 3", "365797893337905810.5", "fail"),
      ("2 ** 60 + 1", "1152921504606846957.1", "fail"),
      ("123456789 * 987654321 / 3", "40644210370878426", "fail"),
      ("123456789 * 987654321 / 3", "40644210370878423", "pass"),
      ("10 / 3", "3.3333333", "pass"), ("10 / 3", "3.33333", "fail"),
      # (red team 29) within a millionth of the answer's size, read exactly: the tool's
      # float repr of a large quotient passes, a 0 for a small one does not
      ("100000000000 / 3", "33333333333.333332", "pass"),
      ("100000000000 / 3", "33333333333.3333333333", "pass"),
      ("1 / 3000000", "0", "fail"), ("1 / 3000000", "0.0000003", "fail"),
      ("1 / 3000000", "0.0000003333333", "pass"),
      # (a reviewer) a negative power, read exactly: its float was given the floor of a
      # fractional power's rounding, and `ANSWER: 0` passed it
      ("2 ** -40", "0", "fail"), ("10 ** -13", "0", "fail"), ("2 ** -2", "0.25", "pass"),
      ("2 ** -40", "0.0000000000009094947017729282379150390625", "pass"),
      # (a reviewer) decimals as written: 0.1 + 0.2 - 0.3 is 0; answers of 4,300 digits
      # and more are read, not raised (int()'s limit stopped the run)
      ("0.1 + 0.2 - 0.3", "0", "pass"), ("0.1 * 3", "0.3", "pass"),
      ("10 / 4", "2." + "5" + "0" * 5000, "pass"), ("10 / 4", "0" * 5000 + "2.5", "pass"),
      ("10 / 3", "3." + "3" * 5000, "pass"), ("10 / 4", "2." + "0" * 5000 + "1", "fail"),
      ("84 / 2", "42.0", "pass"), ("2 + 3", "0" * 5000 + "5", "pass"),
      ("2 + 3", "-" + "0" * 5000 + "5", "fail"),
      # (red team 42) zeros of other scripts (Arabic-Indic, full-width) dropped as ASCII's
      ("2 + 3", "\u0660" * 4400 + "5", "pass"), ("2 + 3", "\uff10" * 4400 + "\uff15", "pass"),
      ("2 + 3", "\u0660" * 4400 + "1", "fail"), ("10 / 4", "\u0662.\u0665", "pass")):
    task = TaskSpec("c", "calculator", {"expression": expression})
    _, _, verdict = play(make("calculator"), task, [f"ANSWER: {said}"])
    assert verdict.status.value == want, (expression, said[:30], verdict.details)
    json.dumps(verdict.to_dict())  # (an exact quotient's answer is carried as its float)
  env = make("calculator")
  asyncio.run(env.reset(TaskSpec("c", "calculator", {"expression": "10 / 3"})))
  _, _, verdict = play(make("calculator"), TaskSpec("c", "calculator", {"expression": "10 / 3"}),
                       [env.reference_action()])
  assert verdict.status == VerdictStatus.PASS and safe_eval("10 / 3") == 10 / 3
  with pytest.raises(ValueError, match="within a float's range"):
    asyncio.run(make("calculator").reset(
        TaskSpec("c", "calculator", {"expression": "999999**64 * 999999**64"})))
  # Past what Python prints (6,900 digits): named, not Python's advice to raise its limit
  huge = "*".join(["999999**64"] * 18)
  with pytest.raises(ValueError, match="the value has over 1200 digits: too large"):
    safe_eval(huge)
  with pytest.raises(ValueError, match="too large$"):
    asyncio.run(make("calculator").reset(TaskSpec("c", "calculator", {"expression": huge})))


def test_a_long_run_of_blanks_after_an_answer_is_read_at_once():
  """`ANSWER: 3580` and 120k blanks and `!` took 26 s to reject (the blanks' runs
  backtracked against each other), on the event loop; on an env worker past its
  clients' timeout, a wrong answer re-rolled as an infrastructure error (red team)."""
  t = time.perf_counter()
  assert final_answer("ANSWER: 3580" + " " * 300_000 + "!") is None
  assert final_answer("ANSWER: 3580" + " \t" * 150_000 + ".\r") == 3580.0
  assert time.perf_counter() - t < 1.0  # (0.003 s; quadratic: ~160 s)


def test_calculator_identifier_is_not_an_answer():
  task = TaskSpec("c", "calculator", {"expression": "82 - 16"})
  for action in ("calculate_82_66", "82 - 16 = 66"):
    _, steps, verdict = play(make("calculator"), task, [action])
    assert steps[0].terminated and verdict.status == VerdictStatus.FAIL
    assert verdict.details["final"] is None
  _, _, verdict = play(make("calculator"), task, ["82 - 16 is\nANSWER: 66"])
  assert verdict.status == VerdictStatus.PASS


def test_calculator_worked_examples_render_as_tool_calls():
  from jaxagent.toolcalls import parse_tool_calls
  from jaxagent.tokenizer import Tokenizer

  env = make("calculator")
  obs, _, _ = play(env, TaskSpec("c", "calculator", {"expression": "1 + 2"}), [])
  roles = [m["role"] for m in obs.messages]
  assert roles == ["system"] + ["user", "assistant", "tool", "assistant"] * 2 + ["user"]
  text = Tokenizer.byte_level().render(obs.messages, obs.tools)
  first_answer = text.split("<|im_start|>assistant\n")[1]  # as the model should write it
  parsed = parse_tool_calls(first_answer)
  (call,) = parsed.calls
  assert not parsed.errors and call.name == "calculate"
  assert call.arguments == {"expression": "3 * 41 + 2"}
  assert safe_eval(call.arguments["expression"]) == 125 and "ANSWER: 125" in text
  obs, _, _ = play(make("calculator"), TaskSpec("c", "calculator",
                                                {"expression": "1 + 2", "examples": 0}), [])
  assert [m["role"] for m in obs.messages] == ["system", "user"]


def test_calculator_task_file_is_make_tasks():
  assert load_tasks(os.path.join(REPO, "envs/tasks/calculator.jsonl")) == make_tasks(256)


def test_safe_eval():
  assert safe_eval("2 ** 10 - (3 // 2) % 5") == 1023
  for bad in ("__import__('os')", "x + 1", "9 ** 9999", "1 +"):
    with pytest.raises(ValueError):
      safe_eval(bad)


def test_python_tests_episode_with_reference_and_public_tests():
  resources = EnvResources(sandboxes=2)
  try:
    env = make("python_tests", resources)
    task = TaskSpec("p", "python_tests", {"task": "fibonacci"})
    write = json.dumps({"name": "write_file", "arguments": {
        "path": "solution.py",
        "content": "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n"
                   "        a, b = b, a + b\n    return a\n"}})
    public = json.dumps({"name": "run_public_tests", "arguments": {}})
    obs, steps, verdict = play(env, task, [f"<tool_call>{write}</tool_call>",
                                           f"<tool_call>{public}</tool_call>", "DONE"])
    assert {t["function"]["name"] for t in obs.tools} == {"write_file", "run_python",
                                                          "run_public_tests"}
    assert "test_public passed" in steps[1].observation.messages[0]["content"]
    assert steps[2].terminated
    assert verdict.status == VerdictStatus.PASS and verdict.details["passed"] == len(
        next(t for t in TASKS if t[0] == "fibonacci")[4])
    assert verdict.reward == 1.0
    asyncio.run(env.close())
  finally:
    resources.close()


def test_the_public_test_tool_runs_the_tasks_own_test():
  """The public test is read-only by any spelling of its name, and the tool runs the
  task's own test even when tool code replaced the file (a red-team finding: a wrong
  solution was told 'test_public passed')."""
  resources = EnvResources(sandboxes=1)
  try:
    env = make("python_tests", resources)
    task = TaskSpec("p", "python_tests", {"task": "add"})
    calls = [{"name": "write_file", "arguments": {"path": "./test_public.py",
                                                  "content": "def test_x():\n    pass\n"}},
             {"name": "write_file", "arguments": {"path": "solution.py",
                                                  "content": "def add(a, b):\n    return 0\n"}},
             {"name": "run_python", "arguments": {"code": (
                 "open('test_public.py', 'w').write('def test_public():\\n    pass\\n')")}},
             {"name": "run_public_tests", "arguments": {}}]

    async def go():
      await env.reset(task)
      return [(await env.step(f"<tool_call>{json.dumps(c)}</tool_call>")).observation
              .messages[0]["content"] for c in calls]

    said = asyncio.run(go())
    assert "error: ./test_public.py is read-only" in said[0]
    assert "test_public FAILED" in said[3] and "test_public passed" not in said[3], said[3]
    asyncio.run(env.close())
  finally:
    resources.close()


def test_a_full_host_disk_under_a_tool_write_is_the_infrastructures_not_a_tool_error(
    monkeypatch):
  """A workspace without a quota of its own is the host's disk: a `write_file`,
  `run_python`'s script or the public tests written to it when full was a tool error
  told to the model, and the episode graded (a correct answer a fail; red team 42).
  It is the infrastructure's (the episode dropped, never scored); a full workspace
  with its own quota stays the policy's doing, and a failing disk (EIO) is the host's."""
  import errno

  from envs.sandbox import Sandbox
  from jaxagent.errors import InfraError

  resources = EnvResources(sandboxes=1)
  try:
    env = make("python_tests", resources)
    task = TaskSpec("p", "python_tests", {"task": "add"})

    def failing(code):
      def write(path, data):
        raise OSError(code, os.strerror(code))
      return write

    async def go(code, quota, call):
      await env.reset(task)
      monkeypatch.setattr(env.sandbox, "_write", failing(code))
      monkeypatch.setattr(Sandbox, "has_quota", property(lambda self: quota))
      try:
        return (await env.step(call)).observation.messages[0]["content"]
      finally:
        await env.close()

    write = _call("write_file", path="solution.py", content=GOOD_ADD)
    for call in (write, _call("run_python", code="print(1)"), _call("run_public_tests")):
      with pytest.raises(InfraError, match="No space left on device"):
        asyncio.run(go(errno.ENOSPC, False, call))
    with pytest.raises(InfraError, match="Input/output error"):
      asyncio.run(go(errno.EIO, True, write))
    said = asyncio.run(go(errno.ENOSPC, True, write))
    assert said.startswith("error: write_file failed: OSError") and "No space" in said, said
  finally:
    resources.close()


def test_python_tests_grades_the_source_not_planted_bytecode():
  """An attack: solution.py looks wrong-but-innocent, and run_python plants an
  unchecked-hash .pyc of a correct one in __pycache__ (Python would import it without
  looking at the source). Grading drops bytecode, so the source is what is graded."""
  resources = EnvResources(sandboxes=1)
  try:
    env = make("python_tests", resources)
    task = TaskSpec("p", "python_tests", {"task": "fibonacci"})
    innocent = "def fibonacci(n):\n    return 0\n"
    plant = ("import py_compile, sys, os\n"
             "open('real.py', 'w').write('def fibonacci(n):\\n    a, b = 0, 1\\n'\n"
             "  '    for _ in range(n):\\n        a, b = b, a + b\\n    return a\\n')\n"
             "tag = sys.implementation.cache_tag\n"
             "py_compile.compile('real.py', cfile=f'__pycache__/solution.{tag}.pyc',\n"
             "  invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)\n"
             "os.remove('real.py')\n"
             "import solution; print('imported', solution.fibonacci(30))\n")
    calls = [{"name": "write_file", "arguments": {"path": "solution.py", "content": innocent}},
             {"name": "run_python", "arguments": {"code": plant}}]

    async def go():
      await env.reset(task)
      steps = [await env.step(f"<tool_call>{json.dumps(c)}</tool_call>") for c in calls]
      await env.step("DONE")
      workspace = await asyncio.to_thread(env.sandbox.files)
      planted = {k: v for k, v in workspace.items() if k.startswith(("solution", "__pycache__"))}
      # Graded with the bytecode, the plant would pass ...
      forged = await env.verifier.grade(planted, HiddenTests(env.fn, env.spec[4]),
                                        env_version="attack")
      return steps, forged, await env.verify()

    steps, forged, verdict = asyncio.run(go())
    assert "imported 832040" in steps[1].observation.messages[0]["content"]
    assert forged.status == VerdictStatus.PASS
    # ... but the environment grades only the source.
    assert verdict.status == VerdictStatus.FAIL and verdict.details["passed"] == 1
    asyncio.run(env.close())
  finally:
    resources.close()


def test_task_files_and_registry(tmp_path):
  tasks = [TaskSpec("a", "guess_number", {"secret": 2}), TaskSpec("b", "calculator",
                                                                    {"expression": "1+1"})]
  path = str(tmp_path / "t.jsonl")
  write_tasks(path, tasks)
  assert load_tasks(path) == tasks
  (tmp_path / "bad.jsonl").write_text('{"id": "x", "env": "guess_number"}\n{"id": 3}\n')
  with pytest.raises(ValueError, match="bad.jsonl:2"):
    load_tasks(str(tmp_path / "bad.jsonl"))
  # Every bad line is said at once, up to ten and how many more (the first alone made a
  # file of several mistakes one run each: a new user).
  lines = ['{"id": "ok", "env": "calculator"}', "{not json", '{"id": 3}', "",
           '{"id": "ok", "env": "calculator"}'] + ["[1]"] * 11
  (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
  with pytest.raises(ValueError) as said:
    load_tasks(str(tmp_path / "bad.jsonl"), unique=True)
  said = str(said.value).splitlines()
  assert said[0] == f"14 bad lines in {tmp_path}/bad.jsonl:", said
  assert [s.split(": ")[0] for s in said[1:11]] == [
      f"  {tmp_path}/bad.jsonl:{n}" for n in (2, 3, 5, 6, 7, 8, 9, 10, 11, 12)], said
  assert "line 1's too" in said[3] and said[11] == "  (and 4 more)", said
  # (not text: the decoder's error named no file; a red team)
  (tmp_path / "bin.jsonl").write_bytes(b'{"id": "ok", "env": "calculator"}\n\xff\xfe\x00')
  with pytest.raises(ValueError, match=r"bin\.jsonl: not a task file \(JSON lines of UTF-8 "
                                       r"text\): byte b'\\xff' \(invalid start byte\)"):
    load_tasks(str(tmp_path / "bin.jsonl"))
  with pytest.raises(KeyError, match="unknown environment 'chess'"):
    make("chess")
  with pytest.raises(ValueError, match="needs EnvResources"):
    make("python_tests")


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999", "9" * 400])
def test_a_reward_that_is_not_a_finite_number_never_reaches_the_learner(tmp_path, literal):
  """`process_reward: NaN` in a task file made every advantage of its group NaN (red
  team): task files refuse such numbers, and a step reward or trained reward that is
  not finite (a task built in code, an environment's bug) is an error naming it."""
  from envs.base import StepResult, Observation, trained_rewards

  path = tmp_path / "t.jsonl"
  path.write_text('{"id": "g", "env": "guess_number", "params": {"secret": 5}}\n'
                  '{"id": "h", "env": "guess_number", "params": {"secret": 5, '
                  f'"process_reward": {literal}}}}}\n')
  with pytest.raises(ValueError, match="t.jsonl:2: .*(not plain JSON|overflows)"):
    load_tasks(str(path))
  if literal.isdigit():  # a whole number: refused above, and not a float to play with
    return
  env = make("guess_number")
  with pytest.raises(ValueError, match="process_reward must be a finite number"):
    asyncio.run(env.reset(TaskSpec("g", "guess_number", {"secret": 5,
                                                          "process_reward": float(literal)})))
  asyncio.run(env.reset(TaskSpec("g", "guess_number", {"secret": 5})))
  env.process_reward = float(literal)  # (an environment's bug: its step's reward not finite)
  with pytest.raises(ValueError, match="a step's reward must be a finite number"):
    asyncio.run(env.step("8"))
  with pytest.raises(ValueError, match="finite"):
    StepResult(Observation([]), float("nan"), False, False)
  with pytest.raises(ValueError, match="rewards must be finite numbers"):
    trained_rewards([0.0, float(literal)], {"status": "pass", "reward": 1.0})


def test_a_reward_past_float32s_range_is_refused_as_it_is_reported():
  """1e39 is finite in Python and inf in the learner's float32: it passed every reward
  check, then stopped the run with a non-finite update blaming the learning rate (red
  team 37)."""
  from envs.base import REWARD_MAX, Observation, StepResult, Verdict

  with pytest.raises(ValueError, match="a step's reward must be within float32's range"):
    StepResult(Observation([]), 1e39, False, False)
  with pytest.raises(ValueError, match="a verdict's reward must be within float32's range"):
    Verdict(VerdictStatus.PASS, -1e39, "e@1", "e@1")
  with pytest.raises(ValueError, match="within float32's range"):  # a sum of two
    trained_rewards([REWARD_MAX], {"status": "pass", "reward": REWARD_MAX})
  StepResult(Observation([]), REWARD_MAX, False, False)  # (its top is a reward)


def test_a_reward_that_is_not_a_number_is_refused_and_named_with_its_task():
  """A string reward ("0.5") trained as 0.5 and a verdict's as a TypeError; a NaN stopped
  the run as "a bug" with a traceback, naming neither the task nor the line (a new
  user's round). Both are BadReward, which the agent names with the task and the
  environment's line, in one line."""
  import numpy as np

  from envs.base import BadReward, Observation, StepResult, Verdict, VerdictStatus
  from jaxagent.agent import MeasuredEnv
  from jaxagent.errors import EpisodeBug

  for bad in ("0.5", None, True, float("inf"), 10 ** 400, 10 ** 5000):  # (ints past a
    # float's range were an unnamed OverflowError; a red team)
    with pytest.raises(BadReward, match="a step's reward must be a finite number"):
      StepResult(Observation([]), bad, False, False)
    with pytest.raises(BadReward, match="a verdict's reward must be a finite number"):
      Verdict(VerdictStatus.FAIL, bad, "1", "1")
  for good in (np.float32(0.5), np.array(0.5), 1):  # numbers of any kind pass
    StepResult(Observation([]), good, False, False)
  Verdict(VerdictStatus.PASS, 1, "1", "1")

  class Bad(type(make("guess_number"))):
    async def step(self, action):
      r = await super().step(action)
      return StepResult(r.observation, "0.5", r.terminated, r.truncated, r.info)

  env = MeasuredEnv(Bad())
  asyncio.run(env.reset(TaskSpec("g", "guess_number", {"secret": 5})))
  with pytest.raises(EpisodeBug, match=r"task 'g' \(guess_number\): .*test_environments.py:\d+: "
                     r"BadReward: a step's reward must be a finite number, got '0.5' \(str\)"):
    asyncio.run(env.step("8"))


def test_filter_cli_keeps_good_tasks_and_says_why_it_drops(tmp_path):
  tasks = [
      TaskSpec("ok", "guess_number", {"secret": 5}),
      # One turn is not enough for bisection to find 5 in 1..16: the reference fails.
      TaskSpec("too-hard", "guess_number", {"secret": 5, "max_turns": 1}),
      TaskSpec("py", "python_tests", {"task": "add"}),
  ]
  path = str(tmp_path / "tasks.jsonl")
  write_tasks(path, tasks)
  out = str(tmp_path / "kept.jsonl")
  proc = subprocess.run([sys.executable, "-m", "envs.filter", path, "--out", out], cwd=REPO,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert "DROP too-hard: reference fail, no-op fail -- reference solution does not pass" in (
      proc.stdout)
  assert "2 of 3 tasks kept" in proc.stdout
  assert [t.id for t in load_tasks(out)] == ["ok", "py"]


def test_bundled_python_tasks_all_pass_the_filter():
  from envs.filter import filter_tasks

  tasks = load_tasks(f"{REPO}/envs/tasks/python_tests.jsonl")
  assert len(tasks) >= 30
  resources = EnvResources(sandboxes=4)
  try:
    reports = asyncio.run(filter_tasks(tasks, resources, concurrency=2))
  finally:
    resources.close()
  assert all(r["keep"] for r in reports), [r for r in reports if not r["keep"]]
  assert {r["reference"] for r in reports} == {"pass"} and {r["noop"] for r in reports} == {
      "fail"}


def test_a_python_tests_task_of_your_own_is_graded_by_its_own_cases():
  """A task file's own function and hidden cases (a new user could only name a bundled
  task: "unknown python_tests task None"); its reference, when given, is what the filter
  checks (without one, the no-op check alone, said: a traceback before); a bad one, or a
  parameter no environment knows (a misspelt `max_turn` was played at the default), is
  refused naming what."""
  from envs.filter import check

  own = {"prompt": "def triple(x): three times x.", "function": "triple",
         "tests": [[[2], 6], [[0], 0], [[-4], -12], [[10 ** 20], 3 * 10 ** 20]],
         "reference": "def triple(x):\n    return 3 * x\n"}
  listed = {"prompt": "def pair(a, b): the list [a, b].", "function": "pair",
            "tests": [[[1, "x"], [1, "x"]], [[None, 2.5], [None, 2.5]]],
            "public_test": "p = pair(1, 2)\nassert p == [1, 2]"}
  resources = EnvResources(sandboxes=2)
  try:
    reports = [asyncio.run(check(TaskSpec(i, "python_tests", p), resources))
               for i, p in (("own", own), ("listed", listed))]
    env = make("python_tests", resources)
    for code, want in (("def pair(a, b):\n    return [a, b]\n", "pass"),
                       ("def pair(a, b):\n    return (a, b)\n", "fail")):  # (a tuple)
      _, _, verdict = play(env, TaskSpec("listed", "python_tests", listed),
                           [_call("write_file", path="solution.py", content=code), "DONE"])
      assert verdict.status.value == want, (code, verdict)
    observation = asyncio.run(env.reset(TaskSpec("listed", "python_tests", listed)))
    assert "def pair(a, b): the list [a, b].\nPublic test:\np = pair(1, 2)" in (
        observation.messages[-1]["content"])
    with pytest.raises(ValueError, match="'parms': did you mean 'params'"):
      TaskSpec.from_dict({"id": "x", "env": "python_tests", "parms": own})
    single = {"prompt": "def one(): 1.", "function": "one", "tests": [[[], 1]]}
    observation = asyncio.run(env.reset(TaskSpec("single", "python_tests", single)))
    assert observation.messages[-1]["content"] == "def one(): 1."  # (no case to copy)
    asyncio.run(env.close())
    bad = [({"task": "addd"}, r"unknown python_tests task 'addd' \(did you mean 'add'\?\)"),
           ({"task": "add", "max_turn": 1}, r"unknown parameters \['max_turn'\].*did you "
                                            r"mean 'max_turns'\?"),
           ({"prompt": "p", "function": "f"}, "gives its own prompt, function and tests: "
                                              "tests missing"),
           ({**own, "tests": [[1, 2]]}, r"tests\[0\] must be \[\[args\], expected\]"),
           ({**own, "function": "not a name"}, "function must be a Python name"),
           ({**own, "reference": "def triple(x) return"}, "reference is not Python")]
    for params, why in bad:
      report = asyncio.run(check(TaskSpec("bad", "python_tests", params), resources))
      assert not report["keep"] and re.search(why, report["reasons"][0]), report
    report = asyncio.run(check(TaskSpec("c", "calculator", {"expression": "1+1",
                                                            "max_turn": 1}), resources))
    assert "unknown parameters ['max_turn']" in report["reasons"][0], report
  finally:
    resources.close()
  assert reports[0]["keep"] and reports[0]["reference"] == "pass", reports[0]
  assert reports[1]["keep"] and reports[1]["reference"] == "-", reports[1]
  assert "no reference: task listed gives no reference solution" in reports[1]["note"]


def test_an_own_tasks_large_cases_odd_names_and_answers_that_know_nothing():
  """Red team 45 on own tasks: a correct answer of 600 cases (or of one 20,000-character
  string) failed, its results past the commands' 16 KiB of output; a task no answer could
  pass was kept. The default public test disagreed with the grader (3.0 passed it for 6,
  0.1 + 0.2 failed it for 0.3), a first case of 300,000 numbers made it a 2 MB file the
  episode could not start with, and a function named test_* broke the public test's
  runner. A task whose every case expects True paid `return True`: the filter plays
  answers that know nothing, and drops a task one of them passes."""
  from envs.filter import check
  from envs.python_tests import task_spec

  resources = EnvResources(sandboxes=2)
  env = make("python_tests", resources)

  def own(fn, tests, **more):
    return {"prompt": f"def {fn}(...): see the tests.", "function": fn, "tests": tests, **more}

  def graded(params, code, actions=("DONE",)):
    _, steps, verdict = play(env, TaskSpec("t", "python_tests", params),
                             [_call("write_file", path="solution.py", content=code),
                              *actions])
    return verdict, [m["content"] for st in steps for m in st.observation.messages]

  try:
    many = own("ident", [[[i], i] for i in range(600)])
    verdict, _ = graded(many, "def ident(x):\n    return x\n")
    assert verdict.status == VerdictStatus.PASS, verdict.details.get("cases", {}).get("0")
    big = own("rep", [[["ab", 10_000], "ab" * 10_000], [["x", 2], "xx"]])
    assert graded(big, "def rep(s, n):\n    return s * n\n")[0].status == VerdictStatus.PASS
    verdict, _ = graded(big, "def rep(s, n):\n    return [s * n] * 60\n")
    assert verdict.status == VerdictStatus.FAIL and "overflowed" in verdict.details["reason"]
    assert "overflowed what the harness reads" in verdict.details["cases"]["0"]
    with pytest.raises(ValueError, match="tests: a correct answer's results take about"):
      task_spec(TaskSpec("t", "python_tests", own("f", [[[i], "x" * 100] for i in range(
          20_000)])))
    # The default public test checks as the grader does.
    run_public = _call("run_public_tests")
    for tests, code, passes in (
        ([[[2], 6], [[1], 3]], "def f(x):\n    return 3.0 * x\n", False),
        ([[[0.1], 0.3], [[1], 1.0]], "def f(x):\n    return x + 0.2 if x < 1 else 1.0\n", True),
        ([[[list(range(300_000))], 1], [[[1]], 1]], "def f(x):\n    return 1\n", True),
        # (a reviewer: what `type(result) is dict`, a top-level isclose and `==` missed)
        ([[["ab"], {"a": 1, "b": 1}], [["a"], {"a": 1}]],
         "from collections import Counter\ndef f(s):\n    return Counter(s)\n", True),
        ([[[0.1], [0.3]], [[1], [1.0]]], "def f(x):\n    return [x + 0.2] if x < 1 else [1.0]\n",
         True)):
      verdict, said = graded(own("f", tests), code, (run_public, "DONE"))
      assert ("test_public passed" in said[1]) is passes, said
      assert (verdict.status == VerdictStatus.PASS) is passes, verdict
    # (the solution's function is no test to run, nor shadowed by the test's names)
    for fn in ("test_x", "test_public", "result", "math", "graded_equal"):
      verdict, said = graded(own(fn, [[[1], 2], [[2], 3]]),
                             f"def {fn}(x):\n    return x + 1\n", (run_public, "DONE"))
      assert verdict.status == VerdictStatus.PASS and "FAILED" not in said[1], said
    asyncio.run(env.close())
    every_true = own("is_even", [[[2], True], [[4], True], [[0], True]],
                     reference="def is_even(n):\n    return n % 2 == 0\n")
    report = asyncio.run(check(TaskSpec("c", "python_tests", every_true), resources))
    assert report["reasons"] == ["an answer that knows nothing passes: returns True for "
                                 "every case"], report
    echo = own("echo", [[["a"], "a"], [["b"], "b"]])
    report = asyncio.run(check(TaskSpec("e", "python_tests", echo), resources))
    assert report["reasons"] == ["an answer that knows nothing passes: returns its first "
                                 "argument"], report
  finally:
    resources.close()
  for bad, said in (({"reference": "x = '\udcff'"}, "reference is not Python: 'utf-8'"),
                    ({"prompt": "a\udcff"}, "prompt is not text (a lone surrogate)"),
                    ({"public_test": "x = 1\n" * 20_000}, "public_test is over 65536 bytes")):
    with pytest.raises(ValueError, match=re.escape(said)):
      task_spec(TaskSpec("t", "python_tests", {**own("f", [[[1], 1]]), **bad}))


def test_noop_passing_task_is_dropped():
  from envs.filter import check

  @base.register("always_pass_test_env")
  class AlwaysPass(base.Env):
    async def reset(self, task):
      self.done = False
      return base.Observation([])

    async def step(self, action):
      self.done = True
      return base.StepResult(base.Observation([]), 0.0, True, False)

    async def verify(self):
      return base.Verdict(VerdictStatus.PASS, 1.0, "x", "x")

    def reference_action(self):
      return ""

  try:
    report = asyncio.run(check(TaskSpec("t", "always_pass_test_env"), EnvResources()))
    assert not report["keep"] and report["reasons"] == ["no-op solution passes"]
  finally:
    base.ENVS.pop("always_pass_test_env")


def test_tool_calls_are_capped_per_turn_and_lone_surrogates_are_malformed():
  """Seven 9.5 s runs in one turn would outlast an environment worker's 60 s deadline
  (an infra error, dropped instead of scored): only the first 4 of a turn run. A path
  with a lone surrogate (a JSON escape) is a malformed call, not a crash in the
  tokenizer when the tool echoes it."""
  from jaxagent.tokenizer import Tokenizer

  resources = EnvResources(sandboxes=1)
  try:
    env = make("python_tests", resources)
    stall = "".join(_call("run_python", code=f"print({i})") for i in range(7))
    surrogate = ('<tool_call>{"name": "write_file", "arguments": {"path": "\\udcff.py", '
                 '"content": "x"}}</tool_call>')
    _, steps, _ = play(env, TaskSpec("p", "python_tests", {"task": "add"}),
                       [stall, surrogate, "DONE"])
    out = [m["content"] for m in steps[0].observation.messages]
    assert len(out) == 7 and all('"exit_code": 0' in o for o in out[:4])
    assert all("at most 4 tool calls" in o for o in out[4:])
    assert env.counters["invalid_tool_calls"] == 4  # 3 unrun + the surrogate call
    bad = steps[1].observation.messages[0]["content"]
    assert "malformed tool call" in bad and "lone surrogate" in bad
    Tokenizer.byte_level().encode_plain(bad)  # whatever is echoed can be tokenized
    asyncio.run(env.close())
  finally:
    resources.close()


def test_a_tool_call_with_other_keys_is_malformed():
  """A call written {"name": ..., "argumesss": {...}} was taken as the call with no
  arguments: the environment ran, and a router's re-encoding rendered, a call the model
  did not write, not counted as malformed (red team 41)."""
  from envs.tools import parse_tool_calls

  bad = parse_tool_calls('<tool_call>{"name": "calculate", "argumesss": {"expression": '
                         '"9+8"}}</tool_call>')
  assert not bad.calls and 'has only "name" and "arguments" (it has "argumesss")' in \
      bad.errors[0]
  ok = parse_tool_calls('<tool_call>{"name": "list_files"}</tool_call>')  # (no arguments)
  assert not ok.errors and ok.calls[0].arguments == {}


def test_tool_call_arguments_nested_past_the_bound_are_malformed():
  """An `anthropic`-client agent sends a reply's tool_use input back on its next turn;
  pydantic refused to serialise ~300 levels and the episode raised, which stopped the
  run. Calls nested past MAX_NESTING are malformed, told to the policy as such."""
  from envs.values import json_depth
  from jaxagent.toolcalls import MAX_NESTING, parse_tool_calls

  def call(depth):  # the call object and its arguments are two levels
    value = "[" * (depth - 2) + "]" * (depth - 2)
    return '<tool_call>{"name": "calculate", "arguments": {"expression": %s}}</tool_call>' % value

  ok = parse_tool_calls(call(MAX_NESTING))
  assert not ok.errors and json_depth(ok.calls[0].arguments) == MAX_NESTING - 1
  for depth in (MAX_NESTING + 1, 300, 5000):
    bad = parse_tool_calls(call(depth))
    assert not bad.calls and f"nested deeper than {MAX_NESTING} levels" in bad.errors[0]
  # Arguments written as a JSON string nest as deep as the same call as an object.
  as_string = ('<tool_call>{"name": "calculate", "arguments": %s}</tool_call>'
               % json.dumps(json.dumps({"expression": json.loads("[" * (MAX_NESTING - 2)
                                                                 + "]" * (MAX_NESTING - 2))})))
  assert not parse_tool_calls(as_string).errors
  deeper = as_string.replace("[", "[[", 1).replace("]", "]]", 1)
  assert "nested deeper" in parse_tool_calls(deeper).errors[0]
  assert json_depth(1) == 0 and json_depth({"a": [1, {"b": []}]}) == 4


def test_guess_number_refuses_a_number_too_long_to_read():
  env = make("guess_number")
  _, steps, verdict = play(env, TaskSpec("g", "guess_number", {"secret": 7}),
                           ["9" * 4301, "7"])
  assert steps[0].info["valid_action"] is False
  assert steps[0].observation.messages[0]["content"] == "That number is too long."
  assert verdict.status == VerdictStatus.PASS


EXTENSION = r'''
#include <Python.h>
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "solution", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_solution(void) {
  PyObject *m = PyModule_Create(&def);
  PyObject *d = PyModule_GetDict(m);
  PyDict_SetItemString(d, "__builtins__", PyEval_GetBuiltins());
  Py_XDECREF(PyRun_String("def add(a, b):\n    return a + b\n", Py_file_input, d, d));
  return m;
}
'''


@pytest.mark.skipif(not (shutil.which("gcc") and glob.glob("/usr/include/python3*/Python.h")),
                    reason="no C compiler and Python headers for the sandbox's Python")
def test_python_tests_grades_the_source_not_a_compiled_extension():
  """An attack: solution.py is wrong but innocent, and run_python builds a C extension
  `solution.<abi>.so` with the sandbox's gcc; Python imports it before solution.py.
  Grading leaves compiled code behind, so the source is what is graded."""
  resources = EnvResources(sandboxes=1)
  try:
    env = make("python_tests", resources)
    build = ("import importlib.machinery, subprocess, sysconfig\n"
             f"open('ext.c', 'w').write({EXTENSION!r})\n"
             "out = 'solution' + importlib.machinery.EXTENSION_SUFFIXES[0]\n"
             "subprocess.run(['gcc', '-shared', '-fPIC', '-I' + sysconfig.get_paths()['include'],"
             " 'ext.c', '-o', out], check=True)\n"
             "import os; os.remove('ext.c')\n"
             "import solution; print('imported', solution.add(2, 3), solution.__file__)\n")

    async def go():
      await env.reset(TaskSpec("p", "python_tests", {"task": "add"}))
      await env.step(_call("write_file", path="solution.py", content=WRONG_ADD))
      step = await env.step(_call("run_python", code=build))
      await env.step("DONE")
      workspace = await asyncio.to_thread(env.sandbox.files)
      planted = {k: v for k, v in workspace.items() if k.startswith("solution")}
      forged = await env.verifier.grade(planted, HiddenTests(env.fn, env.spec[4]),
                                        env_version="attack")
      return step, planted, forged, await env.verify()

    step, planted, forged, verdict = asyncio.run(go())
    out = step.observation.messages[0]["content"]
    assert "imported 5" in out and ".so" in out, out
    assert any(k.endswith(".so") for k in planted)
    assert forged.status == VerdictStatus.PASS  # graded with the extension it would pass
    assert verdict.status == VerdictStatus.FAIL and verdict.reward == 0.0
    asyncio.run(env.close())
  finally:
    resources.close()


@pytest.mark.parametrize("params,said", [
    ({"secret": 99}, "secret 99 is outside 1..16"),
    ({"secrt": 3}, "unknown parameters ['secrt']"),
    # (`1e400` in a task file: an OverflowError, read on a worker as its own failure;
    # 2.5 turns were played as 2, `true` as 1; red team 115)
    ({"low": float("inf")}, "low must be an integer, got inf"),
    ({"max_turns": 2.5}, "max_turns must be an integer, got 2.5"),
    ({"secret": True}, "secret must be an integer, got True"),
    ({"high": [16]}, "high must be an integer, got [16]"),
    ({"high": 10**18}, "low and high must be within +-10^18"),
    ({"process_reward": float("nan")}, "process_reward must be a finite number, got nan"),
    ({"process_reward": "1e999"}, "process_reward must be a finite number, got '1e999'")])
def test_guess_number_refuses_a_task_it_would_play_wrongly(params, said):
  """A secret outside the range was played as an ordinary failure, and a misspelt
  parameter drew a random secret (a new user): the task cannot start (a TaskError)."""
  with pytest.raises(ValueError, match=re.escape(said)):
    asyncio.run(make("guess_number").reset(TaskSpec("g", "guess_number", params)))


def test_a_calculator_task_without_its_expression_is_named():
  """A red team: it was "envs/calculator.py:186: KeyError: 'expression'"."""
  with pytest.raises(ValueError, match=r"task c: params need 'expression'"):
    asyncio.run(make("calculator").reset(TaskSpec("c", "calculator", {})))


def test_task_numbers_as_a_task_file_may_write_them():
  """Integers written as YAML or JSON may write them (16, 16.0, "16") are read so."""
  from envs.base import task_int, task_number

  assert [task_int({"n": v}, "n", 0, "t") for v in (16, 16.0, "16", 10**30)] == [
      16, 16, 16, 10**30]
  assert task_int({}, "n", 7, "t") == 7
  assert [task_number({"x": v}, "x", 0.0, "t") for v in (1, 0.5, "0.25")] == [1, 0.5, 0.25]
  with pytest.raises(ValueError, match=r"x must be a finite number, got 1000"):
    task_number({"x": 10**400}, "x", 0.0, "t")


@pytest.mark.parametrize("version,said", [({"a": 1}, "got {'a': 1}"), (True, "got True"),
                                          (1.5, "got 1.5"), (None, "got None")])
def test_a_task_version_is_a_string_or_an_integer(version, said):
  """A version of `{"a": 1}` was taken as its text (red team 115)."""
  assert TaskSpec.from_dict({"id": "t", "env": "e", "version": 3}).version == "3"
  with pytest.raises(ValueError, match=re.escape(f"task t: version must be a string or "
                                                 f"an integer, {said}")):
    TaskSpec.from_dict({"id": "t", "env": "e", "version": version})


def test_names_are_checked_in_python_this_host_cannot_parse():
  """A syntax newer than the grading host's Python (a sandbox's may be newer) leaves a
  file unparsed here: its names are read from its tokens (reviewer: the whole file went
  unchecked, a look-alike `def` with it)."""
  from envs.python_tests import source_problem

  newer = "type Number = int\ndef is_prime(n):\n    return n in (2, 3)\n"
  assert source_problem({"solution.py": newer.encode()}) is None
  look_alike = newer + "def \u0456s_prime(n):\n    return all(n % d for d in range(2, n))\n"
  assert "'\\u0456s_prime' is not ASCII" in source_problem({"solution.py": look_alike.encode()})


def test_the_source_checks_read_a_bounded_amount_of_text():
  """What the checks read is bounded, strings read again as Python counted with their
  files (red team 16: about 5 s a MiB, unbounded); a solution well under it passes."""
  from envs.python_tests import MAX_CHECKED_CHARS, source_problem

  fine = GOOD_ADD + "# " + "x" * (MAX_CHECKED_CHARS // 2) + "\n"
  assert source_problem({"solution.py": fine.encode()}) is None
  # Under the bound as written, over it with what its string holds read again.
  held = "s = " + repr("\u00e9 = 1\n" * (MAX_CHECKED_CHARS // 12)) + "\n"
  assert len(GOOD_ADD + held) < MAX_CHECKED_CHARS
  said = source_problem({"solution.py": (GOOD_ADD + held).encode(),
                         "more.py": held.encode()})
  assert said is not None and "characters to check" in said, said
  files = {f"pad{i}.txt": b"x" * (MAX_CHECKED_CHARS // 3) for i in range(4)}
  assert "characters to check" in source_problem({"solution.py": GOOD_ADD.encode(), **files})


def test_python_is_parsed_safely_from_several_threads():
  """CPython 3.11 builds syntax trees with an interpreter-wide recursion counter: two
  threads parsing while the garbage collector frees files in cycles (a busy worker's
  garbage) raised `SystemError: AST constructor recursion depth mismatch` from a source
  check, an infrastructure error for a wrong answer, or an agent's run stopped (red team
  16: 17 in 5 s here). The checks and the calculator parse one at a time, and again
  after a parse elsewhere (a traceback's) upset the count."""
  import threading
  import time
  import traceback

  from envs.calculator import safe_eval
  from envs.python_tests import source_problem

  source = ("def f(a):\n  return [(x, {y: (z,)}) for x in a for y in x for z in y]\n" * 400
            ).encode()

  class Cycle:  # garbage whose collection closes a file (releasing the GIL)
    def __init__(self):
      self.me, self.file = self, open(os.devnull, "rb")

  stop, errors = threading.Event(), []

  def litter():
    while not stop.is_set():
      for _ in range(50):
        Cycle()
      time.sleep(0.0005)

  def check(work):
    end = time.time() + 3
    while time.time() < end:
      try:
        work()
      except Exception as e:  # noqa: BLE001 (every error is the finding)
        errors.append((getattr(work, "__name__", ""), repr(e)))

  def a_traceback():  # (Python 3.11 parses the failing line to draw its carets: reviewer)
    try:
      a, b, c = 1, 2, 0
      a + b / c
    except ZeroDivisionError:
      traceback.format_exc()

  threads = [threading.Thread(target=litter)] + [
      threading.Thread(target=check, args=(lambda: source_problem({"solution.py": source}),))
      for _ in range(2)] + [threading.Thread(target=check, args=(
          lambda: safe_eval("((1 + 2) * (3 - 4)) / 5 + " * 6 + "1"),)),
          threading.Thread(target=check, args=(a_traceback,))]
  for t in threads[1:]:
    t.start()
  threads[0].start()
  for t in threads[1:]:
    t.join()
  stop.set()
  threads[0].join()
  assert errors == [], errors[:3]


def test_source_checks_run_one_at_a_time_and_their_queue_is_the_infrastructures():
  """Verifies' source checks run on one thread in turn, and a check's wait behind
  another's is marked as a wait on shared infrastructure (red team 22: side by side on
  the default pool, under the parser's lock, each took as long as all of them, and a
  crowd of padded wrong answers pushed a correct neighbour past the worker's deadline).
  """
  import threading
  import time
  from envs import waits
  from envs.python_tests import checked

  release, running, peak = threading.Event(), [0], [0]

  def check(hold):
    running[0] += 1
    peak[0] = max(peak[0], running[0])
    if hold:
      release.wait(10)
    running[0] -= 1
    return hold

  async def one(hold):
    with waits.measured() as clock:
      t0 = time.perf_counter()
      out = await checked(check, hold)
      return out, clock.queued_total_s(), time.perf_counter() - t0

  async def main():
    first = asyncio.ensure_future(one(True))
    await asyncio.sleep(0.05)
    queued = [asyncio.ensure_future(one(False)) for _ in range(3)]
    await asyncio.sleep(0.4)
    release.set()
    return await first, await asyncio.gather(*queued)

  (held, held_wait, _), queued = asyncio.run(main())
  assert held is True and held_wait < 0.2 and peak[0] == 1
  # (behind the first for 0.4 s: the infrastructure's, in a queue that moves, which an
  # environment worker's wall does not count: verifies padded to slow checks queued past
  # it, 504s re-rolled: red team 35)
  for out, waited, took in queued:
    assert out is False and waited >= 0.3 and took - waited < 0.35


def test_task_text_takes_plain_fields_only():
  """A task's text parameter fills plain fields only: a format width took gigabytes on
  the worker (its MemoryError read as the worker's failure), and attribute access read
  the values' attributes (red team 115). Each is the task's error, naming the field."""
  def reset(env_name, params):
    return asyncio.run(make(env_name).reset(TaskSpec("t", env_name, params)))

  obs = reset("guess_number", {"prompt": "{{x}} {low}-{high}", "low": 2, "high": 9})
  assert obs.messages[0]["content"] == "{x} 2-9"
  for prompt, named in [("{low:>99999999999}", "{low:>99999999999}"),
                        ("{low.__class__}", "{low.__class__}"), ("{low!r}", "{low!r}"),
                        ("{secret}", "{secret}"), ("{0}", "{0}"), ("{low", "prompt:")]:
    with pytest.raises(ValueError, match=re.escape(named)):
      reset("guess_number", {"prompt": prompt})
  with pytest.raises(ValueError, match=re.escape("question: {expression:>999999999}")):
    reset("calculator", {"expression": "1 + 2", "question": "{expression:>999999999}"})
  with pytest.raises(TypeError, match="prompt must be a string"):
    reset("guess_number", {"prompt": 5})


def test_task_generators_write_only_where_told_and_reproduce_the_bundled_files(tmp_path):
  """`python -m envs.guess_number` (and calculator) wrote the bundled task file a run
  trains on when no --out was given, and a bad --out or -n was a traceback or a file of
  "-3 tasks" (a new user). Their defaults give the bundled files, byte for byte."""
  import subprocess
  import sys

  from tests.conftest import REPO

  def gen(name, *args):
    return subprocess.run([sys.executable, "-m", f"envs.{name}", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)

  r = gen("guess_number")
  assert r.returncode == 2 and "the following arguments are required: --out" in r.stderr
  r = gen("guess_number", "--out", str(tmp_path / "none" / "t.jsonl"))
  assert r.returncode == 2 and r.stderr.strip() == (
      f"python -m envs.guess_number: --out: cannot write {tmp_path / 'none' / 't.jsonl'}: "
      "No such file or directory"), r.stderr
  r = gen("calculator", "-n", "-3", "--out", str(tmp_path / "c.jsonl"))
  assert r.returncode == 2 and "argument -n: must be >= 1, got -3" in r.stderr
  for name in ("guess_number", "calculator"):
    out = tmp_path / f"{name}.jsonl"
    r = gen(name, "--out", str(out))
    assert r.returncode == 0 and r.stdout == f"wrote 256 tasks to {out}\n", r.stderr
    with open(os.path.join(REPO, "envs", "tasks", f"{name}.jsonl"), "rb") as f:
      assert out.read_bytes() == f.read(), name


def test_calculator_ends_at_its_turn_budget_and_an_answer_after_it_is_not_read():
  task = TaskSpec("c", "calculator", {"expression": "12 * 7 + 3", "max_turns": 2})
  call = _call("calculate", expression="12 * 7 + 3")
  _, steps, verdict = play(make("calculator"), task, [call, call, "ANSWER: 87"])
  assert len(steps) == 2 and steps[-1].truncated and not steps[-1].terminated
  assert steps[-1].info["truncation"] == "turn_budget"
  assert verdict.status == VerdictStatus.FAIL and verdict.details["final"] is None


def test_calculator_answers_near_zero_are_within_rounding_only_and_decimals_exact():
  """A float answer (a fractional power's) near 0 is right within its rounding (1e-12),
  not within a millionth: `ANSWER: 0` for 6.2e-8 is wrong. Decimals are read as written:
  `0.1 * 3 * 1000000 - 300000` is 0 (its floats' 5.8e-11 refused a right 0)."""
  for expression, said, want in (
      ("2 ** 0.5 - 1.4142135", "0", "fail"), ("2 ** 0.5 - 1.4142135", "0.0000001", "fail"),
      ("2 ** 0.5 - 1.4142135", "0.00000006237309513", "pass"),
      ("2 ** 0.5 - 1.414213562373095", "0", "pass"), ("2 ** 0.5", "1.4142135623731", "pass"),
      ("2 ** 0.5", "1.41421", "fail"), ("0.1 * 3 * 1000000 - 300000", "0", "pass"),
      ("0.1 * 3 * 1000000 - 300000", "0.0000000000582", "fail")):
    _, _, verdict = play(make("calculator"), TaskSpec("c", "calculator",
                                                      {"expression": expression}),
                         [f"ANSWER: {said}"])
    assert verdict.status.value == want, (expression, said, verdict.details)


def test_a_tool_command_the_sandbox_could_not_run_is_the_infrastructures(monkeypatch):
  """`run_python` or the public tests that the sandbox could not run (no execution slot
  in time, no start) end the episode as the infrastructure's failure (dropped, never
  scored): not an output the policy is shown and the episode graded on."""
  from envs.sandbox import ExecResult
  from jaxagent.errors import InfraError

  resources = EnvResources(sandboxes=1)
  try:
    env = make("python_tests", resources)

    async def could_not_run(*args, **kwargs):
      return ExecResult(command=["python3"], exit_code=None, signal=None, duration_s=0.0,
                        timed_out=False, stdout="", stderr="", stdout_bytes=0,
                        stderr_bytes=0, stdout_sha256="", stderr_sha256="",
                        isolation="bwrap", error="no execution slot within 30 s")

    async def go(call):
      await env.reset(TaskSpec("p", "python_tests", {"task": "add"}))
      monkeypatch.setattr(env.sandbox, "run", could_not_run)
      monkeypatch.setattr(env.sandbox, "run_python", could_not_run)
      try:
        return await env.step(call)
      finally:
        await env.close()

    for call in (_call("run_python", code="print(1)"), _call("run_public_tests")):
      with pytest.raises(InfraError, match="no execution slot"):
        asyncio.run(go(call))
  finally:
    resources.close()


def test_guess_number_a_guess_already_ruled_out_keeps_the_range_and_pays_nothing():
  """A guess the feedback had already excluded (below what is still possible, or above)
  leaves the range as it was and rules out nothing: no process reward, never a
  negative one, and the range said is still the one possible."""
  task = TaskSpec("g", "guess_number", {"secret": 11, "process_reward": 1.0,
                                        "feedback": "range"})
  _, steps, verdict = play(make("guess_number"), task, ["8", "3", "16", "20", "11"])
  assert [s.observation.messages[0]["content"] for s in steps] == [
      "Higher: 9-16.", "Higher: 9-16.", "Lower: 9-15.", "Lower: 9-15.", "Correct!"]
  assert [s.reward for s in steps] == pytest.approx([0.5, 0.0, 1 / 8, 0.0, 1.0])
  assert verdict.status == VerdictStatus.PASS and verdict.details["guesses"] == [8, 3, 16, 20, 11]


def test_an_own_task_without_hidden_cases_is_refused_as_it_is_read():
  """A task with no hidden cases can never be graded (the grader calls it an
  infra_error every time: a task dropped sample after sample, never scored): it is
  refused when read, naming what."""
  from envs.python_tests import task_spec

  for tests in ([], None, {}):
    with pytest.raises(ValueError, match=r"tests must be a non-empty list"):
      task_spec(TaskSpec("t", "python_tests", {"prompt": "def f(x): x.", "function": "f",
                                                "tests": tests}))


def test_guess_number_reads_a_guess_as_long_as_the_widest_range_allows():
  """Ranges reach +-(10^18 - 1): a secret of 18 digits is guessed by saying it (a
  guess of 19 digits is refused as too long)."""
  high = 10**18 - 1
  task = TaskSpec("g", "guess_number", {"low": -high, "high": high, "secret": -high})
  _, steps, verdict = play(make("guess_number"), task, [str(high), str(-high)])
  assert [s.observation.messages[0]["content"] for s in steps] == ["Lower.", "Correct!"]
  assert verdict.status == VerdictStatus.PASS
  _, steps, _ = play(make("guess_number"), task, [str(10**18)])
  assert steps[0].observation.messages[0]["content"] == "That number is too long."

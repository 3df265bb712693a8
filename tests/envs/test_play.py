"""`python -m envs.play`: scripted and typed episodes, the exact rewards the learner gets."""

import json
import re
import subprocess
import sys

import pytest

from envs.isolation import available_isolations
from tests.conftest import REPO


def play(*args, stdin=""):
  r = subprocess.run([sys.executable, "-m", "envs.play", *args], cwd=REPO, input=stdin,
                     capture_output=True, text=True, timeout=120)
  return r.returncode, r.stdout, r.stderr


def test_guess_number_from_actions_on_stdin_as_json(tmp_path):
  tasks = tmp_path / "t.jsonl"
  tasks.write_text(json.dumps({"id": "g", "env": "guess_number", "params": {
      "secret": 11, "process_reward": 0.1}}) + "\n")
  code, out, err = play("--task-file", str(tasks), "--actions", "-", "--json",
                        stdin='"8"\n{"action": "12"}\n"11"\n')
  assert code == 0, err
  events = [json.loads(l) for l in out.splitlines()]
  assert events[0]["event"] == "reset" and [e["action"] for e in events[1:4]] == ["8", "12", "11"]
  final = events[-1]
  assert final["verdict"]["status"] == "pass"
  # Process rewards per step, the verdict's 1.0 on the last turn.
  assert final["turn_rewards"] == pytest.approx([0.05, 0.1 * 5 / 8, 0.1 + 1.0])
  assert final["reward"] == pytest.approx(sum(final["turn_rewards"]))


def test_piped_actions_keep_json_output_to_json_lines(tmp_path):
  """Actions piped in without `--actions -` (read as if typed): no `action> ` prompt in
  the output (a new user's finding: `--json` lines began with it)."""
  tasks = tmp_path / "t.jsonl"
  tasks.write_text(json.dumps({"id": "g", "env": "guess_number", "params": {"secret": 11}})
                   + "\n")
  code, out, err = play("--task-file", str(tasks), "--json", stdin="8\n12\n11\n")
  assert code == 0, err
  events = [json.loads(line) for line in out.splitlines()]
  assert [e["action"] for e in events[1:4]] == ["8", "12", "11"]
  assert events[-1]["verdict"]["status"] == "pass"


def test_typed_actions_and_a_readable_report(tmp_path):
  tasks = tmp_path / "t.jsonl"
  tasks.write_text(json.dumps({"id": "c", "env": "calculator",
                               "params": {"expression": "2 + 3"}}) + "\n")
  code, out, _ = play("--task-file", str(tasks), stdin="ANSWER: 4\n")
  assert code == 0 and "verdict fail" in out and "the learner trains on reward 0.0" in out


def test_a_typed_tool_call_can_write_json_escapes_with_raw(tmp_path):
  """Typed, `\\n` is a newline, which JSON refuses inside a string: a tool call writing
  a multi-line file could not be typed (a new user's round). With `--raw` a line is
  taken as typed: its JSON escapes (a newline, a backslash) reach the parser."""
  tasks = tmp_path / "t.jsonl"
  tasks.write_text(json.dumps({"id": "c", "env": "calculator",
                               "params": {"expression": "2 + 3"}}) + "\n")
  call = ('<tool_call>{"name": "calculate", "arguments": {"expression": '
          '"2 +\\n3 \\\\"}}</tool_call>')
  code, out, err = play("--task-file", str(tasks), "--json", "--raw",
                        stdin=call + "\nANSWER: 5\n")
  assert code == 0, err
  step = json.loads(out.splitlines()[1].split("action> ")[-1])  # (the prompt, typed)
  assert step["action"] == call and "malformed" not in out, step
  code, out, err = play("--task-file", str(tasks), "--json", stdin=call + "\nANSWER: 5\n")
  assert code == 0 and "malformed tool call" in out, out  # (without it: a newline)


def test_an_environments_bug_is_one_line_naming_where(tmp_path):
  """A bug in a user's environment (a ValueError in its step, a step that returns the
  wrong type) is one line naming the file and line, not a bare message or play's own
  traceback (a new user's round)."""
  env = tmp_path / "buggy_env.py"
  env.write_text(
      "import json\n"
      "from envs.base import Env, Observation, StepResult, Verdict, VerdictStatus, register\n"
      "@register('buggy_test_env')\n"
      "class Buggy(Env):\n"
      "  async def reset(self, task):\n"
      "    self.kind = task.params['kind']\n"
      "    return Observation([{'role': 'user', 'content': 'say a number'}])\n"
      "  async def step(self, action):\n"
      "    self.begin_turn()\n"
      "    if self.kind == 'wrong_type':\n"
      "      return Observation([])\n"
      "    n = int(action) if self.kind == 'value_error' else json.loads(action)\n"
      "    return StepResult(Observation([]), 0.0, True, False)\n"
      "  async def verify(self):\n"
      "    if self.kind == 'hangs':\n"
      "      import asyncio; await asyncio.sleep(600)\n"
      "    if self.kind == 'infra':\n"
      "      from jaxagent.errors import InfraError; raise InfraError('grader', 'down')\n"
      "    return Verdict(VerdictStatus.PASS, 1.0, '1', '1')\n")
  tasks = tmp_path / "t.jsonl"
  tasks.write_text("".join(json.dumps({"id": k, "env": "buggy_test_env", "params": {"kind": k}})
                           + "\n" for k in ("value_error", "wrong_type", "json", "hangs",
                                            "infra")))
  code, _, err = play("--import", str(env), "--task-file", str(tasks), "--task-id",
                      "value_error", stdin="x\n")
  assert code == 2 and len(err.strip().splitlines()) == 1, err
  assert "buggy_env.py:12: ValueError: invalid literal for int()" in err, err
  code, _, err = play("--import", str(env), "--task-file", str(tasks), "--task-id",
                      "wrong_type", stdin="x\n")
  assert code == 2 and len(err.strip().splitlines()) == 1, err
  assert "buggy_env.py:8: Buggy.step() returned Observation, not a StepResult" in err, err
  # A call of the standard library's that failed: the environment's line, not json's
  code, _, err = play("--import", str(env), "--task-file", str(tasks), "--task-id", "json",
                      stdin="x\n")
  assert code == 2 and "buggy_env.py:12: JSONDecodeError" in err, err
  # A verify that hangs ends past --deadline-s, as a run's call does (it hung for ever),
  # and an InfraError raised is said as a returned infra_error verdict is (a new user).
  code, _, err = play("--import", str(env), "--task-file", str(tasks), "--task-id", "hangs",
                      "--deadline-s", "1", stdin="1\n")
  assert code == 3 and err.strip() == (
      "envs.play: the infrastructure failed: env_call_deadline: the environment's verify ran "
      "past 1 s (--deadline-s; a run's agent.env_call_deadline_s): a tool or grader that "
      "hangs: a run retries or drops this episode; it is never scored"), err
  code, _, err = play("--import", str(env), "--task-file", str(tasks), "--task-id", "infra",
                      stdin="1\n")
  assert code == 3 and err.strip() == (
      f"envs.play: the infrastructure failed: {env}:18: InfraError: grader: down: a run "
      "retries or drops this episode; it is never scored"), err


@pytest.mark.skipif(available_isolations() == ("rlimits",), reason="needs sandbox isolation")
def test_python_tests_reference_and_wrong_solutions(tmp_path):
  def actions(content):
    call = {"name": "write_file", "arguments": {"path": "solution.py", "content": content}}
    return f"{json.dumps(f'<tool_call>{json.dumps(call)}</tool_call>')}\n\"DONE\"\n"

  base = ("--task-file", f"{REPO}/envs/tasks/python_tests.jsonl", "--task-id",
          "python_tests/add", "--actions", "-", "--json")
  _, out, err = play(*base, stdin=actions("def add(a, b):\n    return a + b\n"))
  final = json.loads(out.splitlines()[-1])
  assert final["verdict"]["status"] == "pass" and final["turn_rewards"] == [0.0, 1.0], err
  _, out, _ = play(*base, stdin=actions("def add(a, b):\n    return a - b\n"))
  final = json.loads(out.splitlines()[-1])
  assert final["verdict"]["status"] == "fail" and final["reward"] == 0.0


def test_bad_input_is_a_clear_error(tmp_path):
  code, _, err = play("--task-file", f"{REPO}/envs/tasks/guess_number.jsonl", "--task-id",
                      "guess_number/0-x")
  assert code == 2 and "no task 'guess_number/0-x'" in err and "did you mean" not in err \
      and "(its 256 tasks' ids: guess_number/0-0, " in err, err
  code, _, err = play("--task-file", f"{REPO}/envs/tasks/python_tests.jsonl", "--task-id",
                      "python_tests/ad")
  assert code == 2 and "; did you mean 'python_tests/add'?" in err, err  # (not a list)
  code, _, err = play("--task-file", f"{REPO}/envs/tasks/guess_number.jsonl", "--actions", "-",
                      stdin="8\n")
  assert code == 2 and "actions line 1" in err
  code, _, err = play("--task-file", str(tmp_path / "missing.jsonl"))
  assert code == 2 and "missing.jsonl" in err


def test_a_task_that_cannot_start_is_one_line_in_play_and_a_drop_in_filter(tmp_path, capsys):
  """A task whose parameters its environment refuses (a missing `expression`: a KeyError)
  was a traceback in envs.play and stopped envs.filter with one; filter drops it with its
  reason, and a --out it cannot write is refused before the work (it was after)."""
  from envs import filter as env_filter

  tasks = tmp_path / "tasks.jsonl"
  tasks.write_text('{"id": "z", "env": "calculator", "params": {}}\n'
                   '{"id": "v", "env": "guess_number", "params": {"low": 5, "high": 1}}\n'
                   '{"id": "ok", "env": "guess_number", "params": {"secret": 3}}\n')
  code, _, err = play("--task-file", str(tasks), "--task-id", "z", "--actions", "-",
                      stdin='"8"\n')
  assert code == 2 and "Traceback" not in err, err
  assert re.fullmatch(r"envs.play: task 'z' cannot start: envs/calculator.py:\d+: "
                      r"ValueError: task z: params need 'expression' \(the arithmetic to "
                      r"answer\)\n", err), err
  assert env_filter.main([str(tasks), "--out", str(tmp_path / "kept.jsonl")]) == 0
  out = capsys.readouterr().out
  assert "DROP z: reference -, no-op - -- cannot start: envs/calculator.py:" in out
  assert "DROP v:" in out and "low (5) > high (1)" in out and "1 of 3 tasks kept" in out
  assert (tmp_path / "kept.jsonl").read_text().splitlines() == [
      '{"id": "ok", "env": "guess_number", "params": {"secret": 3}, "version": "1"}']
  assert env_filter.main([str(tasks), "--out", str(tmp_path / "no" / "kept.jsonl")]) == 2
  assert "--out: cannot write in" in capsys.readouterr().err


def test_ctrl_c_at_the_prompt_ends_the_episode_at_once(tmp_path):
  """Typed at a terminal, the first Ctrl-C at `action>` was lost (the blocking read held
  the event loop, whose handler only cancelled the episode) and the second printed
  tracebacks (a new user's walkthrough): the first ends it, in one line, code 130."""
  import os
  import pty
  import select
  import time

  tasks = tmp_path / "t.jsonl"
  tasks.write_text(json.dumps({"id": "c", "env": "calculator",
                               "params": {"expression": "2 + 3"}}) + "\n")
  pid, fd = pty.fork()
  if pid == 0:  # (the child: the terminal's session leader, as a shell's job is)
    os.chdir(REPO)
    os.execv(sys.executable, [sys.executable, "-m", "envs.play", "--task-file", str(tasks)])
  seen, deadline, sent, prompted = b"", time.monotonic() + 60, 0, None
  try:
    while time.monotonic() < deadline and b"interrupted" not in seen:
      if prompted is None and b"action> " in seen:
        prompted = time.monotonic()
      # A second after the prompt (shown just before the read begins: a signal between
      # the two waits for the next key), and once more ten seconds on, under load.
      if prompted is not None and time.monotonic() - prompted > (1, 11, 1e9)[sent]:
        os.write(fd, b"\x03")  # (the terminal makes it SIGINT to its foreground job)
        sent += 1
      if select.select([fd], [], [], 0.5)[0]:
        try:
          chunk = os.read(fd, 4096)
        except OSError:  # (EIO: the child closed the terminal)
          break
        if not chunk:
          break
        seen += chunk
    for _ in range(100):
      done, status = os.waitpid(pid, os.WNOHANG)
      if done:
        break
      time.sleep(0.1)
    else:  # (still waiting at its prompt: the Ctrl-C was lost)
      os.kill(pid, 9)
      _, status = os.waitpid(pid, 0)
  finally:
    os.close(fd)
  text = seen.decode(errors="replace")
  assert sent and os.waitstatus_to_exitcode(status) == 130, text
  assert "interrupted: the episode was not verified" in text and "Traceback" not in text


def test_an_actions_line_that_is_not_json_is_named_with_its_column():
  """(it read "not JSON (Invalid control character at)", the position cut off: a new user)"""
  from envs.play import read_actions

  assert read_actions(['"a"\n', "\n", '{"action": "b"}\n']) == ["a", "b"]
  with pytest.raises(ValueError) as e:
    read_actions(['"a"\n', '{"bad json\n'])
  assert str(e.value) == ("actions line 2: not JSON (Invalid control character at column "
                          "11); write each action as a JSON string")
  with pytest.raises(ValueError, match=r"^actions line 1: not JSON \(Expecting value at "
                                       r"column 1\)"):
    read_actions(["nope\n"])

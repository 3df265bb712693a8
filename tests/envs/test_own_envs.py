"""An environment of a user's own (examples/reverse_word.py) reaches every tier through
`env.imports` / `--import`: played, filtered, served by a worker, trained on; an import
that fails is named with where it failed."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from envs import base
from envs.base import TaskSpec, load_modules
from tests.conftest import REPO

EXAMPLE = "examples/reverse_word.py"
TASKS = "examples/reverse_word.jsonl"


class _StartsOnly(base.Env):
  """A test environment whose episodes never get past the start (its reset's)."""

  async def step(self, action):
    raise AssertionError("not stepped")

  async def verify(self):
    raise AssertionError("not verified")


def test_played_and_filtered_with_import(tmp_path, capsys, monkeypatch):
  from envs import filter as filter_cli
  from envs import play

  monkeypatch.chdir(REPO)
  actions = tmp_path / "actions.jsonl"
  actions.write_text('"god"\n"dog"\n')
  assert play.main(["--import", EXAMPLE, "--task-file", TASKS, "--task-id",
                    "reverse_word/dog", "--actions", str(actions), "--json"]) == 0
  events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  verdict = next(e for e in events if "verdict" in e)
  # The first reply is right: the episode ends there, with the outcome on its turn.
  assert verdict["verdict"]["status"] == "pass" and verdict["turn_rewards"] == [1.0]

  assert filter_cli.main(["--import", EXAMPLE, TASKS, "--concurrency", "2"]) == 0
  assert "12 of 12 tasks kept" in capsys.readouterr().out
  # Imported once however often it is named (its registration would clash otherwise).
  assert load_modules([EXAMPLE, os.path.join(REPO, EXAMPLE)]) == []
  assert "reverse_word" in base.ENVS


def _write(tmp_path, name, text):
  path = tmp_path / name
  path.write_text(text)
  return str(path)


def test_an_import_that_fails_is_named_with_where(tmp_path):
  cases = {
      _write(tmp_path, "syntax.py", "x = (\n"): "syntax.py:1: SyntaxError",
      _write(tmp_path, "taken.py", "from envs.base import Env, register\n\n"
             "@register('calculator')\nclass C(Env):\n  pass\n"):
          "taken.py:3: ValueError: environment 'calculator' is already registered",
      _write(tmp_path, "dep.py", "import not_a_module_anywhere\n"):
          "dep.py:1: ModuleNotFoundError: No module named 'not_a_module_anywhere'",
      _write(tmp_path, "boom.py", "\nraise RuntimeError('boom')\n"): "boom.py:2: RuntimeError: boom",
      str(tmp_path / "missing.py"): "missing.py': no such file",
      "no_such_pkg.envs": "no module named 'no_such_pkg' on the path",
  }
  for entry, said in cases.items():
    with pytest.raises(ValueError) as e:
      load_modules([entry])
    assert said in str(e.value) and str(e.value).startswith(repr(entry)), (entry, e.value)
  with pytest.raises(ValueError, match="a module name or a .py file"):
    load_modules([""])
  # A failed file leaves no half-imported module behind.
  assert not [m for m in sys.modules if m.startswith("jaxagent_envs_boom_")]
  with pytest.raises(KeyError, match="name its module in env.imports"):
    base.make("not_registered_anywhere")


def test_a_worker_serves_it_with_import_and_says_what_is_missing_without(tmp_path):
  from envs.play import play_episode
  from envs.server import RemoteEnv
  from tests.envs.worker_process import start_worker, worker_log

  task = TaskSpec("reverse_word/owl", "reverse_word", {"word": "owl"})
  proc, url, _ = start_worker(tmp_path, "--import", EXAMPLE)
  bare, bare_url, _ = start_worker(tmp_path)
  try:
    replies = ["lwo"]
    result = asyncio.run(play_episode(RemoteEnv(url), task,
                                      lambda turn: replies[turn] if turn < 1 else None))
    assert result["verdict"]["status"] == "pass"
    with pytest.raises(ValueError, match="name its module in env.imports"):
      asyncio.run(RemoteEnv(bare_url).reset(task))
  finally:
    for p in (proc, bare):
      p.send_signal(signal.SIGTERM)
      p.wait(timeout=30)
  assert "environments imported: reverse_word" in worker_log(proc)
  bad = subprocess.run([sys.executable, "-m", "envs.server", "--import", "examples/nope.py"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
  assert bad.returncode == 2
  assert bad.stderr.strip() == ("envs.server: --import 'examples/nope.py': no such file (a "
                                f"relative path, read from the working directory {REPO})")


@pytest.mark.slow
def test_a_run_trains_on_it_and_launch_and_deploy_pass_it_on(tmp_path):
  import argparse

  from jaxagent import config as config_lib
  from jaxagent.launch import plan
  from tests.test_train_cli import SMALL, read_metrics, run_train

  run_dir = str(tmp_path / "run")
  own = [f"env.imports=[{EXAMPLE}]", f"data.tasks={TASKS}", "agent.max_new_tokens=4"]
  proc = run_train("--config", "configs/tiny.yaml", "--run-dir", run_dir, "steps=1",
                   *own, *SMALL)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert read_metrics(run_dir)[-1]["step"] == 1
  with open(os.path.join(run_dir, "config.json")) as f:
    assert json.load(f)["env"]["imports"] == [EXAMPLE]

  proc = run_train("--config", "configs/tiny.yaml", "--run-dir", str(tmp_path / "bad"),
                   "env.imports=[examples/nope.py]")
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == (
      "error: env.imports: 'examples/nope.py': no such file (a relative path, read from "
      f"the working directory {REPO})")

  # The env workers a launch starts, and those it deploys, import the same modules.
  args = argparse.Namespace(config="configs/tiny.yaml", servers=0, env_workers=1,
                            learner_processes=1, resume=False, overrides=own)
  cfg = config_lib.load(config_lib.RunConfig, args.config, own)
  (worker,), _ = plan(args, cfg, str(tmp_path / "launched"))
  assert worker.cmd[worker.cmd.index("--import") + 1] == EXAMPLE
  from tests.test_deploy import generate

  docs, _ = generate(tmp_path, "v5litepod-8", *own)
  env_pod = docs["env-statefulset.yaml"]["spec"]["template"]["spec"]
  cmd = env_pod["containers"][0]["command"]
  assert cmd[cmd.index("--import") + 1] == EXAMPLE


def test_an_environment_whose_tools_are_malformed_is_named_at_the_start(tmp_path):
  """A tool without OpenAI's shape reached the template as it was (white-box) and had
  every black-box turn refused by the gateway: the run's start names the environment."""
  from jaxagent.run_services import task_tools

  @base.register("bad_tools_env")
  class BadTools(_StartsOnly):
    async def reset(self, task):
      return base.Observation([{"role": "user", "content": "go"}],
                              [{"name": "f", "parameters": {}}])  # no type/function

  tasks = tmp_path / "tasks.jsonl"
  tasks.write_text('{"id": "b", "env": "bad_tools_env"}\n')
  with pytest.raises(ValueError, match="environment 'bad_tools_env' offers a tool that is "
                                       "not an OpenAI tools entry"):
    asyncio.run(task_tools(str(tasks), lambda task: base.make(task.env)))


def test_a_reset_that_raises_at_the_start_names_its_task_and_a_task_id_twice_is_refused(
    tmp_path):
  """A reset's own bug at the start (the first task of its environment) was a bare
  traceback from the run's plumbing; two tasks of one id trained without a word (a stopped
  run's logged episodes are replayed by task id). A new user's round."""
  from jaxagent.run_services import task_tools

  @base.register("reset_bug_env")
  class ResetBug(_StartsOnly):
    async def reset(self, task):
      raise RuntimeError("grader database down")

  tasks = tmp_path / "tasks.jsonl"
  tasks.write_text('{"id": "r/0", "env": "reset_bug_env"}\n')
  with pytest.raises(RuntimeError, match=r"task 'r/0' \(reset_bug_env\): the environment's "
                     r"reset raised tests/envs/test_own_envs.py:\d+: RuntimeError: grader "
                     r"database down"):
    asyncio.run(task_tools(str(tasks), lambda task: base.make(task.env)))
  # A parameter of the wrong type is the task's (a ValueError the run names as data.tasks).
  @base.register("reset_type_env")
  class ResetType(ResetBug):
    async def reset(self, task):
      return int(task.params["n"]) + []

  tasks.write_text('{"id": "t/0", "env": "reset_type_env", "params": {"n": 1}}\n')
  with pytest.raises(ValueError, match=r"task 't/0' cannot start: .*TypeError"):
    asyncio.run(task_tools(str(tasks), lambda task: base.make(task.env)))
  # (a value's too: the first task's was a bare "invalid literal for int()")
  tasks.write_text('{"id": "v/0", "env": "guess_number", "params": {"low": "x"}}\n')
  with pytest.raises(ValueError, match=r"task 'v/0' cannot start: envs/guess_number.py:\d+: "
                                       r"ValueError: task v/0: low must be an integer, got 'x'"):
    asyncio.run(task_tools(str(tasks), lambda task: base.make(task.env)))
  tasks.write_text('{"id": "g", "env": "guess_number", "params": {"secret": 3}}\n'
                   '{"id": "g", "env": "guess_number", "params": {"secret": 5}}\n')
  with pytest.raises(ValueError, match=r"tasks.jsonl:2: task id 'g' is line 1's too"):
    asyncio.run(task_tools(str(tasks), lambda task: base.make(task.env)))


def test_an_infra_error_raised_with_a_message_alone_is_counted_under_other():
  """`InfraError("grader service down")` (the docs gave no signature: a new user) made
  each wording a drop counter of its own, named with spaces."""
  from jaxagent.errors import InfraError

  e = InfraError("grader service down")
  assert (e.kind, str(e)) == ("other", "other: grader service down")
  e = InfraError("grader down for task 7", "try later")
  assert (e.kind, str(e)) == ("other", "other: grader down for task 7: try later")
  e = InfraError("grader_db", "connection refused")
  assert (e.kind, str(e)) == ("grader_db", "grader_db: connection refused")
  assert InfraError("x" * 41).kind == "other" and InfraError("env_worker").kind == "env_worker"


def test_the_filter_ends_a_play_by_the_steps_result_and_bounds_one_that_never_ends(
    tmp_path, capsys):
  """An environment written as the docs say (its steps' results end the episode; it sets
  no `done` of its own) hung `envs.filter` for ever, and a user's first command after a
  bad task is that one (a new user). One that never ends is dropped, saying so."""
  from envs import filter as filter_cli

  module = _write(tmp_path, "echo_env.py", """
from envs.base import Env, Observation, StepResult, Verdict, VerdictStatus, register


@register("echo_no_done")
class EchoNoDone(Env):
  async def reset(self, task):
    self.task, self.said = task, ""
    return Observation([{"role": "user", "content": "Say " + task.params["word"]}])

  async def step(self, action):
    self.begin_turn()
    self.said = action
    ends = self.task.params["ends"]
    return StepResult(Observation([]), 0.0, ends and action == self.task.params["word"],
                      ends and self.turns >= 3, self._info())

  async def verify(self):
    ok = self.said == self.task.params["word"]
    return Verdict(VerdictStatus.PASS if ok else VerdictStatus.FAIL, float(ok), "e@1", "e@1")

  def reference_action(self):
    return self.task.params["word"]
""")
  tasks = _write(tmp_path, "echo.jsonl", "".join(
      json.dumps({"id": f"echo/{i}", "env": "echo_no_done",
                  "params": {"word": "hi", "ends": i == 0}}) + "\n" for i in range(2)))
  out = str(tmp_path / "kept.jsonl")
  assert filter_cli.main(["--import", module, tasks, "--out", out]) == 0
  said = capsys.readouterr().out
  assert "1 of 2 tasks kept" in said, said
  assert "a scripted play did not end within 256 turns" in said, said
  with open(out) as f:
    assert [json.loads(line)["id"] for line in f] == ["echo/0"]


def test_a_bad_parameter_of_any_task_is_named_at_the_start(tmp_path):
  """A misspelt parameter was found only when its task was drawn, steps into a run or
  never (a new user): the tasks of environments that need no shared resources are reset
  at the start, within a bound of time, and the first bad one is named."""
  from envs.base import CannotStart
  from jaxagent.run_services import check_task_params

  good = {"low": 1, "high": 16, "max_turns": 5, "secret": 13}
  lines = [{"id": f"g/{i}", "env": "guess_number", "params": dict(good)} for i in range(4)]
  lines[2]["params"]["secrett"] = lines[2]["params"].pop("secret")
  path = _write(tmp_path, "tasks.jsonl", "".join(json.dumps(t) + "\n" for t in lines))
  with pytest.raises(CannotStart, match=r"task 'g/2'.*'secrett'"):
    asyncio.run(check_task_params(path, []))
  assert asyncio.run(check_task_params(path, [TaskSpec.from_dict(lines[2])])) is None
  said = asyncio.run(check_task_params(path, [], limit_s=-1.0))
  assert said.startswith("data.tasks: 0 of 4 tasks' parameters checked in"), said

  class Slow(base.ENVS["guess_number"]):  # (a reset that hangs holds no start for ever)
    async def reset(self, task):
      await asyncio.sleep(60)

  class Opted(base.ENVS["guess_number"]):
    check_at_start = False

  for name, cls in (("slow_reset", Slow), ("opted_out", Opted)):
    base.register(name)(cls)
    try:
      lines[2]["env"] = name
      path = _write(tmp_path, f"{name}.jsonl", "".join(json.dumps(t) + "\n" for t in lines))
      t0 = time.monotonic()
      said = asyncio.run(check_task_params(path, [], limit_s=1.0))
      assert time.monotonic() - t0 < 10 and (said is None) == (name == "opted_out"), said
    finally:
      base.ENVS.pop(name)

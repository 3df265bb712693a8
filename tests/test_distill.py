"""On-policy distillation and reference models: a served model's log-probs of the
student's sampled tokens become per-token advantages (opd) or the KL penalty's reference."""

import json
import os

import numpy as np
import pytest

from jaxagent import advantages as adv
from jaxagent.config import AdvantageConfig
from jaxagent.scheduler import Group, compute_advantages, make_batch
from tests.test_scheduler import episode
from tests.test_train_cli import read_metrics, run_train


def test_distillation_advantage_by_hand():
  teacher = np.array([-0.5, -1.0, -3.0, -0.1], np.float32)
  student = np.array([-1.0, -1.0, -1.0, -2.0], np.float32)
  mask = np.array([1.0, 1.0, 1.0, 0.0], np.float32)
  # coef x (log teacher - log student) on action tokens: 0.5 x (0.5, 0, -2), then 0
  np.testing.assert_allclose(adv.distillation(teacher, student, mask, 0.5),
                             [0.25, 0.0, -1.0, 0.0])


def teacher_scored_groups():
  groups = []
  for g in range(2):
    eps = [episode(g, f"s{g}-{i}", f"g{g}", reward=float(i)) for i in range(2)]
    for e in eps:
      for s in e.segments:  # the teacher finds the sampled tokens likelier than the student
        s.teacher_logp = np.where(s.loss_mask > 0, s.rollout_logp + 0.25, -7.0)
        s.teacher_logp = s.teacher_logp.astype(np.float32)
    groups.append(Group(g, None, eps))
  return groups


def test_opd_alone_and_mixed_with_the_task_advantage():
  groups = teacher_scored_groups()
  compute_advantages(groups, AdvantageConfig(estimator="opd", teacher="t", opd_coef=2.0))
  for s in (s for g in groups for e in g.episodes for s in e.segments):
    np.testing.assert_allclose(s.advantages, np.where(s.loss_mask > 0, 0.5, 0.0))
  groups = teacher_scored_groups()
  compute_advantages(groups, AdvantageConfig(estimator="grpo", scale_by_std=False,
                                             teacher="t", opd_coef=1.0))
  firsts = [e.segments[0].advantages[e.segments[0].loss_mask > 0][0]
            for g in groups for e in g.episodes]
  assert firsts == pytest.approx([-0.25, 0.75, -0.25, 0.75])  # GRPO's -0.5 / +0.5, + 0.25
  with pytest.raises(ValueError, match="no teacher log-probs"):
    bare = [Group(0, None, [episode(0, "s0-0", "g0", reward=1.0)])]
    compute_advantages(bare, AdvantageConfig(teacher="t"))
  with pytest.raises(ValueError, match="advantage.teacher"):
    compute_advantages(teacher_scored_groups(), AdvantageConfig(estimator="opd"))
  # A teacher's -inf on an action token (another vocabulary, a broken scorer) is named
  # here, not as the learner's non-finite update blaming its learning rate (a reviewer);
  # off the action tokens it trains nothing and is let be.
  groups = teacher_scored_groups()
  s = groups[0].episodes[0].segments[0]
  s.teacher_logp = np.where(s.loss_mask > 0, s.teacher_logp, -np.inf).astype(np.float32)
  compute_advantages(groups, AdvantageConfig(estimator="opd", teacher="t"))
  s.teacher_logp[np.argmax(s.loss_mask > 0)] = -np.inf
  with pytest.raises(ValueError, match="the teacher 't' scored token .* must be finite"):
    compute_advantages(groups, AdvantageConfig(estimator="opd", teacher="t"))


def test_served_reference_log_probs_reach_the_batch():
  groups = teacher_scored_groups()
  for s in (s for g in groups for e in g.episodes for s in e.segments):
    s.ref_logp = s.teacher_logp
  batch, _ = make_batch(groups, AdvantageConfig(), rows=4, seq_len=32, pad_id=0)
  m = batch.loss_mask > 0
  np.testing.assert_allclose(batch.ref_logp[m], batch.rollout_logp[m] + 0.25, atol=1e-6)


def make_teacher(root):
  """A sharper random model of the default job's shape: its final norm scaled up."""
  from jaxagent.checkpoint import export_policy
  from jaxagent.models import preset
  from jaxagent.models.params import init_params

  params = {k: np.asarray(v) for k, v in init_params(preset("nano"), 1).items()}
  params["final_norm"] = params["final_norm"] * 8
  return export_policy(root, 0, params, dtype=None)


@pytest.mark.slow
def test_a_short_distillation_run_pulls_the_student_to_its_teacher(tmp_path):
  """The default job with a served teacher and no task reward: the student's sampled
  reverse KL to the teacher falls; the same served model is also the KL reference."""
  teacher = make_teacher(str(tmp_path / "teacher"))
  run_dir = str(tmp_path / "run")
  served = "serving.models.teacher"
  proc = run_train(
      "--config", "configs/tiny.yaml", "--run-dir", run_dir, "steps=12",
      "advantage.estimator=opd", "advantage.teacher=teacher", f"{served}.policy={teacher}",
      f"{served}.model.preset=nano", f"{served}.engine.max_seq_len=256",
      f"{served}.engine.max_prefill_length=256", "learner.kl_coef=0.001",
      "learner.kl_reference=teacher", "learner.entropy_coef=0", "learner.lr=3e-2",
      "learner.lr_schedule=constant", "learner.correction_mode=none",
      "checkpoint.every_steps=100", "trajectories.mode=none")
  assert proc.returncode == 0, proc.stderr[-3000:]
  kl = [r["opd_reverse_kl"] for r in read_metrics(run_dir)]
  assert len(kl) == 12 and "kl_ref" in read_metrics(run_dir)[-1]
  assert np.mean(kl[-3:]) < 0.5 * np.mean(kl[:3]), kl
  with open(os.path.join(run_dir, "config.json")) as f:
    assert json.load(f)["serving"]["models"]["teacher"]["policy"] == teacher


def test_unknown_served_models_are_named(tmp_path):
  proc = run_train("--config", "configs/tiny.yaml", "--run-dir", str(tmp_path / "r"),
                   "advantage.teacher=teach", "serving.models.teacher.model.preset=nano")
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert "advantage.teacher: no served model 'teach'" in proc.stderr


def test_a_scorers_log_probs_that_are_not_finite_are_named():
  """A reference's -inf went into the KL penalty: the update was not finite, and the run
  stopped naming its learning rate (a reviewer). Only trained tokens must be finite."""
  import asyncio
  import types

  from jaxagent.run_services import score_segments
  from jaxagent.trajectory import Segment

  def segment(mask):
    n = len(mask)
    return Segment(np.arange(n), np.asarray(mask, np.float32), np.zeros(n, np.float32),
                   np.zeros(n, np.int32), np.zeros(n, np.int32), "s", "r", "seg-1")

  class Scorer:
    async def score(self, model, sequences, temperature):
      return [[-np.inf, -1.0, -2.0] for _ in sequences]

  def scored(mask):
    groups = [types.SimpleNamespace(episodes=[types.SimpleNamespace(
        segments=[segment(mask)])])]
    asyncio.run(score_segments(Scorer(), groups, {"ref_logp": ("learner.kl_reference",
                                                               "ref")}, 1.0))
    return groups[0].episodes[0].segments[0].ref_logp

  assert scored([0, 1, 1])[1:].tolist() == [-1.0, -2.0]  # (the prompt's first: untrained)
  with pytest.raises(ValueError, match=r"learner\.kl_reference 'ref' scored token 0 of "
                                       r"segment seg-1 -inf: its log-probs must be finite"):
    scored([1, 1, 1])

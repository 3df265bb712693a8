import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent.batch import pack
from jaxagent.config import LearnerConfig
from jaxagent.learner import (Learner, accumulate_gradients, make_optimizer,
                              microbatch_objective, old_logps, token_logps)
from jaxagent.models import preset
from jaxagent.models.params import bind, init_params
from jaxagent.models.sharding import make_mesh

CFG = preset("tiny", n_layers=2)


def make_batch(seed=0, rows=4, seq_len=64, n=10, ref=False):
  rng = np.random.default_rng(seed)
  segs = []
  for i in range(n):
    length = int(rng.integers(8, 30))
    mask = (rng.random(length) < 0.7).astype(np.float32)
    mask[:3] = 0
    seg = dict(tokens=rng.integers(0, 260, length), loss_mask=mask,
               rollout_logp=(-rng.random(length) * 6 * mask).astype(np.float32),
               advantages=(rng.normal(size=length) * mask).astype(np.float32),
               rollout_id=i % 3)  # rollouts spread over rows and microbatches
    if ref:
      seg["ref_logp"] = (-rng.random(length) * 6).astype(np.float32)
    segs.append(seg)
  batch, placed = pack(segs, rows, seq_len)
  assert (placed >= 0).all()
  return batch


@pytest.mark.parametrize("reduction", [  # (the other reductions' in the end-to-end tier)
    "token_mean", pytest.param("seq_mean_token_mean", marks=pytest.mark.slow),
    pytest.param("per_rollout", marks=pytest.mark.slow)])
def test_microbatched_gradient_equals_full_batch_gradient(reduction):
  cfg = LearnerConfig(reduction=reduction, correction_mode="mask", policy_loss="ppo")
  learner = Learner(CFG, cfg, make_mesh())
  params = init_params(CFG, 0)
  batch = jax.tree.map(jnp.asarray, make_batch())

  def objective(p, mb):
    return microbatch_objective(bind(learner.graphdef, learner.abstract_params, p), mb, cfg)

  # Reference: differentiate the full-batch mean directly.
  def full_mean(p):
    s, (d, _) = objective(p, batch)
    return s / d

  want = jax.jit(jax.grad(full_mean))(params)  # jitted: 1.3 s, not 6.6 s eager
  for n in (1, 2, 4):
    grads, total, denom, _ = jax.jit(functools.partial(
        accumulate_gradients, objective=objective, microbatches=n))(params, batch)
    got = jax.tree.map(lambda g: g / denom, grads)
    for name in want:
      np.testing.assert_allclose(got[name], want[name], atol=2e-7, rtol=2e-5,
                                 err_msg=f"{name} microbatches={n}")


@pytest.mark.parametrize("mode", ["mask", "decay"])
def test_staleness_weighting_equals_training_on_the_reweighted_batch(mode):
  """Masking stale tokens is their loss mask at 0; decay is their advantage scaled."""
  cfg = LearnerConfig(staleness=mode, max_token_staleness=1, staleness_decay=0.5)
  learner = Learner(CFG, cfg, make_mesh())
  params = init_params(CFG, 0)
  batch = make_batch()
  rng = np.random.default_rng(1)
  versions = np.where(batch.loss_mask > 0, rng.integers(7, 11, batch.loss_mask.shape), -1)
  stale = 10 - versions
  if mode == "mask":
    want_batch = batch._replace(loss_mask=batch.loss_mask * ((stale <= 1) | (versions < 0)))
  else:
    want_batch = batch._replace(advantages=batch.advantages * np.where(
        versions >= 0, 0.5 ** stale, 1.0).astype(np.float32))

  def grad(b, c, version):
    def mean(p):
      s, (d, _) = microbatch_objective(bind(learner.graphdef, learner.abstract_params, p),
                                       jax.tree.map(jnp.asarray, b), c, version)
      return s / d
    return jax.jit(jax.grad(mean))(params)

  got = grad(batch._replace(versions=versions.astype(np.int32)), cfg, jnp.int32(10))
  want = grad(want_batch, LearnerConfig(), None)
  for name in want:
    np.testing.assert_allclose(got[name], want[name], atol=1e-7, rtol=1e-5, err_msg=name)
  # The whole step: stale tokens counted in the metrics.
  state = learner.init_state(0).replace(policy_version=jnp.int32(5))
  _, m = learner.step(state, batch._replace(
      versions=np.where(batch.loss_mask > 0, 0, -1).astype(np.int32)))  # all 5 behind
  assert float(m["stale_masked_frac"]) == (1.0 if mode == "mask" else 0.0)
  assert float(m["stale_scale_mean"]) == (1.0 if mode == "mask" else 0.5 ** 5)


def test_the_learner_scores_its_frozen_reference_for_the_kl_penalty():
  cfg = LearnerConfig(lr=1e-2, kl_coef=0.1)
  learner = Learner(CFG, cfg, make_mesh())
  state = learner.init_state(0)
  ref = jax.tree.map(jnp.copy, state.params)  # the initial weights, kept frozen
  batch = make_batch()
  state, m = learner.step(state, batch, ref)
  assert abs(float(m["kl_ref"])) < 1e-6  # the policy is still the reference
  for _ in range(3):
    state, m = learner.step(state, batch, ref)
  assert float(m["kl_ref"]) > 1e-4  # it moved away; k3 is non-negative
  state, m = learner.step(state, batch)  # no reference: no KL term
  assert "kl_ref" not in m
  # A batch that brings its reference log-probs keeps them, reference params or not
  # (they were scored again from the params: red team 61's mutation).
  given = make_batch(ref=True)
  _, with_params = learner.step(learner.init_state(0), given, ref)
  _, without = learner.step(learner.init_state(0), given)
  assert float(with_params["kl_ref"]) > 0.1  # (random log-probs: far from the policy)
  assert float(with_params["kl_ref"]) == pytest.approx(float(without["kl_ref"]), rel=1e-5)


def test_step_metrics_and_learning():
  cfg = LearnerConfig(lr=1e-2, correction_mode="mask", kl_coef=0.01, entropy_coef=0.001)
  learner = Learner(CFG, cfg, make_mesh())
  state = learner.init_state(0)
  batch = make_batch(ref=True)
  first = None
  for _ in range(5):
    state, m = learner.step(state, batch)
    first = first or {k: float(v) for k, v in m.items()}
  for key in ("loss", "pg_loss", "kl_ref", "entropy", "clip_frac", "is_masked_frac",
              "grad_norm", "tokens", "lr"):
    assert key in m and np.isfinite(float(m[key])), key
  assert int(state.step) == 5 and int(state.policy_version) == 5
  assert float(m["tokens"]) == batch.loss_mask.sum()
  assert float(m["loss"]) < first["loss"]  # the same batch: the objective goes down


def test_ppo_epochs_equal_updates_against_the_pre_update_policy():
  """epochs=2 is one version bump made of two updates whose ratios use the old policy."""
  base = dict(lr=1e-2, correction_mode="truncate", clip_low=0.05, clip_high=0.05)
  batch = make_batch()
  two = Learner(CFG, LearnerConfig(epochs=2, microbatches=2, **base), make_mesh())
  state, m = two.step(two.init_state(0), batch)
  assert int(state.policy_version) == 1 and int(state.step) == 1
  assert float(m["clip_frac"]) > 0 and "loss_first" in m  # the 2nd update saw moved ratios

  one = Learner(CFG, LearnerConfig(epochs=1, microbatches=2, **base), make_mesh())
  ref = one.init_state(0)
  old = jax.jit(functools.partial(
      old_logps, graphdef=one.graphdef,
      abstract_state=one.abstract_params, cfg=one.cfg))(ref.params, jax.tree.map(jnp.asarray,
                                                                              batch))
  whole = jax.jit(functools.partial(
      old_logps, graphdef=one.graphdef,
      abstract_state=one.abstract_params, cfg=LearnerConfig()))(ref.params,
                                                               jax.tree.map(jnp.asarray, batch))
  np.testing.assert_allclose(old, whole, atol=1e-5)  # microbatched = whole batch
  fixed = batch._replace(old_logp=np.asarray(old))
  logged = []
  for _ in range(2):
    ref, m_one = one.step(ref, fixed)
    logged.append(float(m_one["loss"]))
  # loss_first is the first update's loss, loss the last's (loss_first taken from the
  # last update passed: red team 61's mutation)
  assert logged[0] != pytest.approx(logged[1], abs=1e-4)
  assert (float(m["loss_first"]), float(m["loss"])) == pytest.approx(logged, rel=1e-4,
                                                                     abs=1e-6)
  for name in ref.params:
    np.testing.assert_allclose(state.params[name], ref.params[name], atol=1e-5, err_msg=name)


def test_learning_rate_schedules():
  _, cos = make_optimizer(LearnerConfig(lr=1.0, lr_schedule="cosine", lr_decay_steps=100,
                                        warmup_steps=10, lr_end_factor=0.1))
  # Updates count from 0: the 100th (index 99) is at the floor (it stopped short of it).
  assert [float(cos(i)) for i in (0, 10, 99, 500)] == pytest.approx([0.0, 1.0, 0.1, 0.1])
  assert 0.1 < float(cos(55)) < 1.0 and float(cos(98)) > 0.1
  # With epochs the floor is the last update of lr_decay_steps x epochs (not of lr_decay_steps).
  _, cos2 = make_optimizer(LearnerConfig(lr=1.0, lr_schedule="cosine", lr_decay_steps=10,
                                         epochs=2, lr_end_factor=0.1))
  assert float(cos2(9)) > 0.5 and float(cos2(19)) == pytest.approx(0.1)
  _, const = make_optimizer(LearnerConfig(lr=0.5))
  assert float(const(0)) == float(const(10_000)) == 0.5


def test_the_logged_rate_is_the_steps_first_updates_with_epochs():
  """With epochs > 1 the optimiser counts updates, epochs a step: the rate logged was the
  schedule at the step's count, updates behind the one applied (an advanced user's
  finding: 0.0, 7.5e-4, 1.5e-3 logged where the steps' first updates ran at 0.0, 1.5e-3,
  1.5e-3)."""
  cfg = LearnerConfig(lr=1.0, epochs=2, warmup_steps=4, optimizer="sgd")
  learner = Learner(CFG, cfg, make_mesh())
  state, batch = learner.init_state(0), make_batch(rows=4)
  logged = []
  for _ in range(3):
    state, out = learner.step(state, batch)
    logged.append(float(out["lr"]))
  assert logged == pytest.approx([0.0, 0.5, 1.0])  # updates 0, 2, 4 of a 4-update warm-up


def test_each_loss_clips_at_its_own_range_unless_told():
  """GSPO's sequence ratios sit near 1: it ran with PPO's 0.2 / 0.28 (an advanced user's
  finding), some 500 times its own range."""
  from jaxagent.learner import clip_range

  assert clip_range(LearnerConfig()) == (0.2, 0.28)
  assert clip_range(LearnerConfig(policy_loss="gspo")) == (3e-4, 4e-4)
  assert clip_range(LearnerConfig(policy_loss="gspo", clip_high=1e-3)) == (3e-4, 1e-3)


def test_bad_settings_name_their_key():
  with pytest.raises(ValueError, match="learner.policy_loss"):
    Learner(CFG, LearnerConfig(policy_loss="ppo2"), make_mesh())
  with pytest.raises(ValueError, match="learner.reduction"):
    Learner(CFG, LearnerConfig(reduction="mean"), make_mesh())
  with pytest.raises(ValueError, match="learner.lr_schedule"):
    Learner(CFG, LearnerConfig(lr_schedule="step"), make_mesh())
  with pytest.raises(ValueError, match="learner.staleness"):
    Learner(CFG, LearnerConfig(staleness="drop"), make_mesh())
  with pytest.raises(ValueError, match="learner.epochs"):
    Learner(CFG, LearnerConfig(epochs=0), make_mesh())
  with pytest.raises(ValueError, match="learner.microbatches"):
    Learner(CFG, LearnerConfig(microbatches=0), make_mesh())
  with pytest.raises(ValueError, match="learner.dual_clip is PPO's"):
    Learner(CFG, LearnerConfig(policy_loss="gspo", dual_clip=3.0), make_mesh())
  learner = Learner(CFG, LearnerConfig(microbatches=3), make_mesh())
  with pytest.raises(ValueError, match="microbatches"):
    learner.step(learner.init_state(0), make_batch(rows=4))


@pytest.mark.parametrize("policy", ["gspo", "reinforce"])
def test_other_policy_losses_run(policy):
  cfg = LearnerConfig(policy_loss=policy, reduction="seq_mean_token_mean",
                      correction_mode="truncate", correction_level="geometric", microbatches=2)
  learner = Learner(CFG, cfg, make_mesh())
  state, m = learner.step(learner.init_state(0), make_batch())
  assert np.isfinite(float(m["loss"])) and float(m["grad_norm"]) > 0


def test_one_device_equals_eight_devices(multidevice):
  out = multidevice("""
    import jax, numpy as np
    from jax.sharding import PartitionSpec as P
    from jaxagent.config import LearnerConfig
    from jaxagent.learner import Learner
    from jaxagent.models.params import init_params
    from jaxagent.models.sharding import make_mesh
    from tests.test_learner import CFG, make_batch
    assert len(jax.devices()) == 8
    cfg = LearnerConfig(microbatches=2, reduction="per_rollout", correction_mode="mask")
    batch = make_batch(rows=8, n=16)
    params = jax.device_get(init_params(CFG, 0))
    results = []
    for mesh in (make_mesh(1, 1, 1, devices=jax.devices()[:1]), make_mesh(2, 2, 2)):
      learner = Learner(CFG, cfg, mesh)
      state = learner.init_state(0, params)
      for _ in range(2):
        state, m = learner.step(state, batch)
      results.append((jax.device_get(state.params), {k: float(v) for k, v in m.items()}))
      if mesh.size == 8:
        assert state.params["wq"].sharding.spec == P(None, "fsdp", "tensor", None)
        assert state.params["embed"].sharding.spec == P("tensor", "fsdp")
        assert len(state.params["wq"].sharding.device_set) == 8
    (p1, m1), (p8, m8) = results
    # Not bitwise: all-reduces sum in another order. Adam's first steps move each
    # weight by about lr = 1e-3, so agreement to 1e-4 rules out any real difference.
    worst = max(float(np.abs(p1[k] - p8[k]).max()) for k in p1)
    assert worst < 1e-4, worst
    for k in m1:
      assert abs(m1[k] - m8[k]) <= 1e-4 * max(1.0, abs(m1[k])), (k, m1[k], m8[k])
    print("OK", worst)
  """)
  assert out.startswith("OK")


def test_a_batch_with_nothing_to_train_leaves_weights_and_optimiser_as_they_were():
  """Every token dropped (here: no action token at all; in a run, all stale or masked by
  the correction): Adam's momentum and the weight decay moved the weights anyway, and
  its step count went on (red team 19). The policy version still advances."""
  learner = Learner(CFG, LearnerConfig(lr=1e-2, weight_decay=0.1, warmup_steps=4),
                    make_mesh())
  state = learner.init_state(0)
  state, _ = learner.step(state, make_batch())  # (momentum to move the weights with)
  before = jax.device_get((state.params, state.opt_state))
  empty = make_batch()
  empty = empty._replace(loss_mask=np.zeros_like(empty.loss_mask))
  state, m = learner.step(state, empty)
  assert float(m["denom"]) == 0 and int(state.policy_version) == 2
  # (its logged loss and gradient norm are 0, not 0 x 1/0 = nan)
  assert float(m["loss"]) == 0.0 and float(m["grad_norm"]) == 0.0
  after = jax.device_get((state.params, state.opt_state))
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(a, b)
  # The logged rate is the one the next update applies: the schedule counts updates made.
  state, m_next = learner.step(state, make_batch())
  assert float(m_next["lr"]) == float(m["lr"]) == pytest.approx(1e-2 / 4)
  # per_rollout counts its denominator on the batch's own mask: with every token dropped
  # as stale it was > 0, and the optimiser stepped on zero gradients (a reviewer).
  learner = Learner(CFG, LearnerConfig(lr=1e-2, weight_decay=0.1, reduction="per_rollout",
                                       staleness="mask", max_token_staleness=0), make_mesh())
  state, _ = learner.step(learner.init_state(0), make_batch())
  before = jax.device_get((state.params, state.opt_state))
  batch = make_batch()
  state, m = learner.step(state, batch._replace(  # (all one version behind: all dropped)
      versions=np.where(batch.loss_mask > 0, 0, -1).astype(np.int32)))
  assert float(m["stale_masked_frac"]) == 1.0 and float(m["grad_norm"]) == 0.0
  after = jax.device_get((state.params, state.opt_state))
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(a, b)


def test_entropy_and_kl_are_token_means_under_every_reduction():
  """Dr. GRPO's reduction (sum / norm_len) made the logged entropy and KL other numbers
  than their means over the trained tokens (red team 19)."""
  batch = make_batch(ref=True)
  got = {}
  for reduction in ("token_mean", "seq_mean_token_sum_norm", "per_rollout"):
    learner = Learner(CFG, LearnerConfig(reduction=reduction, kl_coef=0.01), make_mesh())
    _, m = learner.step(learner.init_state(0), batch)
    got[reduction] = (float(m["entropy"]), float(m["kl_ref"]))
  for reduction, values in got.items():
    np.testing.assert_allclose(values, got["token_mean"], rtol=1e-5, err_msg=reduction)


def test_values_of_tokens_out_of_the_loss_never_reach_the_gradient():
  """An inf or nan on a token out of the loss (a prompt token's reference or old
  log-prob of -inf, a nan advantage) gives the same update as a finite one: masked by a
  where, it still reached the gradient (0 x nan) and made every weight nan (a reviewer of
  red team 19)."""
  clean = make_batch(ref=True)
  clean = clean._replace(old_logp=np.where(clean.loss_mask > 0, clean.rollout_logp,
                                           0.0).astype(np.float32))
  out = np.argwhere((clean.loss_mask == 0) & (clean.segment_ids > 0))
  r, t = out[out[:, 1] > 0][0]
  bad = {}
  for name, value in (("ref_logp", -np.inf), ("old_logp", -np.inf), ("advantages", np.nan)):
    arr = np.array(getattr(clean, name))
    arr[r, t] = value
    bad[name] = arr
  cfg = LearnerConfig(kl_coef=0.01, correction_mode="truncate")
  norms = []
  for batch in (clean, clean._replace(**bad)):
    learner = Learner(CFG, cfg, make_mesh())
    _, m = learner.step(learner.init_state(0), batch)
    norms.append(float(m["grad_norm"]))
  assert np.isfinite(norms[1]) and norms[1] == pytest.approx(norms[0], rel=1e-6), norms


def test_the_objective_adds_each_term_with_its_sign_over_the_tokens_it_trains():
  """Against the objective without them: the entropy bonus is subtracted (a coefficient
  raises the policy's entropy) and the KL penalty added, each summed over the tokens the
  loss trains once stale tokens are masked, not the batch's whole loss mask; Dr. GRPO's
  norm_len is the row length unless set. (A flipped bonus, a KL over dropped tokens and
  a norm_len of 1 each passed every learner test: red team 37's mutations.)"""
  learner_cfg = dict(staleness="mask", max_token_staleness=1)
  batch = make_batch(ref=True)
  rng = np.random.default_rng(2)
  versions = np.where(batch.loss_mask > 0, rng.integers(7, 11, batch.loss_mask.shape), -1)
  batch = jax.tree.map(jnp.asarray, batch._replace(versions=versions.astype(np.int32)))
  trained = batch.loss_mask * ((10 - versions <= 1) | (versions < 0))
  assert 0 < float(trained.sum()) < float(batch.loss_mask.sum())  # (some tokens dropped)
  learner = Learner(CFG, LearnerConfig(), make_mesh())
  model = bind(learner.graphdef, learner.abstract_params, init_params(CFG, 0))

  def objective(**kw):
    total, (denom, m) = microbatch_objective(model, batch, LearnerConfig(**learner_cfg, **kw),
                                             jnp.int32(10))
    return float(total), float(denom), m

  base, denom, m = objective()
  entropy_sum, kl_sum = float(m["entropy"][0]), float(m["kl_ref"][0])
  assert float(m["entropy"][1]) == float(trained.sum())  # (the trained tokens' mean)
  got, _, _ = objective(entropy_coef=0.1)
  assert got == pytest.approx(base - 0.1 * entropy_sum, rel=1e-5, abs=1e-5)
  got, _, _ = objective(kl_coef=0.1, kl_estimator="k3")
  assert got == pytest.approx(base + 0.1 * kl_sum, rel=1e-5, abs=1e-5)
  # Dr. GRPO: sum / norm_len, the row length (64) by default
  row, denom_row, _ = objective(reduction="seq_mean_token_sum_norm")
  set64, denom_64, _ = objective(reduction="seq_mean_token_sum_norm", norm_len=64)
  assert (row, denom_row) == pytest.approx((set64, denom_64), rel=1e-6)
  set1, denom_1, _ = objective(reduction="seq_mean_token_sum_norm", norm_len=1)
  assert set1 / denom_1 == pytest.approx(64 * row / denom_row, rel=1e-5)


@pytest.mark.parametrize("decreasing", [False, True])
def test_packing_places_each_segment_whole_by_first_fit(decreasing):
  """Each segment lands whole where first fit puts it (a row it fills exactly too; one
  that does not fit is left out and later ones still placed), every field as it was,
  positions from 0 in each segment, versions -1 off the loss, the rollout weights 1 /
  its action tokens over all its segments, nothing elsewhere; old_logp only when given.
  (Tests by mutation: 17 of 19 planted packing bugs passed the tests that packed.)"""
  from jaxagent.batch import take_rows

  rng = np.random.default_rng(0)
  rows, seq_len = 4, 16
  lengths = [16, 5, 9, 7, 16, 3, 11, 6, 12, 4, 2]
  segs = []
  for i, n in enumerate(lengths):
    mask = (rng.random(n) < 0.6).astype(np.float32)
    mask[0] = 0.0
    segs.append(dict(tokens=rng.integers(1, 100, n), loss_mask=mask,
                     rollout_logp=rng.normal(size=n).astype(np.float32),
                     advantages=rng.normal(size=n).astype(np.float32),
                     versions=rng.integers(0, 5, n), rollout_id=f"r{i // 2}"))
  batch, placed = pack(segs, rows, seq_len, decreasing=decreasing)
  fill, expect, start = [0] * rows, [-1] * len(segs), {}
  for i in (sorted(range(len(segs)), key=lambda i: -lengths[i]) if decreasing
            else range(len(segs))):
    for r in range(rows):
      if fill[r] + lengths[i] <= seq_len:
        expect[i], start[i] = r, fill[r]
        fill[r] += lengths[i]
        break
  assert placed.tolist() == expect and -1 in expect
  used = np.zeros((rows, seq_len), bool)
  for i, seg in enumerate(segs):
    if expect[i] < 0:
      continue
    r, sl = expect[i], slice(start[i], start[i] + lengths[i])
    used[r, sl] = True
    for name in ("tokens", "loss_mask", "rollout_logp", "advantages"):
      np.testing.assert_array_equal(getattr(batch, name)[r, sl], seg[name], err_msg=name)
    np.testing.assert_array_equal(batch.positions[r, sl], np.arange(lengths[i]))
    np.testing.assert_array_equal(batch.versions[r, sl],
                                  np.where(seg["loss_mask"] > 0, seg["versions"], -1))
    ids = batch.segment_ids[r, sl]
    assert len(set(ids.tolist())) == 1 and ids[0] > 0
    assert (batch.segment_ids[r][~used[r]] != ids[0]).all() or used[r].all()
  for name in ("tokens", "positions", "segment_ids", "loss_mask", "rollout_logp",
               "advantages", "rollout_weight"):  # (nothing elsewhere)
    assert not getattr(batch, name)[~used].any(), name
  assert (batch.versions[~used] == -1).all()
  for r in range(rows):  # segment ids 1, 2, ... in the order placed in the row
    mine = sorted((start[i], i) for i in range(len(segs)) if expect[i] == r)
    assert [int(batch.segment_ids[r, s]) for s, _ in mine] == list(range(1, len(mine) + 1))
  for rid in {s["rollout_id"] for s, r in zip(segs, expect) if r >= 0}:  # weights
    mine = [(i, s) for i, s in enumerate(segs) if s["rollout_id"] == rid and expect[i] >= 0]
    tokens = sum(s["loss_mask"].sum() for _, s in mine)
    for i, s in mine:
      w = batch.rollout_weight[expect[i], start[i]:start[i] + lengths[i]]
      np.testing.assert_allclose(w, s["loss_mask"] / max(tokens, 1.0), rtol=1e-6)
  assert batch.old_logp is None and batch.ref_logp is None  # (not given: no zeros)
  given = [dict(s, old_logp=s["rollout_logp"] - 1.0) for s in segs]
  batch, _ = pack(given, rows, seq_len, decreasing=decreasing, with_ref=True)
  np.testing.assert_array_equal(batch.old_logp[used], batch.rollout_logp[used] - 1.0)
  assert batch.ref_logp is not None and not batch.ref_logp.any()
  assert all(x is None or x.shape[0] == 2 for x in take_rows(batch, 2))


def test_pack_refuses_a_segment_it_cannot_train_as_given():
  """A segment whose first token is in the loss (no position of it predicts that token:
  packed, its log-prob came from the row's previous segment and its gradient went there)
  and a NaN behaviour log-prob on a trained token (a nan update, blamed on the learning
  rate) are named at packing (red team 37)."""
  seg = dict(tokens=np.arange(6), loss_mask=np.array([0, 0, 1, 1, 0, 1], np.float32),
             rollout_logp=np.full(6, -1.0, np.float32), advantages=np.ones(6, np.float32),
             rollout_id=0)
  pack([seg], 1, 8)
  with pytest.raises(ValueError, match="segment 1's first token is in the loss"):
    pack([seg, dict(seg, loss_mask=np.ones(6, np.float32))], 1, 16)
  nan = np.array(seg["rollout_logp"])
  nan[3] = np.nan
  with pytest.raises(ValueError, match="segment 0 has a behaviour log-prob that is NaN"):
    pack([dict(seg, rollout_logp=nan)], 1, 8)
  nan[:] = -1.0
  nan[0] = np.nan  # (on a prompt token: never read)
  pack([dict(seg, rollout_logp=nan)], 1, 8)


def test_an_sgd_step_over_microbatches_moves_the_weights_by_lr_times_the_full_batch_mean_gradient():
  """The step's own scaling, end to end: with plain SGD the update is -lr x the gradient
  of the full batch's sum / denominator whatever the microbatches (a gradient also divided
  by their number passed every learner test, Adam being blind to a constant scale), and
  the logged loss and grad_norm are that mean and its gradient's norm (a loss left as the
  sum, a norm of the undivided gradient passed too: red team 61's mutations). Clipping
  then caps the update's norm at lr x max_grad_norm."""
  lr = 0.5
  batch = jax.tree.map(jnp.asarray, make_batch())
  params0 = jax.device_get(init_params(CFG, 0))
  cfg = LearnerConfig(optimizer="sgd", lr=lr, microbatches=2, max_grad_norm=1e6)
  learner = Learner(CFG, cfg, make_mesh())

  def full_mean(p):
    s, (d, _) = microbatch_objective(bind(learner.graphdef, learner.abstract_params, p),
                                     batch, cfg)
    return s / d

  loss, want = jax.jit(jax.value_and_grad(full_mean))(params0)
  norm = float(np.sqrt(sum(float(jnp.sum(jnp.square(g))) for g in want.values())))
  state, m = learner.step(learner.init_state(0, params0), batch)
  assert float(m["denom"]) == float(batch.loss_mask.sum())  # (token_mean)
  assert float(m["loss"]) == pytest.approx(float(loss), rel=1e-5)
  assert float(m["grad_norm"]) == pytest.approx(norm, rel=1e-4)
  for name in want:
    np.testing.assert_allclose(state.params[name] - params0[name], -lr * want[name],
                               atol=1e-6, rtol=1e-4, err_msg=name)
  # (the step's optimizer clips: its update of that gradient is a quarter of it)
  tx, _ = make_optimizer(LearnerConfig(optimizer="sgd", lr=lr, max_grad_norm=norm / 4))
  update, _ = tx.update(want, tx.init(params0), params0)
  for name in want:
    np.testing.assert_allclose(update[name], -lr * want[name] / 4, atol=1e-6, rtol=1e-4,
                               err_msg=name)


@pytest.mark.parametrize("policy", ["ppo", "gspo", "reinforce"])
def test_the_objective_hands_each_loss_the_configured_clips_and_the_rollout_correction(policy):
  """The policy loss the objective computes is `losses`' own, called with the config's
  clip_low, clip_high and dual_clip and the rollout correction's weights and mask, taken
  from the old log-probs (not the current ones): swapped clip bounds, a dual clip or
  importance weights left out, a correction of the current policy each passed every
  learner test (red team 61's mutations)."""
  from jaxagent import losses

  batch = jax.tree.map(jnp.asarray, make_batch())
  cfg = LearnerConfig(policy_loss=policy, clip_low=0.05, clip_high=0.3,
                      dual_clip=1.5 if policy == "ppo" else None, correction_mode="truncate",
                      correction_high=1.2)
  learner = Learner(CFG, cfg, make_mesh())
  model = bind(learner.graphdef, learner.abstract_params, init_params(CFG, 0))
  logp, _ = token_logps(model, batch, cfg)
  mask = batch.loss_mask
  # Old log-probs around the current ones: ratios on both sides of both clip bounds.
  shift = jnp.asarray(np.random.default_rng(4).normal(size=mask.shape) * 0.4, jnp.float32)
  old = jnp.where(mask > 0, logp + shift, 0.0)
  batch = batch._replace(old_logp=old)
  total, (denom, metrics) = jax.jit(lambda b: microbatch_objective(model, b, cfg))(batch)

  old = jnp.where(mask > 0, old, logp)
  corr = losses.rollout_correction(old, batch.rollout_logp, mask, batch.segment_ids,
                                   mode="truncate", high=1.2)
  assert float(metrics["is_truncated_frac"][0]) > 0  # (some weights capped at 1.2)
  reduce = losses.make_reduce("token_mean", segment_ids_BxT=batch.segment_ids,
                              rollout_weight_BxT=batch.rollout_weight, norm_len=64.0,
                              loss_mask_BxT=mask)
  adv_ = jnp.where(mask > 0, batch.advantages, 0.0)
  if policy == "ppo":
    want = losses.ppo_clip_loss(logp, old, adv_, corr.mask, reduce=reduce, clip_low=0.05,
                                clip_high=0.3, dual_clip=1.5, is_weights_BxT=corr.weights)
    assert float(want.metrics["dual_clip_frac"][0]) > 0
  elif policy == "gspo":
    want = losses.gspo_loss(logp, old, adv_, corr.mask, batch.segment_ids, reduce=reduce,
                            clip_low=0.05, clip_high=0.3, is_weights_BxT=corr.weights)
  else:
    want = losses.reinforce_loss(logp, adv_, corr.mask, reduce=reduce,
                                 is_weights_BxT=corr.weights)
  assert float(denom) == float(want.denom)
  assert float(total) == pytest.approx(float(want.sum), rel=1e-5, abs=1e-5)
  for key, (s, d) in want.metrics.items():
    # (a count of clipped tokens moves by one where a ratio sits at a bound to rounding:
    # jit and eager may differ there)
    tol = 1.5 if key.endswith("_frac") else 1e-6
    assert float(metrics[key][0]) == pytest.approx(float(s), rel=1e-5, abs=tol), key


def test_adamw_takes_the_configured_moments_and_decoupled_weight_decay():
  """Two AdamW updates by hand (bias-corrected moments, decay of the weights themselves):
  b1 and b2 swapped (the first update is the same either way) or the weight decay left
  out passed every learner test (red team 61's mutations)."""
  lr, b1, b2, eps, wd = 0.1, 0.5, 0.9, 1e-8, 0.2
  tx, _ = make_optimizer(LearnerConfig(lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=wd))
  p = {"w": jnp.asarray([1.0, -2.0])}
  g1, g2 = np.array([0.3, -0.1]), np.array([-0.2, 0.4])  # (norms under max_grad_norm 1)
  state = tx.init(p)
  want = np.array(p["w"])
  m = v = 0.0
  for t, g in enumerate((g1, g2), start=1):
    upd, state = tx.update({"w": jnp.asarray(g, jnp.float32)}, state, p)
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    step = (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps) + wd * want
    want = want - lr * step
    p = {"w": p["w"] + upd["w"]}
    np.testing.assert_allclose(p["w"], want, rtol=1e-5, err_msg=f"update {t}")


def test_the_learners_rows_are_a_multiple_of_its_microbatches_times_the_batch_shards():
  """`row_multiple` (what the trainer pads each batch's rows to) counts the microbatches
  as well as the devices the rows shard over: without them a batch the step cannot split
  reached it."""
  for n in (1, 3):
    assert Learner(CFG, LearnerConfig(microbatches=n), make_mesh()).row_multiple == n * len(
        jax.devices())


def test_gradients_of_bfloat16_weights_are_accumulated_in_float32():
  """Each microbatch's gradient is cast to float32 before it is summed: the sum over
  microbatches (and the step's division by the token count) never runs in bfloat16."""
  cfg16 = preset("tiny", n_layers=2, param_dtype="bfloat16")
  cfg = LearnerConfig()
  learner = Learner(cfg16, cfg, make_mesh())
  params = init_params(cfg16, 0)
  assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
  batch = jax.tree.map(jnp.asarray, make_batch())

  def objective(p, mb):
    return microbatch_objective(bind(learner.graphdef, learner.abstract_params, p), mb, cfg)

  for n in (1, 2):
    grads, _, _, _ = jax.eval_shape(functools.partial(
        accumulate_gradients, objective=objective, microbatches=n), params, batch)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}, n

"""Losses: hand-computed cases, a NumPy reference, jit/no-jit, and structural properties."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent import losses
from jaxagent.batch import pack, rollout_weights


def row(*xs):
  return jnp.asarray([xs], jnp.float32)


# -- hand-computed -------------------------------------------------------------------


def test_token_logp_and_entropy_match_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 5, 11)).astype(np.float32) * 3
  targets = rng.integers(0, 11, (2, 5))
  for temp in (1.0, 0.7):
    z = logits / temp
    logp_all = z - np.log(np.exp(z).sum(-1, keepdims=True))
    want = np.take_along_axis(logp_all, targets[..., None], -1)[..., 0]
    want_ent = -(np.exp(logp_all) * logp_all).sum(-1)
    logp, ent = losses.token_logp_and_entropy(jnp.asarray(logits), jnp.asarray(targets), temp)
    np.testing.assert_allclose(logp, want, atol=1e-5)
    np.testing.assert_allclose(ent, want_ent, atol=1e-5)


def test_ppo_clip_hand_computed():
  ratio = np.array([1.5, 0.5, 1.0, 1.1, 5.0])
  adv = row(1.0, 1.0, -1.0, -2.0, -1.0)
  logp = row(*np.log(ratio))
  old = jnp.zeros_like(logp)
  mask = row(1, 1, 1, 1, 1)
  out = losses.ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
  # per token: max(-A r, -A clip(r, 0.8, 1.28))
  per_token = [-1.28, -0.5, 1.0, 2.2, 5.0]
  assert float(out.sum) == pytest.approx(sum(per_token), abs=1e-5)
  assert float(out.denom) == 5
  assert out.metrics["clip_frac"][0] == pytest.approx(1.0)  # only token 0
  dual = losses.ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
  # Token 4 (A < 0, r = 5): capped at -A * 3 = 3.
  assert float(dual.sum) == pytest.approx(sum(per_token[:4]) + 3.0, abs=1e-5)
  assert dual.metrics["dual_clip_frac"][0] == pytest.approx(1.0)


def test_gspo_hand_computed_and_gradient():
  logp = row(0.1, 0.3, 0.0)
  old = row(0.0, 0.0, 0.0)
  mask = row(1, 1, 0)
  seg = jnp.asarray([[1, 1, 1]])
  s = math.exp(0.2)  # exp(mean log-ratio over the two action tokens)
  up = losses.gspo_loss(logp, old, row(1, 1, 1), mask, seg, clip_low=0.1, clip_high=0.1)
  assert float(up.sum) == pytest.approx(2 * -1.1, abs=1e-5)  # clipped at 1 + 0.1
  down = losses.gspo_loss(logp, old, row(-1, -1, -1), mask, seg, clip_low=0.1, clip_high=0.1)
  assert float(down.sum) == pytest.approx(2 * s, abs=1e-5)  # unclipped side is larger

  # Unclipped, with a constant advantage, the gradient is GSPO's: A s / |y| per token.
  def loss(lp):
    out = losses.gspo_loss(lp, old, row(-1, -1, -1), mask, seg, clip_low=0.5, clip_high=0.5,
                           reduce=functools.partial(losses.seq_mean_token_mean,
                                                    segment_ids_BxT=seg))
    return out.sum / out.denom

  g = jax.grad(loss)(logp)
  np.testing.assert_allclose(g, [[s / 2, s / 2, 0.0]], atol=1e-5)


def test_reinforce_hand_computed():
  out = losses.reinforce_loss(row(-1.0, -2.0, -3.0), row(2.0, -1.0, 5.0), row(1, 1, 0))
  assert float(out.sum) == pytest.approx(2.0 - 2.0)
  assert float(out.denom) == 2


@pytest.mark.parametrize("level,mode,weights,mask", [
    ("token", "truncate", [2.0, math.exp(-1), 1.0, 1.0], [1, 1, 1, 0]),
    ("token", "mask", [math.e, math.exp(-1), 1.0, 1.0], [0, 0, 1, 0]),
    # sequence: product over the segment's action tokens = e^(1 - 1 + 0) = 1
    ("sequence", "mask", [1.0, 1.0, 1.0, 1.0], [1, 1, 1, 0]),
    ("geometric", "truncate", [1.0, 1.0, 1.0, 1.0], [1, 1, 1, 0]),
])
def test_rollout_correction_hand_computed(level, mode, weights, mask):
  old = row(0.0, -2.0, -1.0, -5.0)
  rollout = row(-1.0, -1.0, -1.0, 0.0)  # log w = [1, -1, 0, (masked)]
  m = row(1, 1, 1, 0)
  seg = jnp.asarray([[1, 1, 1, 1]])
  c = losses.rollout_correction(old, rollout, m, seg, mode=mode, level=level, low=0.5, high=2.0)
  np.testing.assert_allclose(c.weights[0, :3], weights[:3], rtol=1e-5)
  np.testing.assert_array_equal(c.mask[0], mask)
  key = "is_masked_frac" if mode == "mask" else "is_truncated_frac"
  s, d = c.metrics[key]
  assert float(s / d) == pytest.approx(1.0 - sum(mask) / 3 if mode == "mask" else
                                       (1 / 3 if level == "token" else 0.0))


def test_sequence_level_mask_drops_the_whole_sequence():
  old = row(0.0, 0.0, 0.0, 0.0)
  rollout = row(-1.0, -1.0, 0.0, 0.0)
  m = row(1, 1, 1, 1)
  seg = jnp.asarray([[1, 1, 2, 2]])
  c = losses.rollout_correction(old, rollout, m, seg, mode="mask", level="sequence", high=2.0)
  np.testing.assert_array_equal(c.mask[0], [0, 0, 1, 1])  # e^2 > 2 for segment 1


def test_kl_estimators_hand_computed():
  logp, ref = row(0.5), row(0.0)
  assert float(losses.kl_penalty(logp, ref, "k1")[0, 0]) == pytest.approx(0.5)
  assert float(losses.kl_penalty(logp, ref, "k2")[0, 0]) == pytest.approx(0.125)
  assert float(losses.kl_penalty(logp, ref, "k3")[0, 0]) == pytest.approx(
      math.exp(-0.5) - 1 + 0.5, rel=1e-6)
  with pytest.raises(ValueError, match="k4"):
    losses.kl_penalty(logp, ref, "k4")


def test_reductions_hand_computed():
  values = jnp.asarray([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0]])
  mask = jnp.asarray([[0, 1, 1, 1], [1, 1, 0, 0]], jnp.float32)
  seg = jnp.asarray([[1, 1, 2, 2], [1, 1, 0, 0]])
  # token mean: (2 + 3 + 4 + 5 + 6) / 5
  s, d = losses.token_mean(values, mask)
  assert (float(s), float(d)) == (20.0, 5.0)
  # sequences: row0 seg1 = [2] -> 2; row0 seg2 = [3, 4] -> 3.5; row1 seg1 = [5, 6] -> 5.5
  s, d = losses.seq_mean_token_mean(values, mask, seg)
  assert float(s) == pytest.approx(2 + 3.5 + 5.5) and float(d) == pytest.approx(3)
  # Dr. GRPO: token sums / 4, mean over 3 sequences
  s, d = losses.seq_mean_token_sum_norm(values, mask, seg, norm_len=4.0)
  assert float(s) == pytest.approx(20 / 4) and float(d) == pytest.approx(3)
  # per rollout: rollout A = row0 seg1 + row1 seg1 (3 tokens), rollout B = row0 seg2
  rollout_ids = np.asarray([[0, 0, 1, 1], [0, 0, -1, -1]])
  w = rollout_weights(np.asarray(mask), rollout_ids)
  s, d = losses.per_rollout(values, mask, jnp.asarray(w))
  assert float(s) == pytest.approx((2 + 5 + 6) / 3 + (3 + 4) / 2) and float(d) == pytest.approx(2)
  # Tokens the learner drops beside the batch's mask (stale, the correction's mask mode)
  # count as zeros in their rollout's mean; the denominator stays the 2 rollouts (it was
  # their kept weight, 1 + 1/2 here: a fraction of a rollout that inflated the loss).
  dropped = mask.at[0, 3].set(0.0)
  s, d = losses.per_rollout(values, dropped, jnp.asarray(w), loss_mask_BxT=mask)
  assert float(s) == pytest.approx((2 + 5 + 6) / 3 + 3 / 2) and float(d) == pytest.approx(2)
  reduce = losses.make_reduce("per_rollout", segment_ids_BxT=seg, norm_len=4.0,
                              rollout_weight_BxT=jnp.asarray(w), loss_mask_BxT=mask)
  assert float(reduce(values, dropped)[1]) == pytest.approx(2)


# -- NumPy reference and jit ------------------------------------------------------------


def _np_ppo(logp, old, adv, mask, lo, hi):
  r = np.exp(logp - old)
  loss = np.maximum(-adv * r, -adv * np.clip(r, 1 - lo, 1 + hi))
  return (loss * mask).sum() / mask.sum()


class LossVariantsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_ppo_matches_numpy_reference(self):
    rng = np.random.default_rng(1)
    shape = (6, 50)
    logp = -rng.random(shape).astype(np.float32) * 3
    old = logp + rng.normal(0, 0.3, shape).astype(np.float32)
    adv = rng.normal(size=shape).astype(np.float32)
    mask = (rng.random(shape) < 0.7).astype(np.float32)

    @self.variant
    def f(logp, old, adv, mask):
      out = losses.ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
      return out.sum / out.denom

    np.testing.assert_allclose(f(logp, old, adv, mask),
                               _np_ppo(logp, old, adv, mask, 0.2, 0.28), rtol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_seq_mean_matches_numpy_reference(self):
    rng = np.random.default_rng(2)
    B, T = 4, 40
    values = rng.normal(size=(B, T)).astype(np.float32)
    mask = (rng.random((B, T)) < 0.6).astype(np.float32)
    seg = np.sort(rng.integers(1, 5, (B, T)), axis=1)
    means = []
    for b in range(B):
      for s in np.unique(seg[b]):
        m = (seg[b] == s) * mask[b]
        if m.sum():
          means.append((values[b] * m).sum() / m.sum())
    s, d = self.variant(losses.seq_mean_token_mean)(values, mask, seg)
    np.testing.assert_allclose(s / d, np.mean(means), rtol=1e-5)
    assert float(d) == len(means)


# -- properties -----------------------------------------------------------------------


def _segments(rng, n, vocab=50):
  out = []
  for i in range(n):
    length = int(rng.integers(4, 12))
    mask = (rng.random(length) < 0.7).astype(np.float32)
    mask[0] = 0
    out.append(dict(tokens=rng.integers(0, vocab, length), loss_mask=mask,
                    rollout_logp=-rng.random(length).astype(np.float32) * mask,
                    advantages=rng.normal(size=length).astype(np.float32) * mask,
                    old_logp=-rng.random(length).astype(np.float32), rollout_id=i // 2))
  return out


@pytest.mark.parametrize("reduction", sorted(losses.REDUCTIONS))
def test_packed_equals_unpacked(reduction):
  rng = np.random.default_rng(3)
  segs = _segments(rng, 7)
  logp_of = [-rng.random(len(s["tokens"])).astype(np.float32) for s in segs]
  for s, lp in zip(segs, logp_of):
    s["ref_logp"] = lp  # carry the "current" log-probs through packing

  def total(batch):
    reduce = losses.make_reduce(reduction, segment_ids_BxT=jnp.asarray(batch.segment_ids),
                                rollout_weight_BxT=jnp.asarray(batch.rollout_weight),
                                norm_len=12.0)
    out = losses.ppo_clip_loss(jnp.asarray(batch.ref_logp), jnp.asarray(batch.old_logp),
                               jnp.asarray(batch.advantages), jnp.asarray(batch.loss_mask),
                               reduce=reduce)
    return float(out.sum), float(out.denom)

  packed, placed = pack(segs, rows=2, seq_len=48)
  assert (placed >= 0).all() and len(set(placed.tolist())) == 2
  unpacked, _ = pack(segs, rows=len(segs), seq_len=12)
  # One row per segment when each row only fits one.
  assert (unpacked.segment_ids.max(axis=1) == 1).all()
  np.testing.assert_allclose(total(packed), total(unpacked), rtol=1e-5)


def test_masked_equals_filtered():
  rng = np.random.default_rng(4)
  T = 30
  logp, old = -rng.random((1, T)), -rng.random((1, T))
  adv = rng.normal(size=(1, T))
  mask = (rng.random((1, T)) < 0.5).astype(np.float32)
  keep = mask[0] > 0
  full = losses.ppo_clip_loss(*(jnp.asarray(x, jnp.float32) for x in (logp, old, adv, mask)))
  filt = losses.ppo_clip_loss(*(jnp.asarray(x[:, keep], jnp.float32)
                                for x in (logp, old, adv, np.ones_like(mask))))
  np.testing.assert_allclose([full.sum, full.denom], [filt.sum, filt.denom], rtol=1e-5)


def test_reductions_add_up_over_microbatches():
  rng = np.random.default_rng(5)
  batch, _ = pack(_segments(rng, 12), rows=4, seq_len=30)
  values = jnp.asarray(rng.normal(size=batch.tokens.shape), jnp.float32)
  for name in losses.REDUCTIONS:
    def sd(rows):
      reduce = losses.make_reduce(name, segment_ids_BxT=jnp.asarray(batch.segment_ids[rows]),
                                  rollout_weight_BxT=jnp.asarray(batch.rollout_weight[rows]),
                                  norm_len=30.0)
      return np.asarray(reduce(values[rows], jnp.asarray(batch.loss_mask[rows])))
    full = sd(slice(0, 4))
    split = sd(slice(0, 2)) + sd(slice(2, 4))
    np.testing.assert_allclose(split, full, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("policy", ["ppo", "gspo", "reinforce"])
def test_gradients_finite_under_masks(policy):
  # A fully masked row, extreme log-probs on masked tokens, and an empty segment.
  logp = jnp.asarray([[-1.0, -200.0, -0.5], [-300.0, -1e4, 0.0]])
  old = jnp.asarray([[-1.2, 0.0, -0.4], [0.0, 0.0, -50.0]])
  rollout = jnp.asarray([[-1.0, -90.0, -0.3], [0.0, 0.0, 0.0]])
  adv = jnp.asarray([[1.0, 1.0, -1.0], [1.0, 1.0, 1.0]])
  mask = jnp.asarray([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
  seg = jnp.asarray([[1, 1, 2], [1, 1, 1]])

  def objective(lp):
    corr = losses.rollout_correction(old, rollout, mask, seg, mode="mask", level="geometric")
    reduce = functools.partial(losses.seq_mean_token_mean, segment_ids_BxT=seg)
    if policy == "ppo":
      out = losses.ppo_clip_loss(lp, old, adv, corr.mask, reduce=reduce, dual_clip=3.0,
                                 is_weights_BxT=corr.weights)
    elif policy == "gspo":
      out = losses.gspo_loss(lp, old, adv, corr.mask, seg, reduce=reduce,
                             is_weights_BxT=corr.weights)
    else:
      out = losses.reinforce_loss(lp, adv, corr.mask, reduce=reduce, is_weights_BxT=corr.weights)
    kl, _ = reduce(losses.kl_penalty(lp, old, "k3"), corr.mask)
    return (out.sum + 0.1 * kl) / jnp.maximum(out.denom, 1.0)

  g = jax.grad(objective)(logp)
  assert bool(jnp.all(jnp.isfinite(g)))
  assert float(jnp.abs(g[1]).sum()) == 0.0  # masked row gets no gradient
  assert float(jnp.abs(g[0, 0])) > 0.0


def test_unknown_names_are_errors():
  z = row(0.0)
  with pytest.raises(ValueError, match="unknown reduction"):
    losses.make_reduce("mean", segment_ids_BxT=z, rollout_weight_BxT=z, norm_len=1.0)
  with pytest.raises(ValueError, match="level"):
    losses.rollout_correction(z, z, z, z, level="word")
  with pytest.raises(ValueError, match="mode"):
    losses.rollout_correction(z, z, z, z, mode="clip")


def test_staleness_weighting_masks_or_decays_old_tokens():
  versions = jnp.array([[7, 6, 5, 4, -1, 6]])
  mask = jnp.array([[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
  none = losses.staleness_weighting(versions, jnp.int32(7), mask)
  np.testing.assert_array_equal(none.mask, mask)
  np.testing.assert_array_equal(none.scale, jnp.ones_like(mask))
  out = losses.staleness_weighting(versions, jnp.int32(7), mask, mode="mask", max_staleness=1)
  # staleness 0, 1, 2, 3; an unknown version (-1) counts as fresh; mask 0 stays 0
  np.testing.assert_array_equal(out.mask, [[1, 1, 0, 0, 1, 0]])
  s, d = out.metrics["stale_masked_frac"]
  assert float(s / d) == pytest.approx(2 / 5)
  out = losses.staleness_weighting(versions, jnp.int32(7), mask, mode="decay", decay=0.5)
  np.testing.assert_allclose(out.scale, [[1, 0.5, 0.25, 0.125, 1, 0.5]])
  np.testing.assert_array_equal(out.mask, mask)
  with pytest.raises(ValueError, match="staleness mode"):
    losses.staleness_weighting(versions, jnp.int32(7), mask, mode="drop")


def test_gspo_with_a_length_weighted_reduction_is_noted():
  """GSPO's gradient is a mean over sequences; token_mean weighs them by length (a
  reviewer's round: the docstring claimed GSPO's gradient under the default)."""
  from jaxagent.config import LearnerConfig
  from jaxagent.learner import loss_notes

  (note,) = loss_notes(LearnerConfig(policy_loss="gspo"))
  assert "reduction seq_mean_token_mean" in note
  assert loss_notes(LearnerConfig(policy_loss="gspo", reduction="seq_mean_token_mean")) == []
  assert loss_notes(LearnerConfig()) == []


def test_ratios_far_off_keep_their_gradient():
  """Log-ratios past 20 (reference log-probs below -20 are common in large vocabularies)
  were clamped, so the tokens furthest from the reference, or an unclipped ratio of a
  negative advantage, got no gradient (red team 19). Past e^20 the exp goes on linearly."""
  ref = jnp.asarray([[-24.5, -0.5]])
  mask = jnp.ones((1, 2))
  for est, want in (("k1", 1.0), ("k2", 24.0), ("k3", 1.0)):
    g = jax.grad(lambda lp, est=est: jnp.sum(losses.kl_penalty(lp, ref, est)))(
        jnp.asarray([[-0.5, -0.5]]))
    assert float(g[0, 0]) == pytest.approx(want, rel=1e-4), est
  # Far below the reference: finite, with the capped exp's slope.
  lp_low = jnp.asarray([[-40.0, -0.5]])
  k3 = losses.kl_penalty(lp_low, jnp.asarray([[-0.5, -0.5]]), "k3")
  assert np.isfinite(np.asarray(k3)).all() and float(k3[0, 0]) > math.exp(20)
  # PPO, advantage -1, ratio past e^20, no dual clip: the unclipped term's gradient.
  def ppo(lp):
    return losses.ppo_clip_loss(lp, jnp.asarray([[-30.0, -1.0]]), -mask, mask).sum
  g = jax.grad(ppo)(jnp.asarray([[-5.0, -1.0]]))
  assert float(g[0, 0]) == pytest.approx(math.exp(20), rel=1e-4)
  # (at -inf the capped exp is 0, its slope 0: it was nan, -inf - -inf; an audit)
  x = jnp.asarray([-jnp.inf, 0.0])
  assert losses._exp_capped(x).tolist() == [0.0, 1.0]
  assert jax.vmap(jax.grad(losses._exp_capped))(x).tolist() == [0.0, 1.0]


def test_a_value_out_of_the_loss_never_reaches_it():
  """A non-finite value on a token out of the loss (a prompt token's log-prob of -inf)
  made inf x 0 = nan of every sum (red team 19)."""
  seg = jnp.asarray([[1, 1, 1, 2, 2]])
  mask = jnp.asarray([[0.0, 1.0, 1.0, 0.0, 1.0]])
  values = jnp.asarray([[-jnp.inf, 1.0, 3.0, jnp.nan, 2.0]])
  assert float(losses.token_mean(values, mask)[0]) == 6.0
  assert float(losses.seq_mean_token_mean(values, mask, seg)[0]) == 4.0
  assert float(losses.seq_mean_token_sum_norm(values, mask, seg, 2.0)[0]) == 3.0
  for level in ("token", "sequence", "geometric"):
    corr = losses.rollout_correction(jnp.full((1, 5), -1.0), values, mask, seg, level=level)
    assert np.isfinite(np.asarray(corr.weights)[np.asarray(mask) > 0]).all(), level


def test_a_row_of_one_token_segments_counts_each():
  # T segments in a row of T tokens: ids 1..T (the last row's last key was past the end:
  # its segment went uncounted; a row before met the next row's padding key).
  T = 4
  seg = jnp.asarray([[1, 1, 1, 1], [1, 2, 3, 4]])
  mask = jnp.ones((2, T))
  total, n = losses.seq_mean_token_mean(jnp.ones((2, T)), mask, seg)
  assert float(n) == 5.0 and float(total) == 5.0


def test_the_geometric_correction_is_a_mean_over_the_action_tokens():
  """The geometric level's log-weight is the mean over a segment's action tokens, not
  over all of its tokens: the hand-computed case above has log-weights summing to 0, so a
  mean over every token passed it (red team 37)."""
  old = row(0.0, -2.0, -1.0, -5.0)
  rollout = row(-1.0, -1.5, -1.0, 0.0)  # log w = [1, -0.5, 0, (not an action)]
  c = losses.rollout_correction(old, rollout, row(1, 1, 1, 0), jnp.asarray([[1, 1, 1, 1]]),
                                mode="truncate", level="geometric")
  np.testing.assert_allclose(c.weights[0, :3], [math.exp(0.5 / 3)] * 3, rtol=1e-5)


def test_importance_weights_scale_each_tokens_ppo_and_gspo_loss_and_gradient():
  """`is_weights` multiply each token's loss (and so its gradient); a run with the
  rollout correction on trained as if it were off when they were dropped (red team 47)."""
  logp = row(0.0, math.log(1.5), math.log(0.5))
  old = jnp.zeros_like(logp)
  adv = row(1.0, -1.0, 2.0)
  mask = row(1, 1, 1)
  w = row(0.5, 2.0, 4.0)
  # per token max(-A r, -A clip(r, 0.8, 1.2)): -1, 1.5, -1; weighted -0.5 + 3 - 4.
  out = losses.ppo_clip_loss(logp, old, adv, mask, is_weights_BxT=w)
  assert float(out.sum) == pytest.approx(-1.5, abs=1e-5) and float(out.denom) == 3
  # every token on its unclipped side: d(-A r w)/dlogp = -A r w
  g = jax.grad(lambda lp: losses.ppo_clip_loss(lp, old, adv, mask, is_weights_BxT=w).sum)(logp)
  np.testing.assert_allclose(g, [[-0.5, 3.0, -4.0]], rtol=1e-5)
  # GSPO, A = -1 within the clip: each action token's loss is s = e^0.2, weighted 2 and 3
  # (the third token is out of the loss, its weight of 100 with it).
  seg = jnp.asarray([[1, 1, 1]])
  out = losses.gspo_loss(row(0.1, 0.3, 0.0), old, row(-1, -1, -1), row(1, 1, 0), seg,
                         clip_low=0.5, clip_high=0.5, is_weights_BxT=row(2.0, 3.0, 100.0))
  assert float(out.sum) == pytest.approx(5 * math.exp(0.2), rel=1e-5)


def test_gspo_sequence_ratio_leaves_out_tokens_out_of_the_loss():
  """The sequence ratio is the mean log-ratio over the action tokens only: a prompt
  token's log-ratio (5 here) is no part of it."""
  seg = jnp.asarray([[1, 1, 1]])
  out = losses.gspo_loss(row(0.1, 0.3, 5.0), jnp.zeros((1, 3)), row(-1, -1, -1),
                         row(1, 1, 0), seg, clip_low=0.5, clip_high=0.5)
  assert float(out.sum) == pytest.approx(2 * math.exp(0.2), rel=1e-5)
  assert float(out.metrics["clip_frac"][0]) == 0.0


def test_tokens_of_a_version_past_the_policys_count_as_fresh():
  """A token whose version is past the learner's (negative staleness) is fresh: its
  advantage is not scaled up by decay ** -k, and the mask keeps it."""
  versions = jnp.array([[7, 8, 10]])
  mask = jnp.ones((1, 3))
  out = losses.staleness_weighting(versions, jnp.int32(7), mask, mode="decay", decay=0.5)
  np.testing.assert_array_equal(out.scale, [[1.0, 1.0, 1.0]])
  out = losses.staleness_weighting(versions, jnp.int32(7), mask, mode="mask", max_staleness=0)
  np.testing.assert_array_equal(out.mask, [[1.0, 1.0, 1.0]])


def test_correction_bounds_are_inclusive_and_its_metrics_are_the_raw_weights():
  """A weight exactly at `low` or `high` is kept (mask) and not truncated; the metrics are
  of the weights before truncation and of |old - rollout|."""
  old = row(0.0, -1.0, 0.5, 3.0)
  rollout = row(0.0, 0.0, 0.0, 0.0)  # log w = [0, -1, 0.5, (not an action)]
  m = row(1, 1, 1, 0)
  seg = jnp.asarray([[1, 1, 1, 1]])
  c = losses.rollout_correction(old, rollout, m, seg, mode="mask", low=1.0, high=1.0)
  np.testing.assert_array_equal(c.mask, [[1, 0, 0, 0]])  # w = 1 is inside [1, 1]
  assert float(c.metrics["is_masked_frac"][0]) == 2.0
  c = losses.rollout_correction(old, rollout, m, seg, mode="truncate", high=1.0)
  np.testing.assert_allclose(c.weights[0, :3], [1.0, math.exp(-1), 1.0], rtol=1e-6)
  assert float(c.metrics["is_truncated_frac"][0]) == 1.0  # only e^0.5 was past 1
  s, d = c.metrics["is_weight_mean"]
  assert float(s / d) == pytest.approx((1 + math.exp(-1) + math.exp(0.5)) / 3, rel=1e-6)
  s, d = c.metrics["rollout_abs_logp_diff"]
  assert float(s / d) == pytest.approx(1.5 / 3, rel=1e-6)


def test_ppo_reports_the_k2_estimate_of_kl_to_the_old_policy():
  logp, old = row(0.5, -0.2, 3.0), row(0.0, 0.0, 0.0)
  out = losses.ppo_clip_loss(logp, old, row(1, 1, 1), row(1, 1, 0))
  s, d = out.metrics["approx_kl_old"]
  assert (float(s), float(d)) == pytest.approx((0.5 * (0.25 + 0.04), 2.0))


def test_reinforce_pushes_up_the_log_prob_of_positive_advantage_tokens():
  """loss = -A logp: its sum is not 0 here (the hand-computed case above sums to 0, which
  a loss of the opposite sign also gave) and its gradient is -A."""
  logp, adv, mask = row(-1.0, -2.0, -3.0), row(2.0, 1.0, 5.0), row(1, 1, 0)
  out = losses.reinforce_loss(logp, adv, mask)
  assert float(out.sum) == pytest.approx(2.0 + 2.0)
  g = jax.grad(lambda lp: losses.reinforce_loss(lp, adv, mask).sum)(logp)
  np.testing.assert_allclose(g, [[-2.0, -1.0, 0.0]])

"""Pure policy-gradient losses, rollout/learner mismatch correction and KL penalties.

Every function here is a pure function of arrays. Arrays are `[B, T]` and
aligned with `tokens`: position t holds the log-prob of token t given tokens
< t, and `mask` is 1 only on model-sampled action tokens.

Reductions are their own named functions returning `(sum, denominator)`.
Both parts add up across microbatches and devices, so the full-batch loss is
`sum(sums) / sum(denominators)` exactly however the batch is split; the
learner differentiates the sum and divides once at the end.

Names say which policy a log-prob came from: `logp` (current, differentiated),
`old_logp` (learner before this update), `rollout_logp` (what the engine
sampled with), `ref_logp` (frozen reference).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp

Array = jax.Array
SumDenom = tuple[Array, Array]
Reduce = Callable[[Array, Array], SumDenom]

# Past e^20 a ratio's exp() goes on as its tangent line (`_exp_capped`): no overflow, and
# the gradient stays (a clamp's is 0: the token furthest off got no push back).
_MAX_LOG_RATIO = 20.0


def _exp_capped(x: Array) -> Array:
  """exp(x) up to e^_MAX_LOG_RATIO, then e^_MAX_LOG_RATIO (1 + x - _MAX_LOG_RATIO):
  continuous with its derivative, finite for any finite x, 0 at -inf (it was nan: -inf
  - -inf; an audit)."""
  capped = jnp.minimum(x, _MAX_LOG_RATIO)
  return jnp.exp(capped) * (1.0 + jnp.maximum(x - _MAX_LOG_RATIO, 0.0))


# -- log-probs and entropy --------------------------------------------------------


def token_logp_and_entropy(logits_BxTxV: Array, targets_BxT: Array,
                           temperature: float = 1.0) -> tuple[Array, Array]:
  """Log-prob of each target token and the entropy of each next-token distribution.

  Args:
    logits_BxTxV: logits whose position t predicts `targets_BxT[:, t]`.
    targets_BxT: integer token ids.
    temperature: divides the logits first (as the sampler did).
  Returns:
    `(logp_BxT, entropy_BxT)` in float32.
  """
  chex.assert_rank(logits_BxTxV, 3)
  chex.assert_rank(targets_BxT, 2)
  logits = logits_BxTxV.astype(jnp.float32) / temperature
  logz = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets_BxT[..., None], axis=-1)[..., 0]
  probs = jax.nn.softmax(logits, axis=-1)
  # H = log Z - E_p[logit], which avoids forming log p for the whole vocabulary.
  entropy = logz - jnp.sum(probs * logits, axis=-1)
  return target_logit - logz, entropy


def _logz_target_entropy(logits_NxV: Array, targets_N: Array, valid_V: Optional[Array]
                         ) -> tuple[Array, Array, Array, Array]:
  """Pieces of an online log-softmax over one vocabulary chunk: the chunk's max m,
  l = sum exp(z - m), s = sum exp(z - m) z and the target's logit (0 if not in the chunk;
  `targets_N` are chunk-local ids)."""
  if valid_V is not None:  # padding columns of the last chunk: exp() gives exact zeros
    logits_NxV = jnp.where(valid_V[None, :], logits_NxV, -1e30)  # finite: no NaN gradients
  m = jnp.max(logits_NxV, axis=-1)
  e = jnp.exp(logits_NxV - m[:, None])
  l = jnp.sum(e, axis=-1)
  s = jnp.sum(e * logits_NxV, axis=-1)
  V = logits_NxV.shape[-1]
  inside = (targets_N >= 0) & (targets_N < V)
  t = jnp.take_along_axis(logits_NxV, jnp.clip(targets_N, 0, V - 1)[:, None], axis=-1)[:, 0]
  return m, l, s, jnp.where(inside, t, 0.0)


def chunked_token_logp_and_entropy(hidden_BxTxD: Array, head_DxV: Array, targets_BxT: Array,
                                   temperature: float = 1.0, *, chunk: int = 256,
                                   vocab_chunk: int = 0) -> tuple[Array, Array]:
  """`token_logp_and_entropy` of the logits `hidden @ head`, never forming `[B, T, V]`.

  The positions are taken `chunk` at a time (a `[B, chunk, V]` float32 block at most
  alive) under `jax.checkpoint`, so the backward pass recomputes each block instead
  of keeping it; with `vocab_chunk` > 0 the vocabulary is walked in chunks too, with
  an online log-sum-exp (peak `[B, chunk, vocab_chunk]`, for vocabularies of 10^5).
  Equal to the full computation to float32 rounding.
  """
  chex.assert_rank([hidden_BxTxD, targets_BxT], [3, 2])
  B, T, D = hidden_BxTxD.shape
  V = head_DxV.shape[1]
  chunk = max(1, min(chunk, T))
  pad_t = -T % chunk
  h = jnp.pad(hidden_BxTxD, [(0, 0), (0, pad_t), (0, 0)])
  tg = jnp.pad(targets_BxT, [(0, 0), (0, pad_t)])
  n_chunks = (T + pad_t) // chunk
  h = h.reshape(B, n_chunks, chunk, D).swapaxes(0, 1)  # [n, B, chunk, D]
  tg = tg.reshape(B, n_chunks, chunk).swapaxes(0, 1)
  w = head_DxV.astype(jnp.float32)
  vc = V if vocab_chunk <= 0 else min(vocab_chunk, V)
  pad_v = -V % vc
  w_chunks = jnp.pad(w, [(0, 0), (0, pad_v)]).reshape(D, -1, vc).swapaxes(0, 1)  # [nv, D, vc]
  n_v = w_chunks.shape[0]

  def vocab_step(carry, xs):
    m, l, s, t = carry
    w_c, start, h_N, tg_N = xs
    logits = (h_N @ w_c) / temperature
    valid = (start + jnp.arange(vc)) < V if pad_v else None
    m_c, l_c, s_c, t_c = _logz_target_entropy(logits, tg_N - start, valid)
    m_new = jnp.maximum(m, m_c)
    a, b = jnp.exp(m - m_new), jnp.exp(m_c - m_new)
    return (m_new, l * a + l_c * b, s * a + s_c * b, t + t_c), None

  @jax.checkpoint
  def position_chunk(h_BxCxD, tg_BxC):
    h_N = h_BxCxD.reshape(-1, D).astype(jnp.float32)
    tg_N = tg_BxC.reshape(-1)
    if n_v == 1:
      m, l, s, t = _logz_target_entropy((h_N @ w) / temperature, tg_N, None)
    else:
      n = h_N.shape[0]
      init = (jnp.full((n,), -jnp.inf), jnp.zeros((n,)), jnp.zeros((n,)), jnp.zeros((n,)))
      starts = jnp.arange(n_v, dtype=jnp.int32) * vc
      step = jax.checkpoint(lambda c, xs: vocab_step(c, (*xs, h_N, tg_N)))
      (m, l, s, t), _ = jax.lax.scan(step, init, (w_chunks, starts))
    logz = m + jnp.log(l)
    # H = log Z - E_p[z], with E_p[z] = s / l.
    return (t - logz).reshape(B, chunk), (logz - s / l).reshape(B, chunk)

  logp, entropy = jax.lax.map(lambda xs: position_chunk(*xs), (h, tg))
  unchunk = lambda x: x.swapaxes(0, 1).reshape(B, -1)[:, :T]
  return unchunk(logp), unchunk(entropy)


def shifted_targets(tokens_BxT: Array) -> Array:
  """Targets for logits at t: token t+1 (the last position gets token 0, masked out)."""
  return jnp.concatenate([tokens_BxT[:, 1:], jnp.zeros_like(tokens_BxT[:, :1])], axis=1)


def align_to_tokens(per_position_BxT: Array) -> Array:
  """Moves values computed at position t for token t+1 onto token t+1 (0 at t=0)."""
  return jnp.concatenate([jnp.zeros_like(per_position_BxT[:, :1]), per_position_BxT[:, :-1]],
                         axis=1)


# -- segment helpers ----------------------------------------------------------------


def _segment_sums(values_BxT: Array, segment_ids_BxT: Array) -> tuple[Array, Array]:
  """Sums of `values` per (row, segment id), and each token's index into them."""
  chex.assert_equal_shape([values_BxT, segment_ids_BxT])
  B, T = values_BxT.shape
  # A segment is (row, id); ids in a row are <= T (0 is padding), so row * (T + 1) + id
  # is unique.
  key = (jnp.arange(B, dtype=jnp.int32)[:, None] * (T + 1)
         + segment_ids_BxT.astype(jnp.int32))
  sums = jax.ops.segment_sum(values_BxT.reshape(-1), key.reshape(-1),
                             num_segments=B * (T + 1))
  return sums, key


def segment_totals(values_BxT: Array, segment_ids_BxT: Array) -> Array:
  """For each token, the sum of `values` over its segment (segments never cross rows)."""
  sums, key = _segment_sums(values_BxT, segment_ids_BxT)
  return sums[key]


def _count_and_sequences(mask_BxT: Array, segment_ids_BxT: Array) -> tuple[Array, Array]:
  """Per-token action-token count of its segment, and the (exact) number of sequences
  with at least one action token."""
  counts, key = _segment_sums(mask_BxT.astype(jnp.float32), segment_ids_BxT)
  return counts[key], jnp.sum((counts > 0).astype(jnp.float32))


# -- reductions -----------------------------------------------------------------------


def _masked(values_BxT: Array, weights_BxT: Array) -> Array:
  """values x weights, 0 where the weight is 0 whatever the value (a non-finite value
  of a token out of the loss, a prompt token's, made inf x 0 = nan of the whole sum)."""
  return jnp.where(weights_BxT != 0, values_BxT * weights_BxT, 0.0)


def token_mean(values_BxT: Array, mask_BxT: Array) -> SumDenom:
  """Mean over all action tokens: (sum of masked values, number of action tokens)."""
  chex.assert_equal_shape([values_BxT, mask_BxT])
  m = mask_BxT.astype(jnp.float32)
  return jnp.sum(_masked(values_BxT, m)), jnp.sum(m)


def seq_mean_token_mean(values_BxT: Array, mask_BxT: Array, segment_ids_BxT: Array) -> SumDenom:
  """Mean over sequences of each sequence's token mean (GRPO's original reduction, where
  a sample is one sequence).

  A sequence is a packed segment: an episode that forked (a compaction, a sub-agent's
  branch) is several, and weighs as many; `per_rollout` weighs each episode once.
  Sum: each token weighted by 1 / (action tokens of its sequence); denominator:
  the number of sequences with at least one action token.
  """
  m = mask_BxT.astype(jnp.float32)
  count, n_seqs = _count_and_sequences(m, segment_ids_BxT)
  return jnp.sum(_masked(values_BxT, m) / jnp.maximum(count, 1.0)), n_seqs


def seq_mean_token_sum_norm(values_BxT: Array, mask_BxT: Array, segment_ids_BxT: Array,
                            norm_len: float) -> SumDenom:
  """Dr. GRPO: each sequence's token sum divided by a constant `norm_len`, mean over sequences.

  (Liu et al., 2025, "Understanding R1-Zero-Like Training".)
  """
  m = mask_BxT.astype(jnp.float32)
  _, n_seqs = _count_and_sequences(m, segment_ids_BxT)
  return jnp.sum(_masked(values_BxT, m)) / norm_len, n_seqs


def per_rollout(values_BxT: Array, mask_BxT: Array, rollout_weight_BxT: Array,
                loss_mask_BxT: Optional[Array] = None) -> SumDenom:
  """All segments of one rollout share one denominator.

  `rollout_weight` is 1 / (action tokens of the token's whole rollout), computed
  on the host over all of the rollout's segments (see `rollout_weights`), so a
  rollout split into several segments, rows or microbatches is still one
  token-mean. Denominator: number of rollouts, counted on `loss_mask` (the batch's
  own; default `mask`). Tokens that `mask` drops beside it (stale tokens, the
  correction's mask mode) count as zeros in their rollout's mean: a rollout's
  kept-token count is global to the batch, which a microbatch cannot see (dividing
  by the kept weight instead made the denominator a fraction of a rollout and
  inflated the loss).
  """
  chex.assert_equal_shape([values_BxT, mask_BxT, rollout_weight_BxT])
  base = mask_BxT if loss_mask_BxT is None else loss_mask_BxT
  w = mask_BxT.astype(jnp.float32) * rollout_weight_BxT
  return jnp.sum(_masked(values_BxT, w)), jnp.sum(base.astype(jnp.float32) * rollout_weight_BxT)


# Each entry closes a reduction over the batch's structure, giving `reduce(values, mask)`.
REDUCTIONS: dict[str, Callable[..., Reduce]] = {
    "token_mean": lambda **_: token_mean,
    "seq_mean_token_mean": lambda segment_ids_BxT, **_: functools.partial(
        seq_mean_token_mean, segment_ids_BxT=segment_ids_BxT),
    "seq_mean_token_sum_norm": lambda segment_ids_BxT, norm_len, **_: functools.partial(
        seq_mean_token_sum_norm, segment_ids_BxT=segment_ids_BxT, norm_len=norm_len),
    "per_rollout": lambda rollout_weight_BxT, loss_mask_BxT, **_: functools.partial(
        per_rollout, rollout_weight_BxT=rollout_weight_BxT, loss_mask_BxT=loss_mask_BxT),
}


def make_reduce(name: str, *, segment_ids_BxT: Array, rollout_weight_BxT: Array,
                norm_len: float, loss_mask_BxT: Optional[Array] = None) -> Reduce:
  """The named reduction, closed over the batch's structure: `reduce(values, mask)`.
  `loss_mask_BxT`: the batch's own loss mask, before the learner drops tokens
  (per_rollout counts its rollouts on it)."""
  if name not in REDUCTIONS:
    raise ValueError(f"unknown reduction {name!r}; known: {sorted(REDUCTIONS)}")
  return REDUCTIONS[name](segment_ids_BxT=segment_ids_BxT,
                          rollout_weight_BxT=rollout_weight_BxT, norm_len=norm_len,
                          loss_mask_BxT=loss_mask_BxT)


# -- policy losses ------------------------------------------------------------------


class LossOut(NamedTuple):
  """An unreduced loss sum, its denominator, and diagnostics as (sum, denominator) pairs."""

  sum: Array
  denom: Array
  metrics: dict[str, SumDenom]


def _weighted(values, is_weights):
  return values if is_weights is None else values * is_weights


def ppo_clip_loss(logp_BxT: Array, old_logp_BxT: Array, advantages_BxT: Array, mask_BxT: Array,
                  *, reduce: Reduce = token_mean, clip_low: float = 0.2,
                  clip_high: float = 0.2, dual_clip: Optional[float] = None,
                  is_weights_BxT: Optional[Array] = None) -> LossOut:
  """PPO clipped surrogate with separate low/high clip and optional dual clip.

  ratio = exp(logp - old_logp); loss = max(-A ratio, -A clip(ratio, 1 - clip_low,
  1 + clip_high)). `clip_high > clip_low` is DAPO's clip-higher (Yu et al., 2025).
  With `dual_clip = c > 1`, losses of negative-advantage tokens are capped at
  -c A (Ye et al., 2020). `is_weights` (stop-gradient) correct for the rollout
  engine's distribution (see `rollout_correction`).
  """
  chex.assert_equal_shape([logp_BxT, old_logp_BxT, advantages_BxT, mask_BxT])
  log_ratio = logp_BxT - old_logp_BxT
  ratio = _exp_capped(log_ratio)
  unclipped = -advantages_BxT * ratio
  clipped = -advantages_BxT * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
  loss = jnp.maximum(unclipped, clipped)
  clip_frac = (clipped > unclipped).astype(jnp.float32)
  if dual_clip is not None:
    capped = jnp.minimum(loss, -advantages_BxT * dual_clip)
    dual = ((advantages_BxT < 0) & (capped < loss)).astype(jnp.float32)
    loss = jnp.where(advantages_BxT < 0, capped, loss)
  else:
    dual = jnp.zeros_like(loss)
  total, denom = reduce(_weighted(loss, is_weights_BxT), mask_BxT)
  approx_kl = 0.5 * jnp.square(log_ratio)  # k2 estimate of KL(old || current)
  return LossOut(total, denom, {
      "clip_frac": token_mean(clip_frac, mask_BxT),
      "dual_clip_frac": token_mean(dual, mask_BxT),
      "approx_kl_old": token_mean(approx_kl, mask_BxT),
  })


def gspo_loss(logp_BxT: Array, old_logp_BxT: Array, advantages_BxT: Array, mask_BxT: Array,
              segment_ids_BxT: Array, *, reduce: Reduce = token_mean,
              clip_low: float = 3e-4, clip_high: float = 4e-4,
              is_weights_BxT: Optional[Array] = None) -> LossOut:
  """GSPO: a clipped surrogate on the sequence-level ratio (Zheng et al., 2025).

  s = exp(mean over the sequence's action tokens of (logp - old_logp)). Uses the
  GSPO-token form s_t = sg(s) * exp(logp_t - sg(logp_t)), whose gradient equals
  GSPO's when the advantage is constant over a sequence (and which also admits
  per-token advantages) under `seq_mean_token_mean`, GSPO's mean over sequences;
  `token_mean` weights each sequence by its length instead. Clipping is decided by
  the sequence ratio.
  """
  chex.assert_equal_shape([logp_BxT, old_logp_BxT, advantages_BxT, mask_BxT, segment_ids_BxT])
  m = mask_BxT.astype(jnp.float32)
  seq_log_ratio = (segment_totals(_masked(logp_BxT - old_logp_BxT, m), segment_ids_BxT)
                   / jnp.maximum(segment_totals(m, segment_ids_BxT), 1.0))
  seq_ratio = jnp.exp(jnp.clip(seq_log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))
  token_ratio = jax.lax.stop_gradient(seq_ratio) * jnp.exp(
      logp_BxT - jax.lax.stop_gradient(logp_BxT))
  lo, hi = 1.0 - clip_low, 1.0 + clip_high
  unclipped = -advantages_BxT * token_ratio
  # Clip the value, not the gradient path: outside [lo, hi] the clipped branch is constant.
  clipped_ratio = jnp.where(seq_ratio < lo, lo, jnp.where(seq_ratio > hi, hi, token_ratio))
  clipped = -advantages_BxT * clipped_ratio
  loss = jnp.maximum(unclipped, clipped)
  clip_frac = (clipped > unclipped).astype(jnp.float32)
  total, denom = reduce(_weighted(loss, is_weights_BxT), mask_BxT)
  return LossOut(total, denom, {"clip_frac": token_mean(clip_frac, mask_BxT)})


def reinforce_loss(logp_BxT: Array, advantages_BxT: Array, mask_BxT: Array, *,
                   reduce: Reduce = token_mean,
                   is_weights_BxT: Optional[Array] = None) -> LossOut:
  """Plain REINFORCE: loss = -A logp (Williams, 1992)."""
  chex.assert_equal_shape([logp_BxT, advantages_BxT, mask_BxT])
  total, denom = reduce(_weighted(-advantages_BxT * logp_BxT, is_weights_BxT), mask_BxT)
  return LossOut(total, denom, {})


# -- rollout / learner mismatch ----------------------------------------------------------


class Correction(NamedTuple):
  weights: Array  # [B, T] importance weights (stop-gradient), 1 where unused
  mask: Array  # [B, T] mask after dropping tokens (mask mode)
  metrics: dict[str, SumDenom]


# Log importance weight per token at each level, from per-token log-ratios (masked).
CORRECTION_LEVELS: dict[str, Callable[[Array, Array, Array], Array]] = {
    "token": lambda log_w, m, seg: log_w,
    "sequence": lambda log_w, m, seg: segment_totals(log_w, seg),
    "geometric": lambda log_w, m, seg: segment_totals(log_w, seg) / jnp.maximum(
        segment_totals(m, seg), 1.0),
}


def _truncate(w, m, low, high):
  return jnp.minimum(w, high), m, (w > high).astype(jnp.float32)


def _mask_out(w, m, low, high):
  hit = ((w < low) | (w > high)).astype(jnp.float32)
  return w, m * (1.0 - hit), hit


# (weights, mask, hit) from the weights, the mask and the bounds.
CORRECTION_MODES: dict[str, Callable[..., tuple[Array, Array, Array]]] = {
    "truncate": _truncate, "mask": _mask_out}


def rollout_correction(old_logp_BxT: Array, rollout_logp_BxT: Array, mask_BxT: Array,
                       segment_ids_BxT: Array, *, mode: str = "truncate",
                       level: str = "token", low: float = 0.5, high: float = 2.0) -> Correction:
  """Importance weights for the gap between the rollout engine and the learner.

  w = pi_old / pi_rollout, from log-probs, at `level`:
    token: per token; sequence: product over the sequence's action tokens;
    geometric: geometric mean over them (exp of the mean log-ratio).
  `mode`:
    truncate: w = min(w, high) (truncated IS, "TIS"; Yao et al., 2025);
    mask: tokens (or whole sequences, at sequence/geometric level) whose w
      leaves [low, high] are dropped from the loss; the rest keep w.
  Reports the fraction of action tokens masked or truncated.
  """
  chex.assert_equal_shape([old_logp_BxT, rollout_logp_BxT, mask_BxT, segment_ids_BxT])
  m = mask_BxT.astype(jnp.float32)
  if level not in CORRECTION_LEVELS:
    raise ValueError(f"unknown correction level {level!r}; known: {sorted(CORRECTION_LEVELS)}")
  if mode not in CORRECTION_MODES:
    raise ValueError(f"unknown correction mode {mode!r}; known: {sorted(CORRECTION_MODES)}")
  log_w = CORRECTION_LEVELS[level](_masked(old_logp_BxT - rollout_logp_BxT, m), m,
                                   segment_ids_BxT)
  w = jax.lax.stop_gradient(jnp.exp(jnp.clip(log_w, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)))
  weights, new_mask, hit = CORRECTION_MODES[mode](w, m, low, high)
  return Correction(weights, new_mask, {
      "is_masked_frac" if mode == "mask" else "is_truncated_frac": token_mean(hit, m),
      "is_weight_mean": token_mean(w, m),
      "rollout_abs_logp_diff": token_mean(jnp.abs(old_logp_BxT - rollout_logp_BxT), m),
  })


# -- KL to a reference ----------------------------------------------------------------


# Per-token KL estimators of the log-ratio log r = logp - ref_logp.
KL_ESTIMATORS: dict[str, Callable[[Array], Array]] = {
    "k1": lambda log_r: log_r,
    "k2": lambda log_r: 0.5 * jnp.square(log_r),
    "k3": lambda log_r: _exp_capped(-log_r) - 1.0 + log_r,
}


def kl_penalty(logp_BxT: Array, ref_logp_BxT: Array, estimator: str = "k3") -> Array:
  """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, 2020).

  k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) - 1 + log r, with
  log r = logp - ref_logp. k1 and k3 are unbiased values; k3 is non-negative.
  As a loss differentiated on samples of pi, their gradients differ: k2's is
  KL(pi || pi_ref)'s, k3's (GRPO's) KL(pi_ref || pi)'s, and k1's is zero in
  expectation (E_pi[grad log pi] = 0): the learner refuses k1 with a KL coefficient.
  """
  chex.assert_equal_shape([logp_BxT, ref_logp_BxT])
  if estimator not in KL_ESTIMATORS:
    raise ValueError(f"unknown KL estimator {estimator!r}; known: {sorted(KL_ESTIMATORS)}")
  # (no clamp: reference log-probs below -20 are common in large vocabularies, and a
  # clamp gave the tokens that drifted furthest from the reference no gradient)
  return KL_ESTIMATORS[estimator](logp_BxT - ref_logp_BxT)


# -- stale tokens ---------------------------------------------------------------------


STALENESS_MODES = ("none", "mask", "decay")


class Staleness(NamedTuple):
  """Per-token advantage scale `[B, T]`, the loss mask after staleness masking, metrics."""
  scale: Array
  mask: Array
  metrics: dict


def staleness_weighting(versions_BxT: Array, policy_version: Array, mask_BxT: Array, *,
                        mode: str = "none", max_staleness: int = 1, decay: float = 0.5
                        ) -> Staleness:
  """How much tokens sampled by older policies count (AReaL's decoupled staleness).

  A token's staleness is `policy_version - versions` (the updates since the policy
  that sampled it). `mask` drops tokens staler than `max_staleness` from the loss and
  its denominators (`per_rollout`'s excepted: see there); `decay` keeps them but scales their advantage by
  `decay ** staleness` (their gradient shrinks, the denominators do not change);
  `none` trains every token alike. Tokens whose version is unknown (< 0) count as fresh.
  """
  if mode not in STALENESS_MODES:
    raise ValueError(f"unknown staleness mode {mode!r}; known: {list(STALENESS_MODES)}")
  stale = jnp.where(versions_BxT >= 0, policy_version - versions_BxT, 0).astype(jnp.float32)
  stale = jnp.maximum(stale, 0.0)
  scale = jnp.ones_like(mask_BxT)
  new_mask = mask_BxT
  if mode == "mask":
    new_mask = mask_BxT * (stale <= max_staleness)
  elif mode == "decay":
    scale = jnp.power(jnp.float32(decay), stale)
  m = mask_BxT
  return Staleness(scale, new_mask, {
      "stale_masked_frac": token_mean(mask_BxT - new_mask, m),
      "stale_scale_mean": token_mean(scale, m),
  })

"""Advantage estimators: pure functions of rewards, group ids and turn structure.

Sample-level estimators (GRPO, RLOO) take one reward per sample `[N]` and the
sample's group id (the G samples drawn for one task share a group). Chunked-MDP
credit treats each turn (the span between two environment interactions) as
one step: per-turn rewards `[N, K]` are discounted over turns, not tokens, and
each turn's return is given to that turn's action tokens.
"""

from __future__ import annotations

from typing import Optional

import chex
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


# Valid values of a group this many float32 ulps apart (of the larger) are equal: two
# returns equal in exact arithmetic, summed from other rewards in another order, come out
# an ulp or so apart.
FLAT_ULPS = 16


def flat(values) -> bool:
  """Whether a group's values are one value to its advantages (`_group_stats`' rule, in
  float32: equal within FLAT_ULPS of the larger's rounding); no value is flat too."""
  v = [float(x) for x in np.asarray(values, np.float32).ravel()]
  if not v:
    return True
  hi, lo = max(v), min(v)
  return hi == lo or hi - lo <= FLAT_ULPS * float(np.finfo(np.float32).eps) * max(abs(hi),
                                                                                 abs(lo))


def _group_stats(values_N: Array, valid_N: Array, group_ids_N: Array, num_groups: int):
  """Per-sample mean, std and count of the valid values of its group.

  A group whose valid values are all equal (within FLAT_ULPS of rounding) gets each
  sample's own value as its mean and a std of exactly 0: float32 rounding of the sum
  would otherwise leave r - mean at ~1e-8, which the division by (std + eps) blows up
  into a sizeable advantage for a group that carries no signal (0.056 for eight rewards
  of 0.7; 0.057 for a chunk return of -0.1 + 1.0 beside 0.3 + 0.3 + 0.3: red team 26).
  The std is taken of deviations scaled by their largest, so that rewards of 1e19 do
  not square past float32 (it was inf: every advantage 0)."""
  v = valid_N.astype(jnp.float32)
  # (an invalid sample's value counts nowhere: a nan there, times 0, was nan in its
  # group's sums, every advantage of the group nan; an audit)
  values_N = jnp.where(valid_N, values_N, 0.0)
  count = jax.ops.segment_sum(v, group_ids_N, num_segments=num_groups)
  hi = jax.ops.segment_max(jnp.where(valid_N, values_N, -jnp.inf), group_ids_N,
                           num_segments=num_groups)
  lo = jax.ops.segment_min(jnp.where(valid_N, values_N, jnp.inf), group_ids_N,
                           num_segments=num_groups)
  big = jnp.maximum(jnp.abs(hi), jnp.abs(lo))
  # The mean of values scaled by the group's largest (summed as they are, [3e38, 3e38, 0]
  # passed float32's range: every advantage nan, a run stopped blaming its learning rate;
  # red team 37); a group of zeros (or no valid value) sums zeros.
  size = jnp.where(jnp.isfinite(big) & (big > 0), big, 1.0)
  total = jax.ops.segment_sum(values_N / size[group_ids_N] * v, group_ids_N,
                              num_segments=num_groups)
  mean = total / jnp.maximum(count, 1.0) * size
  tol = FLAT_ULPS * jnp.finfo(jnp.float32).eps * big
  flat = (hi == lo) | (hi - lo <= tol)  # (a group with no valid value too)
  flat_N = flat[group_ids_N]
  dev = jnp.where(flat_N, 0.0, values_N - mean[group_ids_N]) * v
  scale = jax.ops.segment_max(jnp.abs(dev), group_ids_N, num_segments=num_groups)
  safe = jnp.where(scale > 0, scale, 1.0)
  sq = jax.ops.segment_sum(jnp.square(dev / safe[group_ids_N]), group_ids_N,
                           num_segments=num_groups)
  # Population std (ddof=0), as DeepSeekMath's GRPO.
  std = jnp.where(scale > 0, safe * jnp.sqrt(sq / jnp.maximum(count, 1.0)), 0.0)
  return (jnp.where(flat_N, values_N, mean[group_ids_N]), std[group_ids_N],
          count[group_ids_N])


def group_normalized(rewards_N: Array, group_ids_N: Array, num_groups: int, *,
                     scale_by_std: bool = True, eps: float = 1e-6,
                     valid_N: Optional[Array] = None) -> Array:
  """GRPO advantages: (r - group mean) / (group std + eps), or without the std.

  (Shao et al., 2024, DeepSeekMath; `scale_by_std=False` is Dr. GRPO.)
  Invalid samples (`valid_N` false) do not count in the statistics and get 0.
  """
  chex.assert_rank([rewards_N, group_ids_N], 1)
  chex.assert_equal_shape([rewards_N, group_ids_N])
  valid = jnp.ones_like(rewards_N, bool) if valid_N is None else valid_N
  r = rewards_N.astype(jnp.float32)
  mean, std, _ = _group_stats(r, valid, group_ids_N, num_groups)
  adv = r - mean
  if scale_by_std:
    adv = adv / (std + eps)
  return jnp.where(valid, adv, 0.0)


def rloo(rewards_N: Array, group_ids_N: Array, num_groups: int, *,
         valid_N: Optional[Array] = None) -> Array:
  """Leave-one-out baseline: r_i minus the mean reward of the other group members.

  (Kool et al., 2019; Ahmadian et al., 2024.) A sample alone in its group gets 0.
  """
  chex.assert_rank([rewards_N, group_ids_N], 1)
  valid = jnp.ones_like(rewards_N, bool) if valid_N is None else valid_N
  r = rewards_N.astype(jnp.float32)
  mean, _, count = _group_stats(r, valid, group_ids_N, num_groups)
  # (the others' mean, mean + (mean - r) / (n - 1): mean x n passed float32's range for
  # rewards near its top)
  others = mean + (mean - r) / jnp.maximum(count - 1.0, 1.0)
  return jnp.where(valid & (count > 1), r - others, 0.0)


def reward_to_go(rewards_K: Array, valid_K: Array, gamma: float,
                 bootstrap: Array | float = 0.0) -> Array:
  """Discounted return of each chunk of one episode: G_k = r_k + gamma G_{k+1}.

  Args:
    rewards_K: per-chunk rewards (process rewards, plus the terminal reward on
      the last chunk; see `turn_rewards`).
    valid_K: which chunks exist (episodes shorter than K are padded at the end).
    gamma: discount per chunk.
    bootstrap: value of the state after the last chunk (0 for a terminated
      episode; the next part's return when an episode is split in two).
  Returns:
    `[K]` returns, 0 on padding.
  """
  chex.assert_rank([rewards_K, valid_K], 1)

  def step(carry, x):
    r, valid = x
    g = jnp.where(valid, r + gamma * carry, carry)
    return g, jnp.where(valid, g, 0.0)

  _, returns = jax.lax.scan(step, jnp.asarray(bootstrap, jnp.float32),
                            (rewards_K.astype(jnp.float32), valid_K), reverse=True)
  return returns


def turn_rewards(process_rewards_NxK: Array, terminal_N: Array, valid_NxK: Array) -> Array:
  """Per-turn rewards: process rewards, with the terminal reward added to the last turn."""
  chex.assert_rank([process_rewards_NxK, valid_NxK], 2)
  K = valid_NxK.shape[1]
  last = jnp.sum(valid_NxK.astype(jnp.int32), axis=1) - 1
  is_last = jnp.arange(K)[None, :] == last[:, None]
  return jnp.where(valid_NxK, process_rewards_NxK, 0.0) + jnp.where(
      is_last, terminal_N[:, None], 0.0)


def chunk_advantages(rewards_NxK: Array, valid_NxK: Array, gamma: float, *,
                     group_ids_N: Optional[Array] = None, num_groups: int = 0,
                     scale_by_std: bool = False, eps: float = 1e-6,
                     bootstrap_N: Optional[Array] = None) -> Array:
  """Chunked-MDP advantages: per-turn reward-to-go, optionally baselined by the group.

  With `group_ids_N`, the baseline of turn k is the mean return at turn k over
  the group's samples that reached turn k (and, with `scale_by_std`, divided by
  their std); a turn only one sample reached has no baseline of its own (its return was
  it: advantage 0 whatever it was, so an episode that outlasted its siblings and then
  failed was never pushed down: red team 17) and takes its sample's advantage at the
  last turn others reached too (turn 0 at least; a baseline taken from another turn's
  returns mixed discounting and process rewards across turns, and with its std, 0 or
  tiny, blew up: a reviewer). Returns `[N, K]`, 0 on padding.
  """
  chex.assert_equal_shape([rewards_NxK, valid_NxK])
  boot = jnp.zeros(rewards_NxK.shape[:1]) if bootstrap_N is None else bootstrap_N
  returns = jax.vmap(reward_to_go, in_axes=(0, 0, None, 0))(rewards_NxK, valid_NxK, gamma, boot)
  if group_ids_N is None:
    return returns
  N, K = returns.shape
  # Baseline per (group, turn index): flatten to groups of size num_groups * K.
  keys = group_ids_N[:, None] * K + jnp.arange(K)[None, :]
  mean, std, count = (x.reshape(N, K) for x in _group_stats(
      returns.reshape(-1), valid_NxK.reshape(-1), keys.reshape(-1), num_groups * K))
  adv = returns - mean
  if scale_by_std:
    adv = adv / (std + eps)
  # A lone turn: the advantage of the sample's last turn that others reached too.
  shared = jnp.where((count > 1) & valid_NxK, jnp.arange(K)[None, :], 0)
  adv = jnp.take_along_axis(adv, jax.lax.cummax(shared, axis=1), axis=1)
  return jnp.where(valid_NxK, adv, 0.0)


def to_tokens(values_NxK: Array, sample_idx_BxT: Array, turn_ids_BxT: Array,
              mask_BxT: Array) -> Array:
  """Gives each action token the value of its sample's turn: values[sample, turn].

  For sample-level advantages pass `values_N[:, None]` and `turn_ids = 0`.
  """
  chex.assert_rank(values_NxK, 2)
  chex.assert_equal_shape([sample_idx_BxT, turn_ids_BxT, mask_BxT])
  K = values_NxK.shape[1]
  out = values_NxK[sample_idx_BxT, jnp.clip(turn_ids_BxT, 0, K - 1)]
  return jnp.where(mask_BxT > 0, out, 0.0)


def distillation(teacher_logp_T: Array, student_logp_T: Array, mask_T: Array,
                 coef: float = 1.0) -> Array:
  """On-policy distillation's per-token advantage: `coef * (log pi_teacher - log pi_student)`
  of each sampled action token (0 elsewhere).

  Its expectation under the student is `-coef * KL(student || teacher)` per token, so the
  policy gradient with these advantages descends the reverse KL to the teacher on the
  student's own samples (no discounting: each token is credited with its own term).
  """
  chex.assert_equal_shape([teacher_logp_T, student_logp_T, mask_T])
  return jnp.where(mask_T > 0, coef * (teacher_logp_T - student_logp_T), 0.0)

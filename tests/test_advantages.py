import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent import advantages as adv


def test_group_normalized_hand_computed():
  r = jnp.asarray([1.0, 0.0, 0.0, 1.0, 5.0, 5.0])
  g = jnp.asarray([0, 0, 0, 0, 1, 1])
  # group 0: mean 0.5, population std 0.5; group 1: all equal -> 0
  np.testing.assert_allclose(adv.group_normalized(r, g, 2), [1, -1, -1, 1, 0, 0], atol=1e-5)
  np.testing.assert_allclose(adv.group_normalized(r, g, 2, scale_by_std=False),
                             [0.5, -0.5, -0.5, 0.5, 0, 0], atol=1e-6)


def test_group_normalized_ignores_invalid_samples():
  r = jnp.asarray([1.0, 0.0, 123.0])
  g = jnp.asarray([0, 0, 0])
  out = adv.group_normalized(r, g, 1, scale_by_std=False, valid_N=jnp.asarray([1, 1, 0], bool))
  np.testing.assert_allclose(out, [0.5, -0.5, 0.0])


def test_rloo_hand_computed():
  r = jnp.asarray([1.0, 0.0, 0.0, 3.0])
  g = jnp.asarray([0, 0, 0, 1])
  # r_i - mean(others): 1 - 0, 0 - 0.5, 0 - 0.5; a group of one gets 0
  np.testing.assert_allclose(adv.rloo(r, g, 2), [1.0, -0.5, -0.5, 0.0], atol=1e-6)


class GroupReferenceTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_grpo_and_rloo_match_numpy(self):
    rng = np.random.default_rng(0)
    n_groups, size = 5, 8
    r = rng.normal(size=n_groups * size).astype(np.float32)
    g = np.repeat(np.arange(n_groups), size)
    grpo = self.variant(adv.group_normalized, static_argnums=2)(r, g, n_groups)
    loo = self.variant(adv.rloo, static_argnums=2)(r, g, n_groups)
    rr = r.reshape(n_groups, size)
    want = (rr - rr.mean(1, keepdims=True)) / (rr.std(1, keepdims=True) + 1e-6)
    want_loo = rr - (rr.sum(1, keepdims=True) - rr) / (size - 1)
    np.testing.assert_allclose(grpo, want.reshape(-1), atol=1e-4)
    np.testing.assert_allclose(loo, want_loo.reshape(-1), atol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_reward_to_go_matches_numpy(self):
    rng = np.random.default_rng(1)
    r = rng.normal(size=12).astype(np.float32)
    valid = np.arange(12) < 9
    out = self.variant(adv.reward_to_go, static_argnums=2)(r, valid, 0.9)
    want = np.zeros(12)
    g = 0.0
    for k in reversed(range(9)):
      g = r[k] + 0.9 * g
      want[k] = g
    np.testing.assert_allclose(out, want, atol=1e-5)


def test_reward_to_go_hand_computed():
  out = adv.reward_to_go(jnp.asarray([1.0, 0.0, 2.0, 7.0]), jnp.asarray([1, 1, 1, 0], bool), 0.5)
  # G2 = 2, G1 = 0 + 0.5 * 2 = 1, G0 = 1 + 0.5 * 1 = 1.5; padding -> 0
  np.testing.assert_allclose(out, [1.5, 1.0, 2.0, 0.0])


def test_splitting_an_episode_gives_the_same_returns():
  rng = np.random.default_rng(2)
  r = jnp.asarray(rng.normal(size=10), jnp.float32)
  ones = jnp.ones(10, bool)
  full = adv.reward_to_go(r, ones, 0.95)
  second = adv.reward_to_go(r[6:], ones[6:], 0.95)
  # The first part bootstraps from the value after it: the second part's first return.
  first = adv.reward_to_go(r[:6], ones[:6], 0.95, bootstrap=second[0])
  np.testing.assert_allclose(jnp.concatenate([first, second]), full, atol=1e-5)


def test_turn_rewards_add_terminal_to_last_turn():
  process = jnp.asarray([[0.1, 0.2, 0.3], [0.5, 0.0, 0.0]])
  valid = jnp.asarray([[1, 1, 1], [1, 0, 0]], bool)
  out = adv.turn_rewards(process, jnp.asarray([1.0, 2.0]), valid)
  np.testing.assert_allclose(out, [[0.1, 0.2, 1.3], [2.5, 0.0, 0.0]])


def test_chunk_advantages_with_group_baseline_hand_computed():
  rewards = jnp.asarray([[0.0, 1.0], [0.0, 0.0], [2.0, 0.0]])
  valid = jnp.asarray([[1, 1], [1, 1], [1, 0]], bool)
  returns = adv.chunk_advantages(rewards, valid, 1.0)
  np.testing.assert_allclose(returns, [[1, 1], [0, 0], [2, 0]])
  out = adv.chunk_advantages(rewards, valid, 1.0, group_ids_N=jnp.asarray([0, 0, 0]),
                             num_groups=1)
  # turn 0 baseline: mean(1, 0, 2) = 1; turn 1 baseline over samples with a turn 1: mean(1, 0)
  np.testing.assert_allclose(out, [[0.0, 0.5], [-1.0, -0.5], [1.0, 0.0]])



def test_a_turn_only_one_sample_reached_takes_its_last_shared_turns_advantage():
  """The baseline of a turn one sample alone reached was its own return: advantage 0,
  so an episode that stalled past its siblings and then answered wrong was never
  pushed down for it (red team 17: [-0.5, 0, 0, 0]). It takes the sample's advantage
  at the last turn others reached too, bounded as theirs are (a turn-0 baseline with
  its std blew up to 5e5 when the turn-0 returns were equal: a reviewer)."""
  # Three answer at once (right, right, wrong); one stalls three turns, then is wrong.
  rewards = jnp.asarray([[1.0, 0, 0, 0], [1.0, 0, 0, 0], [0.0, 0, 0, 0], [0.0, 0, 0, 0]])
  valid = jnp.asarray([[1, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]], bool)
  out = adv.chunk_advantages(rewards, valid, 1.0, group_ids_N=jnp.zeros(4, jnp.int32),
                             num_groups=1)
  np.testing.assert_allclose(out, [[0.5, 0, 0, 0], [0.5, 0, 0, 0], [-0.5, 0, 0, 0],
                                   [-0.5, -0.5, -0.5, -0.5]])
  # Two at a turn still compare with each other.
  valid2 = valid.at[2].set(jnp.asarray([1, 1, 0, 0], bool))
  out = adv.chunk_advantages(rewards.at[2, 1].set(1.0), valid2, 1.0,
                             group_ids_N=jnp.zeros(4, jnp.int32), num_groups=1)
  np.testing.assert_allclose(out[:, 1], [0, 0, 0.5, -0.5])
  # Equal turn-0 returns (std 0), a lone later turn with another return (gamma 0.5):
  # it takes its turn 0's advantage, 0, not (return - mean) / 1e-6.
  out = adv.chunk_advantages(jnp.asarray([[0.0, 1.0], [0.5, 0.0]]),
                             jnp.asarray([[1, 1], [1, 0]], bool), 0.5,
                             group_ids_N=jnp.zeros(2, jnp.int32), num_groups=1,
                             scale_by_std=True)
  np.testing.assert_allclose(out, [[0.0, 0.0], [0.0, 0.0]], atol=1e-6)
  # A success slower than its sibling (gamma 0.9): all its turns share one sign.
  out = adv.chunk_advantages(jnp.asarray([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]),
                             jnp.asarray([[1, 1, 1], [1, 0, 0]], bool), 0.9,
                             group_ids_N=jnp.zeros(2, jnp.int32), num_groups=1)
  np.testing.assert_allclose(out, [[-0.095] * 3, [0.095, 0, 0]], atol=1e-6)


def test_to_tokens_gathers_sample_turn_values():
  values = jnp.asarray([[1.0, 2.0], [3.0, 4.0]])
  sample = jnp.asarray([[0, 0, 0, 1, 1, 1]])
  turn = jnp.asarray([[0, 0, 1, 0, 1, 1]])
  mask = jnp.asarray([[0, 1, 1, 0, 1, 1]], jnp.float32)
  np.testing.assert_allclose(adv.to_tokens(values, sample, turn, mask), [[0, 1, 2, 0, 4, 4]])


def test_gradient_free_but_jittable_end_to_end():
  f = jax.jit(lambda r, v: adv.chunk_advantages(r, v, 0.9, group_ids_N=jnp.asarray([0, 0]),
                                                num_groups=1, scale_by_std=True))
  out = f(jnp.ones((2, 3)), jnp.ones((2, 3), bool))
  assert bool(jnp.all(jnp.isfinite(out)))
  assert float(jnp.abs(out).max()) == pytest.approx(0.0)  # identical samples: no advantage


@pytest.mark.parametrize("reward", [0.7, 0.1, 1.0 / 3.0, 123.456])
def test_equal_rewards_give_exactly_zero_advantage_with_std_scaling(reward):
  """Float32 rounding of a group's mean must not turn into an advantage: eight equal
  rewards of 0.7 gave +0.056 each with scale_by_std (the mean was off by ~6e-8)."""
  from jaxagent import advantages as adv

  r = jnp.full((8,), reward, jnp.float32)
  gid = jnp.zeros((8,), jnp.int32)
  np.testing.assert_array_equal(adv.group_normalized(r, gid, 1, scale_by_std=True), 0.0)
  returns = jnp.full((8, 3), reward, jnp.float32)
  out = adv.chunk_advantages(returns, jnp.ones((8, 3), bool), 0.0, group_ids_N=gid,
                             num_groups=1, scale_by_std=True)
  np.testing.assert_array_equal(out, 0.0)
  # A group with signal is unchanged: mean 0.5, std 0.5.
  mixed = adv.group_normalized(jnp.asarray([0.0, 1.0] * 4), gid, 1)
  np.testing.assert_allclose(mixed, [-1.0, 1.0] * 4, atol=1e-5)


def test_returns_equal_but_for_rounding_give_no_advantage():
  """Red team 26: two episodes' turn-0 returns, equal in exact arithmetic (-0.1 + 1.0 and
  0.3 + 0.3 + 0.3 + 0.0), summed in float32 in another order come out an ulp apart: the
  std, about an ulp, turned it into an advantage of 0.057 for a turn with no signal."""
  from jaxagent import advantages as adv

  rewards = jnp.asarray([[-0.1, 1.0, 0.0, 0.0], [0.3, 0.3, 0.3, 0.0]], jnp.float32)
  valid = jnp.asarray([[True, True, False, False], [True] * 4])
  out = adv.chunk_advantages(rewards, valid, 1.0, group_ids_N=jnp.zeros(2, jnp.int32),
                             num_groups=1, scale_by_std=True)
  assert float(out[0, 0]) == float(out[1, 0]) == 0.0
  # Rewards whose squares pass float32 keep their advantages (they were all 0).
  big = adv.group_normalized(jnp.asarray([1e19, -1e19, 3e19, 0.0]), jnp.zeros(4, jnp.int32), 1)
  np.testing.assert_allclose(big, [0.169, -1.1832, 1.5213, -0.5071], atol=1e-3)


def test_rewards_near_float32s_top_keep_finite_advantages_and_small_differences_count():
  """Red team 37: a group's sum of [3e38, 3e38, 0] passed float32's range (every GRPO
  advantage nan, Dr. GRPO's and RLOO's -inf: the run stopped blaming its learning rate);
  and rewards a real difference apart (840 ulps) keep their advantage, as rounding's
  (FLAT_ULPS) does not."""
  from jaxagent import advantages as adv

  gid = jnp.zeros(3, jnp.int32)
  for r in ([3e38, 3e38, 0.0], [2e38, 2e38, -1.0]):
    r = jnp.asarray(r, jnp.float32)
    for out in (adv.group_normalized(r, gid, 1), adv.rloo(r, gid, 1),
                adv.group_normalized(r, gid, 1, scale_by_std=False)):
      assert bool(jnp.all(jnp.isfinite(out))), out
    np.testing.assert_allclose(adv.group_normalized(r, gid, 1), [0.7071, 0.7071, -1.4142],
                               atol=1e-4)
  np.testing.assert_allclose(adv.rloo(jnp.asarray([3e38, 3e38, 0.0]), gid, 1),
                             [1.5e38, 1.5e38, -3e38], rtol=1e-5)
  close = adv.group_normalized(jnp.asarray([1.0, 1.0001]), jnp.zeros(2, jnp.int32), 1)
  assert float(close[0]) < -0.9 and float(close[1]) > 0.9, close  # (std + eps: not +-1)


def test_a_group_carries_signal_exactly_when_its_advantages_can_differ_from_zero():
  """`carries_signal` (which groups dynamic sampling keeps) by the advantages' own rule:
  an absolute 1e-9 kept [1000, 1000.0009] (advantages 0: trained on nothing) and dropped
  [0, 1e-10] (advantages +-1: red team 37)."""
  from jaxagent import advantages as adv
  from jaxagent.config import AdvantageConfig
  from jaxagent.scheduler import Group, carries_signal
  from tests.test_scheduler import episode

  for rewards in ([1000.0, 1000.0009], [0.0, 1e-10], [0.1 + 0.2, 0.3], [0.0, 1.0],
                  [7.0, 7.0]):
    g = Group(0, 0)
    g.episodes = [episode(0, f"s{i}", "g", reward=r) for i, r in enumerate(rewards)]
    a = adv.group_normalized(jnp.asarray(rewards, jnp.float32), jnp.zeros(2, jnp.int32), 1)
    assert carries_signal(g, AdvantageConfig()) == bool(jnp.any(a != 0)), (rewards, a)


def test_groups_with_signal_under_a_step_wide_baseline_count_only_steps_whose_rewards_differ():
  """With `baseline: batch` (the default run's) every group is kept by dynamic sampling,
  and `groups_with_signal` counted every group on every step, all rewards 0 too (a new
  user read signal where the advantages were all 0)."""
  from jaxagent.config import AdvantageConfig
  from jaxagent.metrics import episode_metrics
  from jaxagent.scheduler import Group, step_signal
  from tests.test_scheduler import episode

  def groups(*rewards):
    out = []
    for k, rs in enumerate(rewards):
      g = Group(k, k)
      g.episodes = [episode(k, f"g{k}-{i}", f"g{k}", reward=r) for i, r in enumerate(rs)]
      out.append(g)
    return out

  batch = AdvantageConfig(baseline="batch")
  for rewards, expected in ((([0.0, 0.0], [0.0, 0.0]), 0), (([0.0, 0.0], [1.0, 1.0]), 2),
                            (([0.0, 1.0], [0.0, 0.0]), 2)):
    played = groups(*rewards)
    row = episode_metrics(played, played, 0, step_signal(played, batch))
    assert row["groups_with_signal"] == expected, rewards
  # The chunk estimator: equal totals whose turns differ have advantages (+-1 at turn 0)
  played = groups([1.0, 1.0])
  played[0].episodes[0].turn_rewards, played[0].episodes[1].turn_rewards = [1.0, 0.0], \
      [0.0, 1.0]
  row = episode_metrics(played, played, 0, step_signal(
      played, AdvantageConfig(baseline="batch", estimator="chunk")))
  assert row["groups_with_signal"] == 1
  played = groups([0.0, 0.0], [0.0, 1.0])  # a group's own baseline: its own rewards
  row = episode_metrics(played, played, 0, step_signal(played, AdvantageConfig()))
  assert row["groups_with_signal"] == 1


def test_advantages_past_float32s_range_are_said_with_the_task():
  """Rewards each within float32's range whose leave-one-out differences are not (a
  reward of 1e39 is refused as it is reported: `envs.base`) stop the run naming the task,
  not as a non-finite update blaming the learning rate."""
  from jaxagent.config import AdvantageConfig
  from jaxagent.scheduler import Group, compute_advantages
  from tests.test_scheduler import episode

  g = Group(0, 0)
  g.episodes = [episode("huge", f"s{i}", "g", reward=r)
                for i, r in enumerate([3e38, -3e38, 3e38])]
  with pytest.raises(ValueError, match="task 'huge'.*float32's range"):
    compute_advantages([g], AdvantageConfig(estimator="rloo"))


def _chunk_reference(rewards, valid, gamma, groups, boot, scale_by_std, eps=1e-6):
  """`chunk_advantages` by its definition, in numpy, one (group, turn) at a time."""
  N, K = rewards.shape
  returns = np.zeros((N, K))
  for n in range(N):
    g = boot[n]
    for k in reversed(range(K)):
      if valid[n, k]:
        g = rewards[n, k] + gamma * g
        returns[n, k] = g
  out, shared = np.zeros((N, K)), np.zeros((N, K), bool)
  for n in range(N):
    for k in range(K):
      if not valid[n, k]:
        continue
      peers = [m for m in range(N) if groups[m] == groups[n] and valid[m, k]]
      values = returns[peers, k]
      out[n, k] = returns[n, k] - values.mean()
      if scale_by_std:
        out[n, k] /= values.std() + eps
      shared[n, k] = len(peers) > 1
  for n in range(N):  # a lone turn: the sample's last turn others reached too (turn 0)
    for k in range(K):
      if valid[n, k] and not shared[n, k]:
        last = max([j for j in range(k + 1) if shared[n, j]], default=0)
        out[n, k] = out[n, last]
  return out


@pytest.mark.parametrize("scale_by_std", [False, True])
def test_chunk_advantages_equal_their_definition_over_groups_of_unequal_episodes(
    scale_by_std):
  """Against the definition on random episodes: three groups of unequal lengths (padded),
  bootstrapped returns, turns only one sample reached. (Tests by mutation: groups whose
  (group, turn) keys overlapped, a lone turn taking turn 0's advantage, padding that
  reset the bootstrap all passed the hand-computed cases.)"""
  rng = np.random.default_rng(3)
  N, K, gamma = 9, 5, 0.9
  groups = np.repeat(np.arange(3), 3)
  lengths = np.array([5, 3, 2, 4, 4, 1, 5, 2, 3])
  valid = np.arange(K)[None, :] < lengths[:, None]
  rewards = np.where(valid, rng.normal(size=(N, K)), 0.0).astype(np.float32)
  boot = rng.normal(size=N).astype(np.float32)
  got = adv.chunk_advantages(jnp.asarray(rewards), jnp.asarray(valid), gamma,
                             group_ids_N=jnp.asarray(groups), num_groups=3,
                             scale_by_std=scale_by_std, bootstrap_N=jnp.asarray(boot))
  np.testing.assert_allclose(got, _chunk_reference(rewards, valid, gamma, groups, boot,
                                                   scale_by_std), rtol=2e-4, atol=2e-5)
  np.testing.assert_allclose(adv.reward_to_go(jnp.asarray([1.0, 2.0, 0.0]),
                                              jnp.asarray([True, True, False]), 0.5,
                                              bootstrap=4.0), [3.0, 4.0, 0.0])


def test_group_normalized_with_std_leaves_invalid_samples_out_of_the_std():
  r = jnp.asarray([1.0, 0.0, 123.0, 2.0, 4.0])
  g = jnp.asarray([0, 0, 0, 1, 1])
  out = adv.group_normalized(r, g, 2, valid_N=jnp.asarray([1, 1, 0, 1, 1], bool))
  np.testing.assert_allclose(out, [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 0.0,
                                   -1 / (1 + 1e-6), 1 / (1 + 1e-6)], rtol=1e-7)


def test_an_invalid_samples_value_that_is_no_number_counts_nowhere():
  """An audit: a nan (or inf) on an invalid sample, times its weight 0, was nan in its
  group's sums: every advantage of the group nan."""
  g, valid = jnp.asarray([0, 0, 0]), jnp.asarray([1, 1, 0], bool)
  for bad in (jnp.nan, jnp.inf):
    r = jnp.asarray([1.0, 0.0, bad])
    np.testing.assert_allclose(adv.group_normalized(r, g, 1, valid_N=valid),
                               [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 0.0], rtol=1e-6)
    np.testing.assert_allclose(adv.rloo(r, g, 1, valid_N=valid), [1.0, -1.0, 0.0])


def test_rloo_leaves_invalid_samples_out_of_the_baseline_and_gives_them_zero():
  """An invalid sample (a failed episode) neither moves its group's leave-one-out baseline
  nor gets an advantage of its own (it got 123 - (-122) = 245 with the valid check gone:
  red team 61's mutation)."""
  r = jnp.asarray([1.0, 0.0, 123.0, 5.0])
  g = jnp.asarray([0, 0, 0, 1])
  out = adv.rloo(r, g, 2, valid_N=jnp.asarray([1, 1, 0, 1], bool))
  # r_i - the other valid member's reward; the invalid one 0; a group of one 0
  np.testing.assert_allclose(out, [1.0, -1.0, 0.0, 0.0], atol=1e-6)


def test_flat_and_the_advantages_agree_at_the_rounding_tolerance_itself():
  """`flat` (which groups dynamic sampling drops) and `_group_stats` share one rule, the
  tolerance included: values exactly FLAT_ULPS ulps of 1.0 apart are one value to both."""
  eps = float(np.finfo(np.float32).eps)
  pair = [1.0, 1.0 - adv.FLAT_ULPS * eps]  # (exact in float32 and in float64)
  assert adv.flat(pair)
  assert adv.flat([-x for x in pair])  # (the tolerance scales with the magnitude)
  np.testing.assert_array_equal(
      adv.group_normalized(jnp.asarray(pair, jnp.float32), jnp.zeros(2, jnp.int32), 1), 0.0)
  wider = [1.0, 1.0 - 2 * adv.FLAT_ULPS * eps]
  assert not adv.flat(wider)
  assert bool(jnp.all(adv.group_normalized(jnp.asarray(wider, jnp.float32),
                                           jnp.zeros(2, jnp.int32), 1) != 0))


def test_turn_rewards_ignore_process_rewards_on_padded_turns():
  """Padding's process rewards (whatever a padded array holds) are no reward: only valid
  turns and the terminal reward on the last valid one count."""
  process = jnp.asarray([[0.1, 9.0, 9.0], [0.2, 0.3, -7.0]])
  valid = jnp.asarray([[1, 0, 0], [1, 1, 0]], bool)
  out = adv.turn_rewards(process, jnp.asarray([1.0, 2.0]), valid)
  np.testing.assert_allclose(out, [[1.1, 0.0, 0.0], [0.2, 2.3, 0.0]], rtol=1e-6)

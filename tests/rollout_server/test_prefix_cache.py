import numpy as np
import pytest

from rollout_server.engine import SamplingParams
from rollout_server.orchestrator import Orchestrator
from rollout_server.prefix_cache import PrefixCache
from tests.rollout_server.conftest import make_engine


def kv(tokens, layers=2):
  """Fake KV whose values encode (layer, token): checks that the right slices come back."""
  t = np.asarray(tokens, np.float32)
  k = np.stack([t + 1000 * l for l in range(layers)])[:, :, None, None]
  return k, -k


def test_match_insert_split_and_counters():
  cache = PrefixCache(1000)
  assert cache.match([1, 2, 3]) == (0, None, None)
  cache.insert([1, 2, 3, 4, 5], *kv([1, 2, 3, 4, 5]))
  cache.insert([1, 2, 9], *kv([1, 2, 9]))  # splits the edge after [1, 2]
  assert cache.tokens == 6
  m, k, v = cache.match([1, 2, 3, 4, 7])
  assert m == 4 and k[0, :, 0, 0].tolist() == [1, 2, 3, 4] and (v == -k).all()
  m, k, _ = cache.match([1, 2, 9, 9])
  assert m == 3 and k[1, :, 0, 0].tolist() == [1001, 1002, 1009]
  assert cache.match([1, 2, 3, 4, 5], max_length=4)[0] == 4
  s = cache.stats()
  assert s["hits"] == 3 and s["misses"] == 1
  assert s["hit_tokens"] == 11 and s["lookup_tokens"] == 3 + 5 + 4 + 4
  assert cache.insert([1, 2, 3], *kv([1, 2, 3])) == 0  # already there


def test_lru_eviction_keeps_memory_bounded():
  cache = PrefixCache(10)
  cache.insert([1, 2, 3, 4], *kv([1, 2, 3, 4]))
  cache.insert([5, 6, 7, 8], *kv([5, 6, 7, 8]))
  cache.match([1, 2])  # [1..4] is now more recent than [5..8]
  cache.insert([9, 10, 11, 12], *kv([9, 10, 11, 12]))
  assert cache.tokens <= 10
  assert cache.match([5, 6])[0] == 0  # least recently used went first
  assert cache.match([1, 2, 3, 4])[0] == 4 and cache.match([9, 10, 11, 12])[0] == 4
  assert cache.stats()["evicted_tokens"] == 4
  cache.clear()
  assert cache.tokens == 0 and cache.match([1])[0] == 0


def test_eviction_merges_a_parent_left_with_one_child():
  cache = PrefixCache(7)
  cache.insert([1, 2, 3], *kv([1, 2, 3]))
  cache.insert([1, 2, 4], *kv([1, 2, 4]))
  cache.match([1, 2, 4])
  cache.insert([7, 7, 7], *kv([7, 7, 7]))  # 7 tokens held: evict the leaf [3]
  m, k, _ = cache.match([1, 2, 4])
  assert m == 3 and k[0, :, 0, 0].tolist() == [1, 2, 4]


def test_mismatched_kv_is_an_error():
  with pytest.raises(ValueError, match="positions"):
    PrefixCache(10).insert([1, 2], *kv([1, 2, 3]))


def test_outputs_identical_with_cache_on_or_off(random_params):
  """Multi-turn sessions and GRPO siblings: same tokens, log-probs within float noise."""
  engine = make_engine()
  params = engine.load_params(random_params)
  results = {}
  for label, cache in (("off", None), ("on", PrefixCache(50_000))):
    orch = Orchestrator(engine, params, prefix_cache=cache).start()
    outs = []
    history = [7, 8, 9, 10, 11, 12]
    for turn in range(3):  # each turn's prompt extends the last turn's prompt and output
      r = orch.generate(history, SamplingParams(seed=turn, max_new_tokens=8), timeout=120)
      outs.append(r)
      history = history + r.output_ids + [20 + turn, 21, 22]
    group = [orch.submit(history, SamplingParams(seed=100 + i, max_new_tokens=6))
             for i in range(4)]
    for r in group:
      r.wait(120)
    outs += group
    results[label] = outs
    if cache is not None:
      assert cache.stats()["hit_tokens"] > 0
      assert outs[1].prefix_hit_tokens >= 6 + 7  # the first turn's prompt and output
      assert all(r.prefix_hit_tokens == len(history) - 1 for r in group[1:])
    orch.stop()
  for off, on in zip(results["off"], results["on"]):
    assert off.output_ids == on.output_ids
    np.testing.assert_allclose(off.output_logprobs, on.output_logprobs, atol=1e-5)


def test_samples_of_one_prompt_share_its_prefill(random_params):
  """A GRPO group submitted at once: the prompt is computed once, the other samples wait
  a round and prefill one token each, several per call."""
  engine = make_engine(prefill_rows=4)
  orch = Orchestrator(engine, engine.load_params(random_params),
                      prefix_cache=PrefixCache(50_000)).start()
  prompt = list(range(1, 41))
  reqs = [orch.submit(prompt, SamplingParams(seed=i, max_new_tokens=1)) for i in range(8)]
  for r in reqs:
    assert r.wait(60) and r.finish_reason == "length"
  s = orch.stats()
  orch.stop()
  assert s["prefill_tokens"] == len(prompt) + 7
  assert s["prefill_calls"] <= 4
  assert len({r.output_ids[0] for r in reqs}) > 1  # each sample drew its own token

"""Prefix sharing through the paged KV pool: whole pages of a session's earlier turns and of
a GRPO group's prompt are shared, not recomputed, and outputs do not change."""

import numpy as np

from rollout_server.engine import SamplingParams
from rollout_server.orchestrator import Orchestrator
from tests.rollout_server.conftest import make_engine


def test_outputs_identical_with_cache_on_or_off(random_params):
  """Multi-turn sessions and GRPO siblings: same tokens, log-probs within float noise."""
  engine = make_engine(page_size=4, extra_pages=2000)
  params = engine.load_params(random_params)
  results = {}
  for label, tokens in (("off", 0), ("on", 8000)):
    orch = Orchestrator(engine, params, prefix_cache_tokens=tokens).start()
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
    if tokens:
      s = orch.stats()
      assert s["prefix_cache"]["hit_tokens"] > 0 and s["shared_pages"] > 0
      # The first turn's prompt and output (13 tokens with KV) are 3 whole pages.
      assert outs[1].prefix_hit_tokens == 12
      assert all(r.prefix_hit_tokens == (len(history) - 1) // 4 * 4 for r in group[1:])
    orch.stop()
  for off, on in zip(results["off"], results["on"]):
    assert off.output_ids == on.output_ids
    np.testing.assert_allclose(off.output_logprobs, on.output_logprobs, atol=1e-5)


def test_samples_of_one_prompt_share_its_pages(random_params):
  """A GRPO group submitted at once: the prompt is computed once; the other samples wait
  for it, take its whole pages and prefill only the tokens of their last, partial page."""
  engine = make_engine(prefill_rows=4, page_size=4, extra_pages=500)
  orch = Orchestrator(engine, engine.load_params(random_params),
                      prefix_cache_tokens=2000).start()
  prompt = list(range(1, 41))
  reqs = [orch.submit(prompt, SamplingParams(seed=i, max_new_tokens=1)) for i in range(8)]
  for r in reqs:
    assert r.wait(60) and r.finish_reason == "length"
  s = orch.stats()
  orch.stop()
  # 36 of the first 39 tokens are whole pages: each sibling computes the last 4 itself.
  assert s["prefill_tokens"] == len(prompt) + 7 * 4
  assert s["shared_pages"] == 7 * 9  # the same 9 pages listed by 7 more sequences
  assert s["prefill_calls"] <= 4
  assert len({r.output_ids[0] for r in reqs}) > 1  # each sample drew its own token


def test_pages_return_to_the_pool(random_params):
  engine = make_engine(page_size=8)
  orch = Orchestrator(engine, engine.load_params(random_params)).start()
  reqs = [orch.submit([1 + i, 2, 3] * 5, SamplingParams(seed=i, max_new_tokens=20))
          for i in range(10)]
  for r in reqs:
    assert r.wait(120) and r.finish_reason == "length"
  s = orch.stats()
  orch.stop()
  assert s["kv_pages"]["used"] == 0 and s["kv_pages"]["free"] == engine.num_pages - 1


def test_a_prompt_finds_only_its_own_prefix_after_edges_split(random_params):
  """Whole pages S X, S X Y, then S Y W are cached (the third splits an edge after its
  first page); S X Y W was never computed, so its request finds at most S X Y (12 tokens)
  and its log-probs are those of the same request without the cache."""
  engine = make_engine(page_size=4, extra_pages=200)
  params = engine.load_params(random_params)
  S, X, Y, W = [11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34], [41, 42, 43, 44]
  prompt = S + X + Y + W + [5, 6]
  results = {}
  for label, tokens in (("off", 0), ("on", 4000)):
    orch = Orchestrator(engine, params, prefix_cache_tokens=tokens).start()
    for earlier in (S + X + [1], S + X + Y + [1], S + Y + W + [1]):
      orch.generate(earlier, SamplingParams(seed=0, max_new_tokens=1), timeout=120)
    results[label] = orch.generate(prompt, SamplingParams(seed=3, max_new_tokens=4),
                                   timeout=120)
    orch.stop()
  assert results["on"].prefix_hit_tokens == 12
  assert results["on"].output_ids == results["off"].output_ids
  np.testing.assert_allclose(results["on"].raw_logprobs, results["off"].raw_logprobs,
                             atol=1e-5)

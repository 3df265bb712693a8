"""Rollout engine benchmark; every ratio is against a baseline measured in the same run.

  python tools/bench_rollout.py [--presets tiny,smollm2-135m] [--batches 1,8,32,64]

1. Decode tokens/s at each batch size, against a naive decoder that recomputes
   the whole sequence every step (no KV cache), same model, batch and tokens.
2. Multi-turn sessions (8 turns, growing history): time to first token of the
   last turn with the prefix cache on versus off.
3. GRPO groups (one prompt, 8 samples): prompt tokens prefilled with and
   without the prefix cache.
4. Agent turns (many short prompts, one new token each, as in guess_number):
   requests/s with `prefill_rows` requests prefilled per call against one per
   call.

Models are randomly initialised with the preset's shape (speed does not
depend on the weights).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent.models.config import preset
from jaxagent.models.params import abstract_model, bind, init_params
from jaxagent.models.sharding import SAMPLE_RULES
from rollout_server.engine import Engine, SamplingParams
from rollout_server.orchestrator import Orchestrator
from rollout_server.prefix_cache import PrefixCache


def decode_rate(engine, params, batch, prompt_len, steps, rng) -> float:
  """Engine tokens/s: `batch` slots filled, then `steps` timed decode steps."""
  state = engine.init_decode_state()
  for slot in range(batch):
    prompt = rng.integers(0, engine.vocab_size, prompt_len).tolist()
    padded, n = engine.pad_tokens(prompt)
    prefix, _ = engine.prefill(params=params, padded_tokens=padded, true_length=n,
                               sampling=SamplingParams(seed=slot))
    state = engine.insert(prefix, state, slot)
  for _ in range(2):  # warm-up, as for the baseline
    state, r = engine.generate(params, state)
  jax.block_until_ready(r.data)
  t0 = time.perf_counter()
  for _ in range(steps):
    state, r = engine.generate(params, state)
    r.to_host()  # the per-step host copy is part of serving
  return batch * steps / (time.perf_counter() - t0)


def naive_rate(cfg, weights, batch, prompt_len, steps, rng) -> float:
  """No KV cache: every step runs the full (padded) sequence and samples the last position."""
  graphdef, abstract = abstract_model(cfg)
  total = prompt_len + steps + 1

  @jax.jit
  def step(weights, tokens, length, key):
    logits, _ = bind(graphdef, abstract, weights)(tokens)
    last = jax.vmap(lambda row: jax.lax.dynamic_index_in_dim(row, length - 1, keepdims=False))(
        logits)
    nxt = jax.random.categorical(jax.random.fold_in(key, length), last).astype(jnp.int32)
    tokens = jax.vmap(lambda row, t: jax.lax.dynamic_update_index_in_dim(row, t, length, 0))(
        tokens, nxt)
    return tokens, nxt

  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, total)), jnp.int32)
  key = jax.random.PRNGKey(0)
  for _ in range(2):  # warm-up: compiles for the input, then for the output's sharding
    tokens, nxt = step(weights, tokens, np.int32(prompt_len), key)
  jax.block_until_ready(tokens)
  t0 = time.perf_counter()
  for i in range(steps):
    tokens, nxt = step(weights, tokens, np.int32(prompt_len + 1 + i), key)
    np.asarray(nxt)  # the same per-step host copy as the engine
  return batch * steps / (time.perf_counter() - t0)


def multi_turn_ttft(engine, params, cache_on, turns, seed) -> float:
  """TTFT of the last turn; run twice, the first run only compiles the shapes."""
  for _ in range(2):
    ttft = _multi_turn(engine, params, cache_on, turns, np.random.default_rng(seed))
  return ttft


def _multi_turn(engine, params, cache_on, turns, rng) -> float:
  orch = Orchestrator(engine, params,
                      prefix_cache=PrefixCache(1_000_000) if cache_on else None).start()
  history = rng.integers(0, engine.vocab_size, 48).tolist()
  ttft = 0.0
  for turn in range(turns):
    r = orch.generate(history, SamplingParams(seed=turn, max_new_tokens=16), timeout=600)
    ttft = r.ttft_s
    history = history + r.output_ids + rng.integers(0, engine.vocab_size, 24).tolist()
  orch.stop()
  return ttft


def grpo_prefill(engine, params, cache_on, prompt, group) -> int:
  orch = Orchestrator(engine, params,
                      prefix_cache=PrefixCache(1_000_000) if cache_on else None).start()
  reqs = [orch.submit(prompt, SamplingParams(seed=i, max_new_tokens=8)) for i in range(group)]
  for r in reqs:
    r.wait(600)
  n = orch.stats()["prefill_tokens"]
  orch.stop()
  return n


def turn_rate(cfg, weights, rows, requests, prompt_len, seed) -> float:
  """Requests/s for `requests` distinct prompts that each want one token; the first
  round compiles the shapes and is not timed."""
  engine = Engine(cfg, max_concurrent_decodes=32, max_prefill_length=prompt_len,
                  max_seq_len=prompt_len + 8, prefill_rows=rows)
  orch = Orchestrator(engine, engine.load_params(weights)).start()
  rng = np.random.default_rng(seed)
  for timed in (False, True):
    prompts = [rng.integers(0, cfg.vocab_size, prompt_len).tolist() for _ in range(requests)]
    t0 = time.perf_counter()
    reqs = [orch.submit(p, SamplingParams(seed=i, max_new_tokens=1))
            for i, p in enumerate(prompts)]
    for r in reqs:
      r.wait(600)
    dt = time.perf_counter() - t0
  orch.stop()
  return requests / dt


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--presets", default="tiny,smollm2-135m")
  p.add_argument("--batches", default="1,8,32,64")
  p.add_argument("--prompt-len", type=int, default=64)
  p.add_argument("--steps", type=int, default=16, help="timed decode steps")
  p.add_argument("--naive-steps", type=int, default=4)
  p.add_argument("--turns", type=int, default=8)
  p.add_argument("--prefill-rows", type=int, default=8)
  args = p.parse_args()
  batches = [int(b) for b in args.batches.split(",")]
  print(f"devices: {len(jax.devices())} x {jax.devices()[0].platform}")
  for name in args.presets.split(","):
    cfg = preset(name)
    rng = np.random.default_rng(0)
    weights = init_params(cfg, 0, None, SAMPLE_RULES)
    print(f"\n== {name} ({cfg.num_params() / 1e6:.1f}M params) ==")
    print(f"{'batch':>6} {'engine tok/s':>14} {'naive tok/s':>13} {'ratio':>7}")
    for b in batches:
      engine = Engine(cfg, max_concurrent_decodes=b, max_prefill_length=args.prompt_len,
                      max_seq_len=args.prompt_len + args.steps + 8)
      params = engine.load_params(weights)
      fast = decode_rate(engine, params, b, args.prompt_len, args.steps, rng)
      slow = naive_rate(cfg, params["weights"], b, args.prompt_len, args.naive_steps, rng)
      print(f"{b:>6} {fast:>14.1f} {slow:>13.1f} {fast / slow:>6.1f}x", flush=True)

    engine = Engine(cfg, max_concurrent_decodes=8, max_prefill_length=1024, max_seq_len=1280)
    params = engine.load_params(weights)
    off = multi_turn_ttft(engine, params, False, args.turns, 1)
    on = multi_turn_ttft(engine, params, True, args.turns, 1)
    print(f"multi-turn ({args.turns} turns): last-turn TTFT cache off {off * 1e3:.1f} ms, "
          f"on {on * 1e3:.1f} ms; ratio off/on {off / on:.2f}x", flush=True)
    prompt = np.random.default_rng(2).integers(0, cfg.vocab_size, 256).tolist()
    without = grpo_prefill(engine, params, False, prompt, 8)
    with_cache = grpo_prefill(engine, params, True, prompt, 8)
    print(f"GRPO group (1 prompt of {len(prompt)} tokens, 8 samples): prefill tokens "
          f"without cache {without}, with cache {with_cache}; ratio "
          f"{without / with_cache:.1f}x", flush=True)
    one = turn_rate(cfg, weights, 1, 128, 16, 3)
    many = turn_rate(cfg, weights, args.prefill_rows, 128, 16, 3)
    print(f"agent turns (128 prompts of 16 tokens, 1 new token each): {one:.0f} requests/s "
          f"one prefill per call, {many:.0f} with {args.prefill_rows} per call; ratio "
          f"{many / one:.1f}x", flush=True)


if __name__ == "__main__":
  main()

"""Rollout engine benchmark; every ratio is against a baseline measured in the same run.

  python tools/bench_rollout.py [--presets tiny] [--batches 1,16,64]
                                [--seq-lens 128,1024,8192] [--kernels gather,triton] [--json]

1. Capacity: decode tokens/s with `batch` requests (prompt 32, 64 new tokens) for
   each engine `max_seq_len`; the baseline is the smallest `max_seq_len`. With the
   paged KV pool a step's cost follows the tokens in use, so the ratio should
   stay near 1 however large the capacity. Also batch B against batch 1, and with
   two `--kernels` the paged-attention kernels against each other (GPU: the Pallas
   Triton kernel against the gather loop).
2. Multi-turn sessions (8 turns, growing history): time to first token of the
   last turn with the prefix cache on versus off.
3. GRPO groups (one prompt, 8 samples): prompt tokens prefilled and pages shared
   with and without the prefix cache.
4. Agent turns (many short prompts, one new token each, as in guess_number):
   requests/s with `prefill_rows` requests prefilled per call against one.

Decoding is timed as the orchestrator runs it: each step's result is copied to
the host asynchronously and read one step later. Models are randomly
initialised with the preset's shape (speed does not depend on the weights);
`tiny` with `--vocab 1024` is the Qwen3-like shape of 0.92M parameters (tied
embeddings) that the Tunix tools call `1.1m`. With `--json` every figure is one JSON
object per line; a readable table follows.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxagent.cli_args import names_of, positive_int, positive_ints  # noqa: E402
from jaxagent.models.config import PRESETS, preset  # noqa: E402
from jaxagent.models.params import init_params  # noqa: E402
from jaxagent.models.sharding import SAMPLE_RULES  # noqa: E402
from rollout_server.engine import Engine, PrefillRequest, SamplingParams  # noqa: E402
from rollout_server.orchestrator import Orchestrator  # noqa: E402

ROWS: list[dict] = []
DTYPE = [None]  # the sampling dtype (--dtype)


def emit(row: dict, as_json: bool) -> None:
  ROWS.append(row)
  if as_json:
    print(json.dumps(row), flush=True)


class DecodeCase:
  """One decode case: an engine with `batch` slots and `max_seq_len` capacity; each run
  prefills and inserts `batch` requests (prompt `prompt_len`), then times `new_tokens`
  decode steps with results read one step behind, as served."""

  def __init__(self, cfg, weights, batch, max_seq_len, prompt_len, new_tokens,
               kernel="auto"):
    self.cfg, self.batch, self.prompt_len, self.new_tokens = cfg, batch, prompt_len, new_tokens
    self.engine = Engine(cfg, max_concurrent_decodes=batch,
                         max_prefill_length=min(512, max_seq_len), max_seq_len=max_seq_len,
                         prefill_rows=min(8, batch), dtype=DTYPE[0], attention_kernel=kernel)
    self.params = self.engine.load_params(weights)
    self.rng = np.random.default_rng(0)
    self.times: list[float] = []
    self.run()  # compiles; not kept

  def run(self) -> float:
    engine, params = self.engine, self.params
    state = engine.init_decode_state()
    per = engine.pages_for(self.prompt_len + self.new_tokens + 1)
    for start in range(0, self.batch, engine.prefill_rows):
      slots = list(range(start, min(self.batch, start + engine.prefill_rows)))
      reqs = [PrefillRequest(self.rng.integers(0, self.cfg.vocab_size, self.prompt_len).tolist(),
                             list(range(1 + s * per, 1 + (s + 1) * per)), 0,
                             SamplingParams(seed=s)) for s in slots]
      state, prefix, _ = engine.prefill_many(params=params, decode_state=state, requests=reqs)
      state = engine.insert_many(prefix, state, slots)
    jax.block_until_ready(state.tokens)
    t0 = time.perf_counter()
    pending = None
    for _ in range(self.new_tokens):
      state, r = engine.generate(params, state)
      r.data.copy_to_host_async()
      if pending is not None:
        pending.to_host()
      pending = r
    pending.to_host()
    return time.perf_counter() - t0

  def rate(self) -> float:
    """Tokens/s over the median timed run."""
    return self.batch * self.new_tokens / float(np.median(self.times))


def interleaved_rates(cases: dict, repeats: int) -> dict:
  """Times every case once per round, `repeats` rounds, in an order rotated each round,
  so a slow spell of the machine falls on every case alike; key -> tokens/s."""
  keys = list(cases)
  for r in range(repeats):
    for key in keys[r % len(keys):] + keys[:r % len(keys)]:
      cases[key].times.append(cases[key].run())
  return {key: case.rate() for key, case in cases.items()}


def _multi_turn(engine, params, cache_tokens, turns, rng) -> float:
  orch = Orchestrator(engine, params, prefix_cache_tokens=cache_tokens).start()
  history = rng.integers(0, engine.vocab_size, 48).tolist()
  ttft = 0.0
  for turn in range(turns):
    r = orch.generate(history, SamplingParams(seed=turn, max_new_tokens=16), timeout=600)
    ttft = r.ttft_s
    history = history + r.output_ids + rng.integers(0, engine.vocab_size, 24).tolist()
  orch.stop()
  return ttft


def multi_turn_ttft(engine, params, cache_tokens, turns, seed) -> float:
  """TTFT of the last turn; run twice, the first run only compiles the shapes."""
  for _ in range(2):
    ttft = _multi_turn(engine, params, cache_tokens, turns, np.random.default_rng(seed))
  return ttft


def grpo_prefill(engine, params, cache_tokens, prompt, group) -> dict:
  orch = Orchestrator(engine, params, prefix_cache_tokens=cache_tokens).start()
  reqs = [orch.submit(prompt, SamplingParams(seed=i, max_new_tokens=8)) for i in range(group)]
  for r in reqs:
    r.wait(600)
  s = orch.stats()
  orch.stop()
  return {"prefill_tokens": s["prefill_tokens"], "shared_pages": s["shared_pages"]}


def scheduling_makespan(cfg, weights, length_aware, groups, group_size, slots, seed) -> float:
  """Seconds until every sample of `groups` GRPO groups has finished, all submitted at
  once; each group's samples run a heavy-tailed length (lognormal, median 16 tokens,
  capped at 256) the server does not know in advance. The first run compiles."""
  engine = Engine(cfg, max_concurrent_decodes=slots, max_prefill_length=64, max_seq_len=320)
  orch = Orchestrator(engine, engine.load_params(weights), length_aware=length_aware).start()
  out = None
  for timed in (False, True):
    rng = np.random.default_rng(seed)
    lengths = np.minimum(256, np.maximum(1, rng.lognormal(np.log(16), 1.2, groups))).astype(int)
    t0 = time.perf_counter()
    reqs = []
    for g, n in enumerate(lengths):
      prompt = rng.integers(0, cfg.vocab_size, 24).tolist()
      reqs += [orch.submit(prompt, SamplingParams(seed=g * group_size + i, max_new_tokens=int(n)))
               for i in range(group_size)]
    for r in reqs:
      r.wait(600)
    out = time.perf_counter() - t0
  orch.stop()
  return out


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
  p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--presets", default="tiny", type=names_of(PRESETS, "model preset"))
  p.add_argument("--vocab", type=int, default=1024, help="vocabulary override (0: the preset's)")
  p.add_argument("--batches", default="1,16,64", type=positive_ints)
  p.add_argument("--seq-lens", default="128,1024,8192", type=positive_ints)
  p.add_argument("--prompt-len", type=positive_int, default=32)
  p.add_argument("--new-tokens", type=positive_int, default=64)
  p.add_argument("--repeats", type=positive_int, default=5,
                 help="timed runs per case (median), in rounds over all cases")
  p.add_argument("--turns", type=positive_int, default=8)
  p.add_argument("--prefill-rows", type=positive_int, default=8)
  p.add_argument("--skip", default="",
                 help="sections to skip: capacity,sessions,grpo,turns,scheduling")
  p.add_argument("--dtype", default=None, help="sampling dtype, e.g. bfloat16 (default: the model's)")
  p.add_argument("--kernels", default="auto",
                 help="paged attention kernels to time (auto, gather, triton); with two, "
                      "the second's tok/s over the first's per case")
  p.add_argument("--json", action="store_true")
  args = p.parse_args()
  # (with --json, stdout holds the JSON lines alone: the table goes to stderr)
  say = functools.partial(print, file=sys.stderr if args.json else sys.stdout)
  DTYPE[0] = args.dtype
  batches, seq_lens = args.batches, args.seq_lens
  skip = set(filter(None, args.skip.split(",")))
  say(f"devices: {len(jax.devices())} x {jax.devices()[0].platform}")
  for name in args.presets:
    cfg = preset(name, **({"vocab_size": args.vocab} if args.vocab else {}))
    weights = init_params(cfg, 0, None, SAMPLE_RULES)
    mparams = cfg.num_params() / 1e6
    if "capacity" not in skip:
      kernels = args.kernels.split(",")
      cases = {(kernel, L, b): DecodeCase(cfg, weights, b, L, args.prompt_len, args.new_tokens,
                                          kernel)
               for kernel in kernels for L in seq_lens for b in batches}
      all_rates = interleaved_rates(cases, args.repeats)
      by_kernel = {}
      for kernel in kernels:
        rates = by_kernel[kernel] = {}
        for L in seq_lens:
          for b in batches:
            rate = rates[L, b] = all_rates[kernel, L, b]
            emit({"section": "decode", "preset": name, "params_m": round(mparams, 2),
                  "dtype": args.dtype or cfg.dtype, "device": jax.devices()[0].platform,
                  "kernel": kernel, "max_seq_len": L, "batch": b, "prompt": args.prompt_len,
                  "new_tokens": args.new_tokens, "tok_per_s": round(rate, 1)}, args.json)
        base = seq_lens[0]
        for L in seq_lens[1:]:
          for b in batches:
            emit({"section": "decode_ratio", "preset": name, "kernel": kernel, "batch": b,
                  "ratio": f"max_seq_len {L} / {base}",
                  "value": round(rates[L, b] / rates[base, b], 3)}, args.json)
        for L in seq_lens:
          for b in batches[1:]:
            emit({"section": "batch_ratio", "preset": name, "kernel": kernel,
                  "max_seq_len": L, "ratio": f"batch {b} / {batches[0]}",
                  "value": round(rates[L, b] / rates[L, batches[0]], 2)}, args.json)
      if len(kernels) == 2:
        first, second = kernels
        for L in seq_lens:
          for b in batches:
            emit({"section": "kernel_ratio", "preset": name, "max_seq_len": L, "batch": b,
                  "ratio": f"{second} / {first}",
                  "value": round(by_kernel[second][L, b] / by_kernel[first][L, b], 2)},
                 args.json)
    engine = Engine(cfg, max_concurrent_decodes=8, max_prefill_length=1024, max_seq_len=1280,
                    extra_pages=4096)
    params = engine.load_params(weights)
    if "sessions" not in skip:
      off = multi_turn_ttft(engine, params, 0, args.turns, 1)
      on = multi_turn_ttft(engine, params, 65536, args.turns, 1)
      emit({"section": "multi_turn", "preset": name, "turns": args.turns,
            "ttft_off_ms": round(off * 1e3, 2), "ttft_on_ms": round(on * 1e3, 2),
            "ratio_off_over_on": round(off / on, 2)}, args.json)
    if "grpo" not in skip:
      prompt = np.random.default_rng(2).integers(0, cfg.vocab_size, 256).tolist()
      without = grpo_prefill(engine, params, 0, prompt, 8)
      with_cache = grpo_prefill(engine, params, 65536, prompt, 8)
      emit({"section": "grpo_group", "preset": name, "prompt": len(prompt), "samples": 8,
            "prefill_tokens_off": without["prefill_tokens"],
            "prefill_tokens_on": with_cache["prefill_tokens"],
            "shared_pages_on": with_cache["shared_pages"],
            "ratio_off_over_on": round(without["prefill_tokens"]
                                       / with_cache["prefill_tokens"], 2)}, args.json)
    if "scheduling" not in skip:
      fifo = scheduling_makespan(cfg, weights, False, 48, 4, 16, 5)
      aware = scheduling_makespan(cfg, weights, True, 48, 4, 16, 5)
      emit({"section": "scheduling", "preset": name, "groups": 48, "group_size": 4,
            "slots": 16, "makespan_fifo_s": round(fifo, 3),
            "makespan_length_aware_s": round(aware, 3),
            "ratio_fifo_over_aware": round(fifo / aware, 2)}, args.json)
    if "turns" not in skip:
      one = turn_rate(cfg, weights, 1, 128, 16, 3)
      many = turn_rate(cfg, weights, args.prefill_rows, 128, 16, 3)
      emit({"section": "agent_turns", "preset": name, "requests": 128,
            "one_per_call_rps": round(one, 1), "many_per_call_rps": round(many, 1),
            "prefill_rows": args.prefill_rows, "ratio": round(many / one, 2)}, args.json)
  say()
  for r in ROWS:
    say("  ".join(f"{k}={v}" for k, v in r.items() if k != "section").ljust(20),
          f"[{r['section']}]")


if __name__ == "__main__":
  main()

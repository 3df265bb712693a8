"""Learner throughput and memory: train-step tokens/s, achieved FLOP/s against a matmul
measured in the same run, and the compiled step's peak memory, per row length.

  python tools/bench_learner.py [--preset tiny] [--seq-lens 1024,8192] [--tokens 8192]
      [--steps 5] [--attention auto] [--remat none] [--scan-unroll 1] [--json]

Each row length trains on `--tokens` token slots per step (rows = tokens / seq_len)
of packed synthetic segments (a quarter to a half of the row each); tokens/s counts
real tokens, not padding. The baseline is a large float32 matmul, the best FLOP/s
this machine's XLA reaches, timed in the same run. The step's FLOPs are the model's
(`ModelConfig.train_flops`: every weight matmul of the real tokens and the attention
products over each token's own causal context in its segment, forward and backward,
as MFU counts them); work an implementation adds (recomputation, masked-out blocks,
padding) does not count. Peak memory is XLA's own account
of the compiled step (arguments + outputs + temporaries, `memory_analysis`).

`--json` prints one JSON object per row length, then a summary line with the peak
memory ratio between the longest and the shortest length (linear growth: about the
ratio of the lengths at a fixed token count, i.e. about 1).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent.batch import pack
from jaxagent.cli_args import positive_int, positive_ints
from jaxagent.config import LearnerConfig
from jaxagent.data import synthetic_segment
from jaxagent.learner import Learner
from jaxagent.models.config import PRESETS, preset
from jaxagent.models.sharding import make_mesh


def best_time(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return min(times)


def matmul_flops_per_s(n: int, repeats: int) -> float:
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32)
  f = jax.jit(lambda a, b: a @ b)
  jax.block_until_ready(f(a, b))
  return 2 * n**3 / best_time(lambda: f(a, b), repeats)


def peak_bytes(compiled) -> int:
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
             - m.alias_size_in_bytes)


def measure(args, seq_len: int) -> dict:
  overrides = dict(attention=args.attention, remat=args.remat, max_seq_len=max(seq_len, 1024))
  if args.scan_unroll:
    overrides["scan_unroll"] = args.scan_unroll
  if args.attention_block:
    overrides["attention_block"] = args.attention_block
  cfg = preset(args.preset, **overrides)
  args.scan_unroll = cfg.scan_unroll
  rows = max(1, args.tokens // seq_len)
  vocab = min(cfg.vocab_size, 256)
  segs = [synthetic_segment(i, seed=0, vocab=vocab, target=97, min_len=seq_len // 4,
                            max_len=seq_len // 2) for i in range(rows * 4)]
  batch, _ = pack(segs, rows, seq_len)
  lcfg = LearnerConfig(microbatches=args.microbatches, logits_chunk=args.logits_chunk)
  learner = Learner(cfg, lcfg, make_mesh())
  state = learner.init_state(0)
  sharded = learner.shard_batch(batch)
  compiled = learner._step.lower(state, sharded).compile()
  state, m = learner.step(state, batch)  # warm-up
  jax.block_until_ready(m)
  times = []
  for _ in range(args.steps):
    t0 = time.perf_counter()
    state, m = learner.step(state, batch)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t0)
  step_s = float(np.median(times))
  real = batch.segment_ids > 0
  tokens = int(real.sum())  # padding is not counted
  flops = cfg.train_flops(tokens, float(np.sum((batch.positions + 1) * real)))
  return {"bench": "learner", "preset": args.preset, "seq_len": seq_len, "rows": rows,
          "fill": round(tokens / batch.tokens.size, 3),
          "attention": args.attention, "remat": args.remat, "scan_unroll": args.scan_unroll,
          "logits_chunk": args.logits_chunk, "step_s": round(step_s, 4),
          "tok_per_s": round(tokens / step_s, 1), "flops_per_s": round(flops / step_s),
          "peak_bytes": peak_bytes(compiled)}


def main() -> None:
  p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
  p.add_argument("--seq-lens", default="1024,8192", type=positive_ints)
  p.add_argument("--tokens", type=positive_int, default=8192, help="tokens per train step")
  p.add_argument("--steps", type=positive_int, default=5)
  p.add_argument("--microbatches", type=positive_int, default=1)
  p.add_argument("--attention", default="auto")
  p.add_argument("--attention-block", type=int, default=0)
  p.add_argument("--remat", default="none")
  p.add_argument("--scan-unroll", type=int, default=0, help="0: the preset's")
  p.add_argument("--logits-chunk", type=int, default=256)
  p.add_argument("--matmul-n", type=positive_int, default=2048)
  p.add_argument("--json", action="store_true")
  args = p.parse_args()
  # (with --json, stdout holds the JSON lines alone: the table goes to stderr)
  say = functools.partial(print, file=sys.stderr if args.json else sys.stdout)

  baseline = matmul_flops_per_s(args.matmul_n, 5)
  results = []
  for seq_len in args.seq_lens:
    r = measure(args, seq_len)
    r["matmul_flops_per_s"] = round(baseline)
    r["fraction_of_matmul"] = round(r["flops_per_s"] / baseline, 3)
    results.append(r)
    if args.json:
      print(json.dumps(r), flush=True)
  # (by length, whatever order --seq-lens gave them in)
  shortest = min(results, key=lambda r: r["seq_len"])
  longest = max(results, key=lambda r: r["seq_len"])
  summary = {"bench": "learner_summary", "matmul_n": args.matmul_n,
             "matmul_flops_per_s": round(baseline),
             "peak_bytes_ratio_longest_over_shortest":
                 round(longest["peak_bytes"] / shortest["peak_bytes"], 3),
             "seq_len_ratio": longest["seq_len"] / shortest["seq_len"]}
  if args.json:
    print(json.dumps(summary), flush=True)
  say(f"devices: {len(jax.devices())} x {jax.devices()[0].platform}; preset {args.preset}; "
        f"{args.tokens} tokens per step; {args.matmul_n}^2 float32 matmul: "
        f"{baseline / 1e9:.1f} GFLOP/s")
  say(f"{'seq_len':>8} {'rows':>5} {'step ms':>9} {'tok/s':>9} {'GFLOP/s':>8} "
        f"{'of matmul':>9} {'peak MiB':>9}")
  for r in results:
    say(f"{r['seq_len']:>8} {r['rows']:>5} {r['step_s'] * 1e3:>9.1f} {r['tok_per_s']:>9,.0f} "
          f"{r['flops_per_s'] / 1e9:>8.1f} {r['fraction_of_matmul']:>9.3f} "
          f"{r['peak_bytes'] / 2**20:>9.1f}")


if __name__ == "__main__":
  main()

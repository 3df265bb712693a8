"""Learner throughput: train-step tokens/s and achieved FLOP/s against a plain matmul.

  python tools/bench_learner.py [--preset tiny] [--rows 8] [--seq-len 256] [--steps 10]

The baseline is measured in the same run: a large float32 matmul, the best
FLOP/s this machine's XLA reaches. The train step's FLOPs are counted
analytically (`ModelConfig.train_flops_per_token`: every weight matmul and the
attention products, forward and backward). XLA's cost analysis is printed too
but undercounts: it counts the body of the layer `scan` once.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent.batch import pack
from jaxagent.config import LearnerConfig
from jaxagent.data import synthetic_segment
from jaxagent.learner import Learner
from jaxagent.models.config import preset
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


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", default="tiny")
  p.add_argument("--rows", type=int, default=8)
  p.add_argument("--seq-len", type=int, default=256)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--microbatches", type=int, default=1)
  p.add_argument("--matmul-n", type=int, default=2048)
  args = p.parse_args()

  cfg = preset(args.preset)
  vocab = min(cfg.vocab_size, 256)
  segs = [synthetic_segment(i, seed=0, vocab=vocab, target=97, min_len=args.seq_len // 4,
                            max_len=args.seq_len // 2) for i in range(args.rows * 4)]
  batch, _ = pack(segs, args.rows, args.seq_len)
  learner = Learner(cfg, LearnerConfig(microbatches=args.microbatches), make_mesh())
  state = learner.init_state(0)
  sharded = learner.shard_batch(batch)
  compiled = learner._step.lower(state, sharded).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  xla_flops = float(cost.get("flops", 0.0))
  step_flops = cfg.train_flops_per_token(args.seq_len) * batch.tokens.size

  state, m = learner.step(state, batch)  # warm-up (compiles)
  jax.block_until_ready(m)
  times = []
  for _ in range(args.steps):
    t0 = time.perf_counter()
    state, m = learner.step(state, batch)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t0)
  step_s = float(np.median(times))
  tokens = batch.tokens.size
  peak = matmul_flops_per_s(args.matmul_n, 5)

  print(f"devices: {len(jax.devices())} x {jax.devices()[0].platform}; preset {args.preset} "
        f"({cfg.num_params() / 1e6:.2f}M params); batch {args.rows} x {args.seq_len} tokens")
  print(f"train step: {step_s * 1e3:.1f} ms median of {args.steps}; "
        f"{tokens / step_s:,.0f} tokens/s")
  print(f"step FLOPs (analytic): {step_flops / 1e9:.3f} GFLOP; 6*N*tokens: "
        f"{6 * cfg.num_params() * tokens / 1e9:.3f}; XLA cost analysis (scan body once): "
        f"{xla_flops / 1e9:.3f}")
  print(f"achieved: {step_flops / step_s / 1e9:.2f} GFLOP/s; "
        f"baseline {args.matmul_n}^2 float32 matmul: {peak / 1e9:.2f} GFLOP/s")
  print(f"ratio achieved / matmul baseline: {step_flops / step_s / peak:.3f}")


if __name__ == "__main__":
  main()

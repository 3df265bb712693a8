"""Checks the engine on whatever device JAX finds: its log-probs equal the learner's
teacher-forced log-probs for the same tokens, and a request's tokens do not depend on the
pool's size or on its neighbours.

  python tools/check_engine.py [--preset tiny] [--dtype float32] [--kernels auto]

Prints one JSON line per check and exits non-zero if one fails. For accelerators, where
the test suite does not run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxagent import losses  # noqa: E402
from jaxagent.models.config import preset  # noqa: E402
from jaxagent.models.params import abstract_model, bind, init_params  # noqa: E402
from rollout_server.engine import Engine, PrefillRequest, SamplingParams  # noqa: E402


def run(engine, params, prompts, seeds, steps, slots):
  """Prefills `prompts` into `slots` together, decodes `steps` tokens; per-request tokens
  and log-probs."""
  state = engine.init_decode_state()
  per = engine.pages_for(max(map(len, prompts)) + steps + 1)
  reqs = [PrefillRequest(p, list(range(1 + i * per, 1 + (i + 1) * per)), 0, SamplingParams(seed=s))
          for i, (p, s) in enumerate(zip(prompts, seeds))]
  state, prefix, first = engine.prefill_many(params=params, decode_state=state, requests=reqs)
  state = engine.insert_many(prefix, state, slots)
  h = first.to_host()
  toks = [[int(h.tokens[i])] for i in range(len(prompts))]
  logp = [[float(h.logp[i])] for i in range(len(prompts))]
  for _ in range(steps):
    state, r = engine.generate(params, state)
    h = r.to_host()
    for i, slot in enumerate(slots):
      toks[i].append(int(h.tokens[slot]))
      logp[i].append(float(h.logp[slot]))
  return toks, logp


def main() -> int:
  p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
  p.add_argument("--preset", default="tiny")
  p.add_argument("--dtype", default="float32")
  p.add_argument("--kernels", default="auto", help="paged attention kernels to check, e.g. "
                                                   "gather,triton")
  args = p.parse_args()
  cfg = preset(args.preset, dtype=args.dtype, param_dtype="float32")
  weights = init_params(cfg, 0)
  ok = True

  def report(name, passed, **figures):
    nonlocal ok
    ok &= bool(passed)
    print(json.dumps({"check": name, "passed": bool(passed), "device": jax.devices()[0].platform,
                      **figures}), flush=True)

  for kernel in args.kernels.split(","):
    engine = Engine(cfg, max_concurrent_decodes=4, max_prefill_length=64, max_seq_len=256,
                    attention_kernel=kernel)
    params = engine.load_params(weights)
    prompts = [[3, 14, 15, 92, 65, 35], [7, 8, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
    toks, logp = run(engine, params, prompts, [1, 2, 3], 24, [0, 1, 2])
    graphdef, abstract = abstract_model(cfg)
    model = bind(graphdef, abstract, weights)
    worst = 0.0
    for prompt, t, lp in zip(prompts, toks, logp):
      seq = jnp.asarray([prompt + t])
      logits, _ = model(seq)
      want, _ = losses.token_logp_and_entropy(logits, losses.shifted_targets(seq), 1.0)
      want = np.asarray(losses.align_to_tokens(want)[0])[len(prompt):]
      worst = max(worst, float(np.abs(np.asarray(lp) - want).max()))
    tol = 2e-5 if args.dtype == "float32" else 5e-2
    report("engine_logp_equals_teacher_forced", worst <= tol, kernel=kernel,
           max_abs_diff=worst, tolerance=tol)
    alone, _ = run(engine, params, prompts[:1], [1], 24, [3])
    report("same_tokens_alone_or_among_others", alone[0] == toks[0], kernel=kernel)
    big = Engine(cfg, max_concurrent_decodes=4, max_prefill_length=64, max_seq_len=256,
                 num_pages=8 * engine.num_pages, attention_kernel=kernel)
    again, _ = run(big, big.load_params(weights), prompts, [1, 2, 3], 24, [0, 1, 2])
    report("same_tokens_in_a_pool_8x_larger", again == toks, kernel=kernel)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())

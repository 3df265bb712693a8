"""Decode tokens/s of our rollout engine against Tunix's vanilla sampler, same model shapes.

  python tools/bench_tunix.py [--rounds 3] [--shapes 1.1m,6.2m] [--batches 16,64]
                              [--max-seq-len 1024] [--tunix-python /tmp/tunix-venv/bin/python]

Tunix (`google-tunix==0.1.7`, the `bench-tunix` extra) is not a dependency of
jaxagent; install it in a separate environment so that its pins leave ours alone:

  python3 -m venv /tmp/tunix-venv && /tmp/tunix-venv/bin/pip install google-tunix==0.1.7

Both systems build a randomly initialised float32 decoder of one shape (RMSNorm,
RoPE, GQA, SwiGLU, tied embeddings; speed does not depend on the weights), take
`batch` prompts of 32 random tokens and generate 64 new tokens with temperature 1
(plain categorical sampling over the whole vocabulary, no top-k / top-p), with no
stop token, so that every sequence runs all 64 steps.

- jaxagent: `decode_rate` of tools/bench_rollout.py: the prompts are prefilled
  into `batch` slots of an engine with `max_seq_len`, then 64 `generate` steps
  are timed, each step's result copied to the host and read one step behind.
- tunix: `tunix.models.qwen3` (or `llama3`) and `tunix.generate.sampler.Sampler`
  with a KV cache of `max_seq_len` positions. Two figures per run: `decode`
  times only the sampler's compiled decode loop after its prefill (what the
  jaxagent figure times, and the one the ratio uses), `call` times the public
  `Sampler.__call__` (tokenising, cache allocation, prefill, decode, copying
  out and detokenising).

Each (shape, batch) case runs in a fresh subprocess per system, the systems
interleaved (jaxagent, tunix, jaxagent, tunix, ...) for `--rounds` rounds; each
subprocess compiles on one untimed run and reports the median of `--repeats`
timed runs, and the driver reports the median over rounds. Tunix's Qwen3 has
RMSNorm weights on q and k (2 x head_dim a layer) that our decoder has not; the
parameter counts are printed and must differ by exactly those (with
`--tunix-model llama3` they must be equal).

The tunix mode imports nothing from this repository (it runs under the other
environment's Python); only the standard library is imported at module level.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

TARGET = 3.0  # the goal: >= 3x Tunix's tok/s at batch 16 and 64
TUNIX_VERSION = "0.1.7"  # the sampler internals timed below are those of this release
DEFAULT_TUNIX_PYTHON = "/tmp/tunix-venv/bin/python"

# One shape per entry, in our ModelConfig's field names; both systems build from it.
_COMMON = dict(vocab_size=1024, tie_embeddings=True, rope_theta=10_000.0, norm_eps=1e-5)
SHAPES: dict[str, dict] = {
    # preset("tiny", vocab_size=1024): 0.92M parameters counted (1.05M untied).
    "1.1m": dict(_COMMON, n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, head_dim=32,
                 d_ff=384),
    # 6.16M parameters.
    "6.2m": dict(_COMMON, n_layers=6, d_model=256, n_heads=8, n_kv_heads=4, head_dim=32,
                 d_ff=1024),
}


def _result(row: dict) -> None:
  """A child's answer to the driver: one tagged JSON line on stdout."""
  print("RESULT " + json.dumps(row), flush=True)


# --------------------------------------------------------------------------- jaxagent


def run_jaxagent(args) -> None:
  import jax
  import numpy as np

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from bench_rollout import decode_rate  # tools/bench_rollout.py
  from jaxagent.models.config import preset
  from jaxagent.models.params import init_params
  from jaxagent.models.sharding import SAMPLE_RULES

  cfg = preset("tiny", **SHAPES[args.shape])
  weights = init_params(cfg, 0, None, SAMPLE_RULES)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(weights))
  rate = decode_rate(cfg, weights, args.batch, args.max_seq_len, args.prompt_len,
                     args.new_tokens, np.random.default_rng(0), args.repeats)
  _result({"params": n_params, "tok_per_s": rate, "dtype": cfg.dtype,
           "platform": jax.devices()[0].platform})


# --------------------------------------------------------------------------- tunix


class _IdTokenizer:
  """Token ids written as decimal text: Tunix's sampler takes strings and a tokenizer
  with encode / decode / bos_id / eos_id / pad_id."""

  def encode(self, text, **_):
    return [int(t) for t in text.split()]

  def decode(self, ids, **_):
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self):
    return None  # falsy: the sampler prepends nothing

  def eos_id(self):
    return -1  # never sampled: every sequence runs all the steps

  def pad_id(self):
    return 0  # prompts are exactly max_prompt_length long, so no padding is inserted


def tunix_model(shape: str, kind: str):
  """A randomly initialised Tunix `qwen3` or `llama3` model of one of SHAPES, and its
  parameter count (runs under the Tunix environment's Python)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  s = SHAPES[shape]
  fields = dict(num_layers=s["n_layers"], vocab_size=s["vocab_size"], embed_dim=s["d_model"],
                hidden_dim=s["d_ff"], num_heads=s["n_heads"], head_dim=s["head_dim"],
                num_kv_heads=s["n_kv_heads"], rope_theta=int(s["rope_theta"]),
                norm_eps=s["norm_eps"])
  if kind == "qwen3":
    from tunix.models.qwen3 import model as model_lib
    config = model_lib.ModelConfig(**fields, use_tied_embedding=s["tie_embeddings"],
                                   dtype=jnp.float32, param_dtype=jnp.float32)
    model = model_lib.Qwen3(config, rngs=nnx.Rngs(0))
  else:
    from tunix.models.llama3 import model as model_lib
    config = model_lib.ModelConfig(**fields, weight_tying=s["tie_embeddings"])
    model = model_lib.Llama3(config, rngs=nnx.Rngs(0))
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  return model, sum(int(np.prod(x.shape)) for x in leaves)


def run_tunix(args) -> None:
  import importlib.metadata

  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from tunix.generate import sampler as sampler_lib

  s = SHAPES[args.shape]
  model, n_params = tunix_model(args.shape, args.tunix_model)
  sampler = sampler_lib.Sampler(
      model, _IdTokenizer(),
      sampler_lib.CacheConfig(cache_size=args.max_seq_len, num_layers=s["n_layers"],
                              num_kv_heads=s["n_kv_heads"], head_dim=s["head_dim"]))
  rng = np.random.default_rng(0)
  total_steps = args.prompt_len + args.new_tokens
  decode_times, call_times = [], []
  for run in range(args.repeats + 1):
    prompt_ids = rng.integers(1, s["vocab_size"], (args.batch, args.prompt_len))
    # (a) The decode loop alone, after the prefill: the steps of Sampler.__call__
    # without its host work (0.1.7 internals; the eos ids are set by __call__).
    sampler.eos_ids = jnp.array([_IdTokenizer().eos_id()])
    state = sampler.init_sample_state(
        jnp.asarray(prompt_ids, jnp.int32), total_sampling_steps=total_steps,
        include_logits=False, forbidden_token_ids=None, temperature=1.0, top_p=1.0,
        top_k=None, seed=jax.random.PRNGKey(run), beam_size=None)
    params = sampler._flattened_transformer_state
    state = sampler._compiled_prefill_fn(params, state, None, echo=False)
    jax.block_until_ready(state.token_buffer)
    t0 = time.perf_counter()
    state = sampler._compiled_decode_fn(params, state)
    jax.block_until_ready(state.token_buffer)
    dt = time.perf_counter() - t0
    if int(state.decoding_step) != total_steps:
      raise RuntimeError(f"Tunix's decode loop stopped at step {int(state.decoding_step)}, "
                         f"not {total_steps}")
    # (b) The public call, end to end.
    prompts = [" ".join(map(str, row)) for row in prompt_ids]
    t1 = time.perf_counter()
    out = sampler(prompts, max_generation_steps=args.new_tokens,
                  max_prompt_length=args.prompt_len, temperature=1.0, top_p=1.0,
                  seed=run, eos_tokens=[_IdTokenizer().eos_id()])
    dt_call = time.perf_counter() - t1
    if any(len(t) != args.new_tokens for t in out.tokens):
      raise RuntimeError(f"Tunix returned {sorted({len(t) for t in out.tokens})} tokens a "
                         f"sequence, not {args.new_tokens}")
    if run:
      decode_times.append(dt)
      call_times.append(dt_call)
  assert not any(m == "jaxagent" or m.startswith(("jaxagent.", "rollout_server"))
                 for m in sys.modules), "the tunix mode must not import this repository"
  n = args.batch * args.new_tokens
  _result({"params": n_params, "tok_per_s": n / statistics.median(decode_times),
           "call_tok_per_s": n / statistics.median(call_times),
           "dtype": str(jax.tree.leaves(nnx.state(model, nnx.Param))[0].dtype),
           "platform": jax.devices()[0].platform,
           "tunix_version": importlib.metadata.version("google-tunix")})


# --------------------------------------------------------------------------- driver


def _tunix_version(python: str) -> str:
  """Tunix's version under `python`; exits with a clear message if it is missing."""
  probe = "import importlib.metadata as m, tunix; print(m.version('google-tunix'))"
  try:
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300)
    err = (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]
  except OSError as e:
    out, err = None, str(e)
  if out is None or out.returncode:
    sys.exit(f"google-tunix is not installed for {python} ({err}).\n"
             f"Install it in its own environment (it is the optional 'bench-tunix' extra,\n"
             f"not a dependency of jaxagent):\n"
             f"  python3 -m venv /tmp/tunix-venv && "
             f"/tmp/tunix-venv/bin/pip install google-tunix=={TUNIX_VERSION}\n"
             f"and pass --tunix-python if it lives elsewhere.")
  return out.stdout.strip()


def _child(python: str, system: str, shape: str, batch: int, args) -> dict:
  cmd = [python, os.path.abspath(__file__), "--system", system, "--shape", shape,
         "--batch", str(batch), "--max-seq-len", str(args.max_seq_len),
         "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
         "--repeats", str(args.repeats), "--tunix-model", args.tunix_model]
  # The tunix child starts outside the repository so that nothing of ours is on its path.
  cwd = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) if system == "jaxagent" \
      else "/"
  proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
  rows = [line[len("RESULT "):] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
  if proc.returncode or not rows:
    sys.exit(f"{system} {shape} batch {batch} failed (exit {proc.returncode}):\n"
             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
  return json.loads(rows[-1])


def drive(args) -> None:
  shapes = args.shapes.split(",")
  batches = [int(b) for b in args.batches.split(",")]
  tunix_version = _tunix_version(args.tunix_python)
  if tunix_version != TUNIX_VERSION:
    print(f"warning: Tunix {tunix_version}, not {TUNIX_VERSION}: the decode-loop timing "
          f"uses that release's sampler internals", file=sys.stderr)
  print(f"# load average {os.getloadavg()[0]:.2f}; tunix {tunix_version} "
        f"({args.tunix_model}) at {args.tunix_python}; {args.rounds} rounds x "
        f"{args.repeats} timed runs; prompt {args.prompt_len}, {args.new_tokens} new tokens, "
        f"max_seq_len {args.max_seq_len}, temperature 1", flush=True)
  systems = {"jaxagent": sys.executable, "tunix": args.tunix_python}
  runs: dict[tuple, list[dict]] = {}
  for r in range(args.rounds):
    for shape in shapes:
      for batch in batches:
        for system, python in systems.items():
          row = _child(python, system, shape, batch, args)
          runs.setdefault((system, shape, batch), []).append(row)
          print(f"# round {r + 1}: {system} {shape} batch {batch}: "
                f"{row['tok_per_s']:.0f} tok/s", file=sys.stderr, flush=True)
  medians = {}
  for (system, shape, batch), rows in runs.items():
    out = {"system": system, "shape": shape, "params": rows[0]["params"], "batch": batch,
           "max_seq_len": args.max_seq_len, "prompt": args.prompt_len,
           "new_tokens": args.new_tokens, "dtype": rows[0]["dtype"],
           "tok_per_s": round(statistics.median(r["tok_per_s"] for r in rows), 1),
           "rounds": [round(r["tok_per_s"], 1) for r in rows]}
    if system == "tunix":
      out["model"] = args.tunix_model
      out["call_tok_per_s"] = round(statistics.median(r["call_tok_per_s"] for r in rows), 1)
    medians[system, shape, batch] = out
    print(json.dumps(out), flush=True)
  ratios = []
  for shape in shapes:
    s = SHAPES[shape]
    qk_norm = 2 * s["head_dim"] * s["n_layers"] if args.tunix_model == "qwen3" else 0
    for batch in batches:
      ours, theirs = medians["jaxagent", shape, batch], medians["tunix", shape, batch]
      if theirs["params"] != ours["params"] + qk_norm:
        sys.exit(f"{shape}: parameter counts differ: jaxagent {ours['params']}, "
                 f"tunix {theirs['params']} (expected {ours['params']} + {qk_norm} QK-norm)")
      ratio = {"shape": shape, "batch": batch, "max_seq_len": args.max_seq_len,
               "params_jaxagent": ours["params"], "params_tunix": theirs["params"],
               "jaxagent_over_tunix": round(ours["tok_per_s"] / theirs["tok_per_s"], 2),
               "jaxagent_over_tunix_call": round(ours["tok_per_s"] / theirs["call_tok_per_s"], 2),
               "target": TARGET}
      ratio["meets_target"] = ratio["jaxagent_over_tunix"] >= TARGET
      ratios.append(ratio)
      print(json.dumps(ratio), flush=True)
  print()
  print(f"{'shape':<6} {'params (ours/tunix)':>20} {'batch':>5} {'jaxagent tok/s':>15} "
        f"{'tunix decode':>13} {'tunix call':>11} {'ratio':>6} {'vs call':>8}  >= {TARGET:g}x")
  for r in ratios:
    ours = medians["jaxagent", r["shape"], r["batch"]]
    theirs = medians["tunix", r["shape"], r["batch"]]
    print(f"{r['shape']:<6} {r['params_jaxagent']:>10,}/{r['params_tunix']:<9,} {r['batch']:>5} "
          f"{ours['tok_per_s']:>15,.0f} {theirs['tok_per_s']:>13,.0f} "
          f"{theirs['call_tok_per_s']:>11,.0f} {r['jaxagent_over_tunix']:>6.2f} "
          f"{r['jaxagent_over_tunix_call']:>8.2f}  {'yes' if r['meets_target'] else 'NO'}")


def main() -> None:
  p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--system", choices=["driver", "jaxagent", "tunix"], default="driver",
                 help="driver (default) runs the other two as interleaved subprocesses")
  p.add_argument("--shapes", default=",".join(SHAPES), help="driver: shapes to run")
  p.add_argument("--batches", default="16,64", help="driver: batch sizes")
  p.add_argument("--rounds", type=int, default=3, help="driver: subprocesses per system and case")
  p.add_argument("--tunix-python", default=DEFAULT_TUNIX_PYTHON,
                 help="a Python with google-tunix installed")
  p.add_argument("--shape", choices=sorted(SHAPES), default="1.1m", help="child: the shape")
  p.add_argument("--batch", type=int, default=16, help="child: the batch size")
  p.add_argument("--tunix-model", choices=["qwen3", "llama3"], default="qwen3")
  p.add_argument("--max-seq-len", type=int, default=1024)
  p.add_argument("--prompt-len", type=int, default=32)
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--repeats", type=int, default=3, help="timed runs per subprocess (median)")
  args = p.parse_args()
  {"driver": drive, "jaxagent": run_jaxagent, "tunix": run_tunix}[args.system](args)


if __name__ == "__main__":
  main()

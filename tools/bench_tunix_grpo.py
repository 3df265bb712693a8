"""Seconds per GRPO step (rollouts + one learner update) of jaxagent against Tunix's GRPO learner.

  python tools/bench_tunix_grpo.py [--json] [--rounds 3] [--repeats 5] [--warmup 2]
                                   [--shapes 1.1m,6.2m] [--max-seq-len 128,1024]
                                   [--tunix-python /tmp/tunix-venv/bin/python]
                                   [--jaxagent-rollout orchestrator|engine]

Tunix (`google-tunix==0.1.7`) lives in its own environment, as for tools/bench_tunix.py
(whose shapes, tokenizer stand-in and version probe this file reuses); without it only
the jaxagent side runs.

One step, the same in both systems: a randomly initialised float32 decoder of the
shape (1.1m: vocab 1024, 4 layers, d_model 128, 4 heads / 2 KV heads, head_dim 32,
d_ff 384, tied embeddings), 2 prompts of 32 random tokens (the same prompts in both
systems) x a group of 8 samples = 16 rollouts of exactly 64 new tokens (temperature 1,
whole vocabulary, no top-k / top-p, no stop token), a KV cache of `max_seq_len`
positions; reward = fraction of even token ids in the completion; GRPO advantages
normalised within each group; then ONE AdamW update (lr 1e-6, b2 0.99, global-norm
clip 1.0, no weight decay) of the PPO-clip loss (epsilon 0.2 both sides, no KL, no
reference model, one epoch, one microbatch, sequence-mean-token-mean reduction) on
the 16 sequences of 96 tokens, loss on the completion tokens only.

- jaxagent: the in-process serving path of `jaxagent.train`: `make_engine` +
  `start_orchestrator` (paged KV, prefix cache at its defaults, 16 slots), 16 requests
  submitted and awaited; `jaxagent.advantages.group_normalized` (jitted), segments
  packed by `jaxagent.batch.pack`, `Learner.step` with its metrics fetched to the
  host, then the new params copied into the engine (`engine.load_params` +
  `Orchestrator.update_weights`), as `train.py` syncs an in-process server. With
  `--jaxagent-rollout engine` the orchestrator is left out: the engine's
  `prefill_many` / `insert_many` / `generate` are called directly (as
  tools/bench_rollout.py's `decode_rate`; no prefix sharing) and the new params
  simply replace the old.
- tunix: `RLCluster` (actor, rollout and trainer on one mesh, so they share the
  weights and nothing is synced) with the vanilla rollout (`Sampler`) and
  `GRPOLearner.train` over a dataset of 2-prompt batches, `num_generations` 8.

A step is timed from before its rollouts start to after its update has finished
(block_until_ready), after `--warmup` untimed steps that compile everything. Tunix
runs the whole loop inside `train()`, so its steps are timed in that loop: the
dataset iterator, read once at the start of each step, waits for the actor's
parameters of the previous update and stamps the time; step k lasts from stamp k to
stamp k + 1 (one extra untimed step closes the last interval). Each subprocess
reports the median of `--repeats` steps; the driver interleaves the systems for
`--rounds` rounds and reports the median over rounds; `tunix_over_jaxagent` is
tunix step_s / jaxagent step_s (the speed-up of jaxagent, goal >= 2). `rollout_s`,
for information, is the part of a step until the 16 completions are on the host
(jaxagent: every request done; tunix: its reward function called); the rest is
rewards, advantages, batching, the update (and for jaxagent the weight copy).

Unavoidable differences: Tunix's Qwen3 has QK-norm weights (2 x head_dim a layer) our
decoder has not; Tunix treats token id 0 (its pad id here: the stand-in tokenizer
needs one) as padding, so a sampled 0 (~1 in 1024 tokens) is left out of its loss and
attention; Tunix's advantages use the sample std (ddof 1), ours the population std;
Tunix samples all 16 with one key (seed None: PRNGKey(0)) and no prefix sharing,
jaxagent with a seed per request and (through the orchestrator) the 8 samples of a
prompt sharing its first KV page by the prefix cache;
jaxagent copies the weights into its engine each step, Tunix shares them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
# tools/bench_tunix.py imports only the standard library at module level: safe in both envs.
_spec = importlib.util.spec_from_file_location("bench_tunix", os.path.join(_HERE, "bench_tunix.py"))
bench_tunix = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_tunix)
SHAPES = bench_tunix.SHAPES

TARGET = 2.0  # goal: jaxagent's GRPO step >= 2x faster than Tunix's
PROMPTS, GROUP = 2, 8  # 16 rollouts a step
LR, CLIP, MAX_GRAD_NORM, B2 = 1e-6, 0.2, 1.0, 0.99


def step_prompts(step: int, n: int, prompt_len: int, vocab: int) -> list[list[int]]:
  """The prompts of step `step`, the same in both systems (ids from 1: 0 is Tunix's pad)."""
  import numpy as np
  return np.random.default_rng(1000 + step).integers(1, vocab, (n, prompt_len)).tolist()


def reward(token_ids) -> float:
  """A trivial deterministic reward: the fraction of even token ids."""
  ids = list(token_ids)
  return sum(1 for t in ids if int(t) % 2 == 0) / max(len(ids), 1)


# --------------------------------------------------------------------------- jaxagent


def run_jaxagent(args) -> None:
  import functools

  import jax
  import jax.numpy as jnp
  import numpy as np

  sys.path.insert(0, os.path.dirname(_HERE))
  from jaxagent.advantages import group_normalized
  from jaxagent.batch import pack
  from jaxagent.config import EngineConfig, LearnerConfig
  from jaxagent.learner import Learner
  from jaxagent.models.config import preset
  from jaxagent.models.sharding import make_mesh
  from rollout_server.engine import PrefillRequest, SamplingParams
  from rollout_server.serving import make_engine, start_orchestrator

  cfg = preset("tiny", **SHAPES[args.shape])
  L, P, N = int(args.max_seq_len), args.prompt_len, args.new_tokens
  mesh = make_mesh()
  learner = Learner(cfg, LearnerConfig(lr=LR, b2=B2, max_grad_norm=MAX_GRAD_NORM, clip_low=CLIP,
                                       clip_high=CLIP, reduction="seq_mean_token_mean"), mesh)
  state = learner.init_state(0)
  e = EngineConfig(slots=PROMPTS * GROUP, max_seq_len=L, max_prefill_length=min(512, L),
                   decode_steps=args.decode_steps or EngineConfig.decode_steps)
  engine = make_engine(cfg, e, mesh)
  # Copies: the learner donates its state, the engine must keep its own weights.
  weights = lambda state: engine.load_params(jax.tree.map(jnp.copy, state.params),  # noqa: E731
                                             version=int(state.policy_version))
  group_ids = np.repeat(np.arange(PROMPTS), GROUP)
  advantages = jax.jit(functools.partial(group_normalized, num_groups=PROMPTS))
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))

  if args.jaxagent_rollout == "orchestrator":  # as train.py's in-process server
    orch = start_orchestrator(engine, weights(state), e)

    def rollouts(prompts, seeds):
      reqs = [orch.submit(p, SamplingParams(temperature=1.0, max_new_tokens=N, seed=seed))
              for p, seed in zip(prompts, seeds)]
      for r in reqs:
        r.wait()
      if any(r.finish_reason != "length" for r in reqs):
        raise RuntimeError(f"rollouts ended: {[r.finish_reason for r in reqs]}")
      return (np.array([r.output_ids for r in reqs]), np.array([r.output_logprobs for r in reqs]))

    def sync(state):
      orch.update_weights(weights(state))
      return orch.params
  else:  # the engine's calls driven directly, as tools/bench_rollout.py's decode_rate
    params, decode_state = [weights(state)], [engine.init_decode_state()]
    per_seq = engine.pages_for(P + N + 1)

    def rollouts(prompts, seeds):
      ds, first, rest = decode_state.pop(), [], []
      for lo in range(0, len(prompts), engine.prefill_rows):
        slots = list(range(lo, min(len(prompts), lo + engine.prefill_rows)))
        reqs = [PrefillRequest(prompts[i], range(1 + i * per_seq, 1 + (i + 1) * per_seq), 0,
                               SamplingParams(seed=seeds[i])) for i in slots]
        ds, prefix, res = engine.prefill_many(params=params[0], decode_state=ds, requests=reqs)
        ds = engine.insert_many(prefix, ds, slots)
        first.append((res, len(slots)))
      for _ in range(N - 1):
        ds, res = engine.generate(params[0], ds)
        res.data.copy_to_host_async()
        rest.append(res)
      decode_state.append(engine.release(ds, list(range(len(prompts)))))
      head = [(h.tokens[:n], h.logp[:n]) for h, n in ((r.to_host(), n) for r, n in first)]
      tail = [r.to_host() for r in rest]
      tokens = np.c_[np.concatenate([t for t, _ in head]), np.stack([h.tokens for h in tail], 1)]
      logp = np.c_[np.concatenate([lp for _, lp in head]), np.stack([h.logp for h in tail], 1)]
      return tokens, logp

    def sync(state):
      params[0] = weights(state)
      return params[0]

  def grpo_step(state, step):
    prompts = [p for p in step_prompts(step, PROMPTS, P, cfg.vocab_size) for _ in range(GROUP)]
    t0 = time.perf_counter()
    tokens, logp = rollouts(prompts, [step * len(prompts) + i for i in range(len(prompts))])
    t_rollouts = time.perf_counter() - t0
    if tokens.shape != (len(prompts), N):
      raise RuntimeError(f"rollouts of shape {tokens.shape}, not {(len(prompts), N)}")
    adv = np.asarray(advantages(np.array([reward(t) for t in tokens], np.float32), group_ids))
    segments = [{"tokens": np.r_[prompts[i], tokens[i]].astype(np.int32),
                 "loss_mask": np.r_[np.zeros(P), np.ones(N)].astype(np.float32),
                 "rollout_logp": np.r_[np.zeros(P), logp[i]].astype(np.float32),
                 "advantages": np.r_[np.zeros(P), np.full(N, adv[i])].astype(np.float32),
                 "rollout_id": i} for i in range(len(prompts))]
    batch, placed = pack(segments, rows=len(segments), seq_len=P + N)
    assert (placed >= 0).all()
    state, metrics = learner.step(state, batch)
    metrics = jax.device_get(metrics)
    jax.block_until_ready((sync(state), state))
    return state, (time.perf_counter() - t0, t_rollouts), metrics

  times, rollout_times = [], []
  for step in range(args.warmup + args.repeats):
    state, (dt, dt_rollouts), metrics = grpo_step(state, step)
    if step >= args.warmup:
      times.append(dt)
      rollout_times.append(dt_rollouts)
  if args.jaxagent_rollout == "orchestrator":
    orch.stop()
  if not np.isfinite(metrics["loss"]):
    raise RuntimeError(f"non-finite loss: {metrics}")
  bench_tunix._result({"params": n_params, "step_s": statistics.median(times), "times": times,
                       "rollout_s": statistics.median(rollout_times),
                       "platform": jax.devices()[0].platform, "decode_steps": e.decode_steps})


# --------------------------------------------------------------------------- tunix


def run_tunix(args) -> None:
  import jax
  import numpy as np
  import optax
  from flax import nnx
  from tunix.rl import rl_cluster as rl_cluster_lib
  from tunix.rl.grpo import grpo_learner
  from tunix.rl.rollout import base_rollout

  s = SHAPES[args.shape]
  L, P, N = int(args.max_seq_len), args.prompt_len, args.new_tokens
  model, n_params = bench_tunix.tunix_model(args.shape, args.tunix_model)

  total = args.warmup + args.repeats + 1  # the last step only closes the last interval
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  roles = rl_cluster_lib.Role
  optimizer = optax.chain(optax.clip_by_global_norm(MAX_GRAD_NORM),
                          optax.adamw(LR, b1=0.9, b2=B2, eps=1e-8, weight_decay=0.0))
  cluster = rl_cluster_lib.RLCluster(
      actor=model, tokenizer=bench_tunix._IdTokenizer(),
      cluster_config=rl_cluster_lib.ClusterConfig(
          role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh},
          rollout_engine="vanilla", offload_to_cpu=False,
          training_config=rl_cluster_lib.RLTrainingConfig(
              actor_optimizer=optimizer, eval_every_n_steps=10**9, max_steps=total,
              mini_batch_size=PROMPTS, train_micro_batch_size=PROMPTS,
              rollout_micro_batch_size=PROMPTS, compute_logps_micro_batch_size=PROMPTS,
              pbar_description=None),
          rollout_config=base_rollout.RolloutConfig(
              max_tokens_to_generate=N, max_prompt_length=P, kv_cache_size=L,
              temperature=1.0, top_p=1.0, top_k=None,
              eos_tokens=[bench_tunix._IdTokenizer().eos_id()])))
  lengths, stamps, reward_stamps = [], [], []

  def reward_fn(prompts, completions, **_):  # called once a step, right after the rollouts
    reward_stamps.append(time.perf_counter())
    ids = [[int(t) for t in c.split()] for c in completions]
    lengths.extend(len(i) for i in ids)
    return [reward(i) for i in ids]

  learner = grpo_learner.GRPOLearner(
      cluster, grpo_learner.GRPOConfig(num_generations=GROUP, num_iterations=1, beta=0.0,
                                       epsilon=CLIP, loss_agg_mode="sequence-mean-token-mean"),
      reward_fns=reward_fn)

  def dataset():  # read by Tunix once at the start of each step
    for step in range(total):
      prompts = np.array([" ".join(map(str, p))
                          for p in step_prompts(step, PROMPTS, P, s["vocab_size"])])
      jax.block_until_ready(nnx.state(cluster.actor_trainer.model, nnx.Param))
      stamps.append(time.perf_counter())
      yield {"prompts": prompts}

  learner.train(dataset())
  if len(stamps) != total or cluster.actor_trainer.train_steps != total:
    raise RuntimeError(f"Tunix ran {cluster.actor_trainer.train_steps} updates and read "
                       f"{len(stamps)} batches, not {total}")
  if set(lengths) != {N}:
    raise RuntimeError(f"Tunix completions of {sorted(set(lengths))} tokens, not {N}")
  assert not any(m == "jaxagent" or m.startswith(("jaxagent.", "rollout_server"))
                 for m in sys.modules), "the tunix mode must not import this repository"
  times = [b - a for a, b in zip(stamps, stamps[1:])][args.warmup:]
  rollout_times = [b - a for a, b in zip(stamps, reward_stamps)][args.warmup:total - 1]
  bench_tunix._result({"params": n_params, "step_s": statistics.median(times), "times": times,
                       "rollout_s": statistics.median(rollout_times),
                       "platform": jax.devices()[0].platform})


# --------------------------------------------------------------------------- driver


def _child(python: str, system: str, shape: str, max_seq_len: int, args) -> dict:
  cmd = [python, os.path.abspath(__file__), "--system", system, "--shape", shape,
         "--max-seq-len", str(max_seq_len), "--prompt-len", str(args.prompt_len),
         "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats),
         "--warmup", str(args.warmup), "--tunix-model", args.tunix_model,
         "--jaxagent-rollout", args.jaxagent_rollout]
  if args.decode_steps:
    cmd += ["--decode-steps", str(args.decode_steps)]
  # The tunix child starts outside the repository so that nothing of ours is on its path.
  cwd = os.path.dirname(_HERE) if system == "jaxagent" else "/"
  proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
  rows = [line[len("RESULT "):] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
  if proc.returncode or not rows:
    sys.exit(f"{system} {shape} max_seq_len {max_seq_len} failed (exit {proc.returncode}):\n"
             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
  return json.loads(rows[-1])


def drive(args) -> None:
  shapes = args.shapes.split(",")
  seq_lens = [int(x) for x in str(args.max_seq_len).split(",")]
  systems = {"jaxagent": sys.executable}
  try:
    tunix_version = bench_tunix._tunix_version(args.tunix_python)
    systems["tunix"] = args.tunix_python
  except SystemExit as e:  # its message says how to install Tunix
    tunix_version = None
    print(f"{e.code}\n\nRunning only the jaxagent side.\n", file=sys.stderr, flush=True)
  rollouts = PROMPTS * GROUP
  print(f"# load average {os.getloadavg()[0]:.2f}; tunix {tunix_version or 'not installed'}"
        f" ({args.tunix_model}); {args.rounds} rounds x {args.repeats} timed steps after "
        f"{args.warmup} warm-up; {PROMPTS} prompts x {GROUP} = {rollouts} rollouts, prompt "
        f"{args.prompt_len}, {args.new_tokens} new tokens, temperature 1", flush=True)
  runs: dict[tuple, list[dict]] = {}
  t_start = time.perf_counter()
  for r in range(args.rounds):
    for shape in shapes:
      for L in seq_lens:
        for system, python in systems.items():
          row = _child(python, system, shape, L, args)
          runs.setdefault((system, shape, L), []).append(row)
          print(f"# round {r + 1}: {system} {shape} max_seq_len {L}: {row['step_s']:.3f} s/step, "
                f"rollouts {row['rollout_s']:.3f} s "
                f"(steps {', '.join(f'{t:.3f}' for t in row['times'])})",
                file=sys.stderr, flush=True)
  med = {}
  for (system, shape, L), rows in runs.items():
    step_s = statistics.median(r["step_s"] for r in rows)
    med[system, shape, L] = out = {
        "bench": "grpo_step", "system": system, "shape": shape, "max_seq_len": L,
        "rollouts": rollouts, "prompts": PROMPTS, "group": GROUP, "prompt": args.prompt_len,
        "new_tokens": args.new_tokens, "params": rows[0]["params"],
        "step_s": round(step_s, 4), "steps_per_s": round(1.0 / step_s, 3),
        "rollout_s": round(statistics.median(r["rollout_s"] for r in rows), 4),
        "rounds": [round(r["step_s"], 4) for r in rows], "platform": rows[0]["platform"]}
    if system == "tunix":
      out.update(model=args.tunix_model, tunix_version=tunix_version)
    else:
      out.update(rollout_via=args.jaxagent_rollout, decode_steps=rows[0].get("decode_steps"))
    if args.json:
      print(json.dumps(out), flush=True)
  ratios = {}
  for shape in shapes:
    for L in seq_lens:
      if ("tunix", shape, L) not in med:
        continue
      ours, theirs = med["jaxagent", shape, L], med["tunix", shape, L]
      qk_norm = 2 * SHAPES[shape]["head_dim"] * SHAPES[shape]["n_layers"]
      if theirs["params"] != ours["params"] + (qk_norm if args.tunix_model == "qwen3" else 0):
        print(f"warning: {shape}: parameter counts differ beyond QK-norm: jaxagent "
              f"{ours['params']}, tunix {theirs['params']}", file=sys.stderr)
      ratio = ratios[shape, L] = {
          "bench": "grpo_step", "shape": shape, "max_seq_len": L,
          "tunix_over_jaxagent": round(theirs["step_s"] / ours["step_s"], 2), "target": TARGET}
      ratio["meets_target"] = ratio["tunix_over_jaxagent"] >= TARGET
      if args.json:
        print(json.dumps(ratio), flush=True)
  print(f"\n# wall time {time.perf_counter() - t_start:.0f} s")
  print(f"{'shape':<6} {'max_seq_len':>11} {'system':<9} {'params':>9} {'step s':>8} "
        f"{'rollout s':>9} {'steps/s':>8} {'rounds (s)':<22} {'tunix/jaxagent':>14}")
  for (system, shape, L), out in sorted(med.items(), key=lambda kv: (kv[0][1], kv[0][2])):
    r = ratios.get((shape, L))
    speedup = "" if system != "tunix" or r is None else \
        f"{r['tunix_over_jaxagent']:.2f}x {'>=' if r['meets_target'] else '<'} {TARGET:g}"
    print(f"{shape:<6} {L:>11} {system:<9} {out['params']:>9,} {out['step_s']:>8.3f} "
          f"{out['rollout_s']:>9.3f} {out['steps_per_s']:>8.2f} "
          f"{' '.join(f'{x:.3f}' for x in out['rounds']):<22} "
          f"{speedup:>14}")


def main() -> None:
  p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--system", choices=["driver", "jaxagent", "tunix"], default="driver",
                 help="driver (default) runs the other two as interleaved subprocesses")
  p.add_argument("--shapes", default="1.1m", help="driver: shapes to run (1.1m, 6.2m)")
  p.add_argument("--shape", choices=sorted(SHAPES), default="1.1m", help="child: the shape")
  p.add_argument("--max-seq-len", default="128",
                 help="KV cache length; the driver takes a list, e.g. 128,1024")
  p.add_argument("--rounds", type=int, default=3, help="driver: subprocesses per system and case")
  p.add_argument("--repeats", type=int, default=5, help="timed steps per subprocess (median)")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps that compile everything")
  p.add_argument("--prompt-len", type=int, default=32)
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--tunix-python", default=bench_tunix.DEFAULT_TUNIX_PYTHON,
                 help="a Python with google-tunix installed")
  p.add_argument("--tunix-model", choices=["qwen3", "llama3"], default="qwen3")
  p.add_argument("--jaxagent-rollout", choices=["orchestrator", "engine"], default="orchestrator",
                 help="jaxagent rollouts through the orchestrator (as training) or the engine's "
                      "prefill/insert/generate calls directly")
  p.add_argument("--decode-steps", type=int, default=None,
                 help="jaxagent: decode steps a device call (default: the engine config's)")
  p.add_argument("--json", action="store_true", help="driver: one JSON object per line")
  args = p.parse_args()
  {"driver": drive, "jaxagent": run_jaxagent, "tunix": run_tunix}[args.system](args)


if __name__ == "__main__":
  main()

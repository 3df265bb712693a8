"""`python -m jaxagent.train --config configs/<run>.yaml [key=value ...]`.

Until the end-to-end agentic loop lands, this is the learner smoke run: the
configured model trains for `steps` steps on synthetic trajectories from a
grain pipeline, with periodic run checkpoints and policy exports. At the end
it restores the last checkpoint and checks it equals the live state bit for
bit. `--resume` continues a run directory from its last checkpoint, data
iterator position included.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import numpy as np
from tqdm import tqdm

from jaxagent import config as config_lib
from jaxagent.batch import pack
from jaxagent.build import build_model, describe
from jaxagent.checkpoint import RunCheckpointer, export_policy
from jaxagent.data import synthetic_dataset, take
from jaxagent.learner import Learner
from jaxagent.models.sharding import make_mesh

SYNTHETIC_MAX_LEN = 64


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog="python -m jaxagent.train", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True, help="YAML run config (see configs/)")
  p.add_argument("--run-dir", default=None, help="run directory (default: runs/<name>-<time>)")
  p.add_argument("--resume", action="store_true", help="continue --run-dir from its last checkpoint")
  p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. learner.lr=3e-4")
  return p.parse_args(argv)


def trees_equal(a, b) -> bool:
  return all(jax.tree.leaves(jax.tree.map(
      lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), a, b)))


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    cfg = config_lib.load(config_lib.RunConfig, args.config, args.overrides)
  except config_lib.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.resume and not args.run_dir:
    print("error: --resume needs --run-dir", file=sys.stderr)
    return 2
  run_dir = args.run_dir or os.path.join("runs", f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, "config.json"), "w") as f:
    json.dump(config_lib.to_dict(cfg), f, indent=1)

  mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
  model_cfg, params, tokenizer = build_model(cfg.model, mesh)
  print(f"model: {describe(model_cfg)}")
  print(f"mesh: {dict(mesh.shape)} on {jax.devices()[0].platform}; run dir: {run_dir}")
  learner = Learner(model_cfg, cfg.learner, mesh)
  state = learner.init_state(cfg.seed, params)
  target = tokenizer.encode("a")[0]
  data = iter(synthetic_dataset(seed=cfg.data.seed, vocab=min(model_cfg.vocab_size, 256),
                                target=target, shuffle=cfg.data.shuffle))
  ckpt = RunCheckpointer(os.path.join(run_dir, "checkpoints"), keep=cfg.checkpoint.keep,
                         async_save=cfg.checkpoint.async_save)
  meta = {"config": config_lib.to_dict(cfg), "model": dataclasses.asdict(model_cfg),
          "tokenizer": tokenizer.identity()}
  start = 0
  if args.resume:
    state, _ = ckpt.restore(learner.abstract_state(), data)
    start = int(state.step)
    print(f"resumed from step {start}")

  if cfg.data.seq_len < SYNTHETIC_MAX_LEN:
    print(f"error: data.seq_len must be >= {SYNTHETIC_MAX_LEN} for synthetic trajectories",
          file=sys.stderr)
    return 2
  per_step = cfg.data.rows * (cfg.data.seq_len // SYNTHETIC_MAX_LEN)  # always fits (first fit)
  t_start = time.time()
  metrics_path = os.path.join(run_dir, "metrics.jsonl")
  bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="learner",
             dynamic_ncols=True)
  with open(metrics_path, "a") as log:
    for step in bar:
      segs = take(data, per_step)
      batch, placed = pack(segs, cfg.data.rows, cfg.data.seq_len, tokenizer.pad_id)
      assert (placed >= 0).all()
      t0 = time.time()
      state, m = learner.step(state, batch)
      m = {k: float(v) for k, v in jax.device_get(m).items()}
      dt = time.time() - t0
      rewards = [s["reward"] for s in segs]
      row = {"step": step + 1, "wall_time_s": round(time.time() - t_start, 3),
             "reward_mean": float(np.mean(rewards)), "success_rate": float(np.mean(rewards)),
             "step_time_s": round(dt, 4), "tokens_per_s": float(batch.tokens.size / dt), **m}
      log.write(json.dumps(row) + "\n")
      bar.set_postfix(loss=f"{m['loss']:.4f}", ent=f"{m['entropy']:.3f}",
                      tok_s=f"{row['tokens_per_s']:.0f}")
      version = step + 1
      if cfg.checkpoint.every_steps and version % cfg.checkpoint.every_steps == 0:
        ckpt.save(version, state, meta, data)
      if cfg.checkpoint.export_every and version % cfg.checkpoint.export_every == 0:
        export_policy(os.path.join(run_dir, "policy"), version, state.params,
                      cfg.checkpoint.export_dtype)
  final = int(state.step)
  if ckpt.latest_step() != final:
    ckpt.save(final, state, meta, data, force=True)
  ckpt.wait()
  restored, _ = ckpt.restore(learner.abstract_state())
  same = trees_equal(restored, state)
  print(f"checkpoint step {final} written to {ckpt.directory}; restored state "
        f"{'equals' if same else 'DIFFERS FROM'} the live state bit for bit")
  ckpt.close()
  return 0 if same else 1


if __name__ == "__main__":
  sys.exit(main())

"""`python -m jaxagent.export_hf --policy RUN_DIR/policy[/vN] --out DIR [--dtype bfloat16]`

Writes a trained policy (the latest export, or version N) as a Hugging Face checkpoint
that transformers' `from_pretrained` (and what reads its format: vLLM, llama.cpp's
converter) loads:

- `config.json`: Llama, or Qwen2 for a model with q/k/v biases;
- `model.safetensors`: the weights, cast to `--dtype` (bfloat16, float16 or float32);
- `tokenizer.json`, `tokenizer_config.json`: the vocabulary and the chat template the
  run trained with (its `config.json` names it);
- `generation_config.json`: the end-of-turn tokens to stop at.

The model comes from the run's `config.json` (`--config` to give another). transformers'
`apply_chat_template` renders the same text and tokenizes it whole; the run encoded
message content as plain text, so ids differ where a message holds a control string.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from typing import Optional


def export(policy: str, out: str, dtype: str = "bfloat16", config: Optional[str] = None) -> dict:
  """Writes the Hugging Face checkpoint; returns what was written and from what."""
  import jax
  import numpy as np
  from flax import nnx

  from jaxagent import config as config_lib
  from jaxagent.build import build_model
  from jaxagent.checkpoint import abstract_params_like, load_policy
  from jaxagent.eval import policy_option, run_config_of
  from jaxagent.models.hf import hf_config, save_hf
  from jaxagent.models.params import abstract_model
  from jaxagent.models.sharding import make_mesh
  from jaxagent.run_checks import check_model_and_learner
  from rollout_server.serving import resolve_policy

  policy = policy_option(policy)  # (RUN_DIR/policy/v7 as well as .../v00000007)
  cfg = run_config_of(policy, config)
  # (an unknown preset was a KeyError's traceback: a red team)
  check_model_and_learner(config_lib.RunConfig(model=cfg.model))
  path, version = resolve_policy(policy, None)
  # (a run's config.json names the template it trained with, chatml_tools where it
  # chose that one for its tasks' tools)
  model_cfg, _, tokenizer = build_model(cfg.model, make_mesh(devices=jax.devices()[:1]))
  # (a model the format cannot hold fails before the load)
  architecture = hf_config(model_cfg, dtype)["architectures"][0]
  shapes = nnx.to_pure_dict(abstract_model(model_cfg)[1])
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = abstract_params_like(shapes, jax.tree.map(lambda _: one, shapes), np.float32)
  params = {k: np.asarray(jax.device_get(v), np.float32)
            for k, v in load_policy(path, abstract).items()}
  stops = list(tokenizer.stop_ids)
  bos = tokenizer.tok.token_to_id(tokenizer.bos_token) if tokenizer.bos_token else None
  files = save_hf(out, model_cfg, params, dtype, bos_token_id=bos,
                  eos_token_id=stops if len(stops) > 1 else stops[0],
                  pad_token_id=tokenizer.pad_id)
  files += tokenizer.save_hf(out)
  generation = {"eos_token_id": stops, "pad_token_id": tokenizer.pad_id}
  if bos is not None:
    generation["bos_token_id"] = bos
  files.append(os.path.join(out, "generation_config.json"))
  with open(files[-1], "w") as f:
    json.dump(generation, f, indent=2)
  return {"policy": path, "policy_version": version, "out": out, "dtype": dtype,
          "files": sorted(os.path.basename(f) for f in files),
          "architecture": architecture,
          "parameters": int(sum(p.size for p in params.values()))}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
      allow_abbrev=False, prog="python -m jaxagent.export_hf", description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--policy", required=True,
                 help="a run's policy exports (RUN_DIR/policy: the latest) or RUN_DIR/policy/vN")
  p.add_argument("--out", required=True, help="the directory to write")
  p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
  p.add_argument("--config", default=None, help="the run's config (default: its config.json)")
  args = p.parse_args(argv)
  from jaxagent import config as config_lib

  if os.path.isdir(args.out) and os.listdir(args.out):
    print(f"error: --out: {args.out} is not empty (no checkpoint is written over)",
          file=sys.stderr)
    return 2
  made = not os.path.exists(args.out)
  try:  # (made before the model loads: red team 25; made, not judged by its modes: root
    # may write anywhere by them, and /proc still refused it, unnamed: a walkthrough)
    os.makedirs(args.out, exist_ok=True)
    probe = tempfile.NamedTemporaryFile(dir=args.out)
    probe.close()
  except OSError as e:
    print(f"error: --out: cannot write the directory {args.out} ({e.strerror})",
          file=sys.stderr)
    return 2
  try:
    done = export(args.policy, args.out, args.dtype, args.config)
  except (config_lib.ConfigError, ValueError, FileNotFoundError, OSError) as e:
    if made:  # (nothing exported: the directory this made goes, if nothing is in it)
      with contextlib.suppress(OSError):
        os.rmdir(args.out)
    if isinstance(e, OSError) and not isinstance(e, FileNotFoundError):
      print(f"error: writing {args.out}: {e}", file=sys.stderr)
      return 1
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"policy v{done['policy_version']} ({done['architecture']}, "
        f"{done['parameters']:,} parameters, {done['dtype']}) -> {done['out']}: "
        + ", ".join(done["files"]))
  return 0


if __name__ == "__main__":
  from jaxagent.checkpoint import end_command

  end_command(main())

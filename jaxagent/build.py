"""Builds the model and tokenizer a `ModelSpec` names: a preset, a HF directory or a GGUF."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

from jax.sharding import Mesh

from jaxagent.config import ModelSpec
from jaxagent.models import hf
from jaxagent.models.config import ModelConfig, preset
from jaxagent.models.params import Params
from jaxagent.models.sharding import Rules, TRAIN_RULES
from jaxagent.tokenizer import CHATML_TOOLS_TEMPLATE, Tokenizer


def build_model(spec: ModelSpec, mesh: Optional[Mesh] = None, rules: Rules = TRAIN_RULES
                ) -> tuple[ModelConfig, Optional[Params], Tokenizer]:
  """Model config, loaded parameters (None for a random init) and tokenizer."""
  overrides = dict(dtype=spec.dtype, param_dtype=spec.param_dtype, remat=spec.remat)
  templates = {None: None, "chatml_tools": CHATML_TOOLS_TEMPLATE}
  if spec.chat_template not in templates:
    raise ValueError(f"model.chat_template: unknown {spec.chat_template!r}; known: "
                     "null (the tokenizer's own), chatml_tools")
  template = templates[spec.chat_template]
  ckpt = spec.checkpoint
  if ckpt is None:
    return preset(spec.preset, **overrides), None, Tokenizer.byte_level()
  if ckpt == "smollm2":
    ckpt = hf.smollm2_gguf_path()
  if ckpt.endswith(".gguf"):
    cfg, params = hf.load_gguf(ckpt, mesh, rules, **overrides)
    return cfg, params, Tokenizer.from_gguf(ckpt, template)
  if os.path.isdir(ckpt):
    cfg, params = hf.load_hf(ckpt, mesh, rules, **overrides)
    return cfg, params, _hf_tokenizer(ckpt, template)
  raise FileNotFoundError(
      f"model.checkpoint: {ckpt!r} is neither a .gguf file, a HF checkpoint directory, "
      "nor 'smollm2'")


def _hf_tokenizer(path: str, template: Optional[str] = None) -> Tokenizer:
  tj = os.path.join(path, "tokenizer.json")
  if not os.path.exists(tj):
    raise FileNotFoundError(f"no tokenizer.json in {path}")
  conf = {}
  tc = os.path.join(path, "tokenizer_config.json")
  if os.path.exists(tc):
    with open(tc) as f:
      conf = json.load(f)

  def text(t):
    return t.get("content") if isinstance(t, dict) else t

  template = template or conf.get("chat_template") or CHATML_TOOLS_TEMPLATE
  eos = text(conf.get("eos_token")) or "<|endoftext|>"
  return Tokenizer.from_file(tj, template, eos_token=eos,
                             pad_token=text(conf.get("pad_token")) or eos,
                             bos_token=text(conf.get("bos_token")),
                             stop_tokens=["<|im_end|>"] if "<|im_end|>" in template else [],
                             name=os.path.basename(os.path.normpath(path)))


def describe(cfg: ModelConfig) -> str:
  fields = {k: v for k, v in dataclasses.asdict(cfg).items() if v not in (None, False)}
  return f"{cfg.num_params() / 1e6:.2f}M params " + json.dumps(fields)

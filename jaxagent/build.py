"""Builds the model and tokenizer a `ModelSpec` names: a preset, a HF directory or a GGUF."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Optional, Sequence

from jax.sharding import Mesh

from jaxagent.config import ConfigError, ModelSpec
from jaxagent.models import hf
from jaxagent.models.config import ModelConfig, preset
from jaxagent.models.params import Params
from jaxagent.models.sharding import Rules, TRAIN_RULES
from jaxagent.tokenizer import (CHATML_TOOLS_TEMPLATE, IM_END, IM_START, Tokenizer,
                                renders_tools, tool_names)

# model.chat_template values: None is the tokenizer's own template.
TEMPLATES = {None: None, "chatml_tools": CHATML_TOOLS_TEMPLATE}


def model_overrides(spec: ModelSpec) -> dict:
  """The `ModelConfig` fields a `ModelSpec` sets over a preset's or a checkpoint's."""
  overrides = dict(dtype=spec.dtype, param_dtype=spec.param_dtype, remat=spec.remat,
                   attention=spec.attention, attention_block=spec.attention_block)
  if spec.scan_unroll is not None:  # None keeps the preset's
    overrides["scan_unroll"] = spec.scan_unroll
  if spec.max_seq_len is not None:
    overrides["max_seq_len"] = spec.max_seq_len
  return overrides


def build_model(spec: ModelSpec, mesh: Optional[Mesh] = None, rules: Rules = TRAIN_RULES,
                tools: Sequence[dict] = ()) -> tuple[ModelConfig, Optional[Params], Tokenizer]:
  """Model config, loaded parameters (None for a random init) and tokenizer.

  `tools` are the tools the tasks offer (OpenAI `tools` entries): with the
  checkpoint's own template (`model.chat_template: null`) and a template that
  drops them, `chatml_tools` is used instead (see `choose_template`).
  """
  overrides = model_overrides(spec)
  if spec.chat_template not in TEMPLATES:
    raise ValueError(f"model.chat_template: unknown {spec.chat_template!r}; known: "
                     "null (the tokenizer's own), chatml_tools")
  ckpt = spec.checkpoint
  if ckpt is None:
    return preset(spec.preset, **overrides), None, Tokenizer.byte_level()
  if ckpt == "smollm2":
    try:
      ckpt = hf.smollm2_gguf_path()
    except FileNotFoundError as e:  # (a user's missing install step: one line, not a trace)
      raise ConfigError(f"model.checkpoint smollm2: {e}") from None
  if ckpt.endswith(".gguf"):  # the tokenizer first: a template error fails before the load
    tokenizer = choose_template(lambda t: Tokenizer.from_gguf(ckpt, t), spec.chat_template,
                                tools)
    return (*hf.load_gguf(ckpt, mesh, rules, **overrides), tokenizer)
  if os.path.isdir(ckpt):
    tokenizer = choose_template(lambda t: _hf_tokenizer(ckpt, t, spec.tokenizer),
                                spec.chat_template, tools)
    return (*hf.load_hf(ckpt, mesh, rules, **overrides), tokenizer)
  raise FileNotFoundError(
      f"model.checkpoint: {ckpt!r} is neither a .gguf file, a HF checkpoint directory, "
      "nor 'smollm2'")


def choose_template(make_tokenizer: Callable[[Optional[str]], Tokenizer],
                    chat_template: Optional[str], tools: Sequence[dict]) -> Tokenizer:
  """The tokenizer with the template `model.chat_template` names, unless the tasks offer
  `tools` and the checkpoint's own template (`chat_template=None`) drops them: then
  `chatml_tools` (printed), where the vocabulary has the ChatML tokens it needs, and
  otherwise `ConfigError` naming `model.chat_template`.

  `make_tokenizer(template)` builds the tokenizer with a template's text (None: its own).
  """
  tokenizer = make_tokenizer(TEMPLATES[chat_template])
  if not tools or renders_tools(tokenizer, tools):
    return tokenizer
  names = ", ".join(tool_names(tools))
  if chat_template is not None:
    raise ConfigError(f"model.chat_template: {chat_template} does not render the tools the "
                      f"tasks offer ({names})")
  if any(tokenizer.tok.token_to_id(t) is None for t in (IM_START, IM_END)):
    raise ConfigError(
        f"model.chat_template: the chat template of {tokenizer.name} drops the tools the tasks "
        f"offer ({names}), and its vocabulary has no {IM_START} / {IM_END} for chatml_tools; "
        "use a checkpoint whose template renders tools")
  print(f"model.chat_template: the chat template of {tokenizer.name} drops the tools the "
        f"tasks offer ({names}); using chatml_tools (set model.chat_template to choose)",
        flush=True)
  return make_tokenizer(CHATML_TOOLS_TEMPLATE)


def hf_tokenizer_file(path: str, tokenizer: Optional[str] = None) -> str:
  """The tokenizer.json of checkpoint directory `path`: its own, or `tokenizer`
  (`model.tokenizer`: a tokenizer.json, or a directory with one); ConfigError naming the
  setting when there is none."""
  if tokenizer is not None:
    tj = os.path.join(tokenizer, "tokenizer.json") if os.path.isdir(tokenizer) else tokenizer
    if not os.path.isfile(tj):
      raise ConfigError(f"model.tokenizer: no tokenizer.json at {tokenizer!r}")
    return tj
  tj = os.path.join(path, "tokenizer.json")
  if not os.path.exists(tj):
    slow = sorted(f for f in ("tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
                              "spiece.model") if os.path.exists(os.path.join(path, f)))
    has = f" (it has {', '.join(slow)}: a slow tokenizer)" if slow else ""
    raise ConfigError(
        f"model.checkpoint: {path} has no tokenizer.json{has}; set model.tokenizer to a "
        "tokenizer.json (or a directory with one) for this vocabulary; transformers writes one "
        "with AutoTokenizer.from_pretrained(PATH).save_pretrained(DIR)")
  return tj


def _hf_tokenizer(path: str, template: Optional[str] = None,
                  tokenizer: Optional[str] = None) -> Tokenizer:
  """The tokenizer of checkpoint directory `path` (see `hf_tokenizer_file`); the special
  tokens and template come from the tokenizer_config.json beside its tokenizer.json
  (else the checkpoint's)."""
  tj = hf_tokenizer_file(path, tokenizer)
  conf = {}
  for tc in (os.path.join(os.path.dirname(tj), "tokenizer_config.json"),
             os.path.join(path, "tokenizer_config.json")):
    if os.path.exists(tc):
      with open(tc) as f:
        conf = json.load(f)
      break

  def text(t):
    return t.get("content") if isinstance(t, dict) else t

  template = template or _own_template(conf, [os.path.dirname(tj), path]) \
      or CHATML_TOOLS_TEMPLATE
  eos = text(conf.get("eos_token")) or "<|endoftext|>"
  return Tokenizer.from_file(tj, template, eos_token=eos,
                             pad_token=text(conf.get("pad_token")) or eos,
                             bos_token=text(conf.get("bos_token")),
                             stop_tokens=["<|im_end|>"] if "<|im_end|>" in template else [],
                             name=os.path.basename(os.path.normpath(path)))


def _own_template(conf: dict, directories: list[str]) -> Optional[str]:
  """A checkpoint's own chat template: its chat_template.jinja (where transformers now
  saves it, not in tokenizer_config.json: jaxagent's ChatML was used in its place
  without a word; a reviewer), else tokenizer_config.json's, whose list form of named
  templates gives its `tool_use` one, else its `default`; None where it has none."""
  for directory in dict.fromkeys(directories):
    jinja = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(jinja):
      with open(jinja, encoding="utf-8") as f:
        return f.read()
  template = conf.get("chat_template")
  if isinstance(template, list):
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    template = named.get("tool_use") or named.get("default")
    if not isinstance(template, str):
      raise ConfigError(f"tokenizer_config.json: chat_template is a list of templates "
                        f"without a 'tool_use' or 'default' one (it names "
                        f"{sorted(map(str, named))}): give model.chat_template")
  if template is not None and not isinstance(template, str):
    raise ConfigError("tokenizer_config.json: chat_template is neither a template nor a "
                      "list of named ones: give model.chat_template")
  return template


def describe(cfg: ModelConfig) -> str:
  fields = {k: v for k, v in dataclasses.asdict(cfg).items() if v not in (None, False)}
  return f"{cfg.num_params() / 1e6:.2f}M params " + json.dumps(fields)

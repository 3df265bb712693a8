"""Architecture hyper-parameters of the Llama / Qwen2 decoder family, with presets."""

from __future__ import annotations

import dataclasses
from typing import Optional


# `ModelConfig.remat`: what `jax.checkpoint` may keep of a layer's forward pass.
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 style frequency-dependent RoPE scaling ("rope_type": "llama3")."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape of a decoder-only transformer (RMSNorm, RoPE, GQA, SwiGLU)."""

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  d_ff: int
  rope_theta: float = 10_000.0
  rope_scaling: Optional[RopeScaling] = None
  norm_eps: float = 1e-5
  qkv_bias: bool = False
  tie_embeddings: bool = False
  max_seq_len: int = 2048
  # Compute dtype for matmuls; softmax, norms and logits always run in float32.
  dtype: str = "float32"
  param_dtype: str = "float32"
  # What the backward pass keeps of each layer's forward (see REMAT_POLICIES):
  # none (everything), full (only the layer's input; recompute the rest),
  # dots (matmul outputs), dots_no_batch (matmuls without batch dims: weights').
  # true / false are accepted for full / none.
  remat: str = "none"
  # Training attention (jaxagent.models.attention): auto | dense | flash | dot_product,
  # and the flash implementation's block of positions.
  attention: str = "auto"
  attention_block: int = 256
  # Layers per iteration of the layer scan (1: a rolled loop; n_layers: unrolled).
  # Unrolling lets XLA fuse across layers and makes the scan's backward cheaper.
  scan_unroll: int = 1

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                 "d_ff", "attention_block", "scan_unroll"):
      if getattr(self, name) <= 0:  # (n_kv_heads 0 was a ZeroDivisionError; -1 passed)
        raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
    if isinstance(self.remat, bool):  # frozen: set through object.__setattr__
      object.__setattr__(self, "remat", "full" if self.remat else "none")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat: unknown {self.remat!r}; known: {', '.join(REMAT_POLICIES)}")
    from jaxagent.models.attention import IMPLEMENTATIONS
    if self.attention not in IMPLEMENTATIONS:
      raise ValueError(f"attention: unknown {self.attention!r}; known: "
                       f"{', '.join(IMPLEMENTATIONS)}")

  def num_params(self) -> int:
    d, f, l = self.d_model, self.d_ff, self.n_layers
    attn = d * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
    if self.qkv_bias:
      attn += self.head_dim * (self.n_heads + 2 * self.n_kv_heads)
    per_layer = attn + 3 * d * f + 2 * d
    head = 0 if self.tie_embeddings else d * self.vocab_size
    return self.vocab_size * d + l * per_layer + d + head

  def train_flops(self, tokens: float, attended_keys: float) -> float:
    """Matmul FLOPs of training on `tokens` tokens (forward + backward = 3 x forward)
    whose queries attend to `attended_keys` keys in all (each token: its position in
    its sequence + 1). Counts every weight matmul (including the output head) and the
    attention score and value products the model needs, as MFU counts them; work an
    implementation adds (recomputation, masked-out blocks, padding) does not count.
    """
    d, f, l = self.d_model, self.d_ff, self.n_layers
    weights = l * (d * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads) + 3 * d * f)
    weights += d * self.vocab_size
    attention = l * 2 * self.n_heads * self.head_dim  # QK and PV, per attended key
    return 3 * 2 * (weights * tokens + attention * attended_keys)

  def train_flops_per_token(self, seq_len: int) -> float:
    """`train_flops` per token of unpacked rows of `seq_len` tokens (causal context)."""
    return self.train_flops(1, (seq_len + 1) / 2)


PRESETS: dict[str, ModelConfig] = {
    # ~0.8M parameters: CPU tests and the default run. Vocabulary fits the
    # byte-level tokenizer (256 bytes, 100 digit pairs, special tokens).
    "tiny": ModelConfig(
        vocab_size=384, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
        d_ff=384, rope_theta=10_000.0, tie_embeddings=True, max_seq_len=1024, scan_unroll=4),
    # ~0.15M parameters: the default RL run, where steps per second matter most on a CPU.
    "nano": ModelConfig(
        vocab_size=384, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
        d_ff=256, rope_theta=10_000.0, tie_embeddings=True, max_seq_len=1024, scan_unroll=2),
    "smollm2-135m": ModelConfig(
        vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
        d_ff=1536, rope_theta=100_000.0, norm_eps=1e-5, tie_embeddings=True, max_seq_len=8192),
    "qwen2.5-0.5b": ModelConfig(
        vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64,
        d_ff=4864, rope_theta=1_000_000.0, norm_eps=1e-6, qkv_bias=True, tie_embeddings=True,
        max_seq_len=32768),
    # Shapes for capacity planning (tools/scaling.py, docs/scaling.md).
    "qwen2.5-7b": ModelConfig(
        vocab_size=152064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4, head_dim=128,
        d_ff=18944, rope_theta=1_000_000.0, norm_eps=1e-6, qkv_bias=True,
        tie_embeddings=False, max_seq_len=32768),
    "llama-3.1-70b": ModelConfig(
        vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
        d_ff=28672, rope_theta=500_000.0, norm_eps=1e-5, tie_embeddings=False,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position=8192),
        max_seq_len=131072),
    "llama-3.2-1b": ModelConfig(
        vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
        d_ff=8192, rope_theta=500_000.0, norm_eps=1e-5, tie_embeddings=True,
        rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position=8192),
        max_seq_len=131072),
}


def preset(name: str, **overrides) -> ModelConfig:
  """Returns a preset by name, with fields replaced by `overrides`."""
  if name not in PRESETS:
    raise KeyError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
  return dataclasses.replace(PRESETS[name], **overrides)

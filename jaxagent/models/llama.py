"""A Flax NNX decoder-only transformer of the Llama / Qwen2 family.

RMSNorm, rotary position embeddings (optionally Llama-3 scaled), grouped-query
attention, SwiGLU MLP, optional q/k/v bias (Qwen2), optional tied embeddings.
Layer weights are stacked on a leading `layers` axis and the forward pass is a
`lax.scan` over layers, so compile time does not grow with depth (as MaxText).

Two attention modes share one code path:
- training / teacher forcing: `segment_ids` pack several sequences in a row;
  a token attends to earlier tokens of its own segment, and `positions`
  restart at 0 for each segment;
- decoding with a KV cache: each row is one sequence whose keys live in cache
  slots indexed by absolute position; new keys are written at `positions` and
  a query at position p sees slots 0..p.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxagent.models.config import ModelConfig, RopeScaling
from jaxagent.models.sharding import ActivationSharding


class KVCache(NamedTuple):
  """Keys and values for every layer: `[layers, batch, max_len, kv_heads, head_dim]`."""

  k: jax.Array
  v: jax.Array

  @property
  def max_len(self) -> int:
    return self.k.shape[2]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
  shape = (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.head_dim)
  dtype = jnp.dtype(dtype or cfg.dtype)
  return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[RopeScaling]) -> jax.Array:
  """Inverse frequencies of rotary embeddings, with Llama-3 frequency scaling."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  if scaling is None:
    return inv_freq
  # Llama 3: long wavelengths are slowed by `factor`, short ones kept, and the
  # band in between interpolated smoothly.
  low_wavelen = scaling.original_max_position / scaling.low_freq_factor
  high_wavelen = scaling.original_max_position / scaling.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
  smooth = ((scaling.original_max_position / wavelen - scaling.low_freq_factor)
            / (scaling.high_freq_factor - scaling.low_freq_factor))
  smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return jnp.where(medium, smoothed, scaled)


def apply_rope(x_BxTxHxD: jax.Array, positions_BxT: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotates query/key vectors by position (the "rotate half" layout of HF Llama)."""
  angles = positions_BxT.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, D]
  x = x_BxTxHxD.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return (x * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x_BxTxHxD.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  # Normalise in float32 whatever the compute dtype (as HF Llama does).
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  w = weight.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + weight.shape)
  return (x32 * w).astype(x.dtype)


def attention_mask(positions_BxT: jax.Array, segment_ids_BxT: Optional[jax.Array],
                   cache_len: Optional[int]) -> jax.Array:
  """Boolean `[B, T, S]` mask: which keys each query may attend to."""
  if cache_len is not None:
    slots = jnp.arange(cache_len)[None, None, :]
    return slots <= positions_BxT[:, :, None]
  t = positions_BxT.shape[1]
  idx = jnp.arange(t)
  mask = (idx[:, None] >= idx[None, :])[None, :, :]
  if segment_ids_BxT is not None:
    mask = mask & (segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :])
  return mask


class Decoder(nnx.Module):
  """Llama / Qwen2 decoder. Call with token ids; returns float32 logits and the cache."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs,
               act_sharding: Optional[ActivationSharding] = None):
    self.cfg = cfg
    self.act_sharding = act_sharding
    pdt = jnp.dtype(cfg.param_dtype)
    init = nnx.initializers.normal(stddev=0.02)
    L, D, H, K, Dh, F = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads,
                         cfg.head_dim, cfg.d_ff)

    def param(shape, axes, initializer=init):
      return nnx.Param(initializer(rngs.params(), shape, pdt), logical_axes=axes)

    ones = nnx.initializers.ones
    zeros = nnx.initializers.zeros
    self.embed = param((cfg.vocab_size, D), ("vocab", "embed"))
    self.attn_norm = param((L, D), ("layers", "norm"), ones)
    self.wq = param((L, D, H, Dh), ("layers", "embed", "q_heads", "head_dim"))
    self.wk = param((L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim"))
    self.wv = param((L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim"))
    if cfg.qkv_bias:
      self.bq = param((L, H, Dh), ("layers", "q_heads", "head_dim"), zeros)
      self.bk = param((L, K, Dh), ("layers", "kv_heads", "head_dim"), zeros)
      self.bv = param((L, K, Dh), ("layers", "kv_heads", "head_dim"), zeros)
    self.wo = param((L, H, Dh, D), ("layers", "q_heads", "head_dim", "embed"))
    self.mlp_norm = param((L, D), ("layers", "norm"), ones)
    self.w_gate = param((L, D, F), ("layers", "embed", "mlp"))
    self.w_up = param((L, D, F), ("layers", "embed", "mlp"))
    self.w_down = param((L, F, D), ("layers", "mlp", "embed"))
    self.final_norm = param((D,), ("norm",), ones)
    if not cfg.tie_embeddings:
      self.lm_head = param((D, cfg.vocab_size), ("embed", "vocab"))

  # -- helpers ---------------------------------------------------------------

  def _constrain(self, x, axes):
    if self.act_sharding is None:
      return x
    return self.act_sharding.constrain(x, axes)

  def _layer_params(self) -> dict[str, jax.Array]:
    names = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
    if self.cfg.qkv_bias:
      names += ["bq", "bk", "bv"]
    return {n: getattr(self, n).get_value() for n in names}

  # -- forward ---------------------------------------------------------------

  def hidden_states(self, tokens_BxT: jax.Array, positions_BxT: Optional[jax.Array] = None,
                    segment_ids_BxT: Optional[jax.Array] = None,
                    cache: Optional[KVCache] = None) -> tuple[jax.Array, Optional[KVCache]]:
    """Final-norm hidden states `[B, T, D]` and the updated cache."""
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    B, T = tokens_BxT.shape
    if positions_BxT is None:
      positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], (B, T))
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    mask = attention_mask(positions_BxT, None if cache is not None else segment_ids_BxT,
                          cache.max_len if cache is not None else None)[:, None, None, :, :]
    G = cfg.n_heads // cfg.n_kv_heads
    scale = 1.0 / math.sqrt(cfg.head_dim)
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))

    # Gather the FSDP-sharded embedding dimension first: a lookup into a table
    # split on `embed` would yield activations split on `embed`, which cannot be
    # resharded to batch-split activations cheaply.
    table = self._constrain(self.embed.get_value(), ("vocab", None))
    x = jnp.take(table, tokens_BxT, axis=0).astype(dt)
    x = self._constrain(x, ("batch", "length", "act_embed"))

    def layer(x, xs):
      p, k_cache, v_cache = xs
      h = rms_norm(x, p["attn_norm"], cfg.norm_eps)
      q = jnp.einsum("btd,dhk->bthk", h, p["wq"].astype(dt))
      k = jnp.einsum("btd,dhk->bthk", h, p["wk"].astype(dt))
      v = jnp.einsum("btd,dhk->bthk", h, p["wv"].astype(dt))
      if cfg.qkv_bias:
        q = q + p["bq"].astype(dt)[None, None]
        k = k + p["bk"].astype(dt)[None, None]
        v = v + p["bv"].astype(dt)[None, None]
      q = apply_rope(q, positions_BxT, inv_freq)
      k = apply_rope(k, positions_BxT, inv_freq)
      if k_cache is not None:
        # Write this step's keys at their absolute positions; out-of-range
        # positions (bucket padding past the cache end) are dropped.
        k_cache = k_cache.at[rows, positions_BxT].set(k.astype(k_cache.dtype), mode="drop")
        v_cache = v_cache.at[rows, positions_BxT].set(v.astype(v_cache.dtype), mode="drop")
        k_all, v_all = k_cache.astype(dt), v_cache.astype(dt)
      else:
        k_all, v_all = k, v
      q = q.reshape(B, T, cfg.n_kv_heads, G, cfg.head_dim)
      scores = jnp.einsum("btkgd,bskd->bkgts", q, k_all,
                          preferred_element_type=jnp.float32) * scale
      # Masked scores get the most negative float, so exp() gives exactly 0.
      scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
      probs = jax.nn.softmax(scores, axis=-1).astype(dt)
      attn = jnp.einsum("bkgts,bskd->btkgd", probs, v_all).reshape(B, T, cfg.n_heads,
                                                                     cfg.head_dim)
      attn = self._constrain(attn, ("batch", "length", "act_heads", None))
      x = x + jnp.einsum("bthk,hkd->btd", attn, p["wo"].astype(dt))
      x = self._constrain(x, ("batch", "length", "act_embed"))
      h = rms_norm(x, p["mlp_norm"], cfg.norm_eps)
      gate = jnp.einsum("btd,df->btf", h, p["w_gate"].astype(dt))
      up = jnp.einsum("btd,df->btf", h, p["w_up"].astype(dt))
      act = self._constrain(jax.nn.silu(gate) * up, ("batch", "length", "act_mlp"))
      x = x + jnp.einsum("btf,fd->btd", act, p["w_down"].astype(dt))
      x = self._constrain(x, ("batch", "length", "act_embed"))
      return x, (k_cache, v_cache)

    if cfg.remat:
      layer = jax.checkpoint(layer)
    xs = (self._layer_params(),
          None if cache is None else cache.k,
          None if cache is None else cache.v)
    x, (k_new, v_new) = jax.lax.scan(layer, x, xs)
    new_cache = None if cache is None else KVCache(k_new, v_new)
    return rms_norm(x, self.final_norm.get_value(), cfg.norm_eps), new_cache

  def logits(self, hidden_BxTxD: jax.Array) -> jax.Array:
    """Float32 logits `[B, T, V]` from final hidden states."""
    h = hidden_BxTxD.astype(jnp.float32)
    if self.cfg.tie_embeddings:
      out = jnp.einsum("btd,vd->btv", h, self.embed.get_value().astype(jnp.float32))
    else:
      out = jnp.einsum("btd,dv->btv", h, self.lm_head.get_value().astype(jnp.float32))
    return self._constrain(out, ("batch", "length", "act_vocab"))

  def __call__(self, tokens_BxT: jax.Array, positions_BxT: Optional[jax.Array] = None,
               segment_ids_BxT: Optional[jax.Array] = None,
               cache: Optional[KVCache] = None) -> tuple[jax.Array, Optional[KVCache]]:
    h, cache = self.hidden_states(tokens_BxT, positions_BxT, segment_ids_BxT, cache)
    return self.logits(h), cache

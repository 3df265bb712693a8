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
  a query at position p sees slots 0..p;
- decoding from a paged KV pool (`forward_paged`): each row's past lives in
  fixed-size pages of a shared pool named by a page table, read block by block
  with an online softmax (flash-decoding), so the work follows the tokens in
  use rather than the pool's capacity (`paged_attention`: a plain-JAX loop, or a
  Pallas kernel on GPUs); the pool is only read, and the new keys and values are
  returned for `write_pages` to scatter in once per step.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from jaxagent.models import attention as attn_lib
from jaxagent.models.attention import attend_block
from jaxagent.models.config import ModelConfig, RopeScaling
from jaxagent.models.paged_attention import (PAGED_KERNELS, past_attention_gather,
                                             past_attention_triton)
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


class PagedKV(NamedTuple):
  """A paged KV pool for every layer: `k`, `v` each `[layers, num_pages, page_size,
  kv_heads, head_dim]`.

  A sequence owns a list of page ids (its row of a page table); its token at
  position p lives in page `table[p // page_size]` at offset `p % page_size`
  (vLLM's PagedAttention layout).
  """

  k: jax.Array
  v: jax.Array

  @property
  def num_pages(self) -> int:
    return self.k.shape[1]

  @property
  def page_size(self) -> int:
    return self.k.shape[2]


def init_pages(cfg: ModelConfig, num_pages: int, page_size: int, dtype=None) -> PagedKV:
  """An all-zero paged pool of `num_pages` pages of `page_size` tokens."""
  shape = (cfg.n_layers, num_pages, page_size, cfg.n_kv_heads, cfg.head_dim)
  dtype = jnp.dtype(dtype or cfg.dtype)
  return PagedKV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def page_slots(page_table_BxN: jax.Array, positions_BxT: jax.Array, valid_BxT: jax.Array,
               page_size: int, num_pages: int) -> tuple[jax.Array, jax.Array]:
  """The (page, offset) of each token, `[B, T]` each; invalid tokens get page
  `num_pages` (out of range, so a scatter with mode="drop" skips them).

  A token is invalid when `valid_BxT` is False, its position is negative, its page
  column lies past the table's width, or its page id is out of `[0, num_pages)`.
  """
  n_cols = page_table_BxN.shape[1]
  col_BxT = positions_BxT // page_size
  page_BxT = jnp.take_along_axis(page_table_BxN, jnp.clip(col_BxT, 0, n_cols - 1), axis=1)
  ok = (valid_BxT & (positions_BxT >= 0) & (col_BxT < n_cols)
        & (page_BxT >= 0) & (page_BxT < num_pages))
  return jnp.where(ok, page_BxT, num_pages), positions_BxT % page_size


def write_pages(pages: PagedKV, new_k_LxBxTxKxD: jax.Array, new_v_LxBxTxKxD: jax.Array,
                page_table_BxN: jax.Array, positions_BxT: jax.Array,
                valid_BxT: jax.Array) -> PagedKV:
  """Scatters every layer's new keys and values into the pool at their (page, offset).

  `new_k/new_v` `[layers, B, T, kv_heads, head_dim]` are what `forward_paged`
  returns; token (b, t) goes to page `page_table_BxN[b, positions_BxT[b, t] //
  page_size]`. Tokens with `valid_BxT` False (padding, padding rows) or outside the
  table are dropped. Pure: jit it with the pool donated to update it in place.
  Two valid tokens must not share a (page, offset) (the last write would be
  unspecified).
  """
  chex.assert_rank([new_k_LxBxTxKxD, new_v_LxBxTxKxD], 5)
  chex.assert_equal_shape([new_k_LxBxTxKxD, new_v_LxBxTxKxD])
  chex.assert_rank([page_table_BxN, positions_BxT, valid_BxT], 2)
  chex.assert_equal_shape([positions_BxT, valid_BxT])
  page_BxT, offset_BxT = page_slots(page_table_BxN, positions_BxT, valid_BxT,
                                    pages.page_size, pages.num_pages)
  # Advanced indices on the adjacent axes 1 and 2 index `[L, B, T, K, D]` in place.
  k = pages.k.at[:, page_BxT, offset_BxT].set(new_k_LxBxTxKxD.astype(pages.k.dtype),
                                              mode="drop")
  v = pages.v.at[:, page_BxT, offset_BxT].set(new_v_LxBxTxKxD.astype(pages.v.dtype),
                                              mode="drop")
  return PagedKV(k, v)


def remat(fn, policy: str):
  """`fn` under `jax.checkpoint` with the named policy (`ModelConfig.remat`)."""
  policies = {"full": None, "dots": jax.checkpoint_policies.checkpoint_dots,
              "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
  if policy == "none":
    return fn
  return jax.checkpoint(fn, policy=policies[policy])


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

  def _embed(self, tokens_BxT: jax.Array) -> jax.Array:
    """Token embeddings `[B, T, D]` in the compute dtype."""
    # Gather the FSDP-sharded embedding dimension first: a lookup into a table
    # split on `embed` would yield activations split on `embed`, which cannot be
    # resharded to batch-split activations cheaply.
    table = self._constrain(self.embed.get_value(), ("vocab", None))
    x = jnp.take(table, tokens_BxT, axis=0).astype(jnp.dtype(self.cfg.dtype))
    return self._constrain(x, ("batch", "length", "act_embed"))

  def _qkv(self, p: dict[str, jax.Array], x_BxTxD: jax.Array, positions_BxT: jax.Array,
           inv_freq: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's pre-norm projections, with bias and RoPE on q and k.

    Returns q `[B, T, H, Dh]`, k and v `[B, T, K, Dh]`, in the compute dtype.
    """
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    B, T, D = x_BxTxD.shape
    H, K, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    h = rms_norm(x_BxTxD, p["attn_norm"], cfg.norm_eps).reshape(B * T, D)
    # One [B*T, D] x [D, (H + 2K) Dh] matmul: plain 2-D products are XLA's fastest,
    # forward and backward (weight gradients contract over one flat axis).
    w = jnp.concatenate([p[n].astype(dt).reshape(D, -1) for n in ("wq", "wk", "wv")], axis=1)
    qkv = h @ w
    q = qkv[:, :H * Dh].reshape(B, T, H, Dh)
    k = qkv[:, H * Dh:(H + K) * Dh].reshape(B, T, K, Dh)
    v = qkv[:, (H + K) * Dh:].reshape(B, T, K, Dh)
    if cfg.qkv_bias:
      q = q + p["bq"].astype(dt)[None, None]
      k = k + p["bk"].astype(dt)[None, None]
      v = v + p["bv"].astype(dt)[None, None]
    return apply_rope(q, positions_BxT, inv_freq), apply_rope(k, positions_BxT, inv_freq), v

  def _attn_out_and_mlp(self, p: dict[str, jax.Array], x_BxTxD: jax.Array,
                        attn_BxTxHxDh: jax.Array) -> jax.Array:
    """The rest of a layer after attention: output projection and residual, then the
    pre-norm SwiGLU MLP and its residual. Returns the layer's output `[B, T, D]`."""
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    B, T, D = x_BxTxD.shape
    F = cfg.d_ff
    attn = self._constrain(attn_BxTxHxDh, ("batch", "length", "act_heads", None))
    x = x_BxTxD + (attn.reshape(B * T, -1) @ p["wo"].astype(dt).reshape(-1, D)).reshape(B, T, D)
    x = self._constrain(x, ("batch", "length", "act_embed"))
    h = rms_norm(x, p["mlp_norm"], cfg.norm_eps).reshape(B * T, D)
    gate_up = h @ jnp.concatenate([p["w_gate"].astype(dt), p["w_up"].astype(dt)], axis=1)
    act = (jax.nn.silu(gate_up[:, :F]) * gate_up[:, F:]).reshape(B, T, F)
    act = self._constrain(act, ("batch", "length", "act_mlp"))
    x = x + (act.reshape(B * T, F) @ p["w_down"].astype(dt)).reshape(B, T, D)
    return self._constrain(x, ("batch", "length", "act_embed"))

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
    G = cfg.n_heads // cfg.n_kv_heads
    scale = 1.0 / math.sqrt(cfg.head_dim)
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    cache_mask = None if cache is None else attention_mask(positions_BxT, None, cache.max_len)

    x = self._embed(tokens_BxT)

    def layer(x, xs):
      p, k_cache, v_cache = xs
      q, k, v = self._qkv(p, x, positions_BxT, inv_freq)
      q = q.reshape(B, T, cfg.n_kv_heads, G, cfg.head_dim)
      if k_cache is not None:
        # Write this step's keys at their absolute positions; out-of-range
        # positions (bucket padding past the cache end) are dropped.
        k_cache = k_cache.at[rows, positions_BxT].set(k.astype(k_cache.dtype), mode="drop")
        v_cache = v_cache.at[rows, positions_BxT].set(v.astype(v_cache.dtype), mode="drop")
        attn = attn_lib.dense_attention(q, k_cache.astype(dt), v_cache.astype(dt),
                                        cache_mask, scale)
      else:
        attn = attn_lib.causal_attention(q, k, v, segment_ids_BxT, scale,
                                         implementation=cfg.attention,
                                         block=cfg.attention_block)
      attn = attn.reshape(B, T, cfg.n_heads, cfg.head_dim)
      return self._attn_out_and_mlp(p, x, attn), (k_cache, v_cache)

    layer = remat(layer, cfg.remat)
    xs = (self._layer_params(),
          None if cache is None else cache.k,
          None if cache is None else cache.v)
    x, (k_new, v_new) = jax.lax.scan(layer, x, xs, unroll=min(cfg.scan_unroll, cfg.n_layers))
    new_cache = None if cache is None else KVCache(k_new, v_new)
    return rms_norm(x, self.final_norm.get_value(), cfg.norm_eps), new_cache

  def head_matrix(self) -> jax.Array:
    """The output head as `[D, V]` float32 (the embedding's transpose when tied)."""
    if self.cfg.tie_embeddings:
      return self.embed.get_value().astype(jnp.float32).T
    return self.lm_head.get_value().astype(jnp.float32)

  def logits(self, hidden_BxTxD: jax.Array) -> jax.Array:
    """Float32 logits `[B, T, V]` from final hidden states."""
    out = jnp.einsum("btd,dv->btv", hidden_BxTxD.astype(jnp.float32), self.head_matrix())
    return self._constrain(out, ("batch", "length", "act_vocab"))

  def __call__(self, tokens_BxT: jax.Array, positions_BxT: Optional[jax.Array] = None,
               segment_ids_BxT: Optional[jax.Array] = None,
               cache: Optional[KVCache] = None) -> tuple[jax.Array, Optional[KVCache]]:
    h, cache = self.hidden_states(tokens_BxT, positions_BxT, segment_ids_BxT, cache)
    return self.logits(h), cache

  # -- paged decoding -------------------------------------------------------------

  def hidden_states_paged(self, tokens_BxT: jax.Array, positions_BxT: jax.Array,
                          past_len_B: jax.Array, pages: PagedKV, page_table_BxN: jax.Array,
                          num_blocks: Optional[jax.Array] = None, *, pages_per_block: int,
                          paged_kernel: str = "gather", interpret: bool = False
                          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`forward_paged` without the output head: final-norm hidden states `[B, T, D]`
    (compute dtype) and the new keys and values (see `forward_paged`).

    Use it to take the logits of a few tokens only (a prefill's last token)."""
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    chex.assert_rank([tokens_BxT, positions_BxT, page_table_BxN], 2)
    chex.assert_equal_shape([tokens_BxT, positions_BxT])
    chex.assert_rank(past_len_B, 1)
    chex.assert_rank([pages.k, pages.v], 5)
    chex.assert_equal_shape([pages.k, pages.v])
    B, T = tokens_BxT.shape
    n_cols = page_table_BxN.shape[1]
    P, ppb = pages.page_size, pages_per_block
    K, G, Dh = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    S = ppb * P  # keys per past block
    scale = 1.0 / math.sqrt(Dh)
    inv_freq = rope_inv_freq(Dh, cfg.rope_theta, cfg.rope_scaling)
    pool_dt = pages.k.dtype
    max_blocks = -(-n_cols // ppb)  # blocks past the table's width read nothing new
    if num_blocks is None:
      num_blocks = (jnp.max(past_len_B) + S - 1) // S
    num_blocks = jnp.minimum(jnp.asarray(num_blocks, jnp.int32), max_blocks)
    # A query sees the new tokens of its own row at positions up to its own.
    self_mask_BxTxT = positions_BxT[:, None, :] <= positions_BxT[:, :, None]

    def layer(x, xs):
      p, layer_idx = xs
      q, k, v = self._qkv(p, x, positions_BxT, inv_freq)
      # New keys go through the pool's dtype before use, so attending to them
      # now equals attending to them later from the pool (chunked prefill
      # equals one chunk; as the dense cache path, which reads back its cache).
      k, v = k.astype(pool_dt), v.astype(pool_dt)
      q = q.reshape(B, T, K, G, Dh)

      if paged_kernel == "gather":
        state = past_attention_gather(q, pages.k, pages.v, layer_idx, page_table_BxN,
                                      past_len_B, num_blocks, pages_per_block=ppb,
                                      scale=scale, compute_dtype=dt)
      elif paged_kernel == "triton":
        state = past_attention_triton(q, pages.k, pages.v, layer_idx, page_table_BxN,
                                      past_len_B, scale=scale, interpret=interpret)
      else:
        raise ValueError(f"unknown paged attention kernel {paged_kernel!r}; "
                         f"one of {PAGED_KERNELS}")
      # The new tokens last, so blocks a row skips cannot reorder its sums.
      state = attend_block(state, q, k.astype(dt), v.astype(dt), self_mask_BxTxT, scale)
      # Every query sees at least itself, so l >= 1.
      attn = (state.acc / state.l[..., None]).astype(dt)  # [B, K, G, T, Dh]
      attn = attn.transpose(0, 3, 1, 2, 4).reshape(B, T, cfg.n_heads, Dh)
      return self._attn_out_and_mlp(p, x, attn), (k, v)

    xs = (self._layer_params(), jnp.arange(cfg.n_layers, dtype=jnp.int32))
    x, (new_k, new_v) = jax.lax.scan(layer, self._embed(tokens_BxT), xs)
    return rms_norm(x, self.final_norm.get_value(), cfg.norm_eps), new_k, new_v

  def forward_paged(self, tokens_BxT: jax.Array, positions_BxT: jax.Array,
                    past_len_B: jax.Array, pages: PagedKV, page_table_BxN: jax.Array,
                    num_blocks: Optional[jax.Array] = None, *, pages_per_block: int,
                    paged_kernel: str = "gather", interpret: bool = False
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Forward pass of T new tokens per row over a paged KV pool (inference only).

    Row b has `past_len_B[b]` tokens in the pool, in pages `page_table_BxN[b, :]`
    (`[B, N]` int32 page ids; entries past a row's pages may hold any integer,
    they are masked by position). Its new tokens `tokens_BxT` sit at `positions_BxT`
    (normally past_len + arange(T); padding may lie beyond and its outputs are
    meaningless). Each new token attends to the row's past (positions <
    past_len, read from the pool) and to the row's new tokens at positions <=
    its own; nothing else.

    The past is read in blocks of `pages_per_block` pages with an online softmax
    in float32 (flash-decoding), in a loop of `num_blocks` iterations: a traced
    int32 scalar, at least ceil(max past_len / (page_size * pages_per_block)),
    so one compiled function serves every length (None: computed here from
    `past_len_B`). A row's result does not depend on the other rows, bit for
    bit: blocks past its own past leave its state unchanged. `paged_kernel`
    picks how the past is read (`paged_attention.PAGED_KERNELS`): `gather`, the
    loop above in plain JAX; `triton`, a Pallas kernel for GPUs whose programs walk
    only their own row's pages (`num_blocks` and `pages_per_block` unused;
    `interpret` runs it in Pallas' interpreter, for tests).

    The pool is only read (gathered per block and layer, never carried through
    the layer scan). Returns float32 logits `[B, T, V]` and the new keys and
    values of every layer `[layers, B, T, kv_heads, head_dim]` in the pool's
    dtype, for `write_pages`.
    """
    h, new_k, new_v = self.hidden_states_paged(
        tokens_BxT, positions_BxT, past_len_B, pages, page_table_BxN, num_blocks,
        pages_per_block=pages_per_block, paged_kernel=paged_kernel, interpret=interpret)
    return self.logits(h), new_k, new_v

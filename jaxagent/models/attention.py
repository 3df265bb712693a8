"""Attention kernels: causal attention over packed rows (training) and the online-softmax
block step shared with paged decoding.

Layouts: queries `[B, T, K, G, Dh]` (K key/value heads, G query heads per KV head),
keys and values `[B, S, K, Dh]`; outputs `[B, T, K, G, Dh]`. Packed rows hold several
segments: a token attends to the tokens at or before it (by index in the row) that
carry the same segment id.

Implementations of `causal_attention` (`ModelConfig.attention`):
- `dense`: the whole `[B, K, G, T, T]` float32 score matrix; memory quadratic in T.
- `flash`: blockwise with an online softmax and a custom VJP that keeps only the
  output and the log-sum-exp (FlashAttention-2's backward): memory linear in T, and
  key blocks wholly after a query block are skipped (about half the work of dense
  for long rows). Plain JAX, so it runs on every backend.
- `dot_product`: `jax.nn.dot_product_attention` (cuDNN's fused kernel where JAX can
  use it on a GPU, XLA's otherwise; the XLA path is quadratic in memory).
- `auto`: `dot_product` on GPUs, `flash` elsewhere.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("auto", "dense", "flash", "dot_product")


class OnlineSoftmax(NamedTuple):
  """Running state of a softmax-weighted sum over key blocks (flash attention), float32.

  `m` `[B, K, G, T]` is the running max of the scores seen (-inf before any key),
  `l` the running sum of exp(score - m), `acc` `[B, K, G, T, Dh]` the running sum of
  exp(score - m) * value. The attention output is `acc / l`.
  """

  m: jax.Array
  l: jax.Array
  acc: jax.Array

  @classmethod
  def empty(cls, B: int, K: int, G: int, T: int, Dh: int) -> "OnlineSoftmax":
    return cls(m=jnp.full((B, K, G, T), -jnp.inf, jnp.float32),
               l=jnp.zeros((B, K, G, T), jnp.float32),
               acc=jnp.zeros((B, K, G, T, Dh), jnp.float32))


def attend_block(state: OnlineSoftmax, q_BxTxKxGxD: jax.Array, k_BxSxKxD: jax.Array,
                 v_BxSxKxD: jax.Array, mask_BxTxS: jax.Array, scale: float) -> OnlineSoftmax:
  """Folds one block of S keys into the online-softmax state (Milakov & Gimelshein 2018;
  FlashAttention; flash-decoding).

  `mask_BxTxS` may have T = 1 (one mask for all queries of a row). A query whose
  keys in this block are all masked keeps its state bit-for-bit: its max does
  not move (alpha is exactly 1) and it adds exact zeros.
  """
  s = jnp.einsum("btkgd,bskd->bkgts", q_BxTxKxGxD, k_BxSxKxD,
                 preferred_element_type=jnp.float32) * scale
  mask = mask_BxTxS[:, None, None, :, :]  # [B, 1, 1, T, S]
  m_new = jnp.maximum(state.m, jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1))
  # Rescale the old sums by exp(m_old - m_new). Where the max did not move the
  # factor is exactly 1 (not exp(0) from a polynomial), so fully masked blocks
  # change nothing; where m_old is -inf (no keys yet) exp(-inf) = 0. The inner
  # where keeps -inf - -inf (NaN) out of exp.
  grew = m_new > state.m
  alpha = jnp.where(grew, jnp.exp(jnp.where(grew, state.m - m_new, 0.0)), 1.0)
  # Subtract a finite max (0 while no key has been seen) so exp never sees
  # -inf - -inf; masked keys then contribute exact zeros.
  m_safe = jnp.where(m_new > -jnp.inf, m_new, 0.0)
  p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
  pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v_BxSxKxD.dtype), v_BxSxKxD,
                  preferred_element_type=jnp.float32)
  return OnlineSoftmax(m=m_new, l=state.l * alpha + jnp.sum(p, axis=-1),
                       acc=state.acc * alpha[..., None] + pv)


def packed_causal_mask(segment_ids_BxT: Optional[jax.Array], T: int) -> jax.Array:
  """Boolean `[B or 1, T, T]`: query t sees key s when s <= t and their segments match."""
  idx = jnp.arange(T)
  mask = (idx[:, None] >= idx[None, :])[None, :, :]
  if segment_ids_BxT is not None:
    mask = mask & (segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :])
  return mask


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask_BxTxS: jax.Array,
                    scale: float) -> jax.Array:
  """Attention through the whole score matrix; any boolean mask (also for a KV cache)."""
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * scale
  # Masked scores get the most negative float, so exp() gives exactly 0.
  scores = jnp.where(mask_BxTxS[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum("bkgts,bskd->btkgd", probs, v)


# -- blockwise attention with a FlashAttention-2 backward ------------------------------
#
# Inside, heads lead and each KV head's G query heads are folded into the rows:
# q `[B, K, T*G, Dh]` (row t*G + g), k and v `[B, K, T, Dh]`, so every block product is
# one batched matmul over (B, K) with no transposes in the loops.


def _rows(x: jax.Array, i, n: int) -> jax.Array:
  """Rows i*n .. i*n + n-1 (i traced) along axis 2."""
  return jax.lax.dynamic_slice_in_dim(x, i * n, n, axis=2)


def _block_mask(seg_BxT, i, j, block: int, G: int) -> jax.Array:
  """`[B, 1, block*G, block]`: same segment, and key index <= query index (blocks i, j)."""
  seg_q = jax.lax.dynamic_slice_in_dim(seg_BxT, i * block, block, axis=1)
  seg_k = jax.lax.dynamic_slice_in_dim(seg_BxT, j * block, block, axis=1)
  idx = jnp.arange(block)
  causal = (j < i) | (idx[:, None] >= idx[None, :])
  mask = (seg_q[:, :, None] == seg_k[:, None, :]) & causal[None]  # [B, bq, bk]
  return jnp.repeat(mask, G, axis=1)[:, None]


def _block_ranges(seg_BxT: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
  """For each block of positions, the first key block its queries can see and the last
  query block that can see its keys (segments are contiguous runs of one id), over
  every row: `[nb]` each. Blocks outside these ranges are skipped, so packed short
  segments cost their own causal square, not the row's."""
  B, T = seg_BxT.shape
  idx = jnp.arange(T)
  starts = jnp.concatenate([jnp.ones((B, 1), bool), seg_BxT[:, 1:] != seg_BxT[:, :-1]], 1)
  ends = jnp.concatenate([seg_BxT[:, 1:] != seg_BxT[:, :-1], jnp.ones((B, 1), bool)], 1)
  first = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)  # start of each token's run
  last = jax.lax.cummin(jnp.where(ends, idx, T - 1), axis=1, reverse=True)
  nb = T // block
  first_key_block = jnp.min(first.reshape(B, nb, block), axis=(0, 2)) // block
  last_query_block = jnp.max(last.reshape(B, nb, block), axis=(0, 2)) // block
  return first_key_block, last_query_block


def _flash_forward(q, k, v, seg, scale: float, block: int, G: int):
  """q `[B, K, T*G, Dh]`, k/v `[B, K, T, Dh]` -> out like q, log-sum-exp `[B, K, T*G]`."""
  B, K, R, Dh = q.shape
  nb, rb = R // (block * G), block * G
  first_key_block, _ = _block_ranges(seg, block)

  def q_block(i):
    qi = _rows(q, i, rb)

    def kv_block(j, carry):
      m, l, acc = carry
      s = jnp.einsum("bkrd,bksd->bkrs", qi, _rows(k, j, block),
                     preferred_element_type=jnp.float32) * scale
      s = jnp.where(_block_mask(seg, i, j, block, G), s, -jnp.inf)
      # Every row sees itself in block i (j <= i), so after block i m is finite;
      # earlier blocks may be all masked for a row: keep -inf out of exp's argument.
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      m_safe = jnp.where(m_new > -jnp.inf, m_new, 0.0)
      p = jnp.exp(s - m_safe[..., None])
      alpha = jnp.exp(jnp.where(m > -jnp.inf, m - m_safe, -jnp.inf))
      pv = jnp.einsum("bkrs,bksd->bkrd", p.astype(v.dtype), _rows(v, j, block),
                      preferred_element_type=jnp.float32)
      return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv

    init = (jnp.full((B, K, rb), -jnp.inf, jnp.float32), jnp.zeros((B, K, rb), jnp.float32),
            jnp.zeros((B, K, rb, Dh), jnp.float32))
    # Only key blocks from the start of this block's first segment to the block
    # itself hold keys its queries see.
    m, l, acc = jax.lax.fori_loop(first_key_block[i], i + 1, kv_block, init)
    return (acc / l[..., None]).astype(q.dtype), m + jnp.log(l)

  outs, lses = jax.lax.map(q_block, jnp.arange(nb))  # [nb, B, K, rb, Dh], [nb, B, K, rb]
  out = outs.transpose(1, 2, 0, 3, 4).reshape(B, K, R, Dh)
  return out, lses.transpose(1, 2, 0, 3).reshape(B, K, R)


def _flash_backward(q, k, v, seg, out, lse, dout, scale: float, block: int, G: int):
  B, K, R, Dh = q.shape
  nb, rb = R // (block * G), block * G
  f32 = jnp.float32
  # D_r = sum_d dO * O (FlashAttention-2): the softmax Jacobian's row term.
  delta = jnp.sum(dout.astype(f32) * out.astype(f32), axis=-1)
  _, last_query_block = _block_ranges(seg, block)

  def kv_block(j, grads):
    dq, dk, dv = grads
    kj, vj = _rows(k, j, block), _rows(v, j, block)

    def q_block(i, acc):
      dq, dk_j, dv_j = acc
      qi, doi = _rows(q, i, rb), _rows(dout, i, rb)
      s = jnp.einsum("bkrd,bksd->bkrs", qi, kj, preferred_element_type=f32) * scale
      p = jnp.where(_block_mask(seg, i, j, block, G),
                    jnp.exp(s - _rows(lse[..., None], i, rb)), 0.0)
      dv_j = dv_j + jnp.einsum("bkrs,bkrd->bksd", p.astype(doi.dtype), doi,
                               preferred_element_type=f32)
      dp = jnp.einsum("bkrd,bksd->bkrs", doi, vj, preferred_element_type=f32)
      ds = (p * (dp - _rows(delta[..., None], i, rb)) * scale).astype(q.dtype)
      dk_j = dk_j + jnp.einsum("bkrs,bkrd->bksd", ds, qi, preferred_element_type=f32)
      dq_i = _rows(dq, i, rb) + jnp.einsum("bkrs,bksd->bkrd", ds, kj,
                                           preferred_element_type=f32)
      return jax.lax.dynamic_update_slice_in_dim(dq, dq_i, i * rb, axis=2), dk_j, dv_j

    zeros = jnp.zeros((B, K, block, Dh), f32)
    # Only query blocks from this one to the end of its last segment see its keys.
    dq, dk_j, dv_j = jax.lax.fori_loop(j, last_query_block[j] + 1, q_block,
                                       (dq, zeros, zeros))
    dk = jax.lax.dynamic_update_slice_in_dim(dk, dk_j, j * block, axis=2)
    dv = jax.lax.dynamic_update_slice_in_dim(dv, dv_j, j * block, axis=2)
    return dq, dk, dv

  init = (jnp.zeros(q.shape, f32), jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32))
  dq, dk, dv = jax.lax.fori_loop(0, nb, kv_block, init)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash(q, k, v, seg, scale: float, block: int, G: int):
  return _flash_forward(q, k, v, seg, scale, block, G)[0]


def _flash_fwd(q, k, v, seg, scale, block, G):
  out, lse = _flash_forward(q, k, v, seg, scale, block, G)
  return out, (q, k, v, seg, out, lse)


def _flash_bwd(scale, block, G, res, dout):
  q, k, v, seg, out, lse = res
  dq, dk, dv = _flash_backward(q, k, v, seg, out, lse, dout, scale, block, G)
  return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q_BxTxKxGxD: jax.Array, k_BxTxKxD: jax.Array, v_BxTxKxD: jax.Array,
                    segment_ids_BxT: Optional[jax.Array], scale: float,
                    block: int = 512) -> jax.Array:
  """Causal attention over packed rows in blocks of `block` positions, memory linear in T.

  Rows are padded to a multiple of the block with segment id -1 (seen by nothing
  real). Differentiable (custom VJP: the backward recomputes each block's
  probabilities from the saved log-sum-exp).
  """
  B, T = q_BxTxKxGxD.shape[:2]
  seg = (jnp.zeros((B, T), jnp.int32) if segment_ids_BxT is None
         else segment_ids_BxT.astype(jnp.int32))
  block = min(block, T)
  pad = -T % block
  if pad:
    widths = lambda x: [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
    q_BxTxKxGxD, k_BxTxKxD, v_BxTxKxD = (jnp.pad(x, widths(x)) for x in
                                         (q_BxTxKxGxD, k_BxTxKxD, v_BxTxKxD))
    seg = jnp.pad(seg, [(0, 0), (0, pad)], constant_values=-1)
  B, Tp, K, G, Dh = q_BxTxKxGxD.shape
  q = q_BxTxKxGxD.transpose(0, 2, 1, 3, 4).reshape(B, K, Tp * G, Dh)
  k, v = k_BxTxKxD.transpose(0, 2, 1, 3), v_BxTxKxD.transpose(0, 2, 1, 3)
  out = _flash(q, k, v, seg, float(scale), int(block), G)
  return out.reshape(B, K, Tp, G, Dh).transpose(0, 2, 1, 3, 4)[:, :T]


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                          segment_ids_BxT: Optional[jax.Array], scale: float) -> jax.Array:
  """`jax.nn.dot_product_attention` with the packed causal mask (GQA handled by JAX)."""
  B, T, K, G, Dh = q.shape
  mask = packed_causal_mask(segment_ids_BxT, T)[:, None]  # [B, 1, T, T]
  out = jax.nn.dot_product_attention(q.reshape(B, T, K * G, Dh), k, v, mask=mask, scale=scale)
  return out.reshape(B, T, K, G, Dh)


def resolve(implementation: str) -> str:
  """The implementation `auto` stands for on this backend."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"model attention: unknown {implementation!r}; known: "
                     f"{', '.join(IMPLEMENTATIONS)}")
  if implementation != "auto":
    return implementation
  return "dot_product" if jax.default_backend() == "gpu" else "flash"


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     segment_ids_BxT: Optional[jax.Array], scale: float, *,
                     implementation: str = "auto", block: int = 512) -> jax.Array:
  """Causal self-attention over packed rows with the chosen implementation."""
  impl = resolve(implementation)
  if impl == "flash":
    return flash_attention(q, k, v, segment_ids_BxT, scale, block)
  if impl == "dot_product":
    return dot_product_attention(q, k, v, segment_ids_BxT, scale)
  return dense_attention(q, k, v, packed_causal_mask(segment_ids_BxT, q.shape[1]), scale)

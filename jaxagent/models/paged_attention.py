"""Attention of new tokens to their row's past in a paged KV pool (decoding, chunked
prefill, speculative verification).

Each row b has `past_len_B[b]` tokens in the pool, in the pages listed by its row of
the page table (vLLM's PagedAttention layout: position p lives in page
`table[b, p // page_size]` at offset `p % page_size`). Every new token of a row sees
all of its row's past, so the mask depends only on the key's position. The result is
an unnormalised online-softmax state (`attention.OnlineSoftmax`) which the caller folds
the new tokens into, then divides out.

Implementations (`PAGED_KERNELS`):
- `gather`: plain JAX, every backend. A loop over blocks of `pages_per_block` pages
  with a traced trip count (the longest row's); each iteration gathers the block's
  pages of one layer for every row. Rows shorter than the longest run masked blocks,
  which leave their state bit for bit unchanged.
- `triton`: a Pallas kernel lowered to Triton for GPUs. One program per (row, KV
  head, block of query rows) walks only that row's pages, so each row costs its own
  length. Tested on CPU in Pallas' interpreter and by lowering it for CUDA.

Both read the pool in place: it is passed whole with the layer's index, so no
layer-sized slice of it is ever copied.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxagent.models.attention import OnlineSoftmax, attend_block

PAGED_KERNELS = ("gather", "triton")


def past_attention_gather(q_BxTxKxGxD: jax.Array, pool_k: jax.Array, pool_v: jax.Array,
                          layer: jax.Array, page_table_BxN: jax.Array, past_len_B: jax.Array,
                          num_blocks: jax.Array, *, pages_per_block: int, scale: float,
                          compute_dtype) -> OnlineSoftmax:
  """The online-softmax state of each query over its row's past, in plain JAX.

  `pool_k/pool_v` `[layers, num_pages, page_size, K, Dh]`; `layer` an int32 scalar;
  `num_blocks` (traced int32) blocks of `pages_per_block` pages are read, at least
  enough for the longest row.
  """
  B, T, K, G, Dh = q_BxTxKxGxD.shape
  n_cols = page_table_BxN.shape[1]
  num_pages, P = pool_k.shape[1], pool_k.shape[2]
  ppb = pages_per_block
  S = ppb * P  # keys per block

  def block(j, state):
    # Block j covers table columns j*C .. j*C + C-1 (C = pages_per_block).
    cols_C = j * ppb + jnp.arange(ppb)
    # Columns past the table are clamped to a valid page and masked (a row's past
    # is read only as far as its table reaches, as the Triton kernel does). Page
    # ids are clipped too, so unused table entries may hold any sentinel.
    ids_BxC = jnp.clip(page_table_BxN[:, jnp.minimum(cols_C, n_cols - 1)], 0, num_pages - 1)
    # One gather of the block's pages of this layer (not a slice of the layer).
    k_blk = pool_k[layer, ids_BxC].reshape(B, S, K, Dh).astype(compute_dtype)
    v_blk = pool_v[layer, ids_BxC].reshape(B, S, K, Dh).astype(compute_dtype)
    key_pos_S = (cols_C[:, None] * P + jnp.arange(P)[None, :]).reshape(S)
    in_table_S = jnp.repeat(cols_C < n_cols, P)
    mask_Bx1xS = ((key_pos_S[None, :] < past_len_B[:, None]) & in_table_S[None, :])[:, None, :]
    # Values past a row's keys are zeroed: a page's stale tail (another request's, an
    # earlier policy's) is weighted 0, and 0 x NaN is NaN: one NaN left in the pool made
    # every later request that got its page return NaN log-probs (a reviewer).
    v_blk = jnp.where(mask_Bx1xS[:, 0, :, None, None], v_blk, jnp.zeros((), v_blk.dtype))
    return attend_block(state, q_BxTxKxGxD, k_blk, v_blk, mask_Bx1xS, scale)

  # A traced trip count: one compiled loop serves every past length.
  return jax.lax.fori_loop(0, num_blocks, block, OnlineSoftmax.empty(B, K, G, T, Dh))


def _is_pow2(n: int) -> bool:
  return n >= 1 and n & (n - 1) == 0


def check_triton_shapes(page_size: int, head_dim: int, block_q: int = 64) -> None:
  """Raises ValueError when the Triton kernel cannot take these shapes (its tiles
  must be powers of two, and at least 16 wide for the tensor-core dot)."""
  for name, n in (("page_size", page_size), ("head_dim", head_dim), ("block_q", block_q)):
    if not (_is_pow2(n) and n >= 16):
      raise ValueError(f"the triton paged-attention kernel needs {name} a power of two "
                       f">= 16, got {n}")


def _triton_kernel(layer_ref, past_len_ref, table_ref, q_ref, k_ref, v_ref,
                   acc_ref, m_ref, l_ref, *, scale: float, num_pages: int, n_cols: int):
  """One program: one row, one KV head, one block of query rows.

  q_ref `[Mq, Dh]` (the block's query rows: G heads x T tokens, padded); k_ref/v_ref
  the whole pool; table_ref the row's page ids; outputs the unnormalised state.
  """
  head = jax.lax.convert_element_type(pl.program_id(1), jnp.int32)
  layer = layer_ref[0]
  past_len = past_len_ref[0]
  q = q_ref[...]
  Mq, Dh = q.shape
  P = k_ref.shape[2]
  n_used = jnp.minimum((past_len + P - 1) // P, n_cols)

  def page(j, carry):
    acc, m, l = carry
    page_id = jnp.clip(table_ref[j], 0, num_pages - 1)
    k = k_ref[layer, page_id, :, head, :].astype(q.dtype)  # [P, Dh]
    v = v_ref[layer, page_id, :, head, :].astype(q.dtype)
    s = plgpu.dot(q, k, trans_b=True).astype(jnp.float32) * scale
    mask = (j * P + jnp.arange(P))[None, :] < past_len  # [1, P]
    v = jnp.where(mask[0][:, None], v, jnp.zeros((), v.dtype))  # (a stale NaN: as the gather)
    m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, -jnp.inf), axis=1))
    # As attend_block: the rescale factor is exactly 1 where the max did not move,
    # and a finite stand-in for an all -inf max keeps NaN out of exp.
    grew = m_new > m
    alpha = jnp.where(grew, jnp.exp(jnp.where(grew, m - m_new, 0.0)), 1.0)
    m_safe = jnp.where(m_new > -jnp.inf, m_new, 0.0)
    p = jnp.where(mask, jnp.exp(s - m_safe[:, None]), 0.0)
    pv = plgpu.dot(p.astype(v.dtype), v).astype(jnp.float32)
    return acc * alpha[:, None] + pv, m_new, l * alpha + jnp.sum(p, axis=1)

  init = (jnp.zeros((Mq, Dh), jnp.float32), jnp.full((Mq,), -jnp.inf, jnp.float32),
          jnp.zeros((Mq,), jnp.float32))
  acc, m, l = jax.lax.fori_loop(0, n_used, page, init)
  acc_ref[...] = acc
  m_ref[...] = m
  l_ref[...] = l


def past_attention_triton(q_BxTxKxGxD: jax.Array, pool_k: jax.Array, pool_v: jax.Array,
                          layer: jax.Array, page_table_BxN: jax.Array, past_len_B: jax.Array,
                          *, scale: float, block_q: int = 64, num_warps: int = 4,
                          num_stages: int = 2, interpret: bool = False) -> OnlineSoftmax:
  """The online-softmax state of each query over its row's past, by a Pallas/Triton
  kernel (flash-decoding over pages, one page a loop step; PagedAttention's layout).

  Grid: (row, KV head, block of `block_q` query rows); a KV head's G query heads and
  the row's T tokens form its G*T query rows, so a decode step (T = 1) reads each
  page once for all G heads sharing it. Query rows are padded to a power of two >= 16
  (the dot's smallest tile). `interpret=True` runs it in Pallas' interpreter (any
  backend; tests).
  """
  B, T, K, G, Dh = q_BxTxKxGxD.shape
  L, num_pages, P, K_pool, Dh_pool = pool_k.shape
  if (K_pool, Dh_pool) != (K, Dh):
    raise ValueError(f"pool heads {K_pool}x{Dh_pool} do not match queries' {K}x{Dh}")
  check_triton_shapes(P, Dh, block_q)
  n_cols = page_table_BxN.shape[1]
  M = G * T
  bq = min(block_q, max(16, 1 << (M - 1).bit_length()))
  M_pad = -(-M // bq) * bq
  q = q_BxTxKxGxD.transpose(0, 2, 3, 1, 4).reshape(B, K, M, Dh)  # rows: (g, t)
  q = jnp.pad(q, ((0, 0), (0, 0), (0, M_pad - M), (0, 0)))
  kernel = functools.partial(_triton_kernel, scale=scale, num_pages=num_pages, n_cols=n_cols)
  whole = lambda b, h, i: (0, 0, 0, 0, 0)
  acc, m, l = pl.pallas_call(
      kernel,
      grid=(B, K, M_pad // bq),
      in_specs=[
          pl.BlockSpec((1,), lambda b, h, i: (0,)),  # layer
          pl.BlockSpec((1,), lambda b, h, i: (b,)),  # past_len
          pl.BlockSpec((None, n_cols), lambda b, h, i: (b, 0)),  # the row's page ids
          pl.BlockSpec((None, None, bq, Dh), lambda b, h, i: (b, h, i, 0)),
          pl.BlockSpec(pool_k.shape, whole),
          pl.BlockSpec(pool_v.shape, whole),
      ],
      out_specs=[
          pl.BlockSpec((None, None, bq, Dh), lambda b, h, i: (b, h, i, 0)),
          pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i)),
          pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((B, K, M_pad, Dh), jnp.float32),
          jax.ShapeDtypeStruct((B, K, M_pad), jnp.float32),
          jax.ShapeDtypeStruct((B, K, M_pad), jnp.float32),
      ],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="paged_past_attention",
  )(jnp.reshape(layer, (1,)).astype(jnp.int32), past_len_B.astype(jnp.int32),
    page_table_BxN.astype(jnp.int32), q, pool_k, pool_v)
  return OnlineSoftmax(m=m[:, :, :M].reshape(B, K, G, T),
                       l=l[:, :, :M].reshape(B, K, G, T),
                       acc=acc[:, :, :M].reshape(B, K, G, T, Dh))


def default_kernel() -> str:
  """The kernel `auto` picks: `gather` on every backend for now. The Triton kernel is
  checked only on CPU (interpreter, CUDA lowering); it becomes the GPU default once a
  GPU run shows it compiles, keeps the log-prob contract and is faster
  (`tools/check_engine.py --kernels gather,triton`, `tools/bench_rollout.py --kernels
  gather,triton`)."""
  return "gather"


"""The paged-KV forward pass (`Decoder.forward_paged`, `write_pages`) against the dense one.

Run as a script (`python tests/models/test_paged.py`) to print decode-step
timings of the paged path against past length and pool size.
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent.models import preset
from jaxagent.models.llama import PagedKV, init_cache, write_pages
from jaxagent.models.params import abstract_model, bind, init_params

VARIANTS = {
    "gqa": dict(),
    "mha_bias_untied": dict(n_kv_heads=4, qkv_bias=True, tie_embeddings=False),
}


@functools.cache
def _fns(variant: str):
  """Config, params and jitted dense and paged steps of a 2-layer tiny model."""
  cfg = preset("tiny", n_layers=2, **VARIANTS[variant])
  graphdef, abstract = abstract_model(cfg)
  params = init_params(cfg, 0)

  @jax.jit
  def dense(params, tokens_BxT):
    return bind(graphdef, abstract, params)(tokens_BxT)[0]

  @jax.jit
  def dense_step(params, tokens_BxT, positions_BxT, cache):
    return bind(graphdef, abstract, params)(tokens_BxT, positions_BxT, cache=cache)

  @functools.partial(jax.jit, static_argnames=("pages_per_block",))
  def paged(params, tokens, positions, past_len, pages, table, num_blocks, valid, *,
            pages_per_block):
    """One engine step: the paged forward, then the new K/V written into the pool."""
    logits, new_k, new_v = bind(graphdef, abstract, params).forward_paged(
        tokens, positions, past_len, pages, table, num_blocks, pages_per_block=pages_per_block)
    return logits, new_k, write_pages(pages, new_k, new_v, table, positions, valid)

  return cfg, params, dense, dense_step, paged


def _random_pool(cfg, num_pages, page_size, seed=0, dtype=jnp.float32):
  """A pool full of finite garbage: anything read outside a row's past must be masked."""
  shape = (cfg.n_layers, num_pages, page_size, cfg.n_kv_heads, cfg.head_dim)
  kk, kv = jax.random.split(jax.random.PRNGKey(seed))
  return PagedKV(jax.random.normal(kk, shape, dtype), jax.random.normal(kv, shape, dtype))


def _shuffled_table(rng, batch, pages_per_row, num_pages):
  """Distinct, non-contiguous page ids for each row."""
  perm = rng.permutation(num_pages)[:batch * pages_per_row]
  return jnp.asarray(perm.reshape(batch, pages_per_row), jnp.int32)


def _num_blocks(past_len_B, page_size, pages_per_block):
  span = page_size * pages_per_block
  return jnp.int32(-(-int(np.max(past_len_B)) // span))


class _PagedRunner:
  """Steps of `forward_paged` + `write_pages`, tracking each row's past length on the host."""

  def __init__(self, variant, page_size, pages_per_block, table, pool, auto_blocks=False):
    self.cfg, self.params, _, _, self._paged = _fns(variant)
    self.auto_blocks = auto_blocks  # num_blocks=None: derived from past_len on device
    self.P, self.ppb, self.table, self.pool = page_size, pages_per_block, table, pool
    self.past_len = np.zeros(table.shape[0], np.int32)

  def step(self, tokens_BxT, n_valid_B):
    """Feeds tokens; row b's first `n_valid_B[b]` are real. Returns logits `[B, T, V]`."""
    B, T = tokens_BxT.shape
    positions = self.past_len[:, None] + np.arange(T, dtype=np.int32)[None, :]
    valid = np.arange(T)[None, :] < np.asarray(n_valid_B)[:, None]
    num_blocks = None if self.auto_blocks else _num_blocks(self.past_len, self.P, self.ppb)
    logits, _, self.pool = self._paged(
        self.params, jnp.asarray(tokens_BxT), jnp.asarray(positions), jnp.asarray(self.past_len),
        self.pool, self.table, num_blocks, jnp.asarray(valid), pages_per_block=self.ppb)
    self.past_len = self.past_len + np.asarray(n_valid_B, np.int32)
    return logits


@pytest.mark.parametrize("variant,page_size,pages_per_block,auto_blocks", [
    ("gqa", 4, 1, False), ("gqa", 16, 3, True), ("mha_bias_untied", 4, 2, False)])
def test_prefill_then_decode_equals_dense(variant, page_size, pages_per_block, auto_blocks):
  cfg, params, dense, *_ = _fns(variant)
  total, prompts, bucket = 22, np.array([7, 8, 0]), 8  # row 2 is a padding row
  tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (3, total), 0, cfg.vocab_size))
  full = np.asarray(dense(params, jnp.asarray(tokens)))
  rng = np.random.default_rng(0)
  pages_per_row = -(-32 // page_size)
  num_pages = 3 * pages_per_row + 5
  run = _PagedRunner(variant, page_size, pages_per_block,
                     _shuffled_table(rng, 3, pages_per_row, num_pages),
                     _random_pool(cfg, num_pages, page_size), auto_blocks)
  pool_before = jax.device_get(run.pool)
  logits = np.asarray(run.step(tokens[:, :bucket], prompts))  # bucket-padded prefill
  for b in range(2):
    np.testing.assert_allclose(logits[b, :prompts[b]], full[b, :prompts[b]], atol=1e-5,
                               rtol=1e-5)
  # Decode one token at a time; a row that has reached `total` idles as padding.
  for _ in range(total - prompts[:2].min()):
    n = run.past_len.copy()
    active = (n < total) & (np.arange(3) < 2)
    step_tokens = np.where(active, tokens[np.arange(3), np.minimum(n, total - 1)], 0)[:, None]
    step = np.asarray(run.step(step_tokens, active.astype(np.int32)))
    for b in np.flatnonzero(active):
      np.testing.assert_allclose(step[b, 0], full[b, n[b]], atol=1e-5, rtol=1e-5)
  assert list(run.past_len) == [total, total, 0]
  # The padding row wrote nothing: its pages still hold their garbage.
  pool_after = jax.device_get(run.pool)
  for page in np.asarray(run.table[2]):
    np.testing.assert_array_equal(pool_after.k[:, page], pool_before.k[:, page])
    np.testing.assert_array_equal(pool_after.v[:, page], pool_before.v[:, page])


def test_chunked_prefill_equals_one_chunk_and_dense():
  variant = "mha_bias_untied"
  cfg, params, dense, *_ = _fns(variant)
  # Shapes as in test_prefill_then_decode_equals_dense, to share its compilations.
  page_size, ppb, n = 4, 2, 22
  tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(5), (3, n), 0, cfg.vocab_size))
  full = np.asarray(dense(params, jnp.asarray(tokens)))
  rng = np.random.default_rng(1)
  table = _shuffled_table(rng, 3, 8, 29)
  pool = _random_pool(cfg, 29, page_size, seed=3)
  one = _PagedRunner(variant, page_size, ppb, table, pool)
  one_chunk = np.asarray(one.step(tokens, [n] * 3))
  chunked = _PagedRunner(variant, page_size, ppb, table, pool)
  # Chunks of 7, 7 and 8 tokens, each padded to 8 (the padding is dropped).
  outs = []
  for start, stop in [(0, 7), (7, 14), (14, 22)]:
    chunk = np.zeros((3, 8), np.int32)
    chunk[:, :stop - start] = tokens[:, start:stop]
    outs.append(np.asarray(chunked.step(chunk, [stop - start] * 3))[:, :stop - start])
  chunked_logits = np.concatenate(outs, axis=1)
  np.testing.assert_allclose(chunked_logits, one_chunk, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(chunked_logits, full, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(one_chunk, full, atol=1e-5, rtol=1e-5)
  # Not bit-equal: the projections run at different shapes (T = 8 vs 22).
  np.testing.assert_allclose(chunked.pool.k, one.pool.k, atol=1e-5)
  np.testing.assert_allclose(chunked.pool.v, one.pool.v, atol=1e-5)


def test_row_is_independent_of_its_neighbours_bit_for_bit():
  """Row 0's logits are bit-identical whether its neighbour's past is short, empty
  (a padding row) or much longer (so many more blocks are iterated)."""
  cfg, params, _, _, paged = _fns("gqa")
  page_size, ppb, T = 4, 2, 3
  table = _shuffled_table(np.random.default_rng(2), 2, 16, 40)
  pool = _random_pool(cfg, 40, page_size, seed=4)  # the pool is the rows' "past"
  tokens = jax.random.randint(jax.random.PRNGKey(6), (2, T), 0, cfg.vocab_size)
  past_a = 10

  def row0(past_neighbour, num_blocks):
    past = jnp.array([past_a, past_neighbour], jnp.int32)
    positions = past[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    logits, new_k, _ = paged(params, tokens, positions, past, pool, table,
                             jnp.int32(num_blocks), jnp.ones((2, T), bool), pages_per_block=ppb)
    return np.asarray(logits[0]), np.asarray(new_k[:, 0])

  base, base_k = row0(3, 2)  # ceil(10 / 8) = 2 blocks
  # A padding neighbour, longer neighbours (8 blocks), more blocks than any row needs.
  for past_neighbour, num_blocks in [(0, 2), (60, 8), (64, 8), (60, 50)]:
    logits, new_k = row0(past_neighbour, num_blocks)
    np.testing.assert_array_equal(logits, base)
    np.testing.assert_array_equal(new_k, base_k)
  # Alone (B = 1). Bit-equality across batch sizes is up to the backend's matmul
  # kernels for the projections (XLA:CPU differs at B*T = 1 vs 2), not the
  # attention, so this is checked to rounding only.
  past = jnp.array([past_a], jnp.int32)
  positions = past[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
  alone, _, _ = paged(params, tokens[:1], positions, past, pool, table[:1], jnp.int32(2),
                      jnp.ones((1, T), bool), pages_per_block=ppb)
  np.testing.assert_allclose(alone[0], base, atol=1e-6, rtol=0)


def test_bfloat16_pool_is_close_to_dense_bfloat16_cache():
  """A float32 model over a bfloat16 pool rounds K/V as the dense path over a bfloat16 cache."""
  cfg, params, _, dense_step, paged = _fns("gqa")
  T, page_size, ppb = 14, 4, 2
  tokens = jax.random.randint(jax.random.PRNGKey(7), (1, T), 0, cfg.vocab_size)
  pos = jnp.arange(T, dtype=jnp.int32)[None, :]
  want, _ = dense_step(params, tokens, pos, init_cache(cfg, 1, 16, jnp.bfloat16))
  table = jnp.array([[3, 0, 2, 1]], jnp.int32)
  pool = _random_pool(cfg, 4, page_size, dtype=jnp.bfloat16)
  valid = jnp.ones((1, 7), bool)
  got, new_k, pool = paged(params, tokens[:, :7], pos[:, :7], jnp.array([0]), pool, table,
                           jnp.int32(0), valid, pages_per_block=ppb)
  assert new_k.dtype == jnp.bfloat16 and got.dtype == jnp.float32
  got2, _, _ = paged(params, tokens[:, 7:], pos[:, 7:], jnp.array([7]), pool, table,
                     jnp.int32(1), valid, pages_per_block=ppb)
  np.testing.assert_allclose(jnp.concatenate([got, got2], axis=1), want, atol=2e-3)


def test_write_pages_places_tokens_and_drops_invalid():
  cfg = preset("tiny", n_layers=2)
  L, K, D = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
  pool = PagedKV(jnp.zeros((L, 6, 4, K, D)), jnp.zeros((L, 6, 4, K, D)))
  table = jnp.array([[5, 2, 0], [1, 3, -1]], jnp.int32)  # -1: an unallocated page
  # Dropped: position 99 (past the table), -1 (negative), 9 (page -1), valid False.
  positions = jnp.array([[3, 4, 5, 99, 1], [6, 7, -1, 9, 0]], jnp.int32)
  valid = jnp.array([[True] * 4 + [False], [True] * 4 + [False]])
  new_k = jax.random.normal(jax.random.PRNGKey(0), (L, 2, 5, K, D))
  out = jax.device_get(jax.jit(write_pages)(pool, new_k, -new_k, table, positions, valid))
  expect = np.zeros(pool.k.shape, np.float32)
  for b, t, page, offset in [(0, 0, 5, 3), (0, 1, 2, 0), (0, 2, 2, 1), (1, 0, 3, 2),
                             (1, 1, 3, 3)]:
    expect[:, page, offset] = new_k[:, b, t]
  np.testing.assert_array_equal(out.k, expect)
  np.testing.assert_array_equal(out.v, -expect)


def test_one_compilation_serves_every_num_blocks():
  cfg, params, *_ = _fns("gqa")
  graphdef, abstract = abstract_model(cfg)

  @jax.jit
  def paged(params, tokens, positions, past_len, pages, table, num_blocks):
    return bind(graphdef, abstract, params).forward_paged(
        tokens, positions, past_len, pages, table, num_blocks, pages_per_block=2)[0]

  pool = _random_pool(cfg, 16, 4)
  table = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
  tokens = jnp.zeros((2, 1), jnp.int32)
  outs = []
  for past, num_blocks in [(0, 0), (5, 1), (17, 3), (30, 4)]:
    past_B = jnp.array([past, 1], jnp.int32)
    outs.append(paged(params, tokens, past_B[:, None], past_B, pool, table,
                      jnp.int32(num_blocks)))
  assert paged._cache_size() == 1
  assert all(bool(jnp.isfinite(o).all()) for o in outs)


# -- timing (python tests/models/test_paged.py) -----------------------------------------


def _bench(batch=16, page_size=16, pages_per_block=8, max_len=8192, repeats=20):
  """Prints the time of one decode step (T=1) against past length and pool size."""
  cfg = preset("tiny")  # d_model 128, 4 layers
  graphdef, abstract = abstract_model(cfg)
  params = init_params(cfg, 0)

  @functools.partial(jax.jit, donate_argnums=(4,))
  def step(params, tokens, positions, past_len, pages, table, num_blocks):
    logits, new_k, new_v = bind(graphdef, abstract, params).forward_paged(
        tokens, positions, past_len, pages, table, num_blocks, pages_per_block=pages_per_block)
    valid = jnp.ones(tokens.shape, bool)
    return logits, write_pages(pages, new_k, new_v, table, positions, valid)

  @functools.partial(jax.jit, donate_argnums=(3,))
  def dense_step(params, tokens, positions, cache):
    return bind(graphdef, abstract, params)(tokens, positions, cache=cache)

  # Room for `max_len` past tokens plus the new one in every row (large), or for
  # 1024 only (small): at equal past length the step time should not change.
  pages_per_row = max_len // page_size + 1
  table_width = pages_per_row
  print(f"backend {jax.default_backend()}, B={batch}, T=1, d_model {cfg.d_model}, "
        f"{cfg.n_layers} layers, page_size {page_size}, pages_per_block {pages_per_block}")
  for num_pages in (batch * pages_per_row, batch * (1024 // page_size + 1)):
    shape = (cfg.n_layers, num_pages, page_size, cfg.n_kv_heads, cfg.head_dim)
    pages = PagedKV(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
    gib = 2 * np.prod(shape) * 4 / 2**30
    for past in (128, 1024, 8192):
      need = -(-(past + 1) // page_size)
      if batch * need > num_pages:
        continue
      table = np.zeros((batch, table_width), np.int32)
      ids = np.random.default_rng(0).permutation(num_pages)[:batch * need]
      table[:, :need] = ids.reshape(batch, need)
      table = jnp.asarray(table)
      past_B = jnp.full((batch,), past, jnp.int32)
      pos = past_B[:, None]
      tokens = jnp.zeros((batch, 1), jnp.int32)
      nb = jnp.int32(-(-past // (page_size * pages_per_block)))
      logits, pages = step(params, tokens, pos, past_B, pages, table, nb)
      logits.block_until_ready()
      t0 = time.perf_counter()
      for _ in range(repeats):
        logits, pages = step(params, tokens, pos, past_B, pages, table, nb)
      logits.block_until_ready()
      ms = (time.perf_counter() - t0) / repeats * 1e3
      print(f"  paged: pool {num_pages:6d} pages ({gib:.3f} GiB)  past {past:5d}: {ms:8.2f} ms")
    del pages
  for cache_len in (1024 + 16, max_len + 16):
    cache = init_cache(cfg, batch, cache_len)
    tokens = jnp.zeros((batch, 1), jnp.int32)
    pos = jnp.full((batch, 1), 128, jnp.int32)
    logits, cache = dense_step(params, tokens, pos, cache)
    logits.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(repeats):
      logits, cache = dense_step(params, tokens, pos, cache)
    logits.block_until_ready()
    ms = (time.perf_counter() - t0) / repeats * 1e3
    print(f"  dense cache (reference): max_len {cache_len:5d}, past 128: {ms:8.2f} ms")
    del cache


if __name__ == "__main__":
  _bench()

"""The Pallas/Triton paged-attention kernel against the plain-JAX gather loop.

On CPU the kernel runs in Pallas' interpreter (same program, same masks and loop
bounds); a lowering test turns it into Triton IR for CUDA without a GPU, which
checks what Pallas' Triton lowering accepts (Triton's compiler runs only on a GPU). Its speed is measured on a GPU
by `tools/check_engine.py`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent.models import preset
from jaxagent.models.llama import PagedKV, write_pages
from jaxagent.models.paged_attention import (check_triton_shapes, past_attention_gather,
                                             past_attention_triton)
from jaxagent.models.params import abstract_model, bind, init_params
from tests.rollout_server.conftest import CFG as ENGINE_CFG
from tests.rollout_server.conftest import make_engine

B, T, K, G, DH, L, NUM_PAGES, PAGE, COLS = 3, 2, 2, 3, 16, 2, 24, 16, 6


def _inputs(seed=0, past=(0, 17, 90)):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(B, T, K, G, DH)), jnp.float32)
  # Finite garbage everywhere: whatever lies outside a row's past must be masked.
  pool_k = jnp.asarray(rng.normal(size=(L, NUM_PAGES, PAGE, K, DH)), jnp.float32)
  pool_v = jnp.asarray(rng.normal(size=(L, NUM_PAGES, PAGE, K, DH)), jnp.float32)
  table = rng.permutation(NUM_PAGES)[:B * COLS].reshape(B, COLS)
  table[0, :] = -1  # an empty row's table may hold any sentinel
  return q, pool_k, pool_v, jnp.asarray(table, jnp.int32), jnp.asarray(past, jnp.int32)


def _state(kernel, q, pool_k, pool_v, layer, table, past):
  if kernel == "gather":
    blocks = jnp.int32(-(-int(jnp.max(past)) // (4 * PAGE)))
    return past_attention_gather(q, pool_k, pool_v, jnp.int32(layer), table, past, blocks,
                                 pages_per_block=4, scale=0.25, compute_dtype=jnp.float32)
  return past_attention_triton(q, pool_k, pool_v, jnp.int32(layer), table, past, scale=0.25,
                               interpret=True)


def _normalised(state):
  """Attention output (acc / l) where a row has a past; zeros elsewhere."""
  l = np.asarray(state.l)
  return np.where(l[..., None] > 0, np.asarray(state.acc) / np.maximum(l, 1e-30)[..., None], 0)


@pytest.mark.parametrize("layer,past", [(0, (0, 17, 90)), (1, (0, 17, 90)),
                                        (0, (32, 96, 200))])  # whole pages; past the table
def test_kernel_equals_the_gather_loop(layer, past):
  """Also where a row's length runs past its table (6 pages of 16): both read the
  table's pages only."""
  args = _inputs(past=past)
  want = _state("gather", *args[:3], layer, *args[3:])
  got = _state("triton", *args[:3], layer, *args[3:])
  if past[0] == 0:  # a row without a past is the empty state exactly
    assert np.all(np.asarray(got.m)[0] == -np.inf) and not np.asarray(got.l)[0].any()
    assert not np.asarray(got.acc)[0].any()
  has_past = np.asarray(past) > 0
  np.testing.assert_allclose(np.asarray(got.m)[has_past], np.asarray(want.m)[has_past],
                             rtol=1e-6)
  np.testing.assert_allclose(np.asarray(got.l), np.asarray(want.l), rtol=1e-5)
  np.testing.assert_allclose(_normalised(got), _normalised(want), atol=1e-5)


@pytest.mark.parametrize("kernel", ["gather", "triton"])
def test_a_nan_left_in_the_pool_past_a_rows_keys_changes_nothing(kernel):
  """A reviewer: values past a row's keys were weighted 0, and 0 x NaN is NaN: one NaN
  left in a page's stale tail (another request's, an earlier policy's) made every
  later request that got the page return NaN log-probs."""
  q, pool_k, pool_v, table, past = _inputs()
  want = _state(kernel, q, pool_k, pool_v, 0, table, past)
  page = int(table[1, 1])  # row 1's second page: its keys 16..31, past 17 reads 16 only
  poisoned_v = pool_v.at[0, page, 5:].set(jnp.nan)
  poisoned_k = pool_k.at[0, page, 5:].set(jnp.nan)
  got = _state(kernel, q, poisoned_k, poisoned_v, 0, table, past)
  assert np.isfinite(np.asarray(got.acc)).all() and np.isfinite(np.asarray(got.l)).all()
  np.testing.assert_allclose(_normalised(got), _normalised(want), atol=1e-6)


def test_a_rows_result_does_not_depend_on_its_neighbours():
  """Bit for bit: another row's length, pages and queries change nothing in row 1."""
  q, pool_k, pool_v, table, past = _inputs()
  base = _state("triton", q, pool_k, pool_v, 0, table, past)
  q2 = q.at[2].set(-q[2])
  table2 = table.at[2].set(jnp.roll(table[2], 1))
  other = _state("triton", q2, pool_k, pool_v, 0, table2, past.at[2].set(33))
  for a, b in zip(base, other):
    np.testing.assert_array_equal(np.asarray(a)[1], np.asarray(b)[1])


def test_forward_paged_with_the_kernel_equals_the_gather_loop():
  """A prefill into pages, then decode steps: the same logits either way."""
  cfg = preset("tiny", n_layers=2)
  graphdef, abstract = abstract_model(cfg)
  params = init_params(cfg, 0)
  pool = PagedKV(*(jnp.zeros((cfg.n_layers, 16, PAGE, cfg.n_kv_heads, cfg.head_dim))
                   for _ in range(2)))
  table = jnp.asarray([[3, 7, 1], [10, 2, 5]], jnp.int32)
  rng = np.random.default_rng(1)

  def step(kernel, pool, tokens, positions, past):
    model = bind(graphdef, abstract, params)
    logits, nk, nv = model.forward_paged(tokens, positions, past, pool, table,
                                         pages_per_block=2, paged_kernel=kernel,
                                         interpret=True)
    valid = jnp.ones(tokens.shape, bool)
    return logits, write_pages(pool, nk, nv, table, positions, valid)

  pools = {"gather": pool, "triton": pool}
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 20)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(20, dtype=jnp.int32), (2, 20))
  past = jnp.zeros(2, jnp.int32)
  for t in range(4):
    out = {}
    for kernel in pools:
      out[kernel], pools[kernel] = step(kernel, pools[kernel], tokens, positions, past)
    np.testing.assert_allclose(out["triton"], out["gather"], atol=2e-5)
    past = positions[:, -1] + 1
    tokens = jnp.argmax(out["gather"][:, -1:], axis=-1).astype(jnp.int32)
    positions = past[:, None] + jnp.int32(t % 2)  # rows may sit past a gap (padding)
    past = past + jnp.int32(t % 2)


def test_shapes_the_kernel_refuses_are_named():
  with pytest.raises(ValueError, match="page_size a power of two >= 16, got 8"):
    check_triton_shapes(8, 64)
  with pytest.raises(ValueError, match="head_dim a power of two >= 16, got 48"):
    check_triton_shapes(16, 48)
  with pytest.raises(ValueError, match="block_q a power of two >= 16, got 8"):
    check_triton_shapes(16, 64, block_q=8)
  with pytest.raises(ValueError, match="attention_kernel"):
    make_engine(attention_kernel="cuda")
  assert ENGINE_CFG.head_dim >= 16


def test_the_kernel_lowers_to_triton_for_cuda():
  """Lowered for a GPU without one: Pallas turns the kernel into Triton IR (block
  shapes, dots, the dynamic page loop) for every shape the engine uses (a decode
  step, a verify step of 5 tokens, a prefill chunk of 64). Triton's own compiler
  runs only on a GPU (`tools/check_engine.py --kernels triton` there)."""
  _, pool_k, pool_v, table, past = _inputs()
  for t in (1, 5, 64):
    q = jnp.zeros((B, t, K, G, DH), jnp.bfloat16)
    fn = jax.jit(lambda q, k, v, tab, p: past_attention_triton(
        q, k, v, jnp.int32(1), tab, p, scale=0.25))
    exported = jax.export.export(
        fn, platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(q, pool_k.astype(jnp.bfloat16), pool_v.astype(jnp.bfloat16), table, past)
    assert "xla.gpu.triton" in exported.mlir_module()


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_compiled_kernel_on_a_gpu(dtype):
  """Triton-compiled on a GPU (SmolLM2's head shape, decode and a 5-token verify):
  equal to the gather loop to the GPU's matmul rounding, rows independent bit for bit."""
  rng = np.random.default_rng(3)
  b, k, g, dh, pages, cols = 8, 3, 3, 64, 600, 64
  pool_k = jnp.asarray(rng.normal(size=(2, pages, PAGE, k, dh)), dtype)
  pool_v = jnp.asarray(rng.normal(size=(2, pages, PAGE, k, dh)), dtype)
  table = jnp.asarray(rng.permutation(pages)[:b * cols].reshape(b, cols), jnp.int32)
  past = jnp.asarray(rng.integers(0, cols * PAGE, b), jnp.int32)
  for t in (1, 5):
    q = jnp.asarray(rng.normal(size=(b, t, k, g, dh)), dtype)
    want = past_attention_gather(q, pool_k, pool_v, jnp.int32(1), table, past,
                                 jnp.int32(cols // 4), pages_per_block=4, scale=0.125,
                                 compute_dtype=dtype)
    run = jax.jit(lambda q, past: past_attention_triton(q, pool_k, pool_v, jnp.int32(1),
                                                        table, past, scale=0.125))
    got = run(q, past)
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-3  # TF32 / bf16 matmuls
    np.testing.assert_allclose(_normalised(got), _normalised(want), atol=tol, rtol=tol)
    other = run(q.at[0].set(-q[0]), past.at[0].set(7))
    for a, c in zip(got, other):
      np.testing.assert_array_equal(np.asarray(a)[1:], np.asarray(c)[1:])

"""Training attention and chunked log-probs: every implementation equals the dense
computation (values and gradients) to float32 rounding, and the memory-lean ones keep
memory linear in the row length."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent import losses
from jaxagent.config import LearnerConfig
from jaxagent.learner import Learner
from jaxagent.models import attention
from jaxagent.models.config import preset
from jaxagent.models.sharding import make_mesh
from jaxagent.batch import pack
from jaxagent.data import synthetic_segment


def _qkv(B=2, T=50, K=2, G=2, D=8, seed=0):
  r = jax.random.split(jax.random.PRNGKey(seed), 4)
  return (jax.random.normal(r[0], (B, T, K, G, D)), jax.random.normal(r[1], (B, T, K, D)),
          jax.random.normal(r[2], (B, T, K, D)), jax.random.normal(r[3], (B, T, K, G, D)))


# Row 0: segments of 20 and 25 tokens, then 5 of padding; row 1: one segment of 3, then
# one of 47 (its first key block lies before the query block's own start).
SEGMENTS = np.stack([np.r_[np.ones(20), 2 * np.ones(25), np.zeros(5)],
                     np.r_[np.ones(3), 2 * np.ones(47)]]).astype(np.int32)


@pytest.mark.parametrize("impl,block", [("flash", 16), ("flash", 7), ("flash", 64),
                                        ("dot_product", 0)])
def test_attention_matches_dense_values_and_gradients(impl, block):
  q, k, v, w = _qkv()
  seg = jnp.asarray(SEGMENTS)

  def loss(impl, q, k, v):
    out = attention.causal_attention(q, k, v, seg, 0.3, implementation=impl, block=block or 8)
    return jnp.sum(out * w)

  dense = jax.jit(jax.value_and_grad(lambda *a: loss("dense", *a), (0, 1, 2)))(q, k, v)
  other = jax.jit(jax.value_and_grad(lambda *a: loss(impl, *a), (0, 1, 2)))(q, k, v)
  np.testing.assert_allclose(other[0], dense[0], rtol=1e-5)
  for a, b in zip(other[1], dense[1]):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5)


def test_flash_attention_without_segments_is_plain_causal():
  q, k, v, _ = _qkv(T=33)
  full = attention.causal_attention(q, k, v, None, 0.5, implementation="dense")
  flash = attention.causal_attention(q, k, v, None, 0.5, implementation="flash", block=8)
  np.testing.assert_allclose(flash, full, atol=1e-5)


def test_flash_attention_in_bfloat16_stays_close():
  q, k, v, _ = _qkv(T=64)
  seg = jnp.ones((2, 64), jnp.int32)
  bf = lambda x: x.astype(jnp.bfloat16)
  out = attention.causal_attention(bf(q), bf(k), bf(v), seg, 0.3, implementation="flash",
                                   block=16)
  ref = attention.causal_attention(q, k, v, seg, 0.3, implementation="dense")
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=3e-2)


def test_unknown_attention_is_named():
  with pytest.raises(ValueError, match="attention: unknown 'flashy'"):
    preset("tiny", attention="flashy")
  with pytest.raises(ValueError, match="remat: unknown 'some'"):
    preset("tiny", remat="some")
  assert preset("tiny", remat=True).remat == "full"


@pytest.mark.parametrize("chunk,vocab_chunk", [(8, 0), (10, 16), (100, 7)])
def test_chunked_logp_and_entropy_equal_the_full_computation(chunk, vocab_chunk):
  B, T, D, V = 3, 37, 16, 50
  r = jax.random.split(jax.random.PRNGKey(1), 4)
  h = jax.random.normal(r[0], (B, T, D))
  w = jax.random.normal(r[1], (D, V))
  targets = jax.random.randint(r[2], (B, T), 0, V)
  c = jax.random.normal(r[3], (B, T))

  def objective(fn, h, w):
    logp, ent = fn(h, w)
    return jnp.sum(logp * c) + jnp.sum(ent * c * c), (logp, ent)

  full = lambda h, w: losses.token_logp_and_entropy(jnp.einsum("btd,dv->btv", h, w),
                                                    targets, 0.7)
  chunked = lambda h, w: losses.chunked_token_logp_and_entropy(
      h, w, targets, 0.7, chunk=chunk, vocab_chunk=vocab_chunk)
  (a, (lp_a, en_a)), g_a = jax.jit(jax.value_and_grad(lambda *x: objective(full, *x),
                                                      (0, 1), has_aux=True))(h, w)
  (b, (lp_b, en_b)), g_b = jax.jit(jax.value_and_grad(lambda *x: objective(chunked, *x),
                                                      (0, 1), has_aux=True))(h, w)
  np.testing.assert_allclose(lp_b, lp_a, atol=1e-5)
  np.testing.assert_allclose(en_b, en_a, atol=1e-5)
  for x, y in zip(g_b, g_a):
    np.testing.assert_allclose(x, y, atol=2e-4, rtol=1e-5)


def _batch(seq_len, rows, vocab=256):
  segs = [synthetic_segment(i, seed=0, vocab=vocab, target=97, min_len=seq_len // 4,
                            max_len=seq_len // 2) for i in range(rows * 4)]
  return pack(segs, rows, seq_len)[0]


def test_lean_learner_objective_equals_the_dense_one():
  """Flash attention + chunked log-probs give the dense objective, its metrics and its
  gradient to float32 rounding."""
  from jaxagent.learner import microbatch_objective
  from jaxagent.models.params import abstract_model, bind, init_params

  batch = jax.tree.map(jnp.asarray, _batch(96, 4))
  out = {}
  for name, attn, chunk in [("dense", "dense", 0), ("lean", "flash", 16)]:
    cfg = preset("nano", attention=attn, attention_block=32)
    lcfg = LearnerConfig(logits_chunk=chunk, entropy_coef=0.01)
    graphdef, abstract = abstract_model(cfg)
    params = init_params(cfg, 0)
    fn = lambda p: microbatch_objective(bind(graphdef, abstract, p), batch, lcfg)
    out[name] = jax.jit(jax.value_and_grad(fn, has_aux=True))(params)
  ((loss_d, (_, m_d)), g_d), ((loss_l, (_, m_l)), g_l) = out["dense"], out["lean"]
  np.testing.assert_allclose(loss_l, loss_d, rtol=1e-5)
  np.testing.assert_allclose(m_l["entropy"][0], m_d["entropy"][0], rtol=1e-5)
  for name in g_d:
    scale = float(jnp.max(jnp.abs(g_d[name])))
    np.testing.assert_allclose(g_l[name], g_d[name], atol=1e-4 * scale + 1e-7)


def test_bfloat16_gradients_accumulate_in_float32():
  """With bfloat16 parameters the accumulated gradient is float32, and 8 microbatches
  sum to the 1-microbatch gradient (a bfloat16 accumulator would round each sum)."""
  from jaxagent.learner import accumulate_gradients

  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=64), jnp.bfloat16)}
  Rows = collections.namedtuple("Rows", "tokens")  # the batch's leading axis is rows
  batch = Rows(jnp.asarray(rng.normal(size=(32, 64)), jnp.float32))

  def objective(p, mb):
    out = mb.tokens @ p["w"].astype(jnp.float32)
    return jnp.sum(out ** 2), (jnp.float32(mb.tokens.shape[0]), {})

  one = accumulate_gradients(params, batch, objective, 1)[0]["w"]
  eight = accumulate_gradients(params, batch, objective, 8)[0]["w"]
  assert one.dtype == eight.dtype == jnp.float32
  np.testing.assert_allclose(eight, one, rtol=2e-2)


def _peak_bytes(attn, seq_len, tokens=2048):
  cfg = preset("nano", attention=attn, attention_block=128, max_seq_len=seq_len)
  learner = Learner(cfg, LearnerConfig(logits_chunk=128 if attn == "flash" else 0),
                    make_mesh())
  batch = learner.shard_batch(_batch(seq_len, tokens // seq_len))
  m = learner._step.lower(learner.abstract_state(), batch).compile().memory_analysis()
  return m.temp_size_in_bytes


def test_lean_learner_memory_is_linear_in_row_length():
  """At a fixed number of tokens, 4x longer rows: the flash step's temporaries stay
  about the same (the dense step's grow 2.7x: quadratic attention scores; see
  tools/bench_learner.py for both)."""
  flash = _peak_bytes("flash", 1024) / _peak_bytes("flash", 256)
  assert flash < 1.2, flash

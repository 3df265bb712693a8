"""Engine: exact log-probs against the learner, sampling semantics, compile-once shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent import losses
from jaxagent.models.params import abstract_model, bind
from rollout_server.engine import PrefillRequest, SamplingParams, bucket
from tests.rollout_server.conftest import CFG, make_engine


def pages_of(engine, n_tokens, first=1):
  """Page ids for `n_tokens` positions, not contiguous (every other page from `first`)."""
  return list(range(first, first + 2 * engine.pages_for(n_tokens), 2))


def run_alone(engine, params, prompt, sampling, steps, slot=0):
  """Prefill, insert, then `steps` decode steps; returns tokens, logp, raw logp, versions."""
  state = engine.init_decode_state()
  padded, n = engine.pad_tokens(prompt)
  state, prefix, first = engine.prefill(params=params, decode_state=state,
                                        pages=pages_of(engine, n + steps + 1),
                                        padded_tokens=padded, true_length=n, sampling=sampling)
  state = engine.insert(prefix, state, slot)
  h = first.to_host()
  out = [[int(h.tokens[0])], [float(h.logp[0])], [float(h.raw_logp[0])], [int(h.versions[0])]]
  for _ in range(steps):
    state, res = engine.generate(params, state)
    h = res.to_host()
    for col, arr in zip(out, (h.tokens, h.logp, h.raw_logp, h.versions)):
      col.append(arr[slot].item())
  return out


def teacher_forced(params, tokens, temperature=1.0):
  graphdef, state = abstract_model(CFG)
  model = bind(graphdef, state, jax.device_put(params))
  seq = jnp.asarray([tokens])
  logits, _ = model(seq)
  logp, _ = losses.token_logp_and_entropy(logits, losses.shifted_targets(seq), temperature)
  return np.asarray(losses.align_to_tokens(logp)[0])


def test_engine_logprobs_equal_learner_teacher_forced(random_params):
  engine = make_engine()
  params = engine.load_params(random_params, version=7)
  prompt = [3, 14, 15, 92, 65, 35]
  toks, logp, raw, versions = run_alone(engine, params, prompt, SamplingParams(seed=1), 24)
  want = teacher_forced(random_params, prompt + toks)[len(prompt):]
  np.testing.assert_allclose(logp, want, atol=2e-5)
  np.testing.assert_allclose(raw, want, atol=2e-5)
  assert set(versions) == {7}


def test_engine_with_the_kernel_keeps_the_logprob_contract(random_params):
  """The engine's log-probs with the kernel equal the learner's teacher-forced ones, and
  its tokens equal the gather engine's."""
  prompt = [3, 14, 15, 92, 65, 35]
  runs = {}
  for kernel in ("gather", "triton"):
    engine = make_engine(attention_kernel=kernel, max_seq_len=128, max_prefill_length=64)
    params = engine.load_params(random_params, version=3)
    runs[kernel] = run_alone(engine, params, prompt, SamplingParams(seed=2), 20)
  toks, logp = runs["triton"][:2]
  assert toks == runs["gather"][0]
  want = teacher_forced(random_params, prompt + toks)[len(prompt):]
  np.testing.assert_allclose(logp, want, atol=2e-5)


def test_score_gives_every_tokens_logprob_as_sampled(random_params):
  """`score` (a frozen model's view of given tokens) equals what sampling recorded, at any
  temperature, and a sequence's scores do not depend on what is scored beside it."""
  engine = make_engine()
  params = engine.load_params(random_params)
  prompt = [3, 14, 15, 92, 65, 35]
  toks, logp, _, _ = run_alone(engine, params, prompt, SamplingParams(temperature=0.7, seed=4),
                               20)
  seqs = [prompt + toks, [5, 6], prompt]
  scored = engine.score(params, seqs, temperature=0.7, rows=2)
  assert [len(s) for s in scored] == [len(s) for s in seqs] and scored[0][0] == 0.0
  np.testing.assert_allclose(scored[0][len(prompt):], logp, atol=2e-5)
  alone = engine.score(params, [prompt], temperature=0.7)[0]
  np.testing.assert_allclose(alone, scored[2], atol=1e-6)
  np.testing.assert_allclose(engine.score(params, [prompt + toks])[0],
                             teacher_forced(random_params, prompt + toks), atol=2e-5)
  with pytest.raises(ValueError, match="token ids"):
    engine.score(params, [[1, 10 ** 6]])
  with pytest.raises(ValueError, match="temperature must be a finite float32"):
    engine.score(params, [prompt], temperature=1e-45)  # (0 to float32: nan log-probs)


def test_tempered_and_truncated_logprobs(random_params):
  engine = make_engine()
  params = engine.load_params(random_params)
  prompt = [5, 6, 7]
  # Temperature: log-prob under softmax(logits / T); raw: under the model itself.
  toks, logp, raw, _ = run_alone(engine, params, prompt, SamplingParams(temperature=0.7, seed=2),
                                 10)
  np.testing.assert_allclose(logp, teacher_forced(random_params, prompt + toks, 0.7)[3:],
                             atol=2e-5)
  np.testing.assert_allclose(raw, teacher_forced(random_params, prompt + toks)[3:], atol=2e-5)
  # Greedy: the argmax every time, log-prob 0 (a point mass); top_k=1 is the same.
  greedy = run_alone(engine, params, prompt, SamplingParams(temperature=0.0), 10)
  tf_logits_argmax = []
  graphdef, state = abstract_model(CFG)
  model = bind(graphdef, state, jax.device_put(random_params))
  logits, _ = model(jnp.asarray([prompt + greedy[0]]))
  tf_logits_argmax = np.asarray(jnp.argmax(logits[0], -1))[len(prompt) - 1:-1]
  assert greedy[0] == tf_logits_argmax.tolist()
  assert greedy[1] == [0.0] * 11
  topk1 = run_alone(engine, params, prompt, SamplingParams(top_k=1, seed=9), 10)
  assert topk1[0] == greedy[0] and np.allclose(topk1[1], 0.0, atol=1e-6)
  # A top_p that float32 reads as 0 keeps the top token (it kept none: token 0, nan).
  tiny_p = run_alone(engine, params, prompt, SamplingParams(top_p=1e-45, seed=9), 10)
  assert tiny_p[0] == greedy[0] and np.allclose(tiny_p[1], 0.0, atol=1e-6)
  # A tiny temperature is all but greedy (its log-probs were +-inf under jit: a reply the
  # server could not write, a session it could not read).
  for t in (1e-10, 1e-30):
    cold = run_alone(engine, params, prompt, SamplingParams(temperature=t, seed=9), 10)
    assert cold[0] == greedy[0] and np.allclose(cold[1], 0.0, atol=1e-6)


def test_top_k_top_p_restrict_the_distribution(random_params):
  engine = make_engine()
  params = engine.load_params(random_params)
  prompt = [40, 41, 42]
  toks, logp, raw, _ = run_alone(engine, params, prompt, SamplingParams(top_k=5, seed=4), 15)
  graphdef, state = abstract_model(CFG)
  model = bind(graphdef, state, jax.device_put(random_params))
  logits, _ = model(jnp.asarray([prompt + toks]))
  logits = np.asarray(logits[0, len(prompt) - 1:-1])
  for t, lp, row in zip(toks, logp, logits):
    top5 = np.argsort(row)[-5:]
    assert t in top5
    z = row[top5] - row[top5].max()
    want = z[list(top5).index(t)] - np.log(np.exp(z).sum())
    assert lp == pytest.approx(want, abs=2e-5)  # renormalised over the top 5
  toks_p, logp_p, _, _ = run_alone(engine, params, prompt, SamplingParams(top_p=0.05, seed=4), 5)
  assert all(lp > np.log(0.05) - 1e-6 or lp == pytest.approx(0.0, abs=1e-6) for lp in logp_p)


def test_a_row_without_top_k_or_top_p_samples_the_same_beside_one_that_filters():
  """A batch with any row that filters takes every row through the filtered path. There a
  row asking for no cut (top_p 1, top_k 0) must keep its whole distribution: float32's
  running sum reached 1.0 before the tail, which was cut (16,112 of 32,000 tokens for
  logits of std 5: red team 36), so the row sampled otherwise than alone."""
  from rollout_server.engine import _sampling_logits

  rng = np.random.default_rng(0)
  for std in (1.0, 5.0, 10.0):
    logits = jnp.asarray(rng.standard_normal(32000).astype(np.float32) * std)
    args = (logits, jnp.float32(1.0), jnp.float32(1.0), jnp.int32(0))
    _, filtered, _, _ = _sampling_logits(*args, filtered=True)
    _, plain, _, _ = _sampling_logits(*args, filtered=False)
    assert np.array_equal(np.asarray(filtered), np.asarray(plain)), std
    # (top_p below 1 still cuts the tail)
    _, cut, _, _ = _sampling_logits(logits, jnp.float32(1.0), jnp.float32(0.9), jnp.int32(0))
    assert np.isinf(np.asarray(cut)).sum() > 0


def test_same_seed_same_tokens_in_any_slot(random_params):
  engine = make_engine()
  params = engine.load_params(random_params)
  a = run_alone(engine, params, [1, 2, 3], SamplingParams(seed=5), 12, slot=0)
  b = run_alone(engine, params, [1, 2, 3], SamplingParams(seed=5), 12, slot=3)
  c = run_alone(engine, params, [1, 2, 3], SamplingParams(seed=6), 12, slot=0)
  assert a == b and a[0] != c[0]
  # Seeds are 64-bit: the bits above 32 count (they were dropped), past 2**63 and below 0
  # wrap around (they raised), and 2**64 + 5 is 5.
  high = run_alone(engine, params, [1, 2, 3], SamplingParams(seed=5 + (1 << 32)), 12)
  wrapped = run_alone(engine, params, [1, 2, 3], SamplingParams(seed=5 + (1 << 64)), 12)
  assert high[0] != a[0] and wrapped == a
  assert run_alone(engine, params, [1, 2, 3], SamplingParams(seed=(1 << 63) + 7), 4)[0] == \
      run_alone(engine, params, [1, 2, 3], SamplingParams(seed=-(1 << 63) + 7), 4)[0]


def test_prefill_many_equals_one_request_at_a_time(random_params):
  """Requests prefilled together (one after its first tokens were prefilled by an
  earlier call into its pages) decode exactly as alone; padding rows reach no slot."""
  engine = make_engine(prefill_rows=4)
  params = engine.load_params(random_params)
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
  sampling = [SamplingParams(seed=s) for s in (3, 4, 5)]
  alone = [run_alone(engine, params, p, s, 6) for p, s in zip(prompts, sampling)]
  pages = [pages_of(engine, 16, first=1 + i) for i in range(3)]  # interleaved page ids
  state = engine.init_decode_state()
  # The third request's first four tokens are in its pages from an earlier prefill.
  state, _, _ = engine.prefill_many(params=params, decode_state=state,
                                    requests=[PrefillRequest(prompts[2][:4], pages[2])])
  reqs = [PrefillRequest(prompts[0], pages[0], 0, sampling[0]),
          PrefillRequest(prompts[1], pages[1], 0, sampling[1]),
          PrefillRequest(prompts[2][4:], pages[2], 4, sampling[2])]
  state, prefix, res = engine.prefill_many(params=params, decode_state=state, requests=reqs)
  assert prefix.token.shape == (4,)  # always prefill_rows rows
  slots = [2, 0, 3]
  state = engine.insert_many(prefix, state, slots)
  assert int(state.lengths[1]) == 0 and not bool(state.active[1])  # padding was dropped
  h = res.to_host()
  got = [[[int(h.tokens[i])], [float(h.logp[i])]] for i in range(3)]
  for _ in range(6):
    state, step = engine.generate(params, state)
    hs = step.to_host()
    assert hs.valid.tolist() == [True, False, True, True]
    for i, slot in enumerate(slots):
      got[i][0].append(int(hs.tokens[slot]))
      got[i][1].append(float(hs.logp[slot]))
  for i in range(2):
    assert got[i] == alone[i][:2]
  assert got[2][0] == alone[2][0]
  np.testing.assert_allclose(got[2][1], alone[2][1], atol=1e-5)
  with pytest.raises(ValueError, match="prefill_rows"):
    engine.prefill_many(params=params, decode_state=state, requests=[PrefillRequest([1], [1])] * 5)
  with pytest.raises(ValueError, match="pages cannot hold"):
    engine.prefill_many(params=params, decode_state=state,
                        requests=[PrefillRequest(list(range(40)), [1])])


def test_decode_cost_follows_the_tokens_in_use_not_the_pool(random_params):
  """The same request decodes to the same numbers in a pool 8x larger (same compiled
  loop, more pages it never reads)."""
  small = make_engine(max_seq_len=640)
  big = make_engine(max_seq_len=640, num_pages=8 * small.num_pages)
  a = run_alone(small, small.load_params(random_params), [7, 8, 9], SamplingParams(seed=3), 8)
  b = run_alone(big, big.load_params(random_params), [7, 8, 9], SamplingParams(seed=3), 8)
  assert a == b


def test_buckets_compile_once(random_params):
  engine = make_engine()
  params = engine.load_params(random_params)
  assert bucket(3) == 16 and bucket(17) == 32 and bucket(64) == 64
  for n in (3, 7, 16):  # one bucket
    run_alone(engine, params, list(range(1, n + 1)), SamplingParams(seed=n), 3)
  assert engine._prefill._cache_size() == 1
  assert engine._generate._cache_size() == 1
  run_alone(engine, params, list(range(1, 30)), SamplingParams(), 3)
  assert engine._prefill._cache_size() == 2 and engine._generate._cache_size() == 1


def test_bad_requests_are_named(random_params):
  engine = make_engine(max_prefill_length=32)
  with pytest.raises(ValueError, match="max_prefill_length 32"):
    engine.pad_tokens(list(range(40)))
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams(top_p=0.0).validate(CFG.vocab_size)
  with pytest.raises(ValueError, match="seed must be an integer"):
    SamplingParams(seed=1.5).validate(CFG.vocab_size)
  with pytest.raises(ValueError, match="stop_token_ids"):
    SamplingParams(stop_token_ids=(10_000,)).validate(CFG.vocab_size)


def test_paged_pool_sharded_over_kv_heads_gives_the_same_tokens(multidevice):
  """The KV pool split over the `tensor` axis (KV heads) decodes exactly as on one device."""
  out = multidevice("""
    import jax, numpy as np
    from jaxagent.models.params import init_params
    from jaxagent.models.sharding import make_mesh
    from rollout_server.engine import Engine, SamplingParams
    from tests.rollout_server.conftest import CFG
    from tests.rollout_server.test_engine import run_alone

    params = jax.device_get(init_params(CFG, 0))
    runs = []
    for mesh in (make_mesh(1, 1, 1), make_mesh(1, 1, 2)):
      engine = Engine(CFG, max_concurrent_decodes=4, max_prefill_length=64, max_seq_len=128,
                      mesh=mesh)
      state = engine.init_decode_state()
      print("pool sharding", state.pages.k.sharding.spec)
      runs.append(run_alone(engine, engine.load_params(params), [3, 4, 5, 6],
                            SamplingParams(seed=2), 12))
    assert runs[0][0] == runs[1][0], runs
    np.testing.assert_allclose(runs[0][1], runs[1][1], atol=1e-5)
    print("ok")
  """)
  assert "ok" in out and "'tensor'" in out


@pytest.mark.parametrize("draft,temperature,top_k", [(2, 1.0, 0), (0, 0.7, 3), (4, 1.0, 3)])
def test_speculative_sampling_keeps_the_distribution(draft, temperature, top_k):
  """Whatever the draft, the first emitted token is distributed exactly as the sampling
  distribution (20,000 draws), and its log-prob is that distribution's."""
  from rollout_server.engine import speculate_row

  logits = jnp.asarray([[1.0, 0.2, 2.0, -1.0, 0.5], [0.3, 0.1, 0.0, 1.5, -0.5]])
  scaled = np.asarray(logits[0]) / temperature
  if top_k:
    scaled = np.where(scaled >= np.sort(scaled)[-top_k], scaled, -np.inf)
  p = np.exp(scaled - scaled.max())
  p /= p.sum()
  keys = jax.random.split(jax.random.PRNGKey(0), 20_000)
  run = jax.jit(jax.vmap(lambda k: speculate_row(
      logits, jnp.asarray([draft]), jnp.int32(1), k, jnp.int32(5), jnp.float32(temperature),
      jnp.float32(1.0), jnp.int32(top_k))))
  tokens, logp, _, n_out = run(keys)
  first = np.asarray(tokens[:, 0])
  freq = np.bincount(first, minlength=5) / len(first)
  np.testing.assert_allclose(freq, p, atol=0.015)
  np.testing.assert_allclose(np.asarray(logp[:, 0]), np.log(p[first]), atol=1e-5)
  accepted = np.asarray(n_out) == 2
  assert abs(accepted.mean() - p[draft]) < 0.015  # a draft is kept with probability p(draft)


def test_top_p_keeps_the_smallest_set_of_sorted_tokens_whose_mass_reaches_it():
  """top_p keeps a token when the mass of the tokens before it is below top_p: the token
  that crosses top_p is kept, the ones after it are not, and a top_p just below 1 still
  cuts a tail of more than 1 - top_p; the log-prob is renormalised over what is kept."""
  from rollout_server.engine import _sampling_logits, sample_token

  probs = np.array([0.005, 0.5, 0.195, 0.3], np.float32)  # sorted: 1, 3, 2, 0
  logits = jnp.asarray(np.log(probs))
  for top_p, kept in ((0.6, [1, 3]), (0.79, [1, 3]), (0.81, [1, 2, 3]), (0.99, [1, 2, 3]),
                      (0.4, [1]), (1.0, [0, 1, 2, 3])):
    _, scaled, _, _ = _sampling_logits(logits, jnp.float32(1.0), jnp.float32(top_p),
                                       jnp.int32(0))
    assert np.flatnonzero(np.isfinite(np.asarray(scaled))).tolist() == kept, top_p
  token, logp, raw = sample_token(logits, jax.random.PRNGKey(0), jnp.float32(1.0),
                                  jnp.float32(0.6), jnp.int32(0))
  assert int(token) in (1, 3)
  assert float(logp) == pytest.approx(np.log(probs[int(token)] / 0.8), abs=1e-5)
  assert float(raw) == pytest.approx(np.log(probs[int(token)]), abs=1e-5)


def prefilled(engine, params, prompt, sampling, slot, state=None, steps=16):
  """A decode state with `prompt` prefilled into `slot`; returns (state, first result)."""
  state = engine.init_decode_state() if state is None else state
  padded, n = engine.pad_tokens(prompt)
  state, prefix, first = engine.prefill(params=params, decode_state=state,
                                        pages=pages_of(engine, n + steps + 1,
                                                       first=1 + slot * engine.pages_per_seq),
                                        padded_tokens=padded, true_length=n, sampling=sampling)
  return engine.insert(prefix, state, slot), first.to_host()


def test_generate_steps_equals_single_steps_and_releases_the_slots_it_spent(random_params):
  """`generate_steps` gives every slot the tokens, log-probs, lengths and versions of as many
  `generate` calls, marks a slot's rows past its `remaining` invalid, and leaves active
  exactly the slots with steps left; an empty slot emits nothing."""
  engine = make_engine(max_seq_len=128, max_prefill_length=64)
  params = engine.load_params(random_params, version=4)
  prompts = {0: [3, 4, 5], 2: [9, 8, 7, 6, 5]}
  sampling = {0: SamplingParams(seed=11), 2: SamplingParams(seed=12, temperature=0.8)}

  def fresh():
    state = None
    for slot, p in prompts.items():
      state, _ = prefilled(engine, params, p, sampling[slot], slot, state)
    return state

  state, single = fresh(), []
  for _ in range(6):
    state, res = engine.generate(params, state)
    single.append(res.to_host())
  state, res = engine.generate_steps(params, fresh(), 5, remaining=[6, 0, 3, 0])
  assert np.asarray(state.active).tolist() == [True, False, False, False]
  spent, _ = engine.generate_steps(params, fresh(), 5, remaining=[5, 0, 6, 0])
  assert np.asarray(spent.active).tolist() == [False, False, True, False]  # (5 of 5: spent)
  d = np.asarray(res.data)
  assert d.shape == (5, 4, 6)
  for t in range(5):
    h = res.to_host()
    assert h.valid[t].tolist() == [True, False, t < 3, False]
    for slot in (0, 2):
      if h.valid[t, slot]:
        assert (h.tokens[t, slot], h.lengths[t, slot], h.versions[t, slot]) == (
            single[t].tokens[slot], single[t].lengths[slot], 4)
        assert h.logp[t, slot] == pytest.approx(single[t].logp[slot], abs=1e-5)
  state, res = engine.generate(params, state)  # slot 0 goes on where it was
  h = res.to_host()
  assert h.valid.tolist() == [True, False, False, False]
  assert (h.tokens[0], h.lengths[0]) == (single[5].tokens[0], single[5].lengths[0])


def test_verify_emits_accepted_drafts_and_the_corrected_token_as_greedy_decoding(random_params):
  """Greedy drafts: the drafts that match the greedy tokens are emitted, then the greedy
  token at the first mismatch (or one more), each with its position's length and the
  raw log-probs of plain decoding; a slot without drafts emits one token and an empty slot
  none; decoding then goes on from the last emitted token."""
  engine = make_engine(max_seq_len=128, max_prefill_length=64)
  params = engine.load_params(random_params, version=2)
  prompt, greedy = [5, 6, 7, 8], SamplingParams(temperature=0.0)
  toks, _, raw, _ = run_alone(engine, params, prompt, greedy, 10)
  state, first = prefilled(engine, params, prompt, greedy, 1)
  sampled = SamplingParams(seed=8, temperature=1.0)
  plain = run_alone(engine, params, [1, 2], sampled, 4)  # no drafts: generate's own tokens
  state, _ = prefilled(engine, params, [1, 2], sampled, 3, state)
  assert int(first.tokens[0]) == toks[0]
  wrong = (toks[4] + 1) % CFG.vocab_size
  drafts = np.zeros((4, 3), np.int32)
  drafts[1] = [toks[1], toks[2], 0]
  state, res = engine.verify(params, state, drafts, np.array([0, 2, 0, 0]))
  h = res.to_host()
  assert h.valid.sum(1).tolist() == [0, 3, 0, 1]  # slot 3: no drafts, one token
  assert int(h.tokens[3, 0]) == plain[0][1] and int(h.lengths[3, 0]) == 4
  assert h.logp[3, 0] == pytest.approx(plain[1][1], abs=1e-5)
  assert h.tokens[1, :3].tolist() == toks[1:4]
  assert h.lengths[1, :3].tolist() == [len(prompt) + 2, len(prompt) + 3, len(prompt) + 4]
  np.testing.assert_allclose(h.raw_logp[1, :3], raw[1:4], atol=2e-5)
  assert h.logp[1, :3].tolist() == [0.0] * 3 and set(h.versions[1].tolist()) == {2}
  drafts[1] = [wrong, toks[5], toks[6]]
  state, res = engine.verify(params, state, drafts, np.array([0, 3, 0, 0]))
  h = res.to_host()
  assert h.valid[1].tolist() == [True, False, False, False] and h.tokens[1, 0] == toks[4]
  assert h.lengths[1, 0] == len(prompt) + 5
  drafts[1] = [toks[5], wrong, 0]
  state, res = engine.verify(params, state, drafts, np.array([0, 2, 0, 0]))
  h = res.to_host()
  assert h.valid[1].tolist() == [True, True, False, False]
  assert h.tokens[1, :2].tolist() == toks[5:7]
  assert int(state.lengths[1]) == len(prompt) + 6
  state, res = engine.generate(params, state)
  h = res.to_host()
  assert int(h.tokens[1]) == toks[7] and int(h.lengths[1]) == len(prompt) + 8
  assert h.valid.tolist() == [False, True, False, True] and int(h.tokens[3]) == plain[0][4]
  assert h.raw_logp[1] == pytest.approx(raw[7], abs=2e-5)


def test_release_empties_only_the_named_slots(random_params):
  """Released slots are inactive with length 0 and a null page-table row, emit nothing,
  and the other slots decode on as if nothing happened."""
  engine = make_engine(max_seq_len=128, max_prefill_length=64)
  params = engine.load_params(random_params)
  alone = run_alone(engine, params, [7, 7, 7], SamplingParams(seed=3), 4, slot=2)
  state = None
  for slot in range(4):
    state, _ = prefilled(engine, params, [7, 7, 7], SamplingParams(seed=3), slot, state)
  state = engine.release(state, [0, 3])
  assert np.asarray(state.active).tolist() == [False, True, True, False]
  assert np.asarray(state.lengths)[[0, 3]].tolist() == [0, 0]
  assert not np.asarray(state.page_table)[[0, 3]].any()
  assert np.asarray(state.page_table)[[1, 2]].any(axis=1).all()
  got = []
  for _ in range(4):
    state, res = engine.generate(params, state)
    h = res.to_host()
    assert h.valid.tolist() == [False, True, True, False]
    got.append(int(h.tokens[2]))
  assert got == alone[0][1:]


def test_a_seeds_key_is_jax_prngkey_layout_over_all_64_bits():
  """A request's key is `jax.random.PRNGKey(seed)`'s for a 32-bit seed, and every one of a
  seed's 64 bits counts (seeds that differ only in bit 63 have different keys)."""
  from rollout_server.engine import _key, _threefry_keys

  for seed in (0, 5, 12345, (1 << 32) - 1):
    assert np.array_equal(_key(seed), np.asarray(jax.random.PRNGKey(seed))), seed
  keys = {tuple(_key(s).tolist()) for s in (7, 7 + (1 << 32), 7 + (1 << 63), 7 + (1 << 62))}
  assert len(keys) == 4
  assert np.array_equal(_key(-1), _key((1 << 64) - 1))
  if _threefry_keys():
    assert _key(7 + (5 << 32)).tolist() == [5, 7]


def test_a_max_seq_len_that_is_not_whole_pages_still_has_a_page_for_its_last_positions(
    random_params):
  """max_seq_len 40 with 16-token pages: a sequence has 3 pages (the last one partial) and
  decodes past position 32 with exact log-probs."""
  engine = make_engine(max_seq_len=40, max_prefill_length=32, page_size=16)
  assert engine.pages_per_seq == 3 and engine.num_pages == 1 + 4 * 3
  assert [engine.pages_for(n) for n in (1, 16, 17, 32, 33, 40)] == [1, 1, 2, 2, 3, 3]
  assert engine.pad_tokens(list(range(10)), prefix_length=30)[1] == 10  # ends at 40: fits
  with pytest.raises(ValueError, match="prompt of 41 tokens exceeds max_seq_len 40"):
    engine.pad_tokens(list(range(10)), prefix_length=31)  # (a chunk after a long prefix)
  params = engine.load_params(random_params)
  prompt = list(range(3, 33))
  toks, logp, _, _ = run_alone(engine, params, prompt, SamplingParams(seed=1), 7)
  want = teacher_forced(random_params, prompt + toks)[len(prompt):]
  np.testing.assert_allclose(logp, want, atol=2e-5)
  with pytest.raises(ValueError, match="1 pages cannot hold 17 tokens"):
    engine.prefill_many(params=params, decode_state=engine.init_decode_state(),
                        requests=[PrefillRequest(list(range(1, 18)), [1])])
  with pytest.raises(ValueError, match="1 pages cannot hold 18 tokens"):  # 14 in the pool
    engine.prefill_many(params=params, decode_state=engine.init_decode_state(),
                        requests=[PrefillRequest([1, 2, 3, 4], [1], start=14)])


def test_a_prefill_writes_the_kv_of_its_tokens_only(random_params):
  """A prefill writes its prompt's positions into its pages and nothing else: not the
  padding after the prompt, nor anything of the padding rows (into the null page)."""
  engine = make_engine(max_seq_len=128, max_prefill_length=64, prefill_rows=4)
  params = engine.load_params(random_params)
  state, _, _ = engine.prefill_many(params=params, decode_state=engine.init_decode_state(),
                                    requests=[PrefillRequest([5, 6, 7], [2])])
  k, v = np.asarray(state.pages.k), np.asarray(state.pages.v)
  for pool in (k, v):
    assert np.abs(pool[:, 2, :3]).sum(axis=(-1, -2)).all()  # each written position
    assert not pool[:, 2, 3:].any() and not pool[:, 0].any() and not pool[:, 1].any()


def test_a_prompt_that_includes_sampled_tokens_samples_on_as_the_decode_did(random_params):
  """The key of the token at position p is the seed's key folded with p, in prefill as in
  decode: a prompt extended by a request's first sampled tokens (a resumed turn) samples
  the same next tokens, with the same seed, as that request's decode did."""
  engine = make_engine(max_seq_len=128, max_prefill_length=64)
  params = engine.load_params(random_params)
  prompt, sampling = [3, 1, 4, 1, 5], SamplingParams(seed=21, temperature=1.0)
  toks = run_alone(engine, params, prompt, sampling, 6)[0]
  for cut in (1, 3):
    assert run_alone(engine, params, prompt + toks[:cut], sampling, 2)[0] == toks[cut:cut + 3]


def test_the_engines_limits_refuse_one_past_them_and_take_them_exactly(random_params):
  """A prompt of 0 tokens and one of `max_prefill_length + 1`, a page row of
  `pages_per_seq + 1` pages, more requests or insert slots than a prefill call has rows,
  a scored sequence of `max_seq_len + 1` tokens or holding the vocabulary's size as an id,
  and a `max_prefill_length` past `max_seq_len` are refused (each limit itself is taken);
  `prefill_rows` defaults to min(8, slots); the sampling copy is cast to the engine's
  dtype."""
  from rollout_server.engine import Prefix

  engine = make_engine(max_prefill_length=32, max_seq_len=64, page_size=8)
  with pytest.raises(ValueError, match="at least one token"):
    engine.pad_tokens([])
  assert engine.pad_tokens(list(range(32)))[1] == 32
  with pytest.raises(ValueError, match="max_prefill_length 32"):
    engine.pad_tokens(list(range(33)))
  assert engine.page_row(list(range(1, 9))).tolist() == list(range(1, 9))
  with pytest.raises(ValueError, match="9 pages exceed"):
    engine.page_row(list(range(1, 10)))
  rows = engine.rows_for(engine.prefill_bucket(3))
  with pytest.raises(ValueError, match=f"{rows + 1} requests exceed"):
    engine.prefill_many(params=None, decode_state=None,
                        requests=[PrefillRequest([1, 2, 3], [1 + i]) for i in range(rows + 1)])
  two_rows = Prefix(*[np.zeros(2, np.int32)] * len(Prefix._fields))
  with pytest.raises(ValueError, match="3 slots given for 2 prefilled rows"):
    engine.insert_many(two_rows, None, [0, 1, 2])
  params = engine.load_params(random_params)
  with pytest.raises(ValueError, match="more than max_seq_len"):
    engine.score(params, [[1] * 65])
  with pytest.raises(ValueError, match="token ids must be in"):
    engine.score(params, [[1, engine.vocab_size]])
  make_engine(max_prefill_length=64, max_seq_len=64)
  with pytest.raises(ValueError, match="exceeds max_seq_len"):
    make_engine(max_prefill_length=65, max_seq_len=64)
  assert make_engine().prefill_rows == 4
  assert make_engine(max_concurrent_decodes=16).prefill_rows == 8
  half = make_engine(dtype="bfloat16").load_params(random_params)
  assert {x.dtype for x in jax.tree.leaves(half["weights"])} == {jnp.dtype(jnp.bfloat16)}

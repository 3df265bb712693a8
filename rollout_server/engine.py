"""A JetStream-shaped inference engine over the jaxagent decoder, with paged KV on the device.

Same method names and meaning as JetStream's `engine_api.Engine`:
`load_params`, `init_decode_state`, `prefill`, `insert`, `generate`,
`free_resource`, `max_concurrent_decodes`, `max_prefill_length`, `mesh`, with
params and decode state passed explicitly. `ResultTokens` carry log-probs and
the policy version beside the token ids. Extensions the paged KV needs:
`prefill_many(params, decode_state, requests)` writes each prompt's KV into its
pages in the decode state's pool (and returns the state), requests name their
pages and start position, and `release(decode_state, slots)` empties slots.

- The KV lives in one pool of fixed-size pages on the device (`PagedKV`,
  `[layers, num_pages, page_size, kv_heads, head_dim]`, sharded over KV heads);
  each slot has a row of a page table. Which pages a sequence uses is decided on
  the host (`rollout_server.pages`); no KV is copied to the host.
- Attention reads only the pages a sequence uses, in blocks, with an online
  softmax whose loop runs as many blocks as the longest sequence in use needs
  (`Decoder.forward_paged`): a step costs the tokens in use, not the capacity.
  New keys and values are scattered into the pool once per step, in place (the
  state is donated).
- Prefill lengths are bucketed (powers of two) so each bucket compiles once; a
  prefill may start after positions already in the pool (a shared prefix, or
  the earlier chunks of a long prompt). A call has `rows_for(bucket)` rows
  (`prefill_rows` for short prompts, fewer for long ones), padded with rows that
  write nothing: a function of the bucket alone, so a request's log-probs do not
  depend on what is prefilled beside it.
- The decode state is a fixed array of `max_concurrent_decodes` slots, so
  `generate` compiles once; empty slots read no pages and write nothing.
- Sampling is per slot (temperature, top-k, top-p, seed), on the device. The key
  of the token at position p is `fold_in(PRNGKey(seed), p)`, so a request's
  tokens do not depend on which slot it runs in or what runs beside it.
- Each step returns one packed int32 array (`ResultTokens.data`): token id,
  valid, length, log-prob bits, raw log-prob bits, policy version, so the host
  copy is one transfer, which can be started asynchronously
  (`data.copy_to_host_async()`) and read a step later.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxagent.models.config import ModelConfig
from jaxagent.models.llama import PagedKV, write_pages
from jaxagent.models.paged_attention import PAGED_KERNELS, check_triton_shapes, default_kernel
from jaxagent.models.params import abstract_model, bind, param_shardings
from jaxagent.models.sharding import SAMPLE_RULES, Rules, logical_to_spec
from jaxagent.trajectory import SamplingParams  # noqa: F401 (the request contract, re-exported)

# Columns of the packed per-step result.
TOKEN, VALID, LENGTH, LOGP, RAW_LOGP, VERSION = range(6)
NUM_COLUMNS = 6


class ResultTokens(NamedTuple):
  """Packed results of one step: `data[slot] = (token, valid, length, logp bits,
  raw logp bits, version)`; log-probs are float32 bit patterns in int32."""

  data: Any

  def to_host(self) -> "HostResult":
    """Host columns, `[slots]` each (`[slots, K + 1]` for `Engine.verify`'s results)."""
    d = np.asarray(self.data)
    return HostResult(tokens=d[..., TOKEN], valid=d[..., VALID].astype(bool),
                      lengths=d[..., LENGTH], logp=d[..., LOGP].view(np.float32),
                      raw_logp=d[..., RAW_LOGP].view(np.float32), versions=d[..., VERSION])


class HostResult(NamedTuple):
  tokens: np.ndarray
  valid: np.ndarray
  lengths: np.ndarray
  logp: np.ndarray
  raw_logp: np.ndarray
  versions: np.ndarray


class Prefix(NamedTuple):
  """Prefilled requests, one per row (one row from `prefill`): the state each first decode
  step starts from. Their KV is already in the decode state's page pool."""

  token: jax.Array  # [rows] the first sampled token (fed at the next step)
  length: jax.Array  # [rows] tokens in the pool (= position of `token`)
  key: jax.Array  # [rows, 2] the request's base PRNG key
  temperature: jax.Array  # [rows]
  top_p: jax.Array
  top_k: jax.Array
  page_table: jax.Array  # [rows, pages per sequence]


class PrefillRequest(NamedTuple):
  """One row of `prefill_many`: `tokens` at positions `start`, `start + 1`, ... of a
  sequence whose KV lives in `pages` (page j holds positions j*page_size ..); positions
  before `start` are in the pool already (a cached prefix, or earlier chunks)."""

  tokens: Sequence[int]
  pages: Sequence[int]
  start: int = 0
  sampling: SamplingParams = SamplingParams()


class DecodeState(NamedTuple):
  pages: PagedKV  # the KV pool: [layers, num_pages, page_size, kv_heads, head_dim]
  page_table: jax.Array  # [slots, pages per sequence] page ids (0: the null page)
  tokens: jax.Array  # [slots] token to feed at the next step
  lengths: jax.Array  # [slots] its position
  active: jax.Array  # [slots] bool: the slot holds a request
  keys: jax.Array  # [slots, 2]
  temperature: jax.Array  # [slots]
  top_p: jax.Array
  top_k: jax.Array


def bucket(n: int, smallest: int = 16) -> int:
  """The prefill bucket for `n` tokens: the next power of two, at least `smallest`."""
  return max(smallest, 1 << max(0, (int(n) - 1).bit_length()))


def _bits(x):
  return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def _sampling_logits(logits_V: jax.Array, temperature: jax.Array, top_p: jax.Array,
                     top_k: jax.Array, filtered: bool = True):
  """(float32 logits, scaled logits of the sampling distribution with the tokens top-k and
  top-p exclude at -inf, raw log-probs, greedy flag)."""
  logits = logits_V.astype(jnp.float32)
  raw_logp = jax.nn.log_softmax(logits)
  greedy = temperature <= 0.0
  # The top logit is 0 before the division: a tiny temperature (1e-10) sends the others to
  # -inf, not every logit past float32's range (log-probs of +-inf under jit).
  scaled = (logits - jnp.max(logits)) / jnp.where(greedy, 1.0, temperature)
  if filtered:
    order = jnp.sort(scaled)[::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, scaled.shape[0]), scaled.shape[0])
    kth = order[k - 1]
    probs = jax.nn.softmax(jnp.where(order >= kth, order, -jnp.inf))
    # Keep a sorted token if the mass before it is below top_p; the first always is (a
    # top_p below float32's smallest normal reads as 0 on the device: it kept nothing),
    # and every one at top_p 1 (float32's sum reaches 1.0 before the tail: a row asking
    # for no cut, batched beside one that filters, lost up to half its vocabulary's tail,
    # ~1e-7 of its mass: red team 36).
    keep = (((jnp.cumsum(probs) - probs) < top_p) | (top_p >= 1.0)
            | (jnp.arange(order.shape[0]) == 0))
    threshold = jnp.min(jnp.where(keep & (order >= kth), order, jnp.inf))
    scaled = jnp.where(scaled >= threshold, scaled, -jnp.inf)
  return logits, scaled, raw_logp, greedy


def sample_token(logits_V: jax.Array, key: jax.Array, temperature: jax.Array,
                 top_p: jax.Array, top_k: jax.Array, filtered: bool = True):
  """Samples one token; returns (token, log-prob under the sampling distribution,
  log-prob under the raw model).

  The sampling distribution is softmax(logits / temperature) restricted to the
  top-k tokens and then to the smallest set whose probability reaches top_p;
  the returned log-prob is taken from exactly that distribution. Greedy
  (temperature 0) samples from a point mass: log-prob 0.
  """
  logits, scaled, raw_logp, greedy = _sampling_logits(logits_V, temperature, top_p, top_k,
                                                      filtered)
  logp_all = jax.nn.log_softmax(scaled)
  sampled = jax.random.categorical(key, scaled)
  token = jnp.where(greedy, jnp.argmax(logits), sampled).astype(jnp.int32)
  logp = jnp.where(greedy, 0.0, logp_all[token])
  return token, logp, raw_logp[token]


def speculate_row(logits_TxV, drafts_K, n_drafts, key, length, temperature, top_p, top_k):
  """Exact speculative sampling with point-mass drafts (speculative decoding, Leviathan et
  al. 2023; drafts from sibling samples as in Seer) for one sequence.

  `logits_TxV` (T = K + 1) are the model's logits after the fed token at position
  `length` and after each draft; draft j is accepted with probability p_j(draft_j), the
  sampling distribution's probability of it (the draft distribution is a point mass).
  At the first rejection the token is drawn from p with the draft's token removed and
  renormalised (the residual max(p - q, 0)); when all `n_drafts` are accepted one more
  token is drawn from p. Each emitted token is therefore distributed exactly as p, and
  its recorded log-prob is log p(token). Returns (tokens [T], log-probs [T], raw log-probs
  [T], n_out): the first n_out tokens are emitted.
  """
  T = logits_TxV.shape[0]
  K = T - 1
  logits, scaled, raw, greedy = jax.vmap(
      lambda l: _sampling_logits(l, temperature, top_p, top_k))(logits_TxV)
  greedy = greedy[0]
  logp = jax.nn.log_softmax(scaled, axis=-1)
  best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  j = jnp.arange(K)
  p_draft = jnp.where(greedy, (drafts_K == best[:K]).astype(jnp.float32),
                      jnp.exp(logp[j, drafts_K]))
  # The accept draw of the token at position length + 1 + j has a key of its own.
  u = jax.vmap(lambda i: jax.random.uniform(
      jax.random.fold_in(jax.random.fold_in(key, length + 1 + i), 1)))(j)
  accepted = jnp.cumprod((u < p_draft) & (j < n_drafts)).sum().astype(jnp.int32)
  rejected = accepted < n_drafts
  bad = drafts_K[jnp.minimum(accepted, K - 1)]
  final_scaled = jnp.where(rejected & (jnp.arange(scaled.shape[1]) == bad), -jnp.inf,
                           scaled[accepted])
  sampled = jax.random.categorical(jax.random.fold_in(key, length + 1 + accepted), final_scaled)
  final = jnp.where(greedy, best[accepted], sampled).astype(jnp.int32)
  tokens = jnp.concatenate([drafts_K.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])
  tokens = tokens.at[accepted].set(final)
  t = jnp.arange(T)
  token_logp = jnp.where(greedy, 0.0, logp[t, tokens])
  return tokens, token_logp, raw[t, tokens], accepted + 1


def _sample_rows(logits_SxV, keys, temperature, top_p, top_k):
  """Samples every row; skips the sort of top-k/top-p when no row uses them."""
  any_filter = jnp.any((top_k > 0) | (top_p < 1.0))
  plain = jax.vmap(functools.partial(sample_token, filtered=False))
  fancy = jax.vmap(functools.partial(sample_token, filtered=True))
  return jax.lax.cond(any_filter, fancy, plain, logits_SxV, keys, temperature, top_p, top_k)


def _step_key(key, position):
  return jax.random.fold_in(key, position)


def _key(seed: int) -> np.ndarray:
  """The key of a 64-bit `seed` (any integer, read modulo 2**64): `jax.random.PRNGKey`'s
  layout with 64-bit integers on, [high 32 bits, low 32 bits], built on the host (no
  device call per request). Without 64-bit integers `PRNGKey` keeps only the low 32 bits
  (seeds that differ above them sampled the same tokens) and a seed past int64 (a client's,
  past 2**63) raised, failing its whole prefill batch."""
  seed = int(seed) % (1 << 64)
  high, low = seed >> 32, seed & 0xFFFFFFFF
  if _threefry_keys():
    return np.array([high, low], np.uint32)
  key = jax.random.PRNGKey(low)
  return np.asarray(jax.random.fold_in(key, high) if high else key)


@functools.cache
def _threefry_keys() -> bool:
  return np.array_equal(np.asarray(jax.random.PRNGKey(12345)), np.array([0, 12345], np.uint32))


class Engine:
  """JetStream-style engine for the Llama/Qwen2 decoder of `jaxagent.models`, with its KV in
  a paged pool on the device.

  `page_size` tokens per page; `num_pages` pages in the pool (page 0 is the null page;
  default: enough for every slot at `max_seq_len`, plus `extra_pages`, e.g. for a prefix
  cache). `attention_kernel` (`paged_attention.PAGED_KERNELS`, or `auto`:
  `paged_attention.default_kernel()`) reads each row's past: `gather` reads `pages_per_block`
  pages per loop iteration; `triton` is a Pallas kernel for GPUs (on CPU it runs in
  Pallas' interpreter: slow, for tests; refused on TPUs) and needs the KV heads unsplit
  (no `tensor` axis in the engine's mesh).
  """

  def __init__(self, model_cfg: ModelConfig, *, max_concurrent_decodes: int = 8,
               max_prefill_length: int = 512, max_seq_len: int = 1024,
               mesh: Optional[Mesh] = None, rules: Rules = SAMPLE_RULES,
               min_prefill_bucket: int = 16, cache_dtype: Optional[str] = None,
               prefill_rows: Optional[int] = None, page_size: int = 16,
               num_pages: Optional[int] = None, extra_pages: int = 0,
               pages_per_block: int = 8, dtype: Optional[str] = None,
               attention_kernel: str = "auto"):
    if max_prefill_length > max_seq_len:
      raise ValueError(f"max_prefill_length ({max_prefill_length}) exceeds max_seq_len "
                       f"({max_seq_len})")
    if prefill_rows is None:
      prefill_rows = min(8, max_concurrent_decodes)
    if not 1 <= prefill_rows <= max_concurrent_decodes:
      raise ValueError(f"prefill_rows ({prefill_rows}) must be in 1..max_concurrent_decodes "
                       f"({max_concurrent_decodes})")
    if page_size < 1 or pages_per_block < 1:
      raise ValueError("page_size and pages_per_block must be >= 1")
    if dtype is not None:  # the sampling copy's own dtype (e.g. bfloat16 on accelerators)
      model_cfg = dataclasses.replace(model_cfg, dtype=dtype, param_dtype=dtype)
    self.model_cfg = model_cfg
    self._slots = max_concurrent_decodes
    self.prefill_rows = prefill_rows
    self._max_prefill = max_prefill_length
    self.max_seq_len = max_seq_len
    self.min_bucket = min_prefill_bucket
    self.page_size = page_size
    self.pages_per_seq = -(-max_seq_len // page_size)
    self.num_pages = num_pages or (1 + max_concurrent_decodes * self.pages_per_seq + extra_pages)
    self.pages_per_block = pages_per_block
    if attention_kernel == "auto":
      attention_kernel = default_kernel()
    if attention_kernel not in PAGED_KERNELS:
      raise ValueError(f"attention_kernel {attention_kernel!r} is not one of "
                       f"{('auto',) + PAGED_KERNELS}")
    self.prefill_token_budget = max(512, prefill_rows * min_prefill_bucket)
    self._mesh = mesh if mesh is not None else Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1),
                                                    ("data", "fsdp", "tensor"))
    self.rules = rules
    if attention_kernel == "triton":
      check_triton_shapes(page_size, model_cfg.head_dim)
      if jax.default_backend() == "tpu":
        raise ValueError("attention_kernel 'triton' is for GPUs; on TPUs use 'gather'")
      if self._mesh.shape.get("tensor", 1) > 1:
        raise ValueError("attention_kernel 'triton' reads whole KV heads; the engine's mesh "
                         "splits them over its tensor axis (use 'gather')")
    self.attention_kernel = attention_kernel
    # Off a GPU the Triton kernel runs in Pallas' interpreter (tests).
    self._paged = dict(pages_per_block=pages_per_block, paged_kernel=attention_kernel,
                       interpret=attention_kernel == "triton" and jax.default_backend() != "gpu")
    self.cache_dtype = jnp.dtype(cache_dtype or model_cfg.dtype)
    self.graphdef, self.abstract_params = abstract_model(model_cfg)
    self.weight_shardings = param_shardings(model_cfg, self._mesh, rules)
    rep = NamedSharding(self._mesh, P())
    self._replicated = rep
    self._prefill = jax.jit(self._prefill_impl, donate_argnums=(1,))
    self._insert = jax.jit(self._insert_impl, donate_argnums=(1,))
    self._release = jax.jit(self._release_impl, donate_argnums=(0,))
    self._generate = jax.jit(self._generate_impl, donate_argnums=(1,))
    self._generate_steps = jax.jit(self._generate_steps_impl, donate_argnums=(1,),
                                   static_argnums=(3,))
    self._verify = jax.jit(self._verify_impl, donate_argnums=(1,))
    self._score = jax.jit(self._score_impl)

  # -- JetStream properties ----------------------------------------------------------

  @property
  def max_concurrent_decodes(self) -> int:
    return self._slots

  @property
  def max_prefill_length(self) -> int:
    return self._max_prefill

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def mesh(self) -> Mesh:
    return self._mesh

  @property
  def vocab_size(self) -> int:
    return self.model_cfg.vocab_size

  def pages_for(self, n_tokens: int) -> int:
    """Pages that hold `n_tokens` positions."""
    return -(-int(n_tokens) // self.page_size)

  # -- params ---------------------------------------------------------------------------

  def load_params(self, params: Any = None, *, path: Optional[str] = None, version: int = 0):
    """Engine params: weights placed with the sampling shardings, plus the policy version.

    Give host/device `params` (a pure dict), or `path` to a policy export.
    """
    if (params is None) == (path is None):
      raise ValueError("give exactly one of params or path")
    if path is not None:
      from jaxagent.checkpoint import abstract_params_like, load_policy
      from flax import nnx

      shapes = nnx.to_pure_dict(self.abstract_params)
      weights = load_policy(path, abstract_params_like(shapes, self.weight_shardings))
    else:
      weights = jax.device_put(params, self.weight_shardings)
    dtype = jnp.dtype(self.model_cfg.param_dtype)
    weights = jax.tree.map(lambda x: x.astype(dtype) if x.dtype != dtype else x, weights)
    return {"weights": weights, "version": jax.device_put(jnp.int32(version), self._replicated)}

  # -- decode state -----------------------------------------------------------------------

  def init_decode_state(self) -> DecodeState:
    """Empty slots and an empty page pool, created on the mesh: the pool split over KV
    heads (`tensor`), the small per-slot arrays replicated."""
    S, cfg = self._slots, self.model_cfg
    shape = (cfg.n_layers, self.num_pages, self.page_size, cfg.n_kv_heads, cfg.head_dim)
    spec = logical_to_spec(("layers", None, None, "kv_heads", "head_dim"), self.rules,
                           self._mesh, shape)
    pool = NamedSharding(self._mesh, spec)
    rep = self._replicated
    shardings = DecodeState(PagedKV(pool, pool), rep, rep, rep, rep, rep, rep, rep, rep)
    zeros = functools.partial(jnp.zeros, dtype=jnp.int32)

    def init():
      return DecodeState(
          pages=PagedKV(jnp.zeros(shape, self.cache_dtype), jnp.zeros(shape, self.cache_dtype)),
          page_table=zeros((S, self.pages_per_seq)), tokens=zeros((S,)), lengths=zeros((S,)),
          active=jnp.zeros((S,), bool), keys=jnp.zeros((S, 2), jnp.uint32),
          temperature=jnp.ones((S,), jnp.float32), top_p=jnp.ones((S,), jnp.float32),
          top_k=zeros((S,)))

    return jax.jit(init, out_shardings=shardings)()

  def _release_impl(self, state: DecodeState, slots):
    put = lambda a, x: a.at[slots].set(x, mode="drop")
    # (and sampling that filters nothing: an empty slot's old top-p or top-k made every
    # later step of every row pay the vocabulary's sort until the slot was taken again)
    return state._replace(active=put(state.active, False), lengths=put(state.lengths, 0),
                          page_table=put(state.page_table, 0),
                          top_p=put(state.top_p, 1.0), top_k=put(state.top_k, 0))

  def release(self, decode_state: DecodeState, slots: Sequence[int]) -> DecodeState:
    """Empties decode slots (donates `decode_state`); their pages go back to whoever
    allocated them (the orchestrator's allocator). An extension of JetStream's
    `free_resource`, which has no decode state to update."""
    idx = np.full(self._slots, self._slots, np.int32)
    idx[:len(slots)] = slots
    return self._release(decode_state, idx)

  def free_resource(self, slot: int) -> None:
    """JetStream's hook: nothing to do here (see `release`)."""
    del slot

  # -- prefill --------------------------------------------------------------------------

  def prefill_bucket(self, n: int, prefix_length: int = 0) -> int:
    """The padded length of a prefill of `n` tokens after `prefix_length` ones already in
    the sequence's pages; raises for a prefill that cannot be done. One call prefills at
    most `max_prefill_length` tokens; a sequence may reach `max_seq_len` (a prompt is
    limited by the orchestrator, which lets a resumed turn's prompt run past
    `max_prefill_length`)."""
    if n < 1:
      raise ValueError("a prompt needs at least one token")
    if n > self._max_prefill:
      raise ValueError(f"a prefill of {n} tokens exceeds max_prefill_length "
                       f"{self._max_prefill}")
    if prefix_length + n > self.max_seq_len:
      raise ValueError(f"prompt of {prefix_length + n} tokens exceeds max_seq_len "
                       f"{self.max_seq_len}")
    return min(bucket(n, self.min_bucket), bucket(self._max_prefill, self.min_bucket))

  def pad_tokens(self, tokens: Sequence[int], prefix_length: int = 0) -> tuple[np.ndarray, int]:
    """Pads prompt tokens to their bucket; returns (padded, true_length)."""
    n = len(tokens)
    out = np.zeros(self.prefill_bucket(n, prefix_length), np.int32)
    out[:n] = tokens
    return out, n

  def _prefill_impl(self, params, state: DecodeState, tokens, start, true_length, page_table,
                    keys, temperature, top_p, top_k):
    B, T = tokens.shape
    model = bind(self.graphdef, self.abstract_params, params["weights"])
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    valid = jnp.arange(T)[None, :] < true_length[:, None]
    h, new_k, new_v = model.hidden_states_paged(tokens, positions, start, state.pages,
                                                page_table, **self._paged)
    pages = write_pages(state.pages, new_k, new_v, page_table, positions, valid)
    last = model.logits(h[jnp.arange(B), true_length - 1][:, None])[:, 0]
    length = start + true_length
    step_keys = jax.vmap(_step_key)(keys, length)
    token, logp, raw = _sample_rows(last, step_keys, temperature, top_p, top_k)
    prefix = Prefix(token=token, length=length, key=keys, temperature=temperature, top_p=top_p,
                    top_k=top_k, page_table=page_table)
    data = jnp.stack([token, jnp.ones((B,), jnp.int32), length + 1, _bits(logp), _bits(raw),
                      jnp.broadcast_to(params["version"], (B,))], axis=1)
    return state._replace(pages=pages), prefix, ResultTokens(data)

  def rows_for(self, bucket_len: int) -> int:
    """Rows of a prefill call of bucket length `bucket_len`: `prefill_rows` for short
    prompts, fewer for long ones, so that a call computes about `prefill_token_budget`
    padded tokens. A function of the bucket alone, so a request's numbers never depend on what
    is prefilled beside it."""
    return max(1, min(self.prefill_rows, self.prefill_token_budget // bucket_len))

  def page_row(self, pages: Sequence[int]) -> np.ndarray:
    """A page-table row: the sequence's page ids, the null page after them."""
    if len(pages) > self.pages_per_seq:
      raise ValueError(f"{len(pages)} pages exceed a sequence's {self.pages_per_seq} "
                       f"(max_seq_len {self.max_seq_len})")
    row = np.zeros(self.pages_per_seq, np.int32)
    row[:len(pages)] = pages
    return row

  def prefill(self, *, params, decode_state: DecodeState, pages: Sequence[int],
              padded_tokens: np.ndarray, true_length: int, start: int = 0,
              sampling: SamplingParams = SamplingParams()
              ) -> tuple[DecodeState, Prefix, ResultTokens]:
    """Computes the KV of a prompt's tokens (after `start` already in `pages`) into the
    pool and samples the next token."""
    tokens = np.asarray(padded_tokens)[:int(true_length)]
    return self.prefill_many(params=params, decode_state=decode_state,
                             requests=[PrefillRequest(tokens, pages, start, sampling)])

  def prefill_many(self, *, params, decode_state: DecodeState,
                   requests: Sequence[PrefillRequest]
                   ) -> tuple[DecodeState, Prefix, ResultTokens]:
    """Prefills up to `prefill_rows` requests in one call (donates `decode_state`): their
    KV goes into the pool at their pages, row i of the results is request i (rows past
    `len(requests)` are padding). Tokens are padded to the longest request's bucket, so
    group requests of one bucket. An extension of JetStream's `prefill`, which returns
    the KV instead of writing it into a pool."""
    if not requests:
      raise ValueError("prefill_many needs at least one request")
    padded = [self.pad_tokens(r.tokens, prefix_length=r.start) for r in requests]
    T = max(len(p) for p, _ in padded)
    rows = self.rows_for(T)
    if len(requests) > rows:
      raise ValueError(f"{len(requests)} requests exceed the {rows} rows of a {T}-token "
                       f"prefill (prefill_rows {self.prefill_rows})")
    tokens = np.zeros((rows, T), np.int32)
    true_length = np.ones(rows, np.int32)
    start = np.zeros(rows, np.int32)
    table = np.zeros((rows, self.pages_per_seq), np.int32)
    for i, ((p, n), r) in enumerate(zip(padded, requests)):
      if self.pages_for(r.start + n) > len(r.pages):
        raise ValueError(f"request {i}: {len(r.pages)} pages cannot hold {r.start + n} tokens")
      tokens[i, :n], true_length[i], start[i] = p[:n], n, r.start
      table[i] = self.page_row(r.pages)
    true_length[len(requests):] = 0  # padding rows write nothing
    sampling = [r.sampling for r in requests] + [SamplingParams()] * (rows - len(requests))
    keys = np.stack([_key(s.seed) for s in sampling])
    return self._prefill(params, decode_state, tokens, start, np.maximum(true_length, 0), table,
                         keys, np.array([s.temperature for s in sampling], np.float32),
                         np.array([s.top_p for s in sampling], np.float32),
                         np.array([s.top_k for s in sampling], np.int32))

  # -- insert / generate ----------------------------------------------------------------

  def _insert_impl(self, prefix: Prefix, state: DecodeState, slots):
    # Padding rows carry slot index `slots` (out of range): their writes are dropped.
    put = lambda a, x: a.at[slots].set(x, mode="drop")
    return state._replace(
        page_table=put(state.page_table, prefix.page_table), tokens=put(state.tokens, prefix.token),
        lengths=put(state.lengths, prefix.length), active=put(state.active, True),
        keys=put(state.keys, prefix.key), temperature=put(state.temperature, prefix.temperature),
        top_p=put(state.top_p, prefix.top_p), top_k=put(state.top_k, prefix.top_k))

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
    """Moves a prefilled request into decode slot `slot` (donates `decode_state`)."""
    return self.insert_many(prefix, decode_state, [slot])

  def insert_many(self, prefix: Prefix, decode_state: DecodeState,
                  slots: Sequence[Optional[int]]) -> DecodeState:
    """Moves row i of `prefix` into decode slot `slots[i]`; rows whose slot is None or
    past `len(slots)` are not inserted (donates `decode_state`)."""
    rows = int(prefix.token.shape[0])
    if len(slots) > rows:
      raise ValueError(f"{len(slots)} slots given for {rows} prefilled rows")
    idx = np.full(rows, self._slots, np.int32)
    for i, slot in enumerate(slots):
      if slot is not None:
        idx[i] = slot
    return self._insert(prefix, decode_state, idx)

  def _generate_impl(self, params, state: DecodeState):
    model = bind(self.graphdef, self.abstract_params, params["weights"])
    past = jnp.where(state.active, state.lengths, 0)  # empty slots read no pages
    logits, new_k, new_v = model.forward_paged(
        state.tokens[:, None], state.lengths[:, None], past, state.pages, state.page_table,
        **self._paged)
    pages = write_pages(state.pages, new_k, new_v, state.page_table, state.lengths[:, None],
                        state.active[:, None])
    lengths = jnp.where(state.active, jnp.minimum(state.lengths + 1, self.max_seq_len - 1),
                        state.lengths)
    keys = jax.vmap(_step_key)(state.keys, lengths)
    tokens, logp, raw = _sample_rows(logits[:, 0], keys, state.temperature, state.top_p,
                                     state.top_k)
    data = jnp.stack([tokens, state.active.astype(jnp.int32), lengths + 1, _bits(logp),
                      _bits(raw), jnp.broadcast_to(params["version"], tokens.shape)], axis=1)
    return state._replace(pages=pages, tokens=tokens, lengths=lengths), ResultTokens(data)

  def _generate_steps_impl(self, params, state: DecodeState, remaining, n: int):
    """`n` decode steps in one call (a `lax.scan` of `_generate_impl`); a slot stops
    (becomes inactive) after `remaining[slot]` of them."""
    def body(st, i):
      go = st.active & (i < remaining)
      st, result = self._generate_impl(params, st._replace(active=go))
      return st._replace(active=state.active), result.data

    state, data = jax.lax.scan(body, state, jnp.arange(n, dtype=jnp.int32))
    return state._replace(active=state.active & (remaining > n)), ResultTokens(data)

  def _verify_impl(self, params, state: DecodeState, drafts, n_drafts):
    S, K = drafts.shape
    model = bind(self.graphdef, self.abstract_params, params["weights"])
    tokens_in = jnp.concatenate([state.tokens[:, None], drafts], axis=1)
    positions = state.lengths[:, None] + jnp.arange(K + 1, dtype=jnp.int32)[None, :]
    past = jnp.where(state.active, state.lengths, 0)
    logits, new_k, new_v = model.forward_paged(tokens_in, positions, past, state.pages,
                                               state.page_table, **self._paged)
    valid = state.active[:, None] & (jnp.arange(K + 1)[None, :] <= n_drafts[:, None])
    pages = write_pages(state.pages, new_k, new_v, state.page_table, positions, valid)
    tokens, logp, raw, n_out = jax.vmap(speculate_row)(
        logits, drafts, n_drafts, state.keys, state.lengths, state.temperature, state.top_p,
        state.top_k)
    n_out = jnp.where(state.active, n_out, 0)
    lengths = jnp.where(state.active,
                        jnp.minimum(state.lengths + n_out, self.max_seq_len - 1), state.lengths)
    last = tokens[jnp.arange(S), jnp.maximum(n_out - 1, 0)]
    emitted = (jnp.arange(K + 1)[None, :] < n_out[:, None]).astype(jnp.int32)
    data = jnp.stack([tokens, emitted, positions + 2, _bits(logp), _bits(raw),
                      jnp.broadcast_to(params["version"], tokens.shape)], axis=-1)
    return state._replace(pages=pages, tokens=jnp.where(state.active, last, state.tokens),
                          lengths=lengths), ResultTokens(data)

  def verify(self, params, decode_state: DecodeState, drafts: np.ndarray,
             n_drafts: np.ndarray) -> tuple[DecodeState, ResultTokens]:
    """A decode step that also checks up to K draft tokens per slot in the same forward
    pass (`drafts` `[slots, K]`, `n_drafts` `[slots]`; donates `decode_state`): each slot
    emits its accepted drafts and one more token (`speculate_row`), all distributed
    exactly as `generate`'s. The result's data is `[slots, K + 1, columns]`; column VALID
    marks the emitted tokens. An extension of JetStream's API."""
    return self._verify(params, decode_state, np.asarray(drafts, np.int32),
                        np.asarray(n_drafts, np.int32))

  def generate(self, params, decode_state: DecodeState) -> tuple[DecodeState, ResultTokens]:
    """One decode step for every active slot (donates `decode_state`). Its cost follows
    the longest sequence in use, not the pool's size."""
    return self._generate(params, decode_state)

  def generate_steps(self, params, decode_state: DecodeState, steps: int,
                     remaining: Optional[Sequence[int]] = None
                     ) -> tuple[DecodeState, ResultTokens]:
    """`steps` decode steps in one device call (donates `decode_state`): the same tokens,
    log-probs and keys as `steps` calls of `generate`, without a dispatch (and a host
    round trip) per token. Slot i takes part in its first `remaining[i]` steps (default:
    all) and is released after them; its other rows of the result have VALID 0. The
    result's data is `[steps, slots, columns]`. An extension of JetStream's API."""
    if remaining is None:
      remaining = np.full(self._slots, steps, np.int32)
    return self._generate_steps(params, decode_state, np.asarray(remaining, np.int32), steps)

  # -- scoring ------------------------------------------------------------------------

  def _score_impl(self, params, tokens, segment_ids, temperature):
    from jaxagent import losses

    model = bind(self.graphdef, self.abstract_params, params["weights"])
    positions = jnp.maximum(jnp.cumsum(segment_ids > 0, axis=1) - 1, 0).astype(jnp.int32)
    hidden, _ = model.hidden_states(tokens, positions, segment_ids)
    logp, _ = losses.chunked_token_logp_and_entropy(
        hidden, model.head_matrix(), losses.shifted_targets(tokens), temperature)
    return losses.align_to_tokens(logp)

  def score(self, params, sequences: Sequence[Sequence[int]], temperature: float = 1.0,
            rows: int = 8) -> list[np.ndarray]:
    """The log-prob of every token of each sequence given the tokens before it (0 for the
    first), under `params` at `temperature`: one forward pass, no KV kept (what a
    reference, a teacher or a judge of sampled tokens needs). Sequences are scored
    `rows` at a time, padded to a bucketed length, each alone in its row, so a
    sequence's log-probs do not depend on what is scored beside it. An extension of
    JetStream's API."""
    if not np.finfo(np.float32).tiny <= temperature < float("inf"):  # (float32 reads
      # a smaller one as 0: every log-prob nan)
      raise ValueError(f"temperature must be a finite float32 number >= "
                       f"{np.finfo(np.float32).tiny:.3g}, got {temperature}")
    out: list[np.ndarray] = []
    for i in range(0, len(sequences), rows):
      chunk = [np.asarray(s, np.int32) for s in sequences[i:i + rows]]
      T = bucket(max(max(len(s) for s in chunk), 1), self.min_bucket)
      tokens = np.zeros((rows, T), np.int32)
      segment_ids = np.zeros((rows, T), np.int32)
      for r, s in enumerate(chunk):
        if len(s) > self.max_seq_len:
          raise ValueError(f"sequence {i + r}: {len(s)} tokens, more than max_seq_len "
                           f"({self.max_seq_len})")
        if len(s) and (s.min() < 0 or s.max() >= self.vocab_size):
          raise ValueError(f"sequence {i + r}: token ids must be in [0, {self.vocab_size})")
        tokens[r, :len(s)] = s
        segment_ids[r, :len(s)] = 1
      logp = np.asarray(self._score(params, tokens, segment_ids, jnp.float32(temperature)))
      out += [logp[r, :len(s)].copy() for r, s in enumerate(chunk)]
    return out

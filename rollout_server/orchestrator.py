"""Continuous batching over the engine: a queue, decode slots, abort and weight swaps.

One background thread owns the engine. Requests queue; a free slot takes the
next request (prefill, reusing the prefix cache, then insert); all live slots
decode together, one `generate` per step; a finished request frees its slot at
once. Other threads talk to the loop through thread-safe calls: `submit`,
`abort`, `update_weights`, `stats`.

Weight updates pause admission, then either let in-flight requests finish
(`drain`) or abort them (`abort`: partial outputs are returned with finish
reason `abort` and can be resumed with `continuation`), drop the prefix cache
(its KV belongs to the old weights), swap the params and resume. Every token
records the policy version of the params that produced it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
import traceback
import uuid
from typing import Any, Callable, Optional, Sequence


from rollout_server.engine import Engine, ExistingPrefix, PrefillRequest, SamplingParams
from rollout_server.prefix_cache import PrefixCache

FINISH_REASONS = ("stop", "length", "abort", "error")


class QueueFull(RuntimeError):
  pass


@dataclasses.dataclass
class Request:
  """One generation request and, as it runs, its outputs (token-exact)."""

  prompt_ids: list[int]
  sampling: SamplingParams
  request_id: str
  session_id: Optional[str] = None
  output_ids: list[int] = dataclasses.field(default_factory=list)
  output_logprobs: list[float] = dataclasses.field(default_factory=list)
  raw_logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  finish_reason: Optional[str] = None
  error: Optional[str] = None
  prefix_hit_tokens: int = 0
  submitted_at: float = dataclasses.field(default_factory=time.perf_counter)
  first_token_at: Optional[float] = None
  finished_at: Optional[float] = None
  _done: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)
  _listeners: list = dataclasses.field(default_factory=list, repr=False)

  @property
  def done(self) -> bool:
    return self._done.is_set()

  def wait(self, timeout: Optional[float] = None) -> bool:
    return self._done.wait(timeout)

  def add_listener(self, fn: Callable[["Request", int], None]) -> None:
    """`fn(request, n_tokens)` runs on the engine thread after new tokens and at the end."""
    self._listeners.append(fn)

  @property
  def ttft_s(self) -> Optional[float]:
    return None if self.first_token_at is None else self.first_token_at - self.submitted_at

  def result(self) -> dict:
    return {
        "request_id": self.request_id, "prompt_ids": list(self.prompt_ids),
        "output_ids": list(self.output_ids), "output_logprobs": list(self.output_logprobs),
        "raw_logprobs": list(self.raw_logprobs), "versions": list(self.versions),
        "finish_reason": self.finish_reason, "error": self.error,
        "prefix_hit_tokens": self.prefix_hit_tokens,
        "ttft_s": self.ttft_s, "sampling": dataclasses.asdict(self.sampling),
    }


def continuation(req: Request) -> tuple[list[int], SamplingParams]:
  """Prompt and sampling to resume an aborted request where it stopped."""
  left = max(1, req.sampling.max_new_tokens - len(req.output_ids))
  return (list(req.prompt_ids) + list(req.output_ids),
          dataclasses.replace(req.sampling, max_new_tokens=left))


@dataclasses.dataclass
class _Update:
  params: Any
  version: int
  mode: str
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  report: dict = dataclasses.field(default_factory=dict)
  paused_at: Optional[float] = None


class Orchestrator:
  """Runs the engine loop in a thread and serves requests to other threads."""

  def __init__(self, engine: Engine, params: Any, *,
               prefix_cache: Optional[PrefixCache] = None, max_queue: int = 4096,
               cache_finished: bool = True):
    self.engine = engine
    self.params = params
    self.version = int(params["version"])
    self.prefix_cache = prefix_cache
    self.cache_finished = cache_finished
    self.max_queue = max_queue
    self._state = engine.init_decode_state()
    self._slots: list[Optional[Request]] = [None] * engine.max_concurrent_decodes
    self._queue: collections.deque[Request] = collections.deque()
    self._requests: dict[str, Request] = {}
    self._aborts: set[str] = set()
    self._update: Optional[_Update] = None
    self._cv = threading.Condition()
    self._stop = False
    self._thread: Optional[threading.Thread] = None
    self._ids = itertools.count()
    self._recent = collections.deque(maxlen=256)  # (time, tokens) per step
    self.tokens_generated = 0
    self.prefill_tokens = 0  # prompt tokens actually computed (prefix-cache hits excluded)
    self.prefill_calls = 0
    self.requests_finished = 0
    self.steps = 0
    self.last_swap: Optional[dict] = None
    self.loop_errors = 0

  # -- lifecycle -----------------------------------------------------------------------

  def start(self) -> "Orchestrator":
    if self._thread is None:
      self._thread = threading.Thread(target=self._run, name="orchestrator", daemon=True)
      self._thread.start()
    return self

  def stop(self) -> None:
    with self._cv:
      self._stop = True
      self._cv.notify_all()
    if self._thread is not None:
      self._thread.join(timeout=30)
      self._thread = None
    for req in list(self._requests.values()):
      self._finish(req, "abort")

  # -- client API (any thread) ---------------------------------------------------------

  def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams(),
             request_id: Optional[str] = None, session_id: Optional[str] = None) -> Request:
    """Queues a request; raises ValueError for a bad request and QueueFull when full."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
      raise ValueError("prompt_ids must not be empty")
    vocab = self.engine.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
      raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    if len(prompt) > self.engine.max_prefill_length:
      raise ValueError(f"prompt has {len(prompt)} tokens; the limit (max_prefill_length) is "
                       f"{self.engine.max_prefill_length}")
    sampling.validate(vocab)
    with self._cv:
      if self._stop:
        raise RuntimeError("the orchestrator is stopped")
      if len(self._queue) >= self.max_queue:
        raise QueueFull(f"queue is full ({self.max_queue} requests)")
      rid = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
      if rid in self._requests:
        raise ValueError(f"request id {rid!r} is already in flight")
      req = Request(prompt, sampling, rid, session_id)
      self._requests[rid] = req
      self._queue.append(req)
      self._cv.notify_all()
    return req

  def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams(),
               timeout: Optional[float] = None, **kwargs) -> Request:
    """Submits and waits for the result."""
    req = self.submit(prompt_ids, sampling, **kwargs)
    if not req.wait(timeout):
      self.abort(req.request_id)
      req.wait(10)
    return req

  def abort(self, request_id: str) -> bool:
    """Aborts a queued or running request; it finishes with what it generated so far."""
    with self._cv:
      if request_id not in self._requests:
        return False
      self._aborts.add(request_id)
      self._cv.notify_all()
    return True

  def update_weights(self, params: Any, mode: str = "drain",
                     timeout: Optional[float] = 600) -> dict:
    """Swaps in new engine params (from `engine.load_params`, which carry the version).

    mode `drain`: running requests finish on the old weights first; `abort`:
    they are aborted and returned partial. Queued requests wait and run on the
    new weights. Returns timings in seconds.
    """
    if mode not in ("drain", "abort"):
      raise ValueError(f"update mode must be 'drain' or 'abort', got {mode!r}")
    upd = _Update(params, int(params["version"]), mode)
    with self._cv:
      if self._update is not None:
        raise RuntimeError("a weight update is already in progress")
      self._update = upd
      self._cv.notify_all()
    if not upd.done.wait(timeout):
      raise TimeoutError("weight update did not complete in time")
    return upd.report

  def stats(self) -> dict:
    with self._cv:
      live = sum(r is not None for r in self._slots)
      queued = len(self._queue)
    now = time.perf_counter()
    window = [(t, n) for t, n in list(self._recent) if now - t <= 10.0]
    tps = 0.0
    if len(window) >= 2:
      tps = sum(n for _, n in window[1:]) / max(window[-1][0] - window[0][0], 1e-9)
    out = {"queue": queued, "live_slots": live, "slots": len(self._slots),
           "tokens_generated": self.tokens_generated, "tokens_per_s": tps,
           "requests_finished": self.requests_finished, "steps": self.steps,
           "prefill_tokens": self.prefill_tokens, "prefill_calls": self.prefill_calls,
           "version": self.version, "loop_errors": self.loop_errors,
           "last_swap": self.last_swap}
    if self.prefix_cache is not None:
      out["prefix_cache"] = self.prefix_cache.stats()
    return out

  # -- engine loop ----------------------------------------------------------------------

  def _run(self) -> None:
    while True:
      with self._cv:
        while not self._stop and not self._has_work():
          self._cv.wait(timeout=0.5)
        if self._stop:
          return
      try:
        self._process_aborts()
        self._process_update()
        self._admit()
        if any(r is not None for r in self._slots):
          self._step()
      except Exception:  # the loop never dies: fail the live requests and go on
        self.loop_errors += 1
        msg = traceback.format_exc(limit=3)
        for slot, req in enumerate(self._slots):
          if req is not None:
            self._slots[slot] = None
            self._finish(req, "error", error=msg)
        self._state = self.engine.init_decode_state()

  def _has_work(self) -> bool:
    admit = bool(self._queue) and self._update is None
    return admit or bool(self._aborts) or self._update is not None or any(
        r is not None for r in self._slots)

  def _process_aborts(self) -> None:
    with self._cv:
      aborts, self._aborts = self._aborts, set()
      if not aborts:
        return
      queued = [r for r in self._queue if r.request_id in aborts]
      for r in queued:
        self._queue.remove(r)
    for r in queued:
      self._finish(r, "abort")
    for slot, req in enumerate(self._slots):
      if req is not None and req.request_id in aborts:
        self._slots[slot] = None
        self._finish(req, "abort")

  def _process_update(self) -> None:
    upd = self._update
    if upd is None:
      return
    if upd.paused_at is None:
      upd.paused_at = time.perf_counter()
      upd.report["in_flight"] = sum(r is not None for r in self._slots)
      if upd.mode == "abort":
        for slot, req in enumerate(self._slots):
          if req is not None:
            self._slots[slot] = None
            self._finish(req, "abort")
    if any(r is not None for r in self._slots):
      return  # draining: keep decoding until the running requests finish
    t0 = time.perf_counter()
    self.params = upd.params
    self.version = upd.version
    if self.prefix_cache is not None:
      self.prefix_cache.clear()
    now = time.perf_counter()
    upd.report.update(version=upd.version, mode=upd.mode, swap_s=now - t0,
                      paused_s=now - upd.paused_at)
    self.last_swap = dict(upd.report)
    with self._cv:
      self._update = None
      self._cv.notify_all()
    upd.done.set()

  def _admit(self) -> None:
    """Prefills queued requests into the free slots, those of one length bucket together."""
    if self._update is not None:
      return
    free = [i for i, r in enumerate(self._slots) if r is None]
    with self._cv:
      reqs = [self._queue.popleft() for _ in range(min(len(free), len(self._queue)))]
    groups: dict[tuple[int, bool], list] = {}
    seen, later = set(), []
    for req in reqs:
      try:
        item = self._prepare(req)
        m = item.existing_prefix.length if item.existing_prefix is not None else 0
        key = (self.engine.prefill_bucket(len(item.tokens), m), m > 0)  # raises if too long
      except Exception as e:  # a bad request fails alone
        self._finish(req, "error", error=f"{type(e).__name__}: {e}")
        continue
      if self.prefix_cache is not None and len(item.tokens) > 1:
        # Samples of one prompt (a GRPO group) wait one round: then the prompt's KV is
        # cached by the first and each of them prefills a single token.
        prompt_key = tuple(req.prompt_ids)
        if prompt_key in seen:
          later.append(req)
          continue
        seen.add(prompt_key)
      groups.setdefault(key, []).append((req, item))
    if later:
      with self._cv:
        self._queue.extendleft(reversed(later))
    rows = self.engine.prefill_rows
    for same in groups.values():
      for group in (same[i:i + rows] for i in range(0, len(same), rows)):
        slots, free = free[:len(group)], free[len(group):]
        try:
          self._prefill_into(group, slots)
        except Exception as e:
          for req, _ in group:
            self._finish(req, "error", error=f"{type(e).__name__}: {e}")

  def _prepare(self, req: Request) -> PrefillRequest:
    """The request's prefill: its prompt after the longest cached prefix."""
    prompt = req.prompt_ids
    existing = None
    if self.prefix_cache is not None:
      # Reuse at most all but the last prompt token: its logits give the first sample.
      m, k, v = self.prefix_cache.match(prompt, max_length=len(prompt) - 1)
      if m:
        existing = ExistingPrefix(k, v)
        req.prefix_hit_tokens = m
    m = existing.length if existing is not None else 0
    return PrefillRequest(prompt[m:], existing, req.sampling)

  def _prefill_into(self, group: list, slots: list[int]) -> None:
    prefix, result = self.engine.prefill_many(params=self.params,
                                              requests=[item for _, item in group])
    self.prefill_tokens += sum(len(item.tokens) for _, item in group)
    self.prefill_calls += 1
    self._state = self.engine.insert_many(prefix, self._state, slots)
    if self.prefix_cache is not None:
      for (req, _), (k, v) in zip(group, self.engine.prefix_kv(
          prefix, [len(req.prompt_ids) for req, _ in group])):
        self.prefix_cache.insert(req.prompt_ids, k, v)
    h = result.to_host()
    for i, ((req, _), slot) in enumerate(zip(group, slots)):
      self._slots[slot] = req
      self._emit(req, slot, int(h.tokens[i]), float(h.logp[i]), float(h.raw_logp[i]),
                 int(h.versions[i]), int(h.lengths[i]))

  def _step(self) -> None:
    self._state, result = self.engine.generate(self.params, self._state)
    h = result.to_host()
    self.steps += 1
    n = 0
    for slot, req in enumerate(self._slots):
      if req is None:
        continue
      n += 1
      self._emit(req, slot, int(h.tokens[slot]), float(h.logp[slot]), float(h.raw_logp[slot]),
                 int(h.versions[slot]), int(h.lengths[slot]))
    self._recent.append((time.perf_counter(), n))

  def _emit(self, req: Request, slot: int, token: int, logp: float, raw: float, version: int,
            length: int) -> None:
    if req.first_token_at is None:
      req.first_token_at = time.perf_counter()
    req.output_ids.append(token)
    req.output_logprobs.append(logp)
    req.raw_logprobs.append(raw)
    req.versions.append(version)
    self.tokens_generated += 1
    reason = None
    if token in req.sampling.stop_token_ids:
      reason = "stop"
    elif len(req.output_ids) >= req.sampling.max_new_tokens or length >= self.engine.max_seq_len:
      reason = "length"
    if reason is None:
      for fn in req._listeners:
        fn(req, len(req.output_ids))
      return
    self._slots[slot] = None
    self.engine.free_resource(slot)
    if self.prefix_cache is not None and self.cache_finished and len(req.output_ids) > 1:
      # KV exists for every token but the last sampled one (never fed back); a request
      # that ends at its first token adds nothing the prefill did not cache.
      seq = req.prompt_ids + req.output_ids[:-1]
      k, v = self.engine.slot_kv(self._state, slot, len(seq))
      self.prefix_cache.insert(seq, k, v)
    self._finish(req, reason)

  def _finish(self, req: Request, reason: str, error: Optional[str] = None) -> None:
    if req.done:
      return
    req.finish_reason = reason
    req.error = error
    req.finished_at = time.perf_counter()
    with self._cv:
      self._requests.pop(req.request_id, None)
    self.requests_finished += 1
    req._done.set()
    for fn in req._listeners:
      fn(req, len(req.output_ids))

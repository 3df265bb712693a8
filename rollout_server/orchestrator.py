"""Continuous batching over the engine: a queue, decode slots, paged KV, abort and weight swaps.

One background thread owns the engine. Requests queue; a request is admitted
when a slot and the KV pages for its whole length are free (its cached prefix's
pages are shared, not copied: `rollout_server.pages`); its prompt is prefilled
in chunks of at most `prefill_chunk` tokens, one prefill call between decode
steps, so a long prompt never stalls the running requests for long; then it
decodes with the others, one `generate` per step. Results come back
asynchronously: each step's packed result is copied to the host while the next
step runs, and the host reads it one step behind, so no decode step waits on
the host. A request that finished at step t has one more token computed and
discarded. A finished request frees its slot and pages at once.

Other threads talk to the loop through thread-safe calls: `submit`, `abort`,
`update_weights`, `stats`.

Weight updates pause admission, then either let in-flight requests finish
(`drain`) or abort them (`abort`: partial outputs are returned with finish
reason `abort` and can be resumed with `continuation`), drop the prefix cache
(its KV belongs to the old weights), swap the params and resume. Every token
records the policy version of the params that produced it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import hashlib
import itertools
import logging
import threading
import time
import traceback
import uuid
from typing import Any, Callable, Optional, Sequence

import numpy as np


from jaxagent.errors import PROMPT_TOO_LONG
from rollout_server.engine import Engine, HostResult, PrefillRequest, SamplingParams
from rollout_server.pages import OutOfPages, PageAllocator, PagedPrefixCache

log = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "abort", "error")


class QueueFull(RuntimeError):
  pass


# What every refusal and failure for a dead engine loop says (a client over HTTP tells
# it from a full queue by it).
ENGINE_DEAD = "the engine loop died"


class EngineDead(QueueFull):
  """The engine loop died (its recovery from an error failed): every request fails at
  once (a 503) and /health says so, instead of waiting for ever on a loop that is gone
  (a reviewer)."""


class PromptTooLong(ValueError):
  """A prompt longer than the engine takes (`max_prefill_length`)."""


# The tokens (prompts and budgets) of the requests kept for their siblings' drafts.
SIBLING_TOKENS = 1 << 22


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
  # Why an aborted request was aborted: "weight_update" (update_mode abort: the caller
  # may resume it, see `continuation`), else None (an explicit abort, the server stopping).
  abort_cause: Optional[str] = None
  prefix_hit_tokens: int = 0
  pages: list[int] = dataclasses.field(default_factory=list, repr=False)
  prefilled: int = 0  # prompt positions in the pool
  dispatched: int = 0  # output tokens computed or in flight
  slot: Optional[int] = None
  submitted_at: float = dataclasses.field(default_factory=time.perf_counter)
  first_token_at: Optional[float] = None
  last_token_at: Optional[float] = None
  finished_at: Optional[float] = None
  _done: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)
  _listeners: list = dataclasses.field(default_factory=list, repr=False)
  _key: Optional[bytes] = dataclasses.field(default=None, repr=False)

  @property
  def prompt_key(self) -> bytes:
    """A digest of the prompt, what the records of a prompt's samples are kept by (its
    tokens as a tuple kept each prompt whole: 4,096 of 32k tokens were 4.7 GB)."""
    if self._key is None:
      self._key = hashlib.blake2b(np.asarray(self.prompt_ids, np.int64).tobytes(),
                                  digest_size=16).digest()
    return self._key

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

  @property
  def decode_s(self) -> float:
    """Seconds from its first token to its end: the time its own tokens took (an
    episode's deadline counts it on the policy's side, the wait before on the server's)."""
    if self.first_token_at is None or self.finished_at is None:
      return 0.0
    return max(0.0, self.finished_at - self.first_token_at)

  @property
  def decoded_s(self) -> float:
    """In flight: seconds from its first token to its latest (a stalled request's do not
    grow)."""
    if self.first_token_at is None or self.last_token_at is None:
      return 0.0
    return self.last_token_at - self.first_token_at

  def result(self) -> dict:
    return {
        "request_id": self.request_id, "prompt_ids": list(self.prompt_ids),
        "output_ids": list(self.output_ids), "output_logprobs": list(self.output_logprobs),
        "raw_logprobs": list(self.raw_logprobs), "versions": list(self.versions),
        "finish_reason": self.finish_reason, "error": self.error,
        "prefix_hit_tokens": self.prefix_hit_tokens,
        "ttft_s": self.ttft_s, "decode_s": self.decode_s,
        "sampling": dataclasses.asdict(self.sampling),
    }


def progress_of(orchestrators: Sequence["Orchestrator"], request_id: str) -> Optional[dict]:
  """Where a request in flight on any of a server's orchestrators (its policy's, its
  other models') stands (`Orchestrator.progress`); None when none runs it."""
  for orch in orchestrators:
    found = orch.progress(request_id)
    if found is not None:
      return found
  return None


def _queued(req: Request) -> bool:
  """Not yet taken: no slot, no prompt position in the pool."""
  return req.slot is None and req.prefilled == 0


def continuation(req: Request) -> tuple[list[int], SamplingParams, int]:
  """Prompt, sampling and `resumed_tokens` (see `Orchestrator.submit`) to resume an
  aborted request where it stopped."""
  left = max(1, req.sampling.max_new_tokens - len(req.output_ids))
  return (list(req.prompt_ids) + list(req.output_ids),
          dataclasses.replace(req.sampling, max_new_tokens=left), len(req.output_ids))


@dataclasses.dataclass
class _Update:
  params: Any
  version: int
  mode: str
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  report: dict = dataclasses.field(default_factory=dict)
  paused_at: Optional[float] = None
  error: Optional[str] = None  # (the engine loop died before it was made)


class Orchestrator:
  """Runs the engine loop in a thread and serves requests to other threads.

  `prefix_cache_tokens` > 0 keeps up to that many tokens of finished and prefilled
  sequences' whole pages for reuse (0: off). `prefill_chunk` bounds the tokens of one
  request prefilled per call. `decode_steps` > 1 runs up to that many decode steps in one
  device call while no request waits to be admitted or prefilled (fewer dispatches and
  host reads a token; a request that stops early wastes the rest of its call's steps).
  """

  def __init__(self, engine: Engine, params: Any, *, prefix_cache_tokens: int = 0,
               max_queue: int = 4096, cache_finished: bool = True,
               prefill_chunk: Optional[int] = None, length_aware: bool = False,
               speculative: int = 0, decode_steps: int = 1):
    if decode_steps < 1:
      raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
    self.decode_steps = decode_steps
    self.engine = engine
    self.params = params
    self.version = int(params["version"])
    self.prefix_cache_tokens = prefix_cache_tokens
    self.cache_finished = cache_finished
    self.max_queue = max_queue
    if prefill_chunk is not None and prefill_chunk < 0:  # (each step's error, for ever)
      raise ValueError(f"prefill_chunk must be >= 0 (0 or None: max_prefill_length), got "
                       f"{prefill_chunk}")
    self.prefill_chunk = min(prefill_chunk or engine.max_prefill_length,
                             engine.max_prefill_length)
    # Length-aware admission (as Seer): the first sample of a prompt runs ahead as a
    # probe; its siblings wait for it, then queued requests start longest-expected first.
    self.length_aware = length_aware
    self._lengths: collections.OrderedDict[bytes, int] = collections.OrderedDict()
    self._probing: set[bytes] = set()
    # Group speculative decoding (as Seer): up to `speculative` draft tokens a step, taken
    # from what samples of the same prompt generated after the same recent tokens.
    self.speculative = speculative
    self._siblings: collections.OrderedDict[bytes, list] = collections.OrderedDict()
    self._sibling_tokens = 0  # (what the kept requests hold: SIBLING_TOKENS at most)
    self.spec_proposed = 0
    self.spec_accepted = 0
    self._reset_engine_state()
    self._queue: collections.deque[Request] = collections.deque()
    self._requests: dict[str, Request] = {}
    self._aborts: set[str] = set()
    self._update: Optional[_Update] = None
    self._cv = threading.Condition()
    self._stop = False
    self.dead: Optional[str] = None  # (what killed the engine loop: `EngineDead`)
    self.step_began: Optional[float] = None  # (monotonic: when the loop's step under way began)
    self._thread: Optional[threading.Thread] = None
    self._ids = itertools.count()
    self._recent = collections.deque(maxlen=256)  # (time, tokens) per step
    self.tokens_generated = 0
    self.prefill_tokens = 0  # prompt tokens actually computed (prefix-cache hits excluded)
    self.prefill_calls = 0
    self.shared_pages = 0  # KV pages requests took from the prefix cache instead of computing
    self.requests_finished = 0
    self.steps = 0
    self.last_swap: Optional[dict] = None
    self.loop_errors = 0

  def _reset_engine_state(self) -> None:
    """A fresh decode state, page allocator and prefix cache (at start, after a loop error)."""
    self._state = None  # (let go first: two whole KV pools at once ran a device out)
    self._state = self.engine.init_decode_state()
    self.allocator = PageAllocator(self.engine.num_pages)
    self.prefix_cache = (PagedPrefixCache(self.allocator, self.engine.page_size,
                                          self.engine.pages_for(self.prefix_cache_tokens))
                         if self.prefix_cache_tokens > 0 else None)
    self._slots: list[Optional[Request]] = [None] * self.engine.max_concurrent_decodes
    self._prefilling: list[Request] = []  # admitted, holding a slot, prompt not all in the pool
    self._pending: collections.deque = collections.deque()  # results not yet read

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
      update, self._update = self._update, None
    if update is not None:  # (its caller waited out its whole timeout, then was told the
      # update was withdrawn with the engine still serving; a reviewer)
      update.error = "the orchestrator stopped before the update was applied"
      update.done.set()
    thread, ended = self._thread, True
    if thread is not None:
      thread.join(timeout=30)
      ended = not thread.is_alive()
      self._thread = None
    if ended:  # (else the loop, in a long device call, ends them at its next look at
      # `_stop`: finished from here too, a request could end twice; a reviewer)
      for req in list(self._requests.values()):
        self._finish(req, "abort")

  # -- client API (any thread) ---------------------------------------------------------

  def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams(),
             request_id: Optional[str] = None, session_id: Optional[str] = None,
             resumed_tokens: int = 0) -> Request:
    """Queues a request; raises ValueError for a bad request and QueueFull when full.

    `resumed_tokens` > 0 says that the prompt's last `resumed_tokens` tokens are the output
    of a turn that was cut (a weight update in abort mode) and is resumed here (see
    `continuation`): the prompt limit (`max_prefill_length`) applies to the prompt
    without them, as it did when the turn was submitted; the whole may run to
    `max_seq_len` (its pages were reserved for prompt + max_new_tokens then)."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
      raise ValueError("prompt_ids must not be empty")
    vocab = self.engine.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
      raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    resumed_tokens = int(resumed_tokens)
    if not 0 <= resumed_tokens < len(prompt):
      raise ValueError(f"resumed_tokens must be in [0, {len(prompt)}) (the prompt's "
                       f"length), got {resumed_tokens}")
    if len(prompt) - resumed_tokens > self.engine.max_prefill_length:
      raise PromptTooLong(f"{PROMPT_TOO_LONG}: {len(prompt) - resumed_tokens} tokens; the "
                          f"limit (engine.max_prefill_length) is {self.engine.max_prefill_length}")
    if len(prompt) >= self.engine.max_seq_len:
      raise PromptTooLong(f"{PROMPT_TOO_LONG}: {len(prompt)} tokens with the resumed turn's "
                          f"leave no room in max_seq_len {self.engine.max_seq_len}")
    sampling.validate(vocab)
    need = self.engine.pages_for(min(len(prompt) + sampling.max_new_tokens,
                                     self.engine.max_seq_len))
    if need > self.engine.num_pages - 1:
      if self.engine.pages_for(min(1 + sampling.max_new_tokens,
                                   self.engine.max_seq_len)) > self.engine.num_pages - 1:
        raise ValueError(f"max_new_tokens {sampling.max_new_tokens} alone needs more KV "
                         f"pages than the engine has ({self.engine.num_pages - 1})")
      # The prompt outgrew this engine, as above: a judge's or a policy's prompt that
      # did is its own length, not the server's failure.
      raise PromptTooLong(f"{PROMPT_TOO_LONG}: with max_new_tokens it needs {need} KV "
                          f"pages; the engine has {self.engine.num_pages - 1} (kv_pages)")
    with self._cv:
      if self._stop:
        raise RuntimeError("the orchestrator is stopped")
      if self.dead is not None:
        raise EngineDead(f"{ENGINE_DEAD}: {self.dead}")
      if len(self._queue) >= self.max_queue:
        raise QueueFull(f"queue is full ({self.max_queue} requests)")
      # (96 random bits: a Responses id, resp_{request id}, is what lets a call go on
      # from its conversation; with 32 and the count, another's could be guessed)
      rid = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:24]}"
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

  def progress(self, request_id: str) -> Optional[dict]:
    """Where a request in flight stands (None: not in flight here): `state` "queued" or
    "running" (it holds a slot), its prompt positions in the pool (`prefilled`), its
    `output_tokens`, and `decode_s`, the seconds from its first token to its latest. A
    client tells a server that is slow (the request moves) from one that is stuck or
    overloaded (it does not) by two looks."""
    with self._cv:
      req = self._requests.get(request_id)
      if req is None or req.done:
        return None
      return {"request_id": request_id, "state": "queued" if _queued(req) else "running",
              "prefilled": int(req.prefilled), "output_tokens": len(req.output_ids),
              "decode_s": req.decoded_s}

  def session_progress(self, session_id: str) -> dict:
    """The session's requests in flight: how many, how many of them still `queued`,
    their prompt positions in the pool and output tokens (a client tells a slow turn,
    which moves, from a stuck one), and the seconds from their first tokens to their
    latest (an episode cut meanwhile counts them on its policy's side), also by request
    id (`by_request`)."""
    with self._cv:
      mine = [r for r in self._requests.values() if r.session_id == session_id and not r.done]
      return {"requests": len(mine), "queued": sum(map(_queued, mine)),
              "prefilled": sum(int(r.prefilled) for r in mine),
              "output_tokens": sum(len(r.output_ids) for r in mine),
              "decode_s": sum(r.decoded_s for r in mine),
              "by_request": {r.request_id: r.decoded_s for r in mine}}

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
      if self.dead is not None:
        raise EngineDead(f"{ENGINE_DEAD}: {self.dead}")
      if self._update is not None:
        raise RuntimeError("a weight update is already in progress")
      self._update = upd
      self._cv.notify_all()
    if not upd.done.wait(timeout):
      with self._cv:
        if self._update is upd:
          # Withdrawn: its caller is told it failed, so it must not swap later, behind
          # the caller's back (the trainer would stamp its next episodes with the old
          # version while the engine ran the new one, or load it again beside it).
          self._update = None
          self._cv.notify_all()
          raise TimeoutError(
              f"the weight update to version {upd.version} did not complete in {timeout} s "
              f"(the running requests did not finish: mode {upd.mode!r}); withdrawn, the "
              f"engine still serves version {self.version}")
      if not upd.done.wait(timeout):  # (it swapped as the time ran out: a moment)
        raise TimeoutError(f"the weight update to version {upd.version} was swapped in "
                           f"and did not complete in {timeout} s more")
    if upd.error is not None:
      raise EngineDead(upd.error)
    return upd.report

  def stats(self) -> dict:
    with self._cv:
      live = sum(r is not None for r in self._slots)
      queued = len(self._queue)
    began = self.step_began
    step_s = 0.0 if began is None or self.dead is not None else time.monotonic() - began
    now = time.perf_counter()
    window = [(t, n) for t, n in list(self._recent) if now - t <= 10.0]
    tps = 0.0
    if len(window) >= 2:
      tps = sum(n for _, n in window[1:]) / max(window[-1][0] - window[0][0], 1e-9)
    out = {"queue": queued, "live_slots": live, "slots": len(self._slots),
           "tokens_generated": self.tokens_generated, "tokens_per_s": tps,
           "requests_finished": self.requests_finished, "steps": self.steps,
           "prefill_tokens": self.prefill_tokens, "prefill_calls": self.prefill_calls,
           "shared_pages": self.shared_pages,
           "speculative": {"proposed": self.spec_proposed, "accepted": self.spec_accepted},
           "version": self.version, "loop_errors": self.loop_errors, "dead": self.dead,
           "last_swap": self.last_swap, "step_s": step_s,
           "kv_pages": {"total": self.engine.num_pages - 1, "used": self.allocator.used,
                        "free": self.allocator.free, "page_size": self.engine.page_size}}
    if self.prefix_cache is not None:
      out["prefix_cache"] = self.prefix_cache.stats()
    return out

  # -- engine loop ----------------------------------------------------------------------

  def _run(self) -> None:
    try:
      self._loop()
    except BaseException as e:  # (not an Exception: the thread ended without a word, its
      # waiters hung for ever while /health said ok; a reviewer)
      self._die(traceback.format_exc(limit=3) or f"{type(e).__name__}: {e}")
    finally:
      if self._stop:  # (its requests end here, the loop's own thread, once it is out)
        for req in list(self._requests.values()):
          with contextlib.suppress(Exception):
            self._finish(req, "abort")

  def _loop(self) -> None:
    while True:
      self.step_began = None
      with self._cv:
        while not self._stop and not self._has_work():
          self._cv.wait(timeout=0.5)
        if self._stop:
          return
      self.step_began = time.monotonic()
      try:
        self._process_aborts()
        self._process_update()
        self._admit()
        self._prefill_step()
        if self.speculative:
          self._spec_step()
        else:
          self._step()
      except Exception:  # the loop never dies: fail the live requests and go on
        self.loop_errors += 1
        msg = traceback.format_exc(limit=3)
        try:
          for req in [r for r in self._slots if r is not None]:
            self._finish(req, "error", error=msg)
          self._probing.clear()
          try:
            self._reset_engine_state()
          except Exception:  # (once more, what the failed step held let go first)
            gc.collect()
            self._reset_engine_state()
        except Exception:  # (its recovery failed too: out of memory for a fresh pool)
          self._die(traceback.format_exc(limit=3))
          return

  def _die(self, why: str) -> None:
    """The loop cannot go on: every request, queued or live, fails now, and every later
    one at once (`EngineDead`); an update waiting on it too (it hung, as every request
    did, while /health said ok: a reviewer)."""
    log.error("the engine loop died and cannot recover: %s", why)
    with self._cv:
      self.dead = why.strip().splitlines()[-1][:500] if why.strip() else "unknown"
      failing = list(self._requests.values())
      self._queue.clear()
      update, self._update = self._update, None
    for req in failing:
      with contextlib.suppress(Exception):
        self._finish(req, "error", error=f"{ENGINE_DEAD}: {self.dead}")
    if update is not None:
      update.error = f"{ENGINE_DEAD}: {self.dead}"
      update.done.set()

  def _has_work(self) -> bool:
    admit = bool(self._queue) and self._update is None
    return (admit or bool(self._aborts) or self._update is not None or bool(self._pending)
            or any(r is not None for r in self._slots))

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
    for req in [r for r in self._slots if r is not None and r.request_id in aborts]:
      self._end(req, "abort")

  def _process_update(self) -> None:
    upd = self._update
    if upd is None:
      return
    if upd.paused_at is None:
      upd.paused_at = time.perf_counter()
      upd.report["in_flight"] = sum(r is not None for r in self._slots)
      if upd.mode == "abort":
        for req in [r for r in self._slots if r is not None]:
          req.abort_cause = "weight_update"
          self._end(req, "abort")
    if any(r is not None for r in self._slots):
      return  # draining: keep decoding until the running requests finish
    self._read_results(keep=0)
    t0 = time.perf_counter()
    with self._cv:  # (its caller may withdraw it, under the lock, as its time runs out)
      if self._update is not upd:
        return
      self.params = upd.params
      self.version = upd.version
      self._update = None
      self._cv.notify_all()
    try:  # (swapped: its caller is told so whatever comes next; it waited for ever)
      if self.prefix_cache is not None:
        self.prefix_cache.clear()
      now = time.perf_counter()
      upd.report.update(version=upd.version, mode=upd.mode, swap_s=now - t0,
                        paused_s=now - upd.paused_at)
      self.last_swap = dict(upd.report)
    finally:
      upd.done.set()

  def _admit(self) -> None:
    """Admits queued requests while a slot and their pages are free, in order; samples
    of a prompt being prefilled (a GRPO group) wait for it, then share its pages."""
    if self._update is not None:
      return
    free = [i for i, r in enumerate(self._slots) if r is None]
    # Prompts being computed whole pages of, which their siblings will then share.
    page = self.engine.page_size
    busy = {r.prompt_key for r in self._prefilling
            if len(r.prompt_ids) - r.prefix_hit_tokens > page}
    waiting = []
    if self.length_aware:
      self._order_by_expected_length()
    while free:
      with self._cv:
        if not self._queue:
          break
        req = self._queue.popleft()
      key = req.prompt_key
      if (self.prefix_cache is not None and key in busy and len(req.prompt_ids) > 1) or (
          key in self._probing):
        waiting.append(req)
        continue
      try:
        if not self._reserve(req):
          with self._cv:
            self._queue.appendleft(req)
          break  # no pages: wait for running requests to free some
      except Exception as e:  # a bad request fails alone
        self._finish(req, "error", error=f"{type(e).__name__}: {e}")
        continue
      if len(req.prompt_ids) - req.prefilled > page:
        busy.add(key)
      if self.length_aware and key not in self._lengths:
        self._probing.add(key)  # the prompt's probe: its siblings wait for its length
      if self.speculative:
        self._keep_sibling(key, req)
      req.slot = free.pop(0)
      self._slots[req.slot] = req
      self._prefilling.append(req)
    if waiting:
      with self._cv:
        self._queue.extendleft(reversed(waiting))

  def _keep_sibling(self, key: bytes, req: Request) -> None:
    """Keeps `req` among the last 16 samples of its prompt, whose outputs drafts come
    from: of 1,024 prompts at most, and SIBLING_TOKENS of their prompts and token budgets
    (by count alone, 16k requests of 32k-token prompts could hold 18 GB; a reviewer)."""
    def held(group):
      return sum(len(r.prompt_ids) + r.sampling.max_new_tokens for r in group)

    group = self._siblings.pop(key, [])
    self._sibling_tokens -= held(group)
    group = group[-15:] + [req]
    self._siblings[key] = group
    self._sibling_tokens += held(group)
    while len(self._siblings) > 1 and (len(self._siblings) > 1024
                                       or self._sibling_tokens > SIBLING_TOKENS):
      self._sibling_tokens -= held(self._siblings.popitem(last=False)[1])

  def _order_by_expected_length(self) -> None:
    """Queued requests in admission order: probes of prompts never seen first, then the
    longest expected output first (the longest its siblings produced); stable."""
    def expected(req):
      return self._lengths.get(req.prompt_key, float("inf"))

    with self._cv:
      self._queue = collections.deque(sorted(self._queue, key=lambda r: -expected(r)))

  def _reserve(self, req: Request) -> bool:
    """Takes the pages of `req`'s whole length: its cached prefix's pages are shared, the
    rest allocated (evicting unused cached prefixes when short). False if they are not
    free now."""
    prompt, engine = req.prompt_ids, self.engine
    m, cached = 0, []
    if self.prefix_cache is not None:
      # Reuse at most all but the last prompt token: its logits give the first sample.
      m, cached = self.prefix_cache.match(prompt, max_length=len(prompt) - 1)
    need = engine.pages_for(min(len(prompt) + req.sampling.max_new_tokens, engine.max_seq_len))
    want = max(need - len(cached), 0)
    if want > self.allocator.free and self.prefix_cache is not None:
      self.prefix_cache.evict(want - self.allocator.free)
    try:
      new = self.allocator.alloc(want)
    except OutOfPages:
      self.allocator.unref(cached)
      return False
    req.pages, req.prefilled, req.prefix_hit_tokens = cached + new, m, m
    self.shared_pages += len(cached)
    return True

  def _prefill_step(self) -> None:
    """One prefill call: the next chunk of up to `prefill_rows` admitted requests whose
    chunks share a length bucket (the oldest request's)."""
    if not self._prefilling:
      return
    engine = self.engine

    def chunk(req):
      return min(len(req.prompt_ids) - req.prefilled, self.prefill_chunk)

    def key(req):
      return engine.prefill_bucket(chunk(req), req.prefilled)

    first = key(self._prefilling[0])
    rows = [r for r in self._prefilling if key(r) == first][:engine.rows_for(first)]
    requests = [PrefillRequest(r.prompt_ids[r.prefilled:r.prefilled + chunk(r)], r.pages,
                               r.prefilled, r.sampling) for r in rows]
    try:
      self._state, prefix, result = engine.prefill_many(params=self.params,
                                                        decode_state=self._state,
                                                        requests=requests)
    except Exception as e:
      for req in rows:
        self._end(req, "error", error=f"{type(e).__name__}: {e}")
      return
    self.prefill_calls += 1
    self.prefill_tokens += sum(len(r.tokens) for r in requests)
    done, decode = [], []
    for req, r in zip(rows, requests):
      req.prefilled += len(r.tokens)
      finished = req.prefilled == len(req.prompt_ids)
      req.dispatched = int(finished)
      done.append(finished)
      # A request that wants one token is done with its prefill: no decode slot on device.
      decode.append(req.slot if finished and self._budget(req) > 1 else None)
    if not any(done):
      return
    if any(s is not None for s in decode):
      self._state = engine.insert_many(prefix, self._state, decode)
    result.data.copy_to_host_async()
    self._pending.append(("prefill", result, [(i, req) for i, (req, d) in
                                               enumerate(zip(rows, done)) if d]))
    for req, d in zip(rows, done):
      if d:
        self._prefilling.remove(req)
        if self.prefix_cache is not None:  # its siblings and next turns share these pages
          self.prefix_cache.insert(req.prompt_ids, req.pages)

  def _budget(self, req: Request) -> int:
    """Output tokens `req` ends at, unless a stop token comes first."""
    return min(req.sampling.max_new_tokens, self.engine.max_seq_len - len(req.prompt_ids))

  def _step(self) -> None:
    """Dispatches decode steps for the requests that still want tokens (one step, or up to
    `decode_steps` in one call when nothing waits to be admitted or prefilled), then reads
    the results of the call before it. A request whose last token is in flight leaves the
    device's batch at once (its length budget is known on the host)."""
    running = [(slot, req) for slot, req in enumerate(self._slots)
               if req is not None and req.prefilled == len(req.prompt_ids)
               and req.dispatched < self._budget(req)]
    if not running:
      self._read_results(keep=0)
      return
    left = {slot: self._budget(req) - req.dispatched for slot, req in running}
    waiting = self._prefilling or (self._queue and None in self._slots)
    n = 1 if waiting else min(self.decode_steps, max(left.values()))
    if n == 1:
      self._state, result = self.engine.generate(self.params, self._state)
    else:
      remaining = np.zeros(len(self._slots), np.int32)
      for slot, k in left.items():
        remaining[slot] = k
      self._state, result = self.engine.generate_steps(self.params, self._state, n, remaining)
    result.data.copy_to_host_async()
    self.steps += n
    self._pending.append(("step" if n == 1 else "steps", result, running))
    spent = []
    for slot, req in running:
      req.dispatched += min(n, left[slot])
      if n == 1 and req.dispatched >= self._budget(req):
        spent.append(slot)  # (generate_steps releases its spent slots itself)
    if spent:
      self._state = self.engine.release(self._state, spent)
    self._read_results(keep=1)

  def _draft(self, req: Request, k: int) -> list[int]:
    """Up to `k` tokens a sibling (a sample of the same prompt) generated after the
    longest suffix (at most 4 tokens) of `req`'s output that it also generated.

    A sampled request never drafts from a sibling of its own seed: that sibling drew its
    tokens from the very random numbers that verify the draft, so the draft is not
    independent of its check and the tokens emitted no longer follow the policy while
    their log-probs say they do (an episode's retry keeps its seed, and drafted from the
    first try: a reviewer measured 0.93 for a token of p 0.55). Greedy requests may: no
    randomness decides them."""
    out, best = req.output_ids, []
    if k <= 0 or not out:
      return best
    seed = req.sampling.seed % (1 << 64) if req.sampling.temperature > 0 else None
    for sib in self._siblings.get(req.prompt_key, ()):
      if sib is req or sib.sampling.seed % (1 << 64) == seed:
        continue
      o = sib.output_ids
      for n in range(min(4, len(out)), 0, -1):
        tail = out[-n:]
        hits = [p for p in range(len(o) - n) if o[p:p + n] == tail]
        if hits:
          # Prefer the occurrence at the same offset (samples of a group run alike).
          p = min(hits, key=lambda p: abs(p + n - len(out)))
          cand = o[p + n:p + n + k]
          if len(cand) > len(best):
            best = cand
          break
    return best

  def _spec_step(self) -> None:
    """One decode step that also verifies sibling drafts (`Engine.verify`). The host
    needs the latest tokens to draft, so results are read at once (no step behind)."""
    self._read_results(keep=0)
    running = [(slot, req) for slot, req in enumerate(self._slots)
               if req is not None and req.prefilled == len(req.prompt_ids) and not req.done
               and len(req.output_ids) < self._budget(req)]
    if not running:
      return
    K = self.speculative
    drafts = np.zeros((len(self._slots), K), np.int32)
    n = np.zeros(len(self._slots), np.int32)
    for slot, req in running:
      d = self._draft(req, min(K, self._budget(req) - len(req.output_ids) - 1))
      drafts[slot, :len(d)] = d
      n[slot] = len(d)
    self._state, result = self.engine.verify(self.params, self._state, drafts, n)
    self.steps += 1
    h = result.to_host()
    emitted = 0
    for slot, req in running:
      count = int(h.valid[slot].sum())
      self.spec_proposed += int(n[slot])
      self.spec_accepted += count - 1
      for j in range(count):
        if req.done:
          break  # ended at a stop token: the rest is discarded
        emitted += 1
        self._emit(req, int(h.tokens[slot, j]), float(h.logp[slot, j]),
                   float(h.raw_logp[slot, j]), int(h.versions[slot, j]), int(h.lengths[slot, j]))
      req.dispatched = len(req.output_ids)
    self._recent.append((time.perf_counter(), emitted))

  def _read_results(self, keep: int) -> None:
    """Reads dispatched results in order, leaving the newest `keep` in flight."""
    while len(self._pending) > keep:
      kind, result, rows = self._pending.popleft()
      h = result.to_host()
      if kind != "steps":  # one row a slot: as `generate_steps`' `[1, slots]`
        h = HostResult(*(c[None] for c in h))
      n = 0
      for t in range(h.tokens.shape[0]):
        for i, req in rows:
          if req.done or req.slot is None or not (kind == "prefill" or h.valid[t, i]):
            continue  # finished (or aborted) after this call was dispatched, or past its budget
          n += 1
          self._emit(req, int(h.tokens[t, i]), float(h.logp[t, i]), float(h.raw_logp[t, i]),
                     int(h.versions[t, i]), int(h.lengths[t, i]))
      if kind != "prefill":
        self._recent.append((time.perf_counter(), n))

  def _emit(self, req: Request, token: int, logp: float, raw: float, version: int,
            length: int) -> None:
    req.last_token_at = time.perf_counter()
    if req.first_token_at is None:
      req.first_token_at = req.last_token_at
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
      self._tell(req)
      return
    self._end(req, reason)

  def _end(self, req: Request, reason: str, error: Optional[str] = None) -> None:
    """Ends an admitted request: frees its slot and pages (a finished sequence's whole pages
    stay in the prefix cache, for the next turn of its session)."""
    if req.slot is not None:
      self._state = self.engine.release(self._state, [req.slot])
      self._slots[req.slot] = None
      req.slot = None
    if req in self._prefilling:
      self._prefilling.remove(req)
    if (self.prefix_cache is not None and self.cache_finished and reason in ("stop", "length")
        and len(req.output_ids) > 1):
      # KV exists for every token but the last sampled one (never fed back); a request
      # that ends at its first token adds nothing the prefill did not cache.
      self.prefix_cache.insert(req.prompt_ids + req.output_ids[:-1], req.pages)
    if req.pages:
      self.allocator.unref(req.pages)
      req.pages = []
    if self.length_aware:
      key = req.prompt_key
      self._probing.discard(key)
      if reason in ("stop", "length"):
        self._lengths[key] = max(self._lengths.pop(key, 0), len(req.output_ids))
        while len(self._lengths) > 4096:
          self._lengths.popitem(last=False)
    self._finish(req, reason, error)

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
    self._tell(req)

  @staticmethod
  def _tell(req: Request) -> None:
    """Calls the request's listeners; one that raises is logged, not the loop's error (it
    failed every live request and reset the engine: a reviewer)."""
    for fn in req._listeners:
      try:
        fn(req, len(req.output_ids))
      except Exception:
        log.exception("a listener of request %s raised (left out)", req.request_id)

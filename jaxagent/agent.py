"""Agent loops: play one episode and return its token-exact trajectory.

- White-box (`run_whitebox`): the loop is ours: render the chat with the
  tokenizer, call the engine by token ids, hand the text to the environment
  (which parses tool calls), repeat. Per-turn and per-episode deadlines.
- Black-box (`jaxagent.blackbox`: `run_openai_agent`, `run_responses_agent`,
  `run_anthropic_agent`, + `collect_session`): any program that speaks the OpenAI chat
  API, OpenAI's Responses API or Anthropic's Messages API plays against the server's
  gateway with an `X-Session-Id`; the trajectory is rebuilt from the turns the server
  recorded.

Both produce an `Episode`: segments from the `TrajectoryManager`, per-turn
rewards, the verifier's verdict and the counters the metrics need. A server
failure (`jaxagent.errors.InfraError`: server, overload, turn deadline, worker,
sandbox) or an infrastructure verdict marks the episode `infra_error` (to be
retried or dropped, never scored 0); running out of turns or tokens, or of time
in the environment, is a truncation with its reason; any other exception is a bug
and propagates.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import re
import sys
import time
import uuid
import zlib
from typing import Awaitable, Callable, Optional

from envs.base import (BAD_TASK, ActionTooLarge, BadReward, CannotStart, Observation,
                       StepResult, check_reward, failure, trained_rewards)
from envs import waits
from jaxagent.config import AgentConfig
from jaxagent.errors import EpisodeBug, InfraError, TaskError
from jaxagent.tokenizer import Tokenizer
from jaxagent.trajectory import (SamplingParams, Segment, TrajectoryManager, TurnRecord,
                                reported_seconds)
from jaxagent.wal import EpisodeLog, Replay, observation_hash


@dataclasses.dataclass
class Episode:
  task_id: str
  session_id: str
  group_id: str
  segments: list[Segment]
  turn_rewards: list[float]
  verdict: dict
  status: str  # completed | truncated | aborted | failed
  reason: str = ""
  infra_error: bool = False
  infra_kind: str = ""  # the InfraError's kind (or "verifier") when infra_error
  turns: int = 0
  tool_calls: int = 0
  invalid_tool_calls: int = 0
  tool_errors: int = 0  # calls whose tool raised (told to the model as an error)
  tool_latencies_s: list[float] = dataclasses.field(default_factory=list)
  latency_s: float = 0.0
  generate_s: float = 0.0
  # Of generate_s, the server's time from each turn's first token to its end: the time
  # its own tokens took, the policy's side at a deadline (the rest is the server's).
  decode_s: float = 0.0
  env_s: float = 0.0  # in the environment, its waits on shared infrastructure left out
  # waiting for sandbox slots and worker turns (others' load), and for other episodes'
  # (or the run's own code's) holds of the event loop (envs.loopwatch)
  infra_wait_s: float = 0.0
  output_tokens: int = 0
  replayed_turns: int = 0  # turns taken from a dead run's write-ahead log
  compactions: int = 0  # times the context was compacted (agent.compaction)
  unfit: str = ""  # why the task's first prompt did not fit (FIRST_PROMPT_TOO_LONG)

  @property
  def reward(self) -> float:
    return float(sum(self.turn_rewards))

  @property
  def success(self) -> bool:
    return self.verdict.get("status") == "pass"

  def min_version(self) -> Optional[int]:
    vs = [s.min_version() for s in self.segments]
    vs = [v for v in vs if v is not None]
    return min(vs) if vs else None


# The truncation of an episode whose task's first prompt did not fit the context.
FIRST_PROMPT_TOO_LONG = "first_prompt_too_long"


def turn_seed(session_id: str, turn: int) -> int:
  """The sampling seed of an episode's turn: the same for the same session and turn (a
  report is reproducible), another for each episode of a group; the same for an
  episode's retries (a session id's `-r<attempt>`): a retry after the infrastructure
  failed plays the episode again as it went, and one the policy's own action fails
  again, is dropped again, never a luckier sample in its place (a reviewer)."""
  base = re.sub(r"-r\d+(#summary)?$", r"\1", session_id)
  return zlib.crc32(f"{base}/{turn}".encode()) & 0x7FFFFFFF


def _merge(first: TurnRecord, more: TurnRecord) -> TurnRecord:
  """A turn resumed after an abort: one turn whose output spans both requests."""
  return dataclasses.replace(first, output_ids=first.output_ids + more.output_ids,
                             output_logprobs=first.output_logprobs + more.output_logprobs,
                             versions=first.versions + more.versions,
                             raw_logprobs=None if first.raw_logprobs is None
                             or more.raw_logprobs is None
                             else first.raw_logprobs + more.raw_logprobs,
                             finish_reason=more.finish_reason,
                             decode_s=first.decode_s + more.decode_s)


SUMMARY_INSTRUCTIONS = ("Summarise this transcript briefly: the task, what was tried, what "
                        "is known now.")
SUMMARY_HEADER = "Summary of earlier turns:\n"


def _split_for_compaction(messages: list[dict], cfg: AgentConfig
                          ) -> tuple[list[dict], list[dict], list[dict]]:
  """(head, dropped, kept): the system message, the messages compaction drops, and the
  last `keep_last_messages` messages it keeps."""
  head = [m for m in messages[:1] if m["role"] == "system"]
  body = messages[len(head):]
  keep = body[-cfg.keep_last_messages:] if cfg.keep_last_messages > 0 else []
  return head, body[:len(body) - len(keep)], keep


def summary_prompt(tokenizer: Tokenizer, dropped: list[dict], budget: int) -> list[int]:
  """The summariser's prompt: instructions, then the dropped messages as a transcript.
  Whole when it fits in `budget` tokens; else every message cut to a shorter head
  (2000 characters, then 1000, ... 60); else the first (usually the task) and as many
  of the last as fit."""
  def render(lines):
    return tokenizer.apply_chat_template(
        [{"role": "system", "content": SUMMARY_INSTRUCTIONS},
         {"role": "user", "content": "\n".join(lines)}])

  def clip(text: str, limit: Optional[int]) -> str:
    return text if limit is None or len(text) <= limit else text[:limit] + " ..."

  for limit in (None, 2000, 1000, 500, 250, 120, 60):
    lines = [f"{m['role']}: {clip(str(m.get('content') or ''), limit)}" for m in dropped]
    ids = render(lines)
    if len(ids) <= budget:
      return ids
  while len(lines) > 1 and len(ids) > budget:
    lines = lines[:1] + lines[2:]
    ids = render(lines)
  return ids if len(ids) <= budget else render([])


async def _compact(messages: list[dict], cfg: AgentConfig, *, engine=None,
                   tokenizer: Optional[Tokenizer] = None, session_id: str = "",
                   turn: int = 0, logged: Optional[str] = None,
                   limit: Optional[int] = None, look: Optional[dict] = None
                   ) -> tuple[list[dict], Optional[str]]:
  """Keeps the system message and the last messages. The others go (`fork`), or (with
  `summary`) the policy, or the served model `agent.summarizer`, writes a summary of them
  that takes their place as a user message: context, never trained (the summariser's
  tokens are not the episode's actions). `logged`: a summary taken from the write-ahead
  log instead of asked for. Returns the messages and the summary's text (None: none).
  `look` (the policy writing its own summary): as a turn's (`_generate`), and its
  `summary_s`, the time the summary's tokens took."""
  head, dropped, keep = _split_for_compaction(messages, cfg)
  if cfg.compaction != "summary" or not dropped:
    return head + keep, None
  if logged is not None:
    return head + [{"role": "user", "content": SUMMARY_HEADER + logged}] + keep, logged
  # (`limit`: the context the engine takes, when it refused more than it)
  prompt = summary_prompt(tokenizer, dropped,
                          (limit or cfg.max_context_tokens) - cfg.summary_max_tokens)
  sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                            max_new_tokens=cfg.summary_max_tokens,
                            stop_token_ids=tuple(tokenizer.stop_ids),
                            seed=turn_seed(session_id + "#summary", turn))
  extra = {"model": cfg.summarizer} if cfg.summarizer else {}
  # Bounded as a turn is (it moves or it is the server's): the policy's context length
  # asked for it, and by default the policy writes it.
  rid = (f"{session_id}#summary#{uuid.uuid4().hex[:12]}"
         if callable(getattr(engine, "progress", None)) else None)
  if rid is not None:
    extra["request_id"] = rid
  look = look if not cfg.summarizer else None  # (a served summariser's time: the server's)
  if look is not None:
    look["rid"] = rid
  record = await _within_turn_deadline(
      engine, engine.generate(prompt, sampling, session_id + "#summary", **extra), rid,
      cfg.turn_deadline_s, look)
  if look is not None:
    look["summary_s"] = record.decode_s
  out = record.output_ids
  text = tokenizer.decode(out[:-1] if out and out[-1] in tokenizer.stop_ids else out).strip()
  text = text or "(empty)"
  return head + [{"role": "user", "content": SUMMARY_HEADER + text}] + keep, text


def next_prompt(tokenizer: Tokenizer, messages: list[dict], record: TurnRecord,
                new_messages: list[dict], tools) -> Optional[list[int]]:
  """The next turn's prompt as the last prompt + the sampled tokens + the newly rendered
  text, so the sampled tokens stay in the context exactly as sampled (no re-tokenising
  of history). None when the template does not render append-only (then the caller
  re-renders the whole history and the trajectory manager realigns or forks). The new
  messages' content is data: encoded as plain text, so an observation that writes the
  template's control strings cannot open a turn (`Tokenizer.render_pieces`).

  `messages` ends with the assistant message of `record`.
  """
  head = tokenizer.render(messages[:-1], tools, add_generation_prompt=True)
  content = messages[-1].get("content") or ""
  closed = tokenizer.render(messages, tools, add_generation_prompt=False)
  pieces = tokenizer.render_pieces(messages + new_messages, tools, add_generation_prompt=True)
  full = "".join(text for text, _ in pieces)
  if not (closed.startswith(head + content) and full.startswith(closed)):
    return None
  closing = closed[len(head) + len(content):]  # the template's end of the assistant turn
  return tokenizer.continue_turn(record.prompt_ids, record.output_ids, closing, pieces,
                                 start=len(closed))


async def while_it_moves(call: Awaitable, look, deadline_s: float, where: str):
  """Awaits `call`. Each `deadline_s` without its answer, `await look()` says how it
  stands: (a key that changes while it moves, or None when it cannot move: unknown,
  still queued; and why). One that did not move since the last look is `where`'s
  failure, InfraError("turn_deadline"); one that moves is waited on."""
  task = asyncio.ensure_future(call)
  seen = None
  try:
    while True:
      done, _ = await asyncio.wait({task}, timeout=deadline_s)
      if done:
        return task.result()
      moved, why = await look()
      if (moved is None or moved == seen) and not task.done():
        # (a turn that ended as it was looked at: its answer may be on its way)
        await asyncio.wait({task}, timeout=min(deadline_s, 2.0))
      if task.done():
        return task.result()
      if moved is None or moved == seen:
        raise InfraError("turn_deadline", f"no answer from {where} in {deadline_s} s"
                         + (f" and the turn did not move since ({why})" if why else ""))
      seen = moved
  finally:
    if not task.done():
      task.cancel()
      with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    elif not task.cancelled():  # (its error, as a look's raised: read, not a traceback of
      task.exception()          # asyncio's "never retrieved" at the process's end)


async def _within_turn_deadline(engine, call, request_id: Optional[str], deadline_s: float,
                                look: Optional[dict] = None):
  """Awaits a turn's `call`. Each `deadline_s` without its answer, the server is asked
  how the request stands (an engine with `progress`): a request that moved since the
  last look (prefill, or tokens) is waited on; one that did not (still queued, or
  stalled, or unknown) is the server's failure, InfraError("turn_deadline"). So a turn's
  deadline bounds the server's stalls, not the policy's length: a policy that writes to
  its token cap on a busy server would otherwise turn its long (failing) turns into
  re-rolled infrastructure errors, never trained (red team). An engine without
  `progress` gets `deadline_s` for the whole turn. `look` is given the last look's
  `decode_s` (from the turn's first token to its latest)."""
  async def progress():
    if request_id is None:
      return None, ""
    now = await engine.progress(request_id)
    if now is None or now.get("state") != "running":
      return None, "not in flight" if now is None else "still queued"
    if look is not None:
      look["decode_s"] = reported_seconds(now.get("decode_s"))
    return ((now.get("prefilled"), now.get("output_tokens")),
            f"no new token ({now.get('output_tokens')} so far)")

  return await while_it_moves(call, progress, deadline_s, "the server")


# Resumes in a row of a turn cut by weight updates that sampled nothing, after which the
# turn is the server's failure (its updates come faster than it serves a token).
IDLE_RESUMES = 4


async def _generate(engine, prompt, sampling, session_id, deadline_s, retries: int = 0,
                    look: Optional[dict] = None):
  """One turn from the engine; resumes a turn aborted by a weight update. A turn whose
  server does not move for its deadline is the server's (overloaded or stuck), not the
  policy's (`_within_turn_deadline`); its length is bounded by max_new_tokens. A turn
  whose server failed is asked again up to `retries` times (of the next server, through
  a router): the same seed samples the same tokens (with speculative decoding, another
  sample of the policy's, as exact), so the episode goes on from its last
  committed token instead of restarting. `look` holds the request in flight (`rid`),
  the decode time of the turn's parts before it (`done_s`, a turn resumed after a weight
  update) and its own as last seen (`decode_s`, `_within_turn_deadline`)."""
  tracked = callable(getattr(engine, "progress", None))

  async def call(prompt, sampling, resumed=0):
    # A resume names its sampled tokens: the prompt limit does not count them.
    more = {"resumed_tokens": resumed} if resumed else {}
    for attempt in range(retries + 1):
      rid = f"{session_id}#{uuid.uuid4().hex[:12]}" if tracked else None
      if rid is not None:
        more["request_id"] = rid
      if look is not None:
        look.pop("decode_s", None)
        look["rid"] = rid
      try:
        return await _within_turn_deadline(
            engine, engine.generate(prompt, sampling, session_id, **more), rid, deadline_s,
            look)
      except InfraError as e:
        if e.kind != "server" or attempt == retries:
          raise
        await asyncio.sleep(0.2 * (attempt + 1))

  record = await call(prompt, sampling)
  # A turn is resumed for as long as its parts sample tokens (bounded by max_new_tokens):
  # a fixed number of resumes made a long turn, the policy's length, the server's failure
  # in a run of frequent updates, dropped and never scored (red team 17). Only parts that
  # sample nothing, IDLE_RESUMES in a row, are the server's.
  idle = 0
  while record.finish_reason == "abort" and len(record.output_ids) < sampling.max_new_tokens:
    if idle >= IDLE_RESUMES:
      # Never a partial turn as the policy's answer.
      raise InfraError("server", f"a turn was cut by weight updates {idle} times in a row "
                                 "before it sampled a token")
    # (the same seed: the engine keys each token by its position, so a resumed part
    # samples as the uncut turn would have under the same weights)
    rest = dataclasses.replace(sampling, max_new_tokens=sampling.max_new_tokens - len(
        record.output_ids))
    if look is not None:  # (the parts so far: the policy's at a cut in the next)
      look["done_s"] = record.decode_s
    try:
      part = await call(prompt + record.output_ids, rest, len(record.output_ids))
    except InfraError as e:
      if e.kind != "prompt_too_long":
        raise
      # A resume the engine refuses as too long (a server without `resumed_tokens`):
      # without the update the turn would have gone on, so this is not the policy's length.
      raise InfraError("server", f"a turn cut by a weight update cannot be resumed: {e}"
                       ) from None
    idle = 0 if part.output_ids else idle + 1
    record = _merge(record, part)
  return record


# An episode's wall time, waits on shared infrastructure included, is cut at this many
# episode deadlines, and judged as at its deadline: the waits of a pool that keeps
# freeing slots are the run's own load (its policy's), not an outage (a stuck pool fails
# its command at once).
EPISODE_WALL_FACTOR = 3


async def graded(verify: Awaitable, cfg: AgentConfig,
                 waited: Optional[Callable[..., Awaitable[float]]] = None):
  """The verdict, within EPISODE_WALL_FACTOR episode deadlines of its own time (its own
  runs are bounded by the grader's timeouts). `waited(ask_worker=...)`: the episode's
  waits on shared infrastructure so far (`MeasuredEnv.waited`), which the bound leaves
  out: a grading queued behind a crowd (sandbox slots, a worker's turns) is slower, not
  cut (cut, it was an infrastructure error re-rolled, and failing answers, whose tests
  run to their limits, were cut more often than passing ones: a survivors' bias).
  Without `waited`, or past EPISODE_WALL_FACTOR times that bound in wall time, it is
  cut all the same."""
  limit = EPISODE_WALL_FACTOR * cfg.episode_deadline_s
  task = asyncio.ensure_future(verify)
  t0 = time.perf_counter()
  if waited is None:
    wall, w0 = limit, 0.0

    async def since() -> float:
      return 0.0
  else:
    wall, w0 = EPISODE_WALL_FACTOR * limit, await waited(ask_worker=False)

    async def since() -> float:  # (a worker asked only when the bound seems reached)
      w = await waited(ask_worker=False) - w0
      if time.perf_counter() - t0 - w >= limit:
        w = await waited() - w0
      return w
  try:
    return await waits.within(task, since, limit, wall, t0, look_s=0.25)
  except (asyncio.TimeoutError, waits.WallCut) as e:
    raise InfraError("verifier", f"grading took longer than {limit:g} s" + (
        "" if waited is None else " of its own" if isinstance(e, asyncio.TimeoutError)
        else f" of its own or {wall:g} s in all")) from None


async def _commit(log: EpisodeLog, write, *args) -> None:
  """A write-ahead log record: in a worker thread when it is fsync'd (a disk wait), else
  right here (a buffered write to the OS: microseconds, less than a thread hop)."""
  if log.fsync:
    await asyncio.to_thread(write, *args)
  else:
    write(*args)


def provenance(tokenizer: Optional[Tokenizer], tools, cfg: AgentConfig, verdict: dict,
               task) -> dict:
  """What produced an episode, for each of its segments' `meta_versions`: tokenizer and
  chat template hashes, the tool schemas' hash, environment, verifier and task versions,
  and the sampling parameters (the policy version range is added per segment)."""
  schema = json.dumps(list(tools or []), sort_keys=True)
  out = dict(tokenizer.identity()) if tokenizer is not None else {}
  out.update(tool_schema_sha256=hashlib.sha256(schema.encode()).hexdigest()[:16],
             env=verdict.get("env_version"), verifier=verdict.get("verifier_version"),
             task=getattr(task, "version", None),
             sampling={"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
                       "max_new_tokens": cfg.max_new_tokens})
  return out


def stamp(segments: list[Segment], meta: dict) -> None:
  for seg in segments:
    trained = seg.versions[seg.loss_mask > 0]
    seg.meta_versions = dict(meta, policy_versions=[int(trained.min()), int(trained.max())]
                             if len(trained) else None)


def judge_cut(cut: BaseException, server_s: float, where: str, measured: "MeasuredEnv",
               decode_s: float = 0.0) -> tuple[str, Optional[str]]:
  """An episode cut at its deadline or wall time: its kind, and why it is the
  infrastructure's (it spent at least as long on the server as on its own side), or None
  (the policy's: a truncation, scored). The policy's side is its time in the environment
  and `decode_s`, the server's time from each turn's first token to its end: the time
  its own tokens took (a policy that writes to its token cap on a busy server would
  otherwise turn its long failures into re-rolled infrastructure errors, never trained).
  The server's side (`server_s`) is the rest: waiting for a slot, prefill, transport.
  Other episodes' holds of the event loop between its calls are on neither side: no
  load of its own, and not the server's (they were counted in one or the other). At
  the wall, the waits of the crowd its own run makes are on the policy's side too."""
  kind = "episode_wall" if isinstance(cut, waits.WallCut) else "episode_deadline"
  # (the holds credited between its calls fell while it waited on the server or while
  # the server decoded its tokens, which go on running during a hold: taken out of the
  # two in proportion, a reviewer; out of the server's alone, they scored the policy 0
  # for the server's time)
  both = server_s + decode_s
  if both > 0:
    kept = 1.0 - min(measured.between_held_s(), both) / both
    server_s, decode_s = server_s * kept, decode_s * kept
  policy_s = (measured.env_s + decode_s
              + (measured.waited_s - measured.held_s if kind == "episode_wall" else 0.0))
  if server_s < policy_s:
    return kind, None
  return kind, (f"{kind}: {server_s:.1f} s {where} (and {decode_s:.1f} s decoding its own "
                f"tokens), {measured.waited_s:.1f} s on sandbox slots and worker turns, "
                f"{measured.env_s:.1f} s in the environment")


@functools.cache
def _uncounted(kind: type) -> None:
  """Says, once an environment class, that its `step` counted no turn: its `max_turns`
  never ended an episode, each ran to agent.max_turns without a word (a new user)."""
  print(f"warning: {kind.__module__}.{kind.__name__}.step counted no turn (self.begin_turn(), "
        "which ToolSet.run_turn calls): the turns and turn budget it keeps stay at 0",
        file=sys.stderr, flush=True)


class MeasuredEnv:
  """An environment whose calls' waits on shared infrastructure (sandbox slots, a
  worker's turn; in process from `envs.waits`, or as a worker reports them) are counted
  in `waited_s`, apart from the rest of their time (`env_s`): waits do not spend an
  episode's budget. A call the episode's deadline cuts is counted too, its worker asked
  how long it waited. Keeps the actions it is handed (which reply of several a black-box
  agent acted on), and the process reward of each step that ended (`rewards`: what a
  black-box episode cut at its deadline is still trained with).

  An in-process environment's call past `deadline_s` of its own time is cut:
  `InfraError("env_call_deadline")`, as an env worker's call past its --deadline-s is a
  504. Its waits do not count, nor the policy's sandboxed commands (`waits.commanding`:
  their wall limits bound them, and a command can stall its own kill for a minute, which
  made a wrong answer's call an infrastructure error: red team 44); the episode's
  deadline bounds those."""

  def __init__(self, env, deadline_s: Optional[float] = None):
    self.env, self.actions, self.task = env, [], None
    self.deadline_s = None if hasattr(env, "in_flight_waits") else deadline_s
    self.rewards: list[float] = []
    self.ended = False  # (a step answered terminated or truncated)
    self.truncation: Optional[str] = None  # (truncated and not terminated: its reason)
    self.on_end: Optional[Callable[[], Awaitable[None]]] = None  # (awaited as it does)
    # (awaited as the first step begins, the agent's first reply had)
    self.on_first_step: Optional[Callable[[], Awaitable[None]]] = None
    self.waited_s = self.env_s = 0.0
    self.held_s = 0.0  # of waited_s, other code's holds of the event loop (envs.loopwatch)
    self._clock: Optional[waits.WaitClock] = None
    self._between: Optional[waits.WaitClock] = None  # (`episode()`)

  @contextlib.contextmanager
  def episode(self):
    """Measures the episode's time between its calls too (waiting on the server, its
    agent's own code): another episode's hold of the event loop meanwhile is a wait
    (`envs.loopwatch`), not its time; a hold by its own agent's code is its own. The
    block's tasks are this episode's."""
    with waits.measured(owner=self, between_calls=True) as self._between:
      yield

  def _between_s(self) -> float:
    return self._between.total_s() if self._between is not None else 0.0

  def between_held_s(self) -> float:
    """Other episodes' holds of the event loop credited between its calls."""
    return self._between.held_s if self._between is not None else 0.0

  def __getattr__(self, name):
    return getattr(self.env, name)

  @property
  def in_call(self) -> bool:
    """Whether a call of the environment's is under way."""
    return self._clock is not None

  def _reported(self) -> tuple[float, float]:
    """What a worker's answers reported so far: its calls' waits, and of them other
    sessions' holds of its loop (0 in process: those are on the call's own clock)."""
    return (getattr(self.env, "infra_wait_s", 0.0), getattr(self.env, "infra_held_s", 0.0))

  async def _within_deadline(self, call, what: str, t0: float):
    clock = self._clock
    task = asyncio.ensure_future(call)  # (made inside measured(): its waits are clock's)

    async def not_its_own() -> float:
      return clock.not_own_s()

    try:
      return await waits.within(task, not_its_own, self.deadline_s, math.inf, t0)
    except waits.DeadlineCut:  # (not a TimeoutError the environment raised itself)
      raise InfraError(
          "env_call_deadline", f"the environment's {what} ran past agent.env_call_deadline_s "
          f"({self.deadline_s:g} s of its own time; {clock.total_s():.1f} s waiting on sandbox "
          f"slots and the judge and {clock.commands_total_s():.1f} s of the policy's sandboxed "
          "commands not counted): a tool or grader that hangs is the infrastructure's "
          "failure, not the policy's") from None

  async def _measured(self, call, what: str):
    t0 = time.perf_counter()
    reported, reported_held = self._reported()
    remote = remote_held = 0.0
    try:
      with waits.measured(owner=self) as self._clock:
        if self.deadline_s is None:
          return await call
        return await self._within_deadline(call, what, t0)
    except TimeoutError as e:  # (not the call's own deadline: that is an InfraError)
      # A service of the environment's that did not answer in its own time (read as
      # the episode's deadline, it was the policy's cut, scored; a reviewer), as an env
      # worker answers it (a 503). Other errors of its code stay its bugs: an OSError
      # the policy's input can cause (a file it named) made infrastructure would let
      # the policy turn wrong answers into drops (its reviewer).
      raise InfraError("env_host", f"the environment's {what} timed out in its own "
                                   f"call: {failure(e)}") from e
    except asyncio.CancelledError:
      if hasattr(self.env, "in_flight_waits"):  # a worker's call, cut client-side
        remote, remote_held = await self.env.in_flight_waits()
      raise
    finally:
      now, now_held = self._reported()
      waited = self._clock.total_s() + now - reported + remote
      self.waited_s += waited
      # (a worker's: other sessions' holds of its loop, which it credited as waits)
      self.held_s += self._clock.held_s + now_held - reported_held + remote_held
      self.env_s += max(0.0, time.perf_counter() - t0 - waited)
      self._clock = None

  @property
  def cut_reward(self) -> float:
    """The environment's outcome of an episode the policy cut before it answered
    (`Env.cut_reward`)."""
    value = getattr(self.env, "cut_reward", 0.0)
    check_reward(value, f"environment {getattr(self.task, 'env', '?')!r}'s cut_reward")
    return float(value)

  async def reset(self, task):
    self.task, self.ended, self.truncation = task, False, None
    try:
      return await self._measured(self.env.reset(task), "reset")
    except BAD_TASK as e:  # the task's parameters (as environments report them)
      # (where it was raised: a bug of an environment's own reset reads the same; a
      # worker's refusal says it itself)
      why = e.why if isinstance(e, CannotStart) else failure(e)
      raise TaskError(f"task {task.id!r} ({task.env}): {why}") from e

  def _bad_reward(self, e: BadReward) -> EpisodeBug:
    """A reward that is not a finite number stops the run in one line naming the task
    and where (it was "an episode raised ValueError (a bug ...)" and a traceback): the
    environment's bug, its task played again on a resume once it is mended (a task
    file's error, exit 2, it read "data.tasks: ..." and pointed at envs.filter, which
    cannot see a reward a later step gives: a new user)."""
    task = self.task
    return EpisodeBug(task, e, (f"task {task.id!r} ({task.env}): " if task else "")
                      + failure(e))

  async def step(self, action: str):
    if self.ended:  # (a harness's bug: the environment's own refusal named no harness)
      raise RuntimeError(f"the agent stepped its environment after its episode ended (at "
                         f"step {len(self.actions)}, terminated or truncated): an agent "
                         "stops at the step that ends it")
    self.actions.append(action)
    if len(self.actions) == 1 and self.on_first_step is not None:
      await self.on_first_step()
    turns = getattr(self.env, "turns", None)  # (an in-process environment's count)
    try:
      result = await self._measured(self.env.step(action), "step")
    except BadReward as e:
      raise self._bad_reward(e) from e
    except ActionTooLarge as e:  # the policy's output, past what its worker takes
      result = StepResult(Observation([]), 0.0, False, True,
                          {"truncation": "action_too_large", "detail": str(e)[:300]})
    self.rewards.append(float(result.reward))
    self.ended = bool(result.terminated or result.truncated)
    if result.truncated and not result.terminated:  # (as the white-box agent reads it)
      self.truncation = str((result.info or {}).get("truncation", "env"))
    if self.ended and self.on_end is not None:
      await self.on_end()
    if type(turns) is int and getattr(self.env, "turns", None) == turns and not self.ended:
      _uncounted(type(self.env))  # (one that ends at its first step needs no count)
    return result

  async def verify(self):
    try:
      return await self._measured(self.env.verify(), "verify")
    except BadReward as e:
      raise self._bad_reward(e) from e

  async def end(self, ep: Episode) -> None:
    """Closes the environment (its error ignored) once `ep` has what was measured of it:
    its waits, its own time and its tool counters (`Env.counters`)."""
    ep.infra_wait_s, ep.env_s = self.waited_s + self._between_s(), self.env_s
    counters = getattr(self.env, "counters", {}) or {}
    for name in ("tool_calls", "invalid_tool_calls", "tool_errors"):
      setattr(ep, name, int(counters.get(name, 0)))
    try:
      await self.env.close()
    except Exception:
      pass

  async def waited(self, ask_worker: bool = True) -> float:
    """Waits so far, a running call's included (a remote one's asked of its worker)."""
    if self._clock is None:
      return self.waited_s + self._between_s()
    running = self._clock.total_s()
    if ask_worker and hasattr(self.env, "in_flight_waits"):
      running += (await self.env.in_flight_waits())[0]
    return self.waited_s + self._between_s() + running


async def run_whitebox(env, task, engine, tokenizer: Tokenizer, cfg: AgentConfig, *,
                       session_id: str, group_id: str = "", log: Optional[EpisodeLog] = None,
                       replay: Optional[Replay] = None) -> Episode:
  """Plays one episode with our own loop. The model's faults are the episode's outcome;
  an `InfraError` marks it `infra_error` (retried or dropped, never scored); anything
  else an environment raises is a bug and propagates.

  `log` (a `jaxagent.wal.EpisodeLog`) receives every turn before the environment sees
  it, and every observation. `replay` (a log left by a run that died) is played first:
  its turns are taken as logged (token-exact) while the environment is stepped through
  their actions and checked against the logged observations; then the episode goes on,
  sampling with the seeds of the logged session."""
  return await _Whitebox(env, task, engine, tokenizer, cfg, session_id, group_id, log,
                         replay).run()


class _Whitebox:
  """One episode of `run_whitebox`: what it has played so far, and its parts (a turn's
  context fitted, its tokens replayed or sampled, its action stepped; the cut judged)."""

  def __init__(self, env, task, engine, tokenizer: Tokenizer, cfg: AgentConfig,
               session_id: str, group_id: str, log: Optional[EpisodeLog],
               replay: Optional[Replay]):
    self.env, self.task, self.engine, self.tokenizer, self.cfg = env, task, engine, tokenizer, cfg
    self.session_id, self.log, self.replay = session_id, log, replay
    self.t_start = time.perf_counter()
    self.manager = TrajectoryManager(session_id, task_id=task.id, group_id=group_id)
    self.ep = Episode(task.id, session_id, group_id, [], [], {}, "completed")
    self.status, self.reason = "completed", ""
    self.waiting = {"on": "env", "since": self.t_start}  # what the episode waits on now
    self.look: dict = {}  # how the turn in flight stood at the agent's last look
    self.limit = cfg.max_context_tokens  # lowered when the engine refuses a shorter prompt
    # its calls' waits on shared infrastructure and own time
    self.measured = MeasuredEnv(env, cfg.env_call_deadline_s)
    self.offered: list = []  # the tool schemas the environment offered
    self.compacted_at: list[int] = []  # turns before which the context was compacted
    self.seed_session = replay.start.get("session_id", session_id) if replay is not None \
        else session_id
    self.messages: list = []  # the conversation so far
    self.tools: Optional[list] = None
    self.prompt = None  # its tokens, rendered (None: not yet)

  def wait_on(self, what: str) -> None:
    self.waiting.update(on=what, since=time.perf_counter())
    self.look.clear()  # (a turn's look is its own: a compaction's wait starts with none)

  async def at_cut(self) -> None:
    """At a cut, before the turn in flight is cancelled: how long its tokens took."""
    rid = self.look.get("rid") if self.waiting["on"] == "server" else None
    if rid is None or not callable(getattr(self.engine, "progress", None)):
      return
    with contextlib.suppress(Exception):
      now = await asyncio.wait_for(self.engine.progress(rid), 10.0)
      if now is not None:
        self.look["decode_s"] = reported_seconds(now.get("decode_s"))

  def too_long(self, turn: int) -> None:
    """Ends a conversation that outgrew the context in a truncation. Before the policy
    wrote a token (the task's first prompt) it is `first_prompt_too_long`, with what to
    raise (`ep.unfit`): a run whose every episode ends so stops saying it (it played new
    groups for ever without a word)."""
    if turn:
      self.status, self.reason = "truncated", "token_cap"
      return
    cfg, task = self.cfg, self.task
    where = ("agent.max_context_tokens" if self.limit == cfg.max_context_tokens else
             "what the engine takes (serving.engine.max_prefill_length)")
    self.ep.unfit = (
        f"task {task.id!r} ({task.env}): its first prompt is {len(self.prompt)} tokens, "
        f"which with agent.max_new_tokens ({cfg.max_new_tokens}) is over {where} "
        f"({self.limit}): raise agent.max_context_tokens, serving.engine.max_prefill_length "
        "and max_seq_len, and data.seq_len (the tools an environment offers add their "
        "schemas to every prompt)")
    self.status, self.reason = "truncated", FIRST_PROMPT_TOO_LONG

  async def play(self) -> None:
    """The episode's turns, from the environment's reset to its end or a cap."""
    cfg = self.cfg
    obs = await self.measured.reset(self.task)  # (a task that cannot start: TaskError)
    self.messages, self.tools = list(obs.messages), list(obs.tools) or None
    self.offered[:] = self.tools or []
    for turn in range(cfg.max_turns):
      if self.prompt is None:
        self.prompt = self.tokenizer.apply_chat_template(self.messages, tools=self.tools)
      taken = await self._turn(turn)
      if taken is None:  # (too long: truncated)
        return
      record, from_log = taken
      if await self._act(turn, record, from_log):
        return
    self.status, self.reason = "truncated", "turn_cap"

  async def _turn(self, turn: int) -> Optional[tuple[TurnRecord, bool]]:
    """The turn's record and whether it came from the replayed log, the context compacted
    first where it outgrew the limit; None where it is too long (the episode truncated)."""
    while True:  # twice at most: a compaction when the engine refuses the prompt
      if self.replay is not None and turn in self.replay.limits:  # (as the run that died;
        # logged again, as a summary is, for a replay of this run's log)
        self.limit = min(self.limit, self.replay.limits.pop(turn))
        if self.log is not None:
          await _commit(self.log, self.log.limit, turn, self.limit)
      if len(self.prompt) + self.cfg.max_new_tokens > self.limit and \
          not await self._compact_to_fit(turn):
        return None
      if self.replay is not None:  # committed by the run that died: taken as it was sampled
        try:
          record = self.replay.next_turn(self.prompt)
        except ValueError as e:
          raise InfraError("wal_replay", str(e)) from None
        if record is not None:
          self.ep.replayed_turns += 1
          return record, True
      record = await self._sampled(turn)
      if record is not None:
        return record, False

  async def _compact_to_fit(self, turn: int) -> bool:
    """Summarises the conversation to fit the limit (`agent.compaction`); False where it
    cannot (off, done before this turn already, or too long even so): truncated."""
    cfg, ep, look = self.cfg, self.ep, self.look
    if cfg.compaction == "none" or turn in self.compacted_at:
      self.too_long(turn)
      return False
    self.wait_on("server")
    t0 = time.perf_counter()
    try:
      self.messages, summary = await _compact(
          self.messages, cfg, engine=self.engine, tokenizer=self.tokenizer,
          session_id=self.seed_session, turn=turn,
          logged=self.replay.summaries.get(turn) if self.replay is not None else None,
          limit=self.limit, look=look)
    except InfraError as e:
      if e.kind != "prompt_too_long":
        raise
      self.too_long(turn)  # too long even to summarise
      return False
    # (the policy's summary: its tokens' time is its own, as a turn's)
    took = time.perf_counter() - t0
    ep.generate_s += took
    ep.decode_s += min(look.get("summary_s", 0.0), took)
    if self.log is not None and summary is not None:  # the next prompts are built on it
      await _commit(self.log, self.log.summary, turn, summary)
    self.wait_on("env")
    self.compacted_at.append(turn)
    ep.compactions += 1
    self.prompt = self.tokenizer.apply_chat_template(self.messages, tools=self.tools)
    if len(self.prompt) + cfg.max_new_tokens > self.limit:
      self.too_long(turn)
      return False
    return True

  async def _sampled(self, turn: int) -> Optional[TurnRecord]:
    """The turn's tokens sampled by the engine; None where the engine refused the prompt
    as too long (the limit lowered to what it takes, for the next fit)."""
    cfg, tokenizer = self.cfg, self.tokenizer
    sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                              max_new_tokens=cfg.max_new_tokens,
                              stop_token_ids=tuple(tokenizer.stop_ids),
                              seed=turn_seed(self.seed_session, turn))
    t0 = time.perf_counter()
    self.wait_on("server")
    try:
      record = await _generate(self.engine, self.prompt, sampling, self.session_id,
                               cfg.turn_deadline_s, cfg.turn_retries, self.look)
    except InfraError as e:
      if e.kind != "prompt_too_long":
        raise
      # The conversation outgrew what the engine takes (its max_prefill_length below
      # max_context_tokens): the policy's length, so compacted (when on) or a
      # truncation, scored; a drop would re-roll every episode that ran long.
      self.wait_on("env")
      self.limit = len(self.prompt) + cfg.max_new_tokens - 1
      if self.log is not None:  # (the compaction it leads to, for a replay to make again)
        await _commit(self.log, self.log.limit, turn, self.limit)
      return None
    self.wait_on("env")
    took = time.perf_counter() - t0
    self.ep.generate_s += took
    self.ep.decode_s += min(record.decode_s, took)
    return record

  async def _act(self, turn: int, record: TurnRecord, from_log: bool) -> bool:
    """Commits the turn, steps the environment with its text and takes the observation
    into the conversation; True where that ended the episode."""
    ep, log, replay, tokenizer = self.ep, self.log, self.replay, self.tokenizer
    if log is not None:  # the commit, before the environment sees the action
      await _commit(log, log.turn, turn, record)
    out = record.output_ids
    text = tokenizer.decode(out[:-1] if out and out[-1] in tokenizer.stop_ids else out)
    response = {"role": "assistant", "content": text}
    record.messages, record.response = list(self.messages), response
    self.manager.add_turn(record, turn)
    ep.turns += 1
    ep.output_tokens += len(out)
    self.messages.append(response)
    step = await self.measured.step(text)
    ep.turn_rewards.append(float(step.reward))  # (before the log's commit: a cut there
    # kept the step's reward from the episode, a 0 in its place)
    env = self.env
    state = (env.state_hash() if (log is not None or from_log)
             and callable(getattr(env, "state_hash", None)) else None)
    if from_log and turn in replay.hashes and (
        (observation_hash(step), state) != replay.hashes[turn]):
      raise InfraError("wal_replay", f"turn {turn}: the environment answered the logged "
                                     "action differently (not deterministic)")
    if log is not None:
      await _commit(log, log.observation, turn, step, state)
    info = step.info or {}
    ep.tool_latencies_s += list(info.get("tool_latency_s", []))
    new_messages = list(step.observation.messages)
    if not (step.terminated or step.truncated):
      self.prompt = next_prompt(tokenizer, self.messages, record, new_messages, self.tools)
    self.messages += new_messages
    if step.truncated and not step.terminated:  # (terminated: completed, truncated or not)
      self.status, self.reason = "truncated", info.get("truncation", "env")
    return step.terminated or step.truncated

  async def waited(self) -> float:
    """The episode's waits on shared infrastructure so far, a running call's included
    (a remote one's asked of its worker only when the budget seems spent)."""
    total = await self.measured.waited(ask_worker=False)
    if time.perf_counter() - self.t_start - total >= self.cfg.episode_deadline_s:
      total = await self.measured.waited()
    return total

  async def run(self) -> Episode:
    """Plays the episode within its deadlines and grades it: the episode, its segments."""
    cfg, ep, measured = self.cfg, self.ep, self.measured
    try:
      # (at least 0.25 s a look: while a remote call waits, `waited()` asks its worker)
      with measured.episode():
        await waits.within(asyncio.ensure_future(self.play()), self.waited,
                           cfg.episode_deadline_s, EPISODE_WALL_FACTOR * cfg.episode_deadline_s,
                           self.t_start, look_s=0.25, on_cut=self.at_cut)
      verdict = await graded(measured.verify(), cfg, measured.waited)
      ep.verdict = verdict.to_dict()
      if verdict.is_infra_error:
        self.status, self.reason = "failed", "verifier_infra_error"
        ep.infra_error, ep.infra_kind = True, "verifier"
      else:
        ep.turn_rewards = trained_rewards(ep.turn_rewards, verdict)
    except (waits.DeadlineCut, waits.WallCut) as cut:  # (not a TimeoutError of its code's)
      self._cut(cut)
    except InfraError as e:  # a server, worker, sandbox or network failure: not a score
      self.status, self.reason = "failed", str(e)[:300]
      ep.infra_error, ep.infra_kind = True, e.kind
    finally:
      await measured.end(ep)
    return self._finished()

  def _cut(self, cut: BaseException) -> None:
    """The episode's own time (waits on shared infrastructure left out) ran out, or its
    wall time. Spent mostly waiting on the server, it is infrastructure; mostly in the
    environment (the policy's tool calls, each bounded by its sandbox limits, and the
    crowd its own run makes), it is the policy's: a truncation, scored."""
    ep, look = self.ep, self.look
    # (a cut environment call's time is in `measured`, its worker's waits too)
    # The turn in flight: its tokens' time so far is the policy's too (as the server
    # said at the cut, or at the last look; and its parts' before a weight update).
    in_flight = time.perf_counter() - self.waiting["since"] \
        if self.waiting["on"] == "server" else 0.0
    own = min(in_flight, look.get("done_s", 0.0) + look.get("decode_s", 0.0))
    server_s = ep.generate_s - ep.decode_s + in_flight - own
    kind, infra = judge_cut(cut, server_s, "waiting on the server", self.measured,
                            ep.decode_s + own)
    if infra:
      self.status, self.reason = "failed", infra
      ep.infra_error, ep.infra_kind = True, kind
      return
    self.status, self.reason = "truncated", kind
    cut = self.measured.cut_reward
    ep.verdict = {"status": "fail", "reward": cut}
    # The turn whose step the cut stopped is in the segments with no reward: it is
    # scored 0 with the rest (left out, the chunk estimator gave the turn that ran out
    # the clock advantage 0, and a cut in the first step hid the whole failure from
    # the baseline and the loss: red team 17; the black-box agent pads so too).
    # (one at least, as a verdict gives an episode cut in its first turn's decoding)
    # (the outcome on the last turn, as a verdict's: the one reward contract)
    ep.turn_rewards = trained_rewards(list(ep.turn_rewards) + [0.0] * (
        max(ep.turns, 1) - len(ep.turn_rewards)), ep.verdict)

  def _finished(self) -> Episode:
    """The episode with its outcome and its segments, stamped; its log ended."""
    ep = self.ep
    ep.status, ep.reason = self.status, self.reason
    ep.latency_s = time.perf_counter() - self.t_start
    ep.segments = self.manager.segments(status=self.status, reason=self.reason,
                                        reward=ep.reward, turn_rewards=list(ep.turn_rewards),
                                        verdict=ep.verdict)
    for seg in ep.segments:  # a segment that a compaction cut says so
      last_turn = int(seg.turn_ids.max()) if len(seg.turn_ids) else -1
      if any(t > last_turn for t in self.compacted_at):
        seg.reason = "context_compacted"
    stamp(ep.segments, provenance(self.tokenizer, self.offered, self.cfg, ep.verdict,
                                  self.task))
    if self.log is not None:
      self.log.end(self.status, self.reason)
      self.log.close()
    return ep

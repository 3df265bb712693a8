"""Environment worker service: hosts environment sessions over HTTP (FastAPI on uvicorn).

  POST   /sessions                  {"task": {...}}    -> {"session_id", "observation"}
  POST   /sessions/{id}/step        {"action": "..."}  -> StepResult
  POST   /sessions/{id}/verify                         -> Verdict
  DELETE /sessions/{id}
  GET    /access                                       -> {"ok": true} (checks a token)
  GET    /health, GET /metrics (Prometheus)

With JAXAGENT_ENV_TOKEN set (the run's environment token, `jaxagent.control`: another
than the servers' control token), the session routes and /access answer only a call
whose X-Env-Token header holds it (401 otherwise); /health and /metrics are open.

A cap on sessions and on calls running at once, and a deadline per call on its
own work: a call past it answers 504 and its session is closed (its state is
unknown). Waits on shared infrastructure (a turn under the call cap, a sandbox
slot) are not charged to a call's deadline (other episodes' load must not turn
the policy's bounded work into a 504) and have bounds of their own, nor is the time of
the policy's sandboxed commands, which their wall limits bound (one that stalled its
own kill for a minute made a wrong answer a 504, re-rolled): a call that
gets no turn under the cap within a deadline (at least `STUCK_FLOOR_S`) in which no
call ended, nor a sandbox command, answers 503, unrun (a reset: within one deadline);
a command that gets no sandbox slot within the pool's `slot_timeout_s` (none freed
meanwhile) fails its episode as infrastructure (503); a call ends within
`WALL_FACTOR` deadlines of its own time and other waits (504; every answer says how
long that is, `call_wall_s`), its commands and its waits in queues that move (the
call cap's, a sandbox pool's, the source checks', a judge's) left out: the run's own load, which
makes a call slower, not cut (cut, a turn of four long commands on a crowded pool was
a 504, re-rolled instead of scored: red team 34; an episode's wall time counts them,
on the policy's side). `RemoteEnv`
waits `call_wall_s` and a margin for an answer, and on while the worker says the call
still runs; a client that goes away has its call cancelled and its session closed.
Every answer carries `infra_wait_s`, the
seconds the call waited (`infra_held_s` of them: other sessions' holds of the
worker's event loop, `envs.loopwatch`), and `GET /sessions/{id}/waits` those of the
call running now, which the agent charges to the infrastructure. Closing a session (DELETE,
the reaper, shutdown) cancels its running call before the environment closes. A session the
worker does not have (expired, closed, or the worker restarted) answers 404
naming it, never a hang. Sessions idle for `idle_timeout_s` since their last call's
end (or as long as their client asked at creation) are closed by a reaper; a session
whose creation was abandoned (deadline, client gone) is closed, not kept. Request
bodies are capped (`max_body_bytes`, 413). On shutdown (SIGTERM, Ctrl-C) every
session is closed and the sandbox pool removes its workspaces. `RemoteEnv` is the
client, with the same async methods as an in-process environment.

`python -m envs.server [--host 127.0.0.1] [--port 8100] [--sandboxes 8]`
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import subprocess
import sys
import time
import uuid
from typing import Awaitable, Optional

import httpx
from fastapi import FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from envs import waits
from envs.base import (BAD_TASK, ActionTooLarge, BadReward, CannotStart, EnvResources,
                       Observation, StepResult, TaskSpec, Verdict, VerdictStatus,
                       add_import_flag, cannot_start, check_reward, failure, json_safe,
                       load_modules, make)
from envs.loopwatch import LoopWatch
from jaxagent import control
from jaxagent.serve_http import BodyLimit, client_gone, control_guard, name_deep_bodies
from jaxagent.errors import InfraError
from jaxagent.tls import shared_tls

log = logging.getLogger(__name__)


class CreateBody(BaseModel):
  model_config = ConfigDict(extra="forbid")
  task: dict
  # How long the session may sit idle between calls before it is closed (the worker's
  # --idle-timeout-s when not given, at most its --max-idle-timeout-s): an agent waits
  # on its policy's turns between them, and those are as long as their tokens
  # (`RemoteEnv` asks for its episode's wall time).
  idle_timeout_s: Optional[float] = Field(None, gt=0, allow_inf_nan=False)


class StepBody(BaseModel):
  model_config = ConfigDict(extra="forbid")
  action: str


@dataclasses.dataclass
class _Session:
  env: object
  task: TaskSpec
  lock: asyncio.Lock
  last_used: float  # when a call of it started or ended
  idle_s: float  # closed after this long without a call
  call: Optional[asyncio.Future] = None  # the call started last (cancelled on close)
  clock: Optional[waits.WaitClock] = None  # its waits on shared infrastructure
  # Every call running (a second waits for the first's lock): all cancelled on close.
  calls: set = dataclasses.field(default_factory=set)
  # Whose calls' clocks are one's (`waits.measured`), from its reset on: a task its
  # environment started in one call holds the loop on the session's account in another.
  owner: object = dataclasses.field(default_factory=object)
  n_calls: int = 0  # calls started since its reset: the last one's number


# A call answers within this many deadlines of its own time and its waits, less its
# commands and its waits in queues that move (`waits.queued`; a client waits longer, and
# on while the worker says the call runs: `RemoteEnv`).
WALL_FACTOR = 2
# The shortest time a wait for a turn sees nothing move before it is refused as stuck:
# one sandboxed command may run that long (a grading run is 20 s, and its kill up to 10 s
# more; with a deadline of 8 s, a looping solution's grading made a sibling's call a 503:
# red team 35).
STUCK_FLOOR_S = 60.0
# A client waits this much past a worker's longest call for the answer (`RemoteEnv`).
CALL_MARGIN_S = 15.0


def waits_of(clock: Optional[waits.WaitClock]) -> dict:
  """A call's waits as its answer reports them (none for no call)."""
  if clock is None:
    return {"infra_wait_s": 0.0, "infra_held_s": 0.0}
  return {"infra_wait_s": round(clock.total_s(), 4), "infra_held_s": round(clock.held_s, 4)}


class _NoTurn(Exception):
  """A call waited for a turn under the worker's call cap while nothing moved (no call
  ended, no sandbox command) for its stuck window; a reset, for a deadline."""


def _encoded(kind: str, answer: dict) -> Response:
  """`answer` as JSON. A value the environment gave that JSON cannot carry (an object
  with nothing to write) is its bug: a 400 naming it (a NumPy value was a 500 after the
  call had run, read as the worker's failure and the episode re-rolled; a reviewer)."""
  try:  # (sets, dates, enums, paths: as FastAPI's encoder writes them, and NumPy's values)
    return Response(json.dumps(json_safe(jsonable_encoder(json_safe(answer))),
                               allow_nan=False), media_type="application/json")
  except (TypeError, ValueError, RecursionError) as e:
    raise HTTPException(400, f"{kind} failed: the environment's answer holds a value JSON "
                             f"cannot carry ({type(e).__name__}: {str(e)[:300]})") from None


def create_app(resources: Optional[EnvResources] = None, *, max_sessions: int = 256,
               max_concurrent_calls: int = 32, deadline_s: float = 60.0,
               idle_timeout_s: float = 300.0, max_idle_timeout_s: float = 7200.0,
               max_body_bytes: int = 8 << 20, token: Optional[str] = None,
               stuck_s: Optional[float] = None) -> FastAPI:
  """The worker's app. With `token` (the run's JAXAGENT_ENV_TOKEN, `jaxagent.control`),
  its session routes answer only a call whose X-Env-Token header holds it. A step or
  verify waiting for a turn under the call cap is refused as stuck (503) once nothing
  moved for `stuck_s` (default: the deadline, at least STUCK_FLOOR_S)."""
  resources = resources or EnvResources()
  token = token or None  # (blank is none)
  access = control_guard(token, control.ENVS)
  sessions: dict[str, _Session] = {}
  calls = asyncio.Semaphore(max_concurrent_calls)
  turns = {"ended": time.monotonic()}  # when a call last gave its turn back
  stuck_s = stuck_s if stuck_s is not None else max(deadline_s, STUCK_FLOOR_S)
  call_wall_s = WALL_FACTOR * deadline_s  # told to clients in every answer
  registry = CollectorRegistry()
  n_sessions = Gauge("env_sessions", "Open sessions", registry=registry)
  n_calls = Counter("env_calls", "Calls by kind and outcome", ["kind", "outcome"],
                    registry=registry)
  n_reaped = Counter("env_sessions_reaped", "Sessions closed for being idle", registry=registry)
  latency = Histogram("env_call_seconds", "Call latency", ["kind"], registry=registry)
  held = Counter("env_loop_held_seconds", "Seconds the event loop was held (a second or "
                 "more at a time) by code that did not await (envs.loopwatch)",
                 registry=registry)
  watch = LoopWatch(what="session", on_hold=held.inc)  # (names an env's code holding it)

  @contextlib.asynccontextmanager
  async def lifespan(app):
    async def reaper():
      while True:
        await asyncio.sleep(max(0.05, min(30.0, idle_timeout_s / 4)))
        await reap_idle()

    watch.start()  # (first: the tasks made after it are told apart, the reaper's too)
    task = asyncio.create_task(reaper())
    try:
      yield
    finally:
      watch.stop()
      task.cancel()
      for sid in list(sessions):  # shutdown: every session's workspace goes
        await close_session(sid)
      await asyncio.to_thread(resources.close)

  app = FastAPI(title="jaxagent environment worker", lifespan=lifespan)
  app.add_middleware(BodyLimit, limit=max_body_bytes)
  name_deep_bodies(app)

  starting: set[object] = set()  # the owners of sessions being started (resets under way)

  async def close_session(sid: str) -> None:
    s = sessions.pop(sid, None)
    n_sessions.set(len(sessions))
    if s is not None:
      running = [c for c in s.calls if not c.done()]
      for call in running:  # its client gave up (DELETE): every call running ends
        call.cancel()       # before the environment closes under it
      for call in running:
        with contextlib.suppress(BaseException):
          await call
      try:
        with waits.measured(owner=s.owner):  # (a close that holds the loop: the session's)
          await s.env.close()
      except Exception:  # (said: a close that failed may have left its workspace)
        log.exception("env worker: closing session %s failed", sid)

  async def reap_idle() -> None:
    now = time.time()
    for sid, s in list(sessions.items()):
      # A session with a call in flight is not idle, however long that call has waited
      # for a turn under the worker's cap (the lock is taken after the turn: a call
      # queued past the idle time had its session closed under it, a 409 its client
      # took for a bad call of its own; red team 52).
      if (now - s.last_used > s.idle_s and not s.lock.locked()
          and all(c.done() for c in s.calls)):
        n_reaped.inc()
        await close_session(sid)

  def get(sid: str) -> _Session:
    s = sessions.get(sid)
    if s is None:
      raise HTTPException(404, f"no session {sid!r} on this worker (closed, expired, or the "
                               "worker restarted)")
    s.last_used = time.time()
    return s

  async def guarded(kind: str, sid: Optional[str], coro_fn, owner: object = None):
    """Runs one call under the concurrency cap; returns its result and its waits (the
    answer's `infra_wait_s`, and `infra_held_s`: other calls' holds of the loop, of them).
    The deadline bounds the call's own work; its waits on shared infrastructure (a turn
    under the cap, a sandbox slot) are not charged to it (other episodes' load must not
    turn the policy's bounded work into a 504, dropped instead of scored) and have bounds
    of their own; the whole call ends within WALL_FACTOR deadlines, less the policy's
    commands (their wall limits bound them) and its waits in queues that move
    (`waits.queued`: the run's own load, which a turn of four 10 s commands on a crowded
    worker passed: a 504, re-rolled instead of scored; red team 34)."""
    t0 = time.perf_counter()

    async def capped():
      # One place in the queue, kept however long the wait (first come, first served).
      # A cap whose calls keep moving (ending, or their commands ending) is waited on as
      # long as it takes, as a sandbox pool's queue is: the run's own load, which makes
      # a call slower, not refused (a 503 after one deadline's wait re-rolled the
      # episodes of a crowded worker instead of scoring them). One where nothing moved
      # for a deadline is stuck: a 503.
      # A reset waits one deadline at most, as before (its client's patience is fixed,
      # and a start that fails is no answer of the policy's: re-rolled, unbiased).
      turn = asyncio.ensure_future(calls.acquire())
      window = deadline_s if kind == "reset" else stuck_s
      try:
        with waits.waiting(), waits.queued():
          while True:
            t_look = time.monotonic()
            done, _ = await asyncio.wait({turn}, timeout=window)
            if done:
              break
            # (a call moves while its commands do: round-robin on a crowded pool, every
            # call of the worker's ended together after minutes, 100 s past a deadline)
            if kind == "reset" or (turns["ended"] <= t_look
                                   and resources.slot_freed_at() <= t_look):
              raise _NoTurn(f"{kind} waited {window:.0f}s for a turn" + (
                  "" if kind == "reset" else ", and no call of the worker's ended, nor a "
                  "sandbox command, meanwhile") + f" (it runs {max_concurrent_calls} calls "
                  "at once)")
      except BaseException:
        turn.cancel()
        await asyncio.wait({turn})
        if not turn.cancelled() and turn.exception() is None:  # (got it meanwhile)
          calls.release()
        raise
      try:
        return await coro_fn()
      finally:
        turns["ended"] = time.monotonic()
        calls.release()

    # (the call is measured to its end: a hold of the loop by another call is credited
    # to its clock meanwhile, envs.loopwatch)
    s = sessions.get(sid) if sid is not None else None
    if sid is not None and s is None:  # (closed between its handler and here: a DELETE
      # that ran first did not see this call to end it, and it ran on a closed env)
      n_calls.labels(kind, "closed").inc()
      raise HTTPException(409, f"{kind}: the session was closed before this call ran")
    if s is not None and s.call is not None and not s.call.done():
      # One call a session at a time: the others waited for its lock holding places under
      # the cap, and 6 steps sent at once to one session held every place of a worker of
      # 4 (another session's 0.1 s step took 9.6 s; a reviewer).
      n_calls.labels(kind, "busy").inc()
      raise HTTPException(409, f"{kind}: call {s.n_calls} of this session is still under "
                               "way (a session's calls run one at a time)")
    with waits.measured(owner=s.owner if s is not None else owner) as clock:
      task = asyncio.ensure_future(capped())
      number = None
      if s is not None:
        s.n_calls += 1
        number = s.n_calls
        s.call, s.clock = task, clock
        s.calls.add(task)
        task.add_done_callback(s.calls.discard)
      async def not_its_own() -> float:  # (a kill a command stalls is the policy's; red
        return clock.not_own_s()           # team 44)

      try:
        out = await waits.within(
            task, not_its_own, deadline_s, WALL_FACTOR * deadline_s, t0,
            unwalled=lambda: clock.queued_total_s() + clock.commands_total_s())
      except asyncio.CancelledError:
        if asyncio.current_task().cancelling():  # (this request's own: its client went)
          raise
        # (the call's, by a DELETE of its session: a plain 500 before, red team 14)
        n_calls.labels(kind, "closed").inc()
        raise HTTPException(409, f"{kind}: the session was closed during this call")
      except (waits.DeadlineCut, waits.WallCut):  # (the environment's own TimeoutError: below)
        n_calls.labels(kind, "deadline").inc()
        if sid is not None:
          await close_session(sid)
        raise HTTPException(504, f"{kind} exceeded the {deadline_s:.0f}s deadline of its "
                                 f"own time ({clock.total_s():.1f}s waiting on sandbox slots, "
                                 f"turns and the like and {clock.commands_total_s():.1f}s of "
                                 "sandboxed commands not counted) or its "
                                 f"{WALL_FACTOR * deadline_s:.0f}s wall (all but the commands "
                                 f"and {clock.queued_total_s():.1f}s in queues that moved); "
                                 "the session was closed")
      except _NoTurn as e:
        n_calls.labels(kind, "busy").inc()
        raise HTTPException(503, str(e))
      except HTTPException:
        raise
      except InfraError as e:  # a sandbox the worker could not run: the worker's failure
        n_calls.labels(kind, "infra").inc()
        raise HTTPException(503, f"{kind} failed in the infrastructure: {e}")
      except (MemoryError, OSError, subprocess.SubprocessError) as e:  # this worker's host
        # (a full disk, a mount or a command that failed, a network timeout), not the
        # environment's code
        n_calls.labels(kind, "infra").inc()
        raise HTTPException(503, f"{kind} failed in the infrastructure: {failure(e)}")
      except Exception as e:  # the environment's bug (or its task's): named where it was
        # raised, and kept serving. (A 500 was read as the infrastructure's: a verdict whose
        # status was misspelt was re-rolled 365 times until the run stopped blaming the
        # workers; a new user.)
        n_calls.labels(kind, "bad_request" if isinstance(e, (ValueError, KeyError))
                       else "error").inc()
        raise HTTPException(400, f"{kind} failed: {failure(e)}")
      finally:
        if s is not None:  # idle from the call's end on (it ran as long as it ran)
          s.last_used = time.time()
    n_calls.labels(kind, "ok").inc()
    latency.labels(kind).observe(time.perf_counter() - t0)
    # (the agent charges them elsewhere; the call's number tells it which calls' waits
    # it has counted: `RemoteEnv.in_flight_waits`)
    return out, {**waits_of(clock), **({"call": number} if number is not None else {})}

  @app.get("/health")
  async def health():
    return {"status": "ok", "sessions": len(sessions), "max_sessions": max_sessions,
            "call_wall_s": call_wall_s, "env_token": token is not None}

  @app.get("/access", dependencies=access)
  async def check_access():
    """A guarded call that changes nothing: a client checks its token with it."""
    return {"ok": True}

  @app.get("/metrics")
  async def metrics():
    return PlainTextResponse(generate_latest(registry).decode(),
                             media_type="text/plain; version=0.0.4")

  async def heard(kind: str, sid: str, coro_fn, http: Request, owner: object = None):
    """`guarded(kind, sid, coro_fn)` raced against its client's going: a client that goes
    away (or whose answer has no reader) has the call cancelled and the session closed
    (its state is unknown in the middle of a call), as is a session a reset registered
    whenever the answer does not carry it. A reset's client that gave up never learns
    the session (kept, it held a slot and a workspace for its idle time: red team 22); a
    step's or verify's held its turn and sandbox slot until a DELETE (the wall no longer
    bounds a call's commands and queue: a reviewer)."""
    call = asyncio.ensure_future(guarded(kind, None if kind == "reset" else sid, coro_fn,
                                         owner))
    gone = asyncio.ensure_future(client_gone(http))
    try:
      await asyncio.wait([call, gone], return_when=asyncio.FIRST_COMPLETED)
      if not call.done() or gone.done():  # (both at once: the answer has no reader)
        n_calls.labels(kind, "abandoned").inc()
        raise HTTPException(499, f"{kind}: the client went away before the answer")
      return call.result()
    except BaseException as e:
      if kind == "reset" or not call.done() or getattr(e, "status_code", None) == 499:
        call.cancel()
        await waits.to_the_end(asyncio.wait([call]))
        await waits.to_the_end(close_session(sid))
      raise
    finally:
      gone.cancel()

  @app.post("/sessions", dependencies=access)
  async def create(body: CreateBody, http: Request):
    await reap_idle()
    # (the sessions starting count: a limit checked before the resets' awaits let 12
    # concurrent starts past a limit of 4, red team 14)
    if len(sessions) + len(starting) >= max_sessions:
      raise HTTPException(503, f"worker is at its session limit ({max_sessions})")
    try:
      task = TaskSpec.from_dict(body.task)
    except ValueError as e:
      raise HTTPException(400, str(e))
    sid = uuid.uuid4().hex

    async def start():
      try:
        env = make(task.env, resources)
      except KeyError as e:  # an environment this worker has not imported: the task's
        why = e.args[0] if e.args else str(e)  # (said alone: not where the plumbing raised it)
        raise CannotStart(f"task {task.id!r} cannot start: {why}", why) from None
      try:
        obs = await env.reset(task)
      except BaseException as e:  # failed or abandoned (deadline): nothing is kept
        await waits.to_the_end(env.close())
        if isinstance(e, BAD_TASK):  # parameters of the wrong type or shape: the task's
          raise cannot_start(task, e) from e
        raise
      # (a client's ask is capped: a learner killed with its sessions open holds the
      # worker's session slots that long)
      idle_s = min(body.idle_timeout_s, max_idle_timeout_s) if body.idle_timeout_s \
          else idle_timeout_s
      sessions[sid] = _Session(env, task, asyncio.Lock(), time.time(), idle_s, owner=owner)
      # (counted as started here, where it is registered: counted in both until the
      # handler woke, a rush's third start was refused at a limit of 3; a CI failure)
      starting.discard(owner)
      n_sessions.set(len(sessions))
      return obs, float(env.cut_reward)

    # (raced against the client's going, `heard`: a session its reset registered is
    # closed whenever the answer does not carry it, as when a reset ended as the deadline
    # cut it, or its handler was cancelled at shutdown)
    owner = object()  # (the session's, its reset's call included)
    starting.add(owner)
    try:
      (obs, cut_reward), waited = await heard("reset", sid, start, http, owner=owner)
    finally:
      starting.discard(owner)
    try:
      return _encoded("reset", {"session_id": sid, "observation": dataclasses.asdict(obs),
                                **waited, "call_wall_s": call_wall_s,
                                "cut_reward": cut_reward})
    except HTTPException:  # (its session is not the client's: closed, not left to idle)
      await waits.to_the_end(close_session(sid))
      raise

  @app.post("/sessions/{sid}/step", dependencies=access)
  async def step(sid: str, body: StepBody, http: Request):
    s = get(sid)

    async def run():
      async with s.lock:
        return await s.env.step(body.action)

    result, waited = await heard("step", sid, run, http)
    return _encoded("step", {**dataclasses.asdict(result), **waited,
                             "call_wall_s": call_wall_s})

  @app.post("/sessions/{sid}/verify", dependencies=access)
  async def verify(sid: str, http: Request):
    s = get(sid)

    async def run():
      async with s.lock:
        return await s.env.verify()

    verdict, waited = await heard("verify", sid, run, http)
    return _encoded("verify", {**verdict.to_dict(), **waited, "call_wall_s": call_wall_s})

  @app.get("/sessions/{sid}/waits", dependencies=access)
  async def session_waits(sid: str):
    """The waits on shared infrastructure of the session's latest call, running or not
    (an agent whose deadline passed during a call asks how much of it was waiting)."""
    s = get(sid)
    return {"session_id": sid, **waits_of(s.clock),
            "running": s.call is not None and not s.call.done(), "call": s.n_calls}

  @app.delete("/sessions/{sid}", dependencies=access)
  async def delete(sid: str):
    get(sid)
    await close_session(sid)
    return {"session_id": sid, "closed": True}

  app.state.sessions = sessions
  return app


class _Refused(RuntimeError):
  """The worker refused a call (4xx): a bad call of ours, a task that cannot start, or
  the environment's bug there (its message names the line that raised, on the worker:
  `on_worker`, for the run's message)."""

  on_worker = True

  def __init__(self, status_code: int, message: str):
    super().__init__(message)
    self.status_code = status_code


class SessionLost(InfraError):
  """The worker no longer has this session (it restarted, or dropped it)."""

  def __init__(self, message: str):
    super().__init__("env_session_lost", message)


class RemoteEnv:
  """An environment hosted by an `envs.server` worker; same methods as `Env`.

  A call waits `timeout_s` for its answer, or longer for a worker whose calls may take
  longer (its `call_wall_s`, in every answer, learnt per worker URL): a worker started
  with a long `--deadline-s` answers a slow call itself instead of the client giving up
  on a call that was within its deadline. A step or verify is waited on past that while
  the worker says it still runs (its commands and its queue for sandbox slots are not
  bounded by the worker's wall); a worker that does not say so is infrastructure. Its
  calls carry `token` (None: this process's JAXAGENT_ENV_TOKEN, `jaxagent.control`)."""

  # Per worker URL, its wall (WALL_FACTOR deadlines): past it and a margin, the client
  # asks whether the call still runs.
  _call_walls: dict[str, float] = {}
  # The worker URLs this process found unreachable, said once an outage (a worker killed
  # for 15 s was seen only in a step's time and its drops' counts: a new user).
  _unreachable: set[str] = set()

  def __init__(self, url: str, *, timeout_s: float = 180.0,
               client: Optional[httpx.AsyncClient] = None,
               idle_timeout_s: Optional[float] = None, token: Optional[str] = None):
    self.url = url.rstrip("/")
    self._headers = control.ENVS.headers(token or control.ENVS.from_env())
    self.timeout_s = timeout_s
    # How long the worker keeps the session between calls (its own default if None): an
    # episode's agent asks for its wall time, the longest its policy's turns can take.
    self.idle_timeout_s = idle_timeout_s
    self._client = client  # our own is opened on first use and closed with the session
    self._own_client = client is None
    self.session_id: Optional[str] = None
    self.done = False
    self.infra_wait_s = 0.0  # what the worker reported its calls waited on its load
    self._answered = 0  # the session's last call whose answer was counted (its number)
    self.infra_held_s = 0.0  # of it, other sessions' holds of the worker's event loop
    # The waits of the call this client last gave up, as its worker said them then.
    self._cut_waits: Optional[tuple[float, float]] = None
    # The session's tool counters (`Env.counters`), from its steps' info where the
    # environment reports them there (`Env._info`).
    self.counters = {"tool_calls": 0, "invalid_tool_calls": 0, "tool_errors": 0}

  async def _call(self, method: str, path: str, **kw) -> dict:
    """One call to the worker. A worker that is unreachable, too slow, or fails (5xx) is
    infrastructure (`InfraError`); a 4xx is a bad call of ours (a bug) and raises
    RuntimeError."""
    if self._client is None:
      self._client = httpx.AsyncClient(timeout=self.timeout_s, verify=shared_tls())
    patience = max(self.timeout_s, self._call_walls.get(self.url, 0.0) + CALL_MARGIN_S)
    self._cut_waits = None  # (an earlier call's, never asked for)
    kw.setdefault("headers", self._headers)
    # (a step's or verify's answer is waited on as long as the worker says it runs)
    runs_on = self.session_id is not None and path.startswith(f"/sessions/{self.session_id}/")
    kw.setdefault("timeout", httpx.Timeout(None, connect=10.0) if runs_on else patience)
    try:
      sent = self._client.request(method, self.url + path, **kw)
      r = await (self._answer(sent, patience, path) if runs_on else sent)
    except httpx.HTTPError as e:
      if (isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout))
          and self.url not in self._unreachable):
        self._unreachable.add(self.url)
        log.warning(f"environment worker {self.url} is unreachable ({type(e).__name__}: "
                    f"{e}): its episodes are dropped as the infrastructure's and their "
                    "tasks played again")
      raise InfraError("env_worker", f"{self.url}{path}: {type(e).__name__}: {e}") from e
    if self.url in self._unreachable and r.status_code < 500:  # (not a proxy's 502)
      self._unreachable.discard(self.url)
      log.warning(f"environment worker {self.url} answers again")
    try:
      out = r.json() if r.headers.get("content-type", "").startswith("application/json") \
          else None
    except ValueError:  # (said JSON and is not)
      out = None
    detail = out.get("detail", r.text) if isinstance(out, dict) else r.text[:500]
    if r.status_code == 404 and self.session_id and self.session_id in path:
      if not isinstance(out, dict):  # (not the worker's: a proxy's page; a reviewer)
        raise InfraError("env_worker", f"{self.url}{path}: 404 not from the worker: {detail}")
      raise SessionLost(detail)
    if r.status_code >= 400:
      message = f"env worker {self.url}{path}: {r.status_code}: {detail}"
      if r.status_code >= 500:
        raise InfraError("env_worker", message)
      raise _Refused(r.status_code, message)
    if not isinstance(out, dict):  # (a proxy's page, or no worker's answer: a reviewer)
      raise InfraError("env_worker", f"{self.url}{path}: {r.status_code} with no worker's "
                                     f"answer: {r.text[:200]!r}")
    if isinstance(out, dict):  # (always, now)
      self.infra_wait_s += float(out.get("infra_wait_s", 0.0))
      self.infra_held_s += float(out.get("infra_held_s", 0.0))
      number = out.pop("call", None)
      if type(number) is int:  # (a call of this session's whose waits are counted now)
        self._answered = max(self._answered, number)
      wall = out.pop("call_wall_s", None)
      if isinstance(wall, (int, float)) and math.isfinite(wall) and wall > 0:
        self._call_walls[self.url] = float(wall)
    return out

  async def _answer(self, request: Awaitable[httpx.Response], patience_s: float,
                    path: str) -> httpx.Response:
    """The answer to the session's call `request`, waited on `patience_s` at a time for
    as long as the worker says the session's call still runs (`GET
    /sessions/{id}/waits`); InfraError when it does not say so (a worker that lost the
    call, or one too stuck to answer that)."""
    sent = asyncio.ensure_future(request)
    try:
      while True:
        done, _ = await asyncio.wait({sent}, timeout=patience_s)
        if done:
          return sent.result()
        if not await self._runs():  # (ended meanwhile: its answer may be on its way)
          done, _ = await asyncio.wait({sent}, timeout=CALL_MARGIN_S)
          if done:
            return sent.result()
          raise InfraError("env_worker", f"{self.url}{path}: no answer in {patience_s:.0f} s, "
                           "and the worker does not say that the call still runs")
    finally:
      if not sent.done():
        # (asked before the request goes: a worker cancels a call whose client went away
        # and closes its session, and an episode cut at its deadline then asks what the
        # call waited: 0, and the crowd's waits were read as the policy's own time)
        self._cut_waits = await self._ask_waits()
        sent.cancel()
        await asyncio.wait({sent})

  async def _waits_now(self, timeout_s: float) -> dict:
    """The worker's `GET /sessions/{id}/waits` answer for this session ({} when it gives
    none: no session, unreachable, an error, not an object)."""
    if self.session_id is None or self._client is None:
      return {}
    try:
      r = await self._client.get(f"{self.url}/sessions/{self.session_id}/waits",
                                 timeout=timeout_s, headers=self._headers)
      out = r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
      return {}
    return out if isinstance(out, dict) else {}

  async def _runs(self) -> bool:
    """Whether the worker says the session's call is running (False when it cannot)."""
    return (await self._waits_now(CALL_MARGIN_S)).get("running") is True

  async def in_flight_waits(self) -> tuple[float, float]:
    """How long the call now running on the worker for this session (one whose client
    gave up: an episode deadline) has waited on shared infrastructure, and how much of
    that was other sessions' holds of the worker's event loop; 0 if unknown. For a call
    this client gave up, what the worker said as it did (`_answer`)."""
    if self._cut_waits is not None:
      cut, self._cut_waits = self._cut_waits, None
      return cut
    return await self._ask_waits()

  async def _ask_waits(self) -> tuple[float, float]:
    """What the worker says the session's latest call has waited (`in_flight_waits`)."""
    out = await self._waits_now(5.0)
    # A call that ended reported its waits in its answer, unless that answer has not been
    # counted here: cut client-side as the call ended (its answer discarded), or still on
    # its way. Its waits were lost, and an episode's 3 s wait was read as its own time (a
    # deadline judged in that moment; CI, under load).
    if not out.get("running"):
      ended = out.get("call")
      if type(ended) is not int or ended <= self._answered:
        return 0.0, 0.0
    try:
      return float(out["infra_wait_s"]), float(out.get("infra_held_s", 0.0))
    except (KeyError, ValueError, TypeError):
      return 0.0, 0.0

  async def reset(self, task: TaskSpec) -> Observation:
    if self.session_id is not None:
      await self.close()
    try:
      body = {"task": task.to_dict()}
      if self.idle_timeout_s is not None:
        body["idle_timeout_s"] = self.idle_timeout_s
      out = await self._call("POST", "/sessions", json=body)
    except _Refused as e:
      if e.status_code == 400 and "cannot start" in str(e):  # the task's (TaskError)
        raise CannotStart(str(e)) from None
      raise
    self.session_id = out["session_id"]
    self._answered = 0  # (a new session's calls are numbered from 1)
    # (the worker's environment's; a worker from before it says none: 0)
    self.cut_reward = out.get("cut_reward", 0.0)
    check_reward(self.cut_reward, f"the worker's environment {task.env!r}'s cut_reward")
    self.done = False
    self.counters = dict.fromkeys(self.counters, 0)
    return Observation(**out["observation"])

  async def _env_call(self, path: str, **kw) -> dict:
    """A step or verify: a reward the worker's environment gave that is not a number is
    BadReward here too (the run names the task), not a refused call of ours."""
    try:
      return await self._call("POST", path, **kw)
    except _Refused as e:
      if e.status_code == 400 and "BadReward: " in str(e):
        raise BadReward(str(e)) from None
      raise

  async def step(self, action: str) -> StepResult:
    try:
      out = await self._env_call(f"/sessions/{self.session_id}/step", json={"action": action})
    except _Refused as e:
      if e.status_code == 413:
        raise ActionTooLarge(f"{e} (an action of {len(action)} characters)") from None
      raise
    self.done = out["terminated"] or out["truncated"]
    info = out.get("info")
    if isinstance(info, dict):  # (the environment's tool counters, as its steps tell them)
      self.counters.update({k: info[k] for k in self.counters
                            if isinstance(info.get(k), int) and not isinstance(info[k], bool)})
    return StepResult(Observation(**out["observation"]), out["reward"], out["terminated"],
                      out["truncated"], out["info"])

  async def verify(self) -> Verdict:
    out = await self._env_call(f"/sessions/{self.session_id}/verify")
    out.pop("infra_wait_s", None)
    out.pop("infra_held_s", None)
    out["status"] = VerdictStatus(out["status"])
    return Verdict(**out)

  async def close(self) -> None:
    """Ends the session on the worker, and closes our own HTTP client."""
    if self.session_id is not None:
      sid, self.session_id = self.session_id, None
      try:
        await self._call("DELETE", f"/sessions/{sid}")
      except RuntimeError:  # (InfraError too) the session is gone either way
        pass
    if self._own_client and self._client is not None:
      client, self._client = self._client, None
      await client.aclose()

  aclose = close


async def wait_workers(urls, timeout_s: float, say=print) -> None:
  """Returns once every worker at `urls` answers /health with 200; says once which it
  waits for (and why); InfraError after `timeout_s`; ValueError at once for a URL that
  answers /health as something else than an environment worker (a rollout server, or
  a 404: a wrong path)."""
  urls = list(dict.fromkeys(u.rstrip("/") for u in urls))
  deadline, said = time.monotonic() + timeout_s, set()

  async def up(client: httpx.AsyncClient, url: str) -> Optional[str]:
    """None once `url` answers as a worker; else what it answered."""
    try:
      r = await client.get(f"{url}/health")
    except httpx.HTTPError as e:
      return f"{type(e).__name__}: {e}"
    if r.status_code == 404:
      raise ValueError(f"{url}/health is not found there (404): not an environment "
                       "worker's URL (python -m envs.server)")
    if r.status_code != 200:
      return f"HTTP {r.status_code}: {r.text[:200]}"
    try:
      health = r.json()
    except ValueError:
      health = None
    if not (isinstance(health, dict) and "call_wall_s" in health):
      raise ValueError(f"{url} answers /health but is not an environment worker "
                       f"(python -m envs.server): {r.text[:200]}")
    return None

  async with httpx.AsyncClient(timeout=5.0, verify=shared_tls()) as client:
    while urls:  # (all at once: a round costs one timeout, not one a worker)
      answers = await asyncio.gather(*(up(client, url) for url in urls))
      waiting = []
      for url, last in zip(urls, answers):
        if last is None:
          if url in said:
            say(f"{url} is ready")
          continue
        if time.monotonic() >= deadline:
          raise InfraError("env_worker", f"{url}/health did not answer 200 within "
                           f"{timeout_s:g} s (env.startup_wait_s; last: {last})")
        if url not in said:
          say(f"waiting up to {timeout_s:g} s for the environment worker {url} to be "
              f"ready ({last})")
          said.add(url)
        waiting.append(url)
      urls = waiting
      if urls:
        await asyncio.sleep(min(2.0, max(0.0, deadline - time.monotonic())))


def access_problem(urls, token: Optional[str], timeout_s: float = 5.0) -> Optional[str]:
  """What stops a process holding the environment token `token` from opening sessions on
  the workers at `urls` (their `GET /access`): one whose token it lacks or holds another
  of. None: nothing it can tell (a worker not up yet is left to its episodes' calls)."""
  from concurrent.futures import ThreadPoolExecutor

  key = control.ENVS

  def ask(url: str) -> Optional[str]:
    url = url.rstrip("/")
    try:
      with httpx.Client(timeout=timeout_s, verify=shared_tls()) as client:
        r = client.get(f"{url}/access", headers=key.headers(token))
    except httpx.HTTPError:
      return None
    if r.status_code not in (401, 403):
      return None
    if not token:
      return (f"environment worker {url} takes a token ({key.header}) on its session "
              f"routes and this process has none: give it the workers' {key.env}")
    return (f"environment worker {url} refuses this process's token: its {key.env} "
            "differs from the workers'")

  urls = list(dict.fromkeys(urls))
  if not urls:
    return None
  with ThreadPoolExecutor(min(16, len(urls))) as pool:
    return next((p for p in pool.map(ask, urls) if p), None)


def main(argv=None) -> int:
  from jaxagent.cli_args import log_to_console, positive_float, positive_int
  from jaxagent.serve_http import add_log_level, listen_or_say, serve

  log_to_console()

  p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m envs.server", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument(control.OPEN_FLAG, action="store_true",
                 help="serve the session routes without a token beyond this machine")
  p.add_argument("--port", type=int, default=8100)
  p.add_argument("--sandboxes", type=positive_int, default=8)
  p.add_argument("--max-sessions", type=positive_int, default=256)
  p.add_argument("--max-concurrent-calls", type=positive_int, default=32)
  p.add_argument("--deadline-s", type=positive_float, default=60.0)
  p.add_argument("--idle-timeout-s", type=positive_float, default=300.0,
                 help="close sessions idle this long (since their last call's end)")
  p.add_argument("--max-idle-timeout-s", type=positive_float, default=7200.0,
                 help="the longest idle time a client may ask for its session (an agent "
                      "asks for its episode's wall time, three agent.episode_deadline_s)")
  p.add_argument("--max-body-bytes", type=positive_int, default=8 << 20)
  p.add_argument("--workspace-root", default=None,
                 help="directory for sandbox workspaces (default: a new temporary one)")
  p.add_argument("--host-oom-is-infra", action="store_true",
                 help="this host's memory is this worker's (no other worker or large "
                      "process on it): a command the host's OOM killer takes, while its "
                      "sandbox never reached its own memory limit, is an infrastructure "
                      "error (re-rolled), where the sandboxes' limits fit the memory free "
                      "at start; otherwise it is the command's own failure")
  p.add_argument("--cgroup", action="append", default=[], metavar="DIR",
                 help="a cgroup delegated to this worker (a v1 memory or cpu hierarchy "
                      "directory it owns, or a v2 directory with memory and cpu in its "
                      "cgroup.subtree_control; repeat for v1's two): each sandbox's "
                      "processes are held to their memory and CPU limits together in a "
                      "cgroup made below it. Needed for that bound where the worker is "
                      "not root (docs/environments.md)")
  p.add_argument("--workspace-filesystem", choices=("auto", "own", "disk"), default="auto",
                 help="a worker that is not root: each workspace a tmpfs of the sandbox "
                      "limits' disk_bytes, held in a user namespace of the worker's (own), "
                      "or a folder on the host's disk that a watch of each command bounds "
                      "(disk); auto: own where the kernel allows it (a root worker's "
                      "workspaces are always a tmpfs)")
  p.add_argument("--allow-unisolated", action="store_true",
                 help="run tool code with resource limits only where the host cannot isolate "
                      "it (no bubblewrap, not root): it can then read and write this host")
  add_import_flag(p)
  add_log_level(p)
  args = p.parse_args(argv)
  problem = control.env_problem()
  if problem:
    print(f"error: {problem}", file=sys.stderr)
    return 2
  from envs.sandbox import IsolationUnavailable

  try:
    names = load_modules(args.imports)
  except ValueError as e:
    print(f"envs.server: --import {e}", file=sys.stderr)
    return 2

  unguarded = control.open_beyond_this_machine(control.ENVS, control.ENVS.from_env(),
                                                args.host)
  if unguarded and not args.open_routes:
    print(f"envs.server: {unguarded}", file=sys.stderr)
    return 2
  sock = listen_or_say(args.host, args.port, "envs.server")
  if sock is None:
    return 2
  resources = EnvResources(sandboxes=args.sandboxes, allow_unisolated=args.allow_unisolated,
                           host_oom_is_infra=args.host_oom_is_infra,
                           sandbox_root=args.workspace_root, cgroups=tuple(args.cgroup),
                           own_filesystem={"auto": None, "own": True, "disk": False}[
                               args.workspace_filesystem])
  try:
    pool = resources.pool()
  except (IsolationUnavailable, ValueError, OSError) as e:
    sock.close()
    print(f"envs.server: {e}", file=sys.stderr)
    return 2
  print(f"envs.server: sandbox isolation {pool.isolation}, {args.sandboxes} commands at once "
        f"({pool.memory_bound() >> 20} MiB of memory at most, {pool.host_memory >> 20} MiB "
        f"free), workspaces under {pool.root}, each on {pool.filesystem} of "
        f"{pool.limits.disk_bytes >> 20} MiB"
        + (f"; each sandbox's {' and '.join(pool.cgroup_controllers)} held together in "
           f"cgroups below {', '.join(pool.cgroup_parents)}" if pool.cgroup_parents else "")
        + (f"; environments imported: {', '.join(names)}" if names else ""),
        file=sys.stderr, flush=True)
  if os.geteuid() != 0 and not pool.cgroup_parents:
    print("envs.server: not root and no --cgroup: a sandbox's memory is bounded process by "
          "process (RLIMIT_AS), not for all its processes together, and not the kernel's "
          "buffers they hold; give the worker a delegated cgroup (--cgroup) or run it "
          "where a memory limit of its own contains it (docs/environments.md)",
          file=sys.stderr, flush=True)
  token = control.ENVS.from_env()
  print(f"envs.server: {control.ENVS.describe(token)}", file=sys.stderr, flush=True)
  app = create_app(resources, max_sessions=args.max_sessions,
                   max_concurrent_calls=args.max_concurrent_calls, deadline_s=args.deadline_s,
                   idle_timeout_s=args.idle_timeout_s,
                   max_idle_timeout_s=args.max_idle_timeout_s,
                   max_body_bytes=args.max_body_bytes, token=token)
  from jaxagent.pools import busy_calls, end_process

  code = 0
  try:
    serve(app, sock, log_level=args.log_level)
  except SystemExit as e:  # (Ctrl-C: 130)
    code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    raise
  except BaseException:
    code = 1
    raise
  finally:
    resources.close()
    if busy_calls():  # (a tool's plain function blocked for ever: Python's exit joined it,
      # and the worker outlived its Ctrl-C or SIGTERM)
      end_process(code, "envs.server")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""HTTP API of a rollout server (FastAPI on uvicorn).

- `POST /generate`: token ids in; token ids, log-probs, versions, finish reason out.
- `POST /v1/chat/completions`: OpenAI-compatible, with `tools` / `tool_calls`
  and optional streaming. An `X-Session-Id` header groups the calls of one
  agent session; each call is recorded as a turn (prompt ids, output ids,
  log-probs, versions, finish reason) and `GET /sessions/{id}` returns them.
- `POST /v1/messages`: Anthropic-compatible (`rollout_server.anthropic_api`), with
  `tool_use` / `tool_result` blocks and streaming events, rendered and recorded as
  the chat completions are (the same `X-Session-Id` header).
- `POST /v1/responses`: OpenAI's Responses API (`rollout_server.responses_api`): input
  items, function calls and their outputs, `previous_response_id`, streaming events,
  rendered and recorded as the chat completions are.
- `POST /v1/score`: token ids in; each token's log-prob under a model out (a frozen
  reference's or a teacher's view of sampled tokens).
- `POST /abort`, `POST /update_weights`, `GET /health`, `GET /metrics` (Prometheus).
- `POST /handover`: a session's turns that ran on another server (a router's, at a
  failover): the session's next call here continues their tokens.

A server may host more models beside its policy (`models:` in its config: a frozen
reference, a teacher, a judge): `model` in a request names one (`/generate`,
`/v1/score`, `/update_weights` refuse names they do not serve; the chat gateways serve
the policy under any other name, as OpenAI clients always send one).

Bad requests get a 4xx naming what is wrong; nothing a request does stops the server.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json
import os
import re
import time
import uuid
from typing import Annotated, Literal, Optional, Union

from fastapi import APIRouter, FastAPI, HTTPException, Query, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from jaxagent.config import ServerConfig
from jaxagent.errors import PROMPT_TOO_LONG
from jaxagent.serve_http import (BodyLimit, EndedStream, client_gone, control_guard,
                                 name_deep_bodies)
from jaxagent.tokenizer import Tokenizer, clean_unicode, renders_tools, tool_names
from jaxagent.toolcalls import parameters_problem
from rollout_server import anthropic_api, responses_api
from rollout_server.chat import (SEED, TEMPERATURE, TOKEN_ID, TOP_K, TOP_P, ChatTurn, Name,
                                 OpenAIRoute, TurnCut, bound_unrendered, continued_prompt,
                                 normalise_messages, unserved, with_sampled_arguments)
from rollout_server.engine import SamplingParams
from rollout_server.orchestrator import (EngineDead, Orchestrator, PromptTooLong, QueueFull,
                                         Request, progress_of)
from rollout_server.routing import MAX_SCORE_TOKENS, error_body
from rollout_server.sessions import (MAX_HEADS, MAX_REPLIES, SessionStore, session_header,
                                     session_of)



# A tool's name: OpenAI's rule (letters, digits, '_' and '-', at most 64) with '.', ':' and
# '/' (namespaced tools, MCP's) and up to 128. A quote, a backslash or a newline in one
# was written escaped, and the call was refused as a template that does not render tools
# (red team 113).
TOOL_NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")


def schema_problem(tools: list[dict]) -> Optional[str]:
  """What is wrong with the first tool whose `parameters` is not a valid JSON Schema (by
  its `$schema`'s draft, 2020-12 where it names none), or None. A schema with a typo
  (`"type": "objekt"`) was written into the prompt as sent: the model sampled, and was
  trained, on a tool it could not call rightly (a new user)."""
  for i, tool in enumerate(tools):
    spec = tool.get("function", tool) if isinstance(tool, dict) else None
    params = spec.get("parameters") if isinstance(spec, dict) else None
    if params is None:
      continue
    problem = parameters_problem(params)
    if problem is not None:
      return f"tools[{i}] ({spec.get('name')!r}): {problem}"
  return None

# -- request bodies -----------------------------------------------------------------------


class SamplingBody(BaseModel):
  model_config = ConfigDict(extra="forbid", strict=True)
  temperature: float = TEMPERATURE
  top_p: float = TOP_P
  top_k: int = TOP_K
  max_new_tokens: int = Field(64, ge=1)
  stop_token_ids: list[Annotated[int, TOKEN_ID]] = Field(default_factory=list)
  seed: Optional[int] = SEED


class GenerateBody(SamplingBody):
  input_ids: list[Annotated[int, TOKEN_ID]] = Field(min_length=1)
  # The last n input ids are a cut turn's output, resumed (`Orchestrator.submit`).
  resumed_tokens: int = Field(0, ge=0)
  request_id: Optional[Name] = None
  session_id: Optional[Name] = None
  model: Optional[Name] = None

  # Record the turn in its session (`GET /sessions/{id}`); false: the session id only
  # routes it (the built-in agent keeps its own record: its turns would fill the store).
  record: bool = True


class ScoreBody(BaseModel):
  model_config = ConfigDict(extra="forbid", strict=True)
  input_ids: list[Annotated[list[Annotated[int, TOKEN_ID]], Field(min_length=1)]] = Field(
      min_length=1, max_length=1024)
  model: Optional[Name] = None
  temperature: float = Field(1.0, gt=0.0, le=100.0)


class AbortBody(BaseModel):
  request_id: str


class UpdateWeightsBody(BaseModel):
  model_config = ConfigDict(extra="forbid", strict=True)
  path: Name  # (a lone surrogate was a 400 of a codec's words)
  version: Optional[int] = None
  mode: Optional[str] = None
  model: Optional[Name] = None


class HandedReply(BaseModel):
  model_config = ConfigDict(extra="forbid")
  output_ids: list[Annotated[int, TOKEN_ID]] = Field(min_length=1)
  response: Optional[dict] = None


class HandedTurn(BaseModel):
  model_config = ConfigDict(extra="forbid")
  prompt_ids: list[Annotated[int, TOKEN_ID]] = Field(min_length=1)
  messages: list[dict] = Field(min_length=1)
  tools: Optional[list[dict]] = None
  replies: list[HandedReply] = Field(min_length=1, max_length=MAX_REPLIES)


class HandoverBody(BaseModel):
  """A session's threads that ran on another server (`SessionStore.handover`)."""
  model_config = ConfigDict(extra="forbid")
  session_id: Name
  turns: list[HandedTurn] = Field(min_length=1, max_length=2 * MAX_HEADS)


class FunctionDef(BaseModel):
  model_config = ConfigDict(extra="allow")  # (strict, and what else a schema carries)
  name: str = Field(min_length=1)
  description: Optional[str] = None
  parameters: Optional[dict] = None


class ToolDef(BaseModel):
  model_config = ConfigDict(extra="forbid")
  type: Literal["function"]
  function: FunctionDef


class ChatBody(BaseModel):
  # Unknown OpenAI fields (user, metadata, ...) are accepted and ignored; those that would
  # change the answer and are not served (tool_choice other than auto, top_logprobs,
  # chat.UNSERVED: logit_bias, penalties, response_format, ...) are refused rather than
  # ignored.
  model_config = ConfigDict(extra="allow", strict=True)
  messages: list[dict] = Field(min_length=1)
  model: Optional[Name] = None
  tools: Optional[list[dict]] = None
  tool_choice: Optional[Union[str, dict]] = None
  top_logprobs: Optional[int] = None
  temperature: float = TEMPERATURE
  top_p: float = TOP_P
  top_k: int = TOP_K
  max_tokens: Optional[int] = Field(None, ge=1)
  max_completion_tokens: Optional[int] = Field(None, ge=1)
  seed: Optional[int] = SEED
  stop: Optional[Union[str, list[str]]] = None
  stop_token_ids: Optional[list[Annotated[int, TOKEN_ID]]] = None
  stream: bool = False
  n: int = 1
  logprobs: bool = False
  session_id: Optional[Name] = None

  @field_validator("tools")
  @classmethod
  def _tools(cls, tools):
    for tool in tools or []:  # checked, and passed on as sent (the prompt renders them)
      ToolDef.model_validate(tool)
    return tools

  @field_validator("tool_choice")
  @classmethod
  def _tool_choice(cls, choice):
    if choice not in (None, "auto"):
      raise ValueError(f"only auto is served, got {choice!r} (sampling cannot be made to "
                       "call, or not call, a tool)")
    return choice

  @field_validator("top_logprobs")
  @classmethod
  def _top_logprobs(cls, n):
    if n:
      raise ValueError("not served: logprobs: true gives each sampled token's log-prob")
    return n

  @model_validator(mode="after")
  def _served(self):
    why = unserved(self.model_extra)
    if why is not None:
      raise ValueError(why)
    return self


# -- sessions ------------------------------------------------------------------------------


def _export_id(path: str, version: Optional[int]) -> Optional[str]:
  """The id of the export `path` (and `version`) names (None: it has none)."""
  from jaxagent.checkpoint import export_id
  from rollout_server.serving import resolve_policy

  try:
    return export_id(resolve_policy(path, version)[0])
  except (OSError, ValueError):
    return None


def _turn_record(req: Request, **extra) -> dict:
  out = req.result()
  out.update(extra)
  return out


# -- metrics -------------------------------------------------------------------------------


class _EngineCollector:
  """Gauges read from the orchestrator and the session store at scrape time."""

  def __init__(self, orch: Orchestrator, sessions: SessionStore):
    self.orch = orch
    self.sessions = sessions

  def collect(self):
    s = self.orch.stats()
    evicted = CounterMetricFamily("rollout_sessions_evicted", "Sessions dropped, by the bound "
                                  "that dropped them", labels=["reason"])
    for reason, n in self.sessions.evicted.items():
      evicted.add_metric([reason], n)
    yield evicted
    pc = s.get("prefix_cache") or {}
    for name, doc, value in [
        ("rollout_queue_length", "Requests waiting for a slot", s["queue"]),
        ("rollout_live_slots", "Decode slots in use", s["live_slots"]),
        ("rollout_slots", "Decode slots", s["slots"]),
        ("rollout_tokens_per_second", "Generated tokens per second (last 10 s)",
         s["tokens_per_s"]),
        ("rollout_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache",
         pc.get("hit_rate", 0.0)),
        ("rollout_prefix_cache_tokens", "Tokens held by the prefix cache", pc.get("tokens", 0)),
        ("rollout_policy_version", "Policy version being served", s["version"]),
        ("rollout_generated_tokens", "Tokens generated since start", s["tokens_generated"]),
        ("rollout_sessions", "Sessions recorded", len(self.sessions)),
        ("rollout_session_bytes", "Bytes the recorded session turns hold (packed)",
         self.sessions.bytes),
    ]:
      g = GaugeMetricFamily(name, doc)
      g.add_metric([], float(value))
      yield g


# -- app -----------------------------------------------------------------------------------


def _sampling(body: SamplingBody, max_new: int, stop_ids: list[int]) -> SamplingParams:
  return SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                        max_new_tokens=max_new, stop_token_ids=tuple(stop_ids),
                        seed=body.seed if body.seed is not None else uuid.uuid4().int % (2**31))


async def _wait(req: Request) -> None:
  """Awaits a request's end from the event loop (the engine runs in its own thread)."""
  loop = asyncio.get_running_loop()
  fut = loop.create_future()

  def done(r, _n):
    if r.done and not fut.done():
      loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))

  req.add_listener(done)
  if req.done:
    return
  await fut


def create_app(orch: Orchestrator, tokenizer: Tokenizer, *, load_params=None,
               update_mode: str = "drain", max_sessions: int = ServerConfig.max_sessions,
               session_ttl_s: Optional[float] = ServerConfig.session_ttl_s,
               session_max_bytes: Optional[int] = ServerConfig.session_max_bytes,
               model_name: str = "jaxagent", models: Optional[dict] = None,
               max_score_tokens: int = MAX_SCORE_TOKENS, policy_id: Optional[str] = None,
               max_body_bytes: int = ServerConfig.max_body_bytes,
               control_token: Optional[str] = None,
               stall_s: Optional[float] = ServerConfig.stall_s) -> FastAPI:
  """The server app. `load_params(path, version) -> engine params` serves /update_weights.
  `models`: more models served by name (`rollout_server.serving.ServedModel`s).
  `policy_id`: the id of the export the policy's weights were loaded from
  (`jaxagent.checkpoint.export_id`), which /health says while they are served.
  `control_token`: what a call to a control route must carry (`jaxagent.control`;
  None: they are open)."""
  app = FastAPI(title="jaxagent rollout server")
  control_token = control_token or None  # (a blank one is none: it said guarded, took "")
  app.add_middleware(BodyLimit, limit=max_body_bytes, shape=error_body)  # (an API's own shape)
  name_deep_bodies(app)
  models = dict(models or {})
  if model_name in models:
    raise ValueError(f"models: {model_name!r} is the policy's name")
  for tok in [tokenizer, *(m.tokenizer for m in models.values())]:
    tok.max_token_chars  # (a walk over the vocabulary, here rather than in a first call)

  def served(name: Optional[str], strict: bool):
    """The served model `name` (None: the policy's orchestrator and tokenizer)."""
    if name in models:
      return models[name]
    if strict and name not in (None, model_name):
      raise HTTPException(404, f"model {name!r} is not served here (served: "
                               f"{[model_name] + sorted(models)})")
    return None
  sessions = SessionStore(max_sessions, session_ttl_s, session_max_bytes)
  # The export the policy's weights came from, as of which version (weights that came
  # another way since, from a process's own learner, are of no export it knows).
  served_from = {"id": policy_id, "version": orch.version}
  # This app's own id: a router tells a server restarted at its address by it (what the
  # server held, session threads and kept responses, is gone).
  instance = uuid.uuid4().hex
  # (id(tokenizer), the tools' hash) -> its chat template writes each of those tools'
  # names into the prompt (an agent sends the same tools every turn: checked once).
  tool_rendering: collections.OrderedDict = collections.OrderedDict()
  registry = CollectorRegistry()
  registry.register(_EngineCollector(orch, sessions))
  ttft = Histogram("rollout_time_to_first_token_seconds", "Time to first token",
                   registry=registry, buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
  finished = Counter("rollout_requests", "Finished requests", ["finish_reason"],
                     registry=registry)
  disconnects = Counter("rollout_client_disconnects", "Requests aborted because their client "
                        "went away before the answer", registry=registry)
  update_lock = asyncio.Lock()
  score_lock = asyncio.Lock()
  app.state.orchestrator = orch
  app.state.sessions = sessions

  def submit(prompt, sampling, request_id=None, session_id=None, on=None,
             resumed_tokens=0) -> Request:
    try:
      req = (on or orch).submit(prompt, sampling, request_id=request_id,
                                session_id=session_id, resumed_tokens=resumed_tokens)
    except QueueFull as e:
      raise HTTPException(503, str(e))
    except ValueError as e:
      raise HTTPException(400, str(e))

    def observe(r, _n):
      if r.done:
        finished.labels(r.finish_reason).inc()
        if r.ttft_s is not None:
          ttft.observe(r.ttft_s)

    req.add_listener(observe)
    return req

  async def run(req: Request, http: HttpRequest, on=None) -> bool:
    """Awaits `req`; aborts it (freeing its slot) if the client disconnects first. True
    when it ended before that."""
    tasks = [asyncio.ensure_future(_wait(req)), asyncio.ensure_future(client_gone(http))]
    try:
      await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
      return req.done
    finally:
      for t in tasks:
        t.cancel()
      if not req.done:  # the client went away (or the handler was cancelled)
        (on or orch).abort(req.request_id)
        disconnects.inc()

  guarded = control_guard(control_token)

  @app.exception_handler(ValueError)
  async def value_error(_request, exc: ValueError):
    return JSONResponse(status_code=400, content={"detail": str(exc)})

  @app.get("/health")
  async def health():
    s = orch.stats()
    if s.get("dead"):  # (out of rotation: its every request fails; a reviewer)
      return JSONResponse({"status": f"the engine loop died: {s['dead']}",
                           "version": s["version"], "instance": instance}, status_code=503)
    if stall_s and s["step_s"] > stall_s:  # (hung: out of rotation, its turns held; a
      # reviewer found one taking turns for good while /health said ok)
      return JSONResponse({"status": f"the engine loop has been in one step for "
                                     f"{s['step_s']:.0f} s (stall_s {stall_s:g}): hung",
                           "version": s["version"], "instance": instance}, status_code=503)
    out = {"status": "ok", "version": s["version"], "live_slots": s["live_slots"],
           "queue": s["queue"], "policy_id": served_from["id"]
           if served_from["version"] == s["version"] else None, "instance": instance,
           "control_token": control_token is not None}
    if models:
      out["models"] = {name: {"version": m.orch.stats()["version"],
                              "update_weights": m.update_weights} for name, m in models.items()}
    return out

  @app.get("/v1/models")
  async def list_models():
    """The models this server serves (what the OpenAI client's `models.list()` reads): the
    policy first."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                        "owned_by": "jaxagent"}
                                       for name in [model_name] + sorted(models)]}

  @app.get("/metrics")
  async def metrics():
    return PlainTextResponse(generate_latest(registry).decode(),
                             media_type="text/plain; version=0.0.4")

  @app.post("/generate")
  async def generate(body: GenerateBody, http: HttpRequest):
    session_id = session_of(session_header(http.headers), body.session_id)
    m = served(body.model, strict=True)
    on = m.orch if m is not None else None
    req = submit(body.input_ids, _sampling(body, body.max_new_tokens, body.stop_token_ids),
                 body.request_id, session_id, on, body.resumed_tokens)
    ended = await run(req, http, on)
    out = req.result()
    # A session records the policy's turns only, and only ended ones (a turn whose
    # client went away is being aborted: its record would be a partial turn).
    if session_id and m is None and ended and body.record:
      sessions.record(session_id, _turn_record(req, kind="generate"))
    return out

  @app.post("/v1/score")
  async def score(body: ScoreBody):
    """Each token's log-prob given the tokens before it (0 for the first), under the
    weights the named model serves now, at `temperature`."""
    m = served(body.model, strict=True)
    engine, params = (m.engine, m.orch.params) if m is not None else (orch.engine, orch.params)
    total = sum(map(len, body.input_ids))
    if total > max_score_tokens:
      raise HTTPException(413, f"input_ids: {total} tokens, more than {max_score_tokens} a "
                               "request (send fewer sequences at a time)")
    try:
      async with score_lock:  # one scoring pass at a time beside decoding
        out = await asyncio.get_running_loop().run_in_executor(
            None, engine.score, params, body.input_ids, body.temperature)
    except ValueError as e:
      raise HTTPException(400, str(e))
    return {"model": body.model or model_name, "logprobs": [x.tolist() for x in out]}

  @app.get("/requests")
  async def in_flight(session_id: str = Query(...)):
    """The session's turns in flight (`Orchestrator.session_progress`): whether they
    move, and how long they have decoded (a black-box episode cut meanwhile counts that
    as its own)."""
    return {"session_id": session_id, **orch.session_progress(session_id)}

  @app.get("/requests/{request_id:path}")
  async def progress(request_id: str):
    """Where a request in flight stands (`Orchestrator.progress`); 404 when none is."""
    found = progress_of([orch, *(m.orch for m in models.values())], request_id)
    if found is None:
      return JSONResponse({"detail": f"no request {request_id!r} in flight"},
                          status_code=404)
    return found

  @app.get("/control", dependencies=guarded)
  async def control_check():
    """A control call that changes nothing: whether the caller's token is this server's
    (200, else 401), asked at a learner's or a router's start."""
    return {"control": "ok", "control_token": control_token is not None}

  @app.post("/abort", dependencies=guarded)
  async def abort(body: AbortBody):
    return {"request_id": body.request_id, "aborted": orch.abort(body.request_id)}

  @app.post("/update_weights", dependencies=guarded)
  async def update_weights(body: UpdateWeightsBody):
    m = served(body.model, strict=True)
    if m is not None and not m.update_weights:
      raise HTTPException(409, f"model {body.model!r} is frozen (update_weights: false)")
    load, target = (m.load, m.orch) if m is not None else (load_params, orch)
    if load is None:
      raise HTTPException(501, "this server was started without a weight loader")
    mode = body.mode or update_mode
    if mode not in ("drain", "abort"):
      raise HTTPException(400, f"mode must be 'drain' or 'abort', got {mode!r}")
    if not os.path.exists(body.path):
      raise HTTPException(400, f"no policy export at {body.path}")
    from jaxagent.checkpoint import OtherModel

    async with update_lock:
      loop = asyncio.get_running_loop()
      t0 = time.perf_counter()
      # (the export's id as it was before its load and after: the same export, else one
      # exported again meanwhile, and which of the two was read is not known)
      before = _export_id(body.path, body.version) if m is None else None
      try:
        params = await loop.run_in_executor(None, load, body.path, body.version)
      except OtherModel as e:  # (this server's model is not the export's: its config's)
        raise HTTPException(409, f"cannot load {body.path}: this server serves another "
                                 f"model: {e}")
      except Exception as e:  # a bad checkpoint must not take the server down
        raise HTTPException(400, f"cannot load {body.path}: {type(e).__name__}: {e}")
      load_s = time.perf_counter() - t0
      try:
        report = await loop.run_in_executor(None, target.update_weights, params, mode)
      except EngineDead as e:  # (a 500 before: the server needs a restart, not a retry)
        raise HTTPException(503, str(e))
      except TimeoutError as e:  # (withdrawn: the old weights still serve; a retry may)
        raise HTTPException(504, str(e))
      if m is None:
        same = before is not None and before == _export_id(body.path, body.version)
        served_from.update(id=before if same else None, version=report["version"])
    # (which model took it, None: the policy, however it was named: a router pins the
    # policy's updates for a backend that rejoins, and read a policy named by its name
    # as another model's, loading the version before back at its next check)
    return {**report, "model": None if m is None else m.name, "load_s": load_s,
            "total_s": time.perf_counter() - t0}

  @app.get("/sessions/{session_id:path}")
  async def get_session(session_id: str, since: int = Query(0, ge=0)):
    """The session's recorded turns (from turn `since` on: a router copies new ones)."""
    got = sessions.read(session_id, since)
    if got is None:
      raise HTTPException(404, f"no session {session_id!r}")
    return {"session_id": session_id, "turns": got[0], "count": got[1], "record_id": got[2]}

  @app.delete("/sessions/{session_id:path}", dependencies=guarded)
  async def delete_session(session_id: str):
    if sessions.pop(session_id) is None:
      raise HTTPException(404, f"no session {session_id!r}")
    return {"session_id": session_id, "deleted": True}

  @app.post("/handover", dependencies=guarded)
  async def handover(body: HandoverBody):
    """A router failing a session over hands its threads here (its last turn, a side
    call's), so that the session's next call continues their tokens (as on the server
    that ran them) rather than encoding the replies again from their text (the
    trajectory forked at every failover: red team 27). The session's record is
    unchanged. Its ids must be in the vocabulary and its JSON finite: a session's next call
    goes on from them (handed unchecked, they made that call's 400, or its record
    unreadable: red team 113)."""
    turns = [t.model_dump() for t in body.turns]
    vocab = orch.engine.vocab_size
    for i, t in enumerate(turns):
      for field, ids in [("prompt_ids", t["prompt_ids"]),
                         *((f"replies[{j}].output_ids", r["output_ids"])
                           for j, r in enumerate(t["replies"]))]:
        bad = [x for x in ids if not 0 <= x < vocab]
        if bad:
          raise HTTPException(400, f"turns[{i}].{field}: token ids {bad[:5]} are outside the "
                                   f"vocabulary [0, {vocab})")
    try:
      json.dumps(turns, allow_nan=False)
    except ValueError as e:
      raise HTTPException(400, f"turns: {e} (NaN and Infinity are not JSON)") from None
    sessions.carry(body.session_id, turns)
    return {"session_id": body.session_id, "carried": True}

  def extra_session(body: BaseModel, http: HttpRequest) -> Optional[str]:
    """The session of a call whose body schema is another API's (Anthropic's, Responses'):
    its header, or the `session_id` its body carries beside the schema (a string: 5,
    true, {} had become sessions)."""
    named = (body.model_extra or {}).get("session_id")
    if named is not None and not isinstance(named, str):
      raise HTTPException(422, f"session_id: must be a string, got {type(named).__name__}")
    return session_of(session_header(http.headers), named)

  def too_many(n: int, what: str, model: Optional[str]) -> None:
    """A 400 (the client's prompt_too_long) for a chat of `n` messages, items or tools
    (`what`) where the prompt of the model `model` names holds fewer tokens (a template
    writes each as one token at least): 100,000 short items were converted and rendered,
    their length known only then, the event loop held 8 s (red team 116)."""
    m = served(model, strict=False)
    limit = (m.orch if m is not None else orch).engine.max_prefill_length
    if n > limit:
      raise HTTPException(400, f"{PROMPT_TOO_LONG}: {n} {what}, more than a prompt of at "
                               f"most {limit} tokens (engine.max_prefill_length) holds (a chat "
                               "template writes each as one token at least)")

  def too_long(pieces, chars: int, tok, limit: int) -> None:
    """PromptTooLong for a rendering (`pieces`, of `chars` characters) whose text is far
    longer than `limit` tokens could hold, found by encoding only its first
    `2 * limit * tok.max_token_chars` characters (twice the longest token: NFC may fold
    three characters into two bytes): encoding it all took a second a megabyte on the
    event loop, every other request held (red team 113). A tokenizer whose normalizer
    deletes text may encode that much into fewer tokens: then the whole is encoded, as
    before."""
    most = 2 * limit * tok.max_token_chars
    if chars <= most:
      return
    head, left = [], most
    for text, is_data in pieces:
      if left <= 0:
        break
      head.append((text[:left], is_data))
      left -= len(text)
    n = len(tok.encode_pieces(head))
    if n > limit:
      raise PromptTooLong(f"{PROMPT_TOO_LONG}: {chars} characters of text, whose first "
                          f"{most} alone are {n} tokens; the limit (engine.max_prefill_length) is "
                          f"{limit} (the rest was not encoded)")

  def start_chat(messages: list[dict], tools: Optional[list[dict]], sampling: SamplingParams,
                 session_id: Optional[str], kind: str, id_prefix: str,
                 model: Optional[str] = None,
                 goes_on_from: Optional[tuple[str, int]] = None) -> ChatTurn:
    """Renders a chat (internal form) through the template of the model `model` names (the
    policy's unless it is another served model's name) and submits it: what both chat
    gateways do with a call. `goes_on_from`: the session's record id and turn the call
    says it continues (a Responses call's previous_response_id)."""
    too_many(len(messages) + len(tools or ()), "messages and tools", model)
    messages, tools = clean_unicode(messages), clean_unicode(tools)
    m = served(model, strict=False)
    tok, on = (m.tokenizer, m.orch) if m is not None else (tokenizer, orch)
    if m is not None:  # stop on that model's own end-of-turn tokens
      sampling = dataclasses.replace(sampling, stop_token_ids=tuple(dict.fromkeys(
          [*tok.stop_ids, *(t for t in sampling.stop_token_ids
                            if t not in tokenizer.stop_ids)])))
    if tools:
      names = tool_names(tools)
      for i, name in enumerate(names):
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
          raise HTTPException(400, f"tools[{i}]: the name {name!r} must be 1 to 128 letters, "
                                   "digits, '_', '-', '.', ':' or '/' (a template writes it "
                                   "escaped or not at all, and a call could not name it)")
        if name in names[:i]:  # (a call of it could mean either)
          raise HTTPException(400, f"tools[{i}]: the name {name!r} is tools"
                                   f"[{names.index(name)}]'s too: each tool needs its own")
      key = (id(tok), hashlib.sha256(json.dumps(tools, sort_keys=True, default=str)
                                     .encode()).hexdigest())
      if key not in tool_rendering:
        problem = schema_problem(tools)
        if problem:
          raise HTTPException(400, problem)
        try:
          tool_rendering[key] = renders_tools(tok, tools, strict=True)
        except Exception as e:  # these tools break the template: said, not kept
          raise HTTPException(400, "cannot render the chat template with these tools: "
                                   f"{type(e).__name__}: {e}")
        while len(tool_rendering) > 1024:
          tool_rendering.popitem(last=False)
      if not tool_rendering[key]:
        raise HTTPException(400, f"tools: the chat template of {tok.name} does not write "
                                 "them into the prompt, so the model would never see them; "
                                 "serve it with model.chat_template=chatml_tools")
    # A session records the policy's turns only: another model's are not its actions.
    recorded = session_id if m is None else None
    try:
      messages = normalise_messages(messages)
      if recorded:
        messages = with_sampled_arguments(messages, sessions.sampled_calls(recorded))
        if goes_on_from is not None:
          # (a turn that need not be the session's last one: an SDK's retry from its
          # last good response, a branch; the call continues that turn's tokens)
          sessions.revive(recorded, *goes_on_from)
      pieces = tok.render_pieces(messages, tools=tools)
      chars = sum(len(text) for text, _ in pieces)
      too_long(pieces, chars, tok, on.engine.max_prefill_length)
      bound_unrendered(messages, chars)
      prompt = continued_prompt(tok, pieces, messages, tools, sessions.last_turn(
          recorded, messages, tools) if recorded else None)
      if prompt is None:
        prompt = tok.encode_pieces(pieces)
    except ValueError as e:
      raise HTTPException(400, str(e))
    except Exception as e:  # a template error names the problem
      raise HTTPException(400, f"cannot render the chat template: {type(e).__name__}: {e}")
    req = submit(prompt, sampling, None, session_id, on)
    return ChatTurn(req, tok, on, messages=messages, tools=tools, sessions=sessions,
                    session_id=recorded, kind=kind,
                    id_prefix=id_prefix, on_abandoned=disconnects.inc,
                    resubmit=lambda ids, s, n: submit(ids, s, None, session_id, on, n))

  chat_api = APIRouter(route_class=OpenAIRoute)

  @chat_api.post("/v1/chat/completions")
  async def chat(body: ChatBody, http: HttpRequest):
    if body.n != 1:
      raise HTTPException(400, "n must be 1 (sample a group as separate requests)")
    if body.stop:
      raise HTTPException(400, "stop strings are not supported (they would cut tokens); "
                               "use stop_token_ids")
    max_new = next((m for m in (body.max_completion_tokens, body.max_tokens) if m is not None),
                   256)
    stops = list(tokenizer.stop_ids) + list(body.stop_token_ids or [])
    session_id = session_of(session_header(http.headers), body.session_id)
    turn = start_chat(body.messages, body.tools, _sampling(body, max_new, stops), session_id,
                      kind="chat", id_prefix="call", model=body.model)
    created = int(time.time())
    cid = f"chatcmpl-{turn.request_id}"

    def finish() -> tuple[dict, str]:
      message = turn.finish()  # (TurnCut for a turn the server could not finish)
      reason = "tool_calls" if message.get("tool_calls") and turn.finish_reason == "stop" \
          else turn.finish_reason
      return message, reason

    def usage() -> dict:
      prompt, out = len(turn.prompt_ids), len(turn.output_ids)
      return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}

    def logprobs() -> Optional[dict]:
      if not body.logprobs:
        return None
      return {"content": [{"token": turn.tokenizer.decode([t]), "logprob": lp,
                           "top_logprobs": []}
                          for t, lp in zip(turn.output_ids, turn.output_logprobs)]}

    if not body.stream:
      try:
        await turn.complete(lambda r: run(r, http, turn.orch))
        message, reason = finish()
      except TurnCut as e:
        raise HTTPException(e.status, str(e))
      return {"id": cid, "object": "chat.completion", "created": created,
              "model": body.model or model_name,
              "choices": [{"index": 0, "message": message, "finish_reason": reason,
                           "logprobs": logprobs()}],
              "usage": usage(),
              "jaxagent": {"request_id": turn.request_id, "versions": turn.versions,
                           "prompt_ids": turn.prompt_ids, "output_ids": turn.output_ids}}

    return EndedStream(_stream_chat(turn, cid, created, body.model or model_name, finish,
                                    usage, logprobs), turn.abort_unfinished,
                       media_type="text/event-stream")

  # Anthropic's Messages API: errors in Anthropic's shape (the route class), the chat
  # converted to the internal form and served as above.
  messages_api = APIRouter(route_class=anthropic_api.AnthropicRoute)

  @messages_api.post("/v1/messages")
  async def messages(body: anthropic_api.MessagesBody, http: HttpRequest):
    too_many(len(body.messages) + len(body.tools or ()), "messages and tools", body.model)
    chat_messages, tools = anthropic_api.chat_messages(body)
    session_id = extra_session(body, http)  # (the body's was ignored; a router's routed by
    # it: a turn recorded nowhere, red team 115)
    turn = start_chat(chat_messages, tools,
                      _sampling(body, body.max_tokens, list(tokenizer.stop_ids)), session_id,
                      kind="messages", id_prefix="toolu", model=body.model)
    if body.stream:
      return EndedStream(anthropic_api.stream_events(turn, body.model),
                         turn.abort_unfinished, media_type="text/event-stream")
    try:
      await turn.complete(lambda r: run(r, http, turn.orch))
      return anthropic_api.message_body(turn, body.model)
    except TurnCut as e:
      raise HTTPException(e.status, str(e))

  # OpenAI's Responses API: errors in OpenAI's shape, items converted to the internal
  # form and served as above; responses kept for previous_response_id.
  responses_api_ = APIRouter(route_class=OpenAIRoute)
  kept_responses = responses_api.ResponseStore()

  @responses_api_.post("/v1/responses")
  async def responses(body: responses_api.ResponsesBody, http: HttpRequest):
    if isinstance(body.input, list):
      too_many(len(body.input) + len(body.tools or ()), "input items and tools", body.model)
    prior: list[dict] = []
    if body.previous_response_id is not None:
      try:
        prior = kept_responses.conversation(body.previous_response_id)
      except KeyError as e:
        raise HTTPException(404, e.args[0])
    continued, parts = responses_api.made_whole(body)
    chat_messages, conversation, tools = responses_api.chat_messages(body, prior, parts)
    session_id = extra_session(body, http)
    sampling = SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k,
        max_new_tokens=body.max_output_tokens or 256,
        stop_token_ids=tuple(tokenizer.stop_ids),
        seed=body.seed if body.seed is not None else uuid.uuid4().int % (2**31))
    made_in = (kept_responses.turn_of(body.previous_response_id)
               if body.previous_response_id is not None and session_id else None)
    turn = start_chat(chat_messages, tools, sampling, session_id, kind="responses",
                      id_prefix="call", model=body.model,
                      goes_on_from=made_in[1:] if made_in is not None
                      and made_in[0] == session_id else None)
    # (cleaned as the prompt is: a lone surrogate echoed made the answer unwritable, a
    # 400 for a turn recorded and kept, a red team's finding)
    settings = clean_unicode(responses_api.echo(body, body.model or model_name, continued))
    created = int(time.time())

    def keep() -> None:
      if body.store is not False:
        message = turn.finish()
        kept_responses.keep(f"resp_{turn.request_id}", body.previous_response_id,
                            conversation[len(prior):] + [message],
                            (session_id, *turn.recorded) if turn.recorded else None)

    if body.stream:
      return EndedStream(
          responses_api.stream_events(turn, settings, created, body.logprobs, keep),
          turn.abort_unfinished, media_type="text/event-stream")
    try:
      await turn.complete(lambda r: run(r, http, turn.orch))
      answer = responses_api.response_body(turn, settings, created, logprobs=body.logprobs)
    except TurnCut as e:
      raise HTTPException(e.status, str(e))
    keep()
    return answer

  app.include_router(chat_api)
  app.include_router(messages_api)
  app.include_router(responses_api_)
  return app


async def _stream_chat(turn: ChatTurn, cid, created, model, finish, usage, logprobs):
  """Server-sent events: content deltas as tokens arrive, tool calls at the end, and the
  log-probs asked for with the last (a stream gave none: a reviewer)."""

  def chunk(delta, reason=None, choice=None, **extra):
    body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": reason,
                         **(choice or {})}], **extra}
    return f"data: {json.dumps(body)}\n\n"

  sent = ""
  try:
    yield chunk({"role": "assistant", "content": ""})
    try:
      async for delta in turn.text_deltas():
        yield chunk({"content": delta})
        sent += delta
      message, reason = finish()
    except TurnCut as e:  # the status is sent: an error event (the client raises it)
      yield f"data: {json.dumps({'error': {'message': str(e), 'code': e.status}})}\n\n"
      return
    # The rest of the content (a malformed tool call stays in it as written), then the
    # calls.
    content = message["content"] or ""
    if content != sent and content.startswith(sent):
      yield chunk({"content": content[len(sent):]})
    if message.get("tool_calls"):
      yield chunk({"tool_calls": [dict(c, index=i) for i, c in
                                  enumerate(message["tool_calls"])]})
    asked = logprobs()
    yield chunk({}, reason, {"logprobs": asked} if asked is not None else None, usage=usage())
    yield "data: [DONE]\n\n"
  finally:
    turn.abort_unfinished()


if __name__ == "__main__":  # (`python -m rollout_server.server` did nothing, exit 0: a red team)
  import sys

  from rollout_server.__main__ import main

  sys.exit(main())

"""HTTP API of a rollout server (FastAPI on uvicorn).

- `POST /generate`: token ids in; token ids, log-probs, versions, finish reason out.
- `POST /v1/chat/completions`: OpenAI-compatible, with `tools` / `tool_calls`
  and optional streaming. An `X-Session-Id` header groups the calls of one
  agent session; each call is recorded as a turn (prompt ids, output ids,
  log-probs, versions, finish reason) and `GET /sessions/{id}` returns them.
- `POST /abort`, `POST /update_weights`, `GET /health`, `GET /metrics` (Prometheus).

Bad requests get a 4xx naming what is wrong; nothing a request does stops the server.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from typing import Annotated, Any, Optional, Union

from fastapi import FastAPI, HTTPException, Query, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field

from jaxagent.config import ServerConfig
from jaxagent.tokenizer import Tokenizer
from jaxagent.toolcalls import parse_tool_calls
from rollout_server.engine import SamplingParams
from rollout_server.orchestrator import Orchestrator, QueueFull, Request
from rollout_server.sessions import SessionStore

SESSION_HEADER = "x-session-id"


# -- request bodies -----------------------------------------------------------------------


# Ranges the engine can take: a request outside them is refused with a 422 naming the
# field, instead of failing on the device (and taking its prefill batch with it).
_TOP_K = Field(0, ge=0, lt=2**31)
_SEED = Field(None, ge=-(2**63), lt=2**63)
_TEMPERATURE = Field(1.0, ge=0.0)
_TOP_P = Field(1.0, gt=0.0, le=1.0)
_TOKEN_ID = Field(ge=0, lt=2**31)


class SamplingBody(BaseModel):
  model_config = ConfigDict(extra="forbid")
  temperature: float = _TEMPERATURE
  top_p: float = _TOP_P
  top_k: int = _TOP_K
  max_new_tokens: int = Field(64, ge=1)
  stop_token_ids: list[Annotated[int, _TOKEN_ID]] = Field(default_factory=list)
  seed: Optional[int] = _SEED


class GenerateBody(SamplingBody):
  input_ids: list[Annotated[int, _TOKEN_ID]] = Field(min_length=1)
  request_id: Optional[str] = None
  session_id: Optional[str] = None


class AbortBody(BaseModel):
  request_id: str


class UpdateWeightsBody(BaseModel):
  model_config = ConfigDict(extra="forbid")
  path: str
  version: Optional[int] = None
  mode: Optional[str] = None


class ChatBody(BaseModel):
  # Unknown OpenAI fields (user, metadata, ...) are accepted and ignored.
  model_config = ConfigDict(extra="allow")
  messages: list[dict] = Field(min_length=1)
  model: Optional[str] = None
  tools: Optional[list[dict]] = None
  tool_choice: Optional[Union[str, dict]] = None
  temperature: float = _TEMPERATURE
  top_p: float = _TOP_P
  top_k: int = _TOP_K
  max_tokens: Optional[int] = Field(None, ge=1)
  max_completion_tokens: Optional[int] = Field(None, ge=1)
  seed: Optional[int] = _SEED
  stop: Optional[Union[str, list[str]]] = None
  stop_token_ids: Optional[list[Annotated[int, _TOKEN_ID]]] = None
  stream: bool = False
  n: int = 1
  logprobs: bool = False
  session_id: Optional[str] = None


# -- sessions ------------------------------------------------------------------------------


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
        ("rollout_session_bytes", "Bytes of recorded session turns (JSON)",
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


def _message_text(content: Any) -> str:
  if content is None:
    return ""
  if isinstance(content, str):
    return content
  if isinstance(content, list):  # OpenAI content parts
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))
  raise ValueError(f"message content must be a string or a list of parts, got {type(content)}")


def _normalise_messages(messages: list[dict]) -> list[dict]:
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
      raise ValueError(f"messages[{i}] needs a role of system, user, assistant or tool")
    m = dict(m)
    m["content"] = _message_text(m.get("content"))
    out.append(m)
  return out


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


async def _disconnected(http: HttpRequest) -> None:
  """Returns when the client of a request whose body was read disconnects."""
  while (await http.receive())["type"] != "http.disconnect":
    await asyncio.sleep(0.05)  # (a server that repeats empty body messages)


def create_app(orch: Orchestrator, tokenizer: Tokenizer, *, load_params=None,
               update_mode: str = "drain", max_sessions: int = ServerConfig.max_sessions,
               session_ttl_s: Optional[float] = ServerConfig.session_ttl_s,
               session_max_bytes: Optional[int] = ServerConfig.session_max_bytes,
               model_name: str = "jaxagent") -> FastAPI:
  """The server app. `load_params(path, version) -> engine params` serves /update_weights."""
  app = FastAPI(title="jaxagent rollout server")
  sessions = SessionStore(max_sessions, session_ttl_s, session_max_bytes)
  registry = CollectorRegistry()
  registry.register(_EngineCollector(orch, sessions))
  ttft = Histogram("rollout_time_to_first_token_seconds", "Time to first token",
                   registry=registry, buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
  finished = Counter("rollout_requests", "Finished requests", ["finish_reason"],
                     registry=registry)
  disconnects = Counter("rollout_client_disconnects", "Requests aborted because their client "
                        "went away before the answer", registry=registry)
  update_lock = asyncio.Lock()
  app.state.orchestrator = orch
  app.state.sessions = sessions

  def submit(prompt, sampling, request_id=None, session_id=None) -> Request:
    try:
      req = orch.submit(prompt, sampling, request_id=request_id, session_id=session_id)
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

  async def run(req: Request, http: HttpRequest) -> None:
    """Awaits `req`; aborts it (freeing its slot) if the client disconnects first."""
    tasks = [asyncio.ensure_future(_wait(req)), asyncio.ensure_future(_disconnected(http))]
    try:
      await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
      for t in tasks:
        t.cancel()
      if not req.done:  # the client went away (or the handler was cancelled)
        orch.abort(req.request_id)
        disconnects.inc()

  @app.exception_handler(ValueError)
  async def value_error(_request, exc: ValueError):
    return JSONResponse(status_code=400, content={"detail": str(exc)})

  @app.get("/health")
  async def health():
    s = orch.stats()
    return {"status": "ok", "version": s["version"], "live_slots": s["live_slots"],
            "queue": s["queue"]}

  @app.get("/v1/models")
  async def models():
    """The one model this server serves (what the OpenAI client's `models.list()` reads)."""
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                        "owned_by": "jaxagent"}]}

  @app.get("/metrics")
  async def metrics():
    return PlainTextResponse(generate_latest(registry).decode(),
                             media_type="text/plain; version=0.0.4")

  @app.post("/generate")
  async def generate(body: GenerateBody, http: HttpRequest):
    session_id = body.session_id or http.headers.get(SESSION_HEADER)
    req = submit(body.input_ids, _sampling(body, body.max_new_tokens, body.stop_token_ids),
                 body.request_id, session_id)
    await run(req, http)
    out = req.result()
    if session_id:
      sessions.record(session_id, _turn_record(req, kind="generate"))
    return out

  @app.post("/abort")
  async def abort(body: AbortBody):
    return {"request_id": body.request_id, "aborted": orch.abort(body.request_id)}

  @app.post("/update_weights")
  async def update_weights(body: UpdateWeightsBody):
    if load_params is None:
      raise HTTPException(501, "this server was started without a weight loader")
    mode = body.mode or update_mode
    if mode not in ("drain", "abort"):
      raise HTTPException(400, f"mode must be 'drain' or 'abort', got {mode!r}")
    if not os.path.exists(body.path):
      raise HTTPException(400, f"no policy export at {body.path}")
    async with update_lock:
      loop = asyncio.get_running_loop()
      t0 = time.perf_counter()
      try:
        params = await loop.run_in_executor(None, load_params, body.path, body.version)
      except Exception as e:  # a bad checkpoint must not take the server down
        raise HTTPException(400, f"cannot load {body.path}: {type(e).__name__}: {e}")
      load_s = time.perf_counter() - t0
      report = await loop.run_in_executor(None, orch.update_weights, params, mode)
    return {**report, "load_s": load_s, "total_s": time.perf_counter() - t0}

  @app.get("/sessions/{session_id}")
  async def get_session(session_id: str, since: int = Query(0, ge=0)):
    """The session's recorded turns (from turn `since` on: a router copies new ones)."""
    turns = sessions.get(session_id)
    if turns is None:
      raise HTTPException(404, f"no session {session_id!r}")
    return {"session_id": session_id, "turns": turns[since:]}

  @app.delete("/sessions/{session_id}")
  async def delete_session(session_id: str):
    if sessions.pop(session_id) is None:
      raise HTTPException(404, f"no session {session_id!r}")
    return {"session_id": session_id, "deleted": True}

  @app.post("/v1/chat/completions")
  async def chat(body: ChatBody, http: HttpRequest):
    if body.n != 1:
      raise HTTPException(400, "n must be 1 (sample a group as separate requests)")
    if body.stop:
      raise HTTPException(400, "stop strings are not supported (they would cut tokens); "
                               "use stop_token_ids")
    try:
      messages = _normalise_messages(body.messages)
      prompt = tokenizer.apply_chat_template(messages, tools=body.tools)
    except ValueError as e:
      raise HTTPException(400, str(e))
    except Exception as e:  # a template error names the problem
      raise HTTPException(400, f"cannot render the chat template: {type(e).__name__}: {e}")
    max_new = next((m for m in (body.max_completion_tokens, body.max_tokens) if m is not None),
                   256)
    stops = list(tokenizer.stop_ids) + list(body.stop_token_ids or [])
    session_id = body.session_id or http.headers.get(SESSION_HEADER)
    req = submit(prompt, _sampling(body, max_new, stops), None, session_id)
    created = int(time.time())
    cid = f"chatcmpl-{req.request_id}"

    def finish(req: Request) -> tuple[dict, str]:
      ids = req.output_ids
      if ids and ids[-1] in tokenizer.stop_ids:
        ids = ids[:-1]
      text = tokenizer.decode(ids)
      parsed = parse_tool_calls(text, id_prefix=f"call_{req.request_id}")
      message = {"role": "assistant", "content": parsed.content if parsed.calls else text}
      reason = {"stop": "stop", "length": "length"}.get(req.finish_reason, req.finish_reason)
      if parsed.calls:
        message["tool_calls"] = [c.openai() for c in parsed.calls]
        if req.finish_reason == "stop":
          reason = "tool_calls"
      if session_id:
        sessions.record(session_id, _turn_record(
            req, kind="chat", messages=messages, tools=body.tools, response=message,
            tool_call_errors=parsed.errors))
      return message, reason

    def usage(req: Request) -> dict:
      return {"prompt_tokens": len(req.prompt_ids), "completion_tokens": len(req.output_ids),
              "total_tokens": len(req.prompt_ids) + len(req.output_ids)}

    def logprobs(req: Request) -> Optional[dict]:
      if not body.logprobs:
        return None
      return {"content": [{"token": tokenizer.decode([t]), "logprob": lp, "top_logprobs": []}
                          for t, lp in zip(req.output_ids, req.output_logprobs)]}

    if not body.stream:
      await run(req, http)
      message, reason = finish(req)
      return {"id": cid, "object": "chat.completion", "created": created,
              "model": body.model or model_name,
              "choices": [{"index": 0, "message": message, "finish_reason": reason,
                           "logprobs": logprobs(req)}],
              "usage": usage(req),
              "jaxagent": {"request_id": req.request_id, "versions": req.versions,
                           "prompt_ids": req.prompt_ids, "output_ids": req.output_ids}}

    return StreamingResponse(_stream_chat(req, tokenizer, cid, created,
                                          body.model or model_name, finish, usage, orch),
                             media_type="text/event-stream")

  return app


async def _stream_chat(req, tokenizer, cid, created, model, finish, usage, orch):
  """Server-sent events: content deltas as tokens arrive, tool calls at the end."""
  loop = asyncio.get_running_loop()
  queue: asyncio.Queue = asyncio.Queue()
  req.add_listener(lambda r, n: loop.call_soon_threadsafe(queue.put_nowait, n))

  def chunk(delta, reason=None, **extra):
    body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": reason}], **extra}
    return f"data: {json.dumps(body)}\n\n"

  sent = ""
  try:
    yield chunk({"role": "assistant", "content": ""})
    while not req.done:
      await queue.get()
      ids = [t for t in req.output_ids if t not in tokenizer.stop_ids]
      text = tokenizer.decode(ids)
      # Hold back text after a tool-call marker and incomplete UTF-8 (U+FFFD).
      cut = text.find("<tool_call>")
      visible = text if cut < 0 else text[:cut]
      visible = visible.rstrip("\ufffd")
      if len(visible) > len(sent) and visible.startswith(sent):
        yield chunk({"content": visible[len(sent):]})
        sent = visible
    message, reason = finish(req)
    if message.get("tool_calls"):
      yield chunk({"tool_calls": [dict(c, index=i) for i, c in
                                  enumerate(message["tool_calls"])]})
    elif message["content"] != sent and message["content"].startswith(sent):
      yield chunk({"content": message["content"][len(sent):]})
    yield chunk({}, reason, usage=usage(req))
    yield "data: [DONE]\n\n"
  finally:
    if not req.done:
      orch.abort(req.request_id)

"""Environment worker service: hosts environment sessions over HTTP (FastAPI on uvicorn).

  POST   /sessions                  {"task": {...}}    -> {"session_id", "observation"}
  POST   /sessions/{id}/step        {"action": "..."}  -> StepResult
  POST   /sessions/{id}/verify                         -> Verdict
  DELETE /sessions/{id}
  GET    /health, GET /metrics (Prometheus)

A cap on sessions and on calls running at once, and a deadline per call: a
call past its deadline answers 504 and its session is closed (its state is
unknown). A session the worker does not have (expired, closed, or the worker
restarted) answers 404 naming it, never a hang. `RemoteEnv` is the client,
with the same async methods as an in-process environment.

`python -m envs.server [--host 127.0.0.1] [--port 8100] [--sandboxes 8]`
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
import uuid
from typing import Optional

import httpx
from fastapi import FastAPI, HTTPException
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from envs.base import (EnvResources, Observation, StepResult, TaskSpec, Verdict, VerdictStatus,
                       make)


class CreateBody(BaseModel):
  model_config = ConfigDict(extra="forbid")
  task: dict


class StepBody(BaseModel):
  model_config = ConfigDict(extra="forbid")
  action: str


@dataclasses.dataclass
class _Session:
  env: object
  task: TaskSpec
  lock: asyncio.Lock
  last_used: float


def create_app(resources: Optional[EnvResources] = None, *, max_sessions: int = 256,
               max_concurrent_calls: int = 32, deadline_s: float = 60.0,
               idle_timeout_s: float = 1800.0) -> FastAPI:
  resources = resources or EnvResources()
  sessions: dict[str, _Session] = {}
  calls = asyncio.Semaphore(max_concurrent_calls)
  registry = CollectorRegistry()
  n_sessions = Gauge("env_sessions", "Open sessions", registry=registry)
  n_calls = Counter("env_calls", "Calls by kind and outcome", ["kind", "outcome"],
                    registry=registry)
  latency = Histogram("env_call_seconds", "Call latency", ["kind"], registry=registry)
  app = FastAPI(title="jaxagent environment worker")

  async def close_session(sid: str) -> None:
    s = sessions.pop(sid, None)
    n_sessions.set(len(sessions))
    if s is not None:
      try:
        await s.env.close()
      except Exception:
        pass

  async def reap_idle() -> None:
    now = time.time()
    for sid, s in list(sessions.items()):
      if now - s.last_used > idle_timeout_s:
        await close_session(sid)

  def get(sid: str) -> _Session:
    s = sessions.get(sid)
    if s is None:
      raise HTTPException(404, f"no session {sid!r} on this worker (closed, expired, or the "
                               "worker restarted)")
    s.last_used = time.time()
    return s

  async def guarded(kind: str, sid: Optional[str], coro_fn):
    """Runs one call under the concurrency cap and the deadline."""
    t0 = time.perf_counter()
    async with calls:
      try:
        out = await asyncio.wait_for(coro_fn(), timeout=deadline_s)
      except asyncio.TimeoutError:
        n_calls.labels(kind, "deadline").inc()
        if sid is not None:
          await close_session(sid)
        raise HTTPException(504, f"{kind} exceeded the {deadline_s:.0f}s deadline; "
                                 "the session was closed")
      except HTTPException:
        raise
      except (ValueError, KeyError, RuntimeError) as e:
        n_calls.labels(kind, "bad_request").inc()
        raise HTTPException(400, f"{kind} failed: {type(e).__name__}: {e}")
      except Exception as e:  # the environment broke: report, keep serving
        n_calls.labels(kind, "error").inc()
        raise HTTPException(500, f"{kind} failed in the environment: {type(e).__name__}: {e}")
    n_calls.labels(kind, "ok").inc()
    latency.labels(kind).observe(time.perf_counter() - t0)
    return out

  @app.get("/health")
  async def health():
    return {"status": "ok", "sessions": len(sessions), "max_sessions": max_sessions}

  @app.get("/metrics")
  async def metrics():
    return PlainTextResponse(generate_latest(registry).decode(),
                             media_type="text/plain; version=0.0.4")

  @app.post("/sessions")
  async def create(body: CreateBody):
    await reap_idle()
    if len(sessions) >= max_sessions:
      raise HTTPException(503, f"worker is at its session limit ({max_sessions})")
    try:
      task = TaskSpec.from_dict(body.task)
    except ValueError as e:
      raise HTTPException(400, str(e))
    sid = uuid.uuid4().hex

    async def start():
      env = make(task.env, resources)
      obs = await env.reset(task)
      sessions[sid] = _Session(env, task, asyncio.Lock(), time.time())
      n_sessions.set(len(sessions))
      return obs

    obs = await guarded("reset", None, start)
    return {"session_id": sid, "observation": dataclasses.asdict(obs)}

  @app.post("/sessions/{sid}/step")
  async def step(sid: str, body: StepBody):
    s = get(sid)

    async def run():
      async with s.lock:
        return await s.env.step(body.action)

    result = await guarded("step", sid, run)
    return dataclasses.asdict(result)

  @app.post("/sessions/{sid}/verify")
  async def verify(sid: str):
    s = get(sid)

    async def run():
      async with s.lock:
        return await s.env.verify()

    return (await guarded("verify", sid, run)).to_dict()

  @app.delete("/sessions/{sid}")
  async def delete(sid: str):
    get(sid)
    await close_session(sid)
    return {"session_id": sid, "closed": True}

  app.state.sessions = sessions
  return app


class SessionLost(RuntimeError):
  """The worker no longer has this session."""


class RemoteEnv:
  """An environment hosted by an `envs.server` worker; same methods as `Env`."""

  def __init__(self, url: str, *, timeout_s: float = 120.0,
               client: Optional[httpx.AsyncClient] = None):
    self.url = url.rstrip("/")
    self._client = client or httpx.AsyncClient(timeout=timeout_s)
    self._own_client = client is None
    self.session_id: Optional[str] = None
    self.done = False

  async def _call(self, method: str, path: str, **kw) -> dict:
    r = await self._client.request(method, self.url + path, **kw)
    if r.status_code == 404 and self.session_id and self.session_id in path:
      raise SessionLost(r.json().get("detail", r.text))
    if r.status_code >= 400:
      detail = r.json().get("detail", r.text) if r.headers.get(
          "content-type", "").startswith("application/json") else r.text
      raise RuntimeError(f"env worker {self.url}{path}: {r.status_code}: {detail}")
    return r.json()

  async def reset(self, task: TaskSpec) -> Observation:
    if self.session_id is not None:
      await self.close()
    out = await self._call("POST", "/sessions", json={"task": task.to_dict()})
    self.session_id = out["session_id"]
    self.done = False
    return Observation(**out["observation"])

  async def step(self, action: str) -> StepResult:
    out = await self._call("POST", f"/sessions/{self.session_id}/step", json={"action": action})
    self.done = out["terminated"] or out["truncated"]
    return StepResult(Observation(**out["observation"]), out["reward"], out["terminated"],
                      out["truncated"], out["info"])

  async def verify(self) -> Verdict:
    out = await self._call("POST", f"/sessions/{self.session_id}/verify")
    out["status"] = VerdictStatus(out["status"])
    return Verdict(**out)

  async def close(self) -> None:
    if self.session_id is not None:
      sid, self.session_id = self.session_id, None
      try:
        await self._call("DELETE", f"/sessions/{sid}")
      except (SessionLost, RuntimeError, httpx.HTTPError):
        pass

  async def aclose(self) -> None:
    await self.close()
    if self._own_client:
      await self._client.aclose()


def main(argv=None) -> int:
  import uvicorn

  p = argparse.ArgumentParser(prog="python -m envs.server", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--port", type=int, default=8100)
  p.add_argument("--sandboxes", type=int, default=8)
  p.add_argument("--max-sessions", type=int, default=256)
  p.add_argument("--max-concurrent-calls", type=int, default=32)
  p.add_argument("--deadline-s", type=float, default=60.0)
  args = p.parse_args(argv)
  resources = EnvResources(sandboxes=args.sandboxes)
  app = create_app(resources, max_sessions=args.max_sessions,
                   max_concurrent_calls=args.max_concurrent_calls, deadline_s=args.deadline_s)
  try:
    uvicorn.run(app, host=args.host, port=args.port)
  finally:
    resources.close()
  return 0


if __name__ == "__main__":
  sys.exit(main())

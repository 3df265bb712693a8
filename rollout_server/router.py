"""Several rollout servers behind one address, routed by consistent hashing on the session id.

A session's turns land on the server that holds its prefix in cache. Each
backend sits at many points of a hash ring (virtual nodes); a key goes to the
first healthy backend clockwise from its hash, and on a connection failure to
the next one (failover). A background task checks `/health` of every backend.
`POST /update_weights` goes to every backend.

`python -m rollout_server.router --backends http://127.0.0.1:8001,http://127.0.0.1:8002 --port 8000`
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import hashlib
import json
import sys
import uuid
from typing import Optional, Sequence

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

SESSION_HEADER = "x-session-id"
_HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}


def _hash(key: str) -> int:
  return int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "big")


class HashRing:
  """Consistent hashing of keys onto backends with virtual nodes."""

  def __init__(self, backends: Sequence[str], replicas: int = 64):
    if not backends:
      raise ValueError("a router needs at least one backend")
    self.backends = list(backends)
    points = sorted((_hash(f"{b}#{i}"), b) for b in self.backends for i in range(replicas))
    self._keys = [p for p, _ in points]
    self._owners = [b for _, b in points]

  def candidates(self, key: str) -> list[str]:
    """Backends in ring order starting at `key`'s owner, each once."""
    start = bisect.bisect(self._keys, _hash(key)) % len(self._keys)
    out: list[str] = []
    for i in range(len(self._owners)):
      b = self._owners[(start + i) % len(self._owners)]
      if b not in out:
        out.append(b)
        if len(out) == len(self.backends):
          break
    return out


def create_router(backends: Sequence[str], *, health_interval_s: float = 2.0,
                  timeout_s: float = 600.0) -> FastAPI:
  ring = HashRing([b.rstrip("/") for b in backends])
  healthy = {b: True for b in ring.backends}
  counts = {b: 0 for b in ring.backends}
  failovers = {"n": 0}
  client_box: dict = {}

  def client() -> httpx.AsyncClient:
    if "c" not in client_box:
      client_box["c"] = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))
    return client_box["c"]

  async def check(backend: str) -> None:
    try:
      r = await client().get(f"{backend}/health", timeout=5.0)
      healthy[backend] = r.status_code == 200
    except httpx.HTTPError:
      healthy[backend] = False

  async def health_loop() -> None:
    while True:
      await asyncio.gather(*(check(b) for b in ring.backends))
      await asyncio.sleep(health_interval_s)

  @contextlib.asynccontextmanager
  async def lifespan(_app):
    task = asyncio.create_task(health_loop())
    yield
    task.cancel()
    if "c" in client_box:
      await client_box["c"].aclose()

  app = FastAPI(title="jaxagent rollout router", lifespan=lifespan)

  def routing_key(request: Request, body: bytes) -> str:
    sid = request.headers.get(SESSION_HEADER)
    if sid:
      return sid
    if request.url.path.startswith("/sessions/"):
      return request.url.path.split("/", 2)[2]
    try:
      data = json.loads(body) if body else {}
      if isinstance(data, dict) and data.get("session_id"):
        return str(data["session_id"])
    except ValueError:
      pass
    return uuid.uuid4().hex  # no session: any backend

  @app.get("/router/health")
  async def router_health():
    return {"backends": [{"url": b, "healthy": healthy[b], "requests": counts[b]}
                         for b in ring.backends], "failovers": failovers["n"]}

  @app.get("/health")
  async def health():
    ok = any(healthy.values())
    return JSONResponse({"status": "ok" if ok else "no healthy backend",
                         "healthy": sum(healthy.values()), "backends": len(ring.backends)},
                        status_code=200 if ok else 503)

  @app.post("/update_weights")
  async def update_all(request: Request):
    body = await request.body()
    results = await asyncio.gather(*(
        client().post(f"{b}/update_weights", content=body,
                      headers={"content-type": "application/json"})
        for b in ring.backends), return_exceptions=True)
    out = []
    for b, r in zip(ring.backends, results):
      if isinstance(r, Exception):
        out.append({"backend": b, "error": f"{type(r).__name__}: {r}"})
      else:
        out.append({"backend": b, "status": r.status_code, "body": r.json()})
    ok = all(isinstance(r, httpx.Response) and r.status_code == 200 for r in results)
    return JSONResponse({"results": out}, status_code=200 if ok else 502)

  @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
  async def proxy(path: str, request: Request):
    body = await request.body()
    key = routing_key(request, body)
    order = ring.candidates(key)
    order = [b for b in order if healthy[b]] + [b for b in order if not healthy[b]]
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
    last_error: Optional[str] = None
    for i, backend in enumerate(order):
      req = client().build_request(request.method, f"{backend}/{path}", content=body,
                                   headers=headers, params=request.query_params)
      try:
        resp = await client().send(req, stream=True)
      except httpx.TransportError as e:  # connection refused, reset, ...: next on the ring
        healthy[backend] = False
        failovers["n"] += 1
        last_error = f"{backend}: {type(e).__name__}: {e}"
        continue
      counts[backend] += 1
      out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}
      out_headers["x-routed-to"] = backend
      if resp.headers.get("content-type", "").startswith("text/event-stream"):
        async def relay(resp=resp):
          try:
            async for chunk in resp.aiter_raw():
              yield chunk
          finally:
            await resp.aclose()
        return StreamingResponse(relay(), status_code=resp.status_code, headers=out_headers)
      content = await resp.aread()
      await resp.aclose()
      return Response(content, status_code=resp.status_code, headers=out_headers)
    return JSONResponse({"detail": f"no backend could take the request; last error: "
                                   f"{last_error}"}, status_code=502)

  return app


def main(argv=None) -> int:
  import uvicorn

  p = argparse.ArgumentParser(prog="python -m rollout_server.router", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--backends", required=True, help="comma-separated server URLs")
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--port", type=int, default=8000)
  args = p.parse_args(argv)
  backends = [b for b in args.backends.split(",") if b]
  uvicorn.run(create_router(backends), host=args.host, port=args.port)
  return 0


if __name__ == "__main__":
  sys.exit(main())

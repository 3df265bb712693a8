"""Serving an ASGI app from a command line: the socket is bound before the command says
where it serves, so a port in use (or a host that is not this machine's) is one clear
error and exit 2, not a line saying "serving on ..." followed by uvicorn's log of the
failure. Used by every service CLI (rollout server, router, environment worker, viewer).
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import json
import math
import signal
import socket
import sys
import threading
from typing import Any, Callable, Optional

import numpy as np
import uvicorn
from fastapi import Depends, Request
from fastapi.exception_handlers import (http_exception_handler,
                                         request_validation_exception_handler)
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from envs.values import json_depth  # (standard library only)


class ListenError(OSError):
  """A service could not listen where it was told to (the message names host and port)."""


def listen(host: str, port: int) -> socket.socket:
  """A TCP socket bound to `host:port` (0: a free port), listening."""
  if not 0 <= port <= 65535:  # (the socket layer would take it modulo 65536)
    raise ListenError(f"cannot listen on {host}:{port}: a port is 0..65535")
  try:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
  except OSError as e:
    raise ListenError(f"cannot listen on {host}:{port}: {e}") from None
  family, kind, proto, _, address = infos[0]
  sock = socket.socket(family, kind, proto)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind(address)
    sock.listen(2048)
  except OSError as e:
    sock.close()
    why = "the port is in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
    raise ListenError(f"cannot listen on {host}:{port}: {why}") from None
  return sock


def listen_or_say(host: str, port: int, prefix: str = "error") -> Optional[socket.socket]:
  """`listen`, or None after one line on stderr (`<prefix>: cannot listen on ...`): a
  CLI then exits 2."""
  try:
    return listen(host, port)
  except ListenError as e:
    print(f"{prefix}: {e}", file=sys.stderr)
    return None


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_log_level(parser) -> None:
  """A service CLI's `--log-level` (uvicorn's; `warning` drops its line per request)."""
  parser.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                      help="uvicorn's log level (default info: a line per request; "
                           "warning: none)")


# Seconds an idle keep-alive connection is kept open: longer than clients keep theirs
# (httpx, under the openai and anthropic clients, 5 s), so the client closes first. At
# uvicorn's 5 s both closed at once, and a turn sent on a connection the server was
# closing failed with a bare ReadError, its episode lost (red team 27).
KEEP_ALIVE_S = 75


def control_guard(token: Optional[str], key=None) -> list:
  """The `dependencies` of a guarded route of a process holding `token`: a server's or
  router's control route (`key` None: `jaxagent.control.CONTROL`), an environment
  worker's session route (`control.ENVS`). A call without it is a 401, before its
  body's fields are checked."""
  from jaxagent import control

  key = key or control.CONTROL

  async def controlled(request: Request) -> None:
    given = request.headers.get(key.header)
    if not control.allows(token, given):
      raise HTTPException(401, key.refusal(given))

  return [Depends(controlled)]


def _exit_by_signal(signum: int, frame) -> None:
  raise SystemExit(128 + signum)


def serve(app, sock: socket.socket, *, log_level: str = "info") -> None:
  """Runs uvicorn on the bound `sock` until it is stopped (SIGINT / SIGTERM), then exits
  128 + the signal's number, Python's exit handlers run."""
  host, port = sock.getsockname()[:2]
  config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          timeout_keep_alive=KEEP_ALIVE_S)
  main = threading.current_thread() is threading.main_thread()
  if main:
    # uvicorn shuts down on SIGTERM, then raises it again into the handler it found: the
    # default one killed the process, its exit handlers not run (an environment worker's
    # sandbox lock file was left in /tmp; a reviewer).
    previous = signal.signal(signal.SIGTERM, _exit_by_signal)
  try:
    uvicorn.Server(config).run(sockets=[sock])
  except KeyboardInterrupt:  # (uvicorn raises the Ctrl-C again once it has shut down,
    raise SystemExit(130) from None  # as a traceback when it came mid-request or twice)
  finally:
    if main:
      signal.signal(signal.SIGTERM, previous)


async def client_gone(request) -> None:
  """Returns when the client of an ASGI request whose body was read disconnects (a
  server aborts the work it asked for, a router its backend request)."""
  while (await request.receive())["type"] != "http.disconnect":
    await asyncio.sleep(0.05)  # (a server that repeats empty body messages)


NESTED_TOO_DEEP = "body: JSON nested too deep to read"
# The deepest a request's JSON body may nest (lists and objects). Python 3.11's parser
# stopped near its recursion limit; 3.13's reads bodies nested 5,000 deep, which then
# overflowed the recursion of the code that walks them (a 500, on a chat route).
MAX_BODY_DEPTH = 128

_STEP = np.zeros(256, np.int8)  # (a bracket's step in depth, by its byte)
_STEP[list(b"[{")], _STEP[list(b"]}")] = 1, -1


def body_depth(body: bytes, value) -> int:
  """How deep lists and objects nest in `value`, the JSON text `body` parsed. Measured
  on the text where it is UTF-8, in numpy: a quote after an even run of backslashes opens
  or closes a string, and a running sum over the brackets outside strings is the depth
  (cutting the strings out by a regular expression took 2.4 s for 46 MB of short items,
  the event loop held; red team 116). Else the value is walked (`json_depth`)."""
  if not isinstance(value, (list, dict)):
    return 0
  if b"\x00" in body:  # (UTF-16 and UTF-32 JSON hold NULs; valid UTF-8 JSON none)
    return json_depth(value)
  text = np.frombuffer(body, np.uint8)
  quotes = np.flatnonzero(text == ord('"'))
  slashes = np.flatnonzero(text == ord("\\"))
  if slashes.size:  # (in valid JSON only a string holds them)
    starts = np.flatnonzero(np.diff(slashes, prepend=-2) != 1)  # (runs of backslashes)
    ends = np.append(starts[1:], slashes.size) - 1
    odd_end = np.zeros(text.size, bool)  # (where a run of an odd number of them ends)
    odd_end[slashes[ends[(ends - starts) % 2 == 0]]] = True
    quotes = quotes[~odd_end[np.maximum(quotes - 1, 0)]]  # (escaped ones out)
  toggle = np.zeros(text.size, np.uint8)
  toggle[quotes] = 1
  steps = _STEP[text]
  steps[np.bitwise_xor.accumulate(toggle).view(bool)] = 0  # (inside strings)
  steps = steps[steps != 0]
  return int(np.cumsum(steps, dtype=np.int32).max()) if steps.size else 0


def _read_as_json(request) -> bool:
  """Whether FastAPI reads the request's body as JSON (no content type, or a JSON one)."""
  kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
  return not kind or kind == "application/json" or (kind.startswith("application/")
                                                    and kind.endswith("+json"))


NOT_UTF8 = ("body: JSON must be UTF-8 (RFC 8259); this body holds a NUL byte (UTF-16 or "
            "UTF-32 text, or a NUL that JSON writes as \\u0000)")
_UNREADABLE = "There was an error parsing the body"  # (FastAPI's words for any other error)


def unreadable_body(exc: HTTPException) -> Optional[str]:
  """What FastAPI's 400 "There was an error parsing the body" was, named (bytes that are
  not UTF-8, an integer of more digits than Python converts), or None for another error."""
  cause = exc.__cause__
  if exc.detail != _UNREADABLE or not isinstance(cause, ValueError):
    return None
  # (Python's advice on long integers is the server's, not the client's)
  said = str(cause).split("; use sys.set_int_max_str_digits()")[0]
  return f"body: cannot be read as JSON: {said}"


def invalid_json(errors: list) -> Optional[str]:
  """What to say of a body that is not JSON at all, given FastAPI's validation `errors`
  (it said "1: JSON decode error"): a bad request (400), as other unreadable bodies are,
  not a body against the schema (422). None where the body read as JSON."""
  for err in errors:
    if err.get("type") == "json_invalid":
      said = (err.get("ctx") or {}).get("error", err.get("msg", ""))
      return f"body: not valid JSON ({said})"
  return None


def not_json(request, errors: list) -> Optional[str]:
  """What to say of a body FastAPI did not read as JSON, given its validation `errors`
  (one on the whole body): its content type is another (`curl -d`'s form encoding), or
  none where the route wants one (FastAPI's `strict_content_type`, the default since
  0.13x: `requests.post(url, data=text)`). None otherwise. Its 422 said only "a valid
  dictionary"."""
  if not any(tuple(e.get("loc", ()))[:2] == ("body",) for e in errors):
    return None
  kind = request.headers.get("content-type", "").split(";")[0].strip()
  if kind:
    return None if _read_as_json(request) else (
        f"body: must be JSON (content-type: application/json), not {kind}")
  strict = getattr(request.scope.get("route"), "strict_content_type", False)
  if getattr(strict, "value", strict) is True:
    return "body: must be JSON, sent with content-type: application/json (none was sent)"
  return None


class EndedStream(StreamingResponse):
  """A streamed response that calls `on_end` (awaited when it is a coroutine function)
  when it ends, however it ends: a client gone by the time its handler answered
  cancelled the stream before its generator ran, nor the generator's `finally`, so what
  that `finally` lets go (a turn's request: `server`; a backend's response relayed:
  `router`) must be let go here too (a reviewer)."""

  def __init__(self, content: Any, on_end: Callable[[], Any], **kw):
    super().__init__(content, **kw)
    self.on_end = on_end

  async def __call__(self, scope, receive, send) -> None:
    try:
      await super().__call__(scope, receive, send)
    finally:
      ended = self.on_end()
      if inspect.isawaitable(ended):
        await ended


class DepthBoundRoute(APIRoute):
  """A route whose JSON body nests deeper than MAX_BODY_DEPTH is refused before it is
  read: 400 NESTED_TOO_DEEP, alike on every Python version. The body is parsed once: the
  parse is left where FastAPI reads it next. A JSON body in UTF-16 or UTF-32 is refused
  (400 NOT_UTF8): Python reads them, but checks on the body's bytes (no NaN, no
  Infinity) did not see their words (red team 113)."""

  def get_route_handler(self):
    handler = super().get_route_handler()

    async def bounded(request):
      body = await request.body()
      # (valid UTF-8 JSON holds no NUL: a control character in a string is escaped)
      if b"\x00" in body and _read_as_json(request):
        raise HTTPException(400, NOT_UTF8)
      # (no body with fewer brackets than the bound nests past it: no parse here)
      if body.count(b"[") + body.count(b"{") > MAX_BODY_DEPTH and _read_as_json(request):
        try:
          value = json.loads(body)
        except RecursionError:
          too_deep = True
        except ValueError:  # (FastAPI names it)
          too_deep = False
        else:
          too_deep = body_depth(body, value) > MAX_BODY_DEPTH
          request._json = value  # (Starlette's Request.json() keeps its parse there)
        if too_deep:
          raise HTTPException(400, NESTED_TOO_DEEP) from RecursionError(
              f"nested deeper than {MAX_BODY_DEPTH}")
      return await handler(request)

    return bounded


def no_route(request) -> str:
  """A request no route of its app takes, named with the routes there are (a bare "Not
  Found" left a client of `/v1/completions` guessing: a new user)."""
  routes = sorted({r.path for r in request.app.routes if isinstance(r, APIRoute)})
  return (f"no route {request.method} {request.url.path[:200]!r}; this server's routes: "
          + ", ".join(routes))


def name_deep_bodies(app) -> None:
  """A JSON body nested too deep (MAX_BODY_DEPTH, or past Python's recursion limit) is
  answered 400 naming that (FastAPI said "There was an error parsing the body", or a
  500 writing its 422), and a path no route takes 404 naming the routes (`no_route`);
  other errors as before. Routes added to `app` from now on are
  `DepthBoundRoute`s."""
  app.router.route_class = DepthBoundRoute

  @app.exception_handler(HTTPException)
  async def named(request, exc: HTTPException):
    if isinstance(exc.__cause__, RecursionError):
      exc = HTTPException(exc.status_code, NESTED_TOO_DEEP)
    elif (said := unreadable_body(exc)) is not None:
      exc = HTTPException(exc.status_code, said)
    elif exc.status_code == 404 and exc.detail == "Not Found":  # (no route matched)
      exc = HTTPException(404, no_route(request))
    return await http_exception_handler(request, exc)

  @app.exception_handler(RequestValidationError)
  async def invalid(request, exc: RequestValidationError):
    unread = not_json(request, exc.errors())
    if unread is not None:
      return JSONResponse({"detail": unread}, status_code=422)
    bad = invalid_json(exc.errors())
    if bad is not None:
      return JSONResponse({"detail": bad}, status_code=400)
    try:  # (a body just under the parser's limit read, but its 422 could not be written:
      # it echoes the input, a 500; reviewer)
      return await request_validation_exception_handler(request, exc)
    except RecursionError:
      return await http_exception_handler(request, HTTPException(400, NESTED_TOO_DEEP))
    except (UnicodeEncodeError, ValueError):  # (it echoes a lone surrogate of the body, or
      # a NaN or 1e400 Python's parser took, which JSON cannot write: a 500 writing it,
      # read by a client as the server's failure; a red team)
      from fastapi.encoders import jsonable_encoder
      from starlette.responses import Response

      body = json.dumps({"detail": finite(jsonable_encoder(exc.errors()), repr)},
                        ensure_ascii=True, default=str, allow_nan=False)
      return Response(body, status_code=422, media_type="application/json")


def finite(value: Any, instead: Callable[[float], Any] = lambda x: None) -> Any:
  """`value` with each float JSON cannot write (nan, inf) as `instead` makes it (None:
  null; `repr`: its text), in its dicts, lists and tuples."""
  if isinstance(value, float):
    return value if math.isfinite(value) else instead(value)
  if isinstance(value, dict):
    return {k: finite(v, instead) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [finite(v, instead) for v in value]
  return value


class BodyLimit:
  """ASGI middleware: a request body over `limit` bytes is refused with 413, by its
  Content-Length or as it streams in, before the application parses any of it; in the
  shape `shape(path, status, message)` gives (the path without its leading slash: an
  API's own error shape), FastAPI's `detail` without one."""

  def __init__(self, app, limit: int, shape=None):
    self.app, self.limit = app, limit
    self.shape = shape or (lambda path, status, message: {"detail": message})

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    length = dict(scope.get("headers") or []).get(b"content-length")
    if length is not None and length.isdigit() and int(length) > self.limit:
      return await self._refuse(scope, send)
    messages, seen = [], 0
    while True:  # at most `limit` bytes are held: the body is read here, then replayed
      message = await receive()
      messages.append(message)
      if message["type"] == "http.disconnect":  # gone before its body came: no one to
        return  # answer (the handler's body read raised, a traceback each: a new user's
        # finding, at every Ctrl-C of `launch local`)
      if message["type"] != "http.request":
        break
      seen += len(message.get("body", b""))
      if seen > self.limit:
        return await self._refuse(scope, send)
      if not message.get("more_body", False):
        break

    async def replay():
      return messages.pop(0) if messages else await receive()

    await self.app(scope, replay, send)

  async def _refuse(self, scope, send):
    body = json.dumps(self.shape(scope.get("path", "/").lstrip("/"), 413,
                                 f"request body over {self.limit} bytes")).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})

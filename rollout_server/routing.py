"""Where a router sends a request, and what it answers when it cannot: the consistent
hash ring of backends, the path a request is forwarded as, and the router's own errors
in the shape of each API's, and how it reads a request's body and session
(`rollout_server.router`)."""

from __future__ import annotations

import bisect
import hashlib
import json
from typing import Optional, Sequence
from urllib.parse import quote, unquote

from fastapi import Request
from fastapi.responses import JSONResponse

from rollout_server import anthropic_api
from rollout_server.chat import openai_error
from rollout_server.sessions import session_header, session_of

MAX_SESSION_ID = 1024  # characters (quoted into a backend's URL: httpx takes 65,536)
# The tokens one /v1/score request may hold, all its sequences together (a server's 413
# past it; its clients send fewer at a time).
MAX_SCORE_TOKENS = 1 << 18


def key_hash(key: str) -> int:
  """A key's point on the ring: the first 8 bytes of its SHA-1 (stable across processes,
  as Python's own `hash` of a string is not)."""
  return int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "big")


class HashRing:
  """Consistent hashing of keys onto backends with virtual nodes."""

  def __init__(self, backends: Sequence[str], replicas: int = 64):
    if not backends:
      raise ValueError("a router needs at least one backend")
    self.backends = list(backends)
    points = sorted((key_hash(f"{b}#{i}"), b) for b in self.backends for i in range(replicas))
    self._keys = [p for p, _ in points]
    self._owners = [b for _, b in points]

  def candidates(self, key: str) -> list[str]:
    """Backends in ring order starting at `key`'s owner, each once."""
    start = bisect.bisect(self._keys, key_hash(key)) % len(self._keys)
    out: list[str] = []
    for i in range(len(self._owners)):
      b = self._owners[(start + i) % len(self._owners)]
      if b not in out:
        out.append(b)
        if len(out) == len(self.backends):
          break
    return out


def forwarded_path(raw_path: str) -> tuple[Optional[str], str]:
  """The path a request to the catch-all route is forwarded as (None: it is not) and its
  plain form, from the path as sent (percent-encoded). The path is judged as a backend
  could read it: decoded, its dot segments resolved (by this router's HTTP client) and
  its trailing slash redirected, so `POST //handover`, `/handover/`, `/v1/../handover`
  or `/handover%3F` reached a backend's /handover (a client setting another session's
  tokens: reviewers). A path with empty, `.` or `..` segments, or an encoded `?`, `#`
  or control character, is not forwarded; its plain form is its segments joined."""
  decoded = unquote(raw_path)
  segments = decoded.strip("/").split("/")
  plain = "/".join(segments)
  if any(s in ("", ".", "..") for s in segments) or any(
      c in "?#" or ord(c) < 32 or ord(c) == 127 for c in decoded):
    return None, plain
  return quote(plain), plain


# A router's 503 when no backend can take a turn now (the servers', not a full queue's)
NONE_AVAILABLE = "no backend can take the request now"


def error_body(path: str, status: int, message: str) -> dict:
  """An error of a request to `path` (without its leading slash) in the shape of that
  API's errors (Anthropic's, OpenAI's: in FastAPI's `detail` the `openai` client said
  only 'Error code: 400', a red team's finding), FastAPI's elsewhere."""
  if path == "v1/messages":
    return anthropic_api.error_body(status, message)
  if path in ("v1/chat/completions", "v1/responses", "v1/models"):
    return openai_error(status, message)
  return {"detail": message}


def api_error(path: str, status: int, message: str, headers: Optional[dict] = None
              ) -> JSONResponse:
  """The router's own error for a request to `path` (`error_body`)."""
  return JSONResponse(error_body(path, status, message), status_code=status, headers=headers)


def stream_cut_event(path: str, message: str) -> bytes:
  """The event that ends a stream its backend cut, in the shape of the API's own stream
  errors (`path`'s: Anthropic's `error` event, OpenAI's Responses `response.failed`
  with the top-level `error` that makes its clients raise, a chat stream's `error`
  chunk) instead of a silently cut connection: the answer is incomplete, an
  infrastructure failure and no answer to score."""
  error = {"message": message, "type": "backend_unavailable", "code": 502}
  if path == "v1/messages":
    body = json.dumps(anthropic_api.error_body(502, message))
    return f"event: error\ndata: {body}\n\n".encode()
  if path == "v1/responses":
    body = json.dumps({"type": "response.failed", "error": error, "response": {
        "status": "failed", "output": [], "error": {"code": "server_error", "message": message}}})
    return f"event: response.failed\ndata: {body}\n\n".encode()
  return f"data: {json.dumps({'error': error})}\n\n".encode()


def parsed(body: bytes) -> dict:
  """The request's JSON object; {} when it is none (its backend says what is wrong)."""
  try:
    data = json.loads(body) if body else {}
  except (ValueError, RecursionError):
    data = {}
  return data if isinstance(data, dict) else {}


def id_too_long(name: str, value: str) -> Optional[str]:
  """What to say of an id longer than MAX_SESSION_ID (quoted into a backend's URL past
  httpx's limit, it was a 500; red team 115), else None."""
  if len(value) <= MAX_SESSION_ID:
    return None
  return f"{name}: {len(value)} characters; at most {MAX_SESSION_ID}"


def long_id(name: str, value: str) -> Optional[JSONResponse]:
  """A 400 for an id longer than MAX_SESSION_ID (`id_too_long`), else None."""
  said = id_too_long(name, value)
  return None if said is None else JSONResponse({"detail": said}, status_code=400)


def session_from(request: Request, data: dict) -> Optional[str]:
  """The request's session (`sessions.session_of`: its header, or its body's).
  ValueError for two headers (the router read the first, the backend the last: a
  turn recorded in another client's session, unseen by the router; red team 115) or
  an id longer than MAX_SESSION_ID (its URL past httpx's limit: a 500 for a turn
  the backend had served)."""
  session_id = session_of(session_header(request.headers), data.get("session_id"))
  if session_id is not None and (said := id_too_long("session_id", session_id)):
    raise ValueError(said)
  return session_id


def handover_refused() -> JSONResponse:
  """A router's answer to `POST /handover`: it hands sessions over itself (forwarded, any
  client could set the token ids another session's next turn continues; a reviewer)."""
  return JSONResponse({"detail": "the router hands sessions over itself; POST /handover "
                                 "to a server, not through the router"}, status_code=403)

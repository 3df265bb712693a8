"""Several rollout servers behind one address, routed by consistent hashing on the session id.

A session's turns land on the server that holds its prefix in cache. Each
backend sits at many points of a hash ring (virtual nodes); a key goes to the
first healthy backend clockwise from its hash, and on a connection failure to
the next one (failover). A background task checks `/health` of every backend; one
that comes back (or serves another policy version) loads the current policy before
it takes traffic. `POST /update_weights` goes to every healthy backend and reports
each one's result. The router keeps a copy of every session's recorded turns, so
`GET /sessions/{id}` still answers after the backend that ran them died. A stream
cut by a dying backend ends with an error event (Anthropic's shape on `/v1/messages`).
A Responses call continuing a response the router relayed goes to the backend that
keeps it, or, that one down, to another with the chain's items as its input.
With JAXAGENT_CONTROL_TOKEN set (the servers' own), its control routes take the
X-Control-Token header and its own control calls to the servers carry it
(docs/serving.md); its /health names the servers that refuse its token.

`python -m rollout_server.router --backends http://127.0.0.1:8001,http://127.0.0.1:8002 --port 8000`
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import heapq
import json
import logging
import math
import re
import sys
import uuid
import weakref
from typing import Optional, Sequence
from urllib.parse import quote

import httpx
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from jaxagent import control
from jaxagent.config import ServerConfig
from jaxagent.serve_http import BodyLimit, EndedStream, client_gone, control_guard
from jaxagent.stopping import unless_stopped
from rollout_server import responses_api
from rollout_server.router_backends import Rotation, is_version
from rollout_server.routing import (NONE_AVAILABLE, api_error, error_body, forwarded_path,
                                    handover_refused, long_id, parsed, session_from,
                                    stream_cut_event)
from rollout_server.sessions import SessionStore

log = logging.getLogger(__name__)

FIRST_ROUND_WAIT_S = 15.0  # the longest a /health waits for the first round of checks
MAX_CONNECTIONS = 1000  # turns the router holds open to its backends at once (each a connection)
_HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}


# The router's own paths: a backend's, reached through the router, would be another
# client's way to set a session's tokens (handover), a policy (update_weights), or a
# backend's health read as the router's. Each with the method the router takes it by.
_ROUTERS_OWN = {"handover": "POST", "update_weights": "POST", "health": "GET",
                "router/health": "GET", "control": "GET"}


class _Unreadable(Exception):
  """A backend's record of a session could not be read (an error, not a record)."""


class _Router(Rotation):
  """What a router holds and does apart from its routes: its backends (`Rotation`: their
  health, the policy they must serve, their control token, the deletes they missed),
  its copy of every session's turns, the responses it relayed, and the forwarding of a
  call to the backend its session hashes to (`proxy`)."""

  def __init__(self, backends: Sequence[str], *, health_interval_s: float, timeout_s: float,
               turn_timeout_s: float, max_sessions: int, session_ttl_s: Optional[float],
               session_max_bytes: Optional[int], max_body_bytes: int,
               control_token: Optional[str], max_connections: int, health_timeout_s: float):
    super().__init__(backends, health_interval_s=health_interval_s, timeout_s=timeout_s,
                     turn_timeout_s=turn_timeout_s, max_sessions=max_sessions,
                     control_token=control_token, max_connections=max_connections,
                     health_timeout_s=health_timeout_s)
    self.max_body_bytes = max_body_bytes
    self.sessions = SessionStore(self.max_sessions, session_ttl_s, session_max_bytes)
    # session id -> {backend: turns of its record already copied}; only sessions a backend
    # had (a read of an unknown id must not push live ones out)
    self.cursors: collections.OrderedDict[str, dict] = collections.OrderedDict()
    # One copy of a session at a time (concurrent turns of one session each copied the
    # same turns); a lock lives while someone holds or waits for it.
    self.copy_locks: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
    # session id -> backends whose record of it a copy could not read: a read of the
    # session while one of them is out of rotation cannot be whole (a reviewer).
    self.owed: collections.OrderedDict[str, set] = collections.OrderedDict()
    # Responses relayed (`/v1/responses`): which backend keeps each, and its items, so that
    # a call continuing one reaches it, or another with the chain's items when it is down.
    # (as much as its backends keep together: one server's bound filled n times sooner)
    self.relayed = responses_api.RelayedResponses((64 << 20) * len(self.ring.backends))
    # session id -> the copies after its streams, running (a read of it waits for them)
    self.copying: dict[str, set] = {}
    # session id -> the backend that ran its last turn in this router's copy
    self.last_from: collections.OrderedDict[str, str] = collections.OrderedDict()
    # session id -> the id of the last response relayed in it (a call going on from
    # another, earlier one is a retry or a branch)
    self.latest: collections.OrderedDict[str, str] = collections.OrderedDict()
    # session ids whose turns on a backend were lost before this router copied them (the
    # backend restarted, or its record was made anew): their reads answer 502, not a
    # record without them (red team 27)
    self.lost: collections.OrderedDict[str, set] = collections.OrderedDict()

  def lost_threads(self, backend: str) -> None:
    """`backend` restarted: the threads of the sessions whose last turn it ran are gone
    with the old instance, so their next turn is handed over wherever it goes (there
    too: before, it went on there encoded from its text)."""
    for session_id, ran in self.last_from.items():
      if ran == backend:
        self.last_from[session_id] = ""  # (a backend that is none: every one is handed it)

  async def copies_done(self, session_id: str) -> None:
    """Returns when the session's stream copies under way are done (waited on, not
    gathered: a caller cancelled would cancel them)."""
    if self.copying.get(session_id):
      await asyncio.wait(set(self.copying[session_id]))

  def copied(self, session_id: str, task: asyncio.Task) -> None:
    running = self.copying.get(session_id, set())
    running.discard(task)
    if not running:
      self.copying.pop(session_id, None)


  async def fetch_turns(self, session_id: str, backend: str, since: int) -> Optional[dict]:
    """The backend's record of the session from turn `since` on; None when it has none
    (404). Raises `_Unreadable` when it cannot be read or is not a record (a dict with
    `turns`, records each, and an integer `count`: a backend's garbage turned a served
    turn into a 500, red team 14)."""
    try:
      r = await self.client(backend).get(f"{backend}/sessions/{quote(session_id, safe='')}",
                                  params={"since": since}, timeout=10.0)
      if r.status_code == 404:
        return None
      got = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, RecursionError) as e:  # (nested past reading)
      raise _Unreadable(f"{backend}: {type(e).__name__}: {e}") from None
    turns = got.get("turns") if isinstance(got, dict) else None
    if not (isinstance(turns, list) and isinstance(got.get("count", 0), int)
            and all(isinstance(t, dict) and isinstance(t.get("recorded_at", 0.0), (int, float))
                    for t in turns)):
      if got is not None:
        log.warning("router: %s's record of session %r is not a record: left", backend,
                    session_id)
      raise _Unreadable(f"{backend} answered {r.status_code} for its record" + (
          "" if got is None else " (not a record)"))
    return got

  async def new_turns(self, session_id: str, backend: str
                      ) -> Optional[tuple[int, list, Optional[str]]]:
    """(where the copy of `backend`'s record goes on from, the turns it recorded for the
    session since, its record's id), or None when it holds none; `_Unreadable` when it
    cannot be read."""
    n, seen = self.cursors.get(session_id, {}).get(backend, (0, None))
    got = await self.fetch_turns(session_id, backend, n)
    made = got.get("record_id") if got is not None else None
    began_again = got is not None and (got.get("count", n) < n or (
        seen is not None and made is not None and made != seen))
    if backend in self.owed.get(session_id, ()) and (got is None or began_again):
      # Turns it ran that no copy read are gone with its record (red team 27: a read
      # answered 200 without them, and the episode trained without them).
      self.forget_later(self.lost, session_id, self.lost.get(session_id, set()) | {backend})
    if began_again:
      # The backend's record began again (it restarted at the same address, or the
      # session was deleted there and made anew): its turns since then are all new (by
      # the count alone, one turn after a restart that had copied one was taken for
      # copied and lost: red team 23).
      n, got = 0, await self.fetch_turns(session_id, backend, 0)
    if got is None:
      return None
    return n, got["turns"], got.get("record_id")

  async def copy_turns(self, session_id: str, *backends: str, strict: bool = False) -> None:
    """Appends the turns `backends` recorded for the session since the last copy, in the
    order they were recorded (a session that failed over ran turns on several). When
    this router's copy was evicted (a bound, or its time to live), every live backend
    that ran its turns is copied whole again."""
    async with self.lock_of(self.copy_locks, session_id):
      asked, known = backends, dict(self.cursors.get(session_id, {}))
      for _ in range(3):
        if session_id not in self.sessions and (session_id in self.cursors or known):
          # Evicted (before, or while its backends were read: its cursors may have gone
          # with it then, and `known` holds them). Every backend that ran its turns is
          # copied from the start again, and owes them until it is: one out of rotation
          # now is read whole when it is back, and a read meanwhile fails (skipped, the
          # read answered 200 without its turns; a reviewer). Each keeps the id of the
          # record it copied: one made anew since lost those turns.
          ran = self.cursors[session_id] = {
              b: (0, seen) for b, (_, seen) in (self.cursors.get(session_id) or known).items()}
          known = ran
          self.forget_later(self.owed, session_id, self.owed.get(session_id, set()) | set(ran))
          backends = (*(b for b in ran if b not in asked and self.healthy.get(b)), *asked)
        held = session_id in self.sessions
        # (a backend whose record cannot be read now: the copy catches up at the next
        # turn or read; a read of the record, `strict`, fails instead: the router
        # answered 200 without the turns it could not read, and the episode trained
        # without them)
        got = await asyncio.gather(*(self.new_turns(session_id, b) for b in backends),
                                   return_exceptions=True)
        # (evicted while its backends were read, by other sessions' copies: the turns
        # read would begin a copy without the earlier ones, and every read after it
        # answered 200 without them; a reviewer. Copied whole again.)
        if not held or session_id in self.sessions:
          break
      else:
        if strict:
          raise _Unreadable("this router's copy of it was evicted while it was read, "
                            "three times (its session store is full: raise the router's "
                            "--max-sessions or --session-max-bytes)")
        return
      failed = [g for g in got if isinstance(g, BaseException)]
      if failed and (strict or not all(isinstance(g, _Unreadable) for g in failed)):
        raise failed[0]
      for b, g in zip(backends, got):  # (which backends' records this copy lacks)
        if isinstance(g, _Unreadable):
          self.forget_later(self.owed, session_id, self.owed.get(session_id, set()) | {b})
        elif session_id in self.owed:
          self.owed[session_id].discard(b)
      read = [(b, g) for b, g in zip(backends, got)
              if g is not None and not isinstance(g, BaseException)]
      if not read:
        return
      # Each backend's turns in its own order, interleaved by when they were recorded
      # (`recorded_at`, each server's clock; a server without it: its turns first).
      turns = list(heapq.merge(*(ts for _, (_, ts, _) in read),
                               key=lambda t: t.get("recorded_at", 0.0)))
      if turns:
        try:
          self.sessions.merge(session_id, turns)
        except Exception as e:  # (the served turn is the client's: its record is ours)
          # Some of them may be in: the copy is dropped, copied whole again at its next
          # read or turn (kept, the next copy appended them a second time; a reviewer);
          # the turns of a backend out of rotation now are owed until it is back.
          self.sessions.pop(session_id)
          away = {b for b in self.cursors.get(session_id, {}) if not self.healthy[b]}
          if away:
            self.forget_later(self.owed, session_id, self.owed.get(session_id, set()) | away)
          log.exception("router: session %r's turns could not be copied", session_id)
          if strict:
            raise _Unreadable(f"its turns could not be copied ({type(e).__name__})") from None
          return
      if turns:
        newest = max(((ts[-1].get("recorded_at", 0.0), b) for b, (_, ts, _) in read if ts),
                     key=lambda x: x[0])
        self.forget_later(self.last_from, session_id, newest[1])
      for b, (n, ts, made) in read:  # (copied: only now past them)
        self.cursors.setdefault(session_id, {})[b] = (n + len(ts), made)
      self.cursors.move_to_end(session_id)
      # (the oldest cursor of a session whose copy is gone: a read moves its cursor and
      # not its copy, and a cursor evicted under a copy held had the whole record copied
      # again on top of it, every turn twice; a reviewer)
      while len(self.cursors) > self.max_sessions:
        gone = next((s for s in self.cursors if s not in self.sessions), None)
        if gone is None:
          break
        del self.cursors[gone]

  async def hand_over(self, session_id: str, backend: str) -> bool:
    """Before a session's turn goes to a backend other than the one that ran its last
    turn (a failover, or the return of its own): hands it the session's threads (`POST
    /handover`: its last turn, side calls' before it), so that the call continues their
    tokens as sampled. Without it the turn's reply was encoded again from its text there
    and the trajectory forked at every failover (red team 27: 76 of ~2,500 turns). Not
    when this router's copy may lack turns (a record it could not read, or lost): an
    older turn handed over would hide the backend's own newer one. False when the
    backend cannot be reached (the turn goes to the next one); a backend that answers
    but does not take the threads is sent the turn all the same (its prompt encoded
    from the text there)."""
    await self.copies_done(session_id)  # (a stream's copy says which backend ran the last turn)
    if (self.last_from.get(session_id) in (None, backend) or self.owed.get(session_id)
            or session_id in self.lost):
      return True
    carried = self.sessions.handover(session_id)
    if carried is None:
      return True
    try:
      # (the client's bound, as the turn's own requests: a busy server is not a dead one)
      # (cut when its health checks go unanswered, as the turn's own send: a host gone
      # without a reset held the turn up to the client's bound, 600 s; a reviewer)
      r = await unless_stopped(self.client(backend).post(
          f"{backend}/handover", headers=self.ruling,
          json={"session_id": session_id, "turns": carried}), self.gone(backend))
      if r is None:
        return False  # (the turn goes to the next backend)
      why = None if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:200]}"
    except httpx.TransportError as e:
      if not isinstance(e, (httpx.ReadTimeout, httpx.PoolTimeout)):
        return False  # (refused, reset: as a turn's own send, the next backend's)
      why = f"{type(e).__name__}: {e}"
    except httpx.HTTPError as e:
      why = f"{type(e).__name__}: {e}"
    self.failovers["handovers_failed" if why else "handovers"] += 1
    if why is None:  # (it holds them now: a call sent there again is not handed them again)
      self.forget_later(self.last_from, session_id, backend)
    if why:
      log.warning("router: %s did not take session %r's threads (%s); the session's "
                  "turn there is encoded from its text", backend, session_id, why)
    return True

  async def delete_everywhere(self, session_id: str):
    """Deletes the session in this router's copy and on every healthy backend (one out
    of rotation is owed it: `must_delete`); the route's answer."""
    self.cursors.pop(session_id, None)
    self.last_from.pop(session_id, None)
    self.latest.pop(session_id, None)
    had = self.sessions.pop(session_id) is not None

    refused: dict = {}  # backend -> its 401/403 (this router lacks the run's token)

    async def delete_on(b: str) -> Optional[bool]:
      """Whether `b` held the session; None when it could not say (deleted later)."""
      with contextlib.suppress(httpx.HTTPError):
        r = await self.client(b).delete(f"{b}/sessions/{quote(session_id, safe='')}", timeout=10.0,
                                       headers=self.ruling)
        if r.status_code in (401, 403):
          refused[b] = r.status_code
          return False
        return True if r.status_code == 200 else False if r.status_code == 404 else None
      return None

    self.owed.pop(session_id, None)
    self.lost.pop(session_id, None)
    for b in self.ring.backends:
      if not self.healthy[b]:  # (deleted there before it takes traffic again)
        self.must_delete(b, session_id)
    asked = [b for b in self.ring.backends if self.healthy[b]]
    found = await asyncio.gather(*(delete_on(b) for b in asked))
    for b, done in zip(asked, found):
      if done is None:  # (failed: a healthy backend kept the record; a reviewer)
        self.must_delete(b, session_id)
    # (one out of rotation takes the delete it is owed before it serves again; one that
    # refuses the token stays out meanwhile)
    if refused:  # (said, not done: a record left there would be read as deleted)
      return JSONResponse({"detail": "the session's delete was refused by "
                                     + ", ".join(f"{b} ({c})" for b, c in refused.items())
                                     + f": the router and its servers share {control.ENV}"},
                          status_code=502)
    found = [bool(f) for f in found]
    if not had and not any(found):
      return JSONResponse({"detail": f"no session {session_id!r}"}, status_code=404)
    return {"session_id": session_id, "deleted": True}

  async def proxy(self, path: str, request: Request):
    """A call the router does not answer itself, forwarded to the backend its session
    hashes to (the next healthy one on the ring when that one fails), its turns copied
    and its session handed over where it moved."""
    # (forwarded as sent, a trailing slash's redirect from the backend to its own
    # address went back to the client, who then called it past the router: red team 41)
    raw = request.scope.get("raw_path") or quote(request.scope["path"]).encode()
    sent = raw.decode("utf-8", "replace")
    forwarded, path = forwarded_path(sent)
    if path == "handover":
      return handover_refused()
    if path == "abort":  # (forwarded, any client aborted another's turn by its id, which
      # `GET /requests?session_id=` names: the turn lost, read as the server's; red team 115)
      return api_error(path, 403, "the router does not pass /abort on: a client ends its own "
                                "turn by disconnecting; abort at a server, not through the "
                                "router")
    if path in _ROUTERS_OWN and request.scope["path"] == f"/{path}":
      # (its route took another method: "GET /update_weights" was a 404 telling the
      # client to GET it; red team 115)
      allowed = _ROUTERS_OWN[path]
      return JSONResponse({"detail": f"{request.method} /{path}: the router takes "
                                     f"{allowed} there"},
                          status_code=405, headers={"allow": allowed})
    if forwarded is None or path in _ROUTERS_OWN:
      return api_error(path, 404, f"no such path: {sent!r}" + (
          f" (the router's own is /{path}: {_ROUTERS_OWN[path]} it as that)"
          if path in _ROUTERS_OWN else ""))
    body = await request.body()
    data = parsed(body)
    try:
      session_id = session_from(request, data)
    except ValueError as e:
      return api_error(path, 400, str(e))
    order = self.ring.candidates(session_id or uuid.uuid4().hex)  # no session: any backend
    # A Responses call continuing a response this router relayed goes to the backend
    # that keeps it (before, a call without a session header went to any backend, most
    # often one that did not keep it: a 404); with a session header, to the session's.
    # Where the response is not kept (its backend down, or restarted and answering 404,
    # or the session's), it goes with the chain's items as its input (`whole`).
    responses = path == "v1/responses" and request.method == "POST"
    if responses and responses_api.MADE_WHOLE in data:
      return api_error(path, 400, f"{responses_api.MADE_WHOLE}: set by a router only (send "
                                "previous_response_id, or the whole input)")
    continued = data.get("previous_response_id") if responses else None
    home, whole_here = (self.relayed.home(continued) if isinstance(continued, str)
                        else (None, False))
    # A session's call going on from a response before its last one (an SDK's retry
    # from its last good response, a branch) goes to the server that keeps that
    # response while it serves: there the turn it was recorded as is continued (the
    # session handed over), where the session's own server, handed the last turn and
    # the one it went on from only, encoded it from its text (a reviewer).
    earlier = self.latest.get(session_id) not in (None, continued)
    if home is not None and (session_id is None or not whole_here
                             or (earlier and self.healthy[home])):
      # (a chain that cannot be made whole here goes to the server that keeps it, the
      # session's or not: elsewhere it could only be a 404; a reviewer)
      order = [home] + [b for b in order if b != home]
    unrecorded = data.get("record") is False  # (a /generate that asks not to be)
    del data  # (its parse of a body of up to max_body_bytes: not for the call's length)
    order = self.in_order(order)
    made_whole = home_lost = False
    whole: Optional[bytes] = None  # (the call made whole, once made)
    # (a client's control token is not passed on: the router's own calls carry the run's)
    headers = {k: v for k, v in request.headers.items()
               if k.lower() not in _HOP_HEADERS and k.lower() != control.HEADER.lower()}
    turn = path in ("generate", "v1/chat/completions", "v1/messages", "v1/responses")
    records = session_id is not None and turn and not (path == "generate" and unrecorded)
    last_error: Optional[str] = None
    while order:
      backend = order.pop(0)
      if session_id is not None and session_id in self.undeleted[backend]:
        # A delete it missed, done first: done after, at its return to rotation, it
        # wiped the turns a new episode under the id had recorded there meanwhile (red
        # team 27: turns missing from a record read as whole, prompts re-encoded).
        status = await self.delete_owed(backend, session_id)
        if status is None or status >= 500 or status in (408, 429):
          last_error = f"{backend}: a delete of the session it owes failed ({status})"
          continue
      content = body
      if home is not None and (home_lost or home != backend):
        if whole is None:
          made = self.relayed.whole(parsed(body))
          whole = b"" if made is None else json.dumps(made).encode()
          del made
          if len(whole) > self.max_body_bytes and not home_lost and self.healthy[home]:
            # (too long to send made whole: the call as sent, to the server that keeps
            # its chain, rather than a 413 while it serves; a reviewer)
            order = [home, backend] + [b for b in order if b != home]
            whole = None
            continue
          if len(whole) > self.max_body_bytes:
            return api_error(path, 413, "previous_response_id: the chain, made whole for a "
                           f"server that does not keep it, is {len(whole)} bytes, over "
                           f"{self.max_body_bytes}: send the whole input")
        if whole:  # (else its backend says the response is not kept there)
          content = whole
          self.failovers["responses_made_whole"] += not made_whole  # (calls, not sends)
          made_whole = True
      ran = self.last_from.get(session_id) if records else None
      if records and path != "generate" and not await self.hand_over(session_id, backend):
        last_error = self.down(backend, "unreachable (handing over the session's threads)")
        continue
      handed = ran != backend and records and self.last_from.get(session_id) == backend
      # A turn is as long as its tokens (its client asks how it stands, `GET
      # /requests`): a long bound of its own, and a slow backend is not a dead one.
      timeout = (httpx.Timeout(self.turn_timeout_s, connect=5.0, pool=30.0) if turn
                 else httpx.USE_CLIENT_DEFAULT)
      turns = self.client(backend, "turns")
      req = turns.build_request(request.method, f"{backend}/{forwarded}", content=content,
                                headers=headers, params=request.query_params, timeout=timeout)
      sending = asyncio.ensure_future(turns.send(req, stream=True))
      gone = asyncio.ensure_future(client_gone(request))
      lost = asyncio.ensure_future(self.gone(backend).wait())
      try:
        # (a client that gave up must not hold a connection to its backend: a stuck
        # backend's abandoned turns filled the router's pool; nor a backend gone without
        # a word, its turn: it was held up to turn_timeout_s)
        await asyncio.wait({sending, gone, lost}, return_when=asyncio.FIRST_COMPLETED)
        if not sending.done():
          sending.cancel()
          with contextlib.suppress(asyncio.CancelledError, Exception):
            await sending
          if not gone.done():
            self.failovers["streams_cut"] += 1
            return api_error(path, 502, self.down(backend, "unreachable mid-turn (its "
                                                           "health checks unanswered); the "
                                                           "turn is lost: retry the request"))
          return Response(status_code=499)
        resp = sending.result()
      except httpx.TransportError as e:  # connection refused, reset, ...: next on the ring
        if turn and isinstance(e, (httpx.ReadTimeout, httpx.PoolTimeout)):
          # A turn past its bound, or a router whose connections are all busy: not a
          # dead backend.
          slow = isinstance(e, httpx.ReadTimeout)
          return api_error(path, 504 if slow else 503,
                         f"{backend}: the turn took longer than {self.turn_timeout_s:.0f} s"
                         if slow else f"the router's {self.max_connections} connections to "
                         f"{backend} are all busy ({type(e).__name__}: {e})")
        last_error = self.down(backend, f"{type(e).__name__}: {e}")
        continue
      finally:
        gone.cancel()
        lost.cancel()
      self.counts[backend] += 1
      if resp.status_code == 404 and backend == home and not home_lost:
        # Its kept responses are gone (it restarted at its address; its own bound): so
        # may be the session's threads (before its next /health names its new instance,
        # the turn went on there encoded from its text: a reviewer), and the call goes
        # to it again made whole where this router can make it so. (A 404 from its own
        # bound alone, the server up all along, costs a handover more: harmless.)
        home_lost = True
        if records and not handed:
          self.forget_later(self.last_from, session_id, "")  # (handed over wherever it goes next)
        if whole_here:
          await resp.aclose()
          order.insert(0, backend)
          continue
      out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}
      out_headers["x-routed-to"] = backend
      # (a response made here is learnt: what its call, as the client sent it, added;
      # taken from its body only now: a served call's input fitted the model's context,
      # where a refused one's was compacted on this loop first, 5 s for 32 MB of items
      # while every other client waited; red team 115)
      step = (self.relayed.step(parsed(body)) if responses and resp.status_code == 200
              else None)
      if resp.headers.get("content-type", "").startswith("text/event-stream"):
        # (its backend's response closed however it ends: a client gone before the relay
        # began left it to the garbage collector; a reviewer)
        return EndedStream(self.relay(resp, backend, session_id if records else None,
                                      path, step), resp.aclose,
                           status_code=resp.status_code, headers=out_headers)
      try:
        content = await resp.aread()
      except httpx.ReadTimeout:  # (slow, as at its send: not a dead backend)
        return api_error(path, 504, f"{backend}: its answer was not read in time")
      except httpx.TransportError as e:  # (it died mid-answer: it was the router's 500)
        self.failovers["streams_cut"] += 1
        return api_error(path, 502, self.down(backend, f"went away mid-answer ("
                                                        f"{type(e).__name__}); the answer is "
                                                        "incomplete: retry the request"))
      finally:
        await resp.aclose()
      if records and resp.status_code == 200:
        await self.copy_turns(session_id, backend)
      if step is not None:
        made = parsed(content)
        self.relayed.learn(backend, step, made)
        if records and isinstance(made.get("id"), str):
          self.forget_later(self.latest, session_id, made["id"])
      return Response(content, status_code=resp.status_code, headers=out_headers)
    if last_error is None:  # (none tried: a moment's, asked again by clients)
      return api_error(path, 503, f"{NONE_AVAILABLE}: none is in rotation, "
                       "and those out of it are unreachable or serve another policy than "
                       f"the router's (version {self.policy['version']!r}); retry")
    return api_error(path, 502, f"no backend could take the request; last error: {last_error}")

  async def relay(self, resp: httpx.Response, backend: str, session_id: Optional[str], path: str,
                  step: Optional[tuple] = None):
    """Relays a stream; if the backend dies mid-stream, ends it with an error event (in
    the shape of the API's own stream errors: OpenAI's or Anthropic's) instead of a
    silently cut connection. `step`: the Responses call's (`RelayedResponses.step`) whose
    streamed response is learnt."""
    cut = False
    end = responses_api.StreamEnd() if step is not None else None
    lost = asyncio.Event()

    async def watch(gone: asyncio.Event) -> None:  # (its backend gone: its read cut)
      await gone.wait()
      lost.set()
      await resp.aclose()  # (the read under way raises httpx.ReadError)

    watching = asyncio.ensure_future(watch(self.gone(backend)))
    try:
      async for chunk in resp.aiter_raw():
        if end is not None:
          end.feed(chunk)
          if end.response is not None:  # (learnt before the chunk is sent: a client that
            self.relayed.learn(backend, step, end.response)  # hangs up at it ends this loop)
            if session_id is not None and isinstance(end.response, dict) and isinstance(
                end.response.get("id"), str):
              self.forget_later(self.latest, session_id, end.response["id"])
            end = None
        yield chunk
    except (httpx.TransportError, httpx.StreamError) as e:
      if not (isinstance(e, httpx.TransportError) or lost.is_set()):
        raise  # (closed by the watch while this loop was at its yield: StreamClosed)
      cut = True  # (no copy: the turn was not recorded whole, and a copy of a dead
      # backend would hold the session's reads at 502 for a turn it never had: a reviewer)
      self.failovers["streams_cut"] += 1
      why = ("unreachable: its health checks unanswered" if lost.is_set()
             else type(e).__name__)
      self.take_out(backend, f"a stream cut: {why}")
      yield stream_cut_event(path, f"the rollout server {backend} went away mid-stream "
                             f"({why}); the answer is incomplete: retry the request")
      return
    finally:
      watching.cancel()
      await resp.aclose()
      if session_id is not None and not cut:  # (in the background: also when the client
        # has gone, which closes this generator at its last chunk; awaited, the copy was cut
        # with it, and a backend that died next took the turn with it: red team 27, a
        # one-turn session read as none)
        task = asyncio.ensure_future(self.copy_turns(session_id, backend))
        self.copying.setdefault(session_id, set()).add(task)
        task.add_done_callback(lambda t: self.copied(session_id, t))


def create_router(backends: Sequence[str], *, health_interval_s: float = 2.0,
                  timeout_s: float = 600.0, turn_timeout_s: float = 3600.0,
                  max_sessions: int = 10000, session_ttl_s: Optional[float] = 3600.0,
                  session_max_bytes: Optional[int] = 1 << 30,
                  max_body_bytes: int = ServerConfig.max_body_bytes,
                  control_token: Optional[str] = None,
                  max_connections: int = MAX_CONNECTIONS,
                  health_timeout_s: float = 5.0) -> FastAPI:
  """The router app. It keeps a copy of every session's recorded turns (bounded as a
  server's records are), so a session outlives the backend its turns ran on. A turn
  (generate, chat, messages) is as long as its tokens: its backend is given
  `turn_timeout_s` (a backend that passes it answers 504 and stays in rotation), and a
  turn whose client went away is cancelled at its backend (which aborts it).
  `control_token` guards its control routes (/update_weights, DELETE /sessions), and its
  own control calls to the backends carry it (`jaxagent.control`)."""
  router = _Router(backends, health_interval_s=health_interval_s, timeout_s=timeout_s,
                   turn_timeout_s=turn_timeout_s, max_sessions=max_sessions,
                   session_ttl_s=session_ttl_s, session_max_bytes=session_max_bytes,
                   max_body_bytes=max_body_bytes, control_token=control_token,
                   max_connections=max_connections, health_timeout_s=health_timeout_s)

  @contextlib.asynccontextmanager
  async def lifespan(_app):
    task = asyncio.create_task(router.health_loop())
    yield
    task.cancel()
    await router.aclose()

  app = FastAPI(title="jaxagent rollout router", lifespan=lifespan)
  # (before any is read whole; in the shape of the API's errors, as the servers')
  app.add_middleware(BodyLimit, limit=router.max_body_bytes, shape=error_body)

  @app.get("/router/health")
  async def router_health():
    return {"backends": [{"url": b, "healthy": router.healthy[b], "requests": router.counts[b]}
                         for b in router.ring.backends], "failovers": router.failovers["n"],
            "streams_cut": router.failovers["streams_cut"],
            "policy_pushes": router.failovers["policy_pushes"],
            "handovers": router.failovers["handovers"],
            "handovers_failed": router.failovers["handovers_failed"],
            "responses_kept": len(router.relayed), "responses_kept_bytes": router.relayed.bytes,
            "responses_made_whole": router.failovers["responses_made_whole"],
            "policy_version": router.policy["version"],
            "sessions": len(router.sessions), "session_bytes": router.sessions.bytes}

  @app.get("/health")
  async def health():
    # (after the first round of checks: before it, every backend read healthy and none
    # refusing the token, and a learner's start check passed a router it would fail at)
    with contextlib.suppress(asyncio.TimeoutError):
      await asyncio.wait_for(router.first_round.wait(), FIRST_ROUND_WAIT_S)
    ok = any(router.healthy.values())
    return JSONResponse({"status": "ok" if ok else "no healthy backend",
                         "healthy": sum(router.healthy.values()),
                         "backends": len(router.ring.backends),
                         "control_token": router.control_token is not None,
                         # (a learner's start check: the router cannot rule these)
                         "backends_need_token": sorted(router.unruled)},
                        status_code=200 if ok else 503)

  guarded = control_guard(router.control_token)

  @app.get("/control", dependencies=guarded)
  async def control_check():
    """A control call that changes nothing: whether the caller's token is this router's
    (200, else 401), and the backends that refuse the router's own."""
    return {"control": "ok", "control_token": router.control_token is not None,
            "backends_need_token": sorted(router.unruled)}

  @app.post("/update_weights", dependencies=guarded)
  async def update_all(request: Request):
    """Sends the update to every healthy backend (`Rotation.update`)."""
    answer, status = await router.update(await request.body())
    return JSONResponse(answer, status_code=status)

  @app.post("/router/policy", dependencies=guarded)
  async def follow_policy(request: Request):
    """Holds the backends to the policy of the update in the body (`path`, `version`), which
    another router (or client) loads into them: this router pushes none (`Rotation.follow`)."""
    body = await request.body()
    try:
      sent = json.loads(body)
    except (ValueError, RecursionError):
      sent = None
    version = sent.get("version") if isinstance(sent, dict) else None
    if version is None or not is_version(version):
      return api_error("router/policy", 400, "the body is an update's JSON object naming "
                       "its version (an integer or a string)")
    if not router.follow(body, version):
      return api_error("router/policy", 409, "this router takes the policy's updates itself "
                       "(POST /update_weights) and loads it into its backends: it follows "
                       "none")
    return {"version": router.policy["version"], "follows": True}

  @app.get("/sessions/{session_id:path}")
  async def get_session(session_id: str, since: int = Query(0, ge=0)):
    """The router's copy of the session, brought up to date from its live backends (all
    of them when this router has not seen it: it restarted, or its turns failed over)."""
    if (too_long := long_id("session_id", session_id)) is not None:
      return too_long
    await router.copies_done(session_id)  # (a stream's copy under way: its turn first)
    held = session_id in router.sessions  # (a copy evicted here: ask every backend again)
    holders = ((list(router.cursors.get(session_id, {})) if held else [])
               or list(router.ring.backends))
    holders += [b for b in router.owed.get(session_id, ()) if b not in holders]  # (never copied)
    try:
      await router.copy_turns(session_id, *(b for b in holders if router.healthy[b]), strict=True)
      away = sorted(b for b in router.owed.get(session_id, ()) if not router.healthy[b])
      if away:  # (a copy could not read it, and it is out of rotation now)
        raise _Unreadable(f"{', '.join(away)}: out of rotation, with turns not copied")
      if router.lost.get(session_id):
        raise _Unreadable(f"{', '.join(sorted(router.lost[session_id]))}: its record was lost "
                          "(a restart) before its turns were copied: they are gone")
    except _Unreadable as e:
      return JSONResponse({"detail": f"session {session_id!r}: a backend's record of it "
                                     f"could not be read ({e})"}, status_code=502)
    got = router.sessions.read(session_id, since)
    if got is None:
      return JSONResponse({"detail": f"no session {session_id!r}"}, status_code=404)
    return {"session_id": session_id, "turns": got[0], "count": got[1], "record_id": got[2]}

  @app.delete("/sessions/{session_id:path}", dependencies=guarded)
  async def delete_session(session_id: str):
    """Deletes the session here and on every live backend: one that ran its turns may
    hold them though this router does not know it (a restarted router, a copy evicted),
    and the next turn's copy would bring them back."""
    if (too_long := long_id("session_id", session_id)) is not None:
      return too_long
    # (a stream's copy landing after the delete brought the deleted turns back, and the
    # next episode's were appended to them: a reviewer)
    await router.copies_done(session_id)
    async with router.lock_of(router.copy_locks, session_id):  # (no copy of the session meanwhile)
      return await router.delete_everywhere(session_id)

  @app.get("/requests")
  async def in_flight(session_id: str = Query(...)):
    """The session's turns in flight, summed over the live backends."""
    if (too_long := long_id("session_id", session_id)) is not None:
      return too_long
    keys = ("requests", "queued", "prefilled", "output_tokens", "decode_s")

    async def ask(b: str) -> dict:
      with contextlib.suppress(httpx.HTTPError, ValueError, TypeError, AttributeError):
        r = await router.client(b).get(f"{b}/requests", params={"session_id": session_id},
                                      timeout=10.0)
        if r.status_code == 200:
          got = r.json()
          said = {k: float(got.get(k) or 0) for k in keys}
          if not all(math.isfinite(v) and abs(v) < 1e15 for v in said.values()):
            return {}  # (a backend's garbage: 1e999 was a 500 here; a reviewer)
          return {**said,
                  "by_request": dict(got.get("by_request") or {})}
      return {}

    found = await asyncio.gather(*(ask(b) for b in router.ring.backends if router.healthy[b]))
    total = {k: sum(f.get(k, 0) for f in found) for k in keys}
    return {"session_id": session_id,
            **{k: (v if k == "decode_s" else int(v)) for k, v in total.items()},
            "by_request": {k: v for f in found for k, v in f.get("by_request", {}).items()}}

  @app.get("/requests/{request_id:path}")
  async def progress(request_id: str):
    """Where a request in flight stands, from the live backend that runs it (a turn may
    have failed over from its session's owner)."""
    if (too_long := long_id("request_id", request_id)) is not None:
      return too_long
    async def ask(b: str):
      with contextlib.suppress(httpx.HTTPError, ValueError):
        r = await router.client(b).get(f"{b}/requests/{quote(request_id, safe='')}", timeout=10.0)
        if r.status_code == 200:
          return r.json()
      return None

    found = [x for x in await asyncio.gather(*(ask(b) for b in router.ring.backends
                                               if router.healthy[b])) if x is not None]
    if not found:
      return JSONResponse({"detail": f"no request {request_id!r} in flight"}, status_code=404)
    return found[0]

  @app.post("/handover")
  async def no_handover():
    return handover_refused()

  # (no DELETE: a server's one is a session's, the router's own route; `//sessions/x`
  # passed on reached a backend's without the router's guard: red team 30)
  @app.api_route("/{path:path}", methods=["GET", "POST"])
  async def proxy(path: str, request: Request):
    return await router.proxy(path, request)

  return app


def main(argv=None) -> int:
  from jaxagent.cli_args import log_to_console
  from jaxagent.serve_http import add_log_level, listen_or_say, serve

  log_to_console()

  p = argparse.ArgumentParser(
      allow_abbrev=False, prog="python -m rollout_server.router", description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--backends", required=True, help="comma-separated server URLs")
  p.add_argument("--max-body-bytes", type=int, default=ServerConfig.max_body_bytes,
                 help="a request body over this is refused (413) before it is parsed; "
                      "as large as the backends' max_body_bytes")
  p.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                 help="turns held open to the backends at once (one connection each; a "
                      "turn past them waits up to 30 s for one, then 503)")
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument(control.OPEN_FLAG, action="store_true",
                 help="serve the control routes without a token beyond this machine")
  p.add_argument("--port", type=int, default=8000)
  add_log_level(p)
  args = p.parse_args(argv)
  problem = control.env_problem()
  if problem:
    print(f"error: {problem}", file=sys.stderr)
    return 2
  backends = [b for b in args.backends.split(",") if b]
  bad = [b for b in backends if not re.fullmatch(r"https?://[^/\s]+(/\S*)?", b)]
  if not backends or bad:
    print(f"error: --backends: give server URLs (http://host:port), got {bad or 'none'}",
          file=sys.stderr)
    return 2
  same = [b.rstrip("/").lower() for b in backends]  # (as the ring keys them)
  twice = sorted({b for b, key in zip(backends, same) if same.count(key) > 1})
  if twice:  # (it weighed the server twice on the ring: a red team)
    print(f"error: --backends: {', '.join(twice)} listed more than once", file=sys.stderr)
    return 2
  if args.max_body_bytes < 1:  # (every request was refused, 413: a red team)
    print(f"error: --max-body-bytes must be at least 1, got {args.max_body_bytes}",
          file=sys.stderr)
    return 2
  if args.max_connections < 1:
    print(f"error: --max-connections must be at least 1, got {args.max_connections}",
          file=sys.stderr)
    return 2
  if not 0 < args.port < 65536:
    print(f"error: --port must be in 1..65535, got {args.port}", file=sys.stderr)
    return 2
  token = control.from_env()
  unguarded = control.open_beyond_this_machine(control.CONTROL, token, args.host)
  if unguarded and not args.open_routes:
    print(f"error: {unguarded}", file=sys.stderr)
    return 2
  sock = listen_or_say(args.host, args.port)
  if sock is None:
    return 2
  print(f"router on http://{args.host}:{args.port} over {len(backends)} backends; "
        f"{control.describe(token)}", flush=True)

  # (a backend down at the start is said by the health loop's first check, at once)
  serve(create_router(backends, max_body_bytes=args.max_body_bytes, control_token=token,
                      max_connections=args.max_connections), sock,
        log_level=args.log_level)
  return 0


if __name__ == "__main__":
  sys.exit(main())

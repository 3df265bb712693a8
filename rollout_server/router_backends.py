"""The router's backends: which of them take traffic (each one's `/health`, checked every
`health_interval_s`), the policy they must serve (a backend that comes back, or serves
another version, loads it before it takes traffic again), whether they take the router's
control token, the session deletes they missed, and the policy updates sent to them all.

Turns go through a connection pool of their own (`max_connections`, as many as the turns
the router holds at once); its checks and control calls through another, and its health
checks through a third: on one pool of 100, past 100 turns in flight the health checks
waited for a connection past their 5 s, every backend went out of rotation and
`/update_weights` answered 503 (a reviewer).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import weakref
from typing import Optional, Sequence
from urllib.parse import quote

import httpx

from jaxagent import control
from jaxagent.stopping import unless_stopped
from jaxagent.tls import shared_tls
from rollout_server.routing import HashRing

log = logging.getLogger("rollout_server.router")

# A backend whose /health went unanswered (no connection, or no answer in its bound) this
# many checks in a row is gone: its turns in flight are cut, not held (a host gone
# without a reset held each stream up to `turn_timeout_s`, an hour; a reviewer).
UNREACHABLE_CHECKS = 3


def is_version(got) -> bool:
  """Whether `got` can be a served policy version (a /health's: an integer, a string, or
  none; a list there made the mix of versions unhashable and killed the health loop)."""
  return got is None or (isinstance(got, (int, str)) and not isinstance(got, bool))


def _of_the_policy(answers: list, body: bytes) -> bool:
  """Whether an update was of the policy: as the backends' answers say (their "model",
  None for the policy however the request named it), else (an older server's answer)
  as the request did (no "model"). A policy named by its name was read as another
  model's update, not pinned, and the next check loaded the version before back."""
  said = [a["model"] for a in answers if isinstance(a, dict) and "model" in a]
  if said:
    return all(m is None for m in said)
  try:
    sent = json.loads(body)
  except (ValueError, RecursionError):
    return True
  return not (isinstance(sent, dict) and sent.get("model"))


class Rotation:
  """The backends a router sends turns to, and what it keeps of each (`check`)."""

  def __init__(self, backends: Sequence[str], *, health_interval_s: float, timeout_s: float,
               turn_timeout_s: float, max_sessions: int, control_token: Optional[str],
               max_connections: int, health_timeout_s: float = 5.0):
    self.health_interval_s, self.timeout_s = health_interval_s, timeout_s
    self.health_timeout_s = health_timeout_s
    self.turn_timeout_s, self.max_sessions = turn_timeout_s, max_sessions
    self.max_connections = max_connections
    self.control_token = control_token or None  # (a blank one is none)
    self.ruling = control.headers(self.control_token)  # (on the router's own control calls only)
    self.ring = HashRing([b.rstrip("/") for b in backends])
    # Healthy: answers /health and serves the current policy (a backend that comes back
    # loads it before it takes traffic again).
    self.healthy = {b: True for b in self.ring.backends}
    self.counts = {b: 0 for b in self.ring.backends}
    self.failovers = {"n": 0, "streams_cut": 0, "policy_pushes": 0, "handovers": 0,
                      "handovers_failed": 0, "responses_made_whole": 0}
    self.policy: dict = {"body": None, "version": None}  # the last update the backends took
    # Held to a policy another router updates the backends to (`follow`): this one pushes
    # none, and keeps a backend behind it out until it serves it. One that takes updates
    # itself (`leads`) follows none.
    self.follows = self.leads = False
    self.updating = asyncio.Lock()
    self.clients: dict = {}  # "turns", "calls", "health" -> its httpx.AsyncClient, once made
    # Deletes a backend missed (not healthy then): done before it takes traffic again, or
    # its record came back into a session played again under the id (red team 23).
    self.undeleted: dict[str, collections.OrderedDict] = {
        b: collections.OrderedDict() for b in self.ring.backends}
    # One delete of a session on a backend at a time (the health round's and the one done
    # before a turn is sent there; a lock lives while someone holds or waits for it).
    self.delete_locks: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
    self.serves: dict = {}  # backend -> (version, policy_id) from its last /health
    # backends whose control routes refuse this router's token -> why ("has none", "holds
    # another"); and the instance whose token was checked, with what it answered
    self.unruled: dict = {}
    self.token_checked: dict = {}
    self.instances: dict = {}  # backend -> the instance its last /health named
    self.said: dict = {"mixed": None, "forgot_deletes": False}
    self.first_round = asyncio.Event()  # (set once every backend was checked)
    self.updates_done = 0  # (`update` calls ended: a check that saw one under way or end
    # cannot judge by the version its /health answered)
    # backend -> its /health checks unanswered in a row, and the event set when they reach
    # UNREACHABLE_CHECKS (a new one when it answers again)
    self.unanswered = {b: 0 for b in self.ring.backends}
    self.gone_events: dict[str, asyncio.Event] = {}
    # Backends out of rotation only for the policy they serve (missed an update, loading
    # it): an update is sent to them too (`_update`).
    self.lagging: set = set()
    self.catching: set = set()  # (their sends, in flight)

  def gone(self, backend: str) -> asyncio.Event:
    """Set when `backend` is unreachable (`UNREACHABLE_CHECKS`): its turns in flight
    are cut."""
    if backend not in self.gone_events:
      self.gone_events[backend] = asyncio.Event()
    return self.gone_events[backend]

  def answered(self, backend: str, unreachable: bool) -> None:
    """Counts `backend`'s /health unanswered in a row (`unreachable`) or not."""
    if not unreachable:
      self.unanswered[backend] = 0
      if self.gone(backend).is_set():
        self.gone_events[backend] = asyncio.Event()
      return
    self.unanswered[backend] += 1
    if self.unanswered[backend] == UNREACHABLE_CHECKS:
      log.warning("router: %s has not answered %d health checks in a row: its turns in "
                  "flight are cut", backend, UNREACHABLE_CHECKS)
      self.gone(backend).set()

  def forget_later(self, table: collections.OrderedDict, key, value) -> int:
    """Sets `table[key]` as its newest, the oldest forgotten past `max_sessions`; how many
    were."""
    table[key] = value
    table.move_to_end(key)
    forgot = 0
    while len(table) > self.max_sessions:
      table.popitem(last=False)
      forgot += 1
    return forgot

  def must_delete(self, backend: str, session_id: str) -> None:
    """A delete `backend` missed: done before it takes traffic again, and before any
    turn of the session is sent to it. Past `max_sessions` owed to one backend the oldest
    is forgotten, said once (its record stays there, and comes back into a session played
    again under its id)."""
    if self.forget_later(self.undeleted[backend], session_id, None) and \
        not self.said["forgot_deletes"]:
      self.said["forgot_deletes"] = True
      log.warning("router: %s owes more than %d session deletes (out of rotation all that "
                  "while): the oldest are forgotten, their records left there", backend,
                  self.max_sessions)
    self.take_out(backend, f"it owes the delete of session {session_id!r}")

  def lock_of(self, locks: weakref.WeakValueDictionary, key) -> asyncio.Lock:
    """The lock of `key` in `locks`, made when no one holds or waits for one."""
    lock = locks.get(key)
    if lock is None:
      lock = locks[key] = asyncio.Lock()
    return lock

  async def delete_owed(self, backend: str, session_id: str) -> Optional[int]:
    """Does the delete of the session that `backend` missed, if one is owed: the status
    it answered (None when it could not be asked); 200 when none was owed."""
    async with self.lock_of(self.delete_locks, (backend, session_id)):
      if session_id not in self.undeleted[backend]:
        return 200
      try:
        r = await self.client(backend).delete(f"{backend}/sessions/{quote(session_id, safe='')}",
                                       timeout=10.0, headers=self.ruling)
      except httpx.HTTPError:
        return None
      if r.status_code in (200, 404) or (400 <= r.status_code < 500
                                         and r.status_code not in (401, 403, 408, 429)):
        self.undeleted[backend].pop(session_id, None)  # (401, 403: owed until it is allowed)
      return r.status_code

  def client(self, backend: str, pool: str = "calls") -> httpx.AsyncClient:
    """`backend`'s connection pool of `pool`: "turns" (`max_connections`), "calls"
    (copies, deletes, handovers, policy updates: httpx's 100) or "health" (the checks,
    one pool for all: a few a backend); made at its first use, in the serving loop. A
    backend's own pools: one whose turns hung (its /health answering) took every
    connection of a pool all shared, and the others' turns were 503s after 30 s (a
    reviewer)."""
    key = ("health", None) if pool == "health" else (pool, backend)
    if key not in self.clients:
      size = {"turns": self.max_connections, "calls": 100,
              "health": 4 * len(self.ring.backends) + 4}[pool]
      self.clients[key] = httpx.AsyncClient(
          timeout=httpx.Timeout(self.timeout_s, connect=5.0), verify=shared_tls(),
          limits=httpx.Limits(max_connections=size, max_keepalive_connections=min(size, 64)))
    return self.clients[key]

  async def aclose(self) -> None:
    for task in list(self.catching):
      task.cancel()
    for c in self.clients.values():
      await c.aclose()
    self.clients.clear()

  def follow(self, body: bytes, version) -> bool:
    """Holds the backends to `version` (the update `body`, as `POST /update_weights`'s),
    which another router loads into them: a learner's processes each route through a
    router of their own, and only the first process updates the servers (the others'
    routers, holding no policy, let a restarted server in on its first weights, and
    their turns there were stale: a reviewer). A version below the one held is left
    out (asked late). False, following nothing, on a router that takes updates itself
    (one router shared by every process: it loads the policy into a server that comes
    back, and following, it would load it no more)."""
    if self.leads:
      return False
    held = self.policy["version"]
    self.follows = True
    if not (isinstance(held, int) and isinstance(version, int) and version < held):
      self.policy.update(body=body, version=version)
    return True

  def on_policy(self, version) -> bool:
    """Whether a backend serving `version` serves the policy: the router's (any before it
    has one); following, that or a newer one (the other router's update under way, which
    this one is told of once it is done: its backends were out until then, a reviewer)."""
    wanted = self.policy["version"]
    return (wanted is None or version == wanted
            or (self.follows and isinstance(version, int) and isinstance(wanted, int)
                and not isinstance(version, bool) and version > wanted))

  async def push_policy(self, backend: str):
    """Loads the current policy into `backend`: the version it now serves, None when it
    did not take it."""
    self.failovers["policy_pushes"] += 1
    body, version = self.policy["body"], self.policy["version"]  # (as it is now)
    try:
      r = await self.client(backend).post(f"{backend}/update_weights", content=body,
                                   headers={"content-type": "application/json", **self.ruling},
                                   timeout=self.update_timeout())
      got = r.json() if r.status_code == 200 else None
    except Exception:  # (any reply it cannot read: not serving the policy)
      return None
    if not (isinstance(got, dict) and got.get("version") == version):
      return None
    self.took(backend, version)
    return version

  def took(self, backend: str, version) -> None:
    """`backend` serves `version` now (it answered its update): known before its next
    /health (a failover held to the policy found none serving it; a reviewer)."""
    self.serves[backend] = (version, self.serves.get(backend, (None, None))[1])

  async def rule_check(self, backend: str, health: dict) -> None:
    """Whether this router can use `backend`'s control routes, by its /health and (once
    an instance, with a token) its `GET /control`: said once when that changes."""
    why = None
    if health.get("control_token"):
      if self.control_token is None:
        why = "this router has none"
      else:
        instance = health.get("instance")
        if self.token_checked.get(backend, (None,))[0] != instance or instance is None:
          with contextlib.suppress(httpx.HTTPError):
            r = await self.client(backend, "health").get(f"{backend}/control", headers=self.ruling,
                                                timeout=5.0)
            # (only an answer about the token is kept: a 503 now is asked again, or a
            # server restarted busy was never checked; 404: one without the route)
            if r.status_code in (200, 401, 403, 404):
              self.token_checked[backend] = (instance, r.status_code not in (401, 403))
        if not self.token_checked.get(backend, (None, True))[1]:
          why = "this router holds another"
    if why is not None and self.unruled.get(backend) != why:
      log.warning("router: %s refuses this router's control token (%s; %s): the policy "
                  "updates and deletes it passes on there are refused", backend, why,
                  control.ENV)
    if why is None:
      self.unruled.pop(backend, None)
    else:
      self.unruled[backend] = why

  def restarted(self, backend: str, instance) -> bool:
    """Notes the instance `backend`'s /health names; another than the last one (it
    restarted at its address) is told to `lost_threads`. Whether it was."""
    seen = self.instances.get(backend)
    self.instances[backend] = instance
    if seen is not None and instance != seen:
      self.lost_threads(backend)
      return True
    return False

  def lost_threads(self, backend: str) -> None:
    """`backend` restarted: what it held of the sessions is gone (the router's session
    copies override this)."""

  def update_timeout(self) -> httpx.Timeout:
    """A policy update's bound: a drain waits for the turns in flight (each bounded by
    `turn_timeout_s`), then loads. Under it (600 s), a backend that took the update after
    the router gave up was caught up to the old policy at its next check: rolled back."""
    return httpx.Timeout(self.turn_timeout_s + self.timeout_s, connect=5.0)

  def say_mixed(self) -> None:
    """Before the first /update_weights the router has no policy of its own to hold the
    backends to: backends serving different weights are said once per mix (a session's
    turns may come from either)."""
    mix = {b: v for b, v in self.serves.items() if self.healthy.get(b)}
    if self.policy["version"] is not None or len(set(mix.values())) < 2:
      return
    if self.said["mixed"] != mix:
      self.said["mixed"] = dict(mix)
      log.warning("router: the backends serve different policies (%s); turns go to either "
                  "until a POST /update_weights gives them one",
                  ", ".join(f"{b}: version {v[0]}" + (f" of {v[1]}" if v[1] else "")
                            for b, v in sorted(mix.items())))

  async def check(self, backend: str) -> None:
    """Asks `backend`'s /health; healthy when it answers and serves the policy (loaded
    first where it missed one, its missed deletes done). A change is said once (a dead
    backend was seen only in /router/health: a new user)."""
    got, was = None, self.healthy[backend]
    why = "its /health did not answer 200"
    rejoins, behind = not was, False  # (behind: out only for the policy it serves)
    began = None if self.updating.locked() else self.updates_done
    try:
      try:
        r = await self.client(backend, "health").get(f"{backend}/health",
                                                     timeout=self.health_timeout_s)
      except httpx.TransportError as e:  # (a pool of its own busy: not the backend's, and
        if not isinstance(e, httpx.PoolTimeout):  # no answer from it either)
          self.answered(backend, unreachable=True)
        raise
      self.answered(backend, unreachable=False)
      got = r.json() if r.status_code == 200 else None
      ok = isinstance(got, dict)
      if ok:
        serves = (got.get("version"), got.get("policy_id"))
        if not (is_version(serves[0]) and isinstance(serves[1], (str, type(None)))):
          raise ValueError(f"its /health names version {serves[0]!r:.80} of policy "
                           f"{serves[1]!r:.80} (an integer or a string each)")
        # (restarted: on its first weights, as one coming back; during an update it
        # served them in rotation, a reviewer)
        rejoins = self.restarted(backend, got.get("instance")) or rejoins
        await self.rule_check(backend, got)
        if began != self.updates_done or self.updating.locked():
          # An update began or ended while it answered: its version may be from before
          # it, and the update said who is in rotation (judged by that version, a check
          # took every backend out at once and the learner's next update found none: a
          # new user). One restarted meanwhile is out; the next check judges the rest.
          if rejoins:  # (restarted: on its first weights, whatever the update did;
            # its version kept from before its restart made it a failover's "on the
            # policy" backend, turns served on version 0: red team 43)
            self.serves[backend] = serves
            self.lagging.add(backend)
            if was:
              self.take_out(backend, "it restarted during a policy update")
          return
        self.serves[backend] = serves
      serving = got.get("version") if ok else None
      wanted = self.policy["version"]  # (read now: an update may have ended meanwhile)
      if (ok and wanted is not None and not self.updating.locked() and serving != wanted
          and not self.follows):  # (following: the other router loads it)
        # restarted (or missed an update): out of rotation while it catches up (its turns
        # meanwhile were another policy's; a reviewer)
        self.healthy[backend], rejoins = False, True
        serving = await self.push_policy(backend)
        ok, why = serving is not None, "it could not load the current policy"
        behind = ok
      if ok and self.undeleted[backend]:
        ok = await self.delete_missed(backend)
        why = "deletes it missed failed"
      # (taken out meanwhile, a delete it missed: it comes back as one out; let in
      # during an update that skipped it, it served the old policy on: a reviewer)
      rejoins = rejoins or not self.healthy[backend]
      if ok and rejoins and self.updating.locked():
        # An update under way skipped it (out of rotation): let in now, it served the old
        # policy on (a reviewer). It loads the new one at its next check.
        ok, why, behind = False, "a policy update is under way", True
      elif ok and not self.updating.locked() and not self.on_policy(serving):
        ok, why, behind = False, (f"it serves version {serving!r}, not the router's "
                                  f"{self.policy['version']!r}: " + (
                                      "the router it follows loads that" if self.follows
                                      else "it loads that at its next check")), True
      self.healthy[backend] = ok
    except Exception as e:  # (any reply it cannot read is a backend not well: red team 14,
      # a JSON list killed the loop, and no backend was checked again)
      self.healthy[backend], behind = False, False
      why = f"{type(e).__name__}: {e}"
    if behind and not self.healthy[backend]:
      self.lagging.add(backend)
    else:
      self.lagging.discard(backend)
    if not isinstance(got, dict):  # (down: whether it takes the token is not known now)
      self.unruled.pop(backend, None)
    if was and not self.healthy[backend]:
      log.warning("router: %s out of rotation (%s); its sessions' turns go to the next "
                  "backend on the ring until it is well", backend, why)
    elif not was and self.healthy[backend]:
      log.warning("router: %s back in rotation", backend)

  async def delete_missed(self, backend: str) -> bool:
    """The deletes `backend` missed, done (16 at a time); True when none is left. One it
    refuses for good (a 4xx) is dropped and said; one it fails is tried at the next check
    (the backend stays out of rotation meanwhile)."""
    gate = asyncio.Semaphore(16)

    async def delete(session_id: str) -> bool:
      async with gate:
        status = await self.delete_owed(backend, session_id)
      if status is None:
        return False
      if status in (200, 404):
        pass
      elif status in (401, 403):  # (its token is asked again at the next check, which
        # says it once; the delete stays owed: out of rotation until it takes it)
        self.token_checked.pop(backend, None)
        return False
      elif 400 <= status < 500 and status not in (408, 429):
        log.warning("router: %s refused to delete session %r (%d): left there",
                    backend, session_id, status)
      else:
        log.warning("router: %s failed to delete session %r (%d): out of rotation until "
                    "it does", backend, session_id, status)
        return False
      return True

    while self.undeleted[backend]:  # (deletes that came meanwhile too: none awaits after it)
      if not all(await asyncio.gather(*(delete(sid) for sid in list(self.undeleted[backend])))):
        return False
    return True

  async def health_loop(self) -> None:
    """Checks each backend every `health_interval_s`, each on its own (in rounds, one
    backend's policy load, up to `update_timeout`, held every other's check)."""
    checked: set = set()

    async def watch(backend: str) -> None:
      while True:
        try:
          await self.check(backend)
          checked.add(backend)
          if len(checked) == len(self.ring.backends):
            self.first_round.set()
          self.say_mixed()
        except Exception:  # (the loop must outlive anything a backend said: red team 14)
          log.exception("router: checking %s failed", backend)
        await asyncio.sleep(self.health_interval_s)

    await asyncio.gather(*(watch(b) for b in self.ring.backends))


  def take_out(self, backend: str, why: str) -> None:
    """`backend` out of rotation until a check finds it well; said when it was in."""
    if self.healthy[backend]:
      log.warning("router: %s out of rotation (%s); its sessions' turns go to the next "
                  "backend on the ring until it is well", backend, why)
    self.healthy[backend] = False

  def down(self, backend: str, why: str) -> str:
    """`backend` out of rotation as a turn failed there (the turn goes to the next on
    the ring); what to say."""
    self.take_out(backend, why)
    self.failovers["n"] += 1
    return f"{backend}: {why}"

  def in_order(self, candidates: Sequence[str]) -> list:
    """`candidates` (a session's backends, its own first) in the order a turn tries them:
    those in rotation, then those out of it that serve the current policy (a check may
    not have seen one come back yet); when there is none, those whose version is not
    known yet. One known on another policy is never tried: its turns were a policy the
    router no longer holds the backends to (a reviewer; a restarted server's first
    weights were served after an update had returned: red team 43); nor one gone
    (`gone`: its turn would be cut at once)."""
    out = [b for b in candidates if not self.healthy[b] and not self.gone(b).is_set()]
    return ([b for b in candidates if self.healthy[b]]
            + [b for b in out if self.on_policy(self.serves.get(b, (None,))[0])]
            or [b for b in out if self.serves.get(b, (None,))[0] is None])

  async def update(self, body: bytes) -> tuple[dict, int]:
    """Sends a policy update (`POST /update_weights`'s body) to every healthy backend:
    the answer and its status. 200 when all of them took it (one that died meanwhile is
    left out of rotation and catches up when it returns); a backend that is down now
    loads this policy before it serves again."""
    async with self.updating:
      self.leads, self.follows = True, False
      try:
        return await self._update(body)
      finally:
        self.updates_done += 1

  async def _update(self, body: bytes) -> tuple[dict, int]:
    targets = [b for b in self.ring.backends if self.healthy[b]]
    if not targets:
      return {"detail": "no healthy backend to update"}, 503
    # Those out of rotation only behind the policy are sent it too, not waited for (their
    # answer is not the update's; a slow one held every update: a reviewer): one that
    # missed an update was pushed it at its next check, and kept out for good by updates
    # faster than its load, each push ending a version behind.
    behind = [b for b in self.ring.backends
              if b in self.lagging and not self.healthy[b] and not self.gone(b).is_set()]

    async def send(b: str) -> httpx.Response:
      # (a backend gone meanwhile, its health checks unanswered: its update cut, as its
      # turns are; a host gone without a reset held every update up to update_timeout)
      r = await unless_stopped(self.client(b).post(
          f"{b}/update_weights", content=body,
          headers={"content-type": "application/json", **self.ruling},
          timeout=self.update_timeout()), self.gone(b))
      if r is None:  # (it may load it yet: its version not known until its /health says)
        self.serves[b] = (None, None)
        raise httpx.ConnectError("unreachable during the update (its health checks "
                                 "unanswered)")
      return r

    async def catch_up(b: str) -> None:  # (a check lets it in once it serves the policy)
      with contextlib.suppress(Exception):
        r = await send(b)
        answer = r.json() if r.status_code == 200 else None
        if isinstance(answer, dict) and is_version(answer.get("version")) and \
            _of_the_policy([answer], body):  # (another model's version is not its policy's)
          self.took(b, answer.get("version"))

    for b in behind:
      task = asyncio.ensure_future(catch_up(b))
      self.catching.add(task)
      task.add_done_callback(self.catching.discard)
    results = await asyncio.gather(*(send(b) for b in targets), return_exceptions=True)
    out, took, refused = [], {}, []
    for b in self.ring.backends:
      if b in behind:
        out.append({"backend": b, "skipped": "out of rotation behind the policy: sent it, "
                                             "not waited for"})
        continue
      if b not in targets:
        out.append({"backend": b, "skipped": "unhealthy: loads this policy when it returns"})
        continue
      r = results[targets.index(b)]
      if isinstance(r, Exception):
        self.take_out(b, f"its update failed: {type(r).__name__}: {r}")
        out.append({"backend": b, "error": f"{type(r).__name__}: {r}"})
        continue
      try:
        answer = r.json()
      except ValueError:
        answer = {"detail": r.text[:500]}
      out.append({"backend": b, "status": r.status_code, "body": answer})
      if r.status_code == 200 and isinstance(answer, dict) and is_version(answer.get("version")):
        took[b] = answer.get("version")
      else:
        refused.append(b)
    try:
      sent = json.loads(body)
    except (ValueError, RecursionError):
      sent = None
    # Only the policy's update is what a rejoining backend must catch up on (an update
    # of another served model is passed on, not pinned).
    if took and _of_the_policy([x["body"] for x in out if x["backend"] in took], body):
      # The newest any took (an update naming no version: each backend loads the latest
      # export it finds, and one landing meanwhile gave two; the first answer's was
      # pinned, and the others' pushed back to it; a reviewer).
      versions = list(took.values())  # (a server's may be a string: the first, then)
      version = max(versions) if all(isinstance(v, int) for v in versions) else versions[0]
      pinned = dict(sent, version=version) if isinstance(sent, dict) else None
      self.policy.update(body=json.dumps(pinned) if pinned else body, version=version)
      for b, v in took.items():
        self.took(b, v)
        if v != version:  # (out of rotation until it serves the policy, as a refusal)
          self.take_out(b, f"it loaded version {v!r} of the update, others {version!r}")
      for b in refused:  # live but stale: out of rotation until it catches up
        self.take_out(b, f"it refused the update to version {version!r}")
    ok = bool(took) and not refused
    answer: dict = {}
    ruled_out = [x["backend"] for x in out if x.get("status") in (401, 403)]
    if ruled_out:  # (their own 401 says the call had no token, or another: the router's;
      # first, so that a client's cut of the body keeps it)
      answer["detail"] = (f"{', '.join(ruled_out)} refused this router's control token ("
                          + ("it has none" if self.control_token is None else "it holds "
                             "another") + f"): give the router (a learner's own: the "
                          f"learner) the servers' {control.ENV}")
    answer.update(results=out, version=self.policy["version"], ok=ok)
    return answer, 200 if ok else 502

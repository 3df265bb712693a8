"""Recorded session turns, bounded by count, bytes and time (a server's record of the
calls of each agent session, and the router's copy of them)."""

from __future__ import annotations

import collections
import json
import threading
import time
from typing import Callable, Optional


class SessionStore:
  """Recorded turns per session id, bounded by session count, by the bytes of their
  records (JSON) and by a time to live since a session's last turn; the least recently
  used go first. `evicted` counts the sessions dropped by each bound."""

  def __init__(self, max_sessions: int, ttl_s: Optional[float] = None,
               max_bytes: Optional[int] = None, clock: Callable[[], float] = time.monotonic):
    self.max_sessions = max_sessions
    self.ttl_s = ttl_s
    self.max_bytes = max_bytes
    self._clock = clock
    # session id -> [turns, bytes, last touched]
    self._sessions: collections.OrderedDict[str, list] = collections.OrderedDict()
    self.bytes = 0
    self.evicted = {"count": 0, "bytes": 0, "ttl": 0}
    self._lock = threading.Lock()

  def record(self, session_id: str, turn: dict) -> None:
    """Appends `turn` (numbered: its `turn` field is set to its index; `recorded_at` is
    the wall time, by which a router orders the turns a session ran on several servers)."""
    turn.setdefault("recorded_at", time.time())
    self.extend(session_id, [turn], number=True)

  def extend(self, session_id: str, turns: list[dict], number: bool = False) -> None:
    """Appends turns recorded elsewhere (a router's copy of its backends' records)."""
    with self._lock:
      self._expire()
      entry = self._sessions.setdefault(session_id, [[], 0, 0.0])
      self._sessions.move_to_end(session_id)
      for turn in turns:
        if number:
          turn["turn"] = len(entry[0])
        size = len(json.dumps(turn, default=str))
        entry[0].append(turn)
        entry[1] += size
        self.bytes += size
      entry[2] = self._clock()
      while len(self._sessions) > self.max_sessions:
        self._drop_oldest("count")
      while self.max_bytes is not None and self.bytes > self.max_bytes and self._sessions:
        self._drop_oldest("bytes")

  def _drop_oldest(self, reason: str) -> None:
    _, (_, size, _) = self._sessions.popitem(last=False)
    self.bytes -= size
    self.evicted[reason] += 1

  def _expire(self) -> None:
    if self.ttl_s is None:
      return
    now = self._clock()
    while self._sessions and now - next(iter(self._sessions.values()))[2] > self.ttl_s:
      self._drop_oldest("ttl")

  def get(self, session_id: str) -> Optional[list[dict]]:
    with self._lock:
      self._expire()
      entry = self._sessions.get(session_id)
      return None if entry is None else list(entry[0])

  def pop(self, session_id: str) -> Optional[list[dict]]:
    with self._lock:
      entry = self._sessions.pop(session_id, None)
      if entry is None:
        return None
      self.bytes -= entry[1]
      return entry[0]

  def __contains__(self, session_id: str) -> bool:
    with self._lock:
      self._expire()
      return session_id in self._sessions

  def __len__(self) -> int:
    with self._lock:
      self._expire()
      return len(self._sessions)


SESSION_HEADER = "x-session-id"


def session_of(header: Optional[str], named: Optional[str]) -> Optional[str]:
  """A request's session: its X-Session-Id header or its body's `session_id`. Both given
  and different is a ValueError: the router routes by the header, so a body naming
  another session would put the turn into that session's record."""
  header, named = header or None, (str(named) if named else None)
  if header and named and header != named:
    raise ValueError(f"the {SESSION_HEADER} header ({header!r}) and the body's session_id "
                     f"({named!r}) name different sessions")
  return header or named

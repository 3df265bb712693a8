"""Recorded session turns, bounded by count, bytes and time (a server's record of the
calls of each agent session, and the router's copy of them).

Turns are stored so that a session's record grows with its context, not with its
context times its turns (each turn sends the whole conversation again): a turn's prompt
ids and messages are kept as the length they share with the turn before (its prompt and
output ids; its messages) and what is new, and token ids, log-probs and versions as
packed arrays (4 or 8 bytes a value, not a Python object each). `get` gives the turns
back as they were recorded."""

from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
import heapq
import json
import logging
import sys
import threading
import time
import uuid
from typing import Any, Callable, Optional

from jaxagent.tokenizer import valid_unicode

log = logging.getLogger(__name__)

# The fields a turn record keeps as packed arrays (when every value has that type).
_PACKED = {"prompt_ids": int, "output_ids": int, "versions": int,
           "output_logprobs": float, "raw_logprobs": float}


def _pack(values: Any, kind: type) -> Any:
  """A list of exactly `kind` (a bool is no int, an int no float) as an array: of
  doubles, or of the narrowest integers that hold it; anything else as it is."""
  if not isinstance(values, list) or not all(type(v) is kind for v in values):
    return values
  if kind is float:
    return array.array("d", values)
  for code in ("i", "q"):
    try:
      return array.array(code, values)
    except OverflowError:
      pass
  return values  # an int past 64 bits


def _common(base, new) -> int:
  """The length of the longest common prefix of two sequences (arrays or lists); the
  usual case, `base` a prefix of `new`, takes one comparison."""
  n = min(len(base), len(new))
  if base[:n] == new[:n]:
    return n
  lo, hi = 0, n  # base[:lo] == new[:lo] and base[:hi] != new[:hi]
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if base[:mid] == new[:mid] else (lo, mid)
  return lo


@dataclasses.dataclass(frozen=True)
class _Tail:
  """A sequence stored as the first `shared` items of an earlier turn's and `rest`: of
  the turn before it, or of turn `base` (the last turn of the thread it goes on, past a
  harness's side calls)."""
  shared: int
  rest: Any
  base: Optional[int] = None

  def of(self, base):
    return base[:self.shared] + self.rest


def held_bytes(value: Any) -> int:
  """The bytes a stored value holds: an array its items, anything else its Python
  objects' (CPython's sizes; a string or number each time it appears). Its JSON's length
  undercounted containers 18 times, `[]` 2 characters and 56 bytes: a store counted at
  19 MB held 351 MB, and one at its default bounds would hold 11 GB (a reviewer)."""
  if isinstance(value, _Tail):
    return held_bytes(value.rest)
  if isinstance(value, array.array):
    return value.itemsize * len(value)
  total, stack = 0, [value]
  while stack:
    v = stack.pop()
    total += sys.getsizeof(v)
    if isinstance(v, dict):
      stack += v.keys()
      stack += v.values()
    elif isinstance(v, (list, tuple)):
      stack += v
  return total



_DIGEST_BYTES = 16
# What a stored turn holds beside its values' bytes (its dict, arrays' and digests'
# headers), so that the byte bound holds for many short turns too.
_TURN_OVERHEAD = 1024


# How many of a session's threads (turns no later call continued) its next call may
# continue, and how many replies sampled from one prompt (a retry's, a best-of-n's) each
# keeps.
MAX_HEADS = 4
MAX_REPLIES = 8


@dataclasses.dataclass
class _Head:
  """A turn of the session that no later call continued (the last turn of a thread: the
  agent's main conversation, a side call such as a title or a summary): what a call
  whose messages begin with its messages continues. `ids` are its prompt and output
  ids; `replies` (output ids, assistant message, the bytes they hold) those sampled from
  its prompt, newest first; `turn` its index in the record, or None when another server
  ran it (handed over by a router, `messages` kept here); `extra` the bytes its messages
  hold then."""
  ids: Any
  output_count: int
  digests: list[bytes]
  tools_json: str
  replies: list[tuple[Any, Optional[dict], int]]
  turn: Optional[int] = None
  messages: Optional[list[dict]] = None
  extra: int = 0
  # The turn this one went on from, when its context is a prefix of this one's (a
  # summary call that sends the whole conversation and asks for a summary goes on from
  # the agent's last turn, and the agent's next call, whose messages are fewer, goes on
  # from that turn)
  parent: Optional["_Parent"] = None

  @property
  def prompt(self):
    return self.ids[:len(self.ids) - self.output_count]

  def size(self) -> int:
    return (held_bytes(self.ids) + _DIGEST_BYTES * len(self.digests) + self.extra
            + sum(n for _, _, n in self.replies)
            + (sum(n for _, _, n in self.parent.replies) if self.parent else 0))

  def parent_turn(self) -> Optional["_Head"]:
    """The turn this one went on from, as a head (its ids a prefix of this one's)."""
    p = self.parent
    if p is None:
      return None
    return _Head(self.ids[:p.context], p.output_count, self.digests[:p.messages],
                 p.tools_json, p.replies, messages=(self.messages[:p.messages]
                                                    if self.messages is not None else None))

  def continued_by(self, digests: list[bytes]) -> bool:
    """A call with these messages' digests follows this turn (or repeats its prompt)."""
    return len(self.digests) <= len(digests) and digests[:len(self.digests)] == self.digests

  def sibling_of(self, other: "_Head") -> bool:
    """Sampled from the same prompt, messages and tools as `other`."""
    return (self.digests == other.digests and self.tools_json == other.tools_json
            and self.prompt == other.prompt)


@dataclasses.dataclass(frozen=True)
class _Parent:
  """The turn a head went on from: its context is the head's first `context` ids, its
  messages the head's first `messages`."""
  context: int
  output_count: int
  messages: int
  tools_json: str
  replies: list
  turn: Optional[int] = None  # (its index in the record, when it ran here)


def _reply(out: Any, response: Any) -> tuple[Any, Optional[dict], int]:
  """A head's reply: its output ids, its assistant message, the bytes they hold."""
  response = response if isinstance(response, dict) else None
  return out, response, held_bytes(out) + (held_bytes(response) if response else 0)


def _thread_of(heads: list[_Head], digests: list[bytes], tools_json: Optional[str] = None
               ) -> Optional[_Head]:
  """The thread a call with these messages' digests goes on: of `heads` (oldest first)
  whose messages its messages begin with, and whose tools are `tools_json` if given, the
  one with the most messages (the newest of equals); None when none."""
  return max((h for h in reversed(heads) if h.continued_by(digests)
              and (tools_json is None or h.tools_json == tools_json)),
             key=lambda h: len(h.digests), default=None)


class _Session:
  """A session's stored turns; the last turn's whole context, which the next turn is
  stored against: its prompt and output ids, and a digest of each of its messages' JSON
  (messages equal as values can differ as JSON: 1 and 1.0); and its threads (`_Head`),
  which its calls continue and a later turn may be stored against. `size` counts all."""

  def __init__(self):
    self.turns: list[dict] = []
    # (this record's own: one made anew, after a server's restart or a delete, has
    # another, so a router's copy does not take its turns for ones it has: red team 23)
    self.record_id = uuid.uuid4().hex[:12]
    self.size, self.touched = 0, 0.0
    self.ids = self.digests = self.output_count = None
    self.calls: dict[str, str] = {}  # tool call id -> its arguments' text, as sampled
    self.heads: list[_Head] = []  # oldest first
    self._context_size = 0
    self._tools: Optional[tuple[str, Any]] = None  # the last turn's tools (JSON, value)
    # (made anew under an id this store dropped: what was dropped, until its first
    # turn of its own says so: `SessionStore.record`)
    self.lost_before: Optional[dict] = None

  def add_head(self, head: _Head) -> None:
    """`head` replaces the threads it continues (the one it went on from is kept as its
    parent when its tokens are a prefix of `head`'s); the oldest past MAX_HEADS go."""
    went_on = sorted((h for h in self.heads if h.continued_by(head.digests)),
                     key=lambda h: len(h.digests), reverse=True)
    for h in went_on:
      if len(h.digests) == len(head.digests):  # (a sibling's parent is its own)
        if h.parent is not None and h.parent.context <= len(head.ids) and (
            head.ids[:h.parent.context] == h.ids[:h.parent.context]):
          head.parent = h.parent
          break
      elif len(h.ids) <= len(head.ids) and head.ids[:len(h.ids)] == h.ids:
        head.parent = _Parent(len(h.ids), h.output_count, len(h.digests), h.tools_json,
                              h.replies, h.turn)
        break
    self.heads = [h for h in self.heads if not h.continued_by(head.digests)][
        -(MAX_HEADS - 1):] + [head]

  def _sized(self) -> int:
    """The bytes the session's contexts hold (the last turn's, and each thread's);
    updates its size; returns how many it grew by."""
    own = self.ids if isinstance(self.ids, array.array) else None
    size = (held_bytes(own) if own is not None else 0) + (
        _DIGEST_BYTES * len(self.digests) if self.digests else 0) + sum(
        h.size() - (held_bytes(own) + _DIGEST_BYTES * len(h.digests) if h.ids is own else 0)
        for h in self.heads)
    grew, self._context_size = size - self._context_size, size
    self.size += grew
    return grew

  def append(self, turn: dict) -> int:
    """Stores `turn`; returns how many bytes the session grew by."""
    stored = {k: _pack(v, _PACKED[k]) if k in _PACKED else v for k, v in turn.items()}
    ids, messages = stored.get("prompt_ids"), stored.get("messages")
    # The tools a turn offers, as the turn before's where they are the same (stored and
    # counted once: each turn's whole copy made 95% of a long episode's bytes with an
    # agent's forty tools, and its record was evicted long before its context's bound;
    # a reviewer). Not changed by a caller: a read's turns share them, as messages.
    tools_json = json.dumps(stored["tools"], default=str) if "tools" in stored else None
    same_tools = tools_json is not None and self._tools is not None \
        and self._tools[0] == tools_json
    if same_tools:
      stored["tools"] = self._tools[1]
    elif tools_json is not None:
      self._tools = (tools_json, stored["tools"])
    as_json = [json.dumps(m, default=str) for m in messages] \
        if isinstance(messages, list) else None
    digests = [_digest(j) for j in as_json] if as_json is not None else None
    # Stored against the turn before it, or against the last turn of the thread it goes
    # on, whichever shares more (past side calls: stored against a side call, each turn
    # after one was kept whole)
    bases = [(None, self.ids, self.digests)]
    thread = _thread_of(self.heads, digests) if digests is not None else None
    if thread is not None and thread.turn is not None and thread.turn != len(self.turns) - 1:
      bases.append((thread.turn, thread.ids, thread.digests))
    shared, base = max(((_common(b_ids, ids), b) for b, b_ids, _ in bases
                        if _packed_alike(ids, b_ids)), key=lambda x: x[0], default=(0, None))
    if shared:
      stored["prompt_ids"] = _Tail(shared, ids[shared:], base)
    messages_size = 0
    if as_json is not None:
      shared, base = max(((_common(b_digests, digests), b) for b, _, b_digests in bases
                          if b_digests is not None), key=lambda x: x[0], default=(0, None))
      # Fresh objects with the same JSON (a caller changing its own later changes
      # nothing here); a turn's messages shared with an earlier turn are that turn's.
      rest = [json.loads(j) for j in as_json[shared:]]
      stored["messages"] = _Tail(shared, rest, base) if shared else rest
      messages_size = sum(map(held_bytes, rest))
    out = stored.get("output_ids")
    self.ids, self.digests = _context(ids, out), digests
    self.keep_calls(stored.get("response"))
    # (how many of `ids` the output holds: None when they are not the prompt and output)
    self.output_count = len(out) if _packed_alike(ids, out) else None
    if digests is not None and self.output_count is not None:  # a chat turn
      head = _Head(self.ids, self.output_count, digests,
                   tools_json if tools_json is not None else "null",
                   [_reply(out, stored.get("response"))], turn=len(self.turns))
      sibling = next((h for h in reversed(self.heads) if h.sibling_of(head)), None)
      if sibling is not None:
        head.replies += sibling.replies[:MAX_REPLIES - 1]
      self.add_head(head)
    size = _TURN_OVERHEAD + messages_size + sum(
        (0 if same_tools else held_bytes(v)) if k == "tools" else held_bytes(v)
        for k, v in stored.items() if k != "messages" or not isinstance(messages, list))
    self.turns.append(stored)
    self.size += size
    return size + self._sized()

  def keep_calls(self, response: Any) -> None:
    """Keeps the arguments' text of a reply's tool calls, by call id."""
    for call in (response.get("tool_calls") or []) if isinstance(response, dict) else []:
      function = call.get("function") if isinstance(call, dict) else None
      if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        self.calls[str(call.get("id"))] = function["arguments"]

  def unpacked(self, since: int = 0, until: Optional[int] = None) -> list[dict]:
    """The turns from `since` on (to `until`) as they were recorded (lists, not arrays;
    each turn's own lists, whose message objects are shared with the store: not to be
    changed)."""
    # (the contexts of the turns a later one is stored against, past the turn before)
    bases = {v.base for t in self.turns for v in (t.get("prompt_ids"), t.get("messages"))
             if isinstance(v, _Tail) and v.base is not None}
    out, ids, messages, kept = [], None, None, {}
    for i, stored in enumerate(self.turns):
      turn = dict(stored)
      if isinstance(p := turn.get("prompt_ids"), _Tail):
        turn["prompt_ids"] = p.of(ids if p.base is None else kept[p.base][0])
      if isinstance(m := turn.get("messages"), _Tail):
        turn["messages"] = m.of(messages if m.base is None else kept[m.base][1])
      ids, messages = _context(turn.get("prompt_ids"), turn.get("output_ids")), \
          turn.get("messages")
      if i in bases:
        kept[i] = (ids, messages)
      if i >= since:
        out.append({k: v.tolist() if isinstance(v, array.array) else
                    list(v) if k == "messages" and isinstance(v, list) else v
                    for k, v in turn.items()})
      if until is not None and i + 1 >= until:
        break
    return out

  def revive(self, turn: int) -> bool:
    """Makes recorded turn `turn` (a chat turn) one of the session's threads again, when
    it is neither a thread nor the turn one went on from, nor among one's replies;
    whether it did."""
    if any(h.turn == turn or (h.parent is not None and h.parent.turn == turn)
           for h in self.heads):  # (the common case, told before the record is read)
      return False
    (t,) = self.unpacked(turn, turn + 1)
    prompt, out = _pack(t.get("prompt_ids"), int), _pack(t.get("output_ids"), int)
    messages = t.get("messages")
    if not (isinstance(messages, list) and _packed_alike(prompt, out)):
      return False
    digests = [_digest(json.dumps(m, default=str)) for m in messages]
    tools_json = json.dumps(t.get("tools"), default=str)
    for h in self.heads:
      kept = [(h.digests, h.tools_json, h.prompt, h.replies)]
      if h.parent is not None:
        p = h.parent
        kept.append((h.digests[:p.messages], p.tools_json,
                     h.ids[:p.context - p.output_count], p.replies))
      for d, tools, ids, replies in kept:
        # (a sibling's: a retry's, a best-of-n's, whose replies it is among)
        if (d == digests and tools == tools_json and list(ids) == list(prompt)
                and any(list(r[0]) == list(out) for r in replies)):
          return False
    head = _Head(prompt + out, len(out), digests, tools_json,
                 [_reply(out, t.get("response"))], turn=turn)
    self.add_head(head)
    return True


@dataclasses.dataclass(frozen=True)
class LastTurn:
  """What a session's call continues (`SessionStore.last_turn`): a turn's prompt ids,
  its message count, and the replies sampled from that prompt (output ids and assistant
  message), newest first: a retry's or a best-of-n's siblings, one of which the agent
  may keep."""
  prompt_ids: list[int]
  message_count: int
  replies: list[tuple[list[int], Optional[dict]]]


def _digest(message_json: str) -> bytes:
  return hashlib.blake2b(message_json.encode(), digest_size=_DIGEST_BYTES).digest()


def _packed_alike(a, b) -> bool:
  return isinstance(a, array.array) and isinstance(b, array.array) and a.typecode == b.typecode


def _context(prompt, output):
  """A turn's prompt and output ids, which the next turn's prompt usually starts with."""
  return prompt + output if _packed_alike(prompt, output) else prompt


class SessionStore:
  """Recorded turns per session id, bounded by session count, by the bytes their stored
  records hold and by a time to live since a session's last turn; the least recently
  used go first. `evicted` counts the sessions dropped by each bound.

  A session dropped while its agent played on is made anew at its next call, holding
  only the turns from there: its record is no longer the episode's, and read so it
  trained the later turns as the whole episode (per-turn rewards on the wrong turns, a
  reviewer). The first turn such a session records itself carries `lost_before` (the
  bound that dropped its record, and how many turns it held); a router's copy of it,
  made whole from its own, does not (`extend`)."""

  def __init__(self, max_sessions: int, ttl_s: Optional[float] = None,
               max_bytes: Optional[int] = None, clock: Callable[[], float] = time.monotonic):
    self.max_sessions = max_sessions
    self.ttl_s = ttl_s
    self.max_bytes = max_bytes
    self._clock = clock
    self._sessions: collections.OrderedDict[str, _Session] = collections.OrderedDict()
    self.bytes = 0
    self.evicted = {"count": 0, "bytes": 0, "ttl": 0}
    # The ids dropped, newest last (what each held), kept for as many more sessions as
    # the store holds (at least 1,024, at most 65,536: an id is at most 1 KiB).
    self._lost: collections.OrderedDict[str, dict] = collections.OrderedDict()
    self._lost_kept = min(max(max_sessions, 1024), 1 << 16)
    self._lock = threading.Lock()

  def record(self, session_id: str, turn: dict) -> tuple[str, int]:
    """Appends `turn` (numbered: its `turn` field is set to its index; `recorded_at` is
    the wall time, by which a router orders the turns a session ran on several servers);
    (its record's id, its index): where it is, for `revive`."""
    turn.setdefault("recorded_at", time.time())
    return self._append(session_id, [turn], number=True, own=True), turn["turn"]

  def extend(self, session_id: str, turns: list[dict], number: bool = False) -> str:
    """Appends turns recorded elsewhere (a router's copy of its backends' records);
    the record's id."""
    return self._append(session_id, turns, number)

  def merge(self, session_id: str, turns: list[dict]) -> str:
    """Adds turns recorded elsewhere, in order (`turns` in the order they were recorded,
    `recorded_at`, as the held ones), numbered: a router's copy of a session that ran on
    several backends. A backend read late (unreadable for a while, out of rotation) holds
    turns older than ones already copied from another; appended, the record read 200
    reordered and renumbered (a reviewer). Such a record is made anew in order, under
    another record id (a copy of it reads it whole again). The record's id."""
    def at(turn: dict) -> float:
      return turn.get("recorded_at", 0.0)

    with self._lock:
      session = self._held(session_id)
      if session.turns and turns and at(turns[0]) < at(session.turns[-1]):
        held = session.unpacked()
        self.bytes -= session.size
        session = self._sessions[session_id] = _Session()
        turns = list(heapq.merge(held, turns, key=at))
      return self._add(session, turns, number=True)

  def _append(self, session_id: str, turns: list[dict], number: bool,
              own: bool = False) -> str:
    with self._lock:
      session = self._held(session_id)
      if own and session.lost_before is not None and not session.turns:
        turns[0]["lost_before"] = session.lost_before
      return self._add(session, turns, number)

  def _add(self, session: _Session, turns: list[dict], number: bool) -> str:
    """(under the lock) `turns` appended to the held `session`; its record's id."""
    for turn in turns:
      if number:
        turn["turn"] = len(session.turns)
      self.bytes += session.append(turn)
    session.touched = self._clock()
    self._bound()
    return session.record_id

  def revive(self, session_id: str, record_id: str, turn: int) -> bool:
    """A call that says which turn it continues (a Responses call's previous_response_id,
    an SDK's retry from its last good response): that turn of the session's record
    `record_id` is made one of its threads again (the session's threads are its last
    turns only, so a call going on from an earlier one was encoded from its text: a fork,
    red team 41). Whether it was."""
    with self._lock:
      session = self._sessions.get(session_id)
      if session is None or session.record_id != record_id or not (
          0 <= turn < len(session.turns)):
        return False
      self._sessions.move_to_end(session_id)  # (most recently used: not the one
      session.touched = self._clock()          # its own growth evicts)
      if not session.revive(turn):
        return False
      self.bytes += session._sized()
      self._bound()
      return True

  def _held(self, session_id: str) -> _Session:
    """The session (made when not held), now the most recently used (under the lock)."""
    self._expire()
    session = self._sessions.get(session_id)
    if session is None:
      session = self._sessions[session_id] = _Session()
      session.lost_before = self._lost.pop(session_id, None)
    self._sessions.move_to_end(session_id)
    return session

  def _bound(self) -> None:
    """Drops the least recently used sessions past the count and byte bounds."""
    while len(self._sessions) > self.max_sessions:
      self._drop_oldest("count")
    while self.max_bytes is not None and self.bytes > self.max_bytes and self._sessions:
      self._drop_oldest("bytes")

  def _drop_oldest(self, reason: str) -> None:
    session_id, session = self._sessions.popitem(last=False)
    self.bytes -= session.size
    self.evicted[reason] += 1
    self._lost[session_id] = {"reason": reason, "turns": len(session.turns)}
    while len(self._lost) > self._lost_kept:
      self._lost.popitem(last=False)
    if reason != "ttl":  # a bound a live session can hit: its episode is lost
      log.warning("session %r evicted by the session store's %s bound (%d turns, %d "
                  "bytes, last turn %.0f s ago; the store holds %d sessions in %d bytes)",
                  session_id, reason, len(session.turns), session.size,
                  self._clock() - session.touched, len(self._sessions), self.bytes)

  def _expire(self) -> None:
    if self.ttl_s is None:
      return
    now = self._clock()
    while self._sessions and now - next(iter(self._sessions.values())).touched > self.ttl_s:
      self._drop_oldest("ttl")

  def get(self, session_id: str) -> Optional[list[dict]]:
    """The session's turns; None when it is not held."""
    got = self.read(session_id)
    return None if got is None else got[0]

  def read(self, session_id: str, since: int = 0
           ) -> Optional[tuple[list[dict], int, str]]:
    """The session's turns from turn `since` on, how many it holds in all, and its
    record's id; None when it is not held."""
    with self._lock:
      self._expire()
      session = self._sessions.get(session_id)
      return None if session is None else (session.unpacked(since), len(session.turns),
                                           session.record_id)

  def last_turn(self, session_id: str, messages: list[dict], tools: Any
                ) -> Optional["LastTurn"]:
    """The turn a call of the session continues: of the session's threads (`_Head`: its
    last turn, a side call's before it, one a router handed over), the one with the most
    messages that `messages` begin with (equal as JSON, as they were recorded) and whose
    tools are `tools`; None when none, or the session is not held."""
    tools_json = json.dumps(tools, default=str)
    with self._lock:
      session = self._sessions.get(session_id)
      heads = list(session.heads) if session else []
    if not heads:
      return None
    # (a parent's messages are a prefix of its head's: the heads' longest bounds both)
    digests = [_digest(json.dumps(m, default=str))
               for m in messages[:max(len(h.digests) for h in heads)]]
    # And the turns they went on from (a call with fewer messages than a summary's that
    # went on from the agent's turn continues that turn): made (their ids sliced) only
    # for those the call's messages begin with, not at every call.
    parents = [h.parent_turn() for h in heads if h.parent is not None
               and h.parent.tools_json == tools_json
               and digests[:h.parent.messages] == h.digests[:h.parent.messages]]
    best = _thread_of(parents + heads, digests, tools_json)
    if best is None:
      return None
    return LastTurn(best.prompt.tolist(), len(best.digests),
                    [(list(out), response) for out, response, _ in best.replies])

  def handover(self, session_id: str) -> Optional[list[dict]]:
    """What another server needs to continue the session's threads (a router's copy,
    when a turn of the session goes to a server that did not run its last one: `carry`
    there): for each, oldest first, the turn it went on from if any, then it: their
    prompt ids, messages, tools and replies (output ids and assistant message, newest
    first); None when the session is not held or has no chat turn."""
    with self._lock:
      session = self._sessions.get(session_id)
      if session is None or not session.heads:
        return None
      heads = list(session.heads)
      own = [h.turn for h in heads if h.turn is not None]
      recorded = session.unpacked(min(own)) if own else []
      first = min(own) if own else 0
    out = []
    for h in heads:
      messages = h.messages if h.turn is None else recorded[h.turn - first]["messages"]
      # (the turn it went on from first, then it: carried so, it is its parent there)
      for t in ([h.parent_turn()] if h.parent else []) + [h]:
        out.append({"prompt_ids": t.prompt.tolist(), "messages": messages[:len(t.digests)],
                    "tools": json.loads(t.tools_json),
                    "replies": [{"output_ids": list(o), "response": response}
                                for o, response, _ in t.replies]})
    return out

  def carry(self, session_id: str, turns: list[dict]) -> None:
    """Takes the threads of a session that ran on another server (`handover` there, sent
    by a router that failed the session over, or brought it back): the session's next
    call continues their tokens as if they had run here. The session's record is
    unchanged (the turns are that server's). A thread this server went on with itself
    (a turn of its own record whose messages begin with the handed one's) stays as it
    is: the router's copy may be behind; a sibling's replies are merged into it."""
    handed = []
    for t in turns:
      replies = [_reply(_pack(list(r["output_ids"]), int), r.get("response"))
                 for r in t["replies"]]
      prompt = _pack(list(t["prompt_ids"]), int)
      if not _packed_alike(prompt, replies[0][0]):  # (ids past 64 bits: none sampled)
        continue
      handed.append(_Head(
          prompt + replies[0][0], len(replies[0][0]),
          [_digest(json.dumps(m, default=str)) for m in t["messages"]],
          json.dumps(t.get("tools"), default=str), replies, messages=t["messages"],
          extra=_TURN_OVERHEAD + sum(held_bytes(m) for m in t["messages"])))
    with self._lock:
      session = self._held(session_id)
      session.lost_before = None  # (the router handing it over holds its turns)
      for head in handed:
        # (its own threads whose messages begin with the handed one's: the same, or on)
        own = [h for h in session.heads if h.turn is not None and head.continued_by(h.digests)]
        sibling = next((h for h in own if h.sibling_of(head)), None)
        if sibling is not None:
          seen = {tuple(out) for out, _, _ in sibling.replies}
          sibling.replies += [r for r in head.replies if tuple(r[0]) not in seen]
          del sibling.replies[MAX_REPLIES:]
        elif not own:
          session.add_head(head)
        for _, response, _ in head.replies:  # (their calls' arguments as sampled)
          session.keep_calls(response)
      self.bytes += session._sized()
      session.touched = self._clock()
      self._bound()

  def sampled_calls(self, session_id: str) -> dict[str, str]:
    """The arguments' text of each tool call the session's turns made, by call id."""
    with self._lock:
      session = self._sessions.get(session_id)
      return {} if session is None else dict(session.calls)

  def pop(self, session_id: str) -> Optional[list[dict]]:
    with self._lock:
      self._lost.pop(session_id, None)  # (deleted: its next turn begins a record)
      session = self._sessions.pop(session_id, None)
      if session is None:
        return None
      self.bytes -= session.size
      return session.unpacked()

  def __contains__(self, session_id: str) -> bool:
    with self._lock:
      self._expire()
      return session_id in self._sessions

  def __len__(self) -> int:
    with self._lock:
      self._expire()
      return len(self._sessions)


SESSION_HEADER = "x-session-id"


def session_header(headers) -> Optional[str]:
  """A request's X-Session-Id header (`headers`: Starlette's), None when it has none.
  ValueError when it is sent twice: a router read the first, a server the last, so a
  turn was recorded in another client's session unseen by the router (red team 115)."""
  sent = headers.getlist(SESSION_HEADER)
  if len(sent) > 1:
    raise ValueError(f"the {SESSION_HEADER} header is sent {len(sent)} times; send one")
  return sent[0] if sent else None


def session_of(header: Optional[str], named: Optional[str]) -> Optional[str]:
  """A request's session: its X-Session-Id header or its body's `session_id`. Both given
  and different is a ValueError: the router routes by the header, so a body naming
  another session would put the turn into that session's record."""
  header, named = header or None, (str(named) if named else None)
  if named is not None and not valid_unicode(named):  # (a JSON escape: its record unreadable)
    raise ValueError("session_id: not valid Unicode (a lone surrogate)")
  if header and named and header != named:
    raise ValueError(f"the {SESSION_HEADER} header ({header!r}) and the body's session_id "
                     f"({named!r}) name different sessions")
  return header or named

"""From engine turns to token-exact training segments.

`TurnRecord` is one sampled turn as the engine returned it. A session's turns
are mounted in a tree (`TrajectoryManager.add_turn`): a turn hangs under the
deepest earlier turn whose prompt and response its own prompt continues (by
chat messages when known, else by tokens), so branches that share a prefix
share it; a turn that continues nothing (compacted context) follows the same
agent's previous turn, and a new agent role starts a root of its own. Linearising the tree gives `Segment`s, the unit the learner trains
on. Walking a root-to-leaf path, each turn is classified against the tokens
built so far:

- CLEAN: its prompt extends them: append the new prompt tokens (mask 0) and
  the output (mask 1, with its log-probs and versions);
- REALIGN: the prompt departs from them inside the last response, past its first
  token (the chat template re-rendered its end differently), and at most
  `realign_max_tokens` of that response would change: keep the tokens up to the
  divergence, continue with the re-rendered tokens as untrained context, then the
  new output;
- FORK: anything else: close the segment and start a new one (its parent
  recorded) from the full prompt.

A turn shared by several branches is trained once (mask 0 in later branches).
Never round-trips text: the tokens trained on are the tokens sampled.

Contracts tier: NumPy and the standard library only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import math
import os
import zlib
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np

CLEAN, REALIGN, FORK = "clean", "realign", "fork"
STATUSES = ("completed", "truncated", "aborted", "failed")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per-request sampling. temperature 0 is greedy; top_k 0 and top_p 1 are off."""

  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  max_new_tokens: int = 64
  stop_token_ids: tuple[int, ...] = ()
  seed: int = 0

  def validate(self, vocab_size: int) -> None:
    if not (self.temperature >= 0 and math.isfinite(self.temperature)):
      raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if not 0 <= self.top_k < 1 << 31:  # (past int32 it failed its whole prefill batch)
      raise ValueError(f"top_k must be in [0, 2**31), got {self.top_k}")
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if isinstance(self.seed, bool) or not hasattr(self.seed, "__index__"):
      raise ValueError(f"seed must be an integer, got {self.seed!r}")
    bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
      raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")


def reported_seconds(value) -> float:
  """A duration a server reported (absent, or not a finite non-negative number: 0)."""
  try:
    value = float(value or 0.0)
  except (TypeError, ValueError):
    return 0.0
  return value if 0.0 <= value < float("inf") else 0.0


@dataclasses.dataclass
class TurnRecord:
  """One sampled turn: token ids in and out, log-probs and versions of each output token."""

  prompt_ids: list[int]
  output_ids: list[int]
  output_logprobs: list[float]
  versions: list[int]
  finish_reason: str
  messages: Optional[list[dict]] = None  # chat messages rendered into prompt_ids
  response: Optional[dict] = None  # the assistant message made of the output
  agent_role: str = "main"
  sampling: dict = dataclasses.field(default_factory=dict)
  raw_logprobs: Optional[list[float]] = None
  request_id: str = ""
  # The server's seconds from the turn's first token to its end (its length's own time;
  # 0 when the server does not say, or the turn came from a write-ahead log).
  decode_s: float = 0.0

  def __post_init__(self):
    if not (len(self.output_ids) == len(self.output_logprobs) == len(self.versions)):
      raise ValueError(f"turn {self.request_id}: output_ids, output_logprobs and versions "
                       "differ in length")

  # A turn's lists and the types of their items (bool is no int here).
  LISTS = {"prompt_ids": (int,), "output_ids": (int,), "versions": (int,),
           "output_logprobs": (float, int)}

  @classmethod
  def checked(cls, r) -> "TurnRecord":
    """`from_result` of what a server sent, checked: ValueError naming what is no turn's
    (a field missing, of another type, lengths that differ, a log-prob not finite)."""
    try:
      if not isinstance(r, dict):
        raise TypeError(f"{type(r).__name__}, not an object")
      for field, kinds in cls.LISTS.items():
        values = r.get(field)
        if not isinstance(values, list) or not all(type(v) in kinds for v in values):
          raise TypeError(f"{field} is not a list of {kinds[0].__name__}s")
      if not all(math.isfinite(v) for v in r["output_logprobs"]):
        raise ValueError("output_logprobs holds one that is not a finite number")
      if not isinstance(r.get("finish_reason"), str):
        raise TypeError("finish_reason is not a string")
      return cls.from_result(r)
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(f"{type(e).__name__}: {e}"[:300]) from None

  @classmethod
  def from_result(cls, r: dict, **extra) -> "TurnRecord":
    """From a `/generate` result or a recorded session turn of the rollout server."""
    return cls(prompt_ids=list(r["prompt_ids"]), output_ids=list(r["output_ids"]),
               output_logprobs=list(r["output_logprobs"]), versions=list(r["versions"]),
               finish_reason=r["finish_reason"], messages=r.get("messages"),
               response=r.get("response"), sampling=r.get("sampling") or {},
               raw_logprobs=r.get("raw_logprobs"), request_id=r.get("request_id", ""),
               decode_s=reported_seconds(r.get("decode_s")), **extra)


@dataclasses.dataclass
class Segment:
  """One trainable linear sequence (docs/architecture.md): arrays, lineage, outcome,
  versions."""

  tokens: np.ndarray
  loss_mask: np.ndarray
  rollout_logp: np.ndarray
  versions: np.ndarray  # policy version per token; -1 where not sampled
  turn_ids: np.ndarray  # chunk (turn) index per token
  session_id: str
  rollout_id: str
  segment_id: str
  parent_segment_id: Optional[str] = None
  branch_id: int = 0
  agent_role: str = "main"
  task_id: str = ""
  group_id: str = ""
  status: str = "completed"
  reason: str = ""
  reward: float = 0.0
  turn_rewards: list[float] = dataclasses.field(default_factory=list)
  verdict: dict = dataclasses.field(default_factory=dict)
  meta_versions: dict = dataclasses.field(default_factory=dict)
  decisions: list[str] = dataclasses.field(default_factory=list)
  advantages: Optional[np.ndarray] = None  # filled in by the batcher
  # A served model's log-probs of the tokens, filled in before batching when asked for:
  # a frozen reference's (learner.kl_reference) and a teacher's (advantage.teacher).
  ref_logp: Optional[np.ndarray] = None
  teacher_logp: Optional[np.ndarray] = None
  step: Optional[int] = None  # the learner step that trained it, as a run records it

  def __len__(self) -> int:
    return len(self.tokens)

  @property
  def num_action_tokens(self) -> int:
    return int(self.loss_mask.sum())

  def min_version(self) -> Optional[int]:
    """The oldest known version of the trained tokens (None: none known). An unknown
    one (< 0) counts as fresh, as the loss's staleness weighting takes it (it made the
    group the oldest there is to acceptance and `policy_lag`: red team 39)."""
    v = self.versions[(self.loss_mask > 0) & (self.versions >= 0)]
    return int(v.min()) if len(v) else None

  def max_version(self) -> Optional[int]:
    v = self.versions[(self.loss_mask > 0) & (self.versions >= 0)]
    return int(v.max()) if len(v) else None

  def to_training(self) -> dict:
    """The dict `jaxagent.batch.pack` takes (advantages must be set)."""
    if self.advantages is None:
      raise ValueError(f"segment {self.segment_id} has no advantages yet")
    out = {"tokens": self.tokens, "loss_mask": self.loss_mask,
           "rollout_logp": self.rollout_logp, "advantages": self.advantages,
           "versions": self.versions, "rollout_id": self.rollout_id}
    if self.ref_logp is not None:
      out["ref_logp"] = self.ref_logp
    return out

  def to_json(self) -> dict:
    d = {}
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      d[f.name] = v.tolist() if isinstance(v, np.ndarray) else v
    return d

  @classmethod
  def from_json(cls, d: dict) -> "Segment":
    d = dict(d)
    for name, dtype in (("tokens", np.int32), ("loss_mask", np.float32),
                        ("rollout_logp", np.float32), ("versions", np.int32),
                        ("turn_ids", np.int32)):
      d[name] = np.asarray(d[name], dtype)
    for name in ("advantages", "ref_logp", "teacher_logp"):
      if d.get(name) is not None:
        d[name] = np.asarray(d[name], np.float32)
    return cls(**d)


def open_jsonl(path: str, mode: str = "r"):
  """A JSONL file in text mode, gzip-compressed when `path` ends in .gz (appends add a
  gzip member, which readers see as one stream)."""
  if path.endswith(".gz"):
    return gzip.open(path, mode + "t" if "t" not in mode else mode, encoding="utf-8")
  return open(path, mode, encoding="utf-8")


def read_jsonl(path: str) -> Iterator[dict]:
  """The rows of a (gzipped) JSONL file; a last line or member cut short by a kill ends it."""
  with open_jsonl(path) as f:
    try:
      for line in f:
        try:
          yield json.loads(line)
        except json.JSONDecodeError:
          return
    except (EOFError, gzip.BadGzipFile, zlib.error):
      return


def dump_segments(path: str, segments: Iterable[Segment], step: Optional[int] = None,
                  text: Optional[Callable[[list[int]], str]] = None) -> int:
  """Appends segments to a JSONL file (gzipped if `path` ends in .gz), each marked with
  the learner `step` that trained them when given and, with `text` (a tokenizer's
  decode), its tokens as text; returns how many were written. A write that fails (a
  full disk) leaves the file as it was: a retry appends them whole, once (red team 21:
  a retried step's segments were in the file twice)."""
  n = 0
  at = os.path.getsize(path) if os.path.exists(path) else 0
  try:
    with open_jsonl(path, "a") as f:
      for s in segments:
        d = s.to_json()
        if step is not None:
          d["step"] = step
        if text is not None:
          d["text"] = text(s.tokens.tolist())
        f.write(json.dumps(d) + "\n")
        n += 1
  except BaseException:
    with contextlib.suppress(OSError):
      os.truncate(path, at)
    raise
  return n


def load_segments(path: str) -> list[Segment]:
  out = []
  for d in read_jsonl(path):
    d.pop("text", None)
    out.append(Segment.from_json(d))
  return out


# -- the message tree ---------------------------------------------------------------------


def _norm_message(m: dict) -> tuple:
  calls = m.get("tool_calls") or []
  calls = tuple((c.get("function", {}).get("name"), str(c.get("function", {}).get("arguments")))
                for c in calls)
  return (m.get("role"), m.get("content") or "", calls)


@dataclasses.dataclass
class _Node:
  id: int
  record: TurnRecord
  turn: int
  parent: Optional["_Node"]
  children: list = dataclasses.field(default_factory=list)
  # Mounted under its parent for want of any turn it continues (`_find_parent`'s last
  # rule): it says nothing of which reply the agent went on from.
  guessed: bool = False

  @property
  def full_tokens(self) -> list[int]:
    return self.record.prompt_ids + self.record.output_ids

  def messages_after(self) -> Optional[list[tuple]]:
    r = self.record
    if r.messages is None or r.response is None:
      return None
    return [_norm_message(m) for m in r.messages] + [_norm_message(r.response)]


def _common_prefix(a: list[int], b: list[int]) -> int:
  n = min(len(a), len(b))
  i = 0
  while i < n and a[i] == b[i]:
    i += 1
  return i


class _Builder:
  """A segment under construction."""

  def __init__(self, segment_id: str, parent: Optional[str]):
    self.segment_id, self.parent = segment_id, parent
    self.tokens: list[int] = []
    self.mask: list[float] = []
    self.logp: list[float] = []
    self.versions: list[int] = []
    self.turns: list[int] = []
    self.last_out = (0, 0)
    self.decisions: list[str] = []

  def truncate(self, n: int) -> None:
    for arr in (self.tokens, self.mask, self.logp, self.versions, self.turns):
      del arr[n:]

  def add_context(self, ids: list[int], turn: int) -> None:
    self.tokens += ids
    self.mask += [0.0] * len(ids)
    self.logp += [0.0] * len(ids)
    self.versions += [-1] * len(ids)
    self.turns += [turn] * len(ids)

  def add_output(self, r: TurnRecord, turn: int, train: bool) -> None:
    start = len(self.tokens)
    self.tokens += r.output_ids
    self.mask += [1.0 if train else 0.0] * len(r.output_ids)
    self.logp += list(r.output_logprobs) if train else [0.0] * len(r.output_ids)
    self.versions += list(r.versions)
    self.turns += [turn] * len(r.output_ids)
    self.last_out = (start, len(self.tokens))


class TrajectoryManager:
  """Collects one session's turns and linearises them into segments."""

  def __init__(self, session_id: str, rollout_id: Optional[str] = None, *, task_id: str = "",
               group_id: str = "", realign_max_tokens: int = 16,
               acted_on: Optional[Callable[[TurnRecord, list[TurnRecord]], bool]] = None):
    self.session_id = session_id
    # Whether the agent acted on a turn, given the turns it went on from, oldest first
    # (see `abandoned`).
    self.acted_on = acted_on
    self.rollout_id = rollout_id or session_id
    self.task_id = task_id
    self.group_id = group_id
    self.realign_max_tokens = realign_max_tokens
    self.roots: list[_Node] = []
    self.nodes: list[_Node] = []

  def add_turn(self, record: TurnRecord, turn: Optional[int] = None) -> int:
    """Mounts a turn under the deepest turn its prompt continues; returns its node id."""
    parent, guessed = self._find_parent(record)
    node = _Node(len(self.nodes), record, len(self.nodes) if turn is None else turn, parent,
                 guessed=guessed)
    (parent.children if parent is not None else self.roots).append(node)
    self.nodes.append(node)
    return node.id

  def _find_parent(self, r: TurnRecord) -> tuple[Optional[_Node], bool]:
    """The turn `r` goes on from, and whether that was guessed (nothing it continues)."""
    if r.messages is not None:
      msgs = [_norm_message(m) for m in r.messages]
      best, tied = None, []
      for node in self.nodes:
        after = node.messages_after()
        if after is not None and len(after) <= len(msgs) and msgs[:len(after)] == after:
          if best is None or len(after) > len(best.messages_after()):
            best, tied = node, [node]
          elif len(after) == len(best.messages_after()):
            tied.append(node)
      if best is not None:
        # (of siblings whose replies read the same, the one whose tokens the prompt goes
        # on: the gateway continued it; the first alone realigned onto another's tokens)
        return next((n for n in tied if r.prompt_ids[:len(n.full_tokens)] == n.full_tokens),
                    best), False
    best, best_len = None, 0
    for node in self.nodes:
      full = node.full_tokens
      # The node's whole turn is a prefix, or the prompt leaves it inside its response
      # (it holds the node's whole prompt and goes on past it).
      d = _common_prefix(full, r.prompt_ids)
      if (d >= len(node.record.prompt_ids) and len(r.prompt_ids) > len(node.record.prompt_ids)
          and d > 0 and d >= best_len):
        best, best_len = node, d
    if best is None:
      # Sampled again from the prompt of an earlier turn: that turn's sibling, and as
      # guessed as it (a retried side call continues no reply either: red team 66).
      for node in self.nodes:
        if node.record.prompt_ids == r.prompt_ids:
          return node.parent, node.guessed
      # Nothing it continues (compacted or rewritten context, a side call): it follows
      # the same agent's previous turn, and linearising will fork there.
      same = [n for n in self.nodes if n.record.agent_role == r.agent_role]
      return (same[-1] if same else None), True
    return best, False

  def abandoned(self) -> set[int]:
    """Node ids of turns sampled again from the same prompt and then left (a harness's
    retry, a best-of-n that kept one reply): they led nowhere, so the episode's outcome
    is not theirs and they train nothing. Of siblings with one prompt, those a later turn
    continues are kept; if none is continued (the last step), the one reply `acted_on`
    says the agent handed on, and when that cannot be told, none of them: a rejected
    reply must not be reinforced with the outcome. A turn mounted under one of them for
    want of any it continues (a side call after a best-of-n) continues none of them."""
    siblings: dict[tuple, list[_Node]] = {}
    for n in self.nodes:
      key = (n.parent.id if n.parent is not None else -1, n.record.agent_role,
             tuple(n.record.prompt_ids))
      siblings.setdefault(key, []).append(n)
    out = set()
    for group in siblings.values():
      if len(group) == 1:
        continue
      kept = [n for n in group if any(not c.guessed for c in n.children)]
      if not kept and self.acted_on is not None:
        before, up = [], group[0].parent
        while up is not None:
          before.insert(0, up.record)
          up = up.parent
        acted = [n for n in group if self.acted_on(n.record, before)]
        kept = acted if len(acted) == 1 else []
      out.update(n.id for n in group if n not in kept)
    return out

  def paths(self) -> list[list[_Node]]:
    out = []

    def walk(node, path):
      path = path + [node]
      if not node.children:
        out.append(path)
      for c in node.children:
        walk(c, path)

    for root in self.roots:
      walk(root, [])
    return out

  def segments(self, **outcome: Any) -> list[Segment]:
    """Linearises every branch; `outcome` (status, reason, reward, ...) goes on each segment."""
    trained: set[int] = self.abandoned()  # (their tokens stay, as context, untrained)
    node_segment: dict[int, str] = {}
    result: list[Segment] = []
    counter = 0

    def close(b: Optional[_Builder], branch: int, role: str):
      if b is None or not b.tokens:
        return
      result.append(Segment(
          tokens=np.asarray(b.tokens, np.int32), loss_mask=np.asarray(b.mask, np.float32),
          rollout_logp=np.asarray(b.logp, np.float32), versions=np.asarray(b.versions, np.int32),
          turn_ids=np.asarray(b.turns, np.int32), session_id=self.session_id,
          rollout_id=self.rollout_id, segment_id=b.segment_id, parent_segment_id=b.parent,
          branch_id=branch, agent_role=role, task_id=self.task_id, group_id=self.group_id,
          decisions=b.decisions, **outcome))

    for branch, path in enumerate(self.paths()):
      cur: Optional[_Builder] = None
      for node in path:
        r = node.record
        train = node.id not in trained
        if cur is None:
          # A later branch starts on a shared turn: it hangs off the segment that trained it.
          parent = node_segment.get(node.id) or (
              node_segment.get(node.parent.id) if node.parent is not None else None)
          cur = _Builder(f"{self.session_id}/{counter}", parent)
          counter += 1
          cur.add_context(r.prompt_ids, node.turn)
          cur.decisions.append(FORK if parent else CLEAN)
        elif r.prompt_ids[:len(cur.tokens)] == cur.tokens:
          cur.add_context(r.prompt_ids[len(cur.tokens):], node.turn)
          cur.decisions.append(CLEAN)
        else:
          d = _common_prefix(cur.tokens, r.prompt_ids)
          start, end = cur.last_out
          # (at least one token of the response kept: a divergence at its first token
          # realigned dropped the whole response from training, the turn's action trained
          # nowhere, as a template that strips an earlier turn's <think> does; a reviewer)
          if start < d and end - d <= self.realign_max_tokens:
            cur.truncate(d)
            cur.add_context(r.prompt_ids[d:], node.turn)
            cur.decisions.append(REALIGN)
          else:
            close(cur, branch, path[0].record.agent_role)
            cur = _Builder(f"{self.session_id}/{counter}", cur.segment_id)
            counter += 1
            cur.add_context(r.prompt_ids, node.turn)
            cur.decisions.append(FORK)
        cur.add_output(r, node.turn, train)
        trained.add(node.id)
        node_segment.setdefault(node.id, cur.segment_id)
      close(cur, branch, path[0].record.agent_role)
    return result

"""`python -m jaxagent.view RUN_DIR [--port P] [--host H]`: a web page of a run's trajectories.

Reads the segments a training run dumped (`RUN_DIR/trajectories.jsonl.gz`, or
`trajectories.jsonl` with `trajectories.compress: none`; see
`trajectory.dump_segments`) and serves, on the loopback interface by default:

- `/`: one page (`view.html`, plain JavaScript): the episodes, filtered by task,
  reward, verdict, policy version and truncation reason; one episode's
  conversation with every token a span coloured by its role (the first turn's
  prompt, a policy action, what later turns added: observations and template
  text) and by its loss mask, its rollout log-prob, advantage and policy version
  on hover; the segments' lineage with their CLEAN/REALIGN/FORK decisions as a
  tree; each turn's tool calls and the observations that followed; the verdict.
- `/api/run`, `/api/episodes?task=&min_reward=&verdict=&version=&truncation=&offset=&limit=`
  and `/api/episodes/{n}`: the same as JSON.

An episode is the segments of one rollout (`rollout_id`) dumped at one learner
step. The file is never loaded whole: one streaming pass builds an index of
small per-episode summaries and where each segment's line starts in the
(decompressed) stream, and an episode is read back from there. A gzip stream
cannot be entered in the middle, so the index also keeps where each gzip member
starts (each step's dump appends one) and, inside a long member (a resumed
run's file is one), a copy of the decompressor's state every `CHECKPOINT_BYTES`
of output, as zlib's `zran.c` does: reading an episode decompresses at most that
much before its first line. Memory: the summaries, plus 32-40 KB of decompressor
state per `CHECKPOINT_BYTES` of a long member. The index reads on when the file
grows (a run in progress) and starts over when it is replaced (`--resume` cuts
it by writing a new file).

Token text is each token id decoded alone by the tokenizer the run's
`config.json` names, so a token holding part of a multi-byte character shows
U+FFFD; log-probs and advantages are shown only where the loss mask is 1 (the
writer stores 0 elsewhere), and advantages only when the segments carry them.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import socket
import sys
import threading
import zlib
from typing import Any, Iterator, Optional, Sequence

import tokenizers
from fastapi import FastAPI, HTTPException, Query
from fastapi.responses import FileResponse, JSONResponse
from starlette.middleware.trustedhost import TrustedHostMiddleware

from jaxagent.serve_http import finite, listen_or_say, serve
from jaxagent.tokenizer import IM_END, IM_START, Tokenizer, smollm2_tokenizer
from jaxagent.toolcalls import parse_tool_calls
from jaxagent.trajectory import FORK, REALIGN

FILES = ("trajectories.jsonl.gz", "trajectories.jsonl")
PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "view.html")
CHUNK = 1 << 16  # compressed bytes read at a time
CHECKPOINT_BYTES = 4 << 20  # decompressed bytes between saved decompressor states
MAX_SPAN_BYTES = 64 << 20  # an episode's lines read in one pass when they lie within this
GZIP_WBITS = 16 + zlib.MAX_WBITS  # zlib's code for a gzip header and trailer


# -- lines of the file, read on from where the last scan stopped --------------------------


class PlainLines:
  """A JSONL file's complete lines as (byte offset, line)."""

  def __init__(self, path: str):
    self.path = path
    self.consumed = 0  # bytes of the file scanned: just past the last complete line
    self.broken = False  # a plain file has no stream to break: a bad line is skipped

  def scan(self, f) -> Iterator[tuple[int, bytes]]:
    """The lines of open file `f` past those scanned before."""
    f.seek(self.consumed)
    for line in f:
      if not line.endswith(b"\n"):
        return  # still being written (or cut by a kill): the next scan reads it again
      start, self.consumed = self.consumed, self.consumed + len(line)
      yield start, line

  def read(self, offset: int, length: int) -> bytes:
    with open(self.path, "rb") as f:
      f.seek(offset)
      return f.read(length)


class GzipLines:
  """A gzip JSONL file's complete lines as (offset in the decompressed stream, line).

  The file may hold several gzip members (appends add one), read as one stream. A
  member that does not decompress (a kill cut it and more was appended) ends it, as
  `trajectory.read_jsonl` does.
  """

  def __init__(self, path: str):
    self.path = path
    self.consumed = 0  # compressed bytes fed to the decompressor
    self.produced = 0  # decompressed bytes it returned
    self.inflate = zlib.decompressobj(GZIP_WBITS)
    self.pending = b""  # decompressed bytes past the last complete line
    self.line_start = 0  # their offset
    self.broken = False
    # Where reading may start: a decompressed offset, the compressed offset there and
    # the decompressor's state (None at a member's start: a fresh one).
    self.mark_offsets = [0]
    self.marks: list[tuple[int, Optional[object]]] = [(0, None)]

  def _mark(self, state) -> None:
    self.mark_offsets.append(self.produced)
    self.marks.append((self.consumed, state))

  def _inflate(self, chunk: bytes) -> bytes:
    """Decompresses `chunk` (the next compressed bytes), saving the decompressor's state
    each CHECKPOINT_BYTES of output: at most that much is decompressed in one call, so a
    chunk of very compressible data (64 KB into 16 MB) does not put the marks 16 MB
    apart (red team 24)."""
    out = []
    while chunk and not self.broken:
      try:
        data = self.inflate.decompress(chunk, CHECKPOINT_BYTES)
      except zlib.error:
        self.broken = True
        break
      out.append(data)
      self.produced += len(data)
      if self.inflate.eof:
        rest = self.inflate.unused_data  # the next member's first bytes
        self.consumed += len(chunk) - len(rest)
        chunk = rest
        self.inflate = zlib.decompressobj(GZIP_WBITS)
        self._mark(None)
        continue
      rest = self.inflate.unconsumed_tail  # (input held back by the output bound)
      self.consumed += len(chunk) - len(rest)
      chunk = rest
      if self.produced - self.mark_offsets[-1] >= CHECKPOINT_BYTES:
        self._mark(self.inflate.copy())
    return b"".join(out)

  def scan(self, f) -> Iterator[tuple[int, bytes]]:
    """The lines of open file `f` past those scanned before."""
    f.seek(self.consumed)
    while not self.broken and (chunk := f.read(CHUNK)):
      buf = self.pending + self._inflate(chunk)
      lines, pos = [], 0
      while (end := buf.find(b"\n", pos)) >= 0:
        lines.append((self.line_start + pos, buf[pos:end + 1]))
        pos = end + 1
      self.pending, self.line_start = buf[pos:], self.line_start + pos
      yield from lines

  def read(self, offset: int, length: int) -> bytes:
    i = bisect.bisect_right(self.mark_offsets, offset) - 1
    skip = offset - self.mark_offsets[i]
    consumed, state = self.marks[i]
    inflate = state.copy() if state is not None else zlib.decompressobj(GZIP_WBITS)
    got = bytearray()
    with open(self.path, "rb") as f:
      f.seek(consumed)
      while len(got) < length and (chunk := f.read(CHUNK)):
        while chunk and len(got) < length:
          data = inflate.decompress(chunk)
          if skip >= len(data):  # before the line: dropped as it comes
            skip -= len(data)
          else:
            got += data[skip:]
            skip = 0
          chunk = inflate.unused_data if inflate.eof else b""
          if inflate.eof:
            inflate = zlib.decompressobj(GZIP_WBITS)
    return bytes(got[:length])


# -- the index ------------------------------------------------------------------------------


class TrajectoryIndex:
  """Summaries of a trajectory file's episodes and where their segments' lines lie.

  `refresh` reads what was appended since the last call, or the whole file again
  when it was replaced. Safe to call from several threads.
  """

  def __init__(self, path: str):
    self.path = path
    self._lock = threading.Lock()
    self._reset(None)

  def _reset(self, identity) -> None:
    self._lines = (GzipLines if self.path.endswith(".gz") else PlainLines)(self.path)
    self._identity = identity
    self.episodes: list[dict] = []
    self._places: list[list[tuple[int, int]]] = []  # per episode: (offset, length) a segment
    self._by_key: dict[tuple, int] = {}
    self.segments = 0
    self.bad_lines = 0
    self.vocab_sha256: Optional[str] = None  # of the tokenizer that wrote the first segment

  def refresh(self) -> None:
    with self._lock:
      try:
        f = open(self.path, "rb")
      except FileNotFoundError:
        return  # being replaced: keep what we have
      with f:
        st = os.fstat(f.fileno())
        identity = (st.st_dev, st.st_ino)
        if identity != self._identity or st.st_size < self._lines.consumed:
          self._reset(identity)
        if st.st_size == self._lines.consumed:
          return
        for offset, line in self._lines.scan(f):
          try:
            self._add(json.loads(line), offset, len(line))
          except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            self.bad_lines += 1  # (not JSON, or not a segment object)

  def _add(self, row: dict, offset: int, length: int) -> None:
    _check_segment(row)  # (before anything is kept: one bad line breaks nothing)
    key = (row.get("step"), row.get("rollout_id") or row["session_id"])
    tokens, versions = len(row["tokens"]), row["versions"]
    trained = int(sum(m > 0 for m in row["loss_mask"]))
    n = self._by_key.get(key)
    if n is None:
      n = self._by_key[key] = len(self.episodes)
      verdict = row.get("verdict") or {}
      status = row.get("status", "")
      self.episodes.append({
          "n": n, "step": key[0], "rollout_id": key[1], "task_id": row.get("task_id", ""),
          "group_id": row.get("group_id", ""), "status": status, "reason": row.get("reason", ""),
          "truncation": row.get("reason", "") if status == "truncated" else "",
          "reward": row.get("reward"), "verdict": verdict.get("status", ""), "versions": [],
          "segments": 0, "tokens": 0, "trained_tokens": 0, "forks": 0, "realigns": 0})
      self._places.append([])
    if self.vocab_sha256 is None:
      self.vocab_sha256 = (row.get("meta_versions") or {}).get("vocab_sha256")
    ep = self.episodes[n]
    ep["versions"] = sorted(set(ep["versions"]) | {v for v in versions if v >= 0})
    ep["segments"] += 1
    ep["tokens"] += tokens
    ep["trained_tokens"] += trained
    decisions = row.get("decisions") or []
    ep["forks"] += decisions.count(FORK)
    ep["realigns"] += decisions.count(REALIGN)
    self._places[n].append((offset, length))
    self.segments += 1

  def select(self, task: str = "", min_reward: Optional[float] = None, verdict: str = "",
             version: Optional[int] = None, truncation: str = "") -> list[dict]:
    """The episodes that pass every filter given: `task` a substring of the task id,
    `truncation` a reason, "any" (truncated) or "none" (not truncated)."""
    self.refresh()
    out = []
    with self._lock:
      for ep in self.episodes:
        if task and task.lower() not in ep["task_id"].lower():
          continue
        if min_reward is not None and (ep["reward"] is None or ep["reward"] < min_reward):
          continue
        if verdict and ep["verdict"] != verdict:
          continue
        if version is not None and version not in ep["versions"]:
          continue
        if truncation and not (ep["truncation"] == truncation
                               or (truncation == "any" and ep["truncation"])
                               or (truncation == "none" and not ep["truncation"])):
          continue
        out.append(ep)
    return out

  def episode(self, n: int) -> Optional[tuple[dict, list[dict]]]:
    """Episode `n`'s summary and its segments as written, or None. ValueError or
    zlib.error if the file was replaced since the refresh this makes."""
    self.refresh()
    with self._lock:
      if not 0 <= n < len(self.episodes):
        return None
      summary, places, lines = self.episodes[n], list(self._places[n]), self._lines
    # Read outside the lock (a long read held every other request), in one pass over the
    # span the episode's lines lie in: they are written together, one dump a step (each
    # read apart decompressed again from the saved state before it: red team 24).
    start = min(o for o, _ in places)
    span = max(o + k for o, k in places) - start
    if span <= MAX_SPAN_BYTES:
      blob = lines.read(start, span)
      return summary, [json.loads(blob[o - start:o - start + k]) for o, k in places]
    return summary, [json.loads(lines.read(o, k)) for o, k in places]

  def facets(self) -> dict:
    """The values the filters can take, and the file's totals."""
    self.refresh()
    with self._lock:
      eps = self.episodes
      return {"episodes": len(eps), "segments": self.segments, "bad_lines": self.bad_lines,
              "verdicts": sorted({e["verdict"] for e in eps if e["verdict"]}),
              "truncations": sorted({e["truncation"] for e in eps if e["truncation"]}),
              "versions": sorted({v for e in eps for v in e["versions"]}),
              "last_step": max((e["step"] for e in eps if e["step"] is not None), default=None),
              "complete": not self._lines.broken}


def _check_segment(row: Any) -> None:
  """TypeError unless `row` has a segment's fields with their types (a line of another
  kind, a string step beside integer ones, broke the viewer's filters and its start:
  red team 14)."""
  def of(value, *kinds, list_of=None):
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if ok and list_of is not None:
      ok = all(isinstance(v, list_of) and not isinstance(v, bool) for v in value)
    return ok

  if not (isinstance(row, dict) and of(row.get("step"), int, type(None))
          and of(row.get("rollout_id") or row.get("session_id"), str)
          and of(row.get("segment_id", ""), str)
          and of(row.get("parent_segment_id"), str, type(None))
          and of(row.get("tokens"), list, list_of=int)
          and all(0 <= t < 2**31 for t in row["tokens"])
          and of(row.get("versions"), list, list_of=int)
          and of(row.get("turn_ids"), list, list_of=int)
          and of(row.get("loss_mask"), list, list_of=(int, float))
          and of(row.get("rollout_logp"), list, list_of=(int, float))
          and of(row.get("advantages") or [], list, list_of=(int, float))
          and len({len(row[k]) for k in ("tokens", "versions", "turn_ids", "loss_mask",
                                         "rollout_logp", "advantages")
                   if row.get(k) is not None}) == 1
          and of(row.get("turn_rewards") or [], list, list_of=(int, float))
          and of(row.get("decisions") or [], list, list_of=str)
          and of(row.get("task_id", ""), str) and of(row.get("group_id", ""), str)
          and of(row.get("status", ""), str) and of(row.get("reason", ""), str)
          and of(row.get("reward"), int, float, type(None))
          and of(row.get("verdict") or {}, dict)
          and of((row.get("verdict") or {}).get("status", ""), str)):
    raise TypeError("not a segment")


# -- tokens as text -------------------------------------------------------------------------


class TokenText:
  """Token ids as text with the run's tokenizer; ids in angle brackets without one."""

  def __init__(self, tok: Optional[tokenizers.Tokenizer], note: str):
    self.tok, self.note = tok, note
    self._cache: dict[int, str] = {}

  def pieces(self, ids: list[int]) -> list[str]:
    if self.tok is None:
      return [f"<{i}>" for i in ids]
    for i in set(ids) - self._cache.keys():
      self._cache[i] = self.tok.decode([i], skip_special_tokens=False)
    return [self._cache[i] for i in ids]

  def text(self, ids: list[int]) -> Optional[str]:
    if self.tok is None:
      return None
    return self.tok.decode(ids, skip_special_tokens=False)


def run_token_text(run_dir: str, vocab_sha256: Optional[str]) -> TokenText:
  """The tokenizer `RUN_DIR/config.json`'s `model` names (a preset's byte-level one, a
  GGUF's, a HF directory's tokenizer.json), checked against the vocabulary hash the
  segments carry where it can be computed."""
  try:
    with open(os.path.join(run_dir, "config.json")) as f:
      model = json.load(f).get("model") or {}
    ckpt = model.get("checkpoint")
    if ckpt is None:
      tokenizer = Tokenizer.byte_level()
    elif ckpt == "smollm2":
      tokenizer = smollm2_tokenizer()
    elif ckpt.endswith(".gguf"):
      tokenizer = Tokenizer.from_gguf(ckpt)
    else:  # a HF directory, or model.tokenizer
      path = model.get("tokenizer") or ckpt
      path = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
      return TokenText(tokenizers.Tokenizer.from_file(path), f"tokens decoded with {path}")
  except Exception as e:  # any reason it cannot be built: show ids, say why
    return TokenText(None, f"no tokenizer ({type(e).__name__}: {e}); tokens shown as ids")
  own = tokenizer.identity()["vocab_sha256"]
  note = f"tokens decoded with the {tokenizer.name} tokenizer"
  if vocab_sha256 and own != vocab_sha256:
    note += (f", whose vocabulary ({own}) is not the run's ({vocab_sha256}): "
             "the token text may be wrong")
  return TokenText(tokenizer.tok, note)


# -- one episode for the page ---------------------------------------------------------------


def chat_roles(pieces: list[str]) -> list[Optional[str]]:
  """The ChatML message each token is in (the role after its `<|im_start|>`); None
  between messages and for other templates."""
  roles: list[Optional[str]] = []
  role, header, name = None, None, ""
  for i, piece in enumerate(pieces):
    if piece == IM_START:
      role, header, name = None, i, ""
    elif header is not None:
      name += piece
      if "\n" in name:
        role = name.split("\n")[0].strip() or None
        roles[header:i] = [role] * (i - header)
        header = None
    roles.append(role)
    if piece == IM_END:
      role = None
  return roles


def segment_view(row: dict, text: TokenText) -> dict:
  """One segment for the page: its tokens as columns (text, role, loss mask, rollout
  log-prob, advantage, version, turn) and its turns (context and action text, tool
  calls, decision, process reward)."""
  ids, mask, versions = row["tokens"], row["loss_mask"], row["versions"]
  turn_ids, logp, adv = row["turn_ids"], row["rollout_logp"], row.get("advantages")
  pieces = text.pieces(ids)
  first = turn_ids[0] if turn_ids else 0
  roles = ["action" if v >= 0 else "prompt" if t == first else "observation"
           for v, t in zip(versions, turn_ids)]
  by_turn: dict[int, list[int]] = {}
  for i, t in enumerate(turn_ids):
    by_turn.setdefault(t, []).append(i)
  decisions = row.get("decisions") or []
  turn_rewards = row.get("turn_rewards") or []
  turns = []
  for k, (t, idx) in enumerate(by_turn.items()):
    action_ids = [ids[i] for i in idx if versions[i] >= 0]
    action = text.text(action_ids) if action_ids else ""
    parsed = parse_tool_calls(action) if action else None
    turns.append({
        "turn": t, "first": k == 0, "decision": decisions[k] if len(decisions) == len(by_turn) else None,
        "context": text.text([ids[i] for i in idx if versions[i] < 0]), "action": action,
        "trained": any(mask[i] > 0 for i in idx),
        "versions": sorted({versions[i] for i in idx if versions[i] >= 0}),
        "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in parsed.calls]
                      if parsed else [],
        "tool_call_errors": parsed.errors if parsed else [],
        "reward": turn_rewards[t] if 0 <= t < len(turn_rewards) else None})
  # The writer stores 0 where the mask is 0: nothing was recorded there.
  keep = ("segment_id", "parent_segment_id", "branch_id", "agent_role", "session_id",
          "decisions", "meta_versions")
  return {**{k: row.get(k) for k in keep}, "text": row.get("text"), "turns": turns,
          "advantages_recorded": adv is not None,
          "tokens": {"id": ids, "text": pieces, "role": roles, "chat": chat_roles(pieces),
                     "mask": [int(m > 0) for m in mask], "version": versions, "turn": turn_ids,
                     "logp": [p if m > 0 else None for p, m in zip(logp, mask)],
                     "adv": None if adv is None else
                            [a if m > 0 else None for a, m in zip(adv, mask)]}}


def lineage(rows: list[dict]) -> list[dict]:
  """The segments as a forest by `parent_segment_id`; a parent the episode does not hold
  (not dumped) is named on its child, which becomes a root."""
  nodes = {r["segment_id"]: {"segment_id": r["segment_id"], "branch_id": r.get("branch_id"),
                             "agent_role": r.get("agent_role"),
                             "decisions": r.get("decisions") or [], "tokens": len(r["tokens"]),
                             "trained": int(sum(m > 0 for m in r["loss_mask"])),
                             "children": []} for r in rows}
  roots = []
  for r in rows:
    node, parent = nodes[r["segment_id"]], r.get("parent_segment_id")
    if parent in nodes:
      nodes[parent]["children"].append(node)
    else:
      node["missing_parent"] = parent
      roots.append(node)
  return roots


def episode_view(summary: dict, rows: list[dict], text: TokenText) -> dict:
  first = rows[0]
  return {"summary": summary, "verdict": first.get("verdict") or {},
          "turn_rewards": first.get("turn_rewards") or [], "tree": lineage(rows),
          "segments": [segment_view(r, text) for r in rows]}


# -- the app --------------------------------------------------------------------------------


def trajectory_file(path: str) -> Optional[str]:
  """The trajectory file of run directory `path` (or `path` itself if it is one)."""
  if os.path.isfile(path):
    return path
  for name in FILES:
    if os.path.isfile(os.path.join(path, name)):
      return os.path.join(path, name)
  return None


class FiniteJSON(JSONResponse):
  """JSON with a NaN or an infinity written as null: a run's file may hold one (a reward,
  a log-prob of -inf), and every list it was in answered 500 (red team 24)."""

  def render(self, content: Any) -> bytes:
    try:
      return super().render(content)
    except ValueError:
      return super().render(finite(content))


def create_app(run_dir: str, hosts: Sequence[str] = ()):
  """The viewer's FastAPI app over `run_dir` (which must hold a trajectory file). It
  answers requests that name this machine (or `hosts`) as their host only: a web page
  elsewhere that rebinds its name to this machine's address cannot read the run."""
  path = trajectory_file(run_dir)
  if path is None:
    raise FileNotFoundError(f"no {' or '.join(FILES)} in {run_dir}")
  index = TrajectoryIndex(path)
  index.refresh()
  config_dir = run_dir if os.path.isdir(run_dir) else os.path.dirname(path)
  text = run_token_text(config_dir, index.vocab_sha256)
  app = FastAPI(title="jaxagent trajectories", default_response_class=FiniteJSON,
                docs_url=None, redoc_url=None, openapi_url=None)
  app.add_middleware(TrustedHostMiddleware, allowed_hosts=[
      "localhost", "127.0.0.1", "[::1]", "::1", *hosts])
  app.state.index = index

  @app.get("/")
  def page():
    return FileResponse(PAGE, media_type="text/html")

  @app.get("/api/run")
  def run():
    return {"run_dir": os.path.abspath(run_dir), "file": path, "tokenizer": text.note,
            **index.facets()}

  @app.get("/api/episodes")
  def episodes(task: str = "",  # (min_reward=nan matched every episode: a new user)
               min_reward: Optional[float] = Query(None, allow_inf_nan=False), verdict: str = "",
               version: Optional[int] = None, truncation: str = "",
               offset: int = Query(0, ge=0), limit: int = Query(100, ge=1, le=1000)):
    found = index.select(task, min_reward, verdict, version, truncation)
    return {"total": len(found), "offset": offset, "limit": limit,
            "episodes": found[offset:offset + limit]}

  @app.get("/api/episodes/{n}")
  def episode(n: int):
    try:
      got = index.episode(n)
    except (ValueError, zlib.error):
      raise HTTPException(409, "the trajectory file changed while it was read; reload")
    if got is None:
      raise HTTPException(404, f"no episode {n}")
    return episode_view(*got, text)

  return app


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
      allow_abbrev=False, prog="python -m jaxagent.view", description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("run_dir", help="a training run directory (or its trajectory file)")
  p.add_argument("--port", type=int, default=8765, help="port to listen on (default 8765)")
  p.add_argument("--host", default="127.0.0.1",
                 help="address to listen on (default 127.0.0.1: this machine only)")
  p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                 help="a host name the page may be opened by besides this machine's (a "
                      "proxy's, a domain name); repeatable")
  args = p.parse_args(argv)
  if not os.path.exists(args.run_dir):
    print(f"error: no such run directory or file {args.run_dir}", file=sys.stderr)
    return 2
  if trajectory_file(args.run_dir) is None:
    print(f"error: no {' or '.join(FILES)} in {args.run_dir}", file=sys.stderr)
    return 2
  sock = listen_or_say(args.host, args.port)
  if sock is None:
    return 2
  app = create_app(args.run_dir, hosts=[args.host, socket.gethostname(), socket.getfqdn(),
                                        *args.allow_host]
                   if args.host not in ("0.0.0.0", "::") else ["*"])
  facts = app.state.index.facets()
  path = app.state.index.path
  if not facts["segments"] and (facts["bad_lines"] or not facts["complete"]):
    # (it served /etc/passwd, or random bytes, as "0 episodes": a red team)
    sock.close()
    print(f"error: {path} is not a trajectory file (" + (
        f"none of its {facts['bad_lines']} lines is a segment" if facts["bad_lines"]
        else "not gzip") + ")", file=sys.stderr)
    return 2
  damaged = ", ".join(filter(None, [
      f"{facts['bad_lines']} lines not segments, left out" if facts["bad_lines"] else "",
      "its stream broken past the last whole line" if not facts["complete"] else ""]))
  print(f"{facts['episodes']} episodes ({facts['segments']} segments) in {path}"
        + (f" ({damaged})" if damaged else "")
        + f"; serving http://{args.host}:{sock.getsockname()[1]}/", flush=True)
  serve(app, sock, log_level="warning")
  return 0


if __name__ == "__main__":
  sys.exit(main())

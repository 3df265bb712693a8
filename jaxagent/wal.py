"""Token write-ahead log: an episode's committed work, durable before its side effects.

The episodes of a group append to the group's JSONL file under the log's directory
(every record tagged with its episode's session id):

- a `start` record (session, group, task, episode index in its group, and the log's
  `run`: a tag of the trainer's start, so that a group's log keeps one key, `run/group`,
  over resumes, which number their groups on from a checkpoint's and may meet a stopped
  run's numbers);
- a `turn` record for every sampled turn (prompt and output token ids, log-probs,
  versions, finish reason), written and flushed (and fsync'd) *before* the
  environment sees the action: the commit boundary comes before any side effect;
- an `obs` record after the environment's step: its reward, flags, the hash of
  what it returned (`observation_hash`) and the environment's state hash
  (`Env.state_hash`), so a replay can check it rebuilt the same state;
- a `summary` record when compaction replaced the context by a summary (its text: it
  is not the policy's action, but the next prompts are built on it);
- an `end` record when the episode is over.

A log is deleted once its episode's group is trained (or dropped) and a checkpoint
that no longer lists it is finalised (at the save after it, or the run's end; not when
an asynchronous save begins). When the trainer dies, `--resume` first deletes the logs of the
groups its checkpoint has trained on (the checkpoint lists their keys, and those of the
logs they replayed), then replays each log left (`jaxagent.agent.run_whitebox(..., replay=...)`): the environment is
reset and stepped through the logged actions (each observation checked against its
hash), the logged turns are taken as they were sampled (token-exact, with their
log-probs and versions) and the episode goes on from its last committed token. A dead
rollout server costs less still: the turn in flight is asked of another server with
the same seed, which samples the same tokens (`fold_in(seed, position)` keys; with
speculative decoding on, another sample of the policy's, as exact).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import re
import shutil
import threading
import uuid
from typing import Any, Iterable, Optional

import numpy as np

from jaxagent.errors import RunWriteFailed, disk_hint
from jaxagent.trajectory import TurnRecord


# Where a resumed run keeps the stopped run's logs until its own first checkpoint is whole.
ASIDE = "replaying"


def tokens_hash(ids) -> str:
  return hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()[:16]


def observation_hash(step: Any) -> str:
  """A hash of what an environment step returned (observation messages, reward, flags)."""
  obs = step.observation
  payload = json.dumps({"messages": list(obs.messages), "tools": list(obs.tools or []),
                        "reward": float(step.reward), "terminated": bool(step.terminated),
                        "truncated": bool(step.truncated)}, sort_keys=True, default=str)
  return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _write_failed(path: str, e: OSError) -> RunWriteFailed:
  """The run cannot keep its episodes' committed work: it stops (a full disk, a lost
  mount; an episode raising OSError was a traceback, "a bug")."""
  return RunWriteFailed(f"the token WAL could not be written in {os.path.dirname(path)} "
                        f"({e.strerror or e}){disk_hint(e)}")


class _OpenFiles:
  """The group files held open, the `limit` most recently written (a run that kept no
  group for a while, no step and no save, held one for every group it played and ran out
  of file descriptors; opening a file for every record instead costs an upload a record
  on a bucket mount). One lock for every write: records are small."""

  def __init__(self, limit: int = 128):
    self.limit = limit
    self.lock = threading.Lock()  # fsync'd writes come from worker threads
    self._held: "collections.OrderedDict[str, Any]" = collections.OrderedDict()

  def get(self, path: str):
    """The open file of `path` (under `lock`), the least recently used closed past the limit."""
    f = self._held.pop(path, None)
    if f is None:
      f = open(path, "a")
      while len(self._held) >= self.limit:
        self._held.popitem(last=False)[1].close()
    self._held[path] = f
    return f

  def close(self, path: str) -> None:
    with self.lock:
      f = self._held.pop(path, None)
      if f is not None:
        f.close()


class _GroupFile:
  """The append-only file a group's episodes share (held open among the most recently
  written, `_OpenFiles`)."""

  def __init__(self, path: str, fsync: bool, files: _OpenFiles):
    self.path = path
    self.fsync = fsync
    self._files = files
    self._write("")  # (created now: a directory that cannot be written fails here)

  def _write(self, line: str) -> None:
    try:
      with self._files.lock:
        f = self._files.get(self.path)
        f.write(line)  # one line a write: records of episodes never interleave
        f.flush()
        # The disk wait outside the lock every group shares (groups' fsyncs overlap, as
        # with a lock a group), on a descriptor of its own (the file may be closed past
        # the limit meanwhile).
        fd = os.dup(f.fileno()) if self.fsync and line else None
      if fd is not None:
        try:
          os.fsync(fd)
        finally:
          os.close(fd)
    except OSError as e:  # (a line cut short is skipped by a replay, as after a kill)
      raise _write_failed(self.path, e) from e

  def append(self, record: dict) -> int:
    line = json.dumps(record, separators=(",", ":")) + "\n"
    self._write(line)
    return len(line)

  def close(self) -> None:
    self._files.close(self.path)


class EpisodeLog:
  """The log of one episode (see the module's docstring): records tagged with its
  session id in its group's file."""

  def __init__(self, group_file: _GroupFile, session_id: str):
    self._group = group_file
    self.path = group_file.path
    self.fsync = group_file.fsync
    self.session_id = session_id
    self.bytes = 0

  def _append(self, record: dict) -> None:
    self.bytes += self._group.append({"session": self.session_id, **record})

  def start(self, *, group_id: str, task: dict, episode: int, run: str = "",
            replays: Iterable[str] = ()) -> None:
    self._append({"kind": "start", "session_id": self.session_id, "group_id": group_id,
                  "task": task, "episode": episode, "run": run,
                  **({"replays": sorted(replays)} if replays else {})})

  def turn(self, turn: int, record: TurnRecord) -> None:
    """Commits a sampled turn (call before the environment sees its action)."""
    # The prompt is rebuilt on replay (from the task and the logged actions): its length
    # and hash check the rebuild, and the log grows with the outputs only.
    self._append({"kind": "turn", "turn": turn, "prompt_len": len(record.prompt_ids),
                  "prompt_hash": tokens_hash(record.prompt_ids),
                  "output_ids": list(record.output_ids),
                  "output_logprobs": list(record.output_logprobs),
                  "raw_logprobs": record.raw_logprobs, "versions": list(record.versions),
                  "finish_reason": record.finish_reason, "request_id": record.request_id})

  def observation(self, turn: int, step: Any, state_hash: Optional[str] = None) -> None:
    """Logs what the environment answered, with its hash and the environment's own
    state hash (`Env.state_hash`) when it has one."""
    self._append({"kind": "obs", "turn": turn, "reward": float(step.reward),
                  "terminated": bool(step.terminated), "truncated": bool(step.truncated),
                  "hash": observation_hash(step), "state": state_hash})

  def summary(self, turn: int, text: str) -> None:
    """Logs the summary that compaction put in the context before `turn`."""
    self._append({"kind": "summary", "turn": turn, "text": text})

  def limit(self, turn: int, tokens: int) -> None:
    """Logs the context limit the engine's refusal of turn `turn`'s prompt lowered the
    episode's to (a replay compacts where the stopped run did: with the config's limit
    its prompts no longer rebuilt, and the finished episode was played again)."""
    self._append({"kind": "limit", "turn": turn, "tokens": tokens})

  def end(self, status: str, reason: str = "") -> None:
    self._append({"kind": "end", "status": status, "reason": reason})

  def close(self) -> None:
    """Nothing to do: the group's file stays open for its other episodes."""


class Replay:
  """The logged turns of an episode in flight, in order, for `run_whitebox(replay=...)`."""

  def __init__(self, records: Iterable[dict]):
    records = list(records)
    self.start = next((r for r in records if r["kind"] == "start"), {})
    # (the group's log's key: its run's tag and its group id; `keys` with those of the
    # logs it replayed, and theirs: its episode's earlier copies, which a resume that
    # sets logs aside may still hold)
    self.key = _key(self.start)
    self.keys = {self.key, *self.start.get("replays", ())}
    self.turns = [r for r in records if r["kind"] == "turn"]
    self.hashes = {r["turn"]: (r["hash"], r.get("state")) for r in records
                   if r["kind"] == "obs"}
    # Summaries are taken as logged (asked again, a summariser whose weights moved since
    # would write another, and the logged prompts would no longer be rebuilt).
    self.summaries = {r["turn"]: r["text"] for r in records if r["kind"] == "summary"}
    self.limits = {r["turn"]: r["tokens"] for r in records if r["kind"] == "limit"}

  def __len__(self) -> int:
    return len(self.turns)

  def up_to_version(self, version: int) -> "Replay":
    """Keeps the turns up to the first one sampled by weights newer than `version` (a
    resumed run restored `version`: later weights of the stopped run are gone, and their
    tokens would carry versions this run gives to other weights); the episode goes on
    sampling from there. So go the summaries and limits logged after that turn: of a
    conversation that is no longer the episode's (a later compaction put the stopped
    run's summary of it in the new turns' context; a reviewer)."""
    for i, r in enumerate(self.turns):
      if _sampled_after(r, version):
        del self.turns[i:]
        for logged in (self.summaries, self.limits):
          for turn in [t for t in logged if t > r["turn"]]:
            del logged[turn]
        break
    return self

  def next_turn(self, prompt: list[int]) -> Optional[TurnRecord]:
    """The next logged turn as sampled, on `prompt` (the rebuilt one); None when the log
    is played out. Raises ValueError if `prompt` is not the logged turn's prompt."""
    if not self.turns:
      return None
    r = self.turns.pop(0)
    if len(prompt) != r["prompt_len"] or tokens_hash(prompt) != r["prompt_hash"]:
      raise ValueError(f"turn {r['turn']}: the rebuilt prompt differs from the logged one")
    return TurnRecord.from_result(dict(r, prompt_ids=list(prompt)))


def _key(start: dict) -> str:
  """The key of a group's log from its start record: `run/group`."""
  return f"{start.get('run', '')}/{start.get('group_id')}"


def _record(line: bytes) -> Optional[dict]:
  """A log's line as a record, or None: not one (cut short, damaged, a foreign file's)."""
  try:
    r = json.loads(line)
  except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
    return None
  return r if isinstance(r, dict) and isinstance(r.get("kind"), str) else None


def _sampled_after(turn: dict, version: int) -> bool:
  """Whether a logged turn holds tokens of weights newer than `version`."""
  versions = turn.get("versions")
  return isinstance(versions, list) and bool(versions) and max(versions) > version


def _cut_log(path: str, version: int) -> None:
  """Rewrites a log without each episode's records from its first turn sampled by
  weights newer than `version` on (atomically: a crash leaves the old log or the new)."""
  records, out, cut = read_log(path), [], set()
  for r in records:
    if r.get("session") in cut:
      continue
    if r["kind"] == "turn" and _sampled_after(r, version):
      cut.add(r.get("session"))
      continue
    out.append(r)
  if len(out) == len(records):
    return
  tmp = path + ".cut"
  with open(tmp, "w") as f:
    f.writelines(json.dumps(r, separators=(",", ":")) + "\n" for r in out)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def read_log(path: str) -> list[dict]:
  """The records of a log. A line that is not one is left out, the records after it
  kept: a last line cut short by a crash (a write the crash interrupted: not
  committed), a damaged line, a foreign file's lines (they were a KeyError or a
  UnicodeDecodeError at every resume: red team 15). A replay whose logged turns no
  longer rebuild their prompts is an infrastructure error of its episode, played again."""
  with open(path, "rb") as f:
    return [r for r in map(_record, f) if r is not None]


class TokenWAL:
  """Episode logs in `directory`: one file a group (`<group id>.jsonl`), each record
  tagged with its episode's session id."""

  def __init__(self, directory: str, fsync: bool = True):
    self.directory = directory
    self.fsync = fsync
    self.run = uuid.uuid4().hex[:12]  # this trainer start's tag, in every log's key
    self._files: dict[str, _GroupFile] = {}
    self._open = _OpenFiles()
    os.makedirs(directory, exist_ok=True)

  def _path(self, group_id: str) -> str:
    return os.path.join(self.directory, re.sub(r"[^A-Za-z0-9_.-]", "_", group_id) + ".jsonl")

  def open(self, session_id: str, *, group_id: str, task: dict, episode: int,
           replays: Iterable[str] = ()) -> EpisodeLog:
    """The log of an episode; `replays`: the keys of the logs it replays (`Replay.keys`)."""
    if group_id not in self._files:
      self._files[group_id] = _GroupFile(self._path(group_id), self.fsync, self._open)
    log = EpisodeLog(self._files[group_id], session_id)
    log.start(group_id=group_id, task=task, episode=episode, run=self.run, replays=replays)
    return log

  def key(self, group_id: str) -> str:
    """The key of this trainer's log of `group_id` (`Replay.key` of what it holds)."""
    return _key({"run": self.run, "group_id": group_id})

  def forget(self, keys: Iterable[str]) -> int:
    """Deletes the logs (set aside or not) of the groups `keys` name (`run/group`; a
    bare group id names any run's): those a checkpoint has trained on, which a resume
    from it must never replay. Returns how many files went."""
    keys = set(keys)
    gone = 0
    for directory in (self.directory, self.aside) if keys else ():
      names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
      for name in names:
        path = os.path.join(directory, name)
        if not name.endswith(".jsonl"):
          continue
        # (by any start record in it: one damaged first line kept the file, and its
        # other episodes replayed a group the checkpoint trained on: reviewer)
        starts = [r for r in read_log(path) if r["kind"] == "start"]
        if any({_key(r), r.get("group_id")} & keys for r in starts):
          with contextlib.suppress(FileNotFoundError):
            os.remove(path)
          gone += 1
    return gone

  def discard_group(self, group_id: str) -> None:
    """Deletes a group's log (every episode and attempt) once it is done with."""
    f = self._files.pop(group_id, None)
    if f is not None:
      f.close()
    with contextlib.suppress(FileNotFoundError):
      os.remove(self._path(group_id))

  def clear(self) -> None:
    """Deletes every log (a resumed run, having read them, starts the log afresh)."""
    for group_id in list(self._files):
      self.discard_group(group_id)
    for name in os.listdir(self.directory):
      if name.endswith((".jsonl", ".jsonl.cut")):  # (a cut a crash left half made)
        with contextlib.suppress(FileNotFoundError):
          os.remove(os.path.join(self.directory, name))

  @property
  def aside(self) -> str:
    return os.path.join(self.directory, ASIDE)

  def set_aside(self, version: Optional[int] = None) -> None:
    """Moves every log into `ASIDE/` (a resumed run, having read them, logs afresh; the
    old logs stay until a checkpoint of the resumed run is whole, `drop_aside`: a crash
    before that, in its start-up too, still replays them). With `version` (the restored
    checkpoint's), every log kept is first cut on disk as `Replay.up_to_version` cuts
    it: the stopped run's later turns were sampled by weights this run gives those
    versions' numbers to, and a later resume from this run's own checkpoint (at a
    higher version) replayed them as its own (red team 21)."""
    os.makedirs(self.aside, exist_ok=True)
    if version is not None:
      for directory in (self.aside, self.directory):
        for name in sorted(os.listdir(directory)):
          if name.endswith(".jsonl"):
            _cut_log(os.path.join(directory, name), version)
    for name in sorted(os.listdir(self.directory)):
      if name.endswith(".jsonl"):
        target, n = os.path.join(self.aside, name), 0
        while os.path.exists(target):  # (a log of an earlier resume's start-up)
          n += 1
          target = os.path.join(self.aside, f"{name[:-len('.jsonl')]}.{n}.jsonl")
        os.rename(os.path.join(self.directory, name), target)

  def drop_aside(self) -> None:
    shutil.rmtree(self.aside, ignore_errors=True)

  def pending(self) -> list[Replay]:
    """Every logged episode not yet discarded (in flight, or finished but not trained),
    set aside or not: what a restarted trainer replays instead of playing again (one a
    task's episode index, as `take_replay` matches them), once it has `forget`ten the
    groups its checkpoint trained on."""
    def read(directory: str) -> list[Replay]:
      out = []
      for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if not name.endswith(".jsonl"):
          continue
        sessions: dict[str, list] = {}
        for r in read_log(os.path.join(directory, name)):
          sessions.setdefault(r.get("session"), []).append(r)
        out += [Replay(records) for records in sessions.values()
                if records and records[0]["kind"] == "start"]
      return out

    def key(replay: Replay) -> tuple:
      return replay.start.get("task", {}).get("id"), replay.start.get("episode")

    out: dict[tuple, Replay] = {}
    for replay in read(self.aside) + read(self.directory):
      # An episode re-logged by a resume (set aside again by the next) supersedes its
      # older log: the longest of one task's episode is kept.
      if key(replay) not in out or len(replay) >= len(out[key(replay)]):
        out[key(replay)] = replay
    return list(out.values())


def take_replay(replays: list[Replay], task_id: str, episode: int) -> Optional[Replay]:
  """Removes and returns the logged episode of `task_id` with index `episode` in its
  group, if `replays` has one."""
  for i, r in enumerate(replays):
    if r.start.get("task", {}).get("id") == task_id and r.start.get("episode") == episode:
      return replays.pop(i)
  return None

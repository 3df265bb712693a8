"""Per-step training metrics: from episodes and learner outputs to JSONL, TensorBoard and a PNG."""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import sys
import time
from typing import Iterable, Optional

import numpy as np


def percentiles(xs: Iterable[float], name: str) -> dict:
  xs = list(xs)
  if not xs:
    return {}
  p = np.percentile(np.asarray(xs, np.float64), [50, 95, 99])
  return {f"{name}_p50": float(p[0]), f"{name}_p95": float(p[1]), f"{name}_p99": float(p[2])}


def episode_metrics(groups, accepted, learner_version: int, signal=None) -> dict:
  """What the step's finished episodes say (all of them, not only the accepted ones).
  `signal(group)`: whether the group's advantages can be other than 0 (the run's
  estimator's rule, `scheduler.carries_signal`; default: its rewards differ)."""
  if signal is None:
    from jaxagent.config import AdvantageConfig
    from jaxagent.scheduler import carries_signal
    signal = functools.partial(carries_signal, cfg=AdvantageConfig())
  episodes = [e for g in groups for e in g.episodes]
  out: dict = {"groups": len(groups), "groups_accepted": len(accepted),
               "episodes": len(episodes),
               "episodes_trained": sum(len(g.episodes) for g in accepted)}
  if not episodes:
    return out
  rewards = [e.reward for e in episodes]
  terminal = [float(e.verdict.get("reward", 0.0) or 0.0) for e in episodes]
  truncations = collections.Counter(e.reason for e in episodes if e.status == "truncated")
  lags = [learner_version - v for g in accepted for v in [g.min_version()] if v is not None]
  out.update({
      "success_rate": float(np.mean([e.success for e in episodes])),
      "reward_mean": float(np.mean(rewards)),
      "reward_terminal_mean": float(np.mean(terminal)),
      "reward_process_mean": float(np.mean(np.asarray(rewards) - np.asarray(terminal))),
      "turns_mean": float(np.mean([e.turns for e in episodes])),
      "tool_calls": int(sum(e.tool_calls for e in episodes)),
      "invalid_tool_calls": int(sum(e.invalid_tool_calls for e in episodes)),
      # Calls whose tool raised: an environment whose tool fails on every call trains a
      # policy on error messages (with invalid_tool_calls 0 and tool_call_rate 1).
      "tool_errors": int(sum(getattr(e, "tool_errors", 0) for e in episodes)),
      "compactions": int(sum(getattr(e, "compactions", 0) for e in episodes)),
      # Episodes with a valid tool call: more calls than invalid ones (malformed blocks,
      # unknown tools and bad arguments all count as invalid), so at least one was run.
      "tool_call_rate": float(np.mean([e.tool_calls > e.invalid_tool_calls for e in episodes])),
      # Groups whose advantages can be other than 0 (rewards that differ, under GRPO).
      "groups_with_signal": sum(len(g.episodes) > 1 and signal(g) for g in groups),
      "output_tokens": int(sum(e.output_tokens for e in episodes)),
      "generate_s_mean": float(np.mean([e.generate_s for e in episodes])),
      "env_s_mean": float(np.mean([e.env_s for e in episodes])),
      "infra_wait_s_mean": float(np.mean([getattr(e, "infra_wait_s", 0.0) for e in episodes])),
      "policy_lag_mean": float(np.mean(lags)) if lags else 0.0,
      "policy_lag_max": int(max(lags)) if lags else 0,
  })
  out.update({f"truncated_{k}": v for k, v in truncations.items()})
  judged = [d for e in episodes for d in [e.verdict.get("details") or {}] if "judge" in d]
  if judged:  # what a judge (env.judge) made of the passes it was given
    # (asked: shown to it; a pass too long to show, or whose answer says a verdict
    # itself, is failed without asking and counted on its own)
    unasked = [bool(d.get("judge_too_long") or d.get("answer_says_verdict")) for d in judged]
    out.update({"judge_asked": len(judged) - sum(unasked),
                "judge_false_positives": sum(bool(d.get("false_positive")) for d in judged),
                "judge_unparsed": sum(bool(d.get("judge_unparsed")) for d in judged),
                "judge_too_long": sum(bool(d.get("judge_too_long")) for d in judged),
                "judge_answer_says_verdict": sum(bool(d.get("answer_says_verdict"))
                                                 for d in judged)})
  out.update(percentiles([e.latency_s for e in episodes], "episode_latency_s"))
  out.update(percentiles([t for e in episodes for t in e.tool_latencies_s], "tool_latency_s"))
  return out


def token_staleness_metrics(versions, loss_mask, learner_version: int) -> dict:
  """The distribution of the trained tokens' staleness (updates since the policy that
  sampled each token): mean, max, p50/p90 and the fractions at 0, 1, 2 and 3 or more."""
  if versions is None:
    return {}
  v = np.asarray(versions)[np.asarray(loss_mask) > 0]
  v = v[v >= 0]
  if not len(v):
    return {}
  stale = np.maximum(learner_version - v.astype(np.int64), 0)  # (replayed newer tokens)
  out = {"token_staleness_mean": float(stale.mean()), "token_staleness_max": int(stale.max()),
         "token_staleness_p50": float(np.percentile(stale, 50)),
         "token_staleness_p90": float(np.percentile(stale, 90))}
  for k in (0, 1, 2):
    out[f"token_staleness_frac_{k}"] = float(np.mean(stale == k))
  out["token_staleness_frac_3plus"] = float(np.mean(stale >= 3))
  return out


def _tensorboard_events():
  """tensorboardX's event file writer and its protos. Its package imports torch where
  torch is installed (a second of every run's start, for an alias the events never use):
  that import is made to fail here, unless torch is already in."""
  blocked = "torch" not in sys.modules
  if blocked:
    sys.modules["torch"] = None  # (an import of it raises ImportError)
  try:
    from tensorboardX.event_file_writer import EventsWriter
    from tensorboardX.proto import event_pb2, summary_pb2
  finally:
    if blocked and sys.modules.get("torch", False) is None:
      del sys.modules["torch"]
  return EventsWriter, event_pb2, summary_pb2


class MetricsWriter:
  """One JSON object per learner step in metrics.jsonl, the same scalars in TensorBoard.

  Each row is on disk when `write` returns, in both (TensorBoard: one event per
  step, written in this thread rather than by tensorboardX's background writer), so
  a killed run keeps every step it reported. `purge_step`: the first step a resumed
  run writes again; its TensorBoard file starts by telling readers to drop the
  earlier points from that step on (TensorBoard's purge on restart), so each step
  is seen once.
  """

  def __init__(self, run_dir: str, purge_step: Optional[int] = None):
    self.path = os.path.join(run_dir, "metrics.jsonl")
    # (unbuffered: a row whose write failed is cut off the file, not left in a buffer
    # that a later write flushes after a retry's copy)
    self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    self._written: dict[str, int] = {}  # the last step each sink holds
    try:
      EventsWriter, event_pb2, summary_pb2 = _tensorboard_events()
    except ImportError:  # TensorBoard events are optional
      self._tb = None
      return
    self._event, self._summary = event_pb2.Event, summary_pb2.Summary
    tb_dir = os.path.join(run_dir, "tensorboard")
    os.makedirs(tb_dir, exist_ok=True)
    # Named by the second it starts, then by how many files came before: a new file
    # never overwrites one started in the same second, and sorts after it.
    self._tb = EventsWriter(os.path.join(tb_dir, "events"), f".{len(os.listdir(tb_dir)):04d}")
    if purge_step is not None:
      self._tb.write_event(self._event(
          wall_time=time.time(), step=purge_step,
          session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
    self._tb.flush()

  def write(self, row: dict) -> None:
    """Writes a step's row; written again after a failure (a full disk), each sink gets
    it once (red team 21: a retried step's row was in metrics.jsonl twice)."""
    step = row["step"]
    if self._written.get("jsonl") != step:
      data = (json.dumps(row) + "\n").encode()
      at = os.lseek(self._fd, 0, os.SEEK_END)
      try:
        done = 0
        while done < len(data):
          done += os.write(self._fd, data[done:])
      except BaseException:
        with contextlib.suppress(OSError):
          os.ftruncate(self._fd, at)
        raise
      self._written["jsonl"] = step
    if self._tb is not None and self._written.get("tb") != step:
      values = [self._summary.Value(tag=k, simple_value=float(v)) for k, v in row.items()
                if isinstance(v, (int, float)) and k != "step"]
      self._tb.write_event(self._event(wall_time=time.time(), step=step,
                                       summary=self._summary(value=values)))
      # (in its writer's buffer now: a flush that fails leaves it there, to land with the
      # next flush; written again, it landed twice)
      self._written["tb"] = step
      self._tb.flush()

  def sync(self) -> None:
    """Forces the rows written so far to the disk (before a checkpoint, which is: a
    host's crash kept a checkpoint past rows it lost, red team 38)."""
    os.fsync(self._fd)

  def close(self) -> None:
    """Best effort (a full disk refusing TensorBoard's buffered row stopped the run's
    own close after it)."""
    os.close(self._fd)
    if self._tb is not None:
      with contextlib.suppress(OSError):
        self._tb.close()


class RecordsDamaged(ValueError):
  """A run's record file damaged before its end (a kill cuts only its last line)."""


def _record_rows(path: str):
  """The rows of a run's JSONL record file (gzipped if it ends in .gz). A last line or
  gzip member a kill cut short ends them; anything else that does not read (a line
  with rows after it, a row that is not an object or whose step is not a number, a
  damaged gzip stream) raises `RecordsDamaged`: the rows after it are not dropped."""
  import gzip
  import zlib

  from jaxagent.trajectory import open_jsonl

  name = os.path.basename(path)
  n, cut = 0, None

  def damaged(why: str) -> RecordsDamaged:
    return RecordsDamaged(f"{name}: {why}: the file is damaged (a kill cuts only its last "
                          "line), and a resume would rewrite it without the rows after "
                          f"that; repair it or move it aside ({path})")

  with open_jsonl(path) as f:
    try:
      for line in f:
        n += 1
        if cut is not None:
          raise damaged(f"line {cut[0]} is not JSON ({cut[1]}) and rows follow it")
        try:
          row = json.loads(line)
        except json.JSONDecodeError as e:
          cut = (n, e.msg, line.endswith("\n"))
          continue
        step = row.get("step") if isinstance(row, dict) else None
        if not isinstance(row, dict) or not (
            step is None or (isinstance(step, int) and not isinstance(step, bool))):
          raise damaged(f"line {n} is not a row of the run's ({line.strip()[:60]!r})")
        yield row
      if cut is not None and cut[2]:  # (a kill leaves a line without its end; this one is
        # whole, damaged otherwise: dropped, said, not silently: a new user's round)
        print(f"warning: {name}: its last line ({cut[0]}) is not JSON ({cut[1]}) and is "
              f"dropped ({path})", file=sys.stderr)
    except EOFError:  # a gzip member cut short by a kill: the end
      return
    except gzip.BadGzipFile as e:
      if str(e) == "Not a gzipped file (b'\\x1f')":  # (one byte of a member's header at
        return  # the end, the only read that short: a cut, not damage; reviewer)
      raise damaged(f"after line {n}: {type(e).__name__}: {e}") from None
    except (gzip.BadGzipFile, zlib.error, UnicodeDecodeError) as e:
      raise damaged(f"after line {n}: {type(e).__name__}: {e}") from None


def last_step(path: str) -> Optional[int]:
  """The largest `step` of the rows of a run's JSONL record file that read (a last line
  a kill cut short left out); None when there is no file or no row with a step. A file
  damaged before its end raises `RecordsDamaged`."""
  if not os.path.exists(path):
    return None
  steps = [row["step"] for row in _record_rows(path) if row.get("step") is not None]
  return max(steps, default=None)


def sync_file(path: str) -> None:
  """Forces what was written to the file at `path` (if there is one) to the disk."""
  try:
    fd = os.open(path, os.O_RDONLY)
  except FileNotFoundError:
    return
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def cut_jsonl(path: str, last_step: int) -> int:
  """Rewrites the JSONL file at `path` (gzipped if it ends in .gz) without its rows
  whose `step` is past `last_step` and without what a kill cut short; rows without a
  step stay. The new file replaces the old in one rename. Returns the rows kept.
  A file damaged before its end raises `RecordsDamaged` and is left as it is."""
  from jaxagent.trajectory import open_jsonl

  if not os.path.exists(path):
    return 0
  kept = 0
  tmp = path[:-3] + ".tmp.gz" if path.endswith(".gz") else path + ".tmp"  # same format
  try:
    with open_jsonl(tmp, "w") as dst:
      for row in _record_rows(path):
        if row.get("step") is None or row["step"] <= last_step:
          dst.write(json.dumps(row) + "\n")
          kept += 1
  except RecordsDamaged:
    os.remove(tmp)
    raise
  sync_file(tmp)  # (on the disk before it replaces the file: a crash after the rename
  # could leave an empty file on some file systems, every row lost)
  os.replace(tmp, path)
  return kept


def read_metrics(run_dir: str) -> list[dict]:
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def plot_learning_curve(run_dir: str, title: Optional[str] = None) -> Optional[str]:
  """learning_curve.png: success rate and mean reward against wall time and step."""
  rows = read_metrics(run_dir)
  rows = [r for r in rows if "success_rate" in r]
  if not rows:
    return None
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  wall = [r["wall_time_s"] / 60 for r in rows]
  steps = [r["step"] for r in rows]
  def smooth(ys, w=10):  # trailing mean: per-step values are noisy (few tasks per step)
    return [float(np.mean(ys[max(0, i - w + 1):i + 1])) for i in range(len(ys))]

  success = [r["success_rate"] for r in rows]
  reward = [r["reward_mean"] for r in rows]
  for ax, x, label in ((axes[0], wall, "wall time (min)"), (axes[1], steps, "learner step")):
    ax.plot(x, success, color="C0", alpha=0.25)
    ax.plot(x, smooth(success), color="C0", label="success rate (mean of 10 steps)")
    ax.set_ylim(0, 1)
    ax.set_ylabel("success rate", color="C0")
    rax = ax.twinx()  # the reward has its own scale (process rewards add up)
    rax.plot(x, smooth(reward), color="C1", label="mean reward (mean of 10 steps)")
    rax.set_ylabel("mean reward", color="C1")
    rax.set_ylim(bottom=min(0.0, min(reward)))
    ax.set_xlabel(label)
    ax.grid(alpha=0.3)
    lines = ax.get_lines()[1:] + rax.get_lines()
    ax.legend(lines, [ln.get_label() for ln in lines], loc="lower right")
  fig.suptitle(title or os.path.basename(os.path.normpath(run_dir)))
  fig.tight_layout()
  path = os.path.join(run_dir, "learning_curve.png")
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path

"""What a run starts from: a resume's restored checkpoint (with the tasks it had in
flight, its group numbering, its stop window and canary), the token WAL's logged
episodes to replay, and the config the run directory records."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
from typing import Any, Optional

import jax

from jaxagent import config as config_lib, distributed
from jaxagent.checkpoint import UNRECORDED, RunCheckpointer
from jaxagent.data import file_digest, tasks_digest
from jaxagent.metrics import RecordsDamaged, last_step
from jaxagent.run_dir import check_provenance, check_weights, config_changes, cut_back
from jaxagent.tokenizer import CHATML_TOOLS_TEMPLATE
from jaxagent.wal import TokenWAL


@dataclasses.dataclass
class Restored:
  """A run's starting point: the learner state, and what its checkpoint carried besides
  (nothing on a fresh start)."""
  state: Any
  wall_time_s: float = 0.0  # the stopped run's, which the run's wall time goes on from
  canary: Optional[list] = None  # the episodes the saved run sampled, for --canary
  stop_window_recent: list = dataclasses.field(default_factory=list)  # the early stop's
  next_group: int = 0  # group numbers go on from here: session ids stay unique
  requeue: list = dataclasses.field(default_factory=list)  # this process's tasks in flight
  consumed: set = dataclasses.field(default_factory=set)  # trained groups' WAL log keys
  # This process's totals at the checkpoint (retries, groups replaced, drops by reason),
  # which its count goes on from.
  counted: dict = dataclasses.field(default_factory=dict)
  # The order its data place indexes (`jaxagent.data.TASK_ORDER`; 1 before it was saved).
  task_order: Optional[int] = None


def restore(ckpt: RunCheckpointer, learner, state, tasks, cfg: config_lib.RunConfig,
            tokenizer, run_dir: str, resume: bool) -> Restored:
  """The state a run starts from: `state` (fresh), or on a resume the last checkpoint
  that reads back, checked against this run (process count, weights, provenance), with
  what the stopped run wrote after it cut back. Moves the `tasks` iterator to the
  checkpoint's position. Raises CheckpointUnreadable, RecordsDamaged or ConfigError."""
  from envs.base import TaskSpec

  if not resume:
    return Restored(state)
  if ckpt.latest_step() is None:
    # Stopped before its first checkpoint: it starts again from step 0, the records of
    # the steps it made cut back (its logged episodes are still replayed: same weights).
    print("no checkpoint yet: the run starts again from step 0", flush=True)
    cut_back(run_dir, cfg, 0, 0)
    return Restored(state)
  saved_by = ckpt.saved_processes()
  if saved_by is not None and saved_by != jax.process_count():
    # (each process's data position and tasks in flight are its own: the restore
    # failed on a file of another process count, "no readable checkpoint")
    raise config_lib.ConfigError(
        f"--resume: this run's checkpoint was saved by {saved_by} processes, and "
        f"{jax.process_count()} are resuming it: resume it with --num-processes "
        f"{saved_by} (each process's data position and tasks in flight are its own)")
  set_aside_unrecorded(ckpt, run_dir)
  newest = ckpt.saved_meta()
  if newest is not None:  # (before its arrays: a restore onto other shapes said "no
    # readable checkpoint", read as damage, not as another model: red team 25)
    check_weights(newest, cfg, tokenizer, ckpt.latest_step())
  state, meta, skipped = ckpt.restore_latest_readable(learner.abstract_state(), tasks)
  check_provenance(meta, cfg, tokenizer, int(state.step), run_dir)
  # (of the tasks' values; a checkpoint saved before: of the file's bytes)
  saved_tasks, digest = ((meta["tasks_digest"], tasks_digest) if "tasks_digest" in meta
                         else (meta.get("tasks_sha256"), file_digest))
  if saved_tasks and distributed.is_primary() and saved_tasks != digest(cfg.data.tasks):
    # (changed in place, said by nothing: a changed path, seed or shuffle is said as
    # every config change; a reviewer)
    print(f"warning: --resume: the tasks file {cfg.data.tasks} is not the one checkpoint "
          f"step {int(state.step)} was saved with (its content changed): its tasks come in "
          "another order from the checkpoint's place, and some of this epoch's may come "
          "twice or not at all", file=sys.stderr)
  cut_back(run_dir, cfg, int(state.step), int(state.policy_version))
  for bad, reason in skipped:
    print(f"warning: checkpoint step {bad} unreadable ({reason}); using step "
          f"{int(state.step)}", file=sys.stderr)
  me = jax.process_index()
  mine = meta.get("pending_tasks_by_process")
  mine = (mine[me] if mine and me < len(mine)
          else meta.get("pending_tasks", []) if distributed.is_primary() else [])
  consumed = meta.get("wal_consumed_by_process") or []
  restored = Restored(
      state, wall_time_s=meta.get("wall_time_s", 0.0), canary=meta.get("canary"),
      stop_window_recent=meta.get("stop_window_recent", []),
      next_group=int(meta.get("next_group", 0)),
      requeue=[TaskSpec.from_dict(t) for t in mine],
      consumed=set(consumed[me] if me < len(consumed) else []),
      counted=_counted(meta, me), task_order=int(meta.get("task_order", 1)))
  print(f"resumed from step {int(state.step)} (policy version {int(state.policy_version)}, "
        f"{len(restored.requeue)} tasks re-queued)")
  if cfg.steps <= int(state.step):  # (a lower steps= does not undo steps trained)
    print(f"note: the run is at step {int(state.step)} already, and steps is {cfg.steps}: "
          f"nothing to train; give steps=N above {int(state.step)} to go on",
          file=sys.stderr)
  return restored


def _counted(meta: dict, process: int) -> dict:
  """Process `process`'s totals at the checkpoint. One saved before they were saved by
  process kept process 0's alone (every process went on from them: the others' counted
  process 0's twice): the others begin at 0."""
  by_process = meta.get("counted_by_process")
  if isinstance(by_process, list):
    return by_process[process] if process < len(by_process) else {}
  return (meta.get("counted") or {}) if process == 0 else {}


def set_aside_unrecorded(ckpt: RunCheckpointer, run_dir: str) -> None:
  """Sets aside the checkpoints past the last step metrics.jsonl records (a checkpoint
  is saved after its step's row: one past it means rows were lost, to a write cut short,
  a host's crash before they reached the disk, a file removed). Resumed from one, the
  lost steps were never recorded, without a word (red team 38); the resume goes on from
  the newest checkpoint the rows reach (the steps after it are trained again), saying
  so. None within them: RecordsDamaged."""
  path = os.path.join(run_dir, "metrics.jsonl")
  recorded = (last_step(path) or 0) if distributed.is_primary() else -1
  recorded = distributed.agree_max(recorded)  # (process 0's: the others write none)
  steps = sorted(ckpt.all_steps())
  past = [s for s in steps if s > recorded]
  if not past:
    return
  within = [s for s in steps if s <= recorded]
  what = (f"{path} records the steps up to {recorded}" if recorded else
          f"{path} records no step")
  lost = (f"rows of steps {recorded + 1}-{past[-1]} were lost" if past[-1] > recorded + 1
          else f"row of step {past[-1]} was lost")
  if not within:
    raise RecordsDamaged(
        f"{what} and every checkpoint is past it ({', '.join(map(str, past))}): the "
        f"{lost} (a write cut short, a host's crash, the file removed); "
        f"resumed, they would be missing for good. To train them again from step 0, move "
        f"{ckpt.directory} aside")
  ckpt.set_aside(past, UNRECORDED)
  them = (f"checkpoint {past[0]} is" if len(past) == 1 else
          f"checkpoints {', '.join(map(str, past))} are")
  print(f"warning: {what}, and {them} past it (the {lost}: a write cut short, a host's "
        f"crash, the file removed): set aside as <step>{UNRECORDED}; resuming from step "
        f"{within[-1]}, the steps after it trained again", file=sys.stderr)


def open_wal(cfg: config_lib.RunConfig, run_dir: str, resume: bool, consumed: set,
             version: int) -> tuple[Optional[TokenWAL], list]:
  """This process's token WAL (None when `checkpoint.wal` is off) and, on a resume, the
  episodes the stopped run left in it to replay, up to the restored policy `version`
  (in memory: the log starts afresh, and re-logs what is replayed)."""
  wal_dir = os.path.join(run_dir, "wal" if distributed.is_primary() else
                         f"wal.process{jax.process_index()}")
  wal = TokenWAL(wal_dir, fsync=cfg.checkpoint.wal_fsync) if cfg.checkpoint.wal else None
  replays = []
  if wal is None and os.path.isdir(wal_dir):
    # The logs of a run before this one: a later resume with the log on would replay
    # them from another point of the run's history.
    stale = TokenWAL(wal_dir, fsync=False)
    stale.clear()
    stale.drop_aside()
  if wal is not None:
    if resume:
      # (the logs of groups the checkpoint trained on first: they outlive it until the
      # next save, and a new group of the same task would replay them, trained twice)
      wal.forget(consumed)
      replays = [r for r in (r.up_to_version(version)
                             for r in wal.pending()) if len(r)]  # (none left: nothing)
      if replays:
        print(f"token WAL: {len(replays)} logged episodes "
              f"({sum(len(r) for r in replays)} turns) to replay")
      # (kept until this run's first checkpoint is whole; cut to the restored version)
      wal.set_aside(version)
    else:
      wal.clear()
      wal.drop_aside()
  return wal, replays


def past_logged_groups(next_group: int, replays: list) -> int:
  """The first group number a resumed run may give: past its checkpoint's `next_group`
  and past every group whose episodes the token WAL logged (`replays`). The stopped run
  numbered groups on after its checkpoint, and a replayed episode samples on with its
  first session's seeds: a fresh group given one of those numbers again sampled the
  same turns, and a task's episode was trained twice (a reviewer)."""
  used = [int(m.group(1)) for r in replays
          for sid in (r.start.get("group_id"), r.start.get("session_id"))
          for m in [re.fullmatch(r"g(\d+)(?:-.*)?", str(sid or ""))] if m]
  return max([next_group, *(n + 1 for n in used)])


def write_run_config(cfg: config_lib.RunConfig, tokenizer, run_dir: str, resume: bool,
                     step: int) -> None:
  """Process 0 writes the run's config.json (after a resume has restored: a failed one
  changes nothing). A resume that changes it keeps the config that ran up to `step` as
  config.step{step}.json."""
  if not distributed.is_primary():
    return
  written = cfg
  if cfg.model.chat_template is None and tokenizer.chat_template == CHATML_TOOLS_TEMPLATE:
    # The template the run uses (chosen because the checkpoint's own drops the tools):
    # what serves or evaluates this run's policy must render its prompts the same way.
    written = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, chat_template="chatml_tools"))
  path = os.path.join(run_dir, "config.json")
  if resume and os.path.exists(path):
    with open(path) as f:
      try:
        before = json.load(f)
      except ValueError:
        before = {}
    kept = os.path.join(run_dir, f"config.step{step}.json")
    if config_changes(before, config_lib.to_dict(written)) and not os.path.exists(kept):
      # Changed on the resume: the config that ran up to here is kept (a copy: a kill
      # between moving it and writing the new one left the run with none). Once: a
      # second changed resume at the same step kept the config of the first, which
      # trained none of the steps kept, in its place (and the checkpoint's own config
      # was then one the run "never had"; a reviewer).
      shutil.copyfile(path, kept)
  with open(path + ".tmp", "w") as f:
    json.dump(config_lib.to_dict(written), f, indent=1)
  os.replace(path + ".tmp", path)

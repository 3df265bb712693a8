"""`python -m jaxagent.train --config configs/<run>.yaml [key=value ...] [--run-dir D] [--resume]`.

Agentic RL end to end: rollout servers (in-process by default, or URLs),
environments (in-process, or `envs.server` URLs), the rollout scheduler, the
jitted learner, and weight updates every `rollout.sync_every` steps (in memory
for in-process servers; servers by URL load a policy export, written then and
every `checkpoint.export_every` steps). One run directory holds `config.json`,
`metrics.jsonl`, TensorBoard events, `checkpoints/`, `policy/`,
`trajectories.jsonl.gz` and `learning_curve.png`. `--resume` continues from the
last checkpoint that reads back: parameters, optimiser, data-iterator position,
policy version, wall time and the tasks that were in flight. What the stopped
run wrote after that step (metrics rows, trajectory segments, TensorBoard
points, newer policy exports) is cut back, so every step is recorded once.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import shlex
import signal
import sys
import time
import traceback
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from tqdm import tqdm

from envs.base import TaskSpec
from jaxagent import config as config_lib, control, distributed
from jaxagent.agreements import Agreements, exit_code
from jaxagent.agent import FIRST_PROMPT_TOO_LONG, Episode, run_whitebox
from jaxagent.blackbox import is_blackbox, run_blackbox
from jaxagent.build import build_model, describe
from jaxagent.checkpoint import (CheckpointFailed, CheckpointUnreadable, PolicyExports,
                                 RunCheckpointer, quiet_failed_save_noise, state_prints)
from jaxagent.data import task_dataset
from jaxagent.errors import (InfraError, InfraOutage, NonFiniteUpdate, PeerFailed, PeerLost,
                             RunWriteFailed, TaskError, disk_hint)
from jaxagent.learner import Learner, loss_notes
from jaxagent.metrics import (MetricsWriter, RecordsDamaged, episode_metrics,
                              plot_learning_curve, token_staleness_metrics)
from jaxagent.pools import CountedPool
from jaxagent.resume import open_wal, restore, write_run_config
from jaxagent.run_checks import check_config, served_scorers
from jaxagent.run_dir import (RunDirInUse, compare_canary, dependency_versions,
                              has_checkpoint, holds_a_run, lock_run_dir, play_canary,
                              resumed_config, started_a_run, trajectories_file)
from jaxagent.run_services import (Serving, attach_judge, first_tasks, make_env_factory,
                                   run_meshes, score_segments, task_tools)
from jaxagent.scheduler import (DROP_REASONS, RolloutScheduler, baseline_share,
                                carries_signal, episode_index, no_step_warning, pack_groups,
                                trim_batch)
from jaxagent.stopping import (RESUME_COMMAND, StopSignals, go_on_hint, leave_stuck_threads,
                               resume_command, resume_on, unless_stopped)
from jaxagent.trajectory import dump_segments
from jaxagent.wal import TokenWAL, take_replay


def parse_args(argv=None):
  p = argparse.ArgumentParser(
      allow_abbrev=False, prog="python -m jaxagent.train", description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", help="YAML run config (see configs/); with --resume, the run's "
                                  "own config.json when not given")
  p.add_argument("--run-dir", default=None, help="run directory (default: runs/<name>-<time>)")
  p.add_argument("--resume", action="store_true", help="continue --run-dir from its last checkpoint")
  p.add_argument("--auto-resume", action="store_true",
                 help="--resume when --run-dir holds a run, else start it there (for a "
                      "scheduler that restarts a failed or preempted job: a JobSet)")
  p.add_argument("--print-config", action="store_true",
                 help="print the resolved config (the file with the overrides) as YAML and exit")
  p.add_argument("--canary", action="store_true",
                 help="with --resume: replay the checkpoint's canary episodes first and "
                      "refuse to go on unless tokens, log-probs and rewards match")
  g = p.add_argument_group("multi-process runs (one process per host; see jaxagent.distributed)")
  g.add_argument("--coordinator", help="HOST:PORT of process 0's coordinator")
  g.add_argument("--num-processes", type=int, help="processes in the run")
  g.add_argument("--process-id", type=int, help="this process's index")
  g.add_argument("--heartbeat-timeout", type=int, default=distributed.HEARTBEAT_TIMEOUT_S,
                 metavar="SECONDS",
                 help="how long the run waits for a process gone silent (killed inside "
                      "the learner's step, stopped, its host lost) before every process "
                      "stops for a resume (default %(default)s)")
  p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. learner.lr=3e-4")
  return config_lib.parse_with_overrides(p, argv, config_lib.RunConfig)


@jax.jit
def all_finite(tree) -> jax.Array:
  """Whether every floating-point value of `tree` is finite (one reduction where the
  arrays live: 94 ms for a 135M model's weights on this CPU, its step 2.4 s)."""
  flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
           if jnp.issubdtype(x.dtype, jnp.floating)]
  return jnp.all(jnp.stack(flags)) if flags else jnp.bool_(True)


def learn(learner: Learner, state, batch, ref_params) -> tuple:
  """One train step to completion (in a worker thread): the new state and the step's
  metrics as floats. A step whose loss or gradient norm is not finite, or whose weights
  come out so, raises `NonFiniteUpdate`: its state is never kept (the state it started
  from was given to it: the run's last checkpoint is what a resume has)."""
  new, m = learner.step(state, batch, ref_params)
  m = {k: float(v) for k, v in jax.device_get(m).items()}
  bad = [f"the {k.replace('_', ' ')} is {m[k]}" for k in ("loss", "grad_norm")
         if not math.isfinite(m.get(k, 0.0))]
  if not bad and not bool(all_finite(new.params)):
    # (the loss and its gradient are the weights' before the update: the update that
    # made them inf passed them, and was served, exported and saved: reviewer; the
    # optimiser's state is checked with every checkpoint, `RunCheckpointer.save`)
    bad = ["the weights after it are not finite"]
  if bad:
    raise NonFiniteUpdate(
        f"step {int(new.step)}: " + " and ".join(bad) + " (the update is not kept nor "
        "checkpointed; learner.lr, learner.max_grad_norm and the advantage settings "
        "shape it)")
  return new, m


async def play_episode(task: dict | TaskSpec, session_id: str, group_id: str, *,
                       cfg: config_lib.RunConfig, env_factory, serving: Serving, tokenizer,
                       wal: Optional[TokenWAL], replays: list,
                       replayed_from: dict[str, set]) -> Episode:
  """One episode of the run's agent on `task` (the scheduler's `play`). With the token
  WAL on, a whitebox episode logs every turn, and a group's first episode replays what a
  stopped run logged for its task (`replayed_from`: a group's id, the keys of the logs
  it replayed)."""
  task = task if isinstance(task, TaskSpec) else TaskSpec.from_dict(task)
  env = env_factory(task)
  if is_blackbox(cfg.agent.kind):
    return await run_blackbox(env, task, serving.gateway_url, cfg.agent,
                              session_id=session_id, group_id=group_id,
                              tokenizer=tokenizer, api=cfg.agent.kind,
                              control_token=serving.control_token)
  replay = log = None
  if wal is not None:
    i = episode_index(session_id)
    replay = take_replay(replays, task.id, i) if session_id.endswith("-r0") else None
    if replay is not None:  # (its logs are done with when this group is)
      replayed_from.setdefault(group_id, set()).update(replay.keys)
    log = wal.open(session_id, group_id=group_id, task=task.to_dict(), episode=i,
                   replays=replay.keys if replay is not None else ())
  return await run_whitebox(env, task, serving.client, tokenizer, cfg.agent,
                            session_id=session_id, group_id=group_id, log=log,
                            replay=replay)


async def evaluate_policy(cfg: config_lib.RunConfig, env_factory, serving: Serving,
                          tokenizer) -> dict:
  """The held-out tasks (`eval.*`) played with the served weights: eval_* figures."""
  from envs.base import load_tasks
  from jaxagent import eval as eval_lib

  e = cfg.eval
  agent = dataclasses.replace(cfg.agent, temperature=0.0) if e.greedy else cfg.agent
  held_out = load_tasks(e.tasks, unique=True)[:e.limit or None]

  async def play_eval(task, session_id):
    return await eval_lib.play_as_configured(env_factory(task), task, serving, tokenizer,
                                             agent, session_id)

  by_task = await eval_lib.evaluate(held_out, play_eval, 1 if e.greedy else e.samples)
  rep = eval_lib.report(by_task, e.k)
  out = {f"eval_{k}": v for k, v in rep["overall"].items() if isinstance(v, (int, float))}
  for env, r in rep["by_env"].items():
    out[f"eval_{env}_success_rate"] = r.get("success_rate")
  return out


async def replay_canary(saved: Optional[list], step: int, cfg: config_lib.RunConfig,
                        env_factory, serving: Serving, tokenizer) -> Optional[str]:
  """`--canary`: the canary episodes of checkpoint `step` (`saved`) played again on the
  restored weights; what differs, or None where they replay as saved (or where the
  checkpoint stored none: said, and the run goes on unchecked)."""
  if not saved:
    print(f"warning: --canary: checkpoint step {step} stored no canary (the run was "
          "stopped while its rollouts ran, it was saved between weight syncs, or "
          "canary_tasks was 0 then); going on unchecked", file=sys.stderr)
    return None
  problem = compare_canary(saved, await play_canary(cfg, env_factory, serving.client,
                                                    tokenizer))
  if problem is None:
    print(f"canary: {len(saved)} episodes replayed as saved")
  return problem


def complete_row(p: dict, wall_time_s: float, n_proc: int, scheduler: RolloutScheduler,
                 loop_held_s: float) -> dict:
  """A step's metrics row (`p["row"]`, completed in place and returned) from what its
  records hold (`p`: the step's batch, its packing's `info`, its metrics `m`, its
  rollout and learner seconds, the policy version it made) and the run's totals so far
  (the scheduler's retries, replaced groups and drops; the loop's held seconds)."""
  row, info, batch = p["row"], p["info"], p["batch"]
  # Rates over the step's own time: waiting for rollouts, learning, syncing weights.
  # (Over the rollout wait alone, an async step whose groups were ready read 1,559
  # trajectories a second.)
  step_s = p["rollout_s"] + p["learner_s"] + row.get("weight_sync_s", 0.0)
  row.update({
      "wall_time_s": round(wall_time_s, 3), "policy_version": p["version"],
      "rollout_s": p["rollout_s"], "learner_s": p["learner_s"],
      "rollout_tokens_per_s": row.get("output_tokens", 0) / max(step_s, 1e-9),
      # (the episodes the batch held: a group left out for want of rows is not one)
      "valid_trajectories_per_s": row["episodes_trained"] / max(step_s, 1e-9),
      "action_tokens": float(batch.loss_mask.sum()),
      "batch_rows": int(batch.tokens.shape[0]) * n_proc,
      "batch_fill": round(info["fill"], 4),
      "retries": scheduler.retries, "groups_replaced": scheduler.replaced,
      "loop_held_s": round(loop_held_s, 3),
      # (every reason in every row, 0 until one is dropped: a column read over the
      # rows has no gaps; infra_<kind> from the first of its kind)
      **{f"dropped_{k}": scheduler.dropped[k] for k in DROP_REASONS},
      **{f"dropped_{k}": v for k, v in scheduler.dropped.items()},
      **{k: v for k, v in p["m"].items() if k != "denom"}})
  return row


def _deleted(state) -> bool:
  """Whether `state`'s arrays were given away (donated to a train step under way)."""
  return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(state))


# A run that plays groups but keeps none says so this often (seconds without a step).
NO_STEP_NOTE_S = 60.0


async def train(cfg: config_lib.RunConfig, run_dir: str, resume: bool,
                canary: bool = False, notes: Sequence[str] = ()) -> int:
  """The run (`main` checks its command line first). `notes`: a resume's changes to the
  run's config, said once its checkpoint is restored (a refusal before that, an
  unreadable checkpoint or a config it cannot build, applies none of them)."""
  from envs.loopwatch import LoopWatch

  t_start = time.time()
  # The run's own work (the learner step, packing, agreements, saves, exports, records)
  # on threads of its own: environments' calls (asyncio.to_thread: sandboxes, files,
  # plugins) take the loop's default executor, and eight episodes blocked in it held
  # every thread, so a stop's checkpoint waited behind them for ever (a learner step
  # queued behind slow sandbox calls). Those threads are not waited for at the end.
  run_pool = CountedPool(2, "jaxagent-run")
  asyncio.get_running_loop().set_default_executor(CountedPool(
      min(32, (os.cpu_count() or 1) + 4), "jaxagent-env", wait_at_close=False))
  multi = jax.process_count() > 1
  mesh, serving_mesh = run_meshes(cfg.mesh, cfg.serving.devices)
  env_factory, close_envs = make_env_factory(cfg)
  from envs.sandbox import IsolationUnavailable

  try:  # the chat template must render the tools the tasks offer
    try:
      first = first_tasks(cfg.data.tasks)
      tools = await task_tools(cfg.data.tasks, env_factory, first)
    except ValueError as e:  # a bad line, an unknown environment, no tasks
      raise config_lib.ConfigError(f"data.tasks: {e}") from None
    model_cfg, params, tokenizer = build_model(cfg.model, mesh, tools=tools)
  except IsolationUnavailable as e:  # the tasks run code and this host cannot isolate it
    close_envs()
    raise config_lib.ConfigError(f"env.allow_unisolated: {e}") from None
  except BaseException:
    close_envs()
    raise
  pool = getattr(getattr(env_factory, "resources", None), "_pool", None)
  if pool is not None:  # say how untrusted tool code is isolated here, at the start
    print(f"sandbox: isolation {pool.isolation}, {pool.size} commands at once")
  print(f"model: {describe(model_cfg)}")
  print(f"mesh: {dict(mesh.shape)} on {jax.devices()[0].platform}; run dir: {run_dir}")
  # Score tokens under the distribution they were sampled from (temperature included).
  learner_cfg = dataclasses.replace(cfg.learner, temperature=max(cfg.agent.temperature, 1e-6),
                                    lr_decay_steps=cfg.learner.lr_decay_steps or cfg.steps)
  learner = Learner(model_cfg, learner_cfg, mesh)
  for note in loss_notes(learner_cfg) if distributed.is_primary() else ():
    print(f"note: {note}", file=sys.stderr)
  state = learner.init_state(cfg.seed, params)
  # The KL penalty's reference when the learner scores it: the run's initial weights,
  # frozen (rebuilt the same way on a resume: the preset's seed or the checkpoint).
  ref_params = (jax.tree.map(jnp.copy, state.params)
                if cfg.learner.kl_coef and cfg.learner.kl_reference == "initial" else None)
  scorers = served_scorers(cfg)
  tasks = iter(task_dataset(cfg.data.tasks, seed=cfg.data.seed, shuffle=cfg.data.shuffle))
  quiet_failed_save_noise()  # a failed save is said in one line (CheckpointFailed)
  ckpt = RunCheckpointer(os.path.join(run_dir, "checkpoints"), keep=cfg.checkpoint.keep,
                         async_save=cfg.checkpoint.async_save)
  try:
    restored = restore(ckpt, learner, state, tasks, cfg, tokenizer, run_dir, resume)
  except (CheckpointUnreadable, RecordsDamaged, config_lib.ConfigError):
    ckpt.close()
    close_envs()
    raise
  state, requeue, consumed = restored.state, restored.requeue, restored.consumed
  t_start -= restored.wall_time_s  # the run's wall time goes on from the stopped run's
  saved_canary, saved_recent = restored.canary, restored.stop_window_recent
  next_group = restored.next_group
  # The episodes a stopped run left in its write-ahead log are replayed by the groups of
  # the re-queued tasks.
  wal, replays = open_wal(cfg, run_dir, resume, consumed, int(state.policy_version))
  replayed_from: dict[str, set] = {}  # a group's id: the keys of the logs it replayed
  version = int(state.policy_version)
  # With several processes each serves its own rollouts on its own devices; the weights
  # it starts from (and is updated with) are the whole values, gathered from every one.
  serving = Serving(cfg, model_cfg, distributed.host_copy(state.params), tokenizer,
                    serving_mesh)
  attach_judge(cfg, env_factory, serving, first if distributed.is_primary() else ())
  exports = PolicyExports(os.path.join(run_dir, "policy"), cfg.checkpoint.export_dtype,
                          cfg.checkpoint.export_every, cfg.steps)
  if cfg.serving.urls:  # (a cluster starts them with the learner: they may be loading)
    await serving.client.wait_ready(
        cfg.serving.startup_wait_s,
        lambda m: print(m, flush=True) if distributed.is_primary() else None)
  if resume or cfg.serving.urls:  # servers must start from the learner's weights
    # Exported again on a resume: an export under this version may be a stopped run's.
    path = exports.write(version, state.params)
    # Shared servers: one update is enough; each process's own engine (no servers):
    # every process loads it (a multi-process resume met one process at the load's
    # barrier and the others past it)
    if distributed.is_primary() or not cfg.serving.urls:
      await serving.client.update_weights(path, version)
    if cfg.serving.urls:
      exports.served(version, distributed.is_primary())
    # Every process's episodes start once the servers serve it (sync mode trains tokens
    # of the current weights only).
    distributed.barrier(f"policy-{version}")
  if canary:  # the restored run must sample what the saved one did
    problem = await replay_canary(saved_canary, int(state.step), cfg, env_factory, serving,
                                  tokenizer)
    if problem:
      await serving.close()
      ckpt.close()
      close_envs()
      raise config_lib.ConfigError(f"--canary: step {int(state.step)} does not replay as "
                                   f"saved: {problem}; not going on")
  # The resume's changes are said and recorded once it goes on: its restore and its
  # canary both passed (a refused one said them, and wrote them to config.json, first).
  for line in notes:
    print(line, file=sys.stderr)
  write_run_config(cfg, tokenizer, run_dir, resume, int(state.step))

  play = functools.partial(play_episode, cfg=cfg, env_factory=env_factory, serving=serving,
                           tokenizer=tokenizer, wal=wal, replays=replays,
                           replayed_from=replayed_from)
  scheduler = RolloutScheduler(cfg.rollout, tasks, play, requeue=requeue,
                               advantage=cfg.advantage)
  scheduler.go_on_from(version, next_group, jax.process_index(), jax.process_count())
  primary = distributed.is_primary()
  writer = (MetricsWriter(run_dir, purge_step=int(state.step) + 1 if resume else None)
            if primary else None)
  meta = {"config": config_lib.to_dict(cfg), "model": dataclasses.asdict(model_cfg),
          "tokenizer": tokenizer.identity(), "dependencies": dependency_versions(),
          "mesh": {"shape": dict(mesh.shape), "devices": mesh.devices.size,
                   "platform": jax.devices()[0].platform, "processes": jax.process_count()},
          "tool_schema_sha256": hashlib.sha256(json.dumps(tools, sort_keys=True)
                                               .encode()).hexdigest()[:16]}

  wal_done_with: list[str] = []  # groups whose logs the save under way makes needless
  saves_begun: list[int] = []  # this run's checkpoint saves
  loop = asyncio.get_running_loop()

  # With several processes an error of this one's own work is held (`agreements.hold`)
  # until the next agreement, where every process learns of it (jaxagent/agreements.py).
  agreements = Agreements(run_pool)
  hold, agree, held = agreements.hold, agreements.agree, agreements.held

  async def save_checkpoint(step, state, pending, force=False, canary=True):
    pending = [t.to_dict() if isinstance(t, TaskSpec) else t for t in pending]
    canary_now = None
    try:  # what the saved weights sample on fixed tasks (checked by --canary)
      # (the servers' weights: between weight syncs not the saved ones, which a resume
      # loads: its --canary refused a sound checkpoint; a reviewer of red team 20)
      if canary and scheduler.served == int(state.policy_version):
        canary_now = await play_canary(cfg, env_factory, serving.client, tokenizer)
    except Exception as e:  # the checkpoint matters more than its canary
      print(f"warning: canary episodes failed ({type(e).__name__}: {e}); saved without",
            file=sys.stderr)
    # Every process's tasks in flight (process 0 writes the metadata): each re-queues
    # its own on a resume. And the keys of the logs this checkpoint has trained on or
    # dropped that are still in the token WAL (let go at the next save), the logs their
    # groups replayed with them: a resume from it deletes them first (their tasks came
    # round again: replayed, they were trained twice).
    done_now = scheduler.drain_finished()
    mine = {"pending": pending, "next": scheduler.next_index,
            "consumed": [] if wal is None else [
                k for g in [*wal_done_with, *done_now]
                for k in [wal.key(g), *sorted(replayed_from.get(g, ()))]]}
    got = await agree("save", **mine) if multi else [mine]
    by_process, next_group = [g["pending"] for g in got], max(g["next"] for g in got)
    # (off the event loop, which serves the rollouts: a second a save for a 135M model
    # on this CPU; every process together, as the save)
    prints = await loop.run_in_executor(run_pool, state_prints, state, step)
    ckpt.save(step, state, {**meta, "wall_time_s": round(time.time() - t_start, 3),
                            "pending_tasks": pending, "pending_tasks_by_process": by_process,
                            "next_group": next_group,
                            "wal_consumed_by_process": [g["consumed"] for g in got],
                            "stop_window_recent": recent,
                            "canary": canary_now}, tasks, force=force, prints=prints)
    if wal is not None:
      # Groups this checkpoint no longer lists need no replay once it is written: those
      # of the checkpoint before are let go now (a save waits for the one before it to
      # finish), this one's at the next save or at the end. Let go when the save began,
      # a crash before it was finalised resumed from the one before without their logs.
      def let_go(groups: list, whole: bool) -> None:
        for group_id in groups:
          wal.discard_group(group_id)
        if whole:  # a checkpoint of this run is whole: the set-aside logs are needless
          wal.drop_aside()

      try:  # (this process's own files: an error is told at the next agreement)
        # (off the event loop: removing files took 1.0 s on a loaded machine, and the
        # loop watch named the run's own code to a new user)
        await loop.run_in_executor(run_pool, let_go, list(wal_done_with), bool(saves_begun))
        for group_id in wal_done_with:
          replayed_from.pop(group_id, None)
      except Exception as e:
        hold(e)
      wal_done_with[:] = done_now
    saves_begun.append(step)

  n_proc = jax.process_count()
  rows_here, row_multiple = cfg.data.rows // n_proc, learner.row_multiple // n_proc

  def pack(accepted, shares):
    """This process's groups packed into its share of the rows (in a worker thread). A
    step-wide advantage baseline spans every process's episodes: `shares`, what each
    process's episodes add to it (`baseline_share`, told at the rollouts' agreement;
    None alone)."""
    gather = None if shares is None else (lambda value: (shares, jax.process_index()))
    return pack_groups(accepted, cfg.advantage, rows_here, cfg.data.seq_len,
                       tokenizer.pad_id, row_multiple, with_ref="ref_logp" in scorers,
                       gather=gather)

  step = first_step = int(state.step)
  recorded = step  # the last step whose metrics row and trajectories are written
  records = None  # what the latest step's records need (`write_records`)

  async def write_records(p: dict) -> None:
    """The step's trajectory segments and its metrics row (completed here)."""
    nonlocal recorded
    info, traj = p["info"], cfg.trajectories
    # Written again after a failure from the part that failed (a retry appended the
    # step's segments a second time; red team 21); a write cut by a second signal goes
    # on in its thread, and the retry awaits it rather than writing beside it.
    if "segments" not in p and (traj.mode == "all" or (
        traj.mode == "sample" and p["step"] % traj.sample_every == 0)):
      job = p.get("segments_job") or loop.run_in_executor(
          run_pool, dump_segments, trajectories_file(run_dir, cfg), info["used_segments"],
          p["step"], tokenizer.decode if traj.text else None)
      p["segments_job"] = job
      try:
        await asyncio.shield(job)
      except asyncio.CancelledError:
        raise
      except BaseException:  # (failed, and cut off the file: a retry writes it whole)
        p.pop("segments_job", None)
        raise
    p["segments"] = True
    complete_row(p, time.time() - t_start, n_proc, scheduler, loop_watch.held_s)
    if writer is not None:
      writer.write(p["row"])
    recorded = p["step"]
  # The last stop_window steps' (successes, episodes), for the early stop; a resumed run
  # goes on with its checkpoint's (a run that had stopped there stops again at once).
  recent = [tuple(x) for x in saved_recent][-cfg.stop_window:]

  def stop_reached() -> Optional[float]:
    """The window's success rate when it reached `stop_success_rate` (else None)."""
    rate = sum(s for s, _ in recent) / max(sum(n for _, n in recent), 1)
    return rate if (cfg.stop_success_rate and len(recent) == cfg.stop_window
                    and rate >= cfg.stop_success_rate) else None

  bar = tqdm(total=cfg.steps, initial=step, desc="train", dynamic_ncols=True,
             disable=not primary or (not sys.stdout.isatty()
                                     and not os.environ.get("JAXAGENT_PROGRESS")))
  t_rollout_mark = time.perf_counter()
  played: list = []  # every group consumed since the last step, trained on or not
  no_step_note_at, dropped_at_step = NO_STEP_NOTE_S, collections.Counter(scheduler.dropped)
  finished = False  # the loop ended by itself (not by an exception)
  signals = StopSignals(run_dir).install(loop)  # (SIGTERM, Ctrl-C)
  abandoned = False  # a stop gave up a wait for rollouts
  lost: Optional[PeerLost] = None  # another process of the run is gone
  peer_failed: Optional[PeerFailed] = None  # another's error, told at the end
  own_failure: Optional[BaseException] = None  # this one's, told at the end
  nonfinite = False  # stopped by a step whose update was not finite
  overflow_said = False  # a batch that left groups out was said

  early_stop = stop_reached()
  # Names an environment's async code that holds the loop every episode moves on, and
  # charges a hold to the episode that held it (started before the episodes: their
  # tasks are told apart from the run's own).
  loop_watch = LoopWatch().start()
  try:
    scheduler.start()
    while step < cfg.steps and early_stop is None:
      if multi:  # a signal to any process stops every one here, between two steps (one
        # stopping alone left the others waiting in the step's collectives)
        got = await agree("step", stop=signals.got)
        names = [g["stop"] for g in got if g["stop"]]
        if names:  # (its own signal's name if it had one: a process exits by its own)
          signals.got = signals.got or names[0]
          break
      elif signals.got is not None:
        break
      accepted: list = []  # (the step's groups: given back if it fails before its update,
      # saved with the checkpoint as tasks in flight; they were lost: neither trained
      # nor played again)
      try:
        if multi:  # (every process goes into the step's collectives)
          share = None  # (this process's part of a step-wide baseline)
          try:  # (the episodes' own errors: told to the others before the collectives)
            accepted, taken = await scheduler.next_groups()
            played += taken
            scored = (await score_segments(serving.client, accepted, scorers,
                                           learner_cfg.temperature) if scorers else {})
            share = baseline_share(accepted, cfg.advantage)
          except Exception as e:
            hold(e)
          shares = [g["share"] for g in await agree("rollouts", share=share)]
        else:  # a stop while the step's rollouts run: no step is under way, none waited for
          got = await unless_stopped(scheduler.next_groups(), signals.stopping)
          if got is None:
            abandoned = True
            print(f"{signals.got}: no step was under way (the episodes in flight are "
                  "played again on a resume)", file=sys.stderr, flush=True)
            break
          accepted, taken = got
          played += taken
          scored = (await score_segments(serving.client, accepted, scorers,
                                         learner_cfg.temperature) if scorers else {})
        rollout_s = time.perf_counter() - t_rollout_mark
        t0 = time.perf_counter()
        # Batching, the step and reading its metrics run off the event loop, which keeps
        # serving episodes' turns and environment steps meanwhile (asynchrony).
        if multi:  # the processes agree on the rows (and on skipping a step nobody has
          # data for); this one's error packing its groups is told there, before the
          # step's collectives (raised at once, it went to its final save while the
          # others were in them: all hung until the coordination service's abort)
          packed = None
          try:
            packed = await loop.run_in_executor(run_pool, pack, accepted, shares)
          except Exception as e:
            hold(e)
          got = await agree("batch", **({"rows": 0, "segments": 0} if packed is None else {
              "rows": packed[1]["rows"], "segments": packed[1]["segments"]}))
          used_rows, segments = max(g["rows"] for g in got), sum(g["segments"] for g in got)
        else:
          packed = await loop.run_in_executor(run_pool, pack, accepted, None)
          used_rows, segments = packed[1]["rows"], packed[1]["segments"]
        batch, info = trim_batch(*packed, used_rows, rows_here, row_multiple)
        m = None
        if segments:
          state, m = await loop.run_in_executor(run_pool, learn, learner, state, batch,
                                                ref_params)
      except BaseException:
        scheduler.put_back(accepted)
        raise
      if m is None:
        scheduler.trained_nothing(accepted)  # (replaced: else the async modes stalled)
        # Nothing to learn from (all filtered or too long): sample again; the next step's
        # metrics count these episodes and their time too. A run whose every episode so
        # far began with a prompt too long for its settings stops saying so; else the
        # wait is said every NO_STEP_NOTE_S while it lasts (such runs spun without a word).
        episodes = [e for g in played for e in g.episodes]
        unfit = [e for e in episodes if e.reason == FIRST_PROMPT_TOO_LONG]
        if (step == first_step and unfit and len(unfit) == len(episodes)
            and len(played) >= 2):  # (this process's episodes: told at the next agreement)
          hold(config_lib.ConfigError(f"{unfit[0].unfit} (every episode this run played "
                                      "began so: nothing to train on)"))
        waited = time.perf_counter() - t_rollout_mark
        if primary and waited >= no_step_note_at:
          no_step_note_at = waited + NO_STEP_NOTE_S
          print(no_step_warning(waited, played, scheduler.dropped - dropped_at_step, info),
                file=sys.stderr, flush=True)
        continue
      if info.get("overflow_groups") and not overflow_said:  # (once a run: the metric counts)
        overflow_said = True
        print(f"warning: step {step + 1}'s batch did not hold {info['overflow_groups']} of "
              "its groups (left out whole, untrained): data.rows x data.seq_len is less "
              "than the step's episodes take; raise data.rows (metrics batch_overflow*)",
              file=sys.stderr, flush=True)
      no_step_note_at, dropped_at_step = NO_STEP_NOTE_S, collections.Counter(scheduler.dropped)
      row = {"step": step + 1, **episode_metrics(
                 played, accepted, version, lambda g: carries_signal(g, cfg.advantage)),
             **token_staleness_metrics(batch.versions, batch.loss_mask, version), **scored}
      if wal is not None:
        row["wal_replayed_turns"] = sum(e.replayed_turns for g in played for e in g.episodes)
      # What the batch held: the episodes trained are those it packed (a group left out
      # for want of rows was counted as trained).
      row.update(episodes_trained=info["episodes"],
                 batch_segments=info["segments"], batch_overflow=info["overflow"],
                 batch_overflow_groups=info.get("overflow_groups", 0),
                 batch_too_long=info["too_long"])
      if multi:  # the episode counts and success of every process, not only this one's
        row.update(distributed.sum_episode_counts(row))
      played = []
      learner_s = time.perf_counter() - t0
      step = int(state.step)
      version = int(state.policy_version)
      scheduler.trained(accepted)
      # What the step's records need: written after the weight sync (with its figures),
      # or on the way out if the run stops before (a step is never checkpointed without
      # its records).
      records = dict(row=row, info=info, batch=batch, m=m,
                     rollout_s=rollout_s, learner_s=learner_s, step=step, version=version)
      sync_s, sync_path = 0.0, None
      if step % cfg.rollout.sync_every == 0 or step == cfg.steps:
        t0 = time.perf_counter()
        if serving.orch is not None:  # in-process: hand the weights over in memory
          weights, sync_path = serving.engine_copy(state.params)
          try:  # (this process's own engine: an error is told at the next agreement)
            await serving.client.load_weights(weights, version, cfg.rollout.update_mode)
          except Exception as e:
            hold(e)
        else:  # servers load the export
          path = await loop.run_in_executor(run_pool, exports.write, version, state.params)
          if primary:  # the servers are shared by every process: one update is enough
            try:
              await serving.client.update_weights(path, version, cfg.rollout.update_mode)
            except Exception as e:
              hold(e)
          if multi:  # no process samples on for the new version before the servers have it
            await agree(f"policy-{version}")
          exports.served(version, primary)  # (the servers have moved on)
          sync_path = "export"
        scheduler.set_served(version)
        sync_s = time.perf_counter() - t0
      # The learner's version, after the sync: groups it drops as stale are replaced on
      # the new weights (before it, during the sync, on the old: a reviewer).
      scheduler.set_version(version)
      if exports.kept(version) and exports.exported != version:  # (not written for the sync)
        if multi:  # (its writes are collectives: an error held since is told first)
          await agree(f"export-{version}")
        await loop.run_in_executor(run_pool, exports.write, version, state.params)
      t_rollout_mark = time.perf_counter()
      row.update({"weight_sync_s": sync_s,
                  **({"weight_sync_path": sync_path} if sync_path else {})})
      recent = (recent + [(row.get("success_rate", 0.0) * row["episodes"],
                           row["episodes"])])[-cfg.stop_window:]
      try:  # (this process's own work: an error is told at the next agreement)
        if cfg.eval.every and step % cfg.eval.every == 0 and primary:
          row.update(await evaluate_policy(cfg, env_factory, serving, tokenizer),
                     eval_policy_version=scheduler.served)
        await write_records(records)
        bar.update(1)
        bar.set_postfix(success=f"{row.get('success_rate', 0):.2f}",
                        reward=f"{row.get('reward_mean', 0):.2f}",
                        tok_s=f"{row['rollout_tokens_per_s']:.0f}",
                        lag=f"{row.get('policy_lag_mean', 0):.1f}")
        if bar.disable and primary:  # no terminal: one line per step instead of a bar
          print(f"step {step}: success {row.get('success_rate', 0):.3f} reward "
                f"{row.get('reward_mean', 0):.3f} loss {m['loss']:.4f} rollout "
                f"{rollout_s:.1f}s learner {learner_s:.1f}s sync {sync_s:.2f}s wall "
                f"{row['wall_time_s']:.0f}s", flush=True)
        ckpt.check()  # (a save under way that failed stops the run here, not at the next)
      except Exception as e:
        hold(e)
      if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0:
        await save_checkpoint(step, state, scheduler.pending_tasks())
      early_stop = stop_reached()
    if early_stop is not None:
      print(f"success rate {early_stop:.3f} over the last {cfg.stop_window} steps' "
            f"episodes reached {cfg.stop_success_rate}: stopping" + (
                " (met when the run was resumed)" if step == first_step else ""), flush=True)
    finished = True
  except Exception as e:
    if multi and distributed.peer_gone(e):  # (not saved, nor exported: both need them all)
      lost = PeerLost(f"another process of the run is gone ({str(e).splitlines()[0][:200]})")
      raise lost from e
    lost = e if isinstance(e, PeerLost) else None
    nonfinite = isinstance(e, NonFiniteUpdate)
    raise
  finally:
    loop_watch.stop()
    bar.close()
    if records is not None and recorded != records["step"]:  # stopped before its records
      try:
        await write_records(records)
      except Exception as e:  # (then it is not checkpointed: a resume replays the step)
        print(f"warning: step {records['step']}'s records could not be written "
              f"({type(e).__name__}: {e})", file=sys.stderr, flush=True)
    pending = scheduler.pending_tasks()
    await scheduler.stop()
    # Saved only with its records: a checkpoint of a step whose metrics row and
    # trajectories were not written would resume past them, losing them for good. Nor
    # when the step under way holds the state (stopped at once in the learner's step).
    unsaved = ("another process of the run is gone" if lost is not None else
               f"step {step}'s records were not written" if step != recorded else
               "the step's update was not finite" if nonfinite
               else "the step under way holds the state" if _deleted(state) else None)
    failed = ckpt.failed is not None
    if multi and lost is None:  # the final save and export are collectives: all or none
      if signals.now:  # (stopped at once: alone, with no collective)
        unsaved = "stopped at once, apart from the run's other processes"
      else:
        try:
          got, peer_failed = await agreements.gather("end", unsaved=unsaved, failed=failed)
          if held:  # (told; raised past the final save, which all make together)
            own_failure = held.pop()
        except Exception as e:
          if not (isinstance(e, PeerLost) or distributed.peer_gone(e)):
            raise
          lost = e if isinstance(e, PeerLost) else PeerLost(str(e).splitlines()[0][:200])
          unsaved = "another process of the run is gone"
        else:
          unsaved = unsaved or next((f"process {i}: {g['unsaved']}" for i, g in
                                     enumerate(got) if g["unsaved"]), None)
          failed = any(g["failed"] for g in got)
    if unsaved and ckpt.latest_step() != step and step > 0:
      print(f"{unsaved}: not checkpointed (a resume goes on from step "
            f"{ckpt.latest_step() or 0})", file=sys.stderr, flush=True)
    elif ckpt.latest_step() != step and step > 0 and not failed:
      # (no canary when a stop gave up waiting for rollouts: its episodes may hang too)
      try:
        await save_checkpoint(step, state, pending, force=True,
                              canary=finished and not abandoned)
      except CheckpointFailed:  # (ckpt.failed: raised below)
        pass
      except NonFiniteUpdate as e:  # (raised below, once the rest is closed)
        own_failure, unsaved, nonfinite = own_failure or e, "not finite", True
    if exports.exported != version and step > 0 and not unsaved:  # the final weights
      try:
        exports.write(version, state.params)
      except Exception as e:  # (the checkpoint has them; a resume exports them again)
        print(f"warning: policy version {version} could not be exported "
              f"({type(e).__name__}: {e})", file=sys.stderr, flush=True)
    if lost is None:  # (a save under way waits on every process: it cannot end now)
      with contextlib.suppress(CheckpointFailed):  # (ckpt.failed: raised below)
        ckpt.close()  # (waits for the last save)
    # (a failed save needs the logs; and a run that lost a process resumes from them)
    if wal is not None and ckpt.failed is None and lost is None:
      for group_id in wal_done_with:
        wal.discard_group(group_id)
      if saves_begun:
        wal.drop_aside()
    if writer is not None:
      writer.close()
    await serving.close()
    close_envs()
    # (held until here: a second signal during the final save stops at once, saying so,
    # instead of the default action killing the process in the middle of it)
    signals.remove(loop)
    run_pool.shutdown(wait=False)  # (its idle threads end; one in a collective is left behind)
  if lost is not None:  # (found at the end: out of step)
    raise lost
  if own_failure is not None:  # (met in the last step's own work, told at the end)
    raise own_failure
  if peer_failed is not None:
    raise peer_failed
  if ckpt.failed is not None:  # (one that the run went on past, or the last one)
    raise ckpt.failed
  stopped = signals.got is not None and step < cfg.steps and early_stop is None
  png = plot_learning_curve(run_dir, cfg.name) if primary else None  # (stopped too)
  if stopped and primary:  # (not finished: a scheduler that restarts the run resumes it)
    print(f"stopped at step {step} of {cfg.steps} ({signals.got}); to go on: "
          f"{resume_command(run_dir)}" + (f"; learning curve so far: {png}" if png else ""),
          file=sys.stderr, flush=True)
  if stopped:
    return 128 + getattr(signal, signals.got).value
  if not primary:
    return 0
  print(f"done: {step} steps in {time.time() - t_start:.0f}s; learning curve: {png}")
  return 0


def main(argv=None) -> int:
  args = parse_args(argv)
  problem = control.env_problem()
  if problem:
    print(f"error: {problem}", file=sys.stderr)
    return 2
  if args.auto_resume:
    if not args.run_dir:
      print("error: --auto-resume needs --run-dir", file=sys.stderr)
      return 2
    args.resume = started_a_run(args.run_dir)  # (one stopped before its first step too)
  if args.resume and not args.run_dir:
    print("error: --resume needs --run-dir", file=sys.stderr)
    return 2
  if args.resume and not started_a_run(args.run_dir):
    print(f"error: --resume: {args.run_dir} holds no run (no config.json, no checkpoint, no "
          "step recorded: nothing to resume; drop --resume to start the run)", file=sys.stderr)
    return 2
  try:
    notes: list[str] = []  # (a resume's changes: said once its checkpoint is restored)
    header = ""
    if args.print_config and args.config is None and not args.resume:
      # Every key at its default (with the overrides given): what a config may set, before
      # one is written (it said only that --config is required, or data.tasks for a file
      # of one key: a new user).
      cfg = config_lib.load(config_lib.RunConfig, None, args.overrides)
      header = ("# every key of a run config at its default (python -m jaxagent.train "
                "--print-config);\n# data.tasks, a JSONL task file, has none: a run needs it\n")
    else:
      if args.config is None and not args.resume:
        raise config_lib.ConfigError("--config is required (a YAML run config, see configs/; "
                                     "with --resume --run-dir, the run's own config.json; "
                                     "--print-config alone prints every key's default)")
      if args.resume and args.config is None:
        args.config = os.path.join(args.run_dir, "config.json")
        if not os.path.exists(args.config):
          raise config_lib.ConfigError(f"--resume: no {args.config}: give --config")
      cfg = config_lib.load(config_lib.RunConfig, args.config, args.overrides)
      check_config(cfg)  # (before --print-config prints: a config the run refuses printed
      # whole to stdout before its error, ready to be saved as a file: a new user)
      given = cfg
      if args.resume:
        cfg = resumed_config(cfg, args.run_dir, notes)
    if args.print_config:
      import yaml

      for line in notes:
        print(line, file=sys.stderr)
      print(header + yaml.safe_dump(config_lib.to_dict(cfg), sort_keys=False), end="")
      return 0
  except config_lib.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.canary and not args.resume:
    print("error: --canary checks a resumed run: it needs --resume", file=sys.stderr)
    return 2
  if args.canary and not cfg.checkpoint.canary_tasks:  # (a gate that checks nothing)
    print("error: --canary: checkpoint.canary_tasks is 0, so the run saves no canary to "
          "check", file=sys.stderr)
    return 2
  try:
    multi = distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                                   args.heartbeat_timeout)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if multi and not args.run_dir:
    print("error: a multi-process run needs --run-dir (the same for every process)",
          file=sys.stderr)
    return 2
  if multi:  # (the line said train's own command alone, which a 2-process checkpoint
    # refuses: a new user's finding)
    n = jax.process_count()
    flags = (f" --coordinator {args.coordinator} --num-processes {n} --process-id I"
             if args.coordinator else "") + (
        f" --heartbeat-timeout {args.heartbeat_timeout}"
        if args.heartbeat_timeout != distributed.HEARTBEAT_TIMEOUT_S else "")
    resume_on(flags, f", on each of the {n} processes" + (
        f" (I: its own, 0..{n - 1}, as before)" if args.coordinator else
        " (with the settings they were started with)"))
  run_dir = args.run_dir or os.path.join("runs", f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
  if not args.resume and holds_a_run(run_dir):
    try:  # (a run going on there is said as such)
      lock_run_dir(run_dir).close()
    except RunDirInUse as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    except OSError:  # (a directory it cannot write: its records say enough)
      pass
    print(f"error: {run_dir} already holds a run (its metrics, checkpoints, trajectories "
          "or policy exports): --resume to go on with it, or another --run-dir",
          file=sys.stderr)
    return 2
  made = not os.path.isdir(run_dir)
  try:
    os.makedirs(run_dir, exist_ok=True)
    if not os.access(run_dir, os.W_OK | os.X_OK):
      raise PermissionError(13, "not writable")
  except OSError as e:  # (a file there, a read-only or missing place: was a traceback)
    print(f"error: --run-dir {run_dir}: cannot write the run there "
          f"({e.strerror or e})", file=sys.stderr)
    return 2
  try:
    lock = lock_run_dir(run_dir)  # (held until this process ends)
  except RunDirInUse as e:  # (a resume's changes unsaid: none is applied)
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.resume:  # (again, the directory now this run's: the trainer before may have
    # saved its first checkpoint, whose schedule is kept, since it was read above)
    notes.clear()
    try:
      cfg = resumed_config(given, run_dir, notes)
    except config_lib.ConfigError as e:  # (its config.json replaced meanwhile)
      print(f"error: {e}", file=sys.stderr)
      return 2
  try:
    try:
      return asyncio.run(train(cfg, run_dir, args.resume, args.canary,
                               notes if distributed.is_primary() else ()))
    except KeyboardInterrupt as e:  # a second Ctrl-C or SIGTERM, or a Ctrl-C before the handlers
      print(f"interrupted: stopped at once; {go_on_hint(run_dir)}", file=sys.stderr,
            flush=True)
      code = 128 + getattr(e, "signum", int(signal.SIGINT))
      if multi:  # (past jax.distributed's shutdown barrier, as for PeerLost: the others
        sys.stdout.flush()  # may be in a collective that waits for this one)
        os._exit(code)
      return code
    except config_lib.ConfigError as e:  # found while building (e.g. the chat template)
      print(f"error: {e}", file=sys.stderr)
      return exit_code(e)
    except (CheckpointUnreadable, RecordsDamaged) as e:
      print(f"error: --resume: {e}", file=sys.stderr)
      return exit_code(e)
    except RunWriteFailed as e:  # a checkpoint, the WAL (the infrastructure's: the JobSet
      # restarts it)
      print(f"error: {e} (then: {resume_command(run_dir)})", file=sys.stderr, flush=True)
      sys.unraisablehook = lambda _: None  # Orbax's abandoned writes, as Python exits
      return exit_code(e)
    except OSError as e:
      if not disk_hint(e):
        raise
      # The run's other records (metrics, trajectories, TensorBoard) on a full disk.
      print(f"error: {e.filename or run_dir} could not be written ({e.strerror or e})"
            f"{disk_hint(e)} (then: {resume_command(run_dir)})", file=sys.stderr, flush=True)
      return exit_code(e)
    except TaskError as e:
      check = shlex.join(["python", "-m", "envs.filter",
                          *[a for m in cfg.env.imports for a in ("--import", m)],
                          cfg.data.tasks])
      print(f"error: data.tasks: {e} ({check} checks a task file)", file=sys.stderr)
      return exit_code(e)
    except PeerLost as e:
      if e.__cause__ is not None:  # (what failed here, for the log; the line says what to do)
        traceback.print_exception(e.__cause__, file=sys.stderr)
      print(f"error: {e}: this process stops too (then: {resume_command(run_dir)})",
            file=sys.stderr, flush=True)
      sys.stdout.flush()
      # Not Python's exit: jax.distributed's shutdown waits for every process at a
      # barrier, which a gone one never reaches (the heartbeat's timeout, then an abort)
      os._exit(exit_code(e))
    except NonFiniteUpdate as e:
      saved = has_checkpoint(run_dir)
      print(f"error: {e}; " + ("a resume goes on from the last checkpoint" if saved else
                               "no checkpoint was saved: the run starts again"),
            file=sys.stderr, flush=True)
      return exit_code(e)
    except PeerFailed as e:  # (all processes saved together; the other's log has why)
      print(f"error: {e}: this process stopped with it (then: {resume_command(run_dir)})",
            file=sys.stderr, flush=True)
      return exit_code(e)
    except (InfraOutage, InfraError) as e:
      # Episodes mostly dropped (the checkpoint, with the tasks not trained on, was saved),
      # or a server or worker that could not be reached (at the start, a weight update).
      saved = has_checkpoint(run_dir)
      # (the run's config.json holds its file and overrides: a resumed run's own command
      # had no --config, and this said "--config None")
      again = resume_command(run_dir)
      if args.resume and not os.environ.get(RESUME_COMMAND) and (
          cfg.serving.urls or cfg.env.urls):  # (services a launch started: gone with it)
        again += (" with those services up, or in process: add serving.urls=[] "
                  "env.urls=[]")
      what = "" if isinstance(e, InfraOutage) else "the infrastructure failed: "
      print(f"error: {what}{e}" + (f" (then: {again})" if saved else ""), file=sys.stderr)
      return exit_code(e)
  finally:
    # (a start that failed leaves no empty run directory behind)
    if made and not multi and os.path.isdir(run_dir) and os.listdir(run_dir) == [".lock"]:
      os.remove(os.path.join(run_dir, ".lock"))
      lock.close()
      os.rmdir(run_dir)


if __name__ == "__main__":
  try:
    exit_with = main()
  except SystemExit as e:
    exit_with = e.code if isinstance(e.code, int) else 1
  except BaseException:  # (a bug's traceback, then the same end: a stuck call is left)
    traceback.print_exc()
    exit_with = 1
  leave_stuck_threads(exit_with if isinstance(exit_with, int) else 1)
  sys.exit(exit_with)

"""One training run (`jaxagent.train`'s loop): its parts restored or built, then step
after step the rollouts, the update, the weight sync, the records and the saves, and at
its end the final save and the run's outcome, with every process of a multi-process
run in step (`jaxagent.agreements`)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import signal
import sys
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from tqdm import tqdm

from envs.base import TaskSpec
from jaxagent import config as config_lib, distributed
from jaxagent.agreements import Agreements
from jaxagent.agent import FIRST_PROMPT_TOO_LONG, Episode, run_whitebox
from jaxagent.blackbox import is_blackbox, run_blackbox
from jaxagent.build import build_model, describe
from jaxagent.checkpoint import (CheckpointFailed, CheckpointUnreadable, IteratorAt,
                                 PolicyExports, RunCheckpointer, quiet_failed_save_noise,
                                 state_prints)
from jaxagent.data import TASK_ORDER, task_dataset, tasks_digest
from jaxagent.errors import (InfraError, NonFiniteUpdate, PeerFailed, PeerLost, RunWriteFailed,
                             disk_hint)
from jaxagent.learner import Learner, loss_notes
from jaxagent.metrics import (MetricsWriter, RecordsDamaged, episode_metrics,
                              plot_learning_curve, sync_file, token_staleness_metrics)
from jaxagent.models.hf import declares_positions
from jaxagent.pools import CountedPool
from jaxagent.resume import open_wal, past_logged_groups, restore, write_run_config
from jaxagent.run_checks import check_lengths, ignored_temperature, served_scorers
from jaxagent.run_dir import compare_canary, dependency_versions, play_canary, trajectories_file
from jaxagent.run_services import (Serving, attach_judge, check_task_params, env_workers_ready,
                                   first_tasks, make_env_factory, run_meshes, score_segments,
                                   task_tools)
from jaxagent.scheduler import (DROP_REASONS, RolloutScheduler, baseline_share, episode_index,
                                no_step_warning, pack_groups, rollout_notes, step_signal,
                                trim_batch)
from jaxagent.stopping import StopSignals, resume_command, unless_stopped
from jaxagent.trajectory import dump_segments
from jaxagent.wal import TokenWAL, take_replay


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


def eval_line(figures: dict, step: int, version: int) -> str:
  """An evaluation's figures (`evaluate_policy`'s) in one line."""
  def said(v) -> str:
    return "n/a" if v is None else f"{v:.3f}"

  passes = " ".join(f"{k[len('eval_'):]} {said(v)}" for k, v in figures.items()
                    if k.startswith("eval_pass@") and not k.endswith("_tasks"))
  infra = figures.get("eval_infra_errors", 0)
  return (f"eval at step {step} (policy v{version}): success "
          f"{said(figures.get('eval_success_rate'))}" + (f" {passes}" if passes else "")
          + f" over {figures.get('eval_episodes', 0)} episodes of "
          f"{figures.get('eval_tasks', 0)} tasks"
          + (f" ({infra} failed by the infrastructure, left out)" if infra else ""))


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


def complete_row(p: dict, wall_time_s: float, n_proc: int, totals: dict,
                 loop_held_s: float) -> dict:
  """A step's metrics row (`p["row"]`, completed in place and returned) from what its
  records hold (`p`: the step's batch, its packing's `info`, its metrics `m`, its
  rollout and learner seconds, the policy version it made) and the run's totals so far
  (`TrainingRun.totals`: retries, replaced groups and drops; the loop's held seconds)."""
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
      "retries": totals["retries"], "groups_replaced": totals["groups_replaced"],
      "loop_held_s": round(loop_held_s, 3),
      # (every reason in every row, 0 until one is dropped: a column read over the
      # rows has no gaps; infra_<kind> from the first of its kind)
      **{f"dropped_{k}": totals["dropped"].get(k, 0) for k in DROP_REASONS},
      **{f"dropped_{k}": v for k, v in totals["dropped"].items()},
      **{k: v for k, v in p["m"].items() if k != "denom"}})
  return row


def add_totals(a: dict, b: dict) -> dict:
  """Two processes' `TrainingRun.totals` together (`loop_held_s` is `a`'s own)."""
  dropped = collections.Counter(a.get("dropped") or {})
  dropped.update(b.get("dropped") or {})
  return {**a, "retries": a.get("retries", 0) + b.get("retries", 0),
          "groups_replaced": a.get("groups_replaced", 0) + b.get("groups_replaced", 0),
          "dropped": dict(dropped)}


def _deleted(state) -> bool:
  """Whether `state`'s arrays were given away (donated to a train step under way)."""
  return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(state))


# A run that plays groups but keeps none says so this often (seconds without a step).
NO_STEP_NOTE_S = 60.0


def check_process_rows(cfg: config_lib.RunConfig, mesh, n_proc: int) -> None:
  """Each of `n_proc` processes packs its own share of a step's rows and feeds them to
  its own devices (`distributed.process_rows`): `data.rows` must split evenly between
  them, and so must the learner mesh's batch shards (the devices along `tensor` for one
  (data, fsdp) place), each on one process's devices. (`data.rows` below the process
  count left each 0 rows, and the first step died on an assertion; a tensor axis across
  processes put two processes' different rows in one shard, and each trained on a batch
  of half the rows, none the same, without a word; a reviewer.)"""
  if n_proc == 1:
    return
  if cfg.data.rows % n_proc:
    raise config_lib.ConfigError(
        f"data.rows ({cfg.data.rows}) must be a multiple of the run's {n_proc} processes "
        "(each packs its share of a step's rows)")
  import numpy as np

  owner = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)
  shards = np.moveaxis(owner, list(mesh.axis_names).index("tensor"), -1).reshape(
      -1, mesh.shape["tensor"])
  m = cfg.mesh
  if (shards != shards[:, :1]).any():
    raise config_lib.ConfigError(
        f"mesh.tensor ({mesh.shape['tensor']}) spans devices of several processes: a batch "
        "shard's devices must be one process's (each feeds its own rows); make mesh.tensor "
        "divide the devices of one process")
  per_process = np.bincount(shards[:, 0], minlength=n_proc)
  if len(set(per_process.tolist())) > 1:
    raise config_lib.ConfigError(
        f"the learner's batch shards (mesh.data {m.data} x mesh.fsdp {m.fsdp}) fall "
        f"{per_process.tolist()} on the run's {n_proc} processes: each must hold as many "
        "(each feeds its own share of the rows)")


class TrainingRun:
  """One training run: its parts (`open`: the model, the learner and its state restored,
  the servers, the environments, the scheduler, the checkpoints, the token WAL) and the
  loop's state from step to step (`go`: rollouts, the update, the weight sync, the
  records and the saves; at the end, the final save and the run's outcome)."""

  def __init__(self, cfg: config_lib.RunConfig, run_dir: str):
    self.cfg, self.run_dir = cfg, run_dir
    self.t_start = time.time()
    self.loop = asyncio.get_running_loop()
    # The run's own work (the learner step, packing, agreements, saves, exports, records)
    # on threads of its own: environments' calls (asyncio.to_thread: sandboxes, files,
    # plugins) take the loop's default executor, and eight episodes blocked in it held
    # every thread, so a stop's checkpoint waited behind them for ever (a learner step
    # queued behind slow sandbox calls). Those threads are not waited for at the end.
    self.run_pool = CountedPool(2, "jaxagent-run")
    self.loop.set_default_executor(CountedPool(
        min(32, (os.cpu_count() or 1) + 4), "jaxagent-env", wait_at_close=False))
    self.multi = jax.process_count() > 1
    self.n_proc = jax.process_count()
    self.primary = distributed.is_primary()
    # With several processes an error of this one's own work is held (`agreements.hold`)
    # until the next agreement, where every process learns of it (jaxagent/agreements.py).
    self.agreements = Agreements(self.run_pool)
    self.hold, self.agree = self.agreements.hold, self.agreements.agree
    self.wal_done_with: list[str] = []  # groups whose logs the save under way makes needless
    self.saves_begun: list[int] = []  # this run's checkpoint saves
    self.replayed_from: dict[str, set] = {}  # a group's id: the keys of the logs it replayed
    self.records: Optional[dict] = None  # what the latest step's records need
    self.played: list = []  # every group consumed since the last step, trained on or not
    self.finished = False  # the loop ended by itself (not by an exception)
    self.abandoned = False  # a stop gave up a wait for rollouts
    self.lost: Optional[PeerLost] = None  # another process of the run is gone
    self.peer_failed: Optional[PeerFailed] = None  # another's error, told at the end
    self.own_failure: Optional[BaseException] = None  # this one's, told at the end
    self.nonfinite = False  # stopped by a step whose update was not finite
    self.counted_before: dict = {}  # the resumed checkpoint's totals (`totals`)
    self.others_totals: dict = {}  # the other processes' totals (their rows are process 0's)
    self.overflow_said = False  # a batch that left groups out was said

  async def open(self, resume: bool, canary: bool, notes: Sequence[str]) -> None:
    """Builds the run's parts, restores its checkpoint (with `resume`), starts its
    servers from the learner's weights and, with `canary`, replays the checkpoint's
    canary episodes; then says the resume's `notes` and writes the run's config."""
    from envs.sandbox import IsolationUnavailable

    cfg, run_dir = self.cfg, self.run_dir
    self.mesh, serving_mesh = run_meshes(cfg.mesh, cfg.serving.devices)
    check_process_rows(cfg, self.mesh, self.n_proc)  # (before the model is built)
    await env_workers_ready(cfg, lambda m: print(m, flush=True) if self.primary else None)
    env_factory, close_envs = make_env_factory(cfg)
    self.env_factory, self.close_envs = env_factory, close_envs
    try:  # the chat template must render the tools the tasks offer
      try:
        first = first_tasks(cfg.data.tasks)
        tools = await task_tools(cfg.data.tasks, env_factory, first)
        if not cfg.env.urls:  # (workers' environments are reset there, when played)
          note = await check_task_params(cfg.data.tasks, list(first.values()))
          if note is not None and self.primary:
            print(f"note: {note}", file=sys.stderr)
      except ValueError as e:  # a bad line, an unknown environment, no tasks
        raise config_lib.ConfigError(f"data.tasks: {e}") from None
      model_cfg, params, tokenizer = build_model(cfg.model, self.mesh, tools=tools)
      if cfg.model.checkpoint is not None and declares_positions(cfg.model.checkpoint):
        check_lengths(cfg, checkpoint_positions=model_cfg.max_seq_len)
    except IsolationUnavailable as e:  # the tasks run code and this host cannot isolate it
      close_envs()
      raise config_lib.ConfigError(f"env.allow_unisolated: {e}") from None
    except BaseException:
      close_envs()
      raise
    self.tokenizer = tokenizer
    pool = getattr(getattr(env_factory, "resources", None), "_pool", None)
    if pool is not None:  # say how untrusted tool code is isolated here, at the start
      print(f"sandbox: isolation {pool.isolation}, {pool.size} commands at once")
    print(f"model: {describe(model_cfg)}")
    print(f"mesh: {dict(self.mesh.shape)} on {jax.devices()[0].platform}; run dir: {run_dir}")
    # Score tokens under the distribution they were sampled from (temperature included).
    self.learner_cfg = dataclasses.replace(
        cfg.learner, temperature=max(cfg.agent.temperature, 1e-6),
        lr_decay_steps=cfg.learner.lr_decay_steps or cfg.steps)
    self.learner = Learner(model_cfg, self.learner_cfg, self.mesh)
    for note in [*loss_notes(self.learner_cfg), *rollout_notes(cfg.rollout),
                 *filter(None, [ignored_temperature(cfg)])] if self.primary else ():
      print(f"note: {note}", file=sys.stderr)
    if cfg.eval.every and self.primary:  # (held-out tasks that are the training tasks)
      from envs.base import load_tasks
      from jaxagent.eval import seen_in_training

      seen = seen_in_training(cfg.data.tasks, load_tasks(cfg.eval.tasks), cfg.eval.tasks)
      if seen:
        print(f"warning: eval.tasks: {seen}", file=sys.stderr)
    state = self.learner.init_state(cfg.seed, params)
    # The KL penalty's reference when the learner scores it: the run's initial weights,
    # frozen (rebuilt the same way on a resume: the preset's seed or the checkpoint).
    self.ref_params = (jax.tree.map(jnp.copy, state.params)
                       if cfg.learner.kl_coef and cfg.learner.kl_reference == "initial"
                       else None)
    self.scorers = served_scorers(cfg)
    quiet_failed_save_noise()  # a failed save is said in one line (CheckpointFailed)
    self.ckpt = RunCheckpointer(os.path.join(run_dir, "checkpoints"), keep=cfg.checkpoint.keep,
                                async_save=cfg.checkpoint.async_save)
    # A resumed run goes on in the order its checkpoint's data place indexes (runs saved
    # before `task_order` was recorded: order 1).
    def in_order(order: int):
      return iter(task_dataset(cfg.data.tasks, seed=cfg.data.seed, shuffle=cfg.data.shuffle,
                               order=order))

    try:
      saved = self.ckpt.saved_meta() if resume and self.ckpt.latest_step() is not None else None
      self.task_order = TASK_ORDER if saved is None else int(saved.get("task_order", 1))
      tasks = self.tasks = in_order(self.task_order)
      restored = restore(self.ckpt, self.learner, state, tasks, cfg, tokenizer, run_dir,
                         resume)
      if restored.task_order not in (None, self.task_order):
        # (the newest checkpoint's metadata did not read, and an older one of another
        # order was restored: its place indexes its own order)
        self.task_order = restored.task_order
        at = tasks.get_state()
        tasks = self.tasks = in_order(self.task_order)
        tasks.set_state(at)
    except (CheckpointUnreadable, RecordsDamaged, config_lib.ConfigError, ValueError):
      self.ckpt.close()
      close_envs()
      raise
    self.state, consumed = restored.state, restored.consumed
    self.t_start -= restored.wall_time_s  # the run's wall time goes on from the stopped run's
    self.counted_before = restored.counted  # (its totals go on from the checkpoint's too)
    # The last stop_window steps' (successes, episodes), for the early stop; a resumed run
    # goes on with its checkpoint's (a run that had stopped there stops again at once).
    self.recent = [tuple(x) for x in restored.stop_window_recent][-cfg.stop_window:]
    # The episodes a stopped run left in its write-ahead log are replayed by the groups of
    # the re-queued tasks.
    self.wal, replays = open_wal(cfg, run_dir, resume, consumed,
                                 int(self.state.policy_version))
    self.version = version = int(self.state.policy_version)
    # With several processes each serves its own rollouts on its own devices; the weights
    # it starts from (and is updated with) are the whole values, gathered from every one.
    self.serving = serving = Serving(cfg, model_cfg, distributed.host_copy(self.state.params),
                                     tokenizer, serving_mesh)
    attach_judge(cfg, env_factory, serving, first if self.primary else ())
    self.exports = PolicyExports(os.path.join(run_dir, "policy"), cfg.checkpoint.export_dtype,
                                 cfg.checkpoint.export_every, cfg.steps)
    try:
      if cfg.serving.urls:  # (a cluster starts them with the learner: they may be loading)
        await serving.client.wait_ready(
            cfg.serving.startup_wait_s,
            lambda m: print(m, flush=True) if self.primary else None)
      if resume or cfg.serving.urls:  # servers must start from the learner's weights
        # Exported again on a resume: an export under this version may be a stopped run's.
        path = self.exports.write(version, self.state.params)
        if serving.orch is not None:
          # Each process's own engine (no servers): every process loads the weights (a
          # multi-process resume met one process at the load's barrier and the others
          # past it), handed over whole as at every weight sync: the export is in
          # checkpoint.export_dtype, and its rounded weights sampled until the first
          # sync (a resume's --canary refused a sound checkpoint; a reviewer).
          weights, _ = serving.engine_copy(self.state.params)
          await serving.client.load_weights(weights, version)
        elif self.primary:  # (shared servers: one update is enough)
          await serving.client.update_weights(path, version)
    except InfraError as e:
      # The servers' own settings, not an outage a resume waits out (exit 3 said so: a
      # new user): a token they refuse, or another model than the run's (409).
      if cfg.serving.urls and e.kind in ("request_refused", "other_model"):
        await serving.close()
        self.ckpt.close()
        close_envs()
        raise config_lib.ConfigError(f"serving.urls: {str(e).split(': ', 1)[-1]}") from None
      raise
    if resume or cfg.serving.urls:
      if cfg.serving.urls:
        self.exports.served(version, self.primary)
      # Every process's episodes start once the servers serve it (sync mode trains tokens
      # of the current weights only).
      distributed.barrier(f"policy-{version}")
      if cfg.serving.urls and not self.primary:
        await self._follow(path, version)
    if canary:  # the restored run must sample what the saved one did
      problem = await replay_canary(restored.canary, int(self.state.step), cfg, env_factory,
                                    serving, tokenizer)
      if problem:
        await serving.close()
        self.ckpt.close()
        close_envs()
        raise config_lib.ConfigError(f"--canary: step {int(self.state.step)} does not "
                                     f"replay as saved: {problem}; not going on")
    # The resume's changes are said and recorded once it goes on: its restore and its
    # canary both passed (a refused one said them, and wrote them to config.json, first).
    for line in notes:
      print(line, file=sys.stderr)
    write_run_config(cfg, tokenizer, run_dir, resume, int(self.state.step))

    play = functools.partial(play_episode, cfg=cfg, env_factory=env_factory, serving=serving,
                             tokenizer=tokenizer, wal=self.wal, replays=replays,
                             replayed_from=self.replayed_from)
    self.scheduler = RolloutScheduler(cfg.rollout, tasks, play, requeue=restored.requeue,
                                      advantage=cfg.advantage)
    self.scheduler.go_on_from(version, past_logged_groups(restored.next_group, replays),
                              jax.process_index(), self.n_proc)
    self.writer = (MetricsWriter(run_dir, purge_step=int(self.state.step) + 1 if resume
                                 else None) if self.primary else None)
    self.meta = {
        "config": config_lib.to_dict(cfg), "model": dataclasses.asdict(model_cfg),
        "tokenizer": tokenizer.identity(), "dependencies": dependency_versions(),
        "mesh": {"shape": dict(self.mesh.shape), "devices": self.mesh.devices.size,
                 "platform": jax.devices()[0].platform, "processes": self.n_proc},
        "tool_schema_sha256": hashlib.sha256(json.dumps(tools, sort_keys=True)
                                             .encode()).hexdigest()[:16],
        "tasks_digest": tasks_digest(cfg.data.tasks), "task_order": self.task_order}
    self.rows_here = cfg.data.rows // self.n_proc
    self.row_multiple = self.learner.row_multiple // self.n_proc
    self.step = self.first_step = int(self.state.step)
    self.recorded = self.step  # the last step whose metrics row and trajectories are written

  def _sync_records(self) -> None:
    """Forces the run's records written so far (metrics rows, this process's trajectory
    segments) to the disk."""
    if self.writer is not None:
      self.writer.sync()
    sync_file(trajectories_file(self.run_dir, self.cfg))

  def save_point(self) -> tuple:
    """What a checkpoint keeps of the rollouts, taken at one instant (no await between):
    the tasks in flight, the data iterator's place, the next group's number and the
    run's totals (a retry or drop of a group in flight counted after it was counted
    again when a resume played the group again; a reviewer)."""
    return (self.scheduler.pending_tasks(), IteratorAt(self.tasks),
            self.scheduler.next_index, self.totals())

  async def save_checkpoint(self, point, force=False, canary=True) -> None:
    """Saves the run's state at its step, with `point` (`save_point`: the tasks in flight,
    where the tasks go on from) and, with `canary`, the canary episodes its weights play.
    (The rollouts go on meanwhile: a group they start is not in the checkpoint, whose
    iterator gives its task again on a resume.)"""
    cfg, scheduler, wal, step, state = (self.cfg, self.scheduler, self.wal, self.step,
                                        self.state)
    pending, data_at, next_index, counted = point
    pending = [t.to_dict() if isinstance(t, TaskSpec) else t for t in pending]
    canary_now = None
    try:  # what the saved weights sample on fixed tasks (checked by --canary)
      # (the servers' weights: between weight syncs not the saved ones, which a resume
      # loads: its --canary refused a sound checkpoint; a reviewer of red team 20)
      if canary and scheduler.served == int(state.policy_version):
        canary_now = await play_canary(cfg, self.env_factory, self.serving.client,
                                       self.tokenizer)
    except Exception as e:  # the checkpoint matters more than its canary
      print(f"warning: canary episodes failed ({type(e).__name__}: {e}); saved without",
            file=sys.stderr)
    # Every process's tasks in flight (process 0 writes the metadata): each re-queues
    # its own on a resume. And the keys of the logs this checkpoint has trained on or
    # dropped that are still in the token WAL (let go at the next save), the logs their
    # groups replayed with them: a resume from it deletes them first (their tasks came
    # round again: replayed, they were trained twice).
    # The checkpoint is made durable (Orbax syncs it), so its steps' records are first:
    # a host's crash kept a checkpoint past rows it lost, and a resume from it left
    # them out for good (red team 38). A failure is told at the save's agreement (every
    # process stops there together, none saving).
    try:
      await self.loop.run_in_executor(self.run_pool, self._sync_records)
    except OSError as e:
      self.hold(RunWriteFailed(f"the run's records in {self.run_dir} could not be forced to "
                               f"the disk before checkpoint {step} ({e.strerror or e})"
                               f"{disk_hint(e)}"))
    done_now = scheduler.drain_finished()
    mine = {"pending": pending, "next": next_index, "counted": counted,
            "consumed": [] if wal is None else [
                k for g in [*self.wal_done_with, *done_now]
                for k in [wal.key(g), *sorted(self.replayed_from.get(g, ()))]]}
    got = await self.agree("save", **mine) if self.multi else [mine]
    by_process, next_group = [g["pending"] for g in got], max(g["next"] for g in got)
    # (off the event loop, which serves the rollouts: a second a save for a 135M model
    # on this CPU; every process together, as the save)
    prints = await self.loop.run_in_executor(self.run_pool, state_prints, state, step)
    self.ckpt.save(step, state, {
        **self.meta, "wall_time_s": round(time.time() - self.t_start, 3),
        "pending_tasks": pending, "pending_tasks_by_process": by_process,
        "next_group": next_group,
        "wal_consumed_by_process": [g["consumed"] for g in got],
        "stop_window_recent": self.recent, "counted": counted,
        "counted_by_process": [g["counted"] for g in got],
        "canary": canary_now}, data_at, force=force, prints=prints)
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
        await self.loop.run_in_executor(self.run_pool, let_go, list(self.wal_done_with),
                                        bool(self.saves_begun))
        for group_id in self.wal_done_with:
          self.replayed_from.pop(group_id, None)
      except Exception as e:
        self.hold(e)
      self.wal_done_with[:] = done_now
    self.saves_begun.append(step)

  def pack(self, accepted, shares):
    """This process's groups packed into its share of the rows (in a worker thread). A
    step-wide advantage baseline spans every process's episodes: `shares`, what each
    process's episodes add to it (`baseline_share`, told at the rollouts' agreement;
    None alone)."""
    gather = None if shares is None else (lambda value: (shares, jax.process_index()))
    return pack_groups(accepted, self.cfg.advantage, self.rows_here, self.cfg.data.seq_len,
                       self.tokenizer.pad_id, self.row_multiple,
                       with_ref="ref_logp" in self.scorers, gather=gather)

  async def write_records(self, p: dict) -> None:
    """The step's trajectory segments and its metrics row (completed here)."""
    info, traj = p["info"], self.cfg.trajectories
    # Written again after a failure from the part that failed (a retry appended the
    # step's segments a second time; red team 21); a write cut by a second signal goes
    # on in its thread, and the retry awaits it rather than writing beside it.
    if "segments" not in p and (traj.mode == "all" or (
        traj.mode == "sample" and p["step"] % traj.sample_every == 0)):
      job = p.get("segments_job") or self.loop.run_in_executor(
          self.run_pool, dump_segments, trajectories_file(self.run_dir, self.cfg),
          info["used_segments"], p["step"], self.tokenizer.decode if traj.text else None)
      p["segments_job"] = job
      try:
        await asyncio.shield(job)
      except asyncio.CancelledError:
        raise
      except BaseException:  # (failed, and cut off the file: a retry writes it whole)
        p.pop("segments_job", None)
        raise
    p["segments"] = True
    totals = self.totals()
    complete_row(p, time.time() - self.t_start, self.n_proc,
                 add_totals(totals, self.others_totals), totals["loop_held_s"])
    if self.writer is not None:
      self.writer.write(p["row"])
    self.recorded = p["step"]

  def totals(self) -> dict:
    """The run's totals so far, its checkpoint's (a resumed run's) and this process's
    scheduler's since: retries, groups replaced, drops by reason (a resume started
    them again at 0: per-step differences went negative; red team 39), and the seconds
    its event loop was held (process 0's: a reviewer found them begun again too)."""
    before, scheduler = self.counted_before, self.scheduler
    dropped = collections.Counter(before.get("dropped") or {})
    dropped.update(scheduler.dropped)
    watch = getattr(self, "loop_watch", None)  # (started with the steps)
    return {"retries": int(before.get("retries", 0)) + scheduler.retries,
            "groups_replaced": int(before.get("groups_replaced", 0)) + scheduler.replaced,
            "dropped": dict(dropped),
            "loop_held_s": float(before.get("loop_held_s", 0.0)) + (
                watch.held_s if watch is not None else 0.0)}

  def stop_reached(self) -> Optional[float]:
    """The window's success rate when it reached `stop_success_rate` (else None)."""
    cfg, recent = self.cfg, self.recent
    rate = sum(s for s, _ in recent) / max(sum(n for _, n in recent), 1)
    return rate if (cfg.stop_success_rate and len(recent) == cfg.stop_window
                    and rate >= cfg.stop_success_rate) else None

  async def go(self) -> int:
    """Runs the steps to the end (`cfg.steps`, the early stop, a signal or an error),
    then saves and closes: the run's exit code (an error of any process raised)."""
    from envs.loopwatch import LoopWatch

    cfg, scheduler = self.cfg, self.scheduler
    self.bar = tqdm(total=cfg.steps, initial=self.step, desc="train", dynamic_ncols=True,
                    disable=not self.primary or (not sys.stdout.isatty()
                                                 and not os.environ.get("JAXAGENT_PROGRESS")))
    self.t_rollout_mark = time.perf_counter()
    self.no_step_note_at = NO_STEP_NOTE_S
    self.dropped_at_step = collections.Counter(scheduler.dropped)
    self.signals = StopSignals(self.run_dir).install(self.loop)  # (SIGTERM, Ctrl-C)
    self.early_stop = self.stop_reached()
    # Names an environment's async code that holds the loop every episode moves on, and
    # charges a hold to the episode that held it (started before the episodes: their
    # tasks are told apart from the run's own).
    self.loop_watch = LoopWatch().start()
    try:
      scheduler.start()
      while self.step < cfg.steps and self.early_stop is None:
        if await self._stop_asked() or not await self._one_step():
          break
        self.early_stop = self.stop_reached()
      if self.early_stop is not None:
        print(f"success rate {self.early_stop:.3f} over the last {cfg.stop_window} steps' "
              f"episodes reached {cfg.stop_success_rate}: stopping" + (
                  " (met when the run was resumed)" if self.step == self.first_step
                  else ""), flush=True)
      self.finished = True
    except Exception as e:
      if self.multi and distributed.peer_gone(e):  # (not saved, nor exported: both need them all)
        self.lost = PeerLost(f"another process of the run is gone "
                             f"({str(e).splitlines()[0][:200]})")
        raise self.lost from e
      self.lost = e if isinstance(e, PeerLost) else None
      self.nonfinite = isinstance(e, NonFiniteUpdate)
      raise
    finally:
      await self._close()
    return self._outcome()

  async def _stop_asked(self) -> bool:
    """Whether a signal asks the run to stop before its next step."""
    if self.multi:  # a signal to any process stops every one here, between two steps (one
      # stopping alone left the others waiting in the step's collectives)
      got = await self.agree("step", stop=self.signals.got)
      names = [g["stop"] for g in got if g["stop"]]
      if names:  # (its own signal's name if it had one: a process exits by its own)
        self.signals.got = self.signals.got or names[0]
        return True
      return False
    return self.signals.got is not None

  async def _one_step(self) -> bool:
    """One step: the rollouts it trains on, the update, the weight sync, the records and
    (in its turn) a save. False when a stop gave up its wait for rollouts."""
    cfg, scheduler = self.cfg, self.scheduler
    accepted: list = []  # (the step's groups: given back if it fails before its update,
    # saved with the checkpoint as tasks in flight; they were lost: neither trained
    # nor played again)
    try:
      got = await self._rollouts(accepted)
      if got is None:
        return False
      shares, scored = got
      rollout_s = time.perf_counter() - self.t_rollout_mark
      t0 = time.perf_counter()
      batch, info, m = await self._update(accepted, shares)
    except BaseException:
      scheduler.put_back(accepted)
      raise
    if m is None:
      scheduler.trained_nothing(accepted)  # (replaced: else the async modes stalled)
      self._nothing_trained(info)
      return True
    if info.get("overflow_groups") and not self.overflow_said:  # (once a run: the metric counts)
      self.overflow_said = True
      print(f"warning: step {self.step + 1}'s batch did not hold {info['overflow_groups']} "
            "of its groups (left out whole, untrained): data.rows x data.seq_len is less "
            "than the step's episodes take; raise data.rows (metrics batch_overflow*)",
            file=sys.stderr, flush=True)
    self.no_step_note_at = NO_STEP_NOTE_S
    self.dropped_at_step = collections.Counter(scheduler.dropped)
    row = self._step_row(accepted, batch, info, scored)
    learner_s = time.perf_counter() - t0
    self.step = int(self.state.step)
    self.version = int(self.state.policy_version)
    scheduler.trained(accepted)
    # What the step's records need: written after the weight sync (with its figures),
    # or on the way out if the run stops before (a step is never checkpointed without
    # its records).
    self.records = dict(row=row, info=info, batch=batch, m=m, rollout_s=rollout_s,
                        learner_s=learner_s, step=self.step, version=self.version)
    sync_s, sync_path = 0.0, None
    if self.step % cfg.rollout.sync_every == 0 or self.step == cfg.steps:
      t0 = time.perf_counter()
      sync_path = await self._sync_weights()
      sync_s = time.perf_counter() - t0
    # The learner's version, after the sync: groups it drops as stale are replaced on
    # the new weights (before it, during the sync, on the old: a reviewer).
    scheduler.set_version(self.version)
    exports = self.exports  # (and kept as an export of its own, unless written for the sync)
    if exports.kept(self.version) and exports.exported != self.version:
      if self.multi:  # (its writes are collectives: an error held since is told first)
        await self.agree(f"export-{self.version}")
      await self.loop.run_in_executor(self.run_pool, exports.write, self.version,
                                      self.state.params)
    row.update({"weight_sync_s": sync_s,
                **({"weight_sync_path": sync_path} if sync_path else {})})
    self.recent = (self.recent + [(row.get("success_rate", 0.0) * row["episodes"],
                                   row["episodes"])])[-cfg.stop_window:]
    try:  # (this process's own work: an error is told at the next agreement)
      if cfg.eval.every and self.step % cfg.eval.every == 0 and self.primary:
        t0 = time.perf_counter()
        figures = await evaluate_policy(cfg, self.env_factory, self.serving, self.tokenizer)
        row.update(figures, eval_policy_version=scheduler.served,
                   eval_s=round(time.perf_counter() - t0, 3))
        # (said on the console too: they were only in metrics.jsonl, a new user's)
        tqdm.write(eval_line(figures, self.step, scheduler.served), file=sys.stdout)
      await self.write_records(self.records)
      self._said(row, m, rollout_s, learner_s, sync_s)
      self.ckpt.check()  # (a save under way that failed stops the run here, not at the next)
    except Exception as e:
      self.hold(e)
    if cfg.checkpoint.every_steps and self.step % cfg.checkpoint.every_steps == 0:
      await self.save_checkpoint(self.save_point())
    # The next step's rollout wait starts here: after this step's evaluation, records and
    # save (they were read as its rollout time, and its rates fell: a reviewer).
    self.t_rollout_mark = time.perf_counter()
    return True

  async def _rollouts(self, accepted: list) -> Optional[tuple]:
    """The step's groups, into `accepted` (as soon as they are had: a step that fails
    gives them back); (every process's baseline shares or None, the served scorers'
    figures), or None when a stop gave up the wait for them."""
    scheduler, client = self.scheduler, self.serving.client
    if self.multi:  # (every process goes into the step's collectives)
      scored, share = {}, None  # (this process's part of a step-wide baseline)
      try:  # (the episodes' own errors: told to the others before the collectives)
        groups, taken = await scheduler.next_groups()
        accepted += groups
        self.played += taken
        scored = (await score_segments(client, accepted, self.scorers,
                                       self.learner_cfg.temperature) if self.scorers else {})
        share = baseline_share(accepted, self.cfg.advantage)
      except Exception as e:
        self.hold(e)
      return [g["share"] for g in await self.agree("rollouts", share=share)], scored
    # a stop while the step's rollouts run: no step is under way, none waited for
    got = await unless_stopped(scheduler.next_groups(), self.signals.stopping)
    if got is None:
      self.abandoned = True
      print(f"{self.signals.got}: no step was under way (the episodes in flight are "
            "played again on a resume)", file=sys.stderr, flush=True)
      return None
    groups, taken = got
    accepted += groups
    self.played += taken
    return None, (await score_segments(client, accepted, self.scorers,
                                       self.learner_cfg.temperature) if self.scorers else {})

  async def _update(self, accepted: list, shares: Optional[list]) -> tuple:
    """The step's groups packed and, when they hold any segment, learned from: (batch,
    its packing's info, the step's metrics or None)."""
    # Batching, the step and reading its metrics run off the event loop, which keeps
    # serving episodes' turns and environment steps meanwhile (asynchrony).
    loop, pool = self.loop, self.run_pool
    if self.multi:  # the processes agree on the rows (and on skipping a step nobody has
      # data for); this one's error packing its groups is told there, before the
      # step's collectives (raised at once, it went to its final save while the
      # others were in them: all hung until the coordination service's abort)
      packed = None
      try:
        packed = await loop.run_in_executor(pool, self.pack, accepted, shares)
      except Exception as e:
        self.hold(e)
      got = await self.agree("batch", **({"rows": 0, "segments": 0} if packed is None else {
          "rows": packed[1]["rows"], "segments": packed[1]["segments"]}))
      used_rows, segments = max(g["rows"] for g in got), sum(g["segments"] for g in got)
    else:
      packed = await loop.run_in_executor(pool, self.pack, accepted, None)
      used_rows, segments = packed[1]["rows"], packed[1]["segments"]
    batch, info = trim_batch(*packed, used_rows, self.rows_here, self.row_multiple)
    m = None
    if segments:
      self.state, m = await loop.run_in_executor(pool, learn, self.learner, self.state,
                                                 batch, self.ref_params)
    return batch, info, m

  def _nothing_trained(self, info: dict) -> None:
    """A step with nothing to learn from (all filtered or too long): the run samples
    again; the next step's metrics count these episodes and their time too. A run whose
    every episode so far began with a prompt too long for its settings stops saying so;
    else the wait is said every NO_STEP_NOTE_S while it lasts (such runs spun without a
    word)."""
    played = self.played
    episodes = [e for g in played for e in g.episodes]
    unfit = [e for e in episodes if e.reason == FIRST_PROMPT_TOO_LONG]
    if (self.step == self.first_step and unfit and len(unfit) == len(episodes)
        and len(played) >= 2):  # (this process's episodes: told at the next agreement)
      self.hold(config_lib.ConfigError(f"{unfit[0].unfit} (every episode this run played "
                                       "began so: nothing to train on)"))
    waited = time.perf_counter() - self.t_rollout_mark
    if self.primary and waited >= self.no_step_note_at:
      self.no_step_note_at = waited + NO_STEP_NOTE_S
      print(no_step_warning(waited, played, self.scheduler.dropped - self.dropped_at_step,
                            info), file=sys.stderr, flush=True)

  def _step_row(self, accepted: list, batch, info: dict, scored: dict) -> dict:
    """The step's metrics row so far: its episodes (every group played since the last
    step), the batch's staleness and what it held; the groups played are let go."""
    cfg, played = self.cfg, self.played
    row = {"step": self.step + 1, **episode_metrics(
               played, accepted, self.version, step_signal(accepted, cfg.advantage)),
           **token_staleness_metrics(batch.versions, batch.loss_mask, self.version), **scored}
    if self.wal is not None:
      row["wal_replayed_turns"] = sum(e.replayed_turns for g in played for e in g.episodes)
    # What the batch held: the episodes trained are those it packed (a group left out
    # for want of rows was counted as trained).
    row.update(episodes_trained=info["episodes"],
               batch_segments=info["segments"], batch_overflow=info["overflow"],
               batch_overflow_groups=info.get("overflow_groups", 0),
               batch_too_long=info["too_long"])
    if self.multi:  # the episode counts and success of every process, not only this one's
      row.update(distributed.sum_episode_counts(row))
      # (and the others' retries, replacements and drops: process 0's alone, while the
      # groups played were every process's, left a row's groups unaccounted for; a
      # reviewer)
      every = distributed.gather_json(self.totals())
      self.others_totals = functools.reduce(
          add_totals, [t for i, t in enumerate(every) if i != jax.process_index()], {})
    self.played = []
    return row

  async def _sync_weights(self) -> str:
    """The servers moved to the learner's weights (its version): how (the path of the
    in-process handover, or "export")."""
    serving, version, exports = self.serving, self.version, self.exports
    if serving.orch is not None:  # in-process: hand the weights over in memory
      weights, sync_path = serving.engine_copy(self.state.params)
      try:  # (this process's own engine: an error is told at the next agreement)
        await serving.client.load_weights(weights, version, self.cfg.rollout.update_mode)
      except Exception as e:
        self.hold(e)
    else:  # servers load the export
      path = await self.loop.run_in_executor(self.run_pool, exports.write, version,
                                             self.state.params)
      if self.primary:  # the servers are shared by every process: one update is enough
        try:
          await serving.client.update_weights(path, version, self.cfg.rollout.update_mode)
        except Exception as e:
          self.hold(e)
      if self.multi:  # no process samples on for the new version before the servers have it
        await self.agree(f"policy-{version}")
        if not self.primary:
          await self._follow(path, version)
      exports.served(version, self.primary)  # (the servers have moved on)
      sync_path = "export"
    self.scheduler.set_served(version)
    return sync_path

  async def _follow(self, path: str, version: int) -> None:
    """This process's client (and its router) held to the policy the first process updated
    the servers to: a server that restarts is not served from before it loads it (this
    process's router held none, let one in on its first weights, and its turns there
    were stale: a group wasted; a reviewer)."""
    try:  # (this process's own: an error is told at the next agreement)
      await self.serving.client.follow_policy(path, version, self.cfg.rollout.update_mode)
    except Exception as e:
      self.hold(e)

  def _said(self, row: dict, m: dict, rollout_s: float, learner_s: float,
            sync_s: float) -> None:
    """The step on the progress bar, or in one line where there is no terminal."""
    bar = self.bar
    bar.update(1)
    bar.set_postfix(success=f"{row.get('success_rate', 0):.2f}",
                    reward=f"{row.get('reward_mean', 0):.2f}",
                    tok_s=f"{row['rollout_tokens_per_s']:.0f}",
                    lag=f"{row.get('policy_lag_mean', 0):.1f}")
    if bar.disable and self.primary:  # no terminal: one line per step instead of a bar
      print(f"step {self.step}: success {row.get('success_rate', 0):.3f} reward "
            f"{row.get('reward_mean', 0):.3f} loss {m['loss']:.4f} rollout "
            f"{rollout_s:.1f}s learner {learner_s:.1f}s sync {sync_s:.2f}s wall "
            f"{row['wall_time_s']:.0f}s", flush=True)

  async def _close(self) -> None:
    """The run's end, however it came: the last step's records, the final save and
    export (what every process can make together), the token WAL's logs let go, and
    everything closed."""
    step, ckpt, wal = self.step, self.ckpt, self.wal
    self.loop_watch.stop()
    self.bar.close()
    records = self.records
    if records is not None and self.recorded != records["step"]:  # stopped before its records
      try:
        await self.write_records(records)
        if self.primary:  # (its row was in metrics.jsonl, not on the console: a new user)
          print(f"step {records['step']}: trained and recorded as the run stopped",
                file=sys.stderr, flush=True)
      except Exception as e:  # (then it is not checkpointed: a resume replays the step)
        print(f"warning: step {records['step']}'s records could not be written "
              f"({type(e).__name__}: {e})", file=sys.stderr, flush=True)
    # The groups taken since the last step that trained (steps that found nothing in
    # them, groups the filters dropped) are in no row yet: given back as in flight, the
    # final save keeps them for a resume to count (it consumed them: in no row ever).
    self.scheduler.give_back(self.played)
    self.played = []
    point = self.save_point()
    await self.scheduler.stop()
    unsaved, failed = await self._unsaved()
    if unsaved and ckpt.latest_step() != step and step > 0:
      print(f"{unsaved}: not checkpointed (a resume goes on from step "
            f"{ckpt.latest_step() or 0})", file=sys.stderr, flush=True)
    elif ckpt.latest_step() != step and step > 0 and not failed:
      # (no canary when a stop gave up waiting for rollouts: its episodes may hang too)
      try:
        await self.save_checkpoint(point, force=True,
                                   canary=self.finished and not self.abandoned)
      except CheckpointFailed:  # (ckpt.failed: raised below)
        pass
      except (RunWriteFailed, PeerFailed) as e:  # records not synced, here or on another
        # process: not saved (raised below, once the rest is closed)
        self.own_failure = self.own_failure or e
      except NonFiniteUpdate as e:  # (raised below, once the rest is closed)
        self.own_failure, unsaved, self.nonfinite = self.own_failure or e, "not finite", True
    exports, version = self.exports, self.version
    if exports.exported != version and step > 0 and not unsaved:  # the final weights
      try:
        exports.write(version, self.state.params)
      except Exception as e:  # (the checkpoint has them; a resume exports them again)
        print(f"warning: policy version {version} could not be exported "
              f"({type(e).__name__}: {e})", file=sys.stderr, flush=True)
    if self.lost is None:  # (a save under way waits on every process: it cannot end now)
      with contextlib.suppress(CheckpointFailed):  # (ckpt.failed: raised below)
        ckpt.close()  # (waits for the last save)
    # (a failed save needs the logs; and a run that lost a process resumes from them)
    if wal is not None and ckpt.failed is None and self.lost is None:
      for group_id in self.wal_done_with:
        wal.discard_group(group_id)
      if self.saves_begun:
        wal.drop_aside()
    if self.writer is not None:
      self.writer.close()
    await self.serving.close()
    self.close_envs()
    # (held until here: a second signal during the final save stops at once, saying so,
    # instead of the default action killing the process in the middle of it)
    self.signals.remove(self.loop)
    self.run_pool.shutdown(wait=False)  # (its idle threads end; one in a collective is left behind)

  async def _unsaved(self) -> tuple[Optional[str], bool]:
    """(Why the run's end is not saved, or None; whether a save failed), every
    process's told to each (the final save and export are collectives: all or none)."""
    step = self.step
    # Saved only with its records: a checkpoint of a step whose metrics row and
    # trajectories were not written would resume past them, losing them for good. Nor
    # when the step under way holds the state (stopped at once in the learner's step).
    unsaved = ("another process of the run is gone" if self.lost is not None else
               f"step {step}'s records were not written" if step != self.recorded else
               "the step's update was not finite" if self.nonfinite
               else "the step under way holds the state" if _deleted(self.state) else None)
    failed = self.ckpt.failed is not None
    if not self.multi or self.lost is not None:
      return unsaved, failed
    if self.signals.now:  # (stopped at once: alone, with no collective)
      return "stopped at once, apart from the run's other processes", failed
    try:
      got, self.peer_failed = await self.agreements.gather("end", unsaved=unsaved,
                                                           failed=failed)
      if self.agreements.held:  # (told; raised past the final save, which all make together)
        self.own_failure = self.agreements.held.pop()
    except Exception as e:
      if not (isinstance(e, PeerLost) or distributed.peer_gone(e)):
        raise
      self.lost = e if isinstance(e, PeerLost) else PeerLost(str(e).splitlines()[0][:200])
      return "another process of the run is gone", failed
    unsaved = unsaved or next((f"process {i}: {g['unsaved']}" for i, g in
                               enumerate(got) if g["unsaved"]), None)
    return unsaved, any(g["failed"] for g in got)

  def _outcome(self) -> int:
    """The run's exit code, once it is closed; an error met on the way raised."""
    if self.lost is not None:  # (found at the end: out of step)
      raise self.lost
    if self.own_failure is not None:  # (met in the last step's own work, told at the end)
      raise self.own_failure
    if self.peer_failed is not None:
      raise self.peer_failed
    if self.ckpt.failed is not None:  # (one that the run went on past, or the last one)
      raise self.ckpt.failed
    cfg, step, signals = self.cfg, self.step, self.signals
    stopped = signals.got is not None and step < cfg.steps and self.early_stop is None
    png = plot_learning_curve(self.run_dir, cfg.name) if self.primary else None  # (stopped too)
    if stopped and self.primary:  # (not finished: a scheduler that restarts the run resumes it)
      print(f"stopped at step {step} of {cfg.steps} ({signals.got}); to go on: "
            f"{resume_command(self.run_dir)}" + (f"; learning curve so far: {png}" if png
                                                 else ""),
            file=sys.stderr, flush=True)
    if stopped:
      return 128 + getattr(signal, signals.got).value
    if not self.primary:
      return 0
    print(f"done: {step} steps in {time.time() - self.t_start:.0f}s; learning curve: {png}")
    return 0

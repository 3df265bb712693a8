"""A run directory: whether it holds a run, its lock, where its trajectories go, and what a
resume checks against it (the config the run had, a checkpoint's provenance, the canary
episodes) and cuts back (what a stopped run wrote after the restored step)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import sys
import time
from typing import Optional

import jax

from jaxagent import config as config_lib, distributed
from jaxagent.agent import run_whitebox
from jaxagent.checkpoint import drop_versions_after, list_versions
from jaxagent.metrics import cut_jsonl


def trajectories_file(run_dir: str, cfg: config_lib.RunConfig) -> str:
  """Where this process records the segments it trains on (process 0:
  trajectories.jsonl[.gz], others one file each)."""
  name = ("trajectories.jsonl" if distributed.is_primary() else
          f"trajectories.process{jax.process_index()}.jsonl")
  return os.path.join(run_dir, name + (".gz" if cfg.trajectories.compress == "gzip" else ""))


def holds_a_run(run_dir: str) -> bool:
  """Whether `run_dir` has a run's records (a new run there would mix into them): a
  metrics row, a checkpoint, a trajectory segment or a policy export past the first.
  (A run that stopped before its first step left none: it is started again there.)"""
  if has_checkpoint(run_dir):
    return True
  names = os.listdir(run_dir) if os.path.isdir(run_dir) else []
  if any((n == "metrics.jsonl" or n.startswith("trajectories."))
         and os.path.getsize(os.path.join(run_dir, n)) > 0 for n in names):
    return True
  try:  # (what a run's learner exports at its start for its servers is version 0)
    return any(v["version"] > 0 for v in list_versions(os.path.join(run_dir, "policy")))
  except (OSError, ValueError, KeyError, TypeError):  # a registry that does not read
    return True


class RunDirInUse(RuntimeError):
  """Another trainer holds the run directory (its process of the same index)."""


def in_use(run_dir: str) -> Optional[str]:
  """Why `run_dir` cannot be trained in now (another process holds its lock), or None:
  free, or a directory whose lock cannot be taken here (its trainer says so)."""
  try:
    lock_run_dir(run_dir).close()
  except RunDirInUse as e:
    return str(e)
  except OSError:
    pass
  return None


def lock_run_dir(run_dir: str):
  """Takes this process's lock on `run_dir` for as long as it lives (an open file with an
  exclusive `flock`; the system lets it go when the process ends, however it ends), and
  returns the file. Two trainers in one run directory (a --resume while the run goes
  on, two starts at once) trained into the same records: each step's segments twice,
  metrics rows written to a file the other had replaced, checkpoints of both in one
  place (red team 15). Raises `RunDirInUse` naming the holder; where the file system
  has no locks, says so and goes on."""
  import fcntl
  import socket

  name = ".lock" if distributed.is_primary() else f".lock.process{jax.process_index()}"
  path = os.path.join(run_dir, name)
  f = open(path, "a+")
  try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    f.seek(0)
    holder = f.read().strip() or "a process that has not said which"
    f.close()
    raise RunDirInUse(f"--run-dir {run_dir} is in use by another trainer ({holder}): stop "
                      "it first, or give another --run-dir") from None
  except OSError as e:  # (a file system without locks: a network mount)
    print(f"warning: --run-dir {run_dir} cannot be locked ({e.strerror or e}): nothing "
          "stops a second trainer from writing into it", file=sys.stderr)
    return f
  f.seek(0)
  f.truncate()
  f.write(f"pid {os.getpid()} on {socket.gethostname()} since "
          f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
  f.flush()
  return f


def started_a_run(run_dir: str) -> bool:
  """Whether `--resume` can go on in `run_dir`: it holds a run's records, or the config
  of one stopped before its first step (which then starts again from step 0, as the
  stop told it to)."""
  return holds_a_run(run_dir) or os.path.exists(os.path.join(run_dir, "config.json"))


def check_weights(meta: dict, cfg: config_lib.RunConfig, tokenizer, step: int) -> None:
  """ConfigError when a checkpoint's metadata says it holds other weights than `cfg`'s
  (the fields that decide them, the vocabulary)."""
  saved = (meta.get("config") or {}).get("model") or {}
  changes = [f"model.{k}: {saved[k]} -> {getattr(cfg.model, k)}"
             for k in config_lib.ModelSpec.WEIGHT_FIELDS
             if k in saved and saved[k] != getattr(cfg.model, k)]
  vocab = (meta.get("tokenizer") or {}).get("vocab_sha256")
  if vocab and vocab != tokenizer.identity()["vocab_sha256"]:
    changes.append(f"the tokenizer's vocabulary (sha256 {vocab} -> "
                   f"{tokenizer.identity()['vocab_sha256']})")
  if changes:
    raise config_lib.ConfigError(
        f"--resume: checkpoint step {step} was saved with other weights than this run's "
        f"({'; '.join(changes)}); a run keeps its model: start a new run with another "
        "--run-dir")


def check_provenance(meta: dict, cfg: config_lib.RunConfig, tokenizer, step: int,
                     run_dir: str) -> None:
  """A restored checkpoint's own record of its run against this one: the fields that
  decide the weights, and the vocabulary, must be the same (ConfigError: the restore
  casts and reshapes silently; without the run's config.json, or with one that did not
  read, nothing else compared them: red team 15). A checkpoint whose config is none this
  run had (its config.json, or one a resume set aside) is said in a line: another run's
  checkpoint copied in, most likely."""
  check_weights(meta, cfg, tokenizer, step)
  ran = []  # the configs this run has had: its config.json, those a resume set aside
  for name in sorted(os.listdir(run_dir)):
    if name == "config.json" or re.fullmatch(r"config\.step\d+\.json", name):
      with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(run_dir, name)) as f:
          ran.append(json.load(f))
  mine = meta.get("config")
  if ran and isinstance(mine, dict) and distributed.is_primary() and all(
      set(config_changes(c, mine)) - {"model.chat_template"} for c in ran):
    differs = sorted(set(config_changes(ran[0], mine)) - {"model.chat_template"})
    print(f"warning: --resume: checkpoint step {step} was saved with a config this run "
          f"never had ({', '.join(differs[:6])}{', ...' if len(differs) > 6 else ''} "
          "differ from its config.json): another run's checkpoint?", file=sys.stderr)


def cut_back(run_dir: str, cfg: config_lib.RunConfig, step: int, version: int) -> None:
  """Rewinds what a stopped run wrote after the `step` (and policy `version`) a
  resumed run restores: each process its trajectory segments, process 0 the metrics
  rows, the newer policy exports and the configs kept at later steps (their steps are
  trained again: kept, a later resume at such a step kept a config no step had)."""
  path = trajectories_file(run_dir, cfg)
  for name in (path, path[:-3] if path.endswith(".gz") else path + ".gz"):
    cut_jsonl(name, step)  # (both: a resume may change trajectories.compress)
  if distributed.is_primary():
    cut_jsonl(os.path.join(run_dir, "metrics.jsonl"), step)
    drop_versions_after(os.path.join(run_dir, "policy"), version)
    for name in os.listdir(run_dir):
      kept = re.fullmatch(r"config\.step(\d+)\.json", name)
      if kept and int(kept.group(1)) > step:
        os.remove(os.path.join(run_dir, name))


CANARY_LOGP_ATOL = 1e-4


def dependency_versions() -> dict:
  """Versions of the packages a checkpoint's numbers depend on."""
  from importlib import metadata

  out = {}
  for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "jaxagent"):
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      out[name] = None
  return out


async def play_canary(cfg: config_lib.RunConfig, env_factory, client, tokenizer) -> list:
  """The first `checkpoint.canary_tasks` tasks, played with fixed session ids (so fixed
  seeds): what each one sampled, its log-probs and rewards (stored with a checkpoint)."""
  from envs.base import TaskSpec

  if not cfg.checkpoint.canary_tasks:
    return []
  with open(cfg.data.tasks) as f:
    specs = [TaskSpec.from_dict(json.loads(line)) for line in f if line.strip()]
  out = []
  for i, task in enumerate(specs[:cfg.checkpoint.canary_tasks]):
    ep = await run_whitebox(env_factory(task), task, client, tokenizer, cfg.agent,
                            session_id=f"canary-{i}", group_id="canary")
    seg = ep.segments[0] if ep.segments else None
    out.append({"task": task.id, "status": ep.status, "rewards": ep.turn_rewards,
                "tokens": [] if seg is None else seg.tokens.tolist(),
                "logp": [] if seg is None else
                [round(float(x), 6) for x in seg.rollout_logp[seg.loss_mask > 0]]})
  return out


def compare_canary(saved: list, now: list) -> Optional[str]:
  """None when the replayed canary matches the stored one, else what differs."""
  for a, b in zip(saved, now):
    if a["tokens"] != b["tokens"]:
      return f"task {a['task']}: sampled other tokens"
    if a["rewards"] != b["rewards"]:
      return f"task {a['task']}: rewards {b['rewards']} instead of {a['rewards']}"
    diff = max((abs(x - y) for x, y in zip(a["logp"], b["logp"])), default=0.0)
    if diff > CANARY_LOGP_ATOL:
      return f"task {a['task']}: log-probs differ by up to {diff:.2e} (> {CANARY_LOGP_ATOL})"
  if len(saved) != len(now):
    return f"{len(now)} canary episodes instead of {len(saved)}"
  return None


def _flat(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict) and v:
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


# Where a run's services are: fresh on each start (`launch local`), not a change of the run.
_SERVICE_ADDRESSES = ("serving.urls", "env.urls")


def config_changes(before: dict, now: dict) -> dict:
  """{dotted key: (before, now)} between two configs as dicts, service addresses aside."""
  before, now = _flat(before), _flat(now)
  return {k: (before.get(k), now.get(k)) for k in sorted(set(before) | set(now))
          if before.get(k) != now.get(k) and k not in _SERVICE_ADDRESSES}


def has_checkpoint(run_dir: str) -> bool:
  """Whether `run_dir` holds a checkpoint (a step's directory; Orbax's unfinished ones
  are named otherwise)."""
  ckpts = os.path.join(run_dir, "checkpoints")
  return os.path.isdir(ckpts) and any(d.isdigit() for d in os.listdir(ckpts))


def _with_model_policies(cfg: config_lib.RunConfig, policies: dict) -> config_lib.RunConfig:
  models = {name: dataclasses.replace(m, policy=policies.get(name, m.policy))
            for name, m in cfg.serving.models.items()}
  return dataclasses.replace(cfg, serving=dataclasses.replace(cfg.serving, models=models))


def pinned_exports(cfg: config_lib.RunConfig) -> config_lib.RunConfig:
  """`cfg` with each model it serves in process from a policy export (`serving.models.*.
  policy`) at the version directory it loads now: an export root's latest version, which
  the run's config.json then records, and a resume keeps (`resumed_config`). Without it
  a resumed run loaded that root's latest again: another reference or teacher than the
  steps before it had, if the root was exported to meanwhile, said nowhere (a reviewer).
  ConfigError naming the model when its export cannot be read.

  With several processes (all must call it) every one loads process 0's versions: each
  pinned its own, and an export landing between their starts gave the run two reference
  models; one's error is every one's (alone, it stopped while the others waited for it in
  the run's first collective)."""
  if cfg.serving.urls or all(m.policy is None for m in cfg.serving.models.values()):
    return cfg  # (remote servers load their own models)
  from rollout_server.serving import resolve_policy

  pinned, failed = {}, None
  for name, m in cfg.serving.models.items():
    if m.policy is not None and failed is None:
      try:
        pinned[name] = resolve_policy(m.policy)[0]
      except (OSError, ValueError) as e:
        failed = f"serving.models.{name}.policy: {e}"
  if jax.process_count() > 1:
    got = distributed.gather_json({"pinned": pinned, "failed": failed})
    pinned, failed = got[0]["pinned"], next(
        (f"process {i}: {g['failed']}" for i, g in enumerate(got) if g["failed"]), None)
  if failed is not None:
    raise config_lib.ConfigError(failed)
  return _with_model_policies(cfg, pinned)


def _kept_exports(saved: config_lib.RunConfig, cfg: config_lib.RunConfig, say) -> dict:
  """The served models' export versions a resumed run keeps: the version directory its
  config.json records for a model it serves from the same export root now (a new
  version there is another model than the one the run's steps had); another path given
  is a change, said as every change is."""
  from jaxagent.checkpoint import export_stands
  from rollout_server.serving import resolve_policy

  kept = {}
  for name, m in cfg.serving.models.items():
    was = saved.serving.models.get(name)
    if m.policy is None or was is None or was.policy is None or was.policy == m.policy:
      continue
    given = os.path.abspath(m.policy)
    # (a version named: the user's; another root: a change, said as such)
    if os.path.dirname(was.policy) not in (given, os.path.join(given, "policy")):
      continue
    try:
      now = resolve_policy(m.policy)[0]
    except (OSError, ValueError) as e:  # (the latest there unreadable: not the one kept)
      if export_stands(was.policy):
        kept[name] = was.policy
        say(f"note: --resume keeps serving.models.{name}.policy at {was.policy}, the "
            f"version the run began with (the latest there cannot be read: {e})")
      continue  # (else said at the start, as on any run)
    if os.path.dirname(now) != os.path.dirname(was.policy):  # (a root's run directory)
      continue
    if now == was.policy:  # (nothing exported since: the same version, no change)
      kept[name] = now
    elif not export_stands(was.policy):  # (dropped since: another run's transient export)
      say(f"warning: --resume: serving.models.{name}.policy's version the run began "
          f"with, {was.policy}, is gone: it loads the latest, {os.path.basename(now)}")
      kept[name] = now
    else:
      kept[name] = was.policy
      say(f"note: --resume keeps serving.models.{name}.policy at {was.policy}, the "
          f"version the run began with (the latest there now: {os.path.basename(now)}); "
          "give a version's directory to change it")
  return kept


def resumed_config(cfg: config_lib.RunConfig, run_dir: str,
                   notes: list[str] | None = None) -> config_lib.RunConfig:
  """The config a resumed run goes on with: `cfg`, checked against the run's own
  `config.json`. The fields that decide its weights cannot change (ConfigError); every
  other change is said, one line each (printed, or appended to `notes` for the caller
  to print once the run is its own: a held directory's refusal must not follow lines
  that read as applied); a run given more (or fewer) `steps` keeps its cosine
  schedule's horizon (the learning rate would jump), unless no checkpoint was saved (the
  run starts again at step 0, on the schedule of the steps it is given now)."""
  say = (lambda line: print(line, file=sys.stderr)) if notes is None else notes.append
  path = os.path.join(run_dir, "config.json")
  if not os.path.exists(path):
    return cfg
  try:
    saved = config_lib.load(config_lib.RunConfig, path)
  except config_lib.ConfigError as e:  # (written by another version of the code)
    say(f"warning: --resume: not compared with the run's config.json ({e})")
    return cfg
  horizon = saved.learner.lr_decay_steps or saved.steps  # the cosine schedule's, as it ran
  kept = (cfg.learner.lr_schedule == "cosine" and cfg.learner.lr_decay_steps == 0
          and horizon != cfg.steps and has_checkpoint(run_dir))
  if kept:  # (with the run's steps changed: the learning rate would jump)
    cfg = dataclasses.replace(cfg, learner=dataclasses.replace(cfg.learner,
                                                               lr_decay_steps=horizon))
  weights = saved.model.weight_changes(cfg.model)
  if weights:
    raise config_lib.ConfigError(
        "--resume: a run keeps its model (" + ", ".join(f"model.{w}" for w in weights)
        + "); start a new run with another --run-dir")
  if saved.learner.optimizer != cfg.learner.optimizer:  # (its state is another shape: the
    # restore said "tree structures do not match", read as a damaged checkpoint)
    raise config_lib.ConfigError(
        f"--resume: a run keeps its optimizer (learner.optimizer: {saved.learner.optimizer} "
        f"-> {cfg.learner.optimizer}: the checkpoint holds its state); start a new run with "
        "another --run-dir")
  if not cfg.serving.urls:
    cfg = _with_model_policies(cfg, _kept_exports(saved, cfg, say))
  changed = config_changes(config_lib.to_dict(saved), config_lib.to_dict(cfg))
  if cfg.model.chat_template is None:  # (auto: the saved one is what auto chose)
    changed.pop("model.chat_template", None)
  for k, (a, b) in changed.items():
    if not (kept and k == "learner.lr_decay_steps"):
      say(f"warning: --resume changes {k}: {a} -> {b}")
  if kept:  # (set here, not by the user: said so, after the steps it follows from)
    say(f"note: --resume keeps the cosine schedule's horizon at the {horizon} steps the "
        f"run began with (learner.lr_decay_steps={horizon}, set for you: the learning rate "
        "would jump); give learner.lr_decay_steps=N to decay over another")
  return cfg

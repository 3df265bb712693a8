"""`python -m jaxagent.train --resume` after SIGKILLs: during the steps, while an
export replaces an existing version, during a checkpoint save, and from a corrupt
latest checkpoint. The run's records come out as if it had never stopped."""

import glob
import json
import os
import random
import re
import signal
import struct
import subprocess
import sys
import time
import types

import numpy as np
import pytest
import orbax.checkpoint as ocp

from jaxagent.trajectory import read_jsonl
from tests.conftest import REPO
from tests.test_train_cli import SMALL, read_metrics

STEPS = 12
SETTINGS = ["--config", "configs/tiny.yaml", f"steps={STEPS}", "checkpoint.keep=2", *SMALL]

# Runs the trainer; KILL_AT=replace SIGKILLs it once an export being replaced is set
# aside (before the new one is renamed in), KILL_AT=save while its second checkpoint
# save is under way.
TRAIN = """
import os, signal, sys
from jaxagent import checkpoint, train, training_run

def die():
  os.kill(os.getpid(), signal.SIGKILL)

if os.environ.get("KILL_AT") == "replace":
  rename = os.rename
  def rename_then_die(src, dst):
    rename(src, dst)
    if dst.endswith(checkpoint.ASIDE):
      die()
  os.rename = rename_then_die
elif os.environ.get("KILL_AT", "").startswith("wal"):
  # The n-th turn committed after the first checkpoint save: killed before its step.
  from jaxagent import wal
  turn, save, turns = wal.EpisodeLog.turn, checkpoint.RunCheckpointer.save, []
  def save_and_count(self, *args, **kwargs):
    save(self, *args, **kwargs)
    turns.append(0)
  def turn_then_die(self, *args):
    turn(self, *args)
    if turns:
      turns.append(1)
      if sum(turns) == int(os.environ["KILL_AT"][3:]):
        die()
  checkpoint.RunCheckpointer.save = save_and_count
  wal.EpisodeLog.turn = turn_then_die
elif os.environ.get("KILL_AT") == "exportfail":
  # The disk is full when step 3's policy is exported: after the step, before its
  # metrics row and trajectories are written.
  export = checkpoint.export_policy
  def export_or_fail(root, version, *args, **kwargs):
    if version == 3:
      raise OSError(28, "No space left on device")
    return export(root, version, *args, **kwargs)
  checkpoint.export_policy = export_or_fail
elif os.environ.get("KILL_AT") == "syncfail":
  # The disk fails as the run's records are forced to it before a checkpoint.
  def sync_fails(path):
    raise OSError(5, "Input/output error", path)
  training_run.sync_file = sync_fails
elif os.environ.get("KILL_AT") == "batchfail":
  # Step 4's batch cannot be made (a bug): after its groups were taken for it.
  pack_groups, calls = training_run.pack_groups, []
  def pack_or_fail(*args, **kwargs):
    calls.append(1)
    if len(calls) == 4:
      raise RuntimeError("a bug in making step 4's batch")
    return pack_groups(*args, **kwargs)
  training_run.pack_groups = pack_or_fail
elif os.environ.get("KILL_AT") == "notrain":
  # Every group from policy version 3 on is filtered (no signal), and the first step that
  # trains nothing is followed by a SIGTERM.
  from jaxagent import scheduler
  refused, nothing = scheduler.RolloutScheduler._refused, training_run.TrainingRun._nothing_trained
  def refuse_from_3(self, group):
    return refused(self, group) or ("no_signal" if self.version >= 3 else None)
  def nothing_then_stop(self, info):
    nothing(self, info)
    os.kill(os.getpid(), signal.SIGTERM)
  scheduler.RolloutScheduler._refused = refuse_from_3
  training_run.TrainingRun._nothing_trained = nothing_then_stop
elif os.environ.get("KILL_AT") == "save":
  save, saves = checkpoint.RunCheckpointer.save, []
  def save_then_die(self, step, *args, **kwargs):
    save(self, step, *args, **kwargs)
    saves.append(step)
    if len(saves) == 2:
      die()
  checkpoint.RunCheckpointer.save = save_then_die
sys.exit(train.main(sys.argv[1:]))
"""


def start(run_dir, *args, kill_at=None, overrides=()):
  # (the session's persistent compilation cache, conftest.py's: the tests' runs after the
  # first load their executables; a cache of each test's own compiled each test anew)
  env = dict(os.environ, KILL_AT=kill_at or "")
  log = open(os.path.join(os.path.dirname(run_dir), f"log{time.monotonic_ns()}.txt"), "w+")
  proc = subprocess.Popen([sys.executable, "-c", TRAIN, *SETTINGS, *overrides, "--run-dir",
                           run_dir, *args],
                          cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
  return proc, log


def finish(proc, log, timeout=240):
  proc.wait(timeout=timeout)
  log.seek(0)
  out = log.read()
  log.close()
  return proc.returncode, out


def complete_rows(run_dir):
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [line for line in f if line.endswith("\n")]


def tensorboard_points(logdir, tag):
  """The steps TensorBoard shows for `tag`: event files in name order, where a session
  START at step s drops the points from step s on written before it (its purge)."""
  from tensorboardX.proto import event_pb2

  steps = []
  for name in sorted(os.listdir(logdir)):
    with open(os.path.join(logdir, name), "rb") as f:
      data = f.read()
    i = 0
    while i + 12 <= len(data):  # TFRecords: length, its CRC, the event, its CRC
      (n,) = struct.unpack("<Q", data[i:i + 8])
      if i + 16 + n > len(data):
        break  # cut short by a kill
      event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
      i += 16 + n
      if event.session_log.status == event_pb2.SessionLog.START:
        steps = [s for s in steps if s < event.step]
      steps += [event.step for v in event.summary.value if v.tag == tag]
  return steps


@pytest.mark.slow
def test_sigkilled_run_resumes_with_every_step_once(tmp_path):
  run_dir = str(tmp_path / "run")
  ckpts, policy = os.path.join(run_dir, "checkpoints"), os.path.join(run_dir, "policy")

  # 1. Killed at a random moment once a checkpoint is down and a step is past it.
  proc, log = start(run_dir)
  deadline = time.time() + 180
  while not (os.path.isdir(os.path.join(ckpts, "2")) and len(complete_rows(run_dir)) >= 3):
    assert proc.poll() is None, finish(proc, log)[1][-3000:]
    assert time.time() < deadline, "no checkpoint and step past it within 180 s"
    time.sleep(0.05)
  time.sleep(random.uniform(0, 0.4))
  proc.send_signal(signal.SIGKILL)
  assert finish(proc, log)[0] == -signal.SIGKILL

  # 2. Killed while the resume's export replaces the version it restored: the old
  # export is set aside, the new one not yet in.
  rc, out = finish(*start(run_dir, "--resume", kill_at="replace"))
  assert rc == -signal.SIGKILL, out[-3000:]
  restored = int(re.search(r"resumed from step (\d+)", out).group(1))
  assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, restored + 1))
  assert {f"v{restored:08d}.old", f"v{restored:08d}.new"} <= set(os.listdir(policy))

  # 3. Killed during a checkpoint save: Orbax's unfinished directory is left.
  rc, out = finish(*start(run_dir, "--resume", kill_at="save"))
  assert rc == -signal.SIGKILL, out[-3000:]
  assert f"resumed from step {restored} " in out
  assert any(".orbax-checkpoint-tmp" in d for d in os.listdir(ckpts)), os.listdir(ckpts)
  steps = sorted(int(d) for d in os.listdir(ckpts) if d.isdigit())
  assert len(steps) == 2 and steps[-1] == restored + 2, os.listdir(ckpts)

  # 4. The latest checkpoint cut short: the run goes on from the one before, saying so
  # in one line.
  data = max(glob.glob(os.path.join(ckpts, str(steps[-1]), "state", "**", "d", "*"),
                       recursive=True), key=os.path.getsize)
  with open(data, "r+b") as f:
    f.truncate(os.path.getsize(data) // 2)
  rc, out = finish(*start(run_dir, "--resume"))
  assert rc == 0, out[-3000:]
  warnings = [line for line in out.splitlines() if "unreadable" in line]
  assert len(warnings) == 1 and re.fullmatch(
      rf"warning: checkpoint step {steps[-1]} unreadable \(.+\); using step {steps[0]}",
      warnings[0]), warnings
  assert "Traceback" not in out and f"resumed from step {steps[0]} " in out

  rows = read_metrics(run_dir)
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  wall = [r["wall_time_s"] for r in rows]
  assert wall == sorted(wall), wall
  held = [r["loop_held_s"] for r in rows]  # (a run's total: a resume went on from 0)
  assert held == sorted(held), held
  assert [r["policy_version"] for r in rows] == list(range(1, STEPS + 1))
  traj_steps = [row["step"] for row in read_jsonl(os.path.join(run_dir,
                                                              "trajectories.jsonl.gz"))]
  assert traj_steps == sorted(traj_steps) and set(traj_steps) == set(range(1, STEPS + 1))
  assert tensorboard_points(os.path.join(run_dir, "tensorboard"), "loss") == list(
      range(1, STEPS + 1))

  # Every version is registered once, whole, and the last holds the final weights.
  with open(os.path.join(policy, "versions.json")) as f:
    versions = json.load(f)["versions"]
  assert [v["version"] for v in versions] == list(range(1, STEPS + 1))
  assert sorted(os.listdir(policy)) == [f"v{v:08d}" for v in range(1, STEPS + 1)] + [
      "versions.json"]
  with ocp.StandardCheckpointer() as ckptr:
    exports = [ckptr.restore(v["path"]) for v in versions]
  final = ocp.CheckpointManager(ckpts).restore(
      STEPS, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
  for k, v in exports[-1].items():
    np.testing.assert_array_equal(np.asarray(v), np.asarray(final["params"][k]))


@pytest.mark.slow
def test_a_resumed_run_replays_its_episodes_in_flight_from_the_token_wal(tmp_path):
  """Killed right after a turn is committed (before its environment step): the resumed
  run replays the logged turns of its episodes in flight instead of sampling them again,
  and never those of episodes a checkpoint has trained on, nor, once resumed and killed
  again, those its own groups replayed and trained on (red team 13, then a reviewer:
  such logs outlive a save until the next one, or sit set aside, and a new group of the
  same task replayed one: trained twice, tokens, log-probs, versions and all)."""
  run_dir = str(tmp_path / "run")
  with open("envs/tasks/guess_number.jsonl") as f:
    (tmp_path / "one.jsonl").write_text(f.readline())
  # (the kill comes after the save is whole; one task: every group's episodes are that
  # task's, so each trained log could be taken; weights synced every 6 steps keep an
  # old episode from being dropped as stale)
  sync_saves = ["checkpoint.async_save=false", f"data.tasks={tmp_path / 'one.jsonl'}",
                "rollout.sync_every=6"]
  proc, log = start(run_dir, kill_at="wal10", overrides=sync_saves)
  code, out = finish(proc, log)
  assert code == -signal.SIGKILL, out
  logs = glob.glob(os.path.join(run_dir, "wal", "*.jsonl"))
  assert logs
  rows = read_metrics(run_dir)
  assert rows and rows[-1]["step"] >= 2, out
  # The groups the checkpoint trained on are listed with it; their logs outlive it.
  with open(os.path.join(run_dir, "checkpoints", "2", "meta", "metadata")) as f:
    (consumed,) = json.load(f)["wal_consumed_by_process"]
  consumed = {k.split("/")[1] for k in consumed}
  segs = list(read_jsonl(os.path.join(run_dir, "trajectories.jsonl.gz")))
  assert {s["group_id"] for s in segs if s["step"] <= 2} <= consumed
  assert consumed & {os.path.basename(p)[:-len(".jsonl")] for p in logs}
  # Resumed, and killed again just after its own first checkpoint (step 4).
  proc, log = start(run_dir, "--resume", kill_at="wal1", overrides=sync_saves)
  code, out = finish(proc, log)
  assert code == -signal.SIGKILL and "resumed from step 2" in out, out[-3000:]
  m = re.search(r"token WAL: (\d+) logged episodes \((\d+) turns\) to replay", out)
  assert m and int(m.group(2)) > 0, out
  proc, log = start(run_dir, "--resume", overrides=sync_saves)
  code, out = finish(proc, log)
  assert code == 0 and "resumed from step 4" in out, out[-3000:]
  rows = read_metrics(run_dir)
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  assert sum(r.get("wal_replayed_turns", 0) for r in rows) > 0
  segs = list(read_jsonl(os.path.join(run_dir, "trajectories.jsonl.gz")))

  def sampled(s):  # what the policy sampled in a segment, and which weights sampled it
    m = [i for i, x in enumerate(s["loss_mask"]) if x]
    return (s["task_id"], tuple(s["tokens"]), tuple(s["rollout_logp"][i] for i in m),
            tuple(s["versions"][i] for i in m))

  first = {}
  for s in segs:  # no episode trained at two steps
    assert first.setdefault(sampled(s), s["step"]) == s["step"], (s["group_id"], s["step"])


@pytest.mark.slow
def test_groups_played_after_the_last_trained_step_are_counted_once_over_a_resume(tmp_path):
  """A reviewer: a stop after a step that trained nothing (every group filtered) let the
  final save consume that step's groups, and no row of either run counted them (their
  drops were counted in the totals all the same). They are saved as in flight: the
  resume plays them again from their logs and its rows count each group once."""
  run_dir = str(tmp_path / "run")
  code, out = finish(*start(run_dir, kill_at="notrain", overrides=["steps=5"]))
  assert code == 128 + signal.SIGTERM, out[-3000:]
  rows = read_metrics(run_dir)
  assert [r["step"] for r in rows] == [1, 2, 3], out[-3000:]
  assert os.path.isdir(os.path.join(run_dir, "checkpoints", "3"))  # (the final save)
  code, out = finish(*start(run_dir, "--resume", overrides=["steps=5"]))
  assert code == 0 and "resumed from step 3 " in out, out[-3000:]
  m = re.search(r"(\d+) tasks re-queued", out)
  assert m and int(m.group(1)) >= 8, out[-3000:]  # (max_sample_rounds x 2 groups, at least)
  rows = read_metrics(run_dir)
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
  # Every group a row counts and did not train is a drop the totals count, no more.
  left = sum(r["groups"] - r["groups_accepted"] for r in rows)
  assert left == sum(rows[-1][f"dropped_{k}"] for k in (
      "no_signal", "too_few_valid", "stale", "future_version")), rows[-1]
  assert sum(r.get("wal_replayed_turns", 0) for r in rows) > 0


@pytest.mark.slow
def test_a_step_is_saved_with_its_records_and_logs_outlive_saves(tmp_path):
  """Nothing is lost (a chaos helper's findings): a step that failed after the learner
  step but before its metrics row and trajectories gets them written on the way out,
  then its checkpoint (it was checkpointed without them: a resume went on past the
  step, its records lost for good); the token WAL keeps the episodes of an asynchronous
  save until it is finalised (they were let go when it began: a kill before it was whole
  resumed from the save before, without them); group numbers go on over a resume, so
  session ids stay unique."""
  run_dir = str(tmp_path / "run")
  rc, out = finish(*start(run_dir, kill_at="exportfail"))
  assert rc == 3 and "No space left on device); the disk is full" in out, out[-3000:]
  assert "warning: policy version 3 could not be exported" in out, out[-3000:]
  ckpts = os.path.join(run_dir, "checkpoints")
  assert sorted(d for d in os.listdir(ckpts) if d.isdigit()) == ["2", "3"]
  assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]
  segs = list(read_jsonl(os.path.join(run_dir, "trajectories.jsonl.gz")))
  assert sorted({s["step"] for s in segs}) == [1, 2, 3]

  # Killed right after its second save (step 6) began: the one before (4) is whole.
  rc, out = finish(*start(run_dir, "--resume", kill_at="save"))
  assert rc == -signal.SIGKILL and "resumed from step 3 " in out, out[-3000:]

  rc, out = finish(*start(run_dir, "--resume"))
  assert rc == 0, out[-3000:]
  restored = int(re.search(r"resumed from step (\d+)", out).group(1))
  m = re.search(r"token WAL: (\d+) logged episodes \((\d+) turns\)", out)
  assert restored == 4 and m and int(m.group(2)) > 0, out[-3000:]
  rows = read_metrics(run_dir)
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  assert sum(r.get("wal_replayed_turns", 0) for r in rows) > 0
  segs = list(read_jsonl(os.path.join(run_dir, "trajectories.jsonl.gz")))
  assert sorted({s["step"] for s in segs}) == list(range(1, STEPS + 1))
  assert len({s["segment_id"] for s in segs}) == len(segs)  # no id twice over the run

  # The last step's row torn after its checkpoint was saved (a host's crash): the resume
  # goes on from the checkpoint before, and trains the step again (it went on from the
  # last one, the step never recorded: red team 38).
  path = os.path.join(run_dir, "metrics.jsonl")
  with open(path) as f:
    lines = f.readlines()
  with open(path, "w") as f:
    f.write("".join(lines[:-1]) + lines[-1][:40])
  rc, out = finish(*start(run_dir, "--resume", overrides=[f"steps={STEPS + 1}"]))
  assert rc == 0, out[-3000:]
  assert f"and checkpoint {STEPS} is past it (the row of step {STEPS} was lost" in out \
      and f"resumed from step {STEPS - 2} " in out, out[-3000:]
  assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, STEPS + 2))

  # The records cannot be forced to the disk before step 14's checkpoint: not saved, the
  # run closed as at any stop (its final export made), one line, exit 3 (the error left
  # the run's close half done: its servers, environments and last save not closed).
  rc, out = finish(*start(run_dir, "--resume", kill_at="syncfail",
                          overrides=[f"steps={STEPS + 3}"]))
  assert rc == 3 and "Traceback" not in out, out[-3000:]
  assert out.strip().splitlines()[-1].startswith(
      f"error: the run's records in {run_dir} could not be forced to the disk before "
      f"checkpoint {STEPS + 2} (Input/output error)"), out[-3000:]
  assert max(int(d) for d in os.listdir(ckpts) if d.isdigit()) == STEPS + 1
  assert os.path.isdir(os.path.join(run_dir, "policy", f"v{STEPS + 2:08d}")), \
      os.listdir(os.path.join(run_dir, "policy"))


@pytest.mark.slow
def test_a_step_that_fails_before_its_update_gives_its_groups_back(tmp_path):
  """A step that fails after taking its groups, before its update (a bug in making its
  batch, a scorer's error): the checkpoint saved on the way out lists their tasks as in
  flight, so a resume plays them (reviewer: they were neither trained nor played again)."""
  run_dir = str(tmp_path / "run")
  rc, out = finish(*start(run_dir, kill_at="batchfail"))
  assert rc == 1 and "a bug in making step 4's batch" in out, out[-3000:]
  assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]
  with open(os.path.join(run_dir, "checkpoints", "3", "meta", "metadata")) as f:
    pending = json.load(f)["pending_tasks"]  # (saved on the way out)
  assert len(pending) == 2, pending  # (sync: step 4's two groups, nothing else in flight)


# -- what a resume checks and cuts back, unit by unit (red team 51) ---------------------


class _Vocab:
  """A tokenizer as check_weights sees one: its identity alone."""

  def __init__(self, sha: str):
    self.sha = sha

  def identity(self) -> dict:
    return {"vocab_sha256": self.sha}


def _tiny(overrides=()):
  from jaxagent import config as config_lib

  return config_lib.load(config_lib.RunConfig, os.path.join(REPO, "configs/tiny.yaml"),
                         list(overrides))


def _rows(path):
  return [r["step"] for r in read_jsonl(str(path))]


def test_cut_back_keeps_the_restored_steps_rows_and_drops_those_past_it_everywhere(tmp_path):
  """A resume from step 3 (policy version 2) keeps every row of steps up to 3 and none
  past it: in metrics.jsonl, in the trajectories (both names: a resume may change
  trajectories.compress), and keeps the exports up to version 2, registered or not.
  One row too many is a step twice in the history; one too few, a step lost."""
  import gzip

  from jaxagent.checkpoint import _write_registry, list_versions
  from jaxagent.run_dir import cut_back

  cfg = _tiny(["trajectories.compress=gzip"])
  lines = "".join(f'{{"step": {s}, "i": {i}}}\n' for i, s in enumerate([1, 2, 3, 3, 4, 5]))
  (tmp_path / "metrics.jsonl").write_text(lines)
  (tmp_path / "trajectories.jsonl").write_text(lines)  # (written before a compress change)
  (tmp_path / "trajectories.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
  root = tmp_path / "policy"
  for v in (1, 2, 3, 4):
    (root / f"v{v:08d}").mkdir(parents=True)
  _write_registry(str(root), [{"version": v, "path": str(root / f"v{v:08d}")}
                              for v in (1, 2, 3)])
  cut_back(str(tmp_path), cfg, 3, 2)
  for name in ("metrics.jsonl", "trajectories.jsonl", "trajectories.jsonl.gz"):
    assert _rows(tmp_path / name) == [1, 2, 3, 3], name
  with gzip.open(tmp_path / "trajectories.jsonl.gz", "rt") as f:  # (still gzip)
    assert len(f.read().splitlines()) == 4
  assert [v["version"] for v in list_versions(str(root))] == [1, 2]
  assert sorted(os.listdir(root)) == ["v00000001", "v00000002", "versions.json"]


def test_a_checkpoint_of_other_weights_is_refused_field_by_field_and_by_vocabulary():
  """Each field that decides the weights, and the tokenizer's vocabulary, refuses a
  checkpoint saved with another value (the restore casts and reshapes silently)."""
  from jaxagent import config as config_lib
  from jaxagent.run_dir import check_weights

  cfg = _tiny()
  mine = config_lib.to_dict(cfg)
  meta = {"config": mine, "tokenizer": {"vocab_sha256": "aaaa"}}
  check_weights(meta, cfg, _Vocab("aaaa"), 4)  # the same: nothing said
  for field in config_lib.ModelSpec.WEIGHT_FIELDS:
    other = json.loads(json.dumps(mine))
    other["model"][field] = "something else"
    with pytest.raises(config_lib.ConfigError, match=f"checkpoint step 4 .*model.{field}: "):
      check_weights({**meta, "config": other}, cfg, _Vocab("aaaa"), 4)
  with pytest.raises(config_lib.ConfigError, match="the tokenizer's vocabulary "
                     r"\(sha256 aaaa -> bbbb\)"):
    check_weights(meta, cfg, _Vocab("bbbb"), 4)


def test_a_checkpoint_of_a_config_the_run_never_had_is_said_and_one_it_had_is_not(tmp_path,
                                                                                   capsys):
  """The configs a run has had: its config.json and those a resume set aside
  (config.stepN.json): a checkpoint of any of them is the run's own; of none, a warning."""
  from jaxagent import config as config_lib
  from jaxagent.run_dir import check_provenance

  now, before = _tiny(["learner.lr=0.5"]), _tiny(["learner.lr=0.25"])
  (tmp_path / "config.json").write_text(json.dumps(config_lib.to_dict(now)))
  (tmp_path / "config.step4.json").write_text(json.dumps(config_lib.to_dict(before)))
  for cfg in (now, before):
    check_provenance({"config": config_lib.to_dict(cfg)}, now, _Vocab("x"), 4, str(tmp_path))
    assert capsys.readouterr().err == ""
  stranger = config_lib.to_dict(_tiny(["learner.lr=0.125"]))
  check_provenance({"config": stranger}, now, _Vocab("x"), 4, str(tmp_path))
  err = capsys.readouterr().err
  assert "checkpoint step 4 was saved with a config this run never had (learner.lr" in err


def test_resumes_with_changed_configs_at_one_step_keep_the_config_that_ran_to_it(tmp_path,
                                                                                capsys):
  """Three resumes at step 4, each with another config (the second and third dying before
  a checkpoint of their own): config.step4.json stays the config that ran to step 4 (the
  second resume's replaced it, and the checkpoint's own config then read as one the run
  never had; a reviewer)."""
  from jaxagent import config as config_lib
  from jaxagent.resume import write_run_config
  from jaxagent.run_dir import check_provenance, cut_back

  ran, *then = [_tiny([f"learner.lr={lr}"]) for lr in (0.5, 0.25, 0.125)]
  tok = types.SimpleNamespace(chat_template=None)
  write_run_config(ran, tok, str(tmp_path), False, 0)
  for cfg in then:
    write_run_config(cfg, tok, str(tmp_path), True, 4)
  kept = json.loads((tmp_path / "config.step4.json").read_text())
  assert kept["learner"]["lr"] == 0.5
  assert json.loads((tmp_path / "config.json").read_text())["learner"]["lr"] == 0.125
  check_provenance({"config": config_lib.to_dict(ran)}, then[-1], _Vocab("x"), 4,
                   str(tmp_path))
  assert capsys.readouterr().err == ""
  # Resumed from an earlier checkpoint (the later ones unreadable): the steps past it are
  # trained again, and the config kept at step 4 is no longer of any step (a reviewer)
  (tmp_path / "config.step2.json").write_text(json.dumps(config_lib.to_dict(ran)))
  cut_back(str(tmp_path), then[-1], 2, 0)
  assert sorted(p.name for p in tmp_path.glob("config*.json")) == [
      "config.json", "config.step2.json"]


def test_a_resume_onto_a_tasks_file_changed_in_place_says_so(tmp_path, capsys):
  """A checkpoint's data place is an index into the order its tasks file's tasks come in:
  resumed onto the file changed in place (same path, seed and shuffle), the order from
  there is another, and some of the epoch's tasks come twice or never. Nothing said so
  (a reviewer); the file's digest, saved with the checkpoint, now does."""
  from jaxagent.checkpoint import RunCheckpointer
  from jaxagent.config import LearnerConfig
  from jaxagent.data import file_digest, task_dataset, tasks_digest
  from jaxagent.learner import Learner
  from jaxagent.models.sharding import make_mesh
  from jaxagent.resume import restore
  from tests.test_learner import CFG

  path = tmp_path / "tasks.jsonl"
  path.write_text("".join(json.dumps({"id": f"t{i}", "env": "guess_number"}) + "\n"
                          for i in range(8)))
  cfg = _tiny([f"data.tasks={path}"])
  learner = Learner(CFG, LearnerConfig(), make_mesh())
  state = learner.init_state(0)
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  ckpt = RunCheckpointer(str(run_dir / "checkpoints"), keep=2, async_save=False)
  ckpt.save(1, state, {"tasks_sha256": file_digest(str(path))},  # (as saved before)
            iter(task_dataset(str(path), seed=0)))
  ckpt.wait()

  def resumed(step: int = 1) -> str:  # (a checkpoint past the records is set aside)
    (run_dir / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n'
                                                   for s in range(1, step + 1)))
    nonlocal restored
    restored = restore(ckpt, learner, state, iter(task_dataset(str(path), seed=0)), cfg,
                       _Vocab("x"), str(run_dir), True)
    return capsys.readouterr().err

  restored = None
  assert "tasks file" not in resumed()
  assert restored.task_order == 1  # (saved before the order was recorded: its own order)
  path.write_text(path.read_text() + json.dumps({"id": "t8", "env": "guess_number"}) + "\n")
  said = resumed()  # (step: the state's own, 0 for these initial weights)
  assert f"the tasks file {path} is not the one checkpoint step" in said
  assert "(its content changed)" in said
  # Saved now, the digest is of the tasks' values: an edit that changes none of them (a
  # blank line, spacing, a key's place) is no change (it warned of another order).
  ckpt.save(2, state, {"tasks_digest": tasks_digest(str(path))},
            iter(task_dataset(str(path), seed=0)))
  ckpt.wait()
  path.write_text("\n" + "".join(json.dumps(dict(reversed(json.loads(line).items())),
                                            indent=1).replace("\n", " ") + "\n\n"
                                 for line in path.read_text().splitlines()))
  assert "tasks file" not in resumed(2)
  path.write_text(path.read_text().replace('"t8"', '"t9"'))
  assert "(its content changed)" in resumed(2)
  ckpt.close()


def test_a_canary_differs_by_tokens_rewards_log_probs_past_the_tolerance_or_count():
  from jaxagent.run_dir import CANARY_LOGP_ATOL, compare_canary

  assert CANARY_LOGP_ATOL == 1e-4
  ep = {"task": "t", "tokens": [1, 2, 3], "rewards": [0.0, 1.0], "logp": [-0.5, -1.0]}
  assert compare_canary([ep], [dict(ep)]) is None
  assert compare_canary([ep], [{**ep, "logp": [-0.5, -1.0 + 0.9e-4]}]) is None
  for logp in ([-0.5, -1.0 + 1.5e-4], [-0.5, -1.0 - 1.5e-4]):  # (either way)
    assert "log-probs differ by up to 1.50e-04" in compare_canary([ep], [{**ep, "logp": logp}])
  assert "sampled other tokens" in compare_canary([ep], [{**ep, "tokens": [1, 2, 4]}])
  assert "rewards [0.0, 0.5]" in compare_canary([ep], [{**ep, "rewards": [0.0, 0.5]}])
  assert compare_canary([ep, ep], [ep]) == "1 canary episodes instead of 2"


def test_config_changes_are_every_field_but_the_service_addresses():
  from jaxagent.run_dir import config_changes

  assert config_changes({"learner": {"lr": 1}, "serving": {"urls": ["a"]}, "x": {}},
                        {"learner": {"lr": 2}, "serving": {"urls": ["b"]}, "x": {}}) == {
                            "learner.lr": (1, 2)}


def test_a_checkpoint_set_aside_is_no_checkpoint_of_the_run(tmp_path):
  from jaxagent.run_dir import has_checkpoint

  (tmp_path / "checkpoints" / "4.unreadable").mkdir(parents=True)
  (tmp_path / "checkpoints" / "6.unrecorded").mkdir()
  assert not has_checkpoint(str(tmp_path))
  (tmp_path / "checkpoints" / "2").mkdir()
  assert has_checkpoint(str(tmp_path))

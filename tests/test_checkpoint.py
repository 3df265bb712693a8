import glob
import os
import re
import shutil
import subprocess
import sys
import textwrap

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent.checkpoint import (CheckpointUnreadable, IteratorAt, RunCheckpointer,
                                 abstract_params_like,
                                 drop_versions_after, export_policy, latest_version,
                                 list_versions, load_policy, version_dir)
from jaxagent.config import LearnerConfig
from jaxagent.data import take
from jaxagent.learner import Learner
from jaxagent.models.sharding import make_mesh
from tests.test_learner import CFG, make_batch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def equal(a, b):
  return all(jax.tree.leaves(jax.tree.map(
      lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), a, b)))


def data_iter():
  return iter(grain.MapDataset.range(1000).shuffle(seed=7).map(
      lambda i: {"seed": int(i)}).to_iter_dataset())


def batch_from(items):
  return make_batch(seed=sum(x["seed"] for x in items))


def test_restore_then_step_is_bitwise_identical(tmp_path):
  learner = Learner(CFG, LearnerConfig(correction_mode="truncate"), make_mesh())
  ckpt = RunCheckpointer(str(tmp_path / "ckpt"), keep=2, async_save=True)
  meta = {"tokenizer": {"vocab_sha256": "abc"}, "buffer_cursor": 17}

  # Never stopping: three steps.
  it = data_iter()
  state = learner.init_state(0)
  state, _ = learner.step(state, batch_from(take(it, 2)))
  ckpt.save(1, state, meta, it)
  ckpt.wait()
  for _ in range(2):
    state, _ = learner.step(state, batch_from(take(it, 2)))
  live = jax.device_get(state)

  # Stopping after step 1: restore state and data position, take the same two steps.
  it2 = data_iter()
  restored, got_meta = ckpt.restore(learner.abstract_state(), it2)
  assert got_meta == meta
  assert int(restored.step) == 1
  for _ in range(2):
    restored, _ = learner.step(restored, batch_from(take(it2, 2)))
  assert equal(jax.device_get(restored), live)
  ckpt.close()


def test_a_checkpoint_keeps_the_iterators_place_when_its_save_began(tmp_path):
  """A checkpoint's tasks in flight are taken when its save begins, the rollouts going on
  meanwhile (the canary episodes, the records' sync): the iterator's place must be that
  instant's too (`IteratorAt`). Read at the save, it was past a group started meanwhile
  that the tasks in flight did not list, and a resume never played that task (a
  reviewer)."""
  learner = Learner(CFG, LearnerConfig(), make_mesh())
  state = learner.init_state(0)
  ckpt = RunCheckpointer(str(tmp_path / "ckpt"), keep=2, async_save=True)
  it = data_iter()
  take(it, 3)
  at = IteratorAt(it)  # (the save begins)
  started_meanwhile = take(it, 2)
  ckpt.save(1, state, {}, at)
  ckpt.wait()
  again = data_iter()
  ckpt.restore(learner.abstract_state(), again)
  assert take(again, 2) == started_meanwhile
  ckpt.close()


def test_keeps_last_n_and_latest(tmp_path):
  learner = Learner(CFG, LearnerConfig(), make_mesh())
  state = learner.init_state(0)
  ckpt = RunCheckpointer(str(tmp_path / "ckpt"), keep=2, async_save=True)
  for step in range(1, 5):
    ckpt.save(step, state, {"step": step})
  ckpt.wait()
  assert ckpt.all_steps() == [3, 4] and ckpt.latest_step() == 4
  _, meta = ckpt.restore(learner.abstract_state())
  assert meta == {"step": 4}
  ckpt.close()
  with pytest.raises(FileNotFoundError):
    RunCheckpointer(str(tmp_path / "empty")).restore(learner.abstract_state())


def test_a_checkpoint_on_a_full_disk_fails_in_one_line(tmp_path):
  """A save that cannot be written (here a full tmpfs) is CheckpointFailed naming the
  full disk, from the save, from check() or from wait(), not Orbax's error left to a
  background thread while the run trained on (an operator round: 1,742 lines of
  tracebacks and no summary)."""
  import subprocess

  from jaxagent.checkpoint import CheckpointFailed

  disk = tmp_path / "disk"
  disk.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                    capture_output=True).returncode != 0:
    pytest.skip("needs root to mount a small tmpfs")
  try:
    with open(disk / "filler", "wb", buffering=0) as f:  # (the disk full but a few KB)
      try:
        while True:
          f.write(b"x" * 4096)
      except OSError:
        pass
    os.truncate(disk / "filler", os.path.getsize(disk / "filler") - 16384)
    learner = Learner(CFG, LearnerConfig(), make_mesh())
    ckpt = RunCheckpointer(str(disk / "ckpt"), keep=2, async_save=True)
    state = learner.init_state(0)
    with pytest.raises(CheckpointFailed) as e:  # (Orbax loses some failures of a save:
      for step in (1, 2, 3):                    # the next one meets the full disk then)
        ckpt.save(step, state, {"step": step})
        ckpt.wait()
    assert "the disk is full: free space there, then resume" in str(e.value)
    assert str(e.value).startswith("checkpoint step ")
    assert " could not be written in " in str(e.value)
    assert ckpt.failed is e.value and "\n" not in str(e.value)  # (train raises it at the end)
    ckpt.close()
  finally:
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_step_another_process_could_not_read_is_not_fingerprinted_here(tmp_path,
                                                                          monkeypatch):
  """A reviewer: the fingerprint check (a reduction over arrays every process holds a
  part of) ran inside each process's read, before the processes agreed that every one
  had read the step: one whose read failed went to the agreement while the others were
  in the check's collective. The check runs once every process has read the step, and
  together."""
  from jaxagent import checkpoint, distributed

  learner = Learner(CFG, LearnerConfig(), make_mesh())
  state = learner.init_state(0)
  ckpt = RunCheckpointer(str(tmp_path / "ckpt"), keep=3, async_save=False)
  for step in (1, 2):
    ckpt.save(step, state, {"step": step})
  ckpt.close()
  checked, agreements = [], []
  check = checkpoint.fingerprint_mismatch
  monkeypatch.setattr(checkpoint, "fingerprint_mismatch", lambda state, saved: (
      checked.append(len(agreements)), check(state, saved))[1])

  def another_failed_step_2(value):  # (step 2's read failed on another process)
    agreements.append(value)
    return True if len(agreements) == 1 else value

  monkeypatch.setattr(distributed, "agree_max", another_failed_step_2)
  ckpt = RunCheckpointer(str(tmp_path / "ckpt"), keep=3)
  _, meta, skipped = ckpt.restore_latest_readable(learner.abstract_state())
  assert meta == {"step": 1} and skipped == [(2, "unreadable on another process")]
  assert checked == [2]  # (step 1's alone, after every process read it)
  ckpt.close()


def test_unreadable_latest_checkpoint_falls_back(tmp_path, capfd):
  learner = Learner(CFG, LearnerConfig(), make_mesh())
  state = learner.init_state(0)
  ckpt = RunCheckpointer(str(tmp_path / "ckpt"), keep=3, async_save=False)
  for step in (1, 2, 3):
    ckpt.save(step, state, {"step": step})
  ckpt.close()
  # Step 3's array files cut in half (many reads fail at once), step 2's metadata JSON
  # cut short.
  data = glob.glob(str(tmp_path / "ckpt" / "3" / "state" / "**" / "d" / "*"), recursive=True)
  for path in (*data, str(tmp_path / "ckpt" / "2" / "meta" / "metadata")):
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)

  ckpt = RunCheckpointer(str(tmp_path / "ckpt"), keep=3)
  _, meta, skipped = ckpt.restore_latest_readable(learner.abstract_state())
  assert meta == {"step": 1} and [s for s, _ in skipped] == [3, 2]
  for _, reason in skipped:
    assert "\n" not in reason and len(reason) <= 120, reason
  assert "JSONDecodeError" in skipped[1][1]
  err = capfd.readouterr().err  # the abandoned reads say nothing
  assert "Traceback" not in err and "never awaited" not in err
  # Set aside, so the resumed run saves those steps again.
  assert ckpt.all_steps() == [1]
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["1", "2.unreadable", "3.unreadable"]
  ckpt.save(2, state, {"step": 2})
  ckpt.close()

  with open(str(tmp_path / "ckpt" / "1" / "meta" / "metadata"), "w") as f:
    f.write("{")
  ckpt = RunCheckpointer(str(tmp_path / "ckpt"), keep=3)
  with open(str(tmp_path / "ckpt" / "2" / "meta" / "metadata"), "w") as f:
    f.write("{")
  with pytest.raises(CheckpointUnreadable, match="step 2: JSONDecodeError.*; step 1: "):
    ckpt.restore_latest_readable(learner.abstract_state())
  assert ckpt.all_steps() == [1, 2]  # nothing moved when nothing reads back
  ckpt.close()


def test_checkpoints_past_the_steps_the_records_hold_are_set_aside_on_a_resume(tmp_path,
                                                                             capfd):
  """A checkpoint is saved after its step's metrics row: one past the rows means rows
  were lost (a torn last line, a host's crash before they reached the disk, the file
  removed), and a resume from it left those steps out of metrics.jsonl for good, without
  a word (red team 38). It goes on from the newest checkpoint the rows reach, saying so;
  with none, it refuses naming the file."""
  from jaxagent.metrics import RecordsDamaged, last_step
  from jaxagent.resume import set_aside_unrecorded

  learner = Learner(CFG, LearnerConfig(), make_mesh())
  state = learner.init_state(0)
  run = tmp_path / "run"
  ckpt = RunCheckpointer(str(run / "checkpoints"), keep=3, async_save=False)
  for step in (2, 4, 6):
    ckpt.save(step, state, {"step": step})
  metrics = run / "metrics.jsonl"
  rows = "".join(f'{{"step": {i}, "loss": 0.5}}\n' for i in range(1, 7))
  metrics.write_text(rows)
  set_aside_unrecorded(ckpt, str(run))  # every step recorded: nothing moves
  assert ckpt.all_steps() == [2, 4, 6] and capfd.readouterr().err == ""

  metrics.write_text(rows[:rows.index('{"step": 4')] + '{"step": 4, "lo')  # 4 torn, 5-6 lost
  assert last_step(str(metrics)) == 3
  set_aside_unrecorded(ckpt, str(run))
  assert ckpt.all_steps() == [2]
  assert sorted(os.listdir(run / "checkpoints")) == ["2", "4.unrecorded", "6.unrecorded"]
  err = capfd.readouterr().err
  assert err.startswith(f"warning: {metrics} records the steps up to 3, and checkpoints 4, "
                        "6 are past it (the rows of steps 4-6 were lost") and \
      "resuming from step 2, the steps after it trained again" in err, err
  ckpt.save(4, state, {"step": 4})  # (the resumed run saves the step again)
  assert ckpt.all_steps() == [2, 4]

  metrics.unlink()  # every row gone: no checkpoint within them
  with pytest.raises(RecordsDamaged, match=f"{metrics} records no step and every checkpoint "
                     r"is past it \(2, 4\): the rows of steps 1-4 were lost .* move "
                     f"{run / 'checkpoints'} aside"):
    set_aside_unrecorded(ckpt, str(run))
  assert ckpt.all_steps() == [2, 4]  # (nothing moved)
  ckpt.close()


def test_policy_exports_are_registered_and_replaced_whole(tmp_path):
  learner = Learner(CFG, LearnerConfig(), make_mesh())
  state = learner.init_state(0)
  root = str(tmp_path / "policy")
  p1 = export_policy(root, 1, state.params)
  stale = jax.tree.map(jnp.copy, state.params)  # the step donates state
  state, _ = learner.step(state, make_batch())
  export_policy(root, 2, stale, dtype=None, extra={"step": 1})
  versions = list_versions(root)
  assert [v["version"] for v in versions] == [1, 2] and latest_version(root) == 2
  assert versions[0]["dtype"] == "bfloat16" and versions[1]["step"] == 1
  target = abstract_params_like(state.params, learner.param_shardings)
  v1 = load_policy(p1, abstract_params_like(state.params, learner.param_shardings, jnp.bfloat16))
  assert v1["wq"].dtype == jnp.bfloat16
  assert equal(load_policy(versions[1]["path"], target), stale)
  with pytest.raises(FileNotFoundError):
    load_policy(os.path.join(root, "v99"), target)

  # Exporting a version again replaces it (a resumed run reaching it anew).
  p2 = export_policy(root, 2, state.params, dtype=None)
  assert equal(load_policy(p2, target), state.params)
  assert [v["version"] for v in list_versions(root)] == [1, 2]
  # A crash between setting the old export aside and renaming the new one in: the
  # old one is read meanwhile, and the next export puts it back and drops the new one.
  os.rename(p2, p2 + ".old")
  export_policy(root, 3, stale, dtype=None)
  os.rename(version_dir(root, 3), p2 + ".new")
  assert equal(load_policy(p2, target), state.params)
  export_policy(root, 3, stale, dtype=None)
  assert sorted(os.listdir(root)) == ["v00000001", "v00000002", "v00000003", "versions.json"]
  assert equal(load_policy(p2, target), state.params)

  # A resumed run at version 1 drops the newer exports, registered or not.
  export_policy(root, 4, stale)
  os.rename(version_dir(root, 4), version_dir(root, 5))
  assert drop_versions_after(root, 1) == [2, 3, 5]
  assert [v["version"] for v in list_versions(root)] == [1]
  assert sorted(os.listdir(root)) == ["v00000001", "versions.json"]


def test_an_export_of_another_model_or_damaged_or_unregistered_is_named(tmp_path):
  """Red team 25: an export read with another model's config said Orbax's "set
  strict=False" (advice that would load it wrongly); a damaged one was a traceback or a
  TensorStore spec; a broken registry's error named no file; an empty one said
  "policy version None"."""
  from rollout_server.serving import resolve_policy

  learner = Learner(CFG, LearnerConfig(), make_mesh())
  params = learner.init_state(0).params
  root = str(tmp_path / "policy")
  path = export_policy(root, 1, params, dtype=None)
  target = abstract_params_like(params, learner.param_shardings)
  other = dict(target, embed=jax.ShapeDtypeStruct((7, 3), jnp.float32,
                                                  sharding=target["embed"].sharding))
  with pytest.raises(ValueError, match=r"holds another model's weights than the config's "
                     r"\(\['embed'\]: stored \(\d+, \d+\), wanted \(7, 3\)\)"):
    load_policy(path, other)
  shutil.rmtree(os.path.join(path, "ocdbt.process_0"))
  with pytest.raises(ValueError, match="cannot be read \\(damaged or partial: "):
    load_policy(path, target)
  with open(os.path.join(root, "versions.json"), "w") as f:
    f.write('{"versi')
  with pytest.raises(ValueError, match="the policy registry .*versions.json cannot be read"):
    resolve_policy(root)
  with open(os.path.join(root, "versions.json"), "w") as f:
    f.write('{"versions": []}')
  with pytest.raises(FileNotFoundError, match="holds no policy export yet"):
    resolve_policy(root)
  # A run's checkpoint given for a policy export (a new user: "give a version", which the
  # server's command line has no way to; through /update_weights, Orbax's internals).
  step = tmp_path / "run" / "checkpoints" / "470"
  for item in ("state", "meta"):
    (step / item).mkdir(parents=True)
  for given in (step, step.parent):
    for version in (None, 471):
      with pytest.raises(ValueError, match=re.escape(
          f"is a run's checkpoint (its training state), not a policy export: give the "
          f"run's exports, {tmp_path / 'run' / 'policy'} (the latest)")):
        resolve_policy(str(given), version)
  with pytest.raises(ValueError, match="a policy export is a version directory "):
    resolve_policy(str(tmp_path / "run"))
  # A version directory that is not there was returned as it was, for every caller (a
  # server's weight update, eval, export_hf) to fail on deep in the load; a registry's
  # version dropped since (a transient export) likewise.
  with pytest.raises(FileNotFoundError, match=r"no such export .*v00000009"):
    resolve_policy(str(tmp_path / "policy" / "v00000009"))
  root = str(tmp_path / "again")
  export_policy(root, 1, params, dtype=None)
  shutil.rmtree(export_policy(root, 2, params, dtype=None))
  with pytest.raises(FileNotFoundError, match=r"policy version 2 is in .*again's registry "
                     r"but its directory .*v00000002 is gone"):
    resolve_policy(root)
  assert resolve_policy(root, 1) == (os.path.join(root, "v00000001"), 1)
  # One a crash left aside while replacing it stands (`load_policy` reads it; a reviewer).
  os.rename(os.path.join(root, "v00000001"), os.path.join(root, "v00000001.old"))
  assert resolve_policy(root, 1) == (os.path.join(root, "v00000001"), 1)
  assert resolve_policy(os.path.join(root, "v00000001")) == (os.path.join(root, "v00000001"), 1)


def test_policy_restores_onto_a_different_mesh(tmp_path, multidevice):
  out = multidevice(f"""
    import jax, numpy as np
    from jax.sharding import PartitionSpec as P
    from jaxagent.checkpoint import export_policy, load_policy, abstract_params_like
    from jaxagent.models.params import init_params, param_shardings
    from jaxagent.models.sharding import SAMPLE_RULES, make_mesh
    from tests.test_learner import CFG
    writer = make_mesh(2, 4, 1)  # FSDP-sharded training layout
    params = init_params(CFG, 3, writer)
    assert params["wq"].sharding.spec == P(None, "fsdp", "tensor", None)
    path = export_policy({str(tmp_path)!r}, 5, params, dtype=None)
    reader = make_mesh(4, 1, 2)  # the sampling layout: tensor parallel, no FSDP
    shardings = param_shardings(CFG, reader, SAMPLE_RULES)
    got = load_policy(path, abstract_params_like(params, shardings))
    assert got["wq"].sharding.spec == P(None, None, "tensor", None), got["wq"].sharding
    for k in params:
      np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(params[k]))
    print("OK")
  """)
  assert out.strip().endswith("OK")


def test_orbax_errors_keep_their_message_without_the_traceback():
  """A full disk printed hundreds of lines of Orbax's thread tracebacks above the run's
  one line (CheckpointFailed): its error records keep their message only; others are
  left as they are."""
  import logging
  import os
  import sys

  from jaxagent.checkpoint import quiet_failed_save_noise

  quiet_failed_save_noise()
  quiet_failed_save_noise()  # (once)
  (f,) = [f for f in logging.getLogger("absl").filters if type(f).__name__.endswith("OneLine")]
  try:
    raise ValueError("RESOURCE_EXHAUSTED")
  except ValueError:
    exc = sys.exc_info()
  orbax = logging.LogRecord("absl", logging.ERROR, os.path.join("x", "orbax", "a.py"), 1,
                            "save failed", None, exc)
  ours = logging.LogRecord("absl", logging.ERROR, os.path.join("x", "jaxagent", "a.py"), 1,
                           "other", None, exc)
  assert f.filter(orbax) and f.filter(ours)
  assert orbax.exc_info is None and orbax.getMessage() == "save failed"
  assert ours.exc_info is exc
  # TensorStore's spec is cut from the message, and a long one cut short; an Orbax
  # task's failure that asyncio logs (nobody awaited it) too, and its traceback dropped.
  spec = " [tensorstore_spec='{\\\"context\\\":{\\\"cache_pool\\\":{}}," + "x" * 900 + "}']"
  full = logging.LogRecord("absl", logging.ERROR, os.path.join("x", "orbax", "a.py"), 1,
                           "RESOURCE_EXHAUSTED: No space left on device [os_error_code='28']%s",
                           (spec,), exc)
  assert f.filter(full)
  assert full.getMessage() == "RESOURCE_EXHAUSTED: No space left on device [os_error_code='28']"
  from jaxagent.checkpoint import _TENSORSTORE_SPEC

  # (the spec's quoted string and no further: a spec not ending in "}" took the cause
  # with it up to another bracket's "}']", a reviewer; a repr's escaped quotes too)
  assert _TENSORSTORE_SPEC.sub("", "A [tensorstore_spec='\"x\"'] CAUSE [other='{1}']") \
      == "A CAUSE [other='{1}']"
  assert _TENSORSTORE_SPEC.sub("", "B [tensorstore_spec=\\'{\\\\\"a\\\\\":1}\\'] CAUSE')>") \
      == "B CAUSE')>"
  (g,) = [g for g in logging.getLogger("asyncio").filters if type(g).__name__.endswith("OneLine")]
  task = logging.LogRecord(
      "asyncio", logging.ERROR, os.path.join("x", "asyncio", "base_events.py"), 1,
      "Task exception was never retrieved\nfuture: <Task coro=<async_serialize_from_host() "
      f"defined at {os.path.join('x', 'orbax', 's.py')}> exception=ValueError('{'y' * 999}')>",
      None, exc)
  assert g.filter(task) and task.exc_info is None
  assert len(task.getMessage()) < 400 and re.search(r"\(\d{4} characters\)$", task.msg)
  assert task.msg.startswith("Task exception") and "y')>" in task.msg  # (and its end)
  other = logging.LogRecord("asyncio", logging.ERROR, "base_events.py", 1, "mine", None, exc)
  assert g.filter(other) and other.exc_info is exc


def test_a_failed_saves_late_completions_into_a_closed_loop_are_not_printed():
  """On a full disk TensorStore handed its failed writes' completions to Orbax's event
  loop after it closed: a traceback each ("Event loop is closed"), dozens above the run's
  one line (a full tmpfs run here). The hook drops exactly those."""
  import asyncio
  import types

  from jaxagent.checkpoint import _quiet_closed_loop_callbacks

  passed = []
  hook = _quiet_closed_loop_callbacks(passed.append)

  def unraisable(exc, obj=None):
    return types.SimpleNamespace(exc_type=type(exc), exc_value=exc,
                                 exc_traceback=exc.__traceback__, err_msg=None, object=obj)

  loop = asyncio.new_event_loop()
  loop.close()
  try:
    loop.call_soon_threadsafe(lambda: None)
  except RuntimeError as e:
    closed = e
  hook(unraisable(closed))
  assert passed == []
  try:
    raise RuntimeError("Event loop is closed")  # (the words, from elsewhere: passed on)
  except RuntimeError as e:
    elsewhere = unraisable(e)
  hook(elsewhere)
  hook(unraisable(closed, obj="a finaliser"))
  assert len(passed) == 2


def test_a_checkpoint_whose_values_do_not_read_back_as_saved_is_unreadable(tmp_path):
  """Orbax keeps no checksum: bytes flipped in a step's array file read back as other
  numbers, and the damaged step resumed as good (red team 15: the canary passed). Each
  array's fingerprint is saved with it and checked: the step counts as unreadable and
  the run falls back to the one before."""
  learner = Learner(CFG, LearnerConfig(), make_mesh())
  state = learner.init_state(0)
  ckpt = RunCheckpointer(str(tmp_path / "ckpt"), keep=3, async_save=False)
  ckpt.save(1, state, {"step": 1})
  state, _ = learner.step(state, make_batch())
  ckpt.save(2, state, {"step": 2})
  ckpt.close()
  data = glob.glob(str(tmp_path / "ckpt" / "2" / "state" / "**" / "d" / "*"), recursive=True)
  largest = max(data, key=os.path.getsize)
  raw = bytearray(open(largest, "rb").read())
  for at in (len(raw) // 3, len(raw) // 2, 2 * len(raw) // 3):
    raw[at] ^= 0x40
  open(largest, "wb").write(bytes(raw))

  ckpt = RunCheckpointer(str(tmp_path / "ckpt"), keep=3)
  restored, meta, skipped = ckpt.restore_latest_readable(learner.abstract_state())
  assert meta == {"step": 1} and [s for s, _ in skipped] == [2], skipped
  # (flipped bits that land in a compressed chunk's frame fail its decoding instead: the
  # file's layout varies from run to run; either way the step is unreadable)
  assert ("their fingerprint differs" in skipped[0][1]
          or "Error reading" in skipped[0][1]), skipped
  assert int(restored.step) == 0
  ckpt.close()


def test_a_state_with_values_that_are_not_finite_is_never_checkpointed(tmp_path):
  """The weights are checked after every step; the optimiser's state with each save,
  in the fingerprint's pass: a state a resume could not go on from is not saved."""
  import jax.numpy as jnp

  from jaxagent.errors import NonFiniteUpdate

  learner = Learner(CFG, LearnerConfig(), make_mesh())
  state = learner.init_state(0)
  bad = state.replace(opt_state=jax.tree.map(
      lambda x: x * jnp.inf if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim else x,
      state.opt_state))
  ckpt = RunCheckpointer(str(tmp_path / "ckpt"), keep=2, async_save=False)
  with pytest.raises(NonFiniteUpdate, match="state of step 1 holds values that are not "
                                            r"finite \(state\.opt_state"):
    ckpt.save(1, bad, {"step": 1})
  ckpt.save(2, state, {"step": 2})
  ckpt.close()
  assert ckpt.all_steps() == [2]


def test_an_export_is_found_by_its_version_as_a_user_writes_it(tmp_path):
  """`--policy RUN_DIR/policy/v973` names `v00000973` (it was "no such export": a new
  user); a version not there is refused naming those that are."""
  from jaxagent.checkpoint import existing_export

  root = tmp_path / "policy"
  for v in (3, 250, 500, 750, 973, 1000, 1250):
    (root / f"v{v:08d}").mkdir(parents=True)
  assert existing_export(str(root / "v973")) == str(root / "v00000973")
  assert existing_export(str(root / "v00000973")) == str(root / "v00000973")
  assert existing_export(str(root)) == str(root)
  with pytest.raises(FileNotFoundError) as e:
    existing_export(str(root / "v974"))
  assert str(e.value) == (f"no such export {root / 'v974'} ({root} holds versions 3, 250, "
                          "500, ..., 973, 1000, 1250: v1250 is the latest)")
  with pytest.raises(FileNotFoundError, match=r"^no such export \S+$"):
    existing_export(str(tmp_path / "nothing" / "v1"))
  # What servers load by (a config's served models, /update_weights) takes it too
  from rollout_server.serving import resolve_policy

  assert resolve_policy(str(root / "v973")) == (str(root / "v00000973"), 973)
  # (standing only as the copy a crash left aside, `v00000003.old`: found by either name;
  # the short one was "no such export": a reviewer)
  (root / "v00000003").rename(root / "v00000003.old")
  for name in ("v3", "v00000003"):
    assert resolve_policy(str(root / name)) == (str(root / "v00000003"), 3)


def test_a_damaged_export_is_one_line_not_pages_of_tracebacks(tmp_path):
  """A red team: an export whose arrays' files were cut short printed 60-140 lines of
  Orbax's, TensorStore's and asyncio's tracebacks and records above its error's line (in
  a command's process, with its console logging)."""
  script = textwrap.dedent(f"""
      import os, jax, jax.numpy as jnp
      from jaxagent.cli_args import log_to_console
      from jaxagent.checkpoint import export_policy, load_policy
      log_to_console()
      params = {{f"w{{i}}": jnp.ones((64, 64)) for i in range(8)}}
      path = export_policy({str(tmp_path)!r}, 1, params, dtype=None)
      for folder, _, files in os.walk(os.path.join(path, "d")):
        for name in files:
          os.truncate(os.path.join(folder, name), 10)
      abstract = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
      try:
        load_policy(path, abstract)
      except ValueError as e:
        print("error:", e, flush=True)

      async def in_a_loop():  # (as an evaluation loads it: inside uvloop's loop)
        try:
          load_policy(path, abstract)
        except ValueError as e:
          print("error:", e, flush=True)

      import uvloop
      uvloop.run(in_a_loop())
      """)
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=300, cwd=REPO)
  said = [line for line in out.stderr.splitlines() if not line.startswith("WARNING")]
  assert out.stdout.count("cannot be read (damaged or partial") == 2, (
      out.stdout + out.stderr[-2000:])
  # (none at all here; a late record of a read's future, cut to its two lines, is not
  # what this is about: the pages were tracebacks, dozens of records)
  assert len(said) <= 2 and not any("Traceback" in line for line in said), (
      "\n".join(said)[:3000])


# -- red team 51: fingerprints, set-asides, exports and their registry, unit by unit ---


def small_state(scale=1.0):
  return {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4) * scale,
          "step": jnp.int32(3), "key": jnp.arange(2, dtype=jnp.uint32)}


def abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      tree)


def test_a_fingerprint_tells_any_one_value_changed_and_any_two_swapped():
  """Every element counts, the first too, and where it is: rows or columns swapped, a
  value moved, read back as saved, are a damaged checkpoint."""
  from jaxagent.checkpoint import fingerprint

  x = jnp.arange(1, 13, dtype=jnp.float32).reshape(3, 4)
  base = fingerprint({"x": x})["['x']"]
  variants = {"first changed": x.at[0, 0].set(7.5), "last changed": x.at[2, 3].set(0.5),
              "rows swapped": x[jnp.array([1, 0, 2])],
              "columns swapped": x[:, jnp.array([1, 0, 2, 3])],
              "two values of an antidiagonal swapped": x.at[0, 1].set(x[1, 0]).at[1, 0].set(x[0, 1])}
  for what, y in variants.items():
    assert fingerprint({"x": y})["['x']"] != base, what
  z = jnp.zeros((4,), jnp.float32)  # (a zero first element: its weight is not zero)
  assert fingerprint({"z": z.at[0].set(1.0)}) != fingerprint({"z": z})


def test_one_value_that_is_not_finite_keeps_a_state_from_being_checkpointed():
  from jaxagent.checkpoint import state_prints
  from jaxagent.errors import NonFiniteUpdate

  state = small_state()
  state_prints(state, 1)
  with pytest.raises(NonFiniteUpdate, match=r"state\['w'\]"):
    state_prints({**state, "w": state["w"].at[1, 2].set(jnp.nan)}, 1)


def test_a_step_unreadable_twice_is_set_aside_again_and_the_newest_meta_is_read(tmp_path):
  """A step set aside once (`4.unreadable`), saved again by the resumed run and unreadable
  again, is set aside again (the older copy replaced): the run resumes from the step
  before, not with an error. `saved_meta` reads the newest step's."""
  from jaxagent.checkpoint import UNREADABLE

  state = small_state()
  ckpt = RunCheckpointer(str(tmp_path / "ckpt"), keep=3, async_save=False)
  for step in (2, 4):
    ckpt.save(step, state, {"step": step})
  assert ckpt.saved_meta()["step"] == 4 and ckpt.saved_meta(2)["step"] == 2
  for _ in range(2):
    with open(tmp_path / "ckpt" / "4" / "meta" / "metadata", "w") as f:
      f.write("{")
    _, meta, skipped = ckpt.restore_latest_readable(abstract(state))
    assert meta["step"] == 2 and [s for s, _ in skipped] == [4]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["2", f"4{UNREADABLE}"]
    ckpt.save(4, state, {"step": 4})
    assert ckpt.all_steps() == [2, 4]
  ckpt.close()


def test_a_save_cut_short_is_removed_when_the_directory_is_opened(tmp_path):
  """What a crash left of a save under way (an Orbax temporary directory) is no step, and
  goes once the next run opens the directory (by its first save)."""
  state = small_state()
  ckpt = RunCheckpointer(str(tmp_path / "ckpt"), keep=3, async_save=False)
  ckpt.save(2, state, {"step": 2})
  ckpt.close()
  partial = tmp_path / "ckpt" / "3.orbax-checkpoint-tmp"
  shutil.copytree(tmp_path / "ckpt" / "2", partial)
  ckpt = RunCheckpointer(str(tmp_path / "ckpt"), keep=3)
  assert ckpt.all_steps() == [2]
  _, meta, skipped = ckpt.restore_latest_readable(abstract(state))
  assert meta["step"] == 2 and skipped == []
  ckpt.save(4, state, {"step": 4})  # (Orbax removes it in the background, done by a save)
  ckpt.close()
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["2", "4"]


def test_a_drop_leaves_no_half_replaced_export_of_a_newer_version_behind(tmp_path):
  """A crash in the middle of replacing v3 (v3 set aside as `.old`, the new one staged)
  and then a resume at version 2: v3 goes, in every name; an export set aside whose
  replacement is whole goes, one whose replacement never came goes back."""
  from jaxagent.checkpoint import _write_registry

  root = tmp_path / "policy"
  for name in ("v00000001", "v00000002.old", "v00000002.new", "v00000001.old",
               "v00000003.old", "v00000003.new", "v00000004.orbax-checkpoint-tmp-9"):
    (root / name).mkdir(parents=True)
  _write_registry(str(root), [{"version": v} for v in (1, 2, 3)])
  assert drop_versions_after(str(root), 2) == [3]  # (v3 put back by the tidy-up, then dropped)
  assert sorted(os.listdir(root)) == ["v00000001", "v00000002", "versions.json"]
  assert [v["version"] for v in list_versions(str(root))] == [1, 2]
  # (the registry is cut when only the version after the kept one is past it)
  (root / "v00000003").mkdir()
  _write_registry(str(root), [{"version": v} for v in (1, 2, 3)])
  assert drop_versions_after(str(root), 2) == [3]
  assert [v["version"] for v in list_versions(str(root))] == [1, 2]


def test_the_last_version_and_every_nth_are_kept():
  from jaxagent.checkpoint import PolicyExports

  exports = PolicyExports("unused", None, export_every=4, steps=10)
  assert [v for v in range(1, 13) if exports.kept(v)] == [4, 8, 10, 11, 12]


def test_a_registry_write_cut_short_leaves_the_registry_as_it_was(tmp_path, monkeypatch):
  from jaxagent import checkpoint

  root = tmp_path / "policy"
  root.mkdir()
  checkpoint._write_registry(str(root), [{"version": 1}])

  def dump_fails(obj, f, **kw):
    f.write('{"versions": [')
    raise OSError(28, "No space left on device")

  # (the module's own `json` alone: json.dump patched for the process reached other
  # threads' writes, Orbax's)
  import json
  import types
  monkeypatch.setattr(checkpoint, "json", types.SimpleNamespace(
      dump=dump_fails, load=json.load, dumps=json.dumps, loads=json.loads))
  with pytest.raises(OSError):
    checkpoint._write_registry(str(root), [{"version": 1}, {"version": 2}])
  monkeypatch.undo()
  assert [v["version"] for v in list_versions(str(root))] == [1]


def test_an_export_replaced_by_one_that_fails_to_rename_in_leaves_the_old_one(tmp_path,
                                                                              monkeypatch):
  """A crash between setting the old export aside and renaming the new one in: the old
  one is still read (never removed before the new one is in place)."""
  from jaxagent import checkpoint

  params = {"w": jnp.ones((2, 4), jnp.float32)}
  root = str(tmp_path / "policy")
  path = export_policy(root, 1, params, dtype=None)
  rename = os.rename

  def rename_in_fails(src, dst):
    if src.endswith(".new") and src.startswith(root):  # (this test's files alone)
      raise OSError(5, "Input/output error")
    rename(src, dst)

  monkeypatch.setattr(checkpoint.os, "rename", rename_in_fails)
  with pytest.raises(OSError):
    export_policy(root, 1, {"w": jnp.zeros((2, 4), jnp.float32)}, dtype=None)
  monkeypatch.undo()
  assert equal(load_policy(path, abstract(params)), params)

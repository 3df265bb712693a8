"""Per-step episode metrics, hand-computed."""

import os

import pytest

from jaxagent.agent import Episode
from jaxagent.metrics import RecordsDamaged, cut_jsonl, episode_metrics
from jaxagent.scheduler import Group


def episode(reward, calls=0, invalid=0, errors=0):
  return Episode("t", "s", "g", [], [reward], {"status": "pass" if reward else "fail",
                                               "reward": reward}, "completed",
                 tool_calls=calls, invalid_tool_calls=invalid, tool_errors=errors)


def test_tool_call_rate_and_groups_with_signal():
  mixed = Group(0, None, [episode(1.0, calls=1), episode(0.0, calls=1, invalid=1)])
  flat = Group(1, None, [episode(0.0), episode(0.0, calls=2, invalid=1)])
  m = episode_metrics([mixed, flat], [mixed, flat], learner_version=0)
  # Valid calls in episodes 0 and 3 (2 calls, 1 invalid); episode 1's call was invalid.
  assert m["tool_call_rate"] == 0.5
  assert m["groups_with_signal"] == 1 and m["success_rate"] == 0.25
  assert m["tool_errors"] == 0


def test_tool_errors_are_counted():
  """A tool that raised on every call looked perfect in metrics.jsonl (tool_call_rate 1,
  invalid_tool_calls 0): its errors are counted now (a new user)."""
  g = Group(0, None, [episode(0.0, calls=2, errors=2), episode(0.0, calls=1, errors=1)])
  m = episode_metrics([g], [g], learner_version=0)
  assert (m["tool_errors"], m["tool_calls"], m["tool_call_rate"]) == (3, 3, 1.0)


def test_what_the_judge_made_of_the_passes_is_counted():
  def judged(status, **details):
    ep = episode(1.0 if status == "pass" else 0.0)
    ep.verdict = {"status": status, "reward": ep.verdict["reward"],
                  "details": {"judge": "j", **details}}
    return ep

  g = Group(0, None, [judged("pass"), judged("fail", false_positive=True),
                      judged("fail", judge_unparsed=True), judged("fail", judge_too_long=True),
                      judged("fail", answer_says_verdict=True),
                      episode(0.0)])  # a fail of the tests: never shown to the judge
  m = episode_metrics([g], [g], learner_version=0)
  # (asked: the passes shown to it; the too long one and the one saying a verdict were not)
  assert (m["judge_asked"], m["judge_false_positives"], m["judge_unparsed"],
          m["judge_too_long"], m["judge_answer_says_verdict"]) == (3, 1, 1, 1, 1)
  assert "judge_asked" not in episode_metrics([Group(1, None, [episode(1.0)])], [], 0)


def test_cut_jsonl_keeps_rows_up_to_the_step(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1}\n{"note": "no step"}\n{"step": 2}\n{"step": 3}\n'
                  '{"step": 2, "again": true}\n{"step": 4, "los')  # the last cut by a kill
  assert cut_jsonl(str(path), 2) == 4
  assert path.read_text() == ('{"step": 1}\n{"note": "no step"}\n{"step": 2}\n'
                              '{"step": 2, "again": true}\n')
  assert cut_jsonl(str(tmp_path / "absent.jsonl"), 2) == 0


def test_a_whole_last_line_that_is_not_json_is_dropped_and_said(tmp_path, capsys):
  """A kill leaves a last line without its end (dropped quietly, above); a whole last line
  that does not read is damage (a disk fault, an edit): dropped, with a warning naming it
  (it went silently, a checkpointed step left without its row: a new user's round)."""
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1}\n{"step": 2, "los')
  assert cut_jsonl(str(path), 2) == 1 and capsys.readouterr().err == ""
  path.write_text('{"step": 1}\n{"step": 2, trunc\n')
  assert cut_jsonl(str(path), 2) == 1
  assert "warning: metrics.jsonl: its last line (2) is not JSON" in capsys.readouterr().err


@pytest.mark.parametrize("damage,said", [
    ('{"step": 2, "lo\n', "line 2 is not JSON"),  # cut in the middle, rows after it
    ("5\n", "line 2 is not a row"),
    ('{"step": "2"}\n', "line 2 is not a row"),
])
@pytest.mark.parametrize("gz", [False, True])
def test_cut_jsonl_refuses_a_file_damaged_before_its_end(tmp_path, damage, said, gz):
  """Only a last line a kill cut short is dropped: a damaged line with rows after it made
  a resume rewrite the file without all of them, at once and for good (red team 15: a
  cut row 2 of metrics.jsonl lost rows 2-4; one flipped byte in trajectories.jsonl.gz
  lost three quarters of its steps); a row that is not one was a traceback."""
  import gzip

  text = '{"step": 1}\n' + damage + '{"step": 3}\n{"step": 4}\n'
  path = tmp_path / ("metrics.jsonl.gz" if gz else "metrics.jsonl")
  path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
  before = path.read_bytes()
  with pytest.raises(RecordsDamaged, match=said):
    cut_jsonl(str(path), 3)
  assert path.read_bytes() == before and os.listdir(tmp_path) == [path.name]


def test_cut_jsonl_refuses_a_damaged_gzip_stream(tmp_path):
  import gzip

  rows = "".join(f'{{"step": {i // 8 + 1}, "x": {i * 7919 % 1000}}}\n' for i in range(400))
  data = bytearray(gzip.compress(rows.encode()))
  data[len(data) // 3] ^= 0x40  # one flipped byte
  path = tmp_path / "trajectories.jsonl.gz"
  path.write_bytes(bytes(data))
  with pytest.raises(RecordsDamaged, match="the file is damaged"):
    cut_jsonl(str(path), 40)
  assert path.read_bytes() == bytes(data)
  # A gzip member a kill cut short is the end (appends add members).
  whole = gzip.compress(rows.encode())
  path.write_bytes(whole + gzip.compress(b'{"step": 51}\n')[:14])
  assert cut_jsonl(str(path), 60) == 400
  path.write_bytes(whole + b"\x1f")  # (one byte of the next member: BadGzipFile)
  assert cut_jsonl(str(path), 60) == 400


def test_tensorboard_events_are_written_without_importing_torch(tmp_path):
  """tensorboardX's package imports torch where it is installed: a second of every run's
  start for nothing the events use. The writer leaves it out."""
  import subprocess
  import sys
  code = ("import sys; from jaxagent.metrics import MetricsWriter; "
          f"w = MetricsWriter({str(tmp_path)!r}); w.write({{'step': 1, 'loss': 0.5}}); "
          "w.close(); print('torch' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True).stdout.split()
  assert out == ["False"]
  assert os.listdir(tmp_path / "tensorboard")


def test_a_row_written_again_after_a_failure_is_in_each_file_once(tmp_path, monkeypatch):
  """A full disk part-way through a row: the part written is cut off, and the retry
  writes the row once (red team 21: the step's row was in metrics.jsonl twice, and the
  checkpoint after it made that permanent)."""
  import json
  from jaxagent import metrics

  w = metrics.MetricsWriter(str(tmp_path))
  w.write({"step": 1, "loss": 0.5})
  real = os.write

  def half_then_full(fd, data):
    if fd == w._fd and len(data) > 8:
      real(fd, data[:8])
      raise OSError(28, "No space left on device")
    return real(fd, data)

  monkeypatch.setattr(metrics.os, "write", half_then_full)
  with pytest.raises(OSError):
    w.write({"step": 2, "loss": 0.25})
  monkeypatch.setattr(metrics.os, "write", real)
  w.write({"step": 2, "loss": 0.25})
  w.write({"step": 2, "loss": 0.25})  # (a retry after a later part failed: once)
  w.close()
  with open(tmp_path / "metrics.jsonl") as f:
    assert [json.loads(line)["step"] for line in f] == [1, 2]


def test_a_resumed_runs_totals_go_on_from_its_checkpoints():
  """`retries`, `groups_replaced` and `dropped_*` are the run's totals: a resume started
  them again at 0 (its scheduler's own counters), and a step's difference went negative
  (red team 39). The checkpoint carries them; the rows go on from them."""
  import asyncio
  import collections
  import types

  from jaxagent.config import RunConfig
  from jaxagent.training_run import TrainingRun

  async def made():  # (it holds the loop it runs on)
    return TrainingRun(RunConfig(), "/nonexistent")

  run = asyncio.run(made())
  run.run_pool.shutdown()
  run.scheduler = types.SimpleNamespace(retries=2, replaced=1, dropped=collections.Counter(
      {"stale": 3, "infra_server": 1}))
  run.loop_watch = types.SimpleNamespace(held_s=1.5)
  assert run.totals() == {"retries": 2, "groups_replaced": 1,
                          "dropped": {"stale": 3, "infra_server": 1}, "loop_held_s": 1.5}
  run.counted_before = {"retries": 5, "groups_replaced": 4,  # (as a checkpoint holds)
                        "dropped": {"stale": 5, "no_signal": 7}, "loop_held_s": 2.0}
  assert run.totals() == {"retries": 7, "groups_replaced": 5,
                          "dropped": {"stale": 8, "no_signal": 7, "infra_server": 1},
                          "loop_held_s": 3.5}


def test_a_checkpoint_saves_the_rollouts_as_they_stood_when_its_save_began(monkeypatch):
  """A group started while a checkpoint is saved (the canary episodes, the records' sync:
  awaits in which the rollouts go on) is in neither the checkpoint's tasks in flight nor
  before its iterator's place: the iterator's place and the next group's number are
  saved as they were when the tasks in flight were taken. Read at the save, the
  iterator was past the group's task, and a resume never played it (a reviewer)."""
  import asyncio
  import collections
  import json
  import types

  import grain

  from jaxagent import training_run
  from jaxagent.config import RunConfig
  from jaxagent.training_run import TrainingRun

  tasks = iter(grain.MapDataset.range(100).to_iter_dataset())
  scheduler = types.SimpleNamespace(
      served=0, next_index=2, pending=[{"t": 0}, {"t": 1}], retries=0, replaced=0,
      dropped=collections.Counter(), drain_finished=lambda: [])
  scheduler.pending_tasks = lambda: list(scheduler.pending)

  async def a_group_starts(*args):  # (the rollouts go on during the save's awaits)
    scheduler.pending.append({"t": next(tasks)})
    scheduler.next_index += 1
    # (and a group in flight meets a retry and a drop: played again on a resume, they
    # were counted twice; a reviewer)
    scheduler.retries += 1
    scheduler.dropped["infra_error"] += 1
    return ["canary"]

  saved = {}

  class Checkpointer:
    def save(self, step, state, meta, data_iter, **kw):
      saved.update(meta=meta, place=json.loads(data_iter.get_state()))

  async def save():
    run = TrainingRun(RunConfig(), "/nonexistent")
    run.scheduler, run.tasks, run.ckpt, run.wal = scheduler, tasks, Checkpointer(), None
    run.step, run.state, run.meta, run.recent = 3, types.SimpleNamespace(
        policy_version=0), {}, []
    run._sync_records = lambda: None
    run.env_factory = run.serving = run.tokenizer = types.SimpleNamespace(client=None)
    next(tasks), next(tasks)  # (tasks 0 and 1: in flight)
    await run.save_checkpoint(run.save_point())
    run.run_pool.shutdown()

  monkeypatch.setattr(training_run, "play_canary", a_group_starts)
  monkeypatch.setattr(training_run, "state_prints", lambda *a: {})
  asyncio.run(save())
  assert saved["meta"]["pending_tasks"] == [{"t": 0}, {"t": 1}]
  assert saved["meta"]["next_group"] == 2 and saved["meta"]["canary"] == ["canary"]
  assert saved["meta"]["counted"] == {"retries": 0, "groups_replaced": 0, "dropped": {},
                                      "loop_held_s": 0.0}
  again = iter(grain.MapDataset.range(100).to_iter_dataset())
  again.set_state(saved["place"])
  assert next(again) == 2  # (task 2, started during the save, is played on a resume)


# -- red team 51: what a resume reads of the records, unit by unit ----------------------


def test_the_last_step_is_the_largest_a_row_says_and_none_without_rows(tmp_path):
  """A step's row written again after a failure (a retry) ends the file with an older
  step: the records still reach the largest one."""
  from jaxagent.metrics import last_step

  path = tmp_path / "metrics.jsonl"
  assert last_step(str(path)) is None
  path.write_text('{"note": "no step"}\n')
  assert last_step(str(path)) is None
  path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 2, "again": true}\n'
                  '{"note": "no step"}\n{"step": 9, "lo')
  assert last_step(str(path)) == 3


def test_a_step_that_is_not_a_number_is_damage_even_true(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1}\n{"step": true}\n{"step": 3}\n')
  with pytest.raises(RecordsDamaged, match="line 2 is not a row"):
    cut_jsonl(str(path), 3)


def test_a_damaged_gzip_member_header_with_members_after_it_is_damage(tmp_path):
  """Only one byte of a member's header at the very end is a kill's cut; a header that
  does not read with rows after it is damage (read as the end, the rows after it went
  at the next cut)."""
  import gzip

  first = gzip.compress(b'{"step": 1}\n{"step": 2}\n')
  later = bytearray(gzip.compress(b'{"step": 3}\n'))
  later[1] ^= 0x01  # the magic's second byte
  path = tmp_path / "trajectories.jsonl.gz"
  path.write_bytes(first + bytes(later) + gzip.compress(b'{"step": 4}\n'))
  before = path.read_bytes()
  with pytest.raises(RecordsDamaged, match="the file is damaged"):
    cut_jsonl(str(path), 9)
  assert path.read_bytes() == before


def test_a_cut_file_is_on_the_disk_before_it_replaces_the_old_one(tmp_path, monkeypatch):
  """The rewritten file is synced before its rename (a crash after the rename could leave
  an empty file on some file systems, every row lost), and is whole by then."""
  import gzip

  from jaxagent import metrics

  events = []
  sync, replace = metrics.sync_file, metrics.os.replace

  def synced(path):
    with open(path, "rb") as f:
      events.append(("sync", os.path.basename(path), f.read()))
    sync(path)

  def replaced(src, dst):
    if os.path.dirname(str(dst)) == str(tmp_path):  # (this test's files alone)
      events.append(("replace", os.path.basename(src), os.path.basename(dst)))
    replace(src, dst)

  monkeypatch.setattr(metrics, "sync_file", synced)
  monkeypatch.setattr(metrics.os, "replace", replaced)
  for name in ("metrics.jsonl", "trajectories.jsonl.gz"):
    path = tmp_path / name
    text = b'{"step": 1}\n{"step": 2}\n'
    path.write_bytes(gzip.compress(text) if name.endswith(".gz") else text)
    events.clear()
    assert cut_jsonl(str(path), 1) == 1
    assert [e[0] for e in events] == ["sync", "replace"], events
    assert events[0][1] == events[1][1] != name and events[1][2] == name
    data = events[0][2]
    assert (gzip.decompress(data) if name.endswith(".gz") else data) == b'{"step": 1}\n'


@pytest.mark.parametrize("gz", [False, True])
def test_bytes_that_do_not_decode_are_damage_and_leave_the_file_alone(tmp_path, gz):
  """A deflate stream that does not inflate (zlib's error), or bytes that are not UTF-8,
  are the file damaged (RecordsDamaged naming it), with nothing left beside it."""
  import gzip

  if gz:
    data = bytearray(gzip.compress(b'{"step": 1}\n' * 50))
    data[10] = 0xFF  # the first deflate block's header: an invalid block type
    path = tmp_path / "trajectories.jsonl.gz"
  else:
    data = b'{"step": 1}\n{"step": 2, "x": "\xff\xfe"}\n{"step": 3}\n'
    path = tmp_path / "metrics.jsonl"
  path.write_bytes(bytes(data))
  with pytest.raises(RecordsDamaged, match="the file is damaged"):
    cut_jsonl(str(path), 9)
  assert path.read_bytes() == bytes(data) and os.listdir(tmp_path) == [path.name]

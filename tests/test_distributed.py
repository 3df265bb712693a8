"""Multi-controller learner: 2 processes x 4 CPU devices give the parameters of
1 process x 8 devices on the same fixed batch, and checkpoint together."""

import json
import re
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxagent.launch import free_port
from tests.conftest import REPO


def _env(devices: int) -> dict:
  env = dict(os.environ)
  env["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} "
                      f"--xla_force_host_platform_device_count={devices}").strip()
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(k, None)
  return env


def _worker(out, *extra, devices):
  return subprocess.Popen([sys.executable, "-m", "tests.distributed.learner_worker", str(out),
                           *extra], cwd=REPO, env=_env(devices), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path):
  one = _worker(tmp_path / "one", devices=8)
  out_one = one.communicate(timeout=300)[0]
  assert one.returncode == 0, out_one[-3000:]

  port = free_port()
  procs = [_worker(tmp_path / "two", "--coordinator", f"127.0.0.1:{port}",
                   "--num-processes", "2", "--process-id", str(i), devices=4) for i in (0, 1)]
  outs = [p.communicate(timeout=300)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]

  a = np.load(tmp_path / "one" / "params.npz")
  b = np.load(tmp_path / "two" / "params.npz")
  assert int(a["processes"]) == 1 and int(b["processes"]) == 2
  assert int(a["devices"]) == int(b["devices"]) == 8
  np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-5)
  names = [k for k in a.files if k.startswith("p/")]
  assert names
  for k in names:
    np.testing.assert_allclose(b[k], a[k], atol=1e-6, rtol=1e-5, err_msg=k)
    # Saved and restored by both processes together: the same values.
    np.testing.assert_array_equal(b["r/" + k[2:]], b[k])
  # Every process's JSON, gathered in process order.
  assert json.loads(str(b["gathered"])) == [{"process": 0, "tasks": []},
                                            {"process": 1, "tasks": ["t"]}]
  # The engine copy of process 0 lives on its own 4 devices (1 process: all 8).
  assert b["local_devices"].tolist() == [0, 1, 2, 3] and len(a["local_devices"]) == 8
  # Only process 0 wrote the shared file; both wrote their checkpoint shards.
  assert os.listdir(tmp_path / "two" / "checkpoints") == ["3"]


def test_a_collective_failed_for_a_process_gone_is_told_from_this_processs_own(monkeypatch):
  """A learner killed mid-run: the other's CPU allgather raised Gloo's failure as a
  ValueError, taken for its own bug (two tracebacks, exit 1), not the line naming the
  process gone and the resume (PeerLost, exit 3)."""
  import jax

  from jaxagent import distributed

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  gloo = ("UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:534] "
          "Read error [127.0.0.1]:33133: Connection reset by peer")
  assert distributed.peer_gone(ValueError(gloo))
  assert distributed.peer_gone(jax.errors.JaxRuntimeError("UNAVAILABLE: Connection closed "
                                                          "by peer"))
  for own in (ValueError("Gloo AllGather failed: shapes differ"),  # (this process's own)
              ValueError("Connection reset by peer"),  # (not a collective's)
              ConnectionResetError(104, "Connection reset by peer")):
    assert not distributed.peer_gone(own), own
  monkeypatch.setattr(jax, "process_count", lambda: 1)
  assert not distributed.peer_gone(ValueError(gloo))


def test_a_steps_counts_are_every_processs(monkeypatch):
  """The row process 0 writes counts every process's episodes, and the token WAL's turns
  replayed (they were process 0's alone: a new user), where the run has a WAL."""
  from jax.experimental import multihost_utils

  from jaxagent import distributed

  monkeypatch.setattr(multihost_utils, "process_allgather",  # (two processes alike)
                      lambda x: np.stack([x, x]))
  row = {"episodes": 4, "success_rate": 0.5, "reward_mean": 1.0, "groups": 1,
         "wal_replayed_turns": 7}
  summed = distributed.sum_episode_counts(row)
  assert (summed["episodes"], summed["success_rate"], summed["groups"],
          summed["wal_replayed_turns"]) == (8, 0.5, 2, 14)
  del row["wal_replayed_turns"]  # (a run without a WAL has none)
  assert "wal_replayed_turns" not in distributed.sum_episode_counts(row)


def test_a_rows_retries_replacements_and_drops_are_every_processs_and_resume_per_process():
  """A reviewer: a two-process run's row summed both processes' groups but counted process
  0's retries, replacements and drops alone (a group left out, said nowhere), and its
  checkpoint kept process 0's totals, which every process went on from on a resume."""
  from jaxagent.resume import _counted
  from jaxagent.training_run import add_totals

  zero = {"retries": 2, "groups_replaced": 1, "dropped": {"stale": 1}, "loop_held_s": 3.0}
  one = {"retries": 5, "groups_replaced": 0, "dropped": {"stale": 2, "infra_error": 1},
         "loop_held_s": 9.0}
  assert add_totals(zero, one) == {"retries": 7, "groups_replaced": 1, "loop_held_s": 3.0,
                                   "dropped": {"stale": 3, "infra_error": 1}}
  assert add_totals(zero, {}) == zero
  meta = {"counted": zero, "counted_by_process": [zero, one]}
  assert [_counted(meta, p) for p in (0, 1, 2)] == [zero, one, {}]
  older = {"counted": zero}  # (saved before: process 0's alone)
  assert [_counted(older, p) for p in (0, 1)] == [zero, {}]


def test_a_steps_tool_calls_tokens_and_means_are_every_processs(monkeypatch):
  """A reviewer: tool calls, output tokens and the means over episodes were process 0's
  alone beside every process's episode count (tool calls an episode read 4x too low on
  4 processes, and the rollout tokens a second with them). Counts are summed, means
  weighted by each process's episodes; a process with none this step adds nothing."""
  from jax.experimental import multihost_utils

  from jaxagent import distributed

  mine = {"episodes": 2, "success_rate": 1.0, "reward_mean": 1.0, "tool_calls": 6,
          "output_tokens": 100, "turns_mean": 3.0, "tool_call_rate": 1.0, "groups": 1}
  theirs = {"episodes": 6, "success_rate": 0.0, "reward_mean": 0.0, "tool_calls": 6,
            "output_tokens": 300, "turns_mean": 1.0, "tool_call_rate": 0.5, "groups": 3}
  idle = {"episodes": 0, "groups": 0}  # (no episode: none of the means' keys)
  vectors = []
  monkeypatch.setattr(multihost_utils, "process_allgather",
                      lambda x: (vectors.append(np.asarray(x)), np.asarray(x)[None])[1])
  for row in (theirs, idle):
    distributed.sum_episode_counts(row)
  assert len({v.shape for v in vectors}) == 1  # (one length, episodes or not)
  monkeypatch.setattr(multihost_utils, "process_allgather",
                      lambda x: np.stack([np.asarray(x), *vectors]))
  summed = distributed.sum_episode_counts(mine)
  assert (summed["episodes"], summed["tool_calls"], summed["output_tokens"],
          summed["groups"]) == (8, 12, 400, 4)
  assert summed["turns_mean"] == pytest.approx((2 * 3.0 + 6 * 1.0) / 8)
  assert summed["tool_call_rate"] == pytest.approx((2 * 1.0 + 6 * 0.5) / 8)
  assert summed["success_rate"] == pytest.approx(0.25)


def test_partial_multi_process_settings_are_named():
  from jaxagent import distributed

  with pytest.raises(ValueError, match="missing: num_processes, process_id"):
    distributed.initialize("127.0.0.1:1234")
  with pytest.raises(ValueError, match="not in"):
    distributed.initialize("127.0.0.1:1234", 2, 2)
  assert distributed.initialize(None, None, None) is False
  with pytest.raises(ValueError, match="heartbeat timeout 0: a whole number of seconds"):
    distributed.initialize("127.0.0.1:1234", 2, 0, heartbeat_timeout_s=0)
  # Bad addresses are named before JAX sees them (it answered a traceback, a
  # segmentation fault, or a wait without end: a new user's walkthrough).
  for bad in ("localhost", "nope:abc", "localhost:99999", "localhost:0", ":1234", "h:-1",
              "a b:12"):
    with pytest.raises(ValueError, match=f"coordinator {bad!r}"):
      distributed.initialize(bad, 2, 0)
  for good in ("localhost:1", "10.0.0.2:8476", "[::1]:65535", "job-0.svc:1234"):
    distributed.check_coordinator(good)
  with pytest.raises(ValueError, match="num_processes 0: a run has at least 1 process"):
    distributed.initialize("127.0.0.1:1234", 0, 0)


def test_bad_process_settings_from_the_environment_are_named(monkeypatch):
  from jaxagent import distributed

  monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "two")
  with pytest.raises(ValueError, match=f"\\${distributed.ENV_NUM_PROCESSES}='two': not a "
                     "whole number"):
    distributed.initialize("127.0.0.1:1234", None, 0)


def _start_two(tmp_path, tag, *args, env=None):
  """`python -m jaxagent.train` of the tiny config (small steps) as two processes, run
  directory `tmp_path/run`, each logging to `tmp_path/<tag><process>.log` (to files: a
  pipe one process fills while the test reads the other's stalls it, and the other with
  it in their collectives)."""
  port = free_port()
  common = ["--config", "configs/tiny.yaml", "--run-dir", str(tmp_path / "run"),
            "rollout.groups_per_step=2", "rollout.group_size=4", "data.rows=8",
            "serving.engine.slots=8", *args, "--coordinator", f"127.0.0.1:{port}",
            "--num-processes", "2"]
  return [subprocess.Popen([sys.executable, "-m", "jaxagent.train", *common, "--process-id",
                            str(i)], cwd=REPO, env={**_env(2), **(env or {})},
                           stdout=open(tmp_path / f"{tag}{i}.log", "w"), stderr=subprocess.STDOUT)
          for i in (0, 1)]


@pytest.mark.slow
def test_a_killed_multi_process_run_resumes_with_every_step_once(tmp_path):
  """Both processes of a two-process run killed (SIGKILL: a node lost, the JobSet
  restarts the job) after three steps, its checkpoint at step 2: resumed, both go on
  from it, replay step 3's episodes from the token WAL, and every step is recorded once.
  (A resume met one process at the load of its engine's weights and the other past it:
  only process 0 loaded them, as for servers the processes share.)"""
  import signal
  import time

  run_dir = tmp_path / "run"
  common = ["checkpoint.every_steps=2", "checkpoint.export_every=0"]
  procs = _start_two(tmp_path, "first", *common, "steps=500")
  metrics, deadline = run_dir / "metrics.jsonl", time.time() + 300
  try:  # (its step-2 checkpoint written whole: an async save ends after its step)
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3
               and (run_dir / "checkpoints" / "2").is_dir()):
      assert all(p.poll() is None for p in procs) and time.time() < deadline
      time.sleep(0.05)
  finally:
    for p in procs:
      p.send_signal(signal.SIGKILL)
      p.wait()
  before = [json.loads(line) for line in metrics.read_text().splitlines()]
  done = before[-1]["step"]
  procs = _start_two(tmp_path, "resumed", *common, "--resume", f"steps={done + 1}")
  try:
    for p in procs:
      p.wait(timeout=300)
  finally:
    for p in procs:
      p.kill()
  outs = [(tmp_path / f"resumed{i}.log").read_text() for i in (0, 1)]
  assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
  assert "resumed from step 2" in outs[0], outs[0][-3000:]
  assert "token WAL:" in outs[0] and "to replay" in outs[0], outs[0][-3000:]
  rows = [json.loads(line) for line in metrics.read_text().splitlines()]
  assert [r["step"] for r in rows] == list(range(1, done + 2))  # each step once
  # Step 3, played again from the WAL after the restore at step 2, is the same step
  assert rows[2]["reward_mean"] == before[2]["reward_mean"]


@pytest.mark.slow
def test_a_process_killed_mid_run_stops_the_other_with_one_line_and_exit_3(tmp_path):
  """One learner process killed (kill -9) as the run goes on: the other stops with the
  line naming a process gone and the resume command (PeerLost, exit 3; what failed
  here before it, for the log). Its CPU
  collective's failure came as Gloo's ValueError, taken for its own bug: two tracebacks
  (the second its final agreement with the dead process) and exit 1 (a new user's
  launch)."""
  import signal
  import time

  procs = _start_two(tmp_path, "k", "steps=500", "checkpoint.every_steps=100",
                     "checkpoint.export_every=0", "--heartbeat-timeout", "20")
  metrics, deadline = tmp_path / "run" / "metrics.jsonl", time.time() + 240
  try:
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
      assert all(p.poll() is None for p in procs) and time.time() < deadline
      time.sleep(0.05)
    procs[1].send_signal(signal.SIGKILL)
    procs[0].wait(timeout=120)
  finally:
    for p in procs:
      p.kill()
      p.wait()
  out = (tmp_path / "k0.log").read_text()
  assert procs[0].returncode == 3, out[-3000:]
  assert "another process of the run is gone" in out and "--resume" in out, out[-3000:]
  # (what failed here, once, for the log: not a second from the final agreement)
  assert out.count("Traceback") <= 1, out[-3000:]


@pytest.mark.slow
def test_a_silent_process_stops_the_run_within_the_heartbeat_timeout(tmp_path):
  """A process gone silent (stopped: its host frozen, or killed inside the learner's
  step, whose collective waits on it) stops the others after the heartbeat timeout that
  `distributed.initialize` is given (`train --heartbeat-timeout`; JAX's 100 s was the
  only setting: a kill inside the step took 85 s)."""
  import time

  from jaxagent import train

  assert train.parse_args(["--heartbeat-timeout", "5"]).heartbeat_timeout == 5
  port = free_port()
  logs = [open(tmp_path / f"p{i}.log", "w+") for i in (0, 1)]
  procs = [subprocess.Popen([sys.executable, "-m", "tests.distributed.silent", str(port),
                             str(i), "5"], cwd=REPO, env=_env(1), stdout=logs[i],
                            stderr=subprocess.STDOUT) for i in (0, 1)]
  try:
    deadline = time.time() + 120
    while "[{" not in (tmp_path / "p0.log").read_text():  # (past the first collective)
      assert procs[0].poll() is None and time.time() < deadline
      time.sleep(0.05)
    t0 = time.time()
    procs[0].wait(timeout=90)
    took = time.time() - t0
  finally:
    for p in procs:
      p.kill()
      p.wait()
  out = (tmp_path / "p0.log").read_text()
  assert procs[0].returncode != 0 and "the collective ended" not in out, out[-3000:]
  assert "stopped sending heartbeats" in out, out[-3000:]
  assert took < 45, took  # (5 s of silence, then the coordination service's poll)


def _two_process_run(tmp_path, *args, env=None, timeout=240):
  """`_start_two` to the end: (return codes, logs)."""
  procs = _start_two(tmp_path, "p", *args, env=env)
  try:
    for p in procs:
      p.wait(timeout=timeout)
  finally:
    for p in procs:
      p.kill()
  return [p.returncode for p in procs], [(tmp_path / f"p{i}.log").read_text() for i in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("where", ["env", "batch", "records"])
def test_an_error_in_one_process_stops_every_process_at_once_with_its_checkpoint(
    tmp_path, where):
  """One process meets an error of its own: an environment's bug while its episodes
  play (process 1, some steps in), a bug packing its batch (process 1, step 3: before
  the step's collectives), or a full disk as it writes the last step's records
  (process 0, after the step's update). It stops saying so, the other at the same point
  saying which process failed and why, with the same exit code (1 a bug, 3 the
  infrastructure's), and the two save the checkpoint of the last step together (alone,
  the failing process went to its final save while the other was in the step's
  collectives: the two paired up, hung and were aborted by the coordination service
  after 5 minutes, nothing saved; an error after the last step's agreement was raised
  inside the final save: no checkpoint)."""
  import time

  bad, good = (0, 1) if where == "records" else (1, 0)
  t0 = time.time()
  codes, outs = _two_process_run(
      tmp_path, {"env": "steps=500", "batch": "steps=5", "records": "steps=2"}[where],
      "checkpoint.every_steps=100", "checkpoint.export_every=0",
      "env.imports=[tests.distributed.bug_on_one]",
      env={"BUG_PROCESS": str(bad), "BUG_IN": where, "BUG_AFTER": "150",
           "BUG_STEP": "3" if where == "batch" else "2"})
  took = time.time() - t0
  log = outs[0][-3000:] + outs[1][-3000:]
  if where == "env":
    assert codes == [1, 1], log
    assert re.search(r"error: an episode of task '[^']+' \(\w+\) raised ZeroDivisionError "
                     r"at tests/distributed/bug_on_one.py:\d+ \(a bug, not an infrastructure "
                     r"failure\): an environment's bug on one process", outs[bad]), log
    assert "  tests/distributed/bug_on_one.py:" in outs[bad], log  # (its frames, not all)
    assert "Traceback" not in outs[bad], log
    told = "EpisodeBug: an episode of task "
    assert re.search(r"an episode of task '[^']+' \(\w+\) raised ZeroDivisionError at "
                     r"tests/distributed/bug_on_one.py", outs[good]), log
  elif where == "batch":
    assert codes == [1, 1], log
    assert "IndexError: a bug packing one process's batch" in outs[bad], log
    told = "IndexError: a bug packing one process's batch"
  else:
    assert codes == [3, 3], log
    assert "(No space left on device); the disk is full" in outs[bad], log
    told = "OSError: [Errno 28] No space left on device"
  assert "Traceback" not in outs[good], log
  assert f"error: process {bad} of the run stopped with an error ({told}" in outs[good], log
  assert "--resume" in outs[good], log
  run_dir = tmp_path / "run"
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  last = rows[-1]["step"]
  assert last >= (1 if where == "env" else 2)
  if where == "batch":
    assert last == 2
  assert [r["step"] for r in rows] == list(range(1, last + 1))
  assert os.listdir(run_dir / "checkpoints") == [str(last)]  # saved by both together
  assert took < 200, took  # (not the coordination service's minutes)


@pytest.mark.slow
def test_train_cli_as_two_processes(tmp_path):
  """`python -m jaxagent.train` as 2 jax.distributed processes: one run directory,
  metrics and the policy registry from process 0 with every process's episodes,
  checkpoints and exports written by both, each process's trajectories kept. A SIGTERM
  to one process stops both after the same step (alone, it left the other waiting in
  the next step's collectives)."""
  import signal
  import time

  run_dir = tmp_path / "run"
  port = free_port()
  common = ["--config", "configs/tiny.yaml", "--run-dir", str(run_dir), "steps=500",
            "rollout.groups_per_step=2", "rollout.group_size=4", "data.rows=8",
            "serving.engine.slots=8", "checkpoint.every_steps=100", "checkpoint.export_every=1",
            "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
  procs = [subprocess.Popen([sys.executable, "-m", "jaxagent.train", *common, "--process-id",
                             str(i)], cwd=REPO, env=_env(2), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
  metrics, deadline = run_dir / "metrics.jsonl", time.time() + 300
  while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
    assert all(p.poll() is None for p in procs) and time.time() < deadline
    time.sleep(0.2)
  procs[1].send_signal(signal.SIGTERM)
  try:
    outs = [p.communicate(timeout=120)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, out in zip(procs, outs):
    assert p.returncode == 128 + signal.SIGTERM, out[-3000:]
  with open(run_dir / "metrics.jsonl") as f:
    rows = [json.loads(line) for line in f]
  last = rows[-1]["step"]
  assert [r["step"] for r in rows] == list(range(1, last + 1))  # once, not per process
  assert all(r["episodes"] == 16 for r in rows)  # 2 processes x 2 groups x 4
  # The batch's counts are both processes' (they were process 0's alone).
  assert all(r["batch_segments"] + r["batch_overflow"] >= 16 for r in rows), rows
  # The rate is of the episodes both processes' batches held (it was process 0's accepted).
  for r in rows:
    step_s = r["rollout_s"] + r["learner_s"] + r["weight_sync_s"]
    assert abs(r["valid_trajectories_per_s"] * step_s - r["episodes_trained"]) < 1e-6, r
  assert rows[1]["policy_version"] == 2 and rows[1]["batch_rows"] % 2 == 0
  # Each process's engine got the weights device to device (collectives), not via host.
  assert {r["weight_sync_path"] for r in rows} == {"reshard"}
  with open(run_dir / "policy" / "versions.json") as f:
    assert [v["version"] for v in json.load(f)["versions"]] == list(range(1, last + 1))
  assert os.listdir(run_dir / "checkpoints") == [str(last)]  # saved by both on the way out
  with open(run_dir / "checkpoints" / str(last) / "meta" / "metadata") as f:
    meta = json.load(f)  # each process's tasks in flight, for its own resume
  assert len(meta["pending_tasks_by_process"]) == 2
  assert (run_dir / "trajectories.jsonl.gz").exists()
  assert (run_dir / "trajectories.process1.jsonl.gz").exists()
  # The processes number their groups apart (0, 2, ... and 1, 3, ...): their sessions on
  # servers they share would never meet.
  from jaxagent.trajectory import read_jsonl

  groups = [{int(s["group_id"][1:]) for s in read_jsonl(str(run_dir / name))}
            for name in ("trajectories.jsonl.gz", "trajectories.process1.jsonl.gz")]
  assert groups[0] and groups[1] and {g % 2 for g in groups[0]} == {0} \
      and {g % 2 for g in groups[1]} == {1}, groups
  # (process 1 got the signal; process 0, which says how to go on, stopped with it)
  assert f"stopped at step {last} of 500 (SIGTERM)" in outs[0]
  # How to go on: every process, with its flags (train's own line alone was refused)
  assert f"--resume --coordinator 127.0.0.1:{port} --num-processes 2 --process-id I, on " \
      "each of the 2 processes (I: its own, 0..1, as before)" in outs[0], outs[0][-2000:]
  assert "Traceback" not in outs[0] + outs[1]


@pytest.mark.slow
def test_rollout_on_its_own_devices(tmp_path):
  """mesh.devices / serving.devices split one process's 8 devices: the learner on 4,
  the engine on the other 4, weights resharded between them (no export)."""
  run_dir = tmp_path / "run"
  proc = subprocess.run(
      [sys.executable, "-m", "jaxagent.train", "--config", "configs/tiny.yaml", "--run-dir",
       str(run_dir), "steps=2", "rollout.groups_per_step=2", "rollout.group_size=4",
       "data.rows=8", "serving.engine.slots=8", "checkpoint.every_steps=0",
       "checkpoint.export_every=0", "mesh.devices=0-3", "serving.devices=4-7"],
      cwd=REPO, env=_env(8), capture_output=True, text=True, timeout=400)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "mesh: {'data': 4" in proc.stdout
  import json

  with open(run_dir / "metrics.jsonl") as f:
    rows = [json.loads(line) for line in f]
  assert [r["weight_sync_path"] for r in rows] == ["reshard", "reshard"]
  assert rows[-1]["policy_version"] == 2


def test_device_selection_errors_are_named():
  import jax

  from jaxagent.models.sharding import select_devices

  devices = jax.local_devices()
  assert select_devices("", devices) == devices
  assert select_devices("0-0", devices) == devices[:1]
  with pytest.raises(ValueError, match="twice"):
    select_devices("0,0", devices)
  with pytest.raises(ValueError, match="'5-9'"):
    select_devices("5-9", devices[:8])
  with pytest.raises(ValueError, match="'x'"):
    select_devices("x", devices)

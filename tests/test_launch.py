"""`python -m jaxagent.launch local`: the learner, rollout servers and environment
workers as separate processes from one config; a short run, and failing fast."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import pytest
from tests.conftest import REPO

SMALL = ["rollout.groups_per_step=2", "rollout.group_size=4", "data.rows=8",
         "serving.engine.slots=8", "checkpoint.every_steps=0", "checkpoint.export_every=0"]


def launch(run_dir, *args):
  return subprocess.Popen([sys.executable, "-m", "jaxagent.launch", "local", "--config",
                           "configs/tiny.yaml", "--run-dir", str(run_dir), *args],
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)


@pytest.mark.slow
def test_short_run_as_processes(tmp_path):
  proc = launch(tmp_path / "run", "--servers", "2", "--env-workers", "1", "steps=2", *SMALL)
  out = proc.communicate(timeout=400)[0]
  assert proc.returncode == 0, out[-4000:]
  # Every child's output is forwarded with its name.
  for name in ("[server0]", "[server1]", "[env0]", "[learner]"):
    assert name in out, name
  assert "launch: the learner finished; stopping the services" in out
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    rows = [json.loads(line) for line in f]
  assert [r["step"] for r in rows] == [1, 2]
  assert all(r["weight_sync_path"] == "export" for r in rows)  # servers load exports
  with open(tmp_path / "run" / "launch" / "server0.yaml") as f:
    assert "preset: nano" in f.read()  # the run's model
  # Each version was exported for the servers to load; those that were not scheduled
  # exports (export_every 0 here: only the last) are gone once the servers had the next.
  policy = tmp_path / "run" / "policy"
  assert sorted(os.listdir(policy)) == ["v00000002", "versions.json"]
  with open(policy / "versions.json") as f:
    assert [v["version"] for v in json.load(f)["versions"]] == [2]
  # The run goes on, with services started afresh; a SIGTERM to the launcher goes to the
  # learner, which stops after its step and checkpoints while the services still serve,
  # then the services stop (the launcher stopped every child with 10 s each, then killed
  # it: a learner whose step took longer died without its checkpoint; it exited 130).
  proc = launch(tmp_path / "run", "--resume", "--servers", "1", "--env-workers", "0",
                "steps=500", *SMALL)
  lines, deadline = [], time.monotonic() + 300
  for line in proc.stdout:
    lines.append(line)
    if "[learner] step 3:" in line or time.monotonic() > deadline:
      break
  proc.send_signal(signal.SIGTERM)
  out = "".join(lines) + proc.communicate(timeout=120)[0]
  assert proc.returncode == 128 + signal.SIGTERM, out[-4000:]
  assert "resumed from step 2" in out
  assert "launch: SIGTERM: the learner stops after its step and checkpoints" in out
  assert "[learner] stopped at step " in out and "launch: the learner stopped" in out
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    steps = [json.loads(line)["step"] for line in f]
  assert steps == list(range(1, len(steps) + 1)) and steps[-1] >= 3
  assert str(steps[-1]) in os.listdir(tmp_path / "run" / "checkpoints")
  with open(policy / "versions.json") as f:  # (the stopped run's final weights)
    assert [v["version"] for v in json.load(f)["versions"]] == [steps[-1]]
  time.sleep(1)  # nothing is left running
  assert not subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True).stdout


@pytest.mark.slow
def test_dead_services_start_again_then_stop_the_run_with_their_names(tmp_path):
  """A service that dies is started again on its address, --restarts times; past them one
  of two rollout servers is not fatal (the learner's router fails its sessions over),
  the only environment worker is, named."""
  proc = launch(tmp_path / "run", "--servers", "2", "--env-workers", "1", "--restarts", "1",
                "steps=500", *SMALL)
  lines = []
  deadline = time.monotonic() + 300

  def until(text):
    for line in proc.stdout:
      lines.append(line)
      if text in line or time.monotonic() > deadline:
        break
    assert text in "".join(lines) and proc.poll() is None, "".join(lines)[-3000:]

  def steps():
    return len([line for line in lines if line.startswith("[learner] step ")])

  def port_of(name):
    if name.startswith("server"):
      with open(tmp_path / "run" / "launch" / f"{name}.yaml") as f:
        return int(re.search(r"port: (\d+)", f.read()).group(1))
    out = subprocess.run(["pgrep", "-af", f"jaxagent.train .*{tmp_path}"], capture_output=True,
                         text=True)  # the learner's env.urls
    return int(re.search(r'env.urls=\["http://127.0.0.1:(\d+)"\]', out.stdout).group(1))

  def kill(name):
    pattern = f"launch/{name}.yaml" if name.startswith("server") else \
        f"envs.server --port {port_of(name)}"
    pid = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    assert pid, "".join(lines)[-3000:]
    os.kill(int(pid[0]), signal.SIGKILL)

  def healthy(name):
    url = f"http://127.0.0.1:{port_of(name)}/health"
    while time.monotonic() < deadline:
      try:
        with urllib.request.urlopen(url, timeout=2) as r:
          if r.status == 200:
            return
      except OSError:
        time.sleep(0.3)
    raise AssertionError(f"{name} did not come back")

  until("[learner] step 1:")
  kill("server0")
  until("launch: server0 exited with code -9 during the run; starting it again "
        "(restart 1 of 1)")
  healthy("server0")
  kill("server0")  # past its restarts: the other serves
  until("launch: server0 exited with code -9 during the run; the learner goes on with "
        "1 server(s)")
  until(f"[learner] step {steps() + 2}:")
  kill("env0")  # the only environment worker: its episodes are played again
  until("launch: env0 exited with code -9 during the run; starting it again "
        "(restart 1 of 1)")
  healthy("env0")
  until(f"[learner] step {steps() + 2}:")
  kill("env0")
  out = "".join(lines) + proc.communicate(timeout=60)[0]
  assert proc.returncode == 1, out[-3000:]
  assert "launch: error: env0 exited with code -9 during the run" in out
  # Nothing is left running.
  time.sleep(1)
  assert not subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True).stdout


def test_children_get_sigterm_when_the_launcher_is_killed(tmp_path):
  """Children run in sessions of their own (a terminal's Ctrl-C reaches the launcher
  only); a launcher that is SIGKILLed left them running."""
  code = textwrap.dedent("""
      import sys, threading, time
      from jaxagent.launch import Child
      child = Child("sleeper", ["sleep", "300"]).start(threading.Lock())
      print(child.proc.pid, flush=True)
      time.sleep(300)
      """)
  proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  line = proc.stdout.readline()
  assert line.strip().isdigit(), (line, proc.stderr.read() if proc.poll() is not None else "")
  pid = int(line)
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait()

  def status() -> str:  # (what the kernel says of it, for a failure: it failed once, unseen)
    with contextlib.suppress(OSError):
      with open(f"/proc/{pid}/status") as f:
        return " ".join(l.strip() for l in f if l.startswith(("Name", "State", "PPid",
                                                                "SigBlk", "SigIgn", "SigCgt")))
    return "(gone)"

  deadline = time.monotonic() + 30  # (a loaded machine: the signal and its exit are slow)
  while time.monotonic() < deadline:
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return
    try:
      with open(f"/proc/{pid}/stat") as f:  # reaped by init once it is a zombie
        if f.read().split()[2] == "Z":
          return
    except FileNotFoundError:  # (reaped between the two looks)
      return
    time.sleep(0.1)
  raise AssertionError(f"the launcher's child outlived it: {status()}")


def test_a_killed_launchers_signals_are_one_stop_request_and_output_goes_to_a_file(tmp_path):
  """The kernel sends a launched process its parent-death SIGTERM once for each of the
  launcher's threads as they die: a learner took the second for "stop now" and saved no
  checkpoint; then its write to the dead launcher's pipe ended it with a traceback (red
  team 25). Repeats within a second are one request; output goes to a file."""
  child = textwrap.dedent(f"""
      import signal, sys, time
      from jaxagent.stopping import RepeatedTerm
      repeats, got = RepeatedTerm({str(tmp_path / "orphan.log")!r}), []
      signal.signal(signal.SIGTERM, lambda s, f: got.append(repeats.same_request(s)))
      print("ready", flush=True)
      while not got:
        time.sleep(0.05)
      time.sleep(1.5)
      for _ in range(2000):  # (past a pipe's buffer)
        print("still here", flush=True)
      with open({str(tmp_path / "got.tmp")!r}, "w") as f:  # (whole when it appears)
        f.write(repr(got))
      import os
      os.replace({str(tmp_path / "got.tmp")!r}, {str(tmp_path / "got")!r})
      """)
  parent = textwrap.dedent(f"""
      import sys, threading, time
      from jaxagent.launch import Child
      lock = threading.Lock()
      child = Child("learner", [sys.executable, "-c", {child!r}]).start(lock)
      for _ in range(4):
        threading.Thread(target=time.sleep, args=(300,), daemon=True).start()
      time.sleep(300)
      """)
  proc = subprocess.Popen([sys.executable, "-c", parent], cwd=REPO, stdout=subprocess.PIPE,
                          text=True)
  assert proc.stdout.readline().endswith("ready\n")
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait()
  deadline = time.monotonic() + 60
  while not (tmp_path / "got").exists():
    assert time.monotonic() < deadline, (tmp_path / "orphan.log").read_text()[-2000:]
    time.sleep(0.1)
  got = eval((tmp_path / "got").read_text())
  assert got[0] is False and all(got[1:]) and len(got) >= 1  # one request, repeats ignored
  assert "still here" in (tmp_path / "orphan.log").read_text()


def test_an_orphans_output_to_a_file_stays_in_it(tmp_path):
  """A run started in the background with its output to a file, by a shell that then
  exited: at a signal its output went to RUN_DIR/output-after-launcher.log, and the
  stop line never reached the user's log (a new user's finding). Only a pipe or socket
  (whose reader may be gone) is given up."""
  code = textwrap.dedent(f"""
      import signal
      from jaxagent.stopping import RepeatedTerm
      repeats = RepeatedTerm({str(tmp_path / "orphan.log")!r})
      repeats.parent = -1  # (its parent is gone)
      repeats.same_request(signal.SIGINT)
      print("after", flush=True)
      """)
  with open(tmp_path / "out.log", "w") as out:
    subprocess.run([sys.executable, "-c", code], cwd=REPO, stdout=out, stderr=out, check=True)
  assert (tmp_path / "out.log").read_text() == "after\n"
  assert not (tmp_path / "orphan.log").exists()
  piped = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True)
  assert piped.stdout == "" and (tmp_path / "orphan.log").read_text() == "after\n"


def test_an_orphans_output_to_a_hung_up_terminal_goes_to_a_file(tmp_path):
  """A run in a terminal window that was then closed: every write to the terminal fails
  (EIO), and its stop line and checkpoint messages were lost with a traceback (only a
  pipe or socket was given up). A live terminal stays where it is."""
  import pty

  code = textwrap.dedent(f"""
      import os, signal, sys
      from jaxagent.stopping import RepeatedTerm
      repeats = RepeatedTerm({str(tmp_path / "orphan.log")!r})
      repeats.parent = -1  # (its parent is gone)
      print("before", flush=True)
      sys.stdin.readline()  # (the test closes the terminal, or not, meanwhile)
      repeats.same_request(signal.SIGINT)
      print("after", flush=True)
      """)
  for hang_up in (False, True):
    master, slave = pty.openpty()
    errors = tmp_path / f"stderr-{hang_up}"  # (what failed, should it: not in the tty)
    with open(errors, "wb") as err:
      proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=slave,
                              stderr=err, stdin=subprocess.PIPE)
    os.close(slave)
    seen = b""
    # (the whole line: print writes its end apart, and a terminal closed between the
    # two, on a loaded machine, failed the child's first print)
    while b"before\r\n" not in seen:
      seen += os.read(master, 1024)
    if hang_up:
      os.close(master)  # (the window closed: the terminal hangs up)
    proc.stdin.write(b"\n")
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0, errors.read_text()
    if not hang_up:
      while b"after" not in seen:
        seen += os.read(master, 1024)
      os.close(master)
      assert not (tmp_path / "orphan.log").exists()
  assert (tmp_path / "orphan.log").read_text() == "after\n"


def test_the_learners_checks_come_before_any_service_starts(tmp_path, capsys):
  from jaxagent import launch as launch_lib

  run = tmp_path / "run"
  assert launch_lib.main(["local", "--config", "configs/tiny.yaml", "--run-dir", str(run),
                          "steps=0"]) == 2
  assert "steps must be >= 1" in capsys.readouterr().err
  assert launch_lib.main(["local", "--config", "configs/tiny.yaml", "--run-dir", str(run),
                          "--heartbeat-timeout", "0"]) == 2
  assert "--heartbeat-timeout must be >= 1" in capsys.readouterr().err
  (run / "checkpoints" / "2").mkdir(parents=True)
  assert launch_lib.main(["local", "--config", "configs/tiny.yaml", "--run-dir",
                          str(run)]) == 2
  assert "already holds a run" in capsys.readouterr().err
  assert launch_lib.main(["local", "--config", "configs/tiny.yaml", "--run-dir",
                          str(tmp_path / "empty"), "--resume"]) == 2
  assert "holds no run" in capsys.readouterr().err  # (services were started first)
  # A resume the learner would refuse (another model) is refused before the services
  # start (red team 25: the learner said so once they were up, the launch exited 1).
  (run / "config.json").write_text(json.dumps({"model": {"preset": "nano"}}))
  assert launch_lib.main(["local", "--config", "configs/tiny.yaml", "--run-dir", str(run),
                          "--resume", "model.preset=tiny"]) == 2
  assert "--resume: a run keeps its model (model.preset: nano -> tiny)" in \
      capsys.readouterr().err
  assert not (run / "launch").exists() and not (tmp_path / "empty").exists()
  # (a new user's walkthrough: a timeout of 0 was taken; --resume alone, argparse's line)
  assert launch_lib.main(["local", "--config", "configs/tiny.yaml", "--start-timeout-s",
                          "0"]) == 2
  assert "--start-timeout-s 0.0: must be > 0 seconds" in capsys.readouterr().err
  assert launch_lib.main(["local", "--run-dir", str(run), "--resume"]) == 2
  assert "--config is required with --resume too (the services are built from it" in \
      capsys.readouterr().err


def test_a_runs_served_models_go_to_its_servers(tmp_path):
  """A config with serving.models (a judge, a teacher, a KL reference) could not be
  launched with servers (the learner refused them with serving.urls, and the servers'
  configs had none), and env workers ignored env.sandboxes (red team 25)."""
  import argparse

  import yaml

  from jaxagent import config as config_lib
  from jaxagent.launch import check_with_services, plan

  args = argparse.Namespace(config="configs/tiny.yaml", servers=1, env_workers=1,
                            learner_processes=1, resume=False,
                            overrides=["env.judge=judge", "serving.models.judge.model.preset=nano",
                                       "env.sandboxes=3", "env.judge_rubric='pay \\${5}'"])
  cfg = config_lib.load(config_lib.RunConfig, args.config, args.overrides)
  assert cfg.env.judge_rubric == "pay ${5}"
  check_with_services(cfg, 1, 0)
  # (the servers' models are checked, and the names that ask for them: a reviewer)
  for bad, needle in ((["learner.kl_coef=0.1", "learner.kl_reference=refx"],
                       "learner.kl_reference: no served model 'refx'"),
                      (["serving.models.judge.engine.max_seq_len=0"],
                       "serving.models.judge.engine.max_seq_len must be >= 1")):
    with pytest.raises(config_lib.ConfigError, match=re.escape(needle)):
      check_with_services(config_lib.load(config_lib.RunConfig, args.config,
                                          args.overrides + bad), 1, 0)
  (server, env), (learner,) = plan(args, cfg, str(tmp_path / "run"))
  served = yaml.safe_load(open(server.cmd[server.cmd.index("--config") + 1]))
  assert served["name"] == cfg.name  # (the policy's served name, as in-process: a new user)
  assert list(served["models"]) == ["judge"] and served["models"]["judge"]["model"]["preset"] \
      == "nano"
  config_lib.load(config_lib.ServerConfig, server.cmd[server.cmd.index("--config") + 1])
  own = config_lib.load(config_lib.RunConfig, learner.cmd[learner.cmd.index("--config") + 1])
  assert own.serving.models == {} and own.env.judge == "judge" and own.env.sandboxes == 3
  assert own.env.judge_rubric == "pay ${5}"  # (a `${` in a value is written as text)
  assert env.cmd[env.cmd.index("--sandboxes") + 1] == "3"


def test_a_parents_death_during_a_stop_is_no_second_request(monkeypatch):
  """A SIGTERM after the first is "stop now", unless it is the launcher's death: its death
  during a stop (more than a second after the first SIGTERM) stopped the learner at once,
  without its checkpoint (a reviewer)."""
  import signal as signals

  from jaxagent import stopping

  monkeypatch.setattr(stopping, "REPEATED_TERM_S", 0.0)
  launched = stopping.RepeatedTerm("")
  assert [launched.same_request(signals.SIGTERM) for _ in range(2)] == [False, False]
  dying = stopping.RepeatedTerm("")
  assert dying.same_request(signals.SIGTERM) is False
  dying.last_parent = -1  # (its parent died since: the kernel's SIGTERM is the same)
  assert dying.same_request(signals.SIGTERM) is True
  assert dying.same_request(signals.SIGINT) is False  # (a person's Ctrl-C still is)
  # (a reviewer) Its parent's death after a Ctrl-C is no second request either; and a
  # process orphaned long before (left by its shell) takes each later SIGTERM as one
  # (its stop stuck, every `kill` was swallowed for good).
  interrupted = stopping.RepeatedTerm("")
  assert interrupted.same_request(signals.SIGINT) is False
  interrupted.last_parent = -1
  assert interrupted.same_request(signals.SIGTERM) is True
  left = stopping.RepeatedTerm("")
  left.parent = -1  # (its parent was gone before any signal)
  assert [left.same_request(signals.SIGTERM) for _ in range(3)] == [False, False, False]


def test_a_failed_learners_code_is_the_launchs(tmp_path, monkeypatch, capsys):
  """A learner's refusal (2) or infrastructure failure (3) came out of the launch as 1
  (red team 25): the launch exits with the learner's code; a service's death is 1."""
  from jaxagent import launch as launch_lib

  def fake_plan(learner_code):
    def plan(args, cfg, run_dir):
      service = launch_lib.Child("server0", [sys.executable, "-c", "import time; "
                                             "time.sleep(60)"], url="http://127.0.0.1:1")
      learner = launch_lib.Child("learner", [sys.executable, "-c", learner_code])
      return [service], [learner]
    return plan

  monkeypatch.setattr(launch_lib, "wait_healthy", lambda child, timeout_s: None)
  own = signal.getsignal(signal.SIGINT)
  for code, want in (("import sys; sys.exit(3)", 3), ("import sys; sys.exit(2)", 2),
                     ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 137)):
    monkeypatch.setattr(launch_lib, "plan", fake_plan(code))
    assert launch_lib.main(["local", "--config", "configs/tiny.yaml", "--run-dir",
                            str(tmp_path / "run")]) == want, code
    err = capsys.readouterr().err
    assert "launch: error: learner exited with code" in err
    assert "to go on" not in err  # (no command to say: none planned)
  # A learner killed (its others stopped with it, unsaved) is followed by how to go on:
  # from the newest checkpoint (a new user: it ended without a word of it).
  from jaxagent.stopping import RESUME_COMMAND

  def planned(args, cfg, run_dir):
    services, learners = fake_plan(
        f"import os, signal; os.makedirs({run_dir!r} + '/checkpoints/5'); "
        "os.kill(os.getpid(), signal.SIGKILL)")(args, cfg, run_dir)
    learners[0].env = {**os.environ, RESUME_COMMAND: "python -m jaxagent.launch local --resume"}
    return services, learners

  monkeypatch.setattr(launch_lib, "plan", planned)
  assert launch_lib.main(["local", "--config", "configs/tiny.yaml", "--run-dir",
                          str(tmp_path / "killed")]) == 137
  assert capsys.readouterr().err.endswith(
      "launch: to go on from the last checkpoint: python -m jaxagent.launch local --resume\n")
  # (its caller's signal handlers are its own again: Ctrl-C was ignored after it)
  assert signal.getsignal(signal.SIGINT) is own


def test_a_signal_while_the_learners_start_reaches_every_one(tmp_path, monkeypatch):
  """A SIGTERM that came after the first of two learners started went to it alone: the
  second trained on until a second signal (a reviewer). And learners that ended their
  runs meanwhile (exit 0) make a launch that finished, not one stopped."""
  import time

  from jaxagent import launch as launch_lib

  def fake_plan(learner_code):
    def plan(args, cfg, run_dir):
      service = launch_lib.Child("server0", [sys.executable, "-c", "import time; "
                                             "time.sleep(60)"], url="http://127.0.0.1:1")
      return [service], [launch_lib.Child(f"learner{i}", [sys.executable, "-c", learner_code])
                         for i in range(2)]
    return plan

  start, at = launch_lib.Child.start, {}

  def started(child, lock):
    out = start(child, lock)
    if child.name == at["name"]:
      time.sleep(at["after_s"])
      os.kill(os.getpid(), signal.SIGTERM)
    return out

  monkeypatch.setattr(launch_lib, "wait_healthy", lambda child, timeout_s: None)
  monkeypatch.setattr(launch_lib.Child, "start", started)
  for code, name, after_s, want in (
      ("import time; time.sleep(60)", "learner0", 0, 143),
      ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(6)",
       "learner1", 3, 0)):  # (signalled once both ignore it)
    at.update(name=name, after_s=after_s)
    monkeypatch.setattr(launch_lib, "plan", fake_plan(code))
    t0 = time.monotonic()
    assert launch_lib.main(["local", "--config", "configs/tiny.yaml", "--run-dir",
                            str(tmp_path / f"run{want}")]) == want
    assert time.monotonic() - t0 < 30


def test_children_are_stopped_together_and_a_second_signal_stops_the_learner_at_once(
    tmp_path, monkeypatch):
  """The children were stopped one after another, each waited for up to 10 s before it
  was killed; and the second signal's stop was a SIGTERM, which a learner takes for the
  first one repeated when it comes within a second of it (killed 10 s on, unsaid). The
  children are stopped together; a learner told to stop already is sent SIGINT."""
  import time

  from jaxagent import launch as launch_lib

  deaf = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
          "signal.signal(signal.SIGINT, lambda *a: sys.exit(130)); time.sleep(60)")

  def plan(learner_code, service_code=deaf):
    def planned(args, cfg, run_dir):
      return ([launch_lib.Child(f"server{i}", [sys.executable, "-c", service_code],
                                url="http://127.0.0.1:1") for i in range(3)],
              [launch_lib.Child("learner", [sys.executable, "-c", learner_code])])
    return planned

  monkeypatch.setattr(launch_lib, "wait_healthy", lambda child, timeout_s: None)
  monkeypatch.setattr(launch_lib, "STOP_GRACE_S", 2.0)
  monkeypatch.setattr(launch_lib, "plan", plan("import sys; sys.exit(3)"))
  t0 = time.monotonic()
  assert launch_lib.main(["local", "--config", "configs/tiny.yaml", "--run-dir",
                          str(tmp_path / "a")]) == 3
  assert time.monotonic() - t0 < 5  # (three services deaf to SIGTERM: 2 s, not 6)
  start = launch_lib.Child.start

  def started(child, lock):  # (two signals once the learner has its handlers)
    out = start(child, lock)
    if child.name == "learner":
      time.sleep(3)
      for _ in range(2):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
    return out

  monkeypatch.setattr(launch_lib.Child, "start", started)
  monkeypatch.setattr(launch_lib, "STOP_GRACE_S", 30.0)
  monkeypatch.setattr(launch_lib, "plan", plan(deaf, "import time; time.sleep(60)"))
  t0 = time.monotonic()
  assert launch_lib.main(["local", "--config", "configs/tiny.yaml", "--run-dir",
                          str(tmp_path / "b")]) == 143
  assert time.monotonic() - t0 < 15  # (the learner's SIGINT: at once, not in 30 s)


def test_a_launched_learner_tells_how_to_go_on_with_the_launch(tmp_path, monkeypatch):
  """The learner of a launch said `python -m jaxagent.train --run-dir D --resume` when it
  stopped, which fails: the run's config names the launch's services, dead by then. It
  says this launch again, with --resume (a new user)."""
  import argparse

  from jaxagent import config as config_lib
  from jaxagent.launch import plan
  from jaxagent.stopping import RESUME_COMMAND, resume_command

  args = argparse.Namespace(config="configs/tiny.yaml", servers=2, env_workers=1,
                            learner_processes=1, resume=False, overrides=["steps=7"])
  cfg = config_lib.load(config_lib.RunConfig, args.config, args.overrides)
  _, (learner,) = plan(args, cfg, str(tmp_path / "run"))
  again = learner.env[RESUME_COMMAND]
  assert again == (f"python -m jaxagent.launch local --config configs/tiny.yaml --run-dir "
                   f"{tmp_path / 'run'} --servers 2 --env-workers 1 --learner-processes 1 "
                   "--resume steps=7")
  assert resume_command("D") == "python -m jaxagent.train --run-dir D --resume"
  monkeypatch.setenv(RESUME_COMMAND, again)  # as the learner's process has it
  assert resume_command("D") == again


def test_launched_learner_processes_get_the_heartbeat_timeout(tmp_path):
  """`launch local --learner-processes 2 --heartbeat-timeout 10`: each learner process,
  and the command that goes on with the launch, carry it (a reviewer: launched runs
  always waited JAX's 100 s for a silent process)."""
  import argparse

  from jaxagent import config as config_lib
  from jaxagent.launch import plan
  from jaxagent.stopping import RESUME_COMMAND

  args = argparse.Namespace(config="configs/tiny.yaml", servers=1, env_workers=1,
                            learner_processes=2, resume=False, overrides=[],
                            heartbeat_timeout=10)
  cfg = config_lib.load(config_lib.RunConfig, args.config, args.overrides)
  _, learners = plan(args, cfg, str(tmp_path / "run"))
  for i, learner in enumerate(learners):
    at = learner.cmd.index("--heartbeat-timeout")
    assert learner.cmd[at + 1] == "10" and learner.cmd[learner.cmd.index("--process-id") + 1] \
        == str(i)
    assert "--heartbeat-timeout 10" in learner.env[RESUME_COMMAND]


def test_a_run_started_with_ctrl_c_ignored_keeps_ignoring_it(tmp_path):
  """Started in the background of a shell without job control, a run has SIGINT ignored
  from its start: one before its first step was lost, and one after
  it (the run's own handler, taken at the first step) stopped the run (a new user).
  Ignored from the start, it stays ignored; SIGTERM still stops the run."""
  import asyncio

  from jaxagent.stopping import StopSignals

  before = signal.signal(signal.SIGINT, signal.SIG_IGN)
  loop = asyncio.new_event_loop()
  try:
    signals = StopSignals(str(tmp_path)).install(loop)
    assert signals.handled == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    signals.remove(loop)
  finally:
    loop.close()
    signal.signal(signal.SIGINT, before)
  loop = asyncio.new_event_loop()
  try:  # (not ignored: Ctrl-C is the run's, as before)
    signals = StopSignals(str(tmp_path)).install(loop)
    assert signals.handled == [signal.SIGTERM, signal.SIGINT]
    signals.remove(loop)
  finally:
    loop.close()


def test_a_run_directory_in_use_is_refused_before_any_service_starts(tmp_path, capsys):
  """A reviewer: a second launch on a run going on rewrote its service configs (a dead
  server came back on the second launch's port) and started every service before its
  learner met the lock. It is refused first, and writes nothing there."""
  from jaxagent import launch as launch_lib
  from jaxagent.run_dir import lock_run_dir

  run = tmp_path / "run"
  run.mkdir()
  held = lock_run_dir(str(run))  # (another trainer's)
  try:
    assert launch_lib.main(["local", "--config", "configs/tiny.yaml", "--run-dir",
                            str(run)]) == 2
    assert "is in use by another trainer" in capsys.readouterr().err
    assert sorted(os.listdir(run)) == [".lock"]
  finally:
    held.close()


def test_a_childs_output_is_read_to_its_end_when_the_launchers_own_is_gone(monkeypatch):
  """A reviewer: with the launcher's output gone (its terminal closed, a `tee` that died
  with a Ctrl-C) a write failed, its reader thread ended, and a child whose pipe then
  filled waited in a write for ever."""
  import io

  from jaxagent import launch as launch_lib

  class Gone(io.StringIO):
    def write(self, text):
      raise BrokenPipeError(32, "Broken pipe")

  monkeypatch.setattr(sys, "stdout", Gone())
  child = launch_lib.Child("talker", [sys.executable, "-c",
                                      "for i in range(20000): print('x' * 80, flush=True)"])
  child.start(threading.Lock())
  assert child.proc.wait(timeout=60) == 0

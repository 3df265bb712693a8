"""The whole system as separate processes on one machine, from one run config.

  python -m jaxagent.launch local --config configs/tiny.yaml [--learner-processes 2]
      [--servers N] [--env-workers M] [--run-dir D] [overrides ...]

Starts N rollout servers (`python -m rollout_server`, the run's model and engine
settings; several are routed by session by the learner's router), M environment
workers (`python -m envs.server`), waits until each answers `/health`, then the
learner (`python -m jaxagent.train`, as `--learner-processes` jax.distributed
processes) pointed at them with `serving.urls` / `env.urls`. Every child's output is
forwarded line by line with a `[name]` prefix. When the learner finishes, the
services are stopped. A service that dies during the run is started again on its
address (`--restarts` times each, as a cluster restarts a pod: a restarted rollout
server is given the policy by the learner's router before it serves again, and the
episodes a dead environment worker held end as infrastructure failures and are played
again); past its restarts it stops the run, named, except a rollout server while
others serve (said; the router fails its sessions over). A learner process that fails
stops the run. Ctrl-C or SIGTERM goes to the learners, which stop after their step and
checkpoint; then the services stop (a second one stops everything at once). Every
child is sent SIGTERM if the launcher itself dies (even by SIGKILL). With
`--servers 0` the learner keeps its in-process engine, with `--env-workers 0` its
in-process environments. The servers and the learners share one control token
(JAXAGENT_CONTROL_TOKEN), the environment workers and the learners an environment token
(JAXAGENT_ENV_TOKEN): the shell's, or fresh ones. Neither goes where the other's does.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Optional

from jaxagent import config as config_lib, control
from jaxagent.cli_args import log_to_console


RESTARTS = 3  # times a service that dies during the run is started again, by default


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _parent_death_signal():
  """A `preexec_fn` that has the kernel send the child SIGTERM when the launcher dies
  (Linux's PR_SET_PDEATHSIG; children run in sessions of their own, so nothing else
  would tell them), or None where there is no such call."""
  if not sys.platform.startswith("linux"):
    return None
  try:
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the fork
  except (OSError, AttributeError):
    return None
  PR_SET_PDEATHSIG = 1
  return lambda: prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


@dataclasses.dataclass
class Child:
  name: str
  cmd: list[str]
  url: Optional[str] = None  # a service's base URL (None for learner processes)
  proc: Optional[subprocess.Popen] = None
  env: Optional[dict] = None
  restarts: int = 0  # times started again after dying

  def start(self, out_lock: threading.Lock) -> "Child":
    self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, bufsize=1, env=self.env, start_new_session=True,
                                 preexec_fn=_parent_death_signal())
    threading.Thread(target=self._forward, args=(out_lock,), daemon=True).start()
    return self

  def _forward(self, out_lock: threading.Lock) -> None:
    for line in self.proc.stdout:  # (read to its end: a child whose pipe fills waits)
      with out_lock:
        _say(f"[{self.name}] {line}", end="")

  def alive(self) -> bool:
    return self.proc is not None and self.proc.poll() is None

  def send(self, sig: int) -> None:
    if self.alive():
      with contextlib.suppress(ProcessLookupError):
        os.killpg(self.proc.pid, sig)

  def killed_after(self, deadline: float) -> None:
    """Waits for the child until `deadline` (time.monotonic()), then kills it."""
    if self.proc is None:
      return
    try:
      self.proc.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(self.proc.pid, signal.SIGKILL)
      self.proc.wait()


STOP_GRACE_S = 10.0  # (how long a child stopped is waited for before it is killed)


def stop_children(children: list[Child], told: list[Child]) -> None:
  """Stops `children` together: SIGTERM to each (SIGINT to those `told` to stop already,
  which a learner takes as the second request, stopping at once: a second SIGTERM within
  REPEATED_TERM_S of the first reads as the same one), then SIGKILL to those alive after
  STOP_GRACE_S (each was waited for in turn, up to 10 s a child; a reviewer)."""
  for c in children:
    c.send(signal.SIGINT if c in told else signal.SIGTERM)
  deadline = time.monotonic() + STOP_GRACE_S
  for c in children:
    c.killed_after(deadline)


def wait_healthy(child: Child, timeout_s: float) -> None:
  """Polls `child.url/health` until it answers 200; raises naming the child if it dies
  or does not answer in time."""
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if not child.alive():
      raise RuntimeError(f"{child.name} exited with code {child.proc.returncode} while "
                         "starting (its output is above)")
    try:
      with urllib.request.urlopen(f"{child.url}/health", timeout=2) as r:
        if r.status == 200:
          return
    except OSError:
      pass
    time.sleep(0.3)
  raise RuntimeError(f"{child.name} did not answer {child.url}/health within {timeout_s:.0f} s")


def server_config(cfg: config_lib.RunConfig, port: int, host: str = "127.0.0.1") -> dict:
  """A rollout server's config: the run's model and engine, this address. Every server
  serves the policy under the run's `name`, as an in-process server does (they were
  named server0, server1, ... and `rollout`: requests naming the run's model were refused,
  and two replicas of one policy answered to two names: a new user)."""
  return {"name": cfg.name, "seed": cfg.seed, "host": host, "port": port,
          "model": dataclasses.asdict(cfg.model),
          "engine": dataclasses.asdict(cfg.serving.engine),
          "update_mode": cfg.rollout.update_mode,
          # (the run's judge, teacher or reference: served by its servers, named in its
          # requests; a config with them could not be launched: red team 25)
          "models": {name: dataclasses.asdict(m) for name, m in cfg.serving.models.items()}}


def without_served_models(cfg: config_lib.RunConfig) -> config_lib.RunConfig:
  """The learner's config where its servers serve `serving.models` (their configs)."""
  return dataclasses.replace(cfg, serving=dataclasses.replace(cfg.serving, models={}))


def check_with_services(cfg: config_lib.RunConfig, servers: int, env_workers: int) -> None:
  """The learner's config checks (ConfigError) as it will run: with `servers` rollout
  servers and `env_workers` environment workers in its serving.urls / env.urls (the
  addresses stand in for theirs: none is reached)."""
  from jaxagent.run_checks import check_config, check_served_models, check_served_names

  urls = lambda n: [f"http://127.0.0.1:{i + 1}" for i in range(n)]  # noqa: E731
  if servers:  # (the servers serve the run's models: each checked, each name found)
    check_served_models(cfg.serving.models)
    check_served_names(cfg)
    cfg = without_served_models(cfg)
  check_config(dataclasses.replace(
      cfg, serving=dataclasses.replace(cfg.serving, urls=urls(servers)) if servers
      else cfg.serving, env=dataclasses.replace(cfg.env, urls=urls(env_workers))
      if env_workers else cfg.env))


def plan(args, cfg: config_lib.RunConfig, run_dir: str) -> tuple[list[Child], list[Child]]:
  """The services and the learner processes to start (nothing is started here)."""
  from omegaconf import OmegaConf

  from jaxagent.stopping import RESUME_COMMAND

  py = sys.executable
  services: list[Child] = []
  # The servers and the learners share a control token (`jaxagent.control`), the
  # environment workers and the learners an environment token: the shell's, or ones made
  # for this launch. Environment workers, which run the policy's code, are not given the
  # control token, nor the servers the environments'.
  tokens = {control.CONTROL.env: control.CONTROL.from_env() or control.new_token(),
            control.ENVS.env: control.ENVS.from_env() or control.new_token()}
  bare = {k: v for k, v in os.environ.items() if k not in tokens}
  servers_env = {**bare, control.CONTROL.env: tokens[control.CONTROL.env]}
  workers_env = {**bare, control.ENVS.env: tokens[control.ENVS.env]}
  launch_dir = os.path.join(run_dir, "launch")
  os.makedirs(launch_dir, exist_ok=True)
  for i in range(args.servers):
    port = free_port()
    path = os.path.join(launch_dir, f"server{i}.yaml")
    OmegaConf.save(OmegaConf.create(config_lib.literal(server_config(cfg, port))),
                   path)
    services.append(Child(f"server{i}", [py, "-m", "rollout_server", "--config", path,
                                         "--log-level", "warning"],
                          url=f"http://127.0.0.1:{port}", env=servers_env))
  for j in range(args.env_workers):
    port = free_port()
    cmd = [py, "-m", "envs.server", "--port", str(port), "--log-level", "warning",
           "--sandboxes", str(cfg.env.sandboxes)]
    if cfg.env.allow_unisolated:
      cmd.append("--allow-unisolated")
    for cgroup in cfg.env.cgroups:  # (each worker's sandboxes' cgroups are named apart)
      cmd += ["--cgroup", cgroup]
    for module in cfg.env.imports:
      cmd += ["--import", module]
    services.append(Child(f"env{j}", cmd, url=f"http://127.0.0.1:{port}", env=workers_env))
  overrides, learner_config = list(args.overrides), args.config
  servers = [c.url for c in services if c.name.startswith("server")]
  envs = [c.url for c in services if c.name.startswith("env")]
  if servers and cfg.serving.models:  # (an override cannot take keys out of a mapping)
    learner_config = os.path.join(launch_dir, "learner.yaml")
    OmegaConf.save(OmegaConf.create(config_lib.literal(config_lib.to_dict(
        without_served_models(cfg)))), learner_config)
    overrides = []  # (in the file)
  if servers:
    overrides.append("serving.urls=[" + ",".join(f'"{u}"' for u in servers) + "]")
  if envs:
    overrides.append("env.urls=[" + ",".join(f'"{u}"' for u in envs) + "]")
  base = [py, "-m", "jaxagent.train", "--config", learner_config, "--run-dir", run_dir,
          *(["--resume"] if getattr(args, "resume", False) else [])]
  learners = []
  n = args.learner_processes
  coordinator = f"127.0.0.1:{free_port()}"
  # How a stopped learner tells the user to go on: this launch again, with --resume (its
  # services' addresses are in the run's config and die with this launch).
  again = shlex.join(["python", "-m", "jaxagent.launch", "local", "--config", args.config,
                      "--run-dir", run_dir, "--servers", str(args.servers), "--env-workers",
                      str(args.env_workers), "--learner-processes", str(n),
                      *(["--restarts", str(args.restarts)]
                        if getattr(args, "restarts", RESTARTS) != RESTARTS else []),
                      *(["--heartbeat-timeout", str(args.heartbeat_timeout)]
                        if getattr(args, "heartbeat_timeout", None) else []),
                      "--resume", *args.overrides])
  env = {**bare, **tokens, RESUME_COMMAND: again}
  for i in range(n):
    extra = ([] if n == 1 else
             ["--coordinator", coordinator, "--num-processes", str(n), "--process-id", str(i),
              *(["--heartbeat-timeout", str(args.heartbeat_timeout)]
                if getattr(args, "heartbeat_timeout", None) else [])])
    learners.append(Child("learner" if n == 1 else f"learner{i}", base + extra + overrides,
                          env=env))
  return services, learners


class _Failed(RuntimeError):
  """A learner process failed; `code` is the launch's exit code (the learner's own: 2 a
  refused config, 3 the infrastructure; a service's death is 1)."""

  def __init__(self, message: str, code: int):
    super().__init__(message)
    self.code = code


def _code(returncode: int) -> int:
  """A child's exit as a shell's code (killed by signal N: 128 + N)."""
  return 128 - returncode if returncode < 0 else returncode


def _say(*args, **kwargs) -> None:
  """`print`, flushed, that a launcher's output gone (its terminal closed, the pipe to a
  `tee` that died with a Ctrl-C) leaves unsaid: it failed, the children's output was no
  longer read (a learner waited in a write for ever) or a signal's handler raised (its
  learners then stopped at once, without a checkpoint; a reviewer)."""
  with contextlib.suppress(OSError, ValueError):
    print(*args, **{"flush": True, **kwargs})


def run_local(args) -> int:
  problem = control.env_problem()
  if problem:
    print(f"error: {problem}", file=sys.stderr)
    return 2
  if args.config is None:
    print("error: --config is required" + (
        " with --resume too (the services are built from it: the run directory keeps the "
        "learner's side of the config only)" if args.resume else ""), file=sys.stderr)
    return 2
  if not args.start_timeout_s > 0:  # (NaN included)
    print(f"error: --start-timeout-s {args.start_timeout_s}: must be > 0 seconds",
          file=sys.stderr)
    return 2
  try:
    cfg = config_lib.load(config_lib.RunConfig, args.config, args.overrides)
  except config_lib.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  for flag in ("servers", "env_workers", "restarts"):
    if getattr(args, flag) < 0:
      print(f"error: --{flag.replace('_', '-')} must be >= 0", file=sys.stderr)
      return 2
  if args.learner_processes < 1:
    print("error: --learner-processes must be >= 1", file=sys.stderr)
    return 2
  if getattr(args, "heartbeat_timeout", None) is not None and args.heartbeat_timeout < 1:
    # (train refused it, after every service had started and passed its health check)
    print("error: --heartbeat-timeout must be >= 1 (seconds)", file=sys.stderr)
    return 2
  if args.resume and not args.run_dir:
    print("error: --resume needs --run-dir (the run to go on with)", file=sys.stderr)
    return 2
  from jaxagent.run_dir import holds_a_run, in_use, started_a_run

  try:  # the learner's checks, before any service starts (with the URLs it will get)
    check_with_services(cfg, args.servers, args.env_workers)
  except config_lib.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.run_dir and not args.resume and holds_a_run(args.run_dir):
    print(f"error: {args.run_dir} already holds a run: --resume to go on with it, or "
          "another --run-dir", file=sys.stderr)
    return 2
  if args.resume and not started_a_run(args.run_dir):  # (before any service starts)
    print(f"error: --resume: {args.run_dir} holds no run (no config.json, no checkpoint, "
          "no step recorded: nothing to resume; drop --resume to start the run)",
          file=sys.stderr)
    return 2
  if args.resume:  # (the learner's refusal, "a run keeps its model", came after the
    # services had started: red team 25; its notes of changes are the learner's to say)
    from jaxagent.run_dir import resumed_config
    try:
      resumed_config(cfg, args.run_dir, notes=[])
    except config_lib.ConfigError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
  run_dir = args.run_dir or os.path.join("runs", f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
  # (a run going on there: refused before its files are rewritten and any service
  # starts, on the running launch's ports; a reviewer)
  held = in_use(run_dir) if os.path.isdir(run_dir) else None
  if held:
    print(f"error: {held}", file=sys.stderr)
    return 2
  services, learners = plan(args, cfg, run_dir)
  lock = threading.Lock()
  started: list[Child] = []
  gone: list[Child] = []  # services that died (a rollout server with others left: said)

  def stop_all():  # (the learners first, while the services they may need still serve)
    stop_children([c for c in started if c in learners], told)
    stop_children([c for c in reversed(started) if c not in learners], told)

  # The first SIGTERM or Ctrl-C goes to the learners, which stop after their step and
  # checkpoint (as train does on its own) while the services they need keep serving;
  # then the services stop. A second one stops everything at once.
  got: dict = {"signal": None}
  told: list[Child] = []  # (the learners it went to)

  def tell(c: Child, signum: int) -> None:
    told.append(c)
    c.send(signum)

  def interrupted(signum, frame):
    first = got["signal"] is None
    got["signal"] = signum
    running = [c for c in learners if c.alive()]
    if first and running:
      for c in running:
        tell(c, signum)
      _say(f"launch: {signal.Signals(signum).name}: the learner stops after its step "
           "and checkpoints, then the services (again to stop everything now)",
           file=sys.stderr)
      return
    raise KeyboardInterrupt

  previous = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGTERM, signal.SIGINT)
              if signal.getsignal(sig) != signal.SIG_IGN}  # (ignored from its start: kept)
  try:
    for c in services:  # (in `started` first: a signal in its start stops it too)
      started.append(c)
      c.start(lock)
    for c in services:
      wait_healthy(c, args.start_timeout_s)
    _say(f"launch: {len(services)} services up; starting {len(learners)} learner "
         f"process(es); run dir {run_dir}")
    for c in learners:
      started.append(c)
      c.start(lock)
    if got["signal"] is not None:  # (it came while they started: those after it trained on
      for c in learners:  # until a second one; a reviewer)
        if c not in told and c.alive():
          tell(c, got["signal"])
    while True:
      if got["signal"] is not None:  # the learners were told to stop: wait for them
        if not any(c.alive() for c in learners):
          codes = ", ".join(f"{c.name} {c.proc.returncode}" for c in learners)
          _say(f"launch: the learner stopped ({codes}); stopping the services",
               file=sys.stderr)
          # (the signal's code only when each learner stopped for it: one that failed
          # or was killed, its checkpoint unsaved, is said by its own code)
          ends = [_code(c.proc.returncode) for c in learners]
          failed = [end for end in ends if end not in (0, 128 + got["signal"])]
          # (every learner ended its run meanwhile: it finished, said as such)
          return failed[0] if failed else 0 if not any(ends) else 128 + got["signal"]
        time.sleep(0.2)
        continue
      if all(c.proc.poll() == 0 for c in learners):
        _say("launch: the learner finished; stopping the services")
        return 0
      # A dead service first: it is the cause when a learner fails after it. It is
      # started again on its address while it has restarts left; past them, a rollout
      # server while others serve is not fatal: the learner's router fails its sessions over.
      for c in services:
        if not c.alive() and c not in gone:
          if c.restarts < args.restarts:
            c.restarts += 1
            _say(f"launch: {c.name} exited with code {c.proc.returncode} during the run; "
                 f"starting it again (restart {c.restarts} of {args.restarts})",
                 file=sys.stderr)
            c.start(lock)
            continue
          gone.append(c)
          left = [s for s in services if s.alive() and s.name.startswith("server")]
          if c.name.startswith("server") and left:
            _say(f"launch: {c.name} exited with code {c.proc.returncode} during the run; "
                 f"the learner goes on with {len(left)} server(s)", file=sys.stderr)
            continue
          raise RuntimeError(f"{c.name} exited with code {c.proc.returncode} during the run")
      for c in learners:
        code = c.proc.poll()
        if code not in (None, 0):
          raise _Failed(f"{c.name} exited with code {code}", _code(code))
      time.sleep(0.2)
  except RuntimeError as e:
    _say(f"launch: error: {e}; stopping the others", file=sys.stderr)
    # (a learner killed: the others stop with it, unsaved, and none said how to go on: a
    # new user; one that stopped itself said it, or was refused)
    got["hint"] = isinstance(e, _Failed) and e.code > 128
    return e.code if isinstance(e, _Failed) else 1
  except KeyboardInterrupt:
    _say("launch: interrupted; stopping every process", file=sys.stderr)
    return 128 + (got["signal"] or signal.SIGINT)
  finally:
    for sig in previous:  # (stopping is not cut short: no orphans)
      signal.signal(sig, signal.SIG_IGN)
    try:
      stop_all()
      from jaxagent.stopping import RESUME_COMMAND, go_on_hint
      again = (learners[0].env or {}).get(RESUME_COMMAND)
      if got.get("hint") and again:
        _say(f"launch: {go_on_hint(run_dir, again)}", file=sys.stderr)
    finally:  # (a caller in this process gets its own handlers back: a test after an
      # in-process launch found Ctrl-C ignored)
      for sig, handler in previous.items():
        if handler is not None:  # (None: one not set from Python, which it cannot restore)
          signal.signal(sig, handler)


def main(argv=None) -> int:
  log_to_console()
  p = argparse.ArgumentParser(
      allow_abbrev=False, prog="python -m jaxagent.launch", description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="where", required=True)
  local = sub.add_parser("local", help="every part as a process on this machine",
                         allow_abbrev=False)
  local.add_argument("--config", help="the run's config (also with --resume: the services "
                     "are built from it; the run directory keeps the learner's side only)")
  local.add_argument("--learner-processes", type=int, default=1)
  local.add_argument("--servers", type=int, default=1)
  local.add_argument("--env-workers", type=int, default=1)
  local.add_argument("--run-dir", default=None)
  local.add_argument("--resume", action="store_true",
                     help="the learner goes on with the run in --run-dir (fresh services)")
  local.add_argument("--start-timeout-s", type=float, default=180.0)
  local.add_argument("--restarts", type=int, default=RESTARTS,
                     help="times a service that dies during the run is started again")
  local.add_argument("--heartbeat-timeout", type=int, default=None, metavar="SECONDS",
                     help="with --learner-processes: how long a silent learner process "
                          "is waited for before the others stop (train's flag)")
  local.add_argument("overrides", nargs="*", help="dotted config overrides")
  args = config_lib.parse_with_overrides(p, argv, config_lib.RunConfig)
  return run_local(args)


if __name__ == "__main__":
  sys.exit(main())

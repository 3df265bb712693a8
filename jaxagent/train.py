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
import contextlib
import asyncio
import os
import shlex
import signal
import sys
import time
import traceback
from typing import Sequence

import jax

from jaxagent import config as config_lib, control, distributed
from jaxagent.agreements import exit_code
from jaxagent.checkpoint import CheckpointUnreadable
from jaxagent.cli_args import log_to_console
from jaxagent.errors import (EpisodeBug, InfraError, InfraOutage, NonFiniteUpdate, PeerFailed,
                             PeerLost, RunWriteFailed, TaskError, disk_hint)
from jaxagent.metrics import RecordsDamaged
from jaxagent.run_checks import check_config
from jaxagent.run_dir import (RunDirInUse, has_checkpoint, holds_a_run, in_use,
                              lock_run_dir, pinned_exports, resumed_config, started_a_run)
from jaxagent.stopping import (RESUME_COMMAND, go_on_hint, leave_stuck_threads, resume_command,
                               resume_on)
from jaxagent.training_run import TrainingRun


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


async def train(cfg: config_lib.RunConfig, run_dir: str, resume: bool,
                canary: bool = False, notes: Sequence[str] = ()) -> int:
  """The run (`main` checks its command line first). `notes`: a resume's changes to the
  run's config, said once its checkpoint is restored (a refusal before that, an
  unreadable checkpoint or a config it cannot build, applies none of them)."""
  run = TrainingRun(cfg, run_dir)
  await run.open(resume, canary, notes)
  return await run.go()


def main(argv=None) -> int:
  args = parse_args(argv)
  log_to_console()
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
    held = in_use(run_dir)  # (a run going on there is said as such)
    if held:
      print(f"error: {held}", file=sys.stderr)
      return 2
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
  try:  # (the version each served model loads: config.json records it, a resume keeps it)
    cfg = pinned_exports(cfg)
  except config_lib.ConfigError as e:
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
    except EpisodeBug as e:  # (one line and the environment's own frames, not the stack
      # through the run's loop; the whole of it for a bug of the run's own code)
      e.say(f" (fixed, then: {resume_command(run_dir)})" if has_checkpoint(run_dir) else "")
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
      # (a second trainer started meanwhile holds a lock of its own there: its directory
      # stays, and this one's end says nothing; a traceback before: a reviewer)
      with contextlib.suppress(OSError):
        os.rmdir(run_dir)


if __name__ == "__main__":
  # (the tokens out of the environment a black-box harness's programs would inherit;
  # the command's alone: a test's in-process main keeps its own environment)
  control.hold_tokens()
  try:
    exit_with = main()
  except SystemExit as e:
    exit_with = e.code if isinstance(e.code, int) else 1
  except BaseException:  # (a bug's traceback, then the same end: a stuck call is left)
    traceback.print_exc()
    exit_with = 1
  leave_stuck_threads(exit_with if isinstance(exit_with, int) else 1)
  sys.exit(exit_with)

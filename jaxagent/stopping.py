"""How a run stops. A first SIGTERM (a pod's eviction) or Ctrl-C stops it after the step
under way, with a checkpoint; a second, at once (`StopNow`, `exit_soon`); a learner whose
launcher died sends its output to a file; threads still blocked at the end are left
behind (`leave_stuck_threads`); and the command that goes on with the run
(`resume_command`)."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import sys
import threading
import time
from typing import Optional

from jaxagent.pools import busy_calls


# Set by `jaxagent.launch` for the learners it starts: the command that goes on with the run.
RESUME_COMMAND = "JAXAGENT_RESUME_COMMAND"


def leave_stuck_threads(code: int, grace_s: float = 5.0) -> None:
  """At the end of the command: calls of the run's executors still running after
  `grace_s` (an environment's blocked for ever, a collective a peer never joins) are
  left behind, the process ending with `code` (Python's exit joins every executor
  thread, and waited for them for ever). With several processes, jax.distributed is
  shut down first (bounded): the others pass their shutdown barrier."""
  deadline = time.monotonic() + grace_s
  while busy_calls() and time.monotonic() < deadline:
    time.sleep(0.05)
  stuck = busy_calls()
  if not stuck:
    return
  print(f"note: {stuck} calls (environments', or a collective's) were still running at "
        "the end; left behind", file=sys.stderr, flush=True)
  import jax  # (here: `unless_stopped` is the router's too, a process without JAX's work)

  if jax.process_count() > 1:
    down = threading.Thread(target=jax.distributed.shutdown, daemon=True)
    down.start()
    down.join(30.0)
  sys.stdout.flush()
  os._exit(code)


# A second signal ends the process within this long, whatever its threads wait on.
STOP_NOW_S = 10.0


# A SIGTERM this soon after a first one is the same request: the kernel sends a launched
# process its parent-death signal once for each of the launcher's threads as they die
# (two 14 ms apart stopped a run at once, without its checkpoint: red team 25).
REPEATED_TERM_S = 1.0


class RepeatedTerm:
  """Tells a signal that repeats a SIGTERM received less than REPEATED_TERM_S before from
  a new request (`same_request`), and sends the process's output to `orphan_log` once its
  parent is gone: a launched learner's stdout is a pipe to the launcher, and a write to
  it, the launcher dead, ended the run before its checkpoint (red team 25)."""

  def __init__(self, orphan_log: str):
    self.parent, self.orphan_log = os.getppid(), orphan_log
    self.term_at: Optional[float] = None
    # The parent as the last signal found it (None: no signal yet): a SIGTERM that finds
    # another is the parent's death signal, during the stop the last one asked for.
    self.last_parent: Optional[int] = None

  def same_request(self, sig: int) -> bool:
    parent = os.getppid()
    if self.orphan_log and parent != self.parent and _output_may_be_gone():
      output_to_file(self.orphan_log)
      self.orphan_log = ""
    now = time.monotonic()
    died = self.last_parent is not None and parent != self.last_parent
    self.last_parent = parent
    if sig != signal.SIGTERM:
      return False
    repeat = self.term_at is not None and now - self.term_at < REPEATED_TERM_S
    self.term_at = now
    # (a parent's death during a stop, after a SIGTERM or a Ctrl-C, is no call to stop at
    # once, once: a reviewer; an orphan's later SIGTERM is one: a run left by its shell,
    # its stop stuck, took no SIGTERM again, and one after its Ctrl-C stopped it at once)
    return repeat or died


def _output_may_be_gone() -> bool:
  """Whether stdout or stderr is a pipe or socket (its reader may die with the parent) or
  a terminal that hung up (its window closed: every write fails with EIO); a file or a
  live terminal stays where it is (output to a file of a run started in the background by
  a shell that then exited went to the orphan log: a new user's finding)."""
  for fd in (1, 2):
    try:
      mode = os.fstat(fd).st_mode
    except OSError:
      continue
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
      return True
    if stat.S_ISCHR(mode):
      try:
        os.write(fd, b"")  # (a hung-up terminal refuses even nothing: no longer a tty)
      except OSError:
        return True
  return False


def output_to_file(path: str) -> None:
  """Sends this process's stdout and stderr to `path` (appended) from now on."""
  try:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
  except OSError:
    fd = os.open(os.devnull, os.O_WRONLY)
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):  # (the pipe's reader is gone)
      pass
  os.dup2(fd, 1)
  os.dup2(fd, 2)
  os.close(fd)


def exit_soon(code: int, run_dir: str) -> None:
  """After a second signal: ends the process in STOP_NOW_S if it has not ended by then.
  A thread that waits for ever (a collective a hung peer never joins, an environment's
  blocking call) kept it alive: asyncio.run's close and Python's exit wait for the
  executor's threads (red team 21: a multi-process run outlived two SIGTERMs)."""
  def end():
    time.sleep(STOP_NOW_S)
    print(f"stopped at once (a thread was still waiting: a collective or an environment "
          f"call); {go_on_hint(run_dir)}", file=sys.stderr, flush=True)
    os._exit(code)

  threading.Thread(target=end, daemon=True, name="jaxagent-stop-now").start()


class StopNow(KeyboardInterrupt):
  """A second SIGTERM or Ctrl-C: stop at once (the process exits 128 + its number)."""

  def __init__(self, sig: signal.Signals):
    super().__init__(sig.name)
    self.signum = int(sig)


class StopSignals:
  """SIGTERM (a pod's eviction) and Ctrl-C to a run: the first asks it to stop after the
  step under way (`got`, the signal's name; `stopping`, set), then to checkpoint and
  export as at the end; a second stops it at once (`now`: StopNow is raised, and the
  process ends in STOP_NOW_S if a thread holds it). A SIGTERM that repeats one (a
  launcher's and its pod's, `RepeatedTerm`) is not a second request."""

  def __init__(self, run_dir: str):
    self.run_dir = run_dir
    self.got: Optional[str] = None
    self.now = False  # (the run's task is cancelled: its `finally` cannot tell why)
    self.stopping = asyncio.Event()
    self.repeats = RepeatedTerm(os.path.join(run_dir, "output-after-launcher.log"))
    self.handled: list = []

  def install(self, loop: asyncio.AbstractEventLoop) -> "StopSignals":
    for sig in (signal.SIGTERM, signal.SIGINT):
      if signal.getsignal(sig) == signal.SIG_IGN:  # (a job started in the background of
        # a shell without job control: ignored from its start, as before this; taken
        # here, a signal before the first step was lost and one after it stopped the
        # run: a new user)
        continue
      try:
        loop.add_signal_handler(sig, self.request, sig)
        self.handled.append(sig)
      except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
        pass
    return self

  def remove(self, loop: asyncio.AbstractEventLoop) -> None:
    for sig in self.handled:
      loop.remove_signal_handler(sig)

  def request(self, sig: signal.Signals) -> None:
    if self.repeats.same_request(sig):
      return
    if self.got is not None:
      self.now = True
      exit_soon(128 + sig, self.run_dir)
      raise StopNow(sig)
    self.got = sig.name
    self.stopping.set()
    print(f"{sig.name}: stopping once the step under way, if any, is done (again to stop "
          "now)", file=sys.stderr, flush=True)


async def unless_stopped(work, stop: asyncio.Event):
  """`work`'s result, or None when `stop` is set before it ends (it is cancelled)."""
  task = asyncio.ensure_future(work)
  waiting = asyncio.ensure_future(stop.wait())
  try:
    await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
  finally:
    waiting.cancel()
    if not task.done():
      task.cancel()
  try:
    return await task
  except asyncio.CancelledError:
    if task.cancelled() and stop.is_set():
      return None
    raise


# A multi-process run's flags for its resume command, and on which processes it runs
# (`resume_on`).
_RESUMED_BY = {"flags": "", "where": ""}


def resume_on(flags: str, where: str) -> None:
  """Sets what `resume_command` adds for a multi-process run: the flags each process
  resumes with (` --num-processes N ...`) and where it runs (`, on each of the N
  processes ...`)."""
  _RESUMED_BY["flags"], _RESUMED_BY["where"] = flags, where


def go_on_hint(run_dir: str, command: Optional[str] = None) -> str:
  """How a run stopped at once goes on (with `command`, this process's `resume_command`
  unless given): from its last checkpoint, or from step 0 where it has none yet (a
  Ctrl-C in its start-up was told "from the last checkpoint": a new user)."""
  from jaxagent.run_dir import has_checkpoint, started_a_run

  command = command or resume_command(run_dir)
  if has_checkpoint(run_dir):
    return f"to go on from the last checkpoint: {command}"
  if started_a_run(run_dir):  # (its config written: --resume takes it, from step 0)
    return f"no checkpoint yet: {command} starts it again from step 0"
  # (stopped before its config was written: --resume refuses a directory holding no run)
  return f"nothing of the run was saved yet in {run_dir}: start it again as it was started"


def resume_command(run_dir: str) -> str:
  """The command that goes on with this run: `launch local ... --resume` when a launch
  started this learner (its services die with the launch), else train's own (on every
  process of a multi-process run, with their flags)."""
  return os.environ.get(RESUME_COMMAND) or (
      f"python -m jaxagent.train --run-dir {run_dir} --resume{_RESUMED_BY['flags']}"
      f"{_RESUMED_BY['where']}")

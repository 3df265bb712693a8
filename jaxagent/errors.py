"""Typed failures.

An `InfraError` is the infrastructure's fault, not the policy's: a rollout server that
is down, overloaded or too slow (a turn deadline), an environment worker or sandbox
that failed, the network. An episode that meets one is retried within its budget, then
dropped and counted by `kind`; it is never trained as a score. Anything else an episode
raises is a bug (`EpisodeBug`): it stops the run, naming its task and line, instead of
hiding as a failure.
"""

from __future__ import annotations

import errno
import re
from typing import Optional


class InfraError(RuntimeError):
  """An infrastructure failure; `kind` names it for the drop counters (`server`,
  `server_overload`, `turn_deadline`, `episode_deadline`, `env_worker`, `sandbox`, ...):
  a short name (letters, digits, `_`, at most 40). Anything else given there is a message
  (`InfraError("grader service down")`: each wording was a metric of its own, named with
  spaces), counted under `other`."""

  def __init__(self, kind: str, message: str = ""):
    if not _KIND.fullmatch(str(kind)):
      kind, message = "other", f"{kind}: {message}" if message else str(kind)
    super().__init__(f"{kind}: {message}" if message else kind)
    self.kind = kind


_KIND = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,39}")


class TaskError(ValueError):
  """A task its environment cannot start (bad parameters in the task file): the data's
  fault, not a bug of the code and not the infrastructure's; the run stops naming it."""


class EpisodeBug(RuntimeError):
  """An episode raised what is neither the policy's outcome nor the infrastructure's
  failure: a bug, mostly its environment's. The run stops naming the task and the line
  that raised; `frames()` are the lines of the code outside this package that the error
  passed through (an environment's own), for the message instead of the whole stack
  through the run's loop (78 lines for a verify's ZeroDivisionError: a new user)."""

  def __init__(self, task, error: BaseException, message: Optional[str] = None):
    """`message`: None for the episode's (the task, where it raised, what)."""
    from envs.base import raised_at

    # (an asyncio.TaskGroup's group of one: the error in it, not "1 sub-exception")
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
      error = error.exceptions[0]

    if message is None:
      of = (f" of task {task.id!r} ({task.env})"
            if hasattr(task, "id") and hasattr(task, "env") else "")
      if getattr(error, "on_worker", False):  # (its line is in the worker's answer)
        message = (f"an episode{of} failed on its environment worker (a bug, not an "
                   f"infrastructure failure): {error}")
      else:
        message = (f"an episode{of} raised {type(error).__name__} at "
                   f"{raised_at(error).rstrip(': ') or 'a line its traceback shows'} (a "
                   f"bug, not an infrastructure failure): {error}")
    super().__init__(message)
    self.error = error

  def frames(self) -> list[str]:
    """`path:line in function: code` for each frame of `error`'s traceback outside this
    package and the Python installation (an environment's), innermost last; [] for a
    worker's (its answer names its line) or a bug of this package's own."""
    import os
    import sysconfig
    import traceback

    if getattr(self.error, "on_worker", False):
      return []
    import envs.base
    import envs.waits

    import rollout_server

    package = os.path.dirname(os.path.abspath(__file__))
    ours = (os.path.join(package, ""),
            os.path.join(os.path.dirname(os.path.abspath(rollout_server.__file__)), ""))
    # (the environment tier's plumbing: how an environment is called and timed)
    plumbing = {os.path.abspath(m.__file__) for m in (envs.base, envs.waits)}
    plumbing.add(os.path.join(os.path.dirname(os.path.abspath(envs.base.__file__)),
                              "server.py"))
    python = tuple(os.path.join(sysconfig.get_paths()[k], "")
                   for k in ("stdlib", "platstdlib", "purelib", "platlib"))
    out = []
    for f in traceback.extract_tb(self.error.__traceback__):
      path = os.path.abspath(f.filename)
      if f.filename.startswith("<") or path.startswith((*ours, *python)) or path in plumbing:
        continue
      if path.startswith(os.getcwd() + os.sep):
        path = os.path.relpath(path)
      out.append(f"{path}:{f.lineno} in {f.name}: {(f.line or '').strip()}")
    return out

  def say(self, then: str = "") -> None:
    """Says the bug on stderr: the environment's lines it passed through, then one line
    naming the task and the line that raised, and `then` (the whole traceback where none
    of its lines is an environment's: a bug of this package's own)."""
    import sys
    import traceback

    frames = self.frames()
    if frames:
      print("the environment's lines it passed through, innermost last:", file=sys.stderr)
      for line in frames:
        print(f"  {line}", file=sys.stderr)
      for line in self.chain():
        print(f"  {line}", file=sys.stderr)
    elif not (getattr(self.error, "on_worker", False) or
              getattr(self.error, "said_whole", False)):
      traceback.print_exception(self.error, file=sys.stderr)
    print(f"error: {self}{then}", file=sys.stderr, flush=True)

  def chain(self) -> list[str]:
    """The errors `error` was raised from or while handling, each `(raised from | while
    handling) Name at path:line: message` (a KeyError an environment turned into a
    ValueError: its own line is where the bug is)."""
    from envs.base import raised_at

    out, e, seen = [], self.error, set()
    while True:
      cause = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
      if cause is None or id(cause) in seen:
        return out
      seen.add(id(cause))
      how = "raised from" if e.__cause__ is not None else "while handling"
      at = raised_at(cause).rstrip(": ")
      out.append(f"({how} {type(cause).__name__}{' at ' + at if at else ''}: {cause})")
      e = cause


class InfraOutage(RuntimeError):
  """Most recent episodes failed in the infrastructure (`rollout.max_infra_fraction`):
  a server, an environment worker or the sandbox is down. The run stops (and saves its
  checkpoint, with the tasks it has not trained on) instead of consuming its data on
  episodes that are all dropped."""


class RunWriteFailed(RuntimeError):
  """The run's own records (a checkpoint, the token WAL, its metrics) could not be
  written: a full disk, a lost mount. The run stops with one line (exit 3) instead of
  going on with what it cannot keep; not a bug of the code, and no episode's fault."""


class NonFiniteUpdate(RuntimeError):
  """A train step's loss or gradient norm is not finite: its weights are not kept,
  checkpointed nor served (a nan `advantage.gamma` trained every weight to nan and the
  run saved them as a checkpoint, exit 0: red team 15)."""


class PeerLost(RuntimeError):
  """Another process of a multi-process run is gone (killed, crashed, preempted): this
  one cannot go on (every step's collectives need them all) nor save (a checkpoint is
  written by all). It stops at once with one line (exit 3), leaving the run to be
  resumed from its last checkpoint, instead of waiting out the coordination service's
  heartbeat and aborting with its stack trace (85 s on CPU)."""


class PeerFailed(RuntimeError):
  """Another process of a multi-process run stopped with an error of its own (an
  environment's bug, an infrastructure outage it counted, a write that failed): its log
  says what and where. This one stops too, at the same point of the step, so that every
  process can still save the run's checkpoint together. `code`: the exit code the other
  stops with (this one stops with it too: 1 a bug, 2 the user's to change, 3 the
  infrastructure's, to be restarted)."""

  def __init__(self, message: str, code: int = 1):
    super().__init__(message)
    self.code = code


def disk_hint(e: BaseException) -> str:
  """"; the disk is full: ..." for an error of a full disk or quota, else ""."""
  full = "No space left on device" in str(e) or "Disk quota exceeded" in str(e) or getattr(
      e, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
  return "; the disk is full: free space there, then resume" if full else ""


# How every refusal of a prompt for its length begins, in the error of any server or
# gateway: the agent reads it as the conversation outgrowing the context (the policy's
# own truncation, scored), never as the infrastructure failing.
PROMPT_TOO_LONG = "prompt is too long"

"""Typed failures.

An `InfraError` is the infrastructure's fault, not the policy's: a rollout server that
is down, overloaded or too slow (a turn deadline), an environment worker or sandbox
that failed, the network. An episode that meets one is retried within its budget, then
dropped and counted by `kind`; it is never trained as a score. Anything else an episode
raises is a bug: it stops the run with its traceback instead of hiding as a failure.
"""

from __future__ import annotations

import errno


class InfraError(RuntimeError):
  """An infrastructure failure; `kind` names it for the drop counters (`server`,
  `server_overload`, `turn_deadline`, `episode_deadline`, `env_worker`, `sandbox`, ...)."""

  def __init__(self, kind: str, message: str = ""):
    super().__init__(f"{kind}: {message}" if message else kind)
    self.kind = kind


class TaskError(ValueError):
  """A task its environment cannot start (bad parameters in the task file): the data's
  fault, not a bug of the code and not the infrastructure's; the run stops naming it."""


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
  has the traceback. This one stops too, at the same point of the step, so that every
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

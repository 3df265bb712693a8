"""How the processes of a run stop together, and with what exit code.

With several processes, every step's collectives pair up in one order on all of them.
An error one process meets in its own work (an environment's bug while its episodes
play, an outage, a record it cannot write) is held until the next agreement, where
every process meets and learns of it: all stop there together and can still save the
checkpoint together. (Raised at once, the process went to its final save while the
others were in the step's collectives, which paired with its own: both hung for
minutes, then the coordination service aborted them.)
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Optional

import jax

from jaxagent import config as config_lib, distributed
from jaxagent.checkpoint import CheckpointUnreadable
from jaxagent.errors import (InfraError, InfraOutage, PeerFailed, PeerLost, RunWriteFailed,
                             TaskError, disk_hint)
from jaxagent.metrics import RecordsDamaged


def exit_code(e: BaseException) -> int:
  """The exit code of a run stopped by `e`: 2 for what its user must change (the config,
  the task file, a checkpoint to resume that cannot be read), 3 for the infrastructure's
  (a server, a worker, the disk, a lost process: restarted, it resumes), 1 for a bug."""
  if isinstance(e, PeerFailed):
    return e.code
  if isinstance(e, (config_lib.ConfigError, TaskError, CheckpointUnreadable, RecordsDamaged)):
    return 2
  if isinstance(e, (RunWriteFailed, PeerLost, InfraOutage, InfraError)) or (
      isinstance(e, OSError) and disk_hint(e)):
    return 3
  return 1


class Agreements:
  """The run's agreements: points every process meets at, in one order, exchanging JSON
  (on `pool`'s threads, off the event loop). `held` is this process's own error, for
  the next agreement."""

  def __init__(self, pool: Executor):
    self.pool = pool
    self.multi = jax.process_count() > 1
    self.held: list[BaseException] = []

  def hold(self, e: BaseException) -> None:
    """Alone: raises `e` now. With several processes: keeps it for the next agreement."""
    if not self.multi:
      raise e
    if not self.held:
      self.held.append(e)

  async def gather(self, at: str, **mine) -> tuple[list, Optional[PeerFailed]]:
    """(Every process's `mine` at the agreement `at`, what the others' errors say: None,
    or the `PeerFailed` to stop with). Processes found at another agreement (one that
    stopped with an error outside any) are out of step: `PeerLost` (no collective can
    pair up again)."""
    own = self.held[0] if self.held else None
    got = await asyncio.get_running_loop().run_in_executor(
        self.pool, distributed.gather_json, {
            "at": at, "error": None if own is None else f"{type(own).__name__}: {own}"[:500],
            "code": None if own is None else exit_code(own), **mine})
    apart = [i for i, g in enumerate(got) if not isinstance(g, dict) or g.get("at") != at]
    if apart:
      raise PeerLost(f"process {apart[0]} of the run is out of step (at this one's "
                     f"agreement {at!r} it was elsewhere: it stopped with an error, its log "
                     "says which)")
    me = jax.process_index()
    failed = [(i, g) for i, g in enumerate(got) if g["error"] and i != me]
    peer = None
    if failed:
      i, g = failed[0]
      peer = PeerFailed(f"process {i} of the run stopped with an error ({g['error']}; its "
                        "log says more)", code=g["code"])
    return got, peer

  async def agree(self, at: str, **mine) -> list:
    """Every process's `mine` at the agreement `at` (all meet at each, in one order); this
    process's held error is raised here, another's as `PeerFailed`."""
    got, peer = await self.gather(at, **mine)
    if self.held:
      raise self.held.pop()
    if peer is not None:
      raise peer
    return got

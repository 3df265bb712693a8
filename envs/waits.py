"""Time an environment call spends waiting on shared infrastructure.

A sandboxed command waits for one of its pool's execution slots; a call on an
environment worker waits for a turn under the worker's call cap. How long depends on
the other episodes' load, not on the policy's actions, so those waits are kept apart
from a call's own time: an environment worker's deadline bounds a call's work and not
its waits (each wait has a bound of its own), and an episode whose wall-clock budget
runs out charges them to the infrastructure, not to the policy.

    with measured() as clock:      # who wants to know (the worker, the agent loop)
      await env.step(action)
    clock.total_s()

    with waiting():                # where a wait happens (the sandbox, the worker)
      await slot.acquire()

The clock travels in a context variable, so tasks and threads started inside
`measured()` report to it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from typing import Awaitable, Callable, Iterator, Optional


class WaitClock:
  """Seconds waited on shared infrastructure inside one `measured()` block, and seconds
  the policy's sandboxed commands ran (`commanding()`)."""

  def __init__(self):
    self.waited_s = 0.0  # waits that ended
    self._open: list[float] = []  # start times of waits in progress
    self.commands_s = 0.0  # commands that ended
    self._commands: list[float] = []  # start times of commands running

  @property
  def waiting(self) -> bool:
    return bool(self._open)

  def total_s(self) -> float:
    """Waits so far, those in progress included."""
    now = time.perf_counter()
    return self.waited_s + sum(now - t for t in self._open)

  def not_own_s(self) -> float:
    """What a call's deadline does not count: its waits and the policy's sandboxed
    commands (whose wall limits bound them)."""
    return self.total_s() + self.commands_total_s()

  def commands_total_s(self) -> float:
    """The policy's sandboxed commands' time so far (running, and being killed: a
    command's teardown can take a minute), those in progress included."""
    now = time.perf_counter()
    return self.commands_s + sum(now - t for t in self._commands)


_CLOCK: contextvars.ContextVar[Optional[WaitClock]] = contextvars.ContextVar(
    "jaxagent_env_wait_clock", default=None)


@contextlib.contextmanager
def measured() -> Iterator[WaitClock]:
  """Runs the block with a fresh clock (yielded) that its infrastructure waits add to."""
  clock = WaitClock()
  token = _CLOCK.set(clock)
  try:
    yield clock
  finally:
    _CLOCK.reset(token)


@contextlib.contextmanager
def _marked(running: str, ended: str) -> Iterator[None]:
  """Times the block on the current clock (if any): its start in the list `running`
  while it runs, then its length added to `ended`."""
  clock = _CLOCK.get()
  if clock is None:
    yield
    return
  t0 = time.perf_counter()
  getattr(clock, running).append(t0)
  try:
    yield
  finally:
    getattr(clock, running).remove(t0)
    setattr(clock, ended, getattr(clock, ended) + time.perf_counter() - t0)


def commanding() -> contextlib.AbstractContextManager:
  """Marks the block as a sandboxed command of the policy's (on the current clock, if
  any): the policy's own time, which an environment call's deadline does not bound (a
  command that stalled its own kill made a wrong answer's call pass the deadline, an
  infrastructure error, re-rolled: red team 44). Its wall limit bounds the command."""
  return _marked("_commands", "commands_s")


def waiting() -> contextlib.AbstractContextManager:
  """Marks the block as a wait on shared infrastructure (on the current clock, if any)."""
  return _marked("_open", "waited_s")


class WallCut(Exception):
  """A task ran past its wall-time bound, waits and all."""


class DeadlineCut(asyncio.TimeoutError):
  """`within` cut a task at its deadline (not a TimeoutError of the task's own, which
  `within` raises as it is)."""


async def to_the_end(aw: Awaitable):
  """Awaits `aw` to its end even when cancelled meanwhile, again and again (cleanup that
  must finish: a command killed before its slot is freed); a cancellation that came
  meanwhile is raised after. `asyncio.shield` alone lets a second cancellation return
  at once, the cleanup still running."""
  task = asyncio.ensure_future(aw)
  cancelled = False
  while not task.done():
    try:
      await asyncio.shield(task)
    except asyncio.CancelledError:  # (ours, even when the cleanup ended in the meantime)
      cancelled = True
  if cancelled:
    raise asyncio.CancelledError
  return task.result()


async def within(task: asyncio.Future, waited: Callable[[], Awaitable[float]], limit_s: float,
                 wall_s: float, t0: float, *, look_s: float = 0.05,
                 on_cut: Optional[Callable[[], Awaitable[None]]] = None):
  """`task`'s result; `DeadlineCut` (an asyncio.TimeoutError) once its own time (wall time since `t0` less
  `waited()`, its waits on shared infrastructure) passes `limit_s`; `WallCut` once its
  wall time passes `wall_s`. Waits do not spend the budget: a crowded pool makes a task
  slower, not cut. It looks at least every `look_s` seconds (`waited()` may ask a remote
  worker). The task is cancelled, and its end awaited, when it is cut or when the caller
  is (whose cancellation goes through); `on_cut()` is awaited at a cut, before the
  task is cancelled (to see how its work in flight stands)."""
  try:
    while True:
      elapsed = time.perf_counter() - t0
      if elapsed >= wall_s:
        if on_cut is not None:
          await on_cut()
        raise WallCut
      left = limit_s - (elapsed - await waited())
      if left <= 0:
        if on_cut is not None:
          await on_cut()
        raise DeadlineCut
      done, _ = await asyncio.wait({task}, timeout=max(min(left, wall_s - elapsed), look_s))
      if done:
        return task.result()
  except BaseException:
    task.cancel()
    await asyncio.wait({task})
    raise

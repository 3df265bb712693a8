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

Every episode of a run moves on one event loop: while one environment's code holds it
(computes or blocks without awaiting), no other call moves, and their time runs.
`envs.loopwatch.LoopWatch` sees who held it and credits the hold to every other call in
a `measured()` block as a wait (`credit_hold`): a policy that makes its own environment
hold the loop spends its own budget, not its siblings'.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import time
from typing import Awaitable, Callable, Iterator, Optional, Sequence


class WaitClock:
  """Seconds waited on shared infrastructure inside one `measured()` block, and seconds
  the policy's sandboxed commands ran (`commanding()`)."""

  def __init__(self, owner: object = None, between_calls: bool = False):
    self.owner = self if owner is None else owner  # (whose calls' clocks are one's)
    # (its owner's time between its calls: credited a hold only while no call of its
    # owner's is measured)
    self.between_calls = between_calls
    self.waited_s = 0.0  # waits that ended
    self._open: list[float] = []  # start times of waits in progress
    self.commands_s = 0.0  # commands that ended
    self._commands: list[float] = []  # start times of commands running
    # Of its waits, those in queues that move (`queued()`)
    self.queued_s = 0.0
    self._queued: list[float] = []
    self.held_s = 0.0  # other code's holds of the event loop, credited (in waited_s too)
    self._ended: collections.deque = collections.deque(maxlen=64)  # (start, end) of marks
    self._loop: Optional[asyncio.AbstractEventLoop] = None  # (the loop it is measured on)
    self._t0 = time.perf_counter()  # (a hold before it is none of its waits)

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

  def queued_total_s(self) -> float:
    """Of its waits, those in queues that move so far (`queued()`), the one in progress
    included."""
    now = time.perf_counter()
    return self.queued_s + sum(now - t for t in self._queued)

  def _counted_s(self, t0: float, t1: float) -> float:
    """Seconds of [t0, t1] that its waits and commands (running, or ended lately)
    already leave out of its own time."""
    spans = list(self._ended) + [(t, t1) for t in self._open + self._commands]
    return min(t1 - t0, sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in spans))


_CLOCK: contextvars.ContextVar[Optional[WaitClock]] = contextvars.ContextVar(
    "jaxagent_env_wait_clock", default=None)


@contextlib.contextmanager
def measured(owner: object = None, *, between_calls: bool = False) -> Iterator[WaitClock]:
  """Runs the block with a fresh clock (yielded) that its infrastructure waits add to.
  `owner`: the episode or session whose call it is (by default the clock's it runs in,
  if any): a hold of the loop by code on another of its clocks (a task its environment
  started in an earlier call) is not credited to it. `between_calls`: the clock of an
  episode's time outside its environment calls (waiting on the server): credited a hold
  only while no call of its owner's is measured."""
  outer = _CLOCK.get()
  if owner is None and outer is not None:
    owner = outer.owner
  clock = WaitClock(owner, between_calls)
  try:
    clock._loop = asyncio.get_running_loop()
  except RuntimeError:  # (no loop: no hold to credit)
    pass
  token = _CLOCK.set(clock)
  _LIVE.add(clock)
  try:
    yield clock
  finally:
    _LIVE.discard(clock)
    _CLOCK.reset(token)


_LIVE: set[WaitClock] = set()  # the clocks of the `measured()` blocks open now

# What a look at a held loop saw running (`LoopWatch`), besides a call's clock: code
# outside any measured() call (the run's own, a task from before the watch, or a
# callback scheduled outside a call), or a task whose context the watch does not know
# (on 3.11, one made around its task factory).
NO_CALL, UNSEEN = "no_call", "unseen"


# Each watched loop's `LoopWatch.settle` (from its start to its stop; a plain dict: not
# every loop can be referred to weakly).
_SETTLE: dict[asyncio.AbstractEventLoop, Callable[[], None]] = {}


def settle_holds() -> None:
  """Credits a hold of the running loop that has just ended, if its watch has not yet
  (its heartbeat may run after a deadline that came due during the hold is judged)."""
  try:
    settle = _SETTLE.get(asyncio.get_running_loop())
  except RuntimeError:
    return
  if settle is not None:
    settle()


def credit_hold(loop: asyncio.AbstractEventLoop, t0: float, t1: float,
                seen: Sequence) -> tuple[int, float]:
  """Credits the hold of `loop` over [t0, t1] (perf_counter) as a wait to each call
  measured on it that did not hold it. `seen`: what each look during the hold saw
  running (a call's WaitClock, NO_CALL or UNSEEN); a call is credited the part of the
  hold that looks saw others hold (other owners' calls, or code in no call; UNSEEN is
  nobody's: a hold never looked at is credited to no one, as before the watch), less
  what its own waits and commands already leave out. Returns (the calls credited, the
  seconds charged to the calls that held it)."""
  if not seen or t1 <= t0:
    return 0, 0.0
  n = len(seen)
  # (by the owner's identity: a session or an episode need not be hashable)
  by = collections.Counter(id(c.owner) if isinstance(c, WaitClock) else c for c in seen)
  known = n - by.get(UNSEEN, 0)
  # (the clocks measured during the hold: one begun after it, before it was settled,
  # waited none of it)
  live = [c for c in _LIVE if c._loop is loop and c._t0 < t1]
  calling = {id(c.owner) for c in live if not c.between_calls}
  credited = 0
  for clock in live:
    if clock.between_calls and id(clock.owner) in calling:
      continue  # (the call's clock is credited)
    since = max(t0, clock._t0)
    share = (known - by.get(id(clock.owner), 0)) / n * (t1 - since
                                                        - clock._counted_s(since, t1))
    if share > 0:
      clock.waited_s += share
      clock.held_s += share
      credited += 1
  held = sum(k for c, k in by.items() if c not in (NO_CALL, UNSEEN)) / n * (t1 - t0)
  return credited, held


@contextlib.contextmanager
def _marked(running: str, ended: str, span: bool = True) -> Iterator[None]:
  """Times the block on the current clock (if any): its start in the list `running`
  while it runs, then its length added to `ended` (and, with `span`, its span to those
  a hold of the loop is not credited over again)."""
  clock = _CLOCK.get()
  if clock is None:
    yield
    return
  t0 = time.perf_counter()
  getattr(clock, running).append(t0)
  try:
    yield
  finally:
    t1 = time.perf_counter()
    getattr(clock, running).remove(t0)
    setattr(clock, ended, getattr(clock, ended) + t1 - t0)
    if span:
      clock._ended.append((t0, t1))


def commanding() -> contextlib.AbstractContextManager:
  """Marks the block as a sandboxed command of the policy's (on the current clock, if
  any): the policy's own time, which an environment call's deadline does not bound (a
  command that stalled its own kill made a wrong answer's call pass the deadline, an
  infrastructure error, re-rolled: red team 44). Its wall limit bounds the command."""
  return _marked("_commands", "commands_s")


def waiting() -> contextlib.AbstractContextManager:
  """Marks the block as a wait on shared infrastructure (on the current clock, if any)."""
  return _marked("_open", "waited_s")


def queued() -> contextlib.AbstractContextManager:
  """Marks the block (inside a `waiting()` one) as a wait in a queue that moves, with a
  bound of its own: a sandbox pool's (ended in its turn while the pool frees slots,
  however long the queue: the run's own load; a pool that frees none fails the command
  as stuck), a worker's call cap's (likewise), the source checks' (each bounded by its
  text's), a served judge's (its timeout and retries). An environment worker's call wall does not count it (`envs.server`): a
  crowd makes a call slower, not cut; an episode's wall time counts it, on the policy's
  side (`jaxagent.agent`)."""
  return _marked("_queued", "queued_s", span=False)


class WallCut(Exception):
  """A task ran past its wall-time bound (waits and all, but what `within`'s `unwalled`
  leaves out)."""


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
                 on_cut: Optional[Callable[[], Awaitable[None]]] = None,
                 unwalled: Optional[Callable[[], float]] = None):
  """`task`'s result; `DeadlineCut` (an asyncio.TimeoutError) once its own time (wall time since `t0` less
  `waited()`, its waits on shared infrastructure) passes `limit_s`; `WallCut` once its
  wall time passes `wall_s`. Waits do not spend the budget: a crowded pool makes a task
  slower, not cut. It looks at least every `look_s` seconds (`waited()` may ask a remote
  worker). The task is cancelled, and its end awaited, when it is cut or when the caller
  is (whose cancellation goes through); `on_cut()` is awaited at a cut, before the
  task is cancelled (to see how its work in flight stands). `unwalled()`: seconds of its
  wall time that the wall does not count (bounded otherwise)."""
  try:
    while True:
      settle_holds()  # (a hold of the loop that just ended: credited before it is judged)
      elapsed = time.perf_counter() - t0
      walled = elapsed - (unwalled() if unwalled is not None else 0.0)
      if walled >= wall_s:
        if on_cut is not None:
          await on_cut()
        raise WallCut
      left = limit_s - (elapsed - await waited())
      if left <= 0:
        if on_cut is not None:
          await on_cut()
        raise DeadlineCut
      done, _ = await asyncio.wait({task}, timeout=max(min(left, wall_s - walled), look_s))
      if done:
        settle_holds()  # (a hold it ended in is its waits' too, whoever asks them next)
        return task.result()
  except BaseException:
    task.cancel()
    await asyncio.wait({task})
    raise

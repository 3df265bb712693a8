"""Names the code that holds an event loop.

Every episode of a run (and every session of an env worker) moves on one event loop. An
environment's `async def` code that computes or blocks without awaiting (a regex over
the policy's output, a parse, `time.sleep`, a blocking client) holds that loop: no other
episode moves meanwhile, and their clocks still run, so their deadlines pass on
another's account. `LoopWatch` is a heartbeat on the loop, which measures each hold,
and a thread that looks at it; when the loop has not come round for `hold_s`, it logs
once, for that hold, where the loop's thread is (the innermost frame of code that is
not a library's, the innermost frame, and the task running), and when the hold ends,
how long it was. Plain tool functions already run on threads (`envs.tools`); blocking
work of an environment's own belongs in `asyncio.to_thread`.

A hold is not charged to those who only waited for it. The watch's thread looks, every
beat of a hold, at which environment call's clock (`envs.waits.measured`) the running
task's context holds (a task says its context from Python 3.12; on 3.11 a task factory
of the watch's own keeps them, while it runs), or a callback's (asyncio's handle keeps
the context it was scheduled in); when the hold ends, every other call
measured on the loop is credited its part as a wait (`envs.waits.credit_hold`). The holder's own deadline pays
for it: a policy cannot make its environment hold the loop to push its siblings past
their deadlines (a truncation, scored 0: their loss, its advantage).
"""

from __future__ import annotations

import asyncio
import contextvars
import linecache
import logging
import os
import sys
import sysconfig
import threading
import time
import weakref
from typing import Callable, Optional

from envs import waits

log = logging.getLogger(__name__)

LOUD_HOLDS = 10  # holds logged as warnings; later ones at DEBUG (all are counted)

# The standard library and installed packages (a virtual environment's platstdlib holds
# its site-packages): the frame named first is the innermost of the project's, or a
# user's, code.
# (as given and as resolved: a frame's file is told apart by its name alone, see `_where`)
_LIBRARIES = tuple({p + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib")
                    for p in (sysconfig.get_paths()[k], os.path.realpath(sysconfig.get_paths()[k]))})


def _where(frame, task: Optional[asyncio.Task]) -> str:
  """`file:line in function` of the innermost frame outside the standard library and
  installed packages (and the innermost frame, where that is another), and the task's
  name. With no system call per frame: each gives the GIL back to the code holding the
  loop and takes it again only after a switch interval (5 ms), so a look at 70 frames (a
  stack under pytest: realpath's lstats, traceback's stat of every file) named a 1.2 s
  hold after it had ended. Only the lines said are read."""
  stack = []  # (file, line, function), innermost first
  while frame is not None:
    stack.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
    frame = frame.f_back
  own = [f for f in stack if not f[0].startswith(_LIBRARIES)]
  said = []
  for filename, lineno, name in own[:1] + stack[:1]:
    line = linecache.getline(filename, lineno).strip()
    text = f"{filename}:{lineno} in {name}" + (f" ({line})" if line else "")
    if text not in said:
      said.append(text)
  if task is not None:
    coro = task.get_coro()
    said.append(f"task {task.get_name()} ({getattr(coro, '__qualname__', coro)})")
  return "; ".join(said) or "an unknown place"


_HANDLE_RUN = asyncio.events.Handle._run.__code__  # (a callback runs in its context)


def _callback_clock(loop_thread: int):
  """The call clock of the callback running on `loop_thread` (asyncio's handle keeps
  the context it was scheduled in), or waits.NO_CALL: none, or one outside a call."""
  frame = sys._current_frames().get(loop_thread)
  while frame is not None and frame.f_code is not _HANDLE_RUN:
    frame = frame.f_back
  if frame is None:
    return waits.NO_CALL
  context = getattr(frame.f_locals.get("self"), "_context", None)
  clock = context.get(waits._CLOCK) if isinstance(context, contextvars.Context) else None
  return clock or waits.NO_CALL


class LoopWatch:
  """Watches the running loop (start inside the loop, `stop()` at its end; an async
  context manager too). The loop's own heartbeat measures each hold (`holds`, `held_s`:
  those of `hold_s` or more, and their seconds in all, to a beat's 50 ms); a thread of
  its own looks as often, names a hold while it lasts, and sees whose call holds it:
  the hold is credited to the other calls (`settle`)."""

  def __init__(self, hold_s: float = 1.0, what: str = "episode",
               on_hold: Optional[Callable[[float], None]] = None):
    if hold_s <= 0:
      raise ValueError(f"hold_s must be > 0, got {hold_s}")
    self.hold_s = hold_s
    self.what = what  # (what waits: "episode", "session")
    self._on_hold = on_hold  # (each hold's seconds as it ends: a metrics counter)
    self.holds = 0
    self.held_s = 0.0
    self._named = 0  # holds named while they lasted
    # (a hold is measured from the beat before it: at most a beat's length short)
    self._beat_s = min(0.05, hold_s / 20)
    # A late beat of this much or more is a hold whose time is credited to the calls
    # that did not hold it (shorter ones are the loop's ordinary crowd).
    self._credit_s = 2 * self._beat_s
    self._beat = time.perf_counter()
    self._stop = threading.Event()
    self._loop: Optional[asyncio.AbstractEventLoop] = None
    self._thread: Optional[threading.Thread] = None
    self._beater: Optional[asyncio.Task] = None
    # Each task's context (where its code's `waits.measured()` clock is set; weakly: a
    # context can refer to its own task, through a clock's owner), on Pythons whose
    # tasks do not say (3.11); the tasks there before the watch (the run's own); and
    # what the looks at each hold (by the beat before it) saw running.
    self._contexts: "weakref.WeakKeyDictionary[asyncio.Task, weakref.ref]" = \
        weakref.WeakKeyDictionary()
    self._before: "weakref.WeakSet[asyncio.Task]" = weakref.WeakSet()
    self._seen: dict[float, list] = {}
    self._seen_lock = threading.Lock()
    self._factory = self._prior_factory = None
    self._credits = False  # (the loop's first watch credits holds; one within it only
    # names and counts them)

  def start(self) -> "LoopWatch":
    if self._loop is not None:
      raise RuntimeError("this LoopWatch was started already")
    self._loop = asyncio.get_running_loop()
    loop_thread = threading.get_ident()
    self._credits = self._loop not in waits._SETTLE
    if self._credits:
      self._before = weakref.WeakSet(asyncio.all_tasks(self._loop))
      if not hasattr(asyncio.Task, "get_context"):  # (3.11; 3.12 on, a task says)
        self._prior_factory = prior = self._loop.get_task_factory()
        contexts = self._contexts

        def factory(loop, coro, context=None, **kwargs):
          context = contextvars.copy_context() if context is None else context
          task = (asyncio.Task(coro, loop=loop, context=context, **kwargs) if prior is None
                  else prior(loop, coro, context=context, **kwargs))
          contexts[task] = weakref.ref(context)
          return task

        self._factory = factory
        self._loop.set_task_factory(factory)
      waits._SETTLE[self._loop] = self.settle
    self._beat = time.perf_counter()
    self._beater = self._loop.create_task(self._beats(), name="loopwatch-heartbeat")
    self._thread = threading.Thread(target=self._watch, args=(loop_thread,),
                                    name="loopwatch", daemon=True)
    self._thread.start()
    return self

  async def _beats(self) -> None:
    while True:
      await asyncio.sleep(self._beat_s)
      self.settle(beat=True)

  def settle(self, beat: bool = False) -> None:
    """Measures (and credits, and counts) the hold that has just ended, if there was
    one. On the loop: by its heartbeat each beat, and by `waits.within` before it judges
    a deadline (which may come due during a hold and be judged before the heartbeat
    runs)."""
    now = time.perf_counter()
    late = now - self._beat - self._beat_s
    if late >= self._credit_s or beat:
      self._beat, last = now, self._beat
    if late >= self._credit_s:
      with self._seen_lock:
        seen = self._seen.pop(last, [])
        self._seen.clear()  # (older beats' looks, seen after their hold ended)
      # (a bug here, or in `on_hold`, must not stop the heartbeat, nor fail a `within`)
      credited, charged = 0, 0.0
      if self._credits:
        try:
          credited, charged = waits.credit_hold(self._loop, last + self._beat_s, now, seen)
        except Exception:
          log.exception("could not credit a hold of the event loop to the calls it held up")
      if late >= self.hold_s:
        self.holds += 1
        self.held_s += late
        try:
          if self._on_hold is not None:
            self._on_hold(late)
        except Exception:
          log.exception("the event loop watch's on_hold failed")
        log.log(self._level(self.holds), "the event loop was held %.1f s in all; every %s "
                "waited for it (%d environment calls credited it as a wait; %.1f s of it "
                "charged to the calls that held it)", late, self.what, credited, charged)
    elif beat:
      with self._seen_lock:
        self._seen.clear()

  def _running(self, loop_thread: int):
    """What runs on the loop now, for `waits.credit_hold`: the running task's call
    clock, or a callback's (the clock of the context it was scheduled in: an
    environment's `call_soon` holds on its own account, red team); waits.NO_CALL outside
    a call; or waits.UNSEEN."""
    task = asyncio.current_task(self._loop)
    if task is None:
      return _callback_clock(loop_thread)
    get_context = getattr(task, "get_context", None)
    if get_context is not None:
      context = get_context()
    else:
      ref = self._contexts.get(task)
      context = ref() if ref is not None else None
    if context is None:  # (a task before the watch is the run's own, on 3.11 unseen)
      return waits.NO_CALL if task in self._before else waits.UNSEEN
    return context.get(waits._CLOCK) or waits.NO_CALL

  def _watch(self, loop_thread: int) -> None:
    named = None  # (the beat before the hold last named)
    while not self._stop.wait(self._beat_s):
      beat = self._beat
      late = time.perf_counter() - beat - self._beat_s
      if late < self._beat_s:
        continue
      try:
        running = self._running(loop_thread)
      except Exception:  # (the loop's task table changed under the look)
        running = waits.UNSEEN
      with self._seen_lock:
        self._seen.setdefault(beat, []).append(running)
      if late < self.hold_s or beat == named:
        continue
      named = beat
      self._named += 1
      try:
        frame = sys._current_frames().get(loop_thread)
        try:
          task = asyncio.current_task(self._loop)
        except RuntimeError:
          task = None
        where = _where(frame, task)
        del frame
      except Exception as e:  # (the count goes on: the heartbeat keeps it)
        where = f"code the watch could not name ({type(e).__name__}: {e})"
      log.log(self._level(self._named),
              "the event loop has been held %.1f s so far, by %s: no other %s moves "
              "meanwhile and their time runs. Blocking work in async code belongs in "
              "asyncio.to_thread (a plain tool function runs on a thread of its own)%s",
              late, where, self.what,
              "; later holds are logged at DEBUG, and counted" if self._named == LOUD_HOLDS
              else "")

  @staticmethod
  def _level(n: int) -> int:
    return logging.WARNING if n <= LOUD_HOLDS else logging.DEBUG

  def stop(self) -> None:
    self._stop.set()
    if self._beater is not None:
      self._beater.cancel()
    if self._loop is not None and waits._SETTLE.get(self._loop) == self.settle:
      waits._SETTLE.pop(self._loop, None)
    if (self._loop is not None and not self._loop.is_closed()
        and self._loop.get_task_factory() is self._factory):
      self._loop.set_task_factory(self._prior_factory)
    if self._thread is not None and self._thread is not threading.current_thread():
      self._thread.join(timeout=1.0)

  async def __aenter__(self) -> "LoopWatch":
    return self.start()

  async def __aexit__(self, *exc) -> None:
    self.stop()

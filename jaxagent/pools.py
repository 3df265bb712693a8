"""Thread pools whose running calls are counted, so that a process at its end can tell
calls that are stuck (an environment's blocked for ever, a collective a peer never
joins, a weight swap that never finishes) from idle threads, and leave them behind
(`jaxagent.stopping.leave_stuck_threads`) instead of Python's exit joining them for ever."""

from __future__ import annotations

import concurrent.futures
import threading
import weakref


class CountedPool(concurrent.futures.ThreadPoolExecutor):
  """An executor that counts the calls it is running (`busy`); `wait_at_close=False` makes
  its close not wait for calls that never end (the loop's default executor, which
  environments' calls share: asyncio.run's close waited for them for ever after a run
  had stopped and saved). `live` holds every pool not yet collected."""

  live: "weakref.WeakSet[CountedPool]" = weakref.WeakSet()

  def __init__(self, workers: int, name: str, wait_at_close: bool = True):
    super().__init__(workers, thread_name_prefix=name)
    self.wait_at_close, self.busy, self._count = wait_at_close, 0, threading.Lock()
    CountedPool.live.add(self)

  def submit(self, fn, /, *args, **kwargs):
    def counted():
      with self._count:
        self.busy += 1
      try:
        return fn(*args, **kwargs)
      finally:
        with self._count:
          self.busy -= 1
    return super().submit(counted)

  def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
    if self.wait_at_close:
      super().shutdown(wait, cancel_futures=cancel_futures)
    else:
      super().shutdown(wait=False, cancel_futures=True)


def busy_calls() -> int:
  """The calls every live counted pool is running."""
  return sum(p.busy for p in list(CountedPool.live))


def end_process(code: int, what: str) -> None:
  """Ends a command with `code`. Calls a counted pool still runs (a tool's plain function
  that never returned, its episode cut at a deadline) are said and left behind: Python's
  exit joined them for ever, after the command's work was done."""
  import os
  import sys

  stuck = busy_calls()
  if stuck:
    print(f"{what}: {stuck} calls (a tool's, an environment's) still running at the end; "
          "left behind", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except Exception:
        pass
    os._exit(code)
  sys.exit(code)

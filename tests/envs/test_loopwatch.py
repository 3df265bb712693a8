"""`envs.loopwatch` names the code that holds the event loop every episode moves on (an
environment's async code that computes or blocks without awaiting), in a run and on an
env worker, and counts the seconds held."""

import asyncio
import logging
import os
import signal
import textwrap
import time

import httpx
import pytest

from envs.loopwatch import LOUD_HOLDS, LoopWatch


def spin(seconds: float) -> None:
  t = time.perf_counter()
  while time.perf_counter() - t < seconds:
    pass


async def blocking_step() -> None:
  spin(1.2)


def test_a_hold_is_named_where_it_is_and_counted(caplog):
  caplog.set_level(logging.WARNING, "envs.loopwatch")

  async def main():
    async with LoopWatch(hold_s=0.4) as watch:
      await asyncio.sleep(0.3)
      await asyncio.create_task(blocking_step(), name="episode-3")
      await asyncio.sleep(0.6)  # (the watch sees the hold end)
    return watch

  watch = asyncio.run(main())
  assert watch.holds == 1 and 1.15 < watch.held_s < 2.0, (watch.holds, watch.held_s)
  start, end = [r.getMessage() for r in caplog.records if r.name == "envs.loopwatch"]
  assert f"{__file__}:{spin.__code__.co_firstlineno + 2} in spin" in start, start
  assert "task episode-3 (blocking_step)" in start and "asyncio.to_thread" in start, start
  assert "held 1." in end and "in all" in end, end


def test_a_loop_that_awaits_is_not_held(caplog):
  caplog.set_level(logging.DEBUG, "envs.loopwatch")

  async def main():
    async with LoopWatch(hold_s=0.3) as watch:
      await asyncio.sleep(0.5)
      await asyncio.to_thread(time.sleep, 0.8)  # blocking, on a thread: the loop is free
      await asyncio.gather(*(asyncio.sleep(0.01 * i) for i in range(50)))
    return watch

  watch = asyncio.run(main())
  assert watch.holds == 0 and watch.held_s == 0
  assert not [r for r in caplog.records if r.name == "envs.loopwatch"]


def test_after_ten_holds_they_are_counted_and_not_warned_of(caplog):
  caplog.set_level(logging.DEBUG, "envs.loopwatch")

  async def main():
    async with LoopWatch(hold_s=0.2) as watch:
      for _ in range(LOUD_HOLDS + 2):
        spin(0.4)
        await asyncio.sleep(0.1)
    return watch

  watch = asyncio.run(main())
  # (a loaded machine may add a hold of its own: at least these, each measured by the
  # heartbeat to its beat, 0.01 s)
  assert watch.holds >= LOUD_HOLDS + 2
  assert watch.held_s >= 0.39 * (LOUD_HOLDS + 2), watch.held_s
  named = [r for r in caplog.records if "so far" in r.getMessage()]
  assert len(named) >= LOUD_HOLDS + 2
  assert [r.levelno for r in named[:LOUD_HOLDS]] == [logging.WARNING] * LOUD_HOLDS
  assert {r.levelno for r in named[LOUD_HOLDS:]} == {logging.DEBUG}
  assert "later holds are logged at DEBUG" in named[LOUD_HOLDS - 1].getMessage()
  with pytest.raises(ValueError, match="hold_s"):
    LoopWatch(hold_s=0)


ENV = textwrap.dedent("""\
    import time
    from envs.base import Env, Observation, StepResult, Verdict, VerdictStatus, register

    @register("sleepy_step")
    class SleepyStep(Env):
      async def reset(self, task):
        self.reset_counters()
        return Observation([{"role": "user", "content": "go"}])

      async def step(self, action):
        time.sleep(1.5)  # blocking, in async code: holds the worker's loop
        return StepResult(Observation([]), 0.0, True, False, {})

      async def verify(self):
        return Verdict(VerdictStatus.PASS, 1.0, "sleepy_step@0", "0")
    """)


def test_an_env_worker_names_an_environment_that_holds_its_loop(tmp_path):
  """A worker's sessions all move on its loop: the log names the environment's line, and
  /metrics counts the seconds (`env_loop_held_seconds_total`)."""
  from tests.envs.test_server import start_worker, worker_log

  module = tmp_path / "sleepy_env.py"
  module.write_text(ENV)
  proc, url, _ = start_worker(tmp_path, "--import", str(module))
  try:
    r = httpx.post(f"{url}/sessions", json={"task": {"id": "s", "env": "sleepy_step",
                                                     "params": {}}}, timeout=30)
    assert r.status_code == 200, r.text
    sid = r.json()["session_id"]
    r = httpx.post(f"{url}/sessions/{sid}/step", json={"action": "x"}, timeout=30)
    assert r.status_code == 200, r.text
    time.sleep(0.6)
    held = [line for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
            if line.startswith("env_loop_held_seconds_total ")]
    assert held and float(held[0].split()[1]) > 1.0, held
  finally:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
  log = worker_log(proc)
  assert f"{os.path.realpath(module)}:11 in step" in log or f"{module}:11 in step" in log, log
  assert "no other session moves" in log, log

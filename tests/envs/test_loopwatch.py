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

from envs import waits
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


def test_a_hold_is_charged_to_the_call_that_held_the_loop_and_not_to_the_others():
  """Each environment call's deadline counts its own time: a call that holds the loop
  past it is cut (its own time), and one that only waited for the hold is credited it as
  a wait. (Before, the waiting call was cut too: a policy whose environment held the
  loop pushed its siblings past their deadlines.)"""
  from envs.base import Observation, StepResult
  from jaxagent.agent import MeasuredEnv
  from jaxagent.errors import InfraError

  class Env:
    async def step(self, action):
      if action == "hold":
        spin(1.5)
      await asyncio.sleep(0.4)
      return StepResult(Observation([]), 0.0, False, False, {})

  async def main():
    async with LoopWatch():
      waiting, holding = MeasuredEnv(Env(), deadline_s=1.0), MeasuredEnv(Env(), deadline_s=1.0)
      waited = asyncio.ensure_future(waiting.step("wait"))
      await asyncio.sleep(0.1)
      held = asyncio.ensure_future(holding.step("hold"))
      out = await asyncio.gather(waited, held, return_exceptions=True)
      spin(0.5)  # the run's own code, in no call: nobody's to credit
      await asyncio.sleep(0.2)
    return waiting, holding, out

  waiting, holding, (waited, held) = asyncio.run(main())
  assert isinstance(waited, StepResult), waited
  assert 1.3 < waiting.waited_s < 1.7 and waiting.env_s < 0.9, (waiting.waited_s,
                                                                 waiting.env_s)
  assert isinstance(held, InfraError) and held.kind == "env_call_deadline", held
  assert holding.waited_s < 0.1, holding.waited_s


def test_a_hold_by_a_task_an_environment_started_earlier_is_still_its_own():
  """A task an environment started in its reset (on the reset's clock) holds the loop
  during its step: the hold is the episode's own (its step is not credited it), and
  another episode's step is."""
  from envs.base import Observation, StepResult
  from jaxagent.agent import MeasuredEnv

  class Env:
    def __init__(self, background: bool):
      self.background = background

    async def reset(self, task):
      if self.background:
        async def later():
          await asyncio.sleep(0.3)
          spin(1.0)
        self.later = asyncio.ensure_future(later())
      return Observation([])

    async def step(self, action):
      await asyncio.sleep(1.0)
      return StepResult(Observation([]), 0.0, False, False, {})

  async def main():
    async with LoopWatch():
      own, other = MeasuredEnv(Env(True)), MeasuredEnv(Env(False))
      await asyncio.gather(own.reset(None), other.reset(None))
      await asyncio.gather(own.step("a"), other.step("a"))
    return own, other

  own, other = asyncio.run(main())
  assert own.waited_s < 0.1 and 0.8 < other.waited_s < 1.6, (own.waited_s, other.waited_s)


def test_a_hold_by_a_callback_an_environment_scheduled_is_its_own():
  """A callback (`loop.call_soon`) runs in no task, in the context it was scheduled
  in: an environment's callback that holds the loop holds it on that call's account
  (it was credited to every call, its own too, and so counted as no one's time at the
  episode's wall: a reviewer)."""
  from envs.base import Observation, StepResult
  from jaxagent.agent import MeasuredEnv

  class Env:
    def __init__(self, hold: bool):
      self.hold = hold

    async def step(self, action):
      if self.hold:
        asyncio.get_running_loop().call_soon(spin, 1.0)
      await asyncio.sleep(1.5)
      return StepResult(Observation([]), 0.0, False, False, {})

  async def main():
    async with LoopWatch():
      own, other = MeasuredEnv(Env(True)), MeasuredEnv(Env(False))
      await asyncio.gather(other.step("a"), own.step("a"))
    return own, other

  own, other = asyncio.run(main())
  assert own.held_s < 0.1 and 0.7 < other.held_s < 1.4, (own.held_s, other.held_s)


async def beside_a_holder_between_calls():
  """Two episodes between their environment calls (waiting on the server); the second's
  agent code holds the loop 1 s: the two MeasuredEnvs."""
  from jaxagent.agent import MeasuredEnv

  async with LoopWatch():
    waiting, holding = MeasuredEnv(object()), MeasuredEnv(object())

    async def episode(measured, hold):
      async def play():
        await asyncio.sleep(0.2)
        if hold:
          spin(1.0)  # its agent's own code
        await asyncio.sleep(1.0)  # (as on the server)

      with measured.episode():
        await asyncio.ensure_future(play())

    await asyncio.gather(episode(waiting, False), episode(holding, True))
  return waiting, holding


def test_an_episode_between_its_calls_is_credited_another_s_hold_and_not_its_own():
  """An episode waiting on the server (no environment call of its own running) when
  another episode's agent code holds the loop: the hold is a wait of the first (its
  deadline must not pay for it: red team), the holder's own time."""
  waiting, holding = asyncio.run(beside_a_holder_between_calls())
  waited, held = asyncio.run(waiting.waited()), asyncio.run(holding.waited())
  assert 0.8 < waited < 1.6 and held < 0.1, (waited, held)


def test_holds_credited_on_a_worker_or_between_calls_are_no_side_s_time_at_a_cut():
  """At an episode's cut, other episodes' holds of the loop are neither the policy's time
  nor the server's. A worker's answers report them (`infra_held_s`), and the episode's
  `held_s` sums them, as it does its own calls' credits (they counted as the policy's
  time at the wall). Holds credited between its calls (waiting on the server) are left
  out of the server's time (they leaned a cut towards the infrastructure)."""
  from envs.base import Observation, StepResult
  from jaxagent.agent import MeasuredEnv, judge_cut

  class Remote:  # as RemoteEnv: a worker reports each call's waits
    infra_wait_s = infra_held_s = 0.0

    async def in_flight_waits(self):
      return 0.0, 0.0

    async def step(self, action):
      await asyncio.sleep(0.05)
      self.infra_wait_s += 1.5
      self.infra_held_s += 1.2  # of them, other sessions' holds of the worker's loop
      return StepResult(Observation([]), 0.0, False, False, {})

  remote = MeasuredEnv(Remote())
  asyncio.run(remote.step("a"))
  assert remote.waited_s == 1.5 and remote.held_s == 1.2, (remote.waited_s, remote.held_s)
  # 0.5 s on the server against 0.3 s of the crowd's waits and its own time: the server's
  kind, why = judge_cut(waits.WallCut(), 0.5, "waiting on the server", remote)
  assert kind == "episode_wall" and why and "0.5 s waiting on the server" in why, why

  waiting, _ = asyncio.run(beside_a_holder_between_calls())
  assert 0.8 < waiting.between_held_s() < 1.6, waiting.between_held_s()
  waiting.env_s = 0.5  # its own time in the environment
  # its time "on the server" as the agent timed it, the other's hold among it: 0.2 s is
  # the server's, less than its own
  assert judge_cut(waits.DeadlineCut(), 0.2 + waiting.between_held_s(),
                   "waiting on the server", waiting) == ("episode_deadline", None)
  # A hold may fall while the server decodes its tokens (the policy's side) too: taken
  # out of the two in proportion. 6 s queued and 5 s decoding with a 2 s hold: still the
  # server's (out of the server's time alone, the policy's: 4 s < 5.5 s)
  waiting.between_held_s = lambda: 2.0
  kind, why = judge_cut(waits.DeadlineCut(), 6.0, "waiting on the server", waiting, 5.0)
  assert why and "4.9 s waiting on the server (and 4.1 s decoding" in why, why


def test_the_watch_keeps_no_finished_task_or_environment_alive():
  """An environment that keeps a task of its own: the task's context refers, through
  its call's clock, to the environment. The watch's map of tasks to contexts must not
  keep them (it did: every worker session, stepped and closed, stayed; red team)."""
  import gc
  import weakref

  from envs.base import Observation, StepResult
  from jaxagent.agent import MeasuredEnv

  class Env:
    async def step(self, action):
      self.kept = asyncio.ensure_future(asyncio.sleep(0))
      await self.kept
      return StepResult(Observation([]), 0.0, False, False, {})

  async def main():
    refs = []
    async with LoopWatch():
      for _ in range(20):
        measured = MeasuredEnv(Env())
        refs.append(weakref.ref(measured.env))
        with measured.episode():
          await measured.step("a")
      del measured
      gc.collect()
      return sum(r() is not None for r in refs)

  # (the last one may still be referred to by the loop's own bookkeeping: none piles up)
  assert asyncio.run(main()) <= 1


def test_a_hold_outside_any_call_is_credited_to_every_call_and_one_unseen_to_none():
  """Code of the run's own (in no measured call, or in a task made before the watch
  started: the run's main task) holding the loop is the infrastructure's: every call is
  credited it, less what its own waits already leave out. A hold by a task the watch
  cannot see (made around its task factory, on Python 3.11) is credited to no one."""
  from envs import waits

  async def call(body):
    with waits.measured() as clock:
      await asyncio.ensure_future(body())
    return clock

  async def sleeping():
    await asyncio.sleep(1.2)

  async def slot():
    with waits.waiting():
      await asyncio.sleep(1.2)

  async def hold():
    await asyncio.sleep(0.2)
    spin(0.8)

  async def main():
    async with LoopWatch():
      asleep, in_slot, _ = await asyncio.gather(call(sleeping), call(slot), hold())
      calling = asyncio.ensure_future(call(sleeping))
      await asyncio.sleep(0.1)
      spin(0.6)  # in the run's main task, made before the watch started
      own = await calling
      calling = asyncio.ensure_future(call(sleeping))
      await asyncio.sleep(0.1)
      await asyncio.Task(hold())  # (not through the loop's task factory)
      unseen = await calling
    return asleep, in_slot, own, unseen

  asleep, in_slot, own, unseen = asyncio.run(main())
  assert 0.7 < asleep.held_s < 1.3 and asleep.waited_s == asleep.held_s, asleep.held_s
  assert in_slot.held_s < 0.05 and 1.15 < in_slot.total_s() < 1.4, (in_slot.held_s,
                                                                    in_slot.total_s())
  assert 0.5 < own.held_s < 1.1, own.held_s  # (a loaded machine's descheduling: a look)
  if not hasattr(asyncio.Task, "get_context"):  # (3.12 on, every task says its context)
    # (a look may fall just after a hold, before it is settled: a look's share, 1 in 16)
    assert unseen.held_s < 0.1, unseen.held_s


def test_a_watch_within_a_watch_credits_once_and_a_failing_on_hold_stops_nothing(caplog):
  """A second watch on the loop names and counts holds but does not credit them again
  (two credited a 1 s hold twice); an `on_hold` that raises is logged, and the
  heartbeat and the calls' deadlines go on (it killed the heartbeat, then failed a
  call's `within`); a watch starts once."""
  from envs import waits

  def on_hold(seconds):
    raise RuntimeError("counter down")

  async def main():
    async with LoopWatch() as outer:
      async with LoopWatch(on_hold=on_hold) as inner:
        with pytest.raises(RuntimeError, match="started already"):
          inner.start()
        async def holds():  # (another's: made outside the call)
          await asyncio.sleep(0.1)
          spin(1.2)

        held = asyncio.ensure_future(holds())
        with waits.measured() as clock:
          out = await waits.within(asyncio.ensure_future(asyncio.sleep(1.5, "ok")),
                                   lambda: asyncio.sleep(0, clock.not_own_s()), 1.0, 10.0,
                                   time.perf_counter())
          await held
        spin(1.1)  # (a second hold: the heartbeat still beats)
        await asyncio.sleep(0.2)
    return out, clock, outer, inner

  out, clock, outer, inner = asyncio.run(main())
  assert out == "ok" and 1.0 < clock.held_s < 1.7, clock.held_s
  assert outer.holds >= 2 and inner.holds >= 2, (outer.holds, inner.holds)
  assert "on_hold failed" in caplog.text


ENV = textwrap.dedent("""\
    import asyncio
    import time
    from envs.base import Env, Observation, StepResult, Verdict, VerdictStatus, register

    @register("sleepy_step")
    class SleepyStep(Env):
      async def step(self, action):
        if action == "hold":
          time.sleep(2.5)  # blocking, in async code: holds the worker's loop
        elif action == "background":
          self.go.set()
          await asyncio.sleep(0.05)  # (its task holds the loop meanwhile)
        await asyncio.sleep(6.0 if action == "long" else 1.0)
        return StepResult(Observation([]), 0.0, True, False, {})

      async def reset(self, task):
        self.reset_counters()
        self.go = asyncio.Event()

        async def background():  # (started in the reset's call, holding in the step's)
          await self.go.wait()
          time.sleep(2.5)

        self.later = asyncio.ensure_future(background())
        return Observation([{"role": "user", "content": "go"}])

      async def verify(self):
        return Verdict(VerdictStatus.PASS, 1.0, "sleepy_step@0", "0")
    """)


def test_an_env_worker_names_an_environment_that_holds_its_loop(tmp_path):
  """A worker's sessions all move on its loop: the log names the environment's line, and
  /metrics counts the seconds (`env_loop_held_seconds_total`). The hold is charged to
  the call that held it (a 504: past its deadline of its own time), and credited to a
  session's call that only waited for it (200, the hold among its waits); a task the
  session's reset started holds on the session's account (a 504 too)."""
  from concurrent.futures import ThreadPoolExecutor

  from tests.envs.worker_process import start_worker, worker_log

  module = tmp_path / "sleepy_env.py"
  module.write_text(ENV)
  proc, url, _ = start_worker(tmp_path, "--import", str(module), "--deadline-s", "2")
  try:
    sids = []
    for name in ("waits", "holds", "background"):
      r = httpx.post(f"{url}/sessions", json={"task": {"id": name, "env": "sleepy_step",
                                                       "params": {}}}, timeout=30)
      assert r.status_code == 200, r.text
      sids.append(r.json()["session_id"])

    def step(sid, action):
      return httpx.post(f"{url}/sessions/{sid}/step", json={"action": action}, timeout=30)

    with ThreadPoolExecutor(2) as pool:
      waits_step = pool.submit(step, sids[0], "wait")
      time.sleep(0.4)
      holds_step = pool.submit(step, sids[1], "hold")
      waited, held = waits_step.result(), holds_step.result()
    assert waited.status_code == 200, waited.text
    assert waited.json()["infra_wait_s"] > 1.5, waited.json()
    assert 1.0 < waited.json()["infra_held_s"] <= waited.json()["infra_wait_s"], waited.json()
    assert held.status_code == 504, held.text
    r = step(sids[2], "background")
    assert r.status_code == 504, r.text
    time.sleep(0.6)
    held = [line for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
            if line.startswith("env_loop_held_seconds_total ")]
    assert held and float(held[0].split()[1]) > 1.0, held
  finally:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
  log = worker_log(proc)
  assert f"{os.path.realpath(module)}:9 in step" in log or f"{module}:9 in step" in log, log
  assert "no other session moves" in log, log


def test_a_remote_call_cut_client_side_counts_the_worker_s_credited_holds(tmp_path):
  """An episode that cuts its call to a worker (its deadline) asks the worker what the
  call waited so far: the part that was another session's hold of the worker's loop is
  the episode's `held_s` too (no one's time at its wall), as an answered call's is."""
  from concurrent.futures import ThreadPoolExecutor

  from envs.base import TaskSpec
  from envs.server import RemoteEnv
  from jaxagent.agent import MeasuredEnv
  from tests.envs.worker_process import start_worker

  module = tmp_path / "sleepy_env.py"
  module.write_text(ENV)
  proc, url, _ = start_worker(tmp_path, "--import", str(module), "--deadline-s", "4")
  try:
    holder = httpx.post(f"{url}/sessions", json={"task": {"id": "h", "env": "sleepy_step",
                                                          "params": {}}}, timeout=30)
    assert holder.status_code == 200, holder.text

    async def main():
      measured = MeasuredEnv(RemoteEnv(url))
      await measured.reset(TaskSpec(id="w", env="sleepy_step", params={}))
      call = asyncio.ensure_future(measured.step("long"))
      await asyncio.sleep(0.4)
      with ThreadPoolExecutor(1) as pool:  # another session holds the worker's loop 2.5 s
        held = await asyncio.get_running_loop().run_in_executor(pool, lambda: httpx.post(
            f"{url}/sessions/{holder.json()['session_id']}/step", json={"action": "hold"},
            timeout=30))
      await asyncio.sleep(0.3)
      call.cancel()  # (cut client-side while the worker's call still runs)
      with pytest.raises(asyncio.CancelledError):
        await call
      await measured.env.close()
      return measured, held

    measured, held = asyncio.run(main())
    # (the holder, within its deadline of 4 s: its own hold is not credited to it)
    assert held.status_code == 200 and held.json()["infra_held_s"] < 0.1, held.text
    assert 2.0 < measured.held_s <= measured.waited_s, (measured.held_s, measured.waited_s)
  finally:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)

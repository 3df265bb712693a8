"""Rollout scheduler and batcher with a scripted `play` (no model): modes, staleness,
retries, filters, advantages and packing."""

import asyncio
import itertools
import re
import types

import numpy as np
import pytest

from jaxagent.agent import Episode
from jaxagent.config import AdvantageConfig, RolloutConfig
from jaxagent.errors import EpisodeBug
from jaxagent.batch import row_ladder
from jaxagent.scheduler import RolloutScheduler, batch_rows, episode_index, make_batch
from jaxagent.trajectory import TrajectoryManager, TurnRecord


def episode(task, sid, gid, *, reward, version=0, turns=1, infra=False, tokens=6):
  m = TrajectoryManager(sid, task_id=str(task), group_id=gid)
  prompt = [1] * 3
  for t in range(turns):
    out = [2] * 2
    m.add_turn(TurnRecord(prompt, out, [-0.5, -0.5], [version, version], "stop"), t)
    prompt = prompt + out + [3]
  per_turn = [reward / turns] * turns
  ep = Episode(str(task), sid, gid, [], per_turn, {"status": "pass" if reward >= 1 else "fail"},
               "failed" if infra else "completed", infra_error=infra,
               infra_kind="turn_deadline" if infra else "", turns=turns)
  ep.segments = m.segments(reward=reward, turn_rewards=per_turn)
  return ep


def run(coro):
  return asyncio.run(coro)


def test_sync_mode_plays_whole_groups_on_current_weights():
  calls = []

  async def play(task, sid, gid):
    calls.append((task, sid))
    return episode(task, sid, gid, reward=float(sid.endswith("-0-r0")), version=3)

  async def go():
    s = RolloutScheduler(RolloutConfig(mode="sync", groups_per_step=3, group_size=4),
                         itertools.count(), play)
    s.set_version(3)
    s.set_served(3)
    accepted, taken = await s.next_groups()
    return s, accepted, taken

  s, accepted, taken = run(go())
  assert len(taken) == 3 and len(accepted) == 3 and len(calls) == 12
  assert [g.task for g in taken] == [0, 1, 2]
  assert all(len(g.episodes) == 4 and g.started_version == 3 for g in taken)


def test_infra_errors_are_retried_then_dropped_never_scored():
  attempts = {}

  async def play(task, sid, gid):
    key = sid.rsplit("-r", 1)[0]
    attempts[key] = attempts.get(key, 0) + 1
    if key.endswith("-0"):  # always broken: dropped after retries
      return episode(task, sid, gid, reward=0.0, infra=True)
    if key.endswith("-1") and attempts[key] == 1:  # broken once: the retry counts
      return episode(task, sid, gid, reward=0.0, infra=True)
    return episode(task, sid, gid, reward=float(key.endswith("-2")))

  async def go():
    s = RolloutScheduler(RolloutConfig(mode="sync", groups_per_step=1, group_size=4,
                                       max_retries=2), itertools.count(), play)
    return s, *(await s.next_groups())

  s, accepted, taken = run(go())
  (group,) = taken
  assert len(group.episodes) == 3  # the broken one is gone, not scored 0
  assert s.dropped["infra_error"] == 1 and s.retries == 3
  assert s.dropped["infra_turn_deadline"] == 1  # counted by kind too
  assert all(not e.infra_error for e in group.episodes)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_infrastructure_outage_stops_the_run_instead_of_consuming_the_tasks(mode):
  """With the environment workers down every episode is dropped: a run that went on
  would take its tasks group after group (each consumed, trained on by nobody) without a
  step. Past max_infra_fraction of a full window of episodes, for infra_grace_s, it stops
  naming the kinds."""
  from jaxagent.errors import InfraOutage

  async def play(task, sid, gid):
    await asyncio.sleep(0.001)
    ep = episode(task, sid, gid, reward=0.0, infra=True)
    ep.infra_kind, ep.reason = "env_worker", f"env_worker: {sid} refused"
    return ep

  async def go():
    s = RolloutScheduler(RolloutConfig(mode=mode, groups_per_step=2, group_size=4,
                                       max_retries=1, infra_window=16, infra_grace_s=0.5,
                                       retry_backoff_s=0.0), itertools.count(), play)
    s.start()
    try:  # (the last episode's why said: a harness's mistakes read "check the servers")
      with pytest.raises(InfraOutage, match=r"16 of the last 16 .*env_worker 16.*"
                                            r"max_infra_fraction 0.5.*this process dropped \d+ "
                                            r"episodes so\), .*; the last env_worker: "
                                            r"env_worker: g\d+-\d-r1 refused$"):
        for _ in range(10000):  # (as the training loop asks again after an empty step)
          await asyncio.wait_for(s.next_groups(), 30)
      return s
    finally:
      await s.stop()

  s = run(go())
  assert s.dropped["infra_error"] >= 16


def test_the_outage_bound_counts_a_full_window_of_episodes():
  import time

  s = RolloutScheduler(RolloutConfig(infra_window=4, max_infra_fraction=0.5,
                                     infra_grace_s=0.3), itertools.count(), None)
  for kind in ["sandbox", None, "sandbox", None, "server"]:  # 2 of 4: at the bound
    s._ended(kind)
  assert s.error is None
  s._ended("server")  # 3 of the last 4: past it, but only just begun (a restart?)
  assert s.error is None
  time.sleep(0.35)
  s._ended("server")  # and 0.3 s on, still
  assert "3 of the last 4" in str(s.error) and "(server 3)" in str(s.error)


def test_episodes_the_policy_gets_dropped_count_once_not_per_retry():
  """One episode in three dropped, retries and all (a policy that found a way to make
  some of its episodes read as infrastructure failures): a third of the window, below
  the bound. Counted per attempt it was 3 in 5 (red-team round 5: the policy could stop
  the run with a third of its episodes)."""
  async def play(task, sid, gid):
    infra = sid.split("-")[1] == "0"
    return episode(task, sid, gid, reward=float(sid.split("-")[1] == "1"), infra=infra)

  async def go():
    s = RolloutScheduler(RolloutConfig(mode="sync", groups_per_step=2, group_size=3,
                                       max_retries=2, infra_window=12, infra_grace_s=0.0,
                                       retry_backoff_s=0.0), itertools.count(), play)
    for _ in range(3):
      accepted, _ = await s.next_groups()
      assert len(accepted) == 2
    return s

  s = run(go())
  assert s.error is None and s.dropped["infra_error"] == 6 and s.retries == 12


def test_a_group_the_infrastructure_left_short_is_played_again_once():
  """A group left with fewer than two episodes by infrastructure drops has its task
  played again, once (later, as a fresh group): the task was never fairly played."""
  async def play(task, sid, gid):
    i = sid.split("-")[1]
    if task == 1 and i != "0":  # task 1: three of four episodes broken, every time
      return episode(task, sid, gid, reward=0.0, infra=True)
    return episode(task, sid, gid, reward=float(i == "0"))

  async def go():
    s = RolloutScheduler(RolloutConfig(mode="sync", groups_per_step=3, group_size=4,
                                       max_retries=1), itertools.count(), play)
    first = await s.next_groups()
    second = await s.next_groups()
    return s, first, second

  s, (accepted, taken), (accepted2, taken2) = run(go())
  assert [g.task for g in taken] == [0, 1, 2, 1, 3]  # task 1 again (before task 3)
  assert [g.task for g in accepted] == [0, 2, 3]
  assert [g.task for g in taken2] == [4, 5, 6]  # not a third time
  assert s.dropped["too_few_valid"] == 2 and s.dropped["infra_error"] == 6


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_bug_in_an_episode_stops_the_run_instead_of_hiding(mode):
  async def play(task, sid, gid):
    if sid.startswith("g0-2"):
      raise KeyError("a bug")
    return episode(task, sid, gid, reward=float(sid.endswith("-0-r0")))

  async def go():
    s = RolloutScheduler(RolloutConfig(mode=mode, groups_per_step=1, group_size=4),
                         itertools.count(), play)
    s.start()
    try:
      await asyncio.wait_for(s.next_groups(), 30)
    finally:
      await s.stop()

  with pytest.raises(RuntimeError, match="KeyError") as e:
    run(go())
  assert isinstance(e.value.__cause__, KeyError)
  # where: the file and line that raised it (a new user's round: it said neither)
  assert "test_scheduler.py:" in str(e.value), str(e.value)


def test_a_bug_names_its_episodes_task_as_the_task_file_gave_it():
  """Tasks reach the scheduler as the task file's dicts: the run's message named no task
  (a new user)."""
  async def play(task, sid, gid):
    raise AttributeError("a bug")

  async def go():
    tasks = iter({"id": f"unit/{i}", "env": "unit_convert", "params": {}} for i in range(9))
    s = RolloutScheduler(RolloutConfig(mode="sync", groups_per_step=1, group_size=2),
                         tasks, play)
    s.start()
    try:
      await asyncio.wait_for(s.next_groups(), 30)
    finally:
      await s.stop()

  with pytest.raises(EpisodeBug, match=r"an episode of task 'unit/0' \(unit_convert\) "
                     r"raised AttributeError at tests/test_scheduler.py:\d+") as bug:
    run(go())
  (frame,) = bug.value.frames()  # (the environment's line alone, not the run's loop)
  assert re.fullmatch(r'tests/test_scheduler.py:\d+ in play: raise AttributeError\("a bug"\)',
                      frame), frame


def test_an_episodes_bug_is_said_in_its_environments_lines_and_one_line(capsys):
  """A verify's ZeroDivisionError was 78 lines of the run's loop around the user's one
  (a new user): the environment's own frames are said, then one line; a bug whose lines
  are all this package's own is said with its whole traceback."""
  def helper():
    return 1 / 0

  def verify():
    return helper()

  task = types.SimpleNamespace(id="t/1", env="mine")
  try:
    verify()
  except ZeroDivisionError as e:
    bug = EpisodeBug(task, e)
  at = helper.__code__.co_firstlineno
  name = "test_an_episodes_bug_is_said_in_its_environments_lines_and_one_line"
  assert bug.frames() == [f"tests/test_scheduler.py:{at + 8} in {name}: verify()",
                          f"tests/test_scheduler.py:{at + 4} in verify: return helper()",
                          f"tests/test_scheduler.py:{at + 1} in helper: return 1 / 0"]
  bug.say(" (then: resume)")
  err = capsys.readouterr().err.splitlines()
  assert err[0] == "the environment's lines it passed through, innermost last:"
  assert err[-1] == ("error: an episode of task 't/1' (mine) raised ZeroDivisionError at "
                     f"tests/test_scheduler.py:{at + 1} (a bug, not an infrastructure "
                     "failure): division by zero (then: resume)"), err
  assert "Traceback" not in "\n".join(err)
  # An error raised while handling another, in a TaskGroup: the one it came from is said
  # with its line, and the group's one error is the error (not "1 sub-exception").
  async def lookup():
    table = {}
    try:
      return table["x"]
    except KeyError:
      raise ValueError("no x in the table")

  async def grouped():
    async with asyncio.TaskGroup() as tg:
      tg.create_task(lookup())

  try:
    asyncio.run(grouped())
  except BaseException as e:
    chained = EpisodeBug(task, e)
  at = lookup.__code__.co_firstlineno
  assert str(chained).startswith("an episode of task 't/1' (mine) raised ValueError at "
                                 f"tests/test_scheduler.py:{at + 5} ")
  assert chained.chain() == [f"(while handling KeyError at tests/test_scheduler.py:{at + 3}: "
                             "'x')"]
  chained.say()
  err = capsys.readouterr().err.splitlines()
  assert err[-2] == f"  (while handling KeyError at tests/test_scheduler.py:{at + 3}: 'x')", err
  try:
    episode_index("g1")  # (this package's own line raises: its whole traceback)
  except IndexError as e:  # (as the run's loop catches it: from the call down)
    ours = EpisodeBug(task, e.with_traceback(e.__traceback__.tb_next))
  assert ours.frames() == []
  ours.say()
  err = capsys.readouterr().err
  assert err.startswith("Traceback") and "jaxagent/scheduler.py" in err, err
  # A harness's sampling refused: its message is all there is (it came after a traceback
  # of the run's own lines: a new user)
  from jaxagent.blackbox import SamplingMismatch

  try:
    raise SamplingMismatch("turn 0 was sampled with temperature 0.7")
  except SamplingMismatch as e:
    EpisodeBug(task, e.with_traceback(None)).say()
  assert capsys.readouterr().err.splitlines() == [
      "error: an episode of task 't/1' (mine) raised SamplingMismatch at a line its "
      "traceback shows (a bug, not an infrastructure failure): turn 0 was sampled with "
      "temperature 0.7"]


def test_equal_reward_groups_are_filtered():
  async def play(task, sid, gid):
    return episode(task, sid, gid, reward=1.0 if task % 2 else float(sid[-4] == "0"))

  async def go(rounds):
    s = RolloutScheduler(RolloutConfig(mode="sync", groups_per_step=4, group_size=3,
                                       max_sample_rounds=rounds), itertools.count(), play)
    return s, *(await s.next_groups())

  s, accepted, taken = run(go(1))  # no replacement
  assert [g.task for g in accepted] == [0, 2] and s.dropped["no_signal"] == 2
  # Dynamic sampling: dropped groups are replaced until the step has its 4 groups.
  s, accepted, taken = run(go(4))
  # (rounds of 4, then 2 for the 2 missing, then 1 for the last)
  assert [g.task for g in accepted] == [0, 2, 4, 6] and [g.task for g in taken] == list(range(7))
  assert s.dropped["no_signal"] == 3 and s.replaced == 3
  # ... but at most max_sample_rounds x groups_per_step groups are consumed.
  async def no_signal(task, sid, gid):
    return episode(task, sid, gid, reward=1.0)

  s = RolloutScheduler(RolloutConfig(mode="sync", groups_per_step=2, group_size=2,
                                     max_sample_rounds=3), itertools.count(), no_signal)
  accepted, taken = run(s.next_groups())
  assert accepted == [] and len(taken) == 6


def test_async_staleness_bound_and_capacity():
  async def go():
    release = asyncio.Event()
    started_versions = []

    async def play(task, sid, gid):
      started_versions.append(s.served)
      if task == 0:
        await release.wait()  # the first group is slow
      return episode(task, sid, gid, reward=float(sid.endswith("-0-r0")), version=s.served)

    s = RolloutScheduler(RolloutConfig(mode="async", groups_per_step=2, group_size=2,
                                       max_staleness=1, max_concurrent_episodes=64),
                         itertools.count(), play)
    s.start()
    await asyncio.sleep(0.05)
    # Capacity: (version 0 + staleness 1 + 1) * 2 groups = 4 started, no more.
    assert s.started == 4
    accepted, taken = await s.next_groups()  # groups 1, 2 (0 is still running)
    assert sorted(g.task for g in taken) == [1, 2]
    s.set_version(2)
    s.set_served(2)  # the learner moved on twice
    release.set()
    await asyncio.sleep(0.05)
    accepted, taken = await s.next_groups()
    await s.stop()
    return s, accepted, taken

  s, accepted, taken = run(go())
  # Groups sampled at version 0 are now 2 versions old: stale, dropped and counted.
  assert s.dropped["stale"] >= 1
  assert all(s.version - g.min_version() <= 1 for g in accepted)


def test_a_resumed_scheduler_keeps_the_capacity_bound_and_numbers_groups_apart():
  """Resumed at version 10 as process 1 of 2 (next group 7): as many groups start as at a
  run's start, (0 + 1 + 1) x 2, not 10 x 2 more; numbered 7, 9, 11, ..."""
  async def go():
    sids = []

    async def play(task, sid, gid):
      sids.append(sid)
      await asyncio.sleep(60)  # nothing finishes: only the bound stops the producer

    s = RolloutScheduler(RolloutConfig(mode="async", groups_per_step=2, group_size=2,
                                       max_staleness=1, max_concurrent_episodes=64),
                         itertools.count(), play)
    s.go_on_from(10, 7, process=1, processes=2)
    s.start()
    await asyncio.sleep(0.05)
    await s.stop()
    return s, sids

  s, sids = run(go())
  assert s.version == 10
  assert sorted({sid.split("-")[0] for sid in sids}) == ["g11", "g13", "g7", "g9"]


def test_groups_the_bound_cannot_accept_are_dropped_at_once_and_replaced():
  """A straggler started on weights the staleness bound no longer accepts is cancelled
  when the version moves (its environment closed by the cancellation), counted stale,
  and its capacity goes to a fresh group at once."""
  async def go():
    cancelled = []

    async def play(task, sid, gid):
      if task == 0:
        try:
          await asyncio.sleep(60)  # the straggler
        except asyncio.CancelledError:
          cancelled.append(sid)
          raise
      return episode(task, sid, gid, reward=float(sid.endswith("-0-r0")), version=s.served)

    s = RolloutScheduler(RolloutConfig(mode="async", groups_per_step=2, group_size=2,
                                       max_staleness=1), itertools.count(), play)
    s.start()
    await asyncio.sleep(0.05)
    assert s.started == 4  # (0 + 1 + 1) x 2
    await s.next_groups()  # groups 1 and 2
    s.set_version(1)
    s.set_served(1)
    await asyncio.sleep(0.05)
    running_at_1 = 0 in s.groups  # started at version 0: still acceptable at version 1
    s.set_version(2)
    s.set_served(2)
    await asyncio.sleep(0.05)
    out = (running_at_1, 0 in s.groups, sorted(cancelled), s.dropped["stale"], s.started)
    await s.stop()
    return out

  running_at_1, running_at_2, cancelled, stale, started = run(go())
  assert running_at_1 and not running_at_2
  assert cancelled == ["g0-0-r0", "g0-1-r0"] and stale >= 1
  # (2 + 1 + 1) x 2 + the replaced group(s): capacity did not wait for the straggler.
  assert started >= 8 + 1


def _started_at_once(redundancy=0.0, **cfg):
  """How many groups an async scheduler starts at once with `redundancy` (episodes that
  never end; two groups of two a step, `max_staleness` 1 unless `cfg` says)."""
  async def go():
    s = RolloutScheduler(RolloutConfig(**{"mode": "async", "groups_per_step": 2,
                                          "group_size": 2, "max_staleness": 1,
                                          "redundancy": redundancy, **cfg}),
                         itertools.count(), lambda *a: asyncio.sleep(60))
    s.start()
    await asyncio.sleep(0.05)
    started = s.started
    await s.stop()
    return started

  return run(go())


def test_redundancy_runs_more_groups_than_the_bound():
  assert [_started_at_once(r) for r in (0.0, 0.5, 1.0)] == [4, 6, 8]


def test_redundancy_follows_the_bound_not_max_staleness():
  # With sync_every 4 the bound is 3 versions, past max_staleness 1: (1 + r) x the groups
  # that bound lets run (the extra was sized from max_staleness: r=1 ran 1.25x, not 2x).
  assert [_started_at_once(r, sync_every=4) for r in (0.0, 1.0)] == [8, 16]


def test_window_mode_waits_for_the_oldest_groups():
  async def go():
    release = asyncio.Event()

    async def play(task, sid, gid):
      if task == 0:
        await release.wait()
      return episode(task, sid, gid, reward=float(sid.endswith("-0-r0")))

    s = RolloutScheduler(RolloutConfig(mode="window", window=2, groups_per_step=2,
                                       group_size=2, max_staleness=4), itertools.count(), play)
    s.start()
    await asyncio.sleep(0.05)
    waiter = asyncio.create_task(s.next_groups())
    await asyncio.sleep(0.05)
    blocked = not waiter.done()  # groups 1.. are done, but group 0 heads the window
    release.set()
    accepted, taken = await waiter
    await s.stop()
    return blocked, taken

  blocked, taken = run(go())
  assert blocked and sorted(g.task for g in taken) == [0, 1]


def test_pending_tasks_are_kept_for_resume():
  async def go():
    s = RolloutScheduler(RolloutConfig(mode="async", groups_per_step=1, group_size=2),
                         iter(range(100)), lambda *a: asyncio.sleep(10), requeue=["a", "b"])
    s.start()
    await asyncio.sleep(0.05)
    pending = s.pending_tasks()
    await s.stop()
    return pending

  assert run(go())[:2] == ["a", "b"]


@pytest.mark.parametrize("how", ["cancelled", "outage"])
def test_a_step_given_up_while_sampling_loses_none_of_its_groups(how):
  """A run stopping while a step waits for rollouts cancels the wait (train.py), and an
  outage raises out of it: the groups that step had already accepted go back, in
  order, to be saved with the checkpoint and their episodes' logs kept (they were
  popped: a resume never played them again, and the token WAL let their logs go)."""
  from jaxagent.errors import InfraOutage

  async def play(task, sid, gid):
    if task >= 2:  # only the first two groups end; the second is filtered (one reward)
      await asyncio.sleep(60)
    return episode(task, sid, gid, reward=float(task == 0 and sid.endswith("-0-r0")))

  async def go():
    s = RolloutScheduler(RolloutConfig(mode="async", groups_per_step=2, group_size=2,
                                       filter_equal_rewards=True), itertools.count(), play)
    s.start()
    step = asyncio.ensure_future(s.next_groups())
    for _ in range(100):
      await asyncio.sleep(0.01)
      if 1 not in s.groups:  # 0 accepted, 1 filtered: the step waits for another
        break
    assert 0 not in s.groups and 1 not in s.groups and not step.done()
    if how == "cancelled":
      step.cancel()
    else:
      s.error = InfraOutage("the servers are gone")
      s._changed.set()
    with pytest.raises(asyncio.CancelledError if how == "cancelled" else InfraOutage):
      await step
    pending, finished = s.pending_tasks(), s.drain_finished()
    order = list(s.groups)
    counted = s.dropped["no_signal"], s.replaced
    await s.stop()
    return pending, finished, order, counted

  pending, finished, order, counted = run(go())
  # (the filtered group too: consumed, it was in no metrics row of either run)
  assert pending[:2] == [0, 1] and order == sorted(order)
  assert "g0" not in finished and "g1" not in finished and counted == (0, 0)


def test_groups_taken_since_the_last_trained_step_are_given_back_uncounted():
  """A reviewer: a stop after a step that trained nothing (its groups filtered, or none
  packed) let the final save consume those groups (their logs let go, their tasks past
  the checkpoint's place), and no row of either run counted them. Given back, they are
  in flight again and their drops no longer counted (a resume counts them once); a
  group whose task the infrastructure's drops re-queued stays taken."""
  failed = []

  async def play(task, sid, gid):
    if task == 2 and sid.endswith("-1-r0") and not failed:  # short: its task played again
      failed.append(sid)
      return episode(task, sid, gid, reward=0.0, infra=True)
    return episode(task, sid, gid, reward=float(task == 0 and sid.endswith("-0-r0")))

  async def go():
    s = RolloutScheduler(RolloutConfig(mode="sync", groups_per_step=1, group_size=2,
                                       max_retries=0, filter_equal_rewards=True,
                                       max_sample_rounds=3), itertools.count(), play)
    accepted, taken = await s.next_groups()  # group 0: accepted, its step found nothing
    s.trained_nothing(accepted)
    # task 1 filtered, task 2 short (re-queued), and played again: filtered
    more_accepted, more = await s.next_groups()
    assert more_accepted == [] and [g.task for g in more] == [1, 2, 2]
    assert s.dropped["no_signal"] == 2 and s.dropped["too_few_valid"] == 1
    assert s.replaced == 4
    s.give_back(taken + more)
    pending = s.pending_tasks()
    finished = s.drain_finished()
    await s.stop()
    return s, pending, finished

  s, pending, finished = run(go())
  assert pending == [0, 1, 2]  # (task 2 once: its second play stands for the first)
  assert finished == ["g2"]
  assert s.dropped["no_signal"] == 0 and s.dropped["too_few_valid"] == 1 and s.replaced == 1


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "chunk"])
def test_make_batch_advantages_and_packing(estimator):
  from jaxagent.scheduler import Group

  groups = []
  for gi in range(2):
    g = Group(gi, gi)
    g.episodes = [episode(gi, f"g{gi}-{i}", f"g{gi}", reward=float(i), turns=2)
                  for i in range(3)]
    groups.append(g)
  batch, info = make_batch(groups, AdvantageConfig(estimator=estimator, scale_by_std=False),
                           rows=8, seq_len=32, pad_id=0)
  assert info["segments"] == 6 and info["overflow"] == 0
  adv = batch.advantages[batch.loss_mask > 0]
  assert abs(adv.sum()) < 1e-4  # group baselines: advantages sum to zero
  if estimator == "grpo":
    # rewards 0, 1, 2: advantages -1, 0, 1 on every action token of the episode
    assert sorted(set(np.round(adv, 4))) == [-1.0, 0.0, 1.0]
  assert batch.tokens.shape == (2, 32)  # six 8-token segments fill two rows exactly


def test_a_segment_longer_than_a_row_trains_its_first_tokens_not_nothing():
  """A long failure beside a short success: dropped, it would still lower the group's
  baseline (pushing the success up) while never being pushed down itself, so running
  long would hide a loss (red-team). It trains its first seq_len tokens."""
  from jaxagent.scheduler import Group

  g = Group(0, 0)
  g.episodes = [episode(0, "win", "g", reward=1.0), episode(0, "lose", "g", reward=0.0,
                                                            turns=8)]
  assert len(g.episodes[1].segments[0]) > 16 >= len(g.episodes[0].segments[0])
  batch, info = make_batch([g], AdvantageConfig(estimator="grpo", scale_by_std=False),
                           rows=2, seq_len=16, pad_id=0)
  assert info["segments"] == 2 and info["too_long"] == 1
  adv = batch.advantages[batch.loss_mask > 0]
  assert sorted(set(np.round(adv, 4))) == [-0.5, 0.5]
  assert (batch.segment_ids > 0).sum() == 16 + len(g.episodes[0].segments[0])


def test_batches_carry_each_tokens_policy_version():
  from jaxagent.metrics import token_staleness_metrics
  from jaxagent.scheduler import Group
  groups = [Group(g, None, [episode(g, f"s{g}-{i}", f"g{g}", reward=float(i), version=v)
                            for i in range(2)]) for g, v in enumerate([5, 3])]
  batch, _ = make_batch(groups, AdvantageConfig(), rows=8, seq_len=32, pad_id=0)
  sampled = batch.loss_mask > 0
  assert sorted(np.unique(batch.versions[sampled])) == [3, 5]
  assert (batch.versions[~sampled] == -1).all()  # prompts, observations and padding
  from jaxagent.batch import pack  # versions always there (-1 unknown), ref_logp on request
  bare, _ = pack([{k: v for k, v in s.to_training().items() if k != "versions"}
                  for g in groups for e in g.episodes for s in e.segments], 2, 32,
                 with_ref=True)
  assert (bare.versions == -1).all() and (bare.ref_logp == 0).all()
  m = token_staleness_metrics(batch.versions, batch.loss_mask, 6)
  assert m["token_staleness_frac_1"] == 0.5 and m["token_staleness_frac_3plus"] == 0.5
  assert m["token_staleness_mean"] == 2.0 and m["token_staleness_max"] == 3


@pytest.mark.parametrize("estimator", ["grpo", "chunk"])
def test_batch_baseline_gives_uniform_failures_a_signal(estimator):
  """A group whose samples all fail alike: 0 against its own group, negative against
  the step (REINFORCE++-style global baseline)."""
  from jaxagent.scheduler import Group, compute_advantages

  def groups():
    out = []
    for gi, rewards in enumerate([(0.0, 0.0), (1.0, 3.0)]):
      g = Group(gi, gi)
      g.episodes = [episode(gi, f"g{gi}-{i}", f"g{gi}", reward=r) for i, r in enumerate(rewards)]
      out.append(g)
    return out

  def first_adv(gs):
    return [float(e.segments[0].advantages[e.segments[0].loss_mask > 0][0])
            for g in gs for e in g.episodes]

  cfg = dict(estimator=estimator, scale_by_std=False, gamma=1.0)
  gs = groups()
  compute_advantages(gs, AdvantageConfig(**cfg))
  assert first_adv(gs) == pytest.approx([0.0, 0.0, -1.0, 1.0])
  gs = groups()
  compute_advantages(gs, AdvantageConfig(baseline="batch", **cfg))
  assert first_adv(gs) == pytest.approx([-1.0, -1.0, 0.0, 2.0])  # step mean: 1
  with pytest.raises(ValueError, match="advantage.baseline"):
    compute_advantages(groups(), AdvantageConfig(baseline="global", **cfg))


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "chunk"])
def test_a_step_wide_baseline_spans_every_process(estimator):
  """Two processes' groups with `baseline: batch`: each process's advantages equal those
  of the whole step computed in one process."""
  from jaxagent.scheduler import Group, compute_advantages

  def groups(offset, rewards):
    return [Group(g, None, [episode(g, f"s{g}-{i}", f"g{g}", reward=r, turns=1 + i % 2)
                            for i, r in enumerate(rs)])
            for g, rs in enumerate(rewards, offset)]

  def firsts(gs):
    return [float(s.advantages[s.loss_mask > 0][0]) for g in gs for e in g.episodes
            for s in e.segments]

  cfg = AdvantageConfig(estimator=estimator, baseline="batch", scale_by_std=True)
  a_rewards, b_rewards = [(0.0, 1.0), (1.0, 1.0)], [(0.0, 0.0, 3.0)]
  whole = groups(0, a_rewards) + groups(2, b_rewards)
  compute_advantages(whole, cfg)

  def contributed(gs):  # what a process hands `gather`
    return [list(e.turn_rewards) if estimator == "chunk" else float(e.reward)
            for g in gs for e in g.episodes]

  a, b = groups(0, a_rewards), groups(2, b_rewards)
  compute_advantages(a, cfg, gather=lambda v: ([v, contributed(groups(2, b_rewards))], 0))
  compute_advantages(b, cfg, gather=lambda v: ([contributed(groups(0, a_rewards)), v], 1))
  assert firsts(a) + firsts(b) == pytest.approx(firsts(whole), abs=1e-6)
  alone = groups(2, b_rewards)  # what process 1 computed before: its own step only
  compute_advantages(alone, cfg)
  assert firsts(b) != pytest.approx(firsts(alone), abs=1e-3)


def test_batch_rows_follow_a_ladder_of_few_shapes():
  assert row_ladder(64) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48,
                            56, 64]
  assert row_ladder(20, multiple=4) == [4, 8, 12, 16, 20]
  assert row_ladder(10, multiple=4) == [4, 8, 12]  # the cap rounds up to the multiple
  assert batch_rows(17, 64) == 20
  assert batch_rows(3, 64, multiple=2) == 4
  assert batch_rows(100, 64) == 64


def test_make_batch_fills_rows_instead_of_rounding_to_powers_of_two():
  """32 episodes of ~80 tokens with 160-token rows: two a row, 16 rows (was 32)."""
  from jaxagent.scheduler import Group
  groups = [Group(g, None, [episode(g, f"s{g}-{i}", f"g{g}", reward=float(i % 2), turns=25 + i % 2)
                            for i in range(4)]) for g in range(8)]
  assert {len(s) for g in groups for e in g.episodes for s in e.segments} <= set(range(72, 81))
  batch, info = make_batch(groups, AdvantageConfig(), rows=64, seq_len=160, pad_id=0)
  assert batch.tokens.shape == (16, 160)
  assert info["segments"] == 32 and info["overflow"] == 0
  assert info["fill"] > 0.9
  # Row counts honour the learner's multiple (batch shards x microbatches).
  batch, _ = make_batch(groups, AdvantageConfig(), rows=64, seq_len=160, pad_id=0,
                        row_multiple=3)
  assert batch.tokens.shape[0] % 3 == 0 and batch.tokens.shape[0] >= 16


def test_groups_of_weights_other_than_the_servers_current_are_dropped():
  """Sync mode trains tokens of the current weights only (older ones: a server that lost
  its weights), or those of the last weight update with sync_every > 1; no mode trains tokens of versions newer than the learner's (a stopped
  run's weights, which a resumed run gave up)."""
  def play_at(version):
    async def play(task, sid, gid):
      return episode(task, sid, gid, reward=float(sid.split("-")[1] == "0"),
                     version=version(task))
    return play

  async def go(mode, version, sync_every=1):
    s = RolloutScheduler(RolloutConfig(mode=mode, groups_per_step=2, group_size=2,
                                       max_sample_rounds=2, sync_every=sync_every),
                         itertools.count(), play_at(version))
    s.set_version(5)
    s.set_served(5)
    s.start()
    try:
      accepted, taken = await asyncio.wait_for(s.next_groups(), 30)
    finally:
      await s.stop()
    return s, accepted, taken

  s, accepted, _ = run(go("sync", lambda task: 4 if task % 2 else 5))
  assert all(g.task % 2 == 0 for g in accepted) and s.dropped["stale"] >= 1
  s, accepted, _ = run(go("async", lambda task: 6 if task % 2 else 5))
  assert all(g.task % 2 == 0 for g in accepted) and s.dropped["future_version"] >= 1
  # Weights updated every 3 steps: the learner runs up to 2 versions ahead of the servers
  # (a run resumed between two updates replays episodes of the last one's weights).
  s, accepted, _ = run(go("sync", lambda task: 3 if task % 2 else 2, sync_every=3))
  assert all(g.task % 2 == 1 for g in accepted) and s.dropped["stale"] >= 1


def test_a_task_its_environment_cannot_start_stops_the_run_naming_it():
  from jaxagent.errors import TaskError

  async def play(task, sid, gid):
    if task == 1:
      raise TaskError("task 'z' (guess_number): ValueError: low (10) > high (2)")
    return episode(task, sid, gid, reward=float(sid.split("-")[1] == "0"))

  async def go():
    s = RolloutScheduler(RolloutConfig(mode="sync", groups_per_step=2, group_size=2),
                         itertools.count(), play)
    with pytest.raises(TaskError, match="low"):  # itself, not wrapped as "a bug"
      await s.next_groups()
    return s

  assert 1 not in run(go()).pending_tasks()  # not played again on a resume


def test_a_run_that_cannot_write_its_records_stops_with_that_error():
  """The token WAL on a full disk: an episode raising it is the run's storage, not a bug
  (it was "an episode raised OSError (a bug ...)" with its traceback, exit 1)."""
  from jaxagent.errors import RunWriteFailed

  async def play(task, sid, gid):
    raise RunWriteFailed("the token WAL could not be written in w (No space left on device)")

  async def go():
    s = RolloutScheduler(RolloutConfig(mode="sync", groups_per_step=1, group_size=2),
                         itertools.count(), play)
    with pytest.raises(RunWriteFailed, match="token WAL"):  # itself, not wrapped
      await s.next_groups()
    return s

  assert run(go()).pending_tasks() == [0]  # kept to be played on a resume


@pytest.mark.parametrize("broken", ["tasks", "capacity"])
def test_the_async_producer_s_error_stops_the_run_instead_of_a_wait_for_ever(broken):
  """The async scheduler's producer (a task of its own) died in silence when starting a
  group raised (red team 15: `rollout.redundancy=nan` raised in its capacity rule, and
  the run waited for groups with no output): `next_groups` raises it."""
  from jaxagent.scheduler import ProducerFailed

  async def play(task, sid, gid):
    return episode(task, sid, gid, reward=1.0)

  def tasks():
    yield 0
    yield 1
    raise KeyError("a broken task source")

  async def go():
    cfg = RolloutConfig(mode="async", groups_per_step=2, group_size=2,
                        redundancy=float("nan") if broken == "capacity" else 0.0)
    s = RolloutScheduler(cfg, tasks() if broken == "tasks" else itertools.count(), play)
    s.start()
    try:
      with pytest.raises(ProducerFailed, match="starting the next group failed: "):
        for _ in range(10):
          await asyncio.wait_for(s.next_groups(), 10)
    finally:
      await s.stop()

  run(go())


def test_what_a_batch_cannot_hold_is_left_out_by_whole_groups():
  """First-fit decreasing left out the shortest segments when a step's episodes did not
  fit: here every success (short), so the step trained only its failures' negative
  advantages, the successes' rewards still in their baseline (red team 17). Whole
  groups are left out, the last ones, and said."""
  from jaxagent.scheduler import Group

  groups = [Group(g, None, [episode(g, f"s{g}-{i}", f"g{g}", reward=float(i < 2),
                                    turns=5 if i < 2 else 9) for i in range(4)])
            for g in range(2)]
  lengths = sorted(len(e.segments[0]) for e in groups[0].episodes)
  assert lengths[0] < lengths[-1]
  seq_len = lengths[-1] * 2  # one group's four segments fill two rows, not two groups'
  batch, info = make_batch(groups, AdvantageConfig(scale_by_std=False), rows=2,
                           seq_len=seq_len, pad_id=0)
  assert (info["segments"], info["overflow"], info["overflow_groups"]) == (4, 4, 1)
  assert {s.group_id for s in info["used_segments"]} == {"g0"}
  assert info["episodes"] == 4  # (the step's episodes_trained: those packed)
  adv = batch.advantages[batch.loss_mask > 0]
  assert adv.max() == 0.5 and adv.min() == -0.5  # its successes with its failures

  # Not even the first group fits: its first episodes, in their order (a reviewer: the
  # step trained nothing, and the run spun without saying why).
  batch, info = make_batch(groups, AdvantageConfig(scale_by_std=False), rows=1,
                           seq_len=seq_len, pad_id=0)
  assert info["overflow_groups"] == 1 and 0 < info["segments"] < 4  # (the first: part)
  assert [s.rollout_id for s in info["used_segments"]] == [
      e.segments[0].rollout_id for e in groups[0].episodes[:info["segments"]]]


def test_the_equal_rewards_filter_keeps_what_the_estimator_learns_from():
  """A group is dropped only where its advantages can only be 0 (red team 19: equal
  totals of other turn rewards, or a faster success under a discount, were dropped
  while the chunk estimator ranks their turns; a teacher's or a step-wide baseline's
  signal too)."""
  from jaxagent.scheduler import Group, carries_signal

  def group(*turn_rewards):
    g = Group(0, "t", [])
    for i, per_turn in enumerate(turn_rewards):
      e = episode(0, f"s{i}", "g", reward=sum(per_turn), turns=max(len(per_turn), 1))
      e.turn_rewards = list(per_turn)
      g.episodes.append(e)
    return g

  grpo, chunk = AdvantageConfig(), AdvantageConfig(estimator="chunk", gamma=0.9)
  same = group([0.5, 0.5], [0.5, 0.5])
  assert not carries_signal(same, grpo) and not carries_signal(same, chunk)
  other_turns = group([0.5, 0.5], [0.0, 1.0])
  assert not carries_signal(other_turns, grpo) and carries_signal(other_turns, chunk)
  faster = group([1.0], [0.0, 0.0, 1.0])
  assert carries_signal(faster, chunk)
  # Other turn counts alone rank nothing (a lone turn takes the advantage of the last
  # turn others reached: all 0 here; a reviewer).
  chunk1 = AdvantageConfig(estimator="chunk")
  for same_returns in (group([1.0], [0.0, 0.0, 1.0]), group([0.0], [0.0, 0.0]),
                       group([0.0, 1.0], [0.0, 1.0, 0.0]), group([], [0.0])):
    assert not carries_signal(same_returns, chunk1)
  assert not carries_signal(group([0.0], [0.0, 0.0]), chunk)
  assert carries_signal(group([0.0], [1.0]), grpo)
  for cfg in (AdvantageConfig(baseline="batch"), AdvantageConfig(teacher="t")):
    assert carries_signal(same, cfg)
  # The step's metric counts by the same rule.
  from jaxagent.metrics import episode_metrics
  assert episode_metrics([other_turns], [], 0)["groups_with_signal"] == 0
  assert episode_metrics([other_turns], [], 0, lambda g: carries_signal(g, chunk))[
      "groups_with_signal"] == 1
  # The scheduler asks it with the run's estimator.
  async def play(task, sid, gid):
    e = episode(task, sid, gid, reward=1.0, turns=2)
    e.turn_rewards = [0.0, 1.0] if sid.endswith("-0-r0") else [0.5, 0.5]
    return e

  async def go(advantage):
    s = RolloutScheduler(RolloutConfig(mode="sync", groups_per_step=1, group_size=2,
                                       max_sample_rounds=1), itertools.count(), play,
                         advantage=advantage)
    s.start()
    accepted, _ = await s.next_groups()
    await s.stop()
    return len(accepted), s.dropped["no_signal"]

  assert run(go(grpo)) == (0, 1) and run(go(chunk)) == (1, 0)


def test_between_weight_syncs_staleness_is_the_learners_and_groups_still_start():
  """async, sync_every 3, max_staleness 1: groups start on the served weights, which move
  every third step. The capacity rule counted max_staleness (not the bound, sync_every - 1
  = 2) from the served version, so no group could start between syncs: the run waited for
  ever; and staleness was measured against the served version, so groups 3 versions
  behind the learner were trained (red team 20)."""
  box = {}

  async def play(task, sid, gid):
    return episode(task, sid, gid, reward=float(sid.endswith("-0-r0")),
                   version=box["s"].served)

  async def go():
    s = box["s"] = RolloutScheduler(RolloutConfig(mode="async", groups_per_step=1, group_size=2,
                                       max_staleness=1, sync_every=3), itertools.count(),
                         play)
    s.start()
    lags = []
    for step in range(1, 8):
      accepted, _ = await asyncio.wait_for(s.next_groups(), 10)  # (it waited for ever)
      lags += [s.version - g.min_version() for g in accepted]
      s.set_version(step)  # the learner's step
      if step % 3 == 0:
        s.set_served(step)  # a weight sync
    await s.stop()
    return lags

  lags = run(go())
  assert len(lags) == 7 and max(lags) <= 2  # (staleness_bound: max(1, 3 - 1))


def test_groups_that_gave_a_step_nothing_are_replaced():
  """A step whose groups packed to nothing (every first prompt too long) makes no version:
  counted as a step's by the capacity rule, max_staleness + 1 of them let no group start
  again, and an async run waited for ever (red team 20)."""
  async def play(task, sid, gid):
    return episode(task, sid, gid, reward=float(sid.endswith("-0-r0")))

  async def go():
    s = RolloutScheduler(RolloutConfig(mode="async", groups_per_step=1, group_size=2,
                                       max_staleness=0), itertools.count(), play)
    s.start()
    for _ in range(3):  # three steps of nothing to train: the version stays 0
      accepted, _ = await asyncio.wait_for(s.next_groups(), 10)
      s.trained_nothing(accepted)
    await s.stop()
    return s.started

  assert run(go()) >= 3  # (the run had stopped at the second step)


def test_short_steps_do_not_grow_the_capacity():
  """max_sample_rounds 1, every other group without signal: each step trains 1 of its 2
  groups. The capacity rule counted 2 a version, so each short step left one more group
  to start for good: 14 in flight at version 10 against a bound of 4, stale drops
  growing quadratically (a reviewer of red team 20)."""
  box = {}

  async def play(task, sid, gid):
    await asyncio.sleep(0.001)
    reward = 0.0 if task % 2 == 0 else float(sid.endswith("-0-r0"))
    return episode(task, sid, gid, reward=reward, version=box["s"].served)

  async def go():
    s = box["s"] = RolloutScheduler(RolloutConfig(
        mode="async", groups_per_step=2, group_size=2, max_staleness=1,
        max_sample_rounds=1), itertools.count(), play)
    s.start()
    most = 0
    for v in range(1, 21):
      accepted, _ = await asyncio.wait_for(s.next_groups(), 10)
      s.trained(accepted)
      s.set_served(v)
      s.set_version(v)
      await asyncio.sleep(0.01)
      most = max(most, len(s.groups))
    await s.stop()
    return most, s.dropped["stale"]

  most, stale = run(go())
  assert most <= 4 + 2 and stale <= 4, (most, stale)


def test_tokens_of_unknown_version_count_as_fresh_to_acceptance_and_lag():
  """A trained token of unknown version (-1) is fresh to the loss and the token
  staleness metrics, and was the oldest there is to acceptance (a group dropped as
  stale) and `policy_lag` (version + 1): red team 39."""
  from jaxagent.metrics import episode_metrics, token_staleness_metrics
  from jaxagent.scheduler import Group
  from jaxagent.trajectory import Segment

  def ep(versions, reward):
    v = np.asarray(versions, np.int32)
    n = len(v)
    seg = Segment(tokens=np.arange(n), loss_mask=np.ones(n, np.float32),
                  rollout_logp=np.zeros(n, np.float32), versions=v,
                  turn_ids=np.zeros(n, np.int32), session_id="s", rollout_id="s",
                  segment_id="s/0")
    return Episode("t", "s", "g", [seg], [reward], {"status": "pass"}, "completed")

  s = RolloutScheduler(RolloutConfig(mode="async", groups_per_step=1, group_size=2,
                                     filter_equal_rewards=False, max_staleness=1),
                       iter(range(100)), None)
  s.set_version(5)
  g = Group(0, None, episodes=[ep([5, 5, -1], 1.0), ep([5, 5], 0.0)], done=True)
  assert s._accept(g), dict(s.dropped)
  assert episode_metrics([g], [g], 5)["policy_lag_max"] == 0
  assert token_staleness_metrics(np.array([[5, 5, -1, 5, 5]]), np.ones((1, 5)),
                                 5)["token_staleness_max"] == 0
  assert ep([-1, -1], 0.0).segments[0].min_version() is None


def test_async_updates_sparser_than_the_staleness_bound_are_said():
  """Async with `sync_every - 1 > max_staleness` trains tokens older than max_staleness
  (the bound is the larger, as docs/architecture.md says) without a word: red team 39.
  And a window mode whose window holds every group in flight is async mode, said too."""
  from jaxagent.scheduler import rollout_notes

  (note,) = rollout_notes(RolloutConfig(mode="async", max_staleness=1, sync_every=3))
  assert "up to 2 versions behind" in note and "rollout.max_staleness (1)" in note
  assert rollout_notes(RolloutConfig(mode="async", max_staleness=2, sync_every=3)) == []
  assert rollout_notes(RolloutConfig(mode="sync", sync_every=3)) == []
  # A window that holds every group in flight is async mode (the defaults: 16 of 2 x 8)
  (note,) = rollout_notes(RolloutConfig(mode="window", groups_per_step=8, window=16,
                                        max_staleness=1))
  assert "rollout.window 16 holds every group the staleness bound lets run (16)" in note
  assert rollout_notes(RolloutConfig(mode="window", groups_per_step=8, window=15,
                                     max_staleness=1)) == []
  assert len(rollout_notes(RolloutConfig(mode="window", groups_per_step=8, window=16,
                                         max_staleness=1, redundancy=0.5))) == 0


def test_episodes_in_flight_are_capped_by_max_concurrent_episodes():
  """Async with a staleness bound far off: the groups started at once are capped at twice
  the groups `max_concurrent_episodes` holds (4 // 2 x 2), not the bound's 24."""
  assert _started_at_once(max_staleness=10, max_concurrent_episodes=4) == 4


def test_equal_reward_groups_are_kept_with_the_filter_off():
  async def play(task, sid, gid):
    return episode(task, sid, gid, reward=1.0)

  async def go():
    s = RolloutScheduler(RolloutConfig(mode="sync", groups_per_step=2, group_size=2,
                                       filter_equal_rewards=False), itertools.count(), play)
    return s, *(await s.next_groups())

  s, accepted, taken = run(go())
  assert [g.task for g in accepted] == [0, 1] and len(taken) == 2
  assert s.dropped["no_signal"] == 0 and s.replaced == 0


def test_a_failed_episode_is_retried_after_a_doubling_backoff(monkeypatch):
  sleeps = []
  real_sleep = asyncio.sleep

  async def fake_sleep(delay, *a):
    sleeps.append(delay)
    await real_sleep(0)

  async def play(task, sid, gid):
    return episode(task, sid, gid, reward=0.0, infra=sid.split("-")[1] == "0")

  async def go():
    s = RolloutScheduler(RolloutConfig(mode="sync", groups_per_step=1, group_size=3,
                                       max_retries=3, retry_backoff_s=0.5,
                                       filter_equal_rewards=False), itertools.count(), play)
    monkeypatch.setattr(asyncio, "sleep", fake_sleep)
    return s, *(await s.next_groups())

  s, accepted, taken = run(go())
  assert sleeps == [0.5, 1.0, 2.0]  # after attempts 0, 1, 2; none after the last
  assert s.retries == 3 and s.dropped["infra_error"] == 1 and len(accepted[0].episodes) == 2


def test_dynamic_sampling_consumes_at_most_max_sample_rounds_times_the_groups():
  async def play(task, sid, gid):
    return episode(task, sid, gid, reward=0.0)  # no group carries a signal

  async def go():
    s = RolloutScheduler(RolloutConfig(mode="sync", groups_per_step=2, group_size=2,
                                       max_sample_rounds=3), itertools.count(), play)
    return s, *(await s.next_groups())

  s, accepted, taken = run(go())
  assert accepted == [] and len(taken) == 6 and s.dropped["no_signal"] == 6


def test_a_group_is_as_stale_as_its_oldest_episode():
  """Staleness is the learner's version minus the group's oldest token's: one episode of
  version 3 makes the group 2 versions old at version 5, past max_staleness 1, however
  fresh the others; at version 4 it is just within the bound."""
  from jaxagent.scheduler import Group

  s = RolloutScheduler(RolloutConfig(mode="async", groups_per_step=1, group_size=2,
                                     filter_equal_rewards=False, max_staleness=1),
                       iter(range(100)), None)
  s.set_version(5)

  def group(old):
    return Group(0, 0, episodes=[episode(0, "g0-0-r0", "g0", reward=1.0, version=old),
                                 episode(0, "g0-1-r0", "g0", reward=0.0, version=5)],
                 done=True)

  assert group(3).min_version() == 3 and group(3).max_version() == 5
  assert not s._accept(group(3)) and s.dropped["stale"] == 1
  assert s._accept(group(4)) and s.dropped["stale"] == 1


def test_the_outage_bound_is_strictly_past_the_fraction_and_a_zero_grace_is_at_once():
  s = RolloutScheduler(RolloutConfig(infra_window=4, max_infra_fraction=0.5,
                                     infra_grace_s=0.0), itertools.count(), None)
  for kind in ["sandbox", None, "sandbox", None, "sandbox"]:  # 2 of the last 4: at it
    s._ended(kind)
    assert s.error is None
  s._ended("sandbox")  # 3 of the last 4, with no grace: the outage, at once
  assert "3 of the last 4" in str(s.error)


def test_groups_start_on_the_served_weights_and_are_dropped_by_them():
  """Between weight syncs the learner runs ahead of the servers: a group started then
  started on the served version, and it is doomed once the learner is past the bound
  from that version (not from the learner's own at its start). The capacity counts from
  the served version too: (0 + 2 + 1) x 1 groups, not (2 + 2 + 1)."""
  async def go():
    s = RolloutScheduler(RolloutConfig(mode="async", groups_per_step=1, group_size=2,
                                       max_staleness=1, sync_every=3),
                         itertools.count(), lambda *a: asyncio.sleep(60))
    s.set_version(2)  # two steps past the servers' version 0 (bound: 3 - 1 = 2)
    s.start()
    await asyncio.sleep(0.05)
    versions = [g.started_version for g in s.groups.values()]
    s.set_version(3)  # version 0 is now 3 behind: every running group is doomed
    out = versions, s.dropped["stale"], len(s.groups)
    await s.stop()
    return out

  versions, stale, left = run(go())
  assert versions == [0, 0, 0]
  assert stale == len(versions) and left == 0


def test_pending_tasks_keep_the_tasks_queued_to_be_played_again():
  """Tasks waiting in the requeue (a checkpoint's pending tasks, a group the
  infrastructure left short) are pending too: saved with a checkpoint, first in line."""
  s = RolloutScheduler(RolloutConfig(mode="sync"), iter(range(100)), None,
                       requeue=["a", "b"])
  assert s.pending_tasks() == ["a", "b"]


def test_advantages_are_zero_off_the_action_tokens():
  from jaxagent.scheduler import Group, compute_advantages

  g = Group(0, 0, episodes=[episode(0, f"g0-{i}", "g0", reward=float(i), turns=2)
                            for i in range(2)])
  compute_advantages([g], AdvantageConfig(scale_by_std=False))
  for e, want in zip(g.episodes, (-0.5, 0.5)):
    for s in e.segments:
      np.testing.assert_array_equal(s.advantages, want * s.loss_mask)
      assert (s.loss_mask == 0).any()


def test_the_outage_grace_starts_again_after_the_drops_fall_back_under_the_bound(
    monkeypatch):
  """A burst of drops, a recovery, then another burst: the grace counts from the second
  burst's start, not the first's (a brief blip later must not stop the run at once)."""
  import time

  now = [100.0]  # (the scheduler's clock, moved by hand: no real wait to race)
  monkeypatch.setattr(time, "monotonic", lambda: now[0])
  s = RolloutScheduler(RolloutConfig(infra_window=4, max_infra_fraction=0.5,
                                     infra_grace_s=30.0), itertools.count(), None)
  for kind in ["server"] * 4 + [None] * 4:  # past the bound, then back under it
    s._ended(kind)
  now[0] += 60.0
  for kind in ["server"] * 3:  # past it again, only just
    s._ended(kind)
  assert s.error is None
  now[0] += 29.0
  s._ended("server")
  assert s.error is None
  now[0] += 1.0  # the second burst's grace is spent
  s._ended("server")
  assert s.error is not None


def test_a_groups_other_episodes_end_with_its_bug_and_stop_leaves_none_running():
  """A reviewer: an episode's bug ended its group's task while gather left the group's
  other episodes running, out of any task `stop` cancels: they went on using servers
  and workers the run then closed, holding their episode slots."""
  live, cancelled = set(), []

  async def play(task, sid, gid):
    live.add(sid)
    try:
      if sid.startswith("g0-0"):
        await asyncio.sleep(0.01)
        raise ValueError("a bug")
      await asyncio.sleep(5)
      return episode(task, sid, gid, reward=float(sid.endswith("0-r0")))
    except asyncio.CancelledError:
      cancelled.append(sid)
      raise
    finally:
      live.discard(sid)

  async def go():
    s = RolloutScheduler(RolloutConfig(mode="async", groups_per_step=1, group_size=3,
                                       max_concurrent_episodes=3), itertools.count(), play)
    s.start()
    with pytest.raises(EpisodeBug):
      await s.next_groups()
    await s.stop()
    # (before the loop's own end cancels what is left)
    assert not live and {"g0-1-r0", "g0-2-r0"} <= set(cancelled)
    assert s.episode_slots._value == 3

  run(go())


def test_stop_lets_the_groups_dropped_as_stale_close_their_environments():
  """A reviewer: a group `_drop_doomed` cancelled (stale once the step's version came)
  was cancelled again by a stop right after, which cut its episodes' environment
  closes (an HTTP delete of the worker's session) short: sessions and sandboxes left
  open on the workers until their idle reaper."""
  closed, cut = [], []

  async def play(task, sid, gid):
    try:
      await asyncio.sleep(10)
      return episode(task, sid, gid, reward=1.0)
    finally:  # (run_whitebox's: its environment closed, awaited)
      try:
        await asyncio.sleep(0.05)
        closed.append(sid)
      except asyncio.CancelledError:
        cut.append(sid)
        raise

  async def go():
    s = RolloutScheduler(RolloutConfig(mode="async", groups_per_step=1, group_size=2,
                                       max_staleness=0, max_concurrent_episodes=2),
                         itertools.count(), play)
    s.start()
    await asyncio.sleep(0.01)
    s.set_served(1)
    s.set_version(1)  # (the running group is doomed, and cancelled)
    await asyncio.sleep(0)
    await s.stop()

  run(go())
  assert sorted(closed) == ["g0-0-r0", "g0-1-r0"] and not cut

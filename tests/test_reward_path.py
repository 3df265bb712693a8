"""The reward path is one contract: what the verifier returns is what the learner trains on.

A python_tests task played through the white-box loop with a scripted policy: the
reference solution trains with reward 1, a wrong one with 0, and a grader that fails
is retried, then dropped and counted by the scheduler, never trained.
"""

import asyncio
import dataclasses
import itertools
import json

import numpy as np
import pytest

from envs.base import EnvResources, TaskSpec, make
from envs.python_tasks_data import TASKS
from envs.isolation import available_isolations
from jaxagent.agent import run_whitebox
from jaxagent.config import AdvantageConfig, AgentConfig, RolloutConfig
from jaxagent.scheduler import RolloutScheduler, make_batch
from tests.test_agent import TOK, ScriptedEngine

pytestmark = pytest.mark.skipif(available_isolations() == ("rlimits",),
                                reason="python_tests needs sandbox isolation")
REFERENCE = {t[0]: t[2] for t in TASKS}
TASK = TaskSpec("python_tests/add", "python_tests", {"task": "add"})
CFG = AgentConfig(max_turns=4, max_new_tokens=64, max_context_tokens=4096)


def write(content: str) -> str:
  call = {"name": "write_file", "arguments": {"path": "solution.py", "content": content}}
  return f"<tool_call>{json.dumps(call)}</tool_call>"


@pytest.fixture
def resources():
  r = EnvResources(sandboxes=2)
  yield r
  r.close()


def play(resources, replies, session_id="s", env=None):
  env = env or make("python_tests", resources)
  return asyncio.run(run_whitebox(env, TASK, ScriptedEngine(replies), TOK, CFG,
                                  session_id=session_id, group_id="g"))


def test_the_reference_solution_trains_with_reward_1_and_a_wrong_one_with_0(resources):
  good = play(resources, [write(REFERENCE["add"]), "DONE"])
  assert good.status == "completed" and not good.infra_error and good.success
  assert good.turn_rewards == [0.0, 1.0] and good.reward == 1.0
  (seg,) = good.segments
  assert seg.reward == 1.0 and seg.turn_rewards == [0.0, 1.0]
  wrong = play(resources, [write("def add(a, b):\n    return a * b\n"), "DONE"])
  assert wrong.verdict["status"] == "fail" and wrong.turn_rewards == [0.0, 0.0]
  # Both reach the batch with exactly those rewards: advantages +1/-1 around the mean.
  from jaxagent.scheduler import Group
  group = Group(0, TASK, [good, wrong])
  batch, _ = make_batch([group], AdvantageConfig(estimator="grpo", scale_by_std=False),
                        rows=2, seq_len=2048, pad_id=TOK.pad_id)
  adv = np.asarray(batch.advantages)[np.asarray(batch.loss_mask) > 0]
  assert sorted(set(np.round(adv, 4).tolist())) == [-0.5, 0.5]


class BrokenPool:
  """A sandbox host that fails every grading (an infrastructure failure)."""

  def acquire(self):
    raise OSError("sandbox host unavailable")


def test_an_infrastructure_failure_is_retried_then_dropped_and_counted(resources):
  plays = []

  async def play_one(task, sid, gid):
    env = make("python_tests", resources)
    broken = sid.startswith("g0-0")  # the first episode of the group: its grader always fails
    if broken:
      env.verifier.pool = BrokenPool()
    plays.append(sid)
    return await run_whitebox(env, task, ScriptedEngine([write(REFERENCE["add"]), "DONE"]),
                              TOK, CFG, session_id=sid, group_id=gid)

  async def go():
    s = RolloutScheduler(RolloutConfig(mode="sync", groups_per_step=1, group_size=3,
                                       max_retries=2, filter_equal_rewards=False),
                         itertools.repeat(TASK), play_one)
    s.set_version(5)
    s.set_served(5)  # (the scripted engine's tokens are version 5)
    accepted, taken = await s.next_groups()
    return s, accepted, taken

  s, accepted, taken = asyncio.run(go())
  assert sorted(plays) == ["g0-0-r0", "g0-0-r1", "g0-0-r2", "g0-1-r0", "g0-2-r0"]
  assert s.dropped["infra_error"] == 1 and s.retries == 2
  (group,) = taken
  # Only the graded episodes train; the dropped one is not a 0.
  assert [e.session_id for e in group.episodes] == ["g0-1-r0", "g0-2-r0"]
  assert [e.reward for e in group.episodes] == [1.0, 1.0]


def run_code(code: str) -> str:
  return f"<tool_call>{json.dumps({'name': 'run_python', 'arguments': {'code': code}})}</tool_call>"


def test_waiting_for_a_sandbox_slot_is_the_infrastructures_time(resources):
  """Waiting for an execution slot (every slot taken by other episodes, often the run's
  own) does not spend an episode's budget: it goes slower, then is graded (neither a
  bystander's wait scored as its failure, nor a policy slow everywhere having its
  failures dropped as infrastructure); past EPISODE_WALL_FACTOR deadlines of wall time
  it is the infrastructure's; a command that gets no slot while the pool makes no
  progress ends its episode as infrastructure instead of reaching the policy as a
  strange tool output; waits are counted apart from the episode's own time."""
  import rollout_server.client  # noqa: F401  (imported before the episodes' clocks start)

  pool = resources.pool()

  async def with_slots_taken(hold_s, **cfg):
    async def hold():
      async with pool.slot(), pool.slot():  # both slots: another episode's long commands
        await asyncio.sleep(hold_s)

    holder = asyncio.ensure_future(hold())
    await asyncio.sleep(0.05)
    env = make("python_tests", resources)
    ep = await run_whitebox(env, TASK, ScriptedEngine([run_code("print(1)"), "DONE"]), TOK,
                            dataclasses.replace(CFG, **cfg), session_id="s", group_id="g")
    await holder
    return ep

  ep = asyncio.run(with_slots_taken(2.0, episode_deadline_s=1.0))  # waits 2 s of its 1
  assert not ep.infra_error and ep.verdict["status"] == "fail", ep.reason
  assert ep.infra_wait_s > 1.5 and ep.env_s < 1.0
  ep = asyncio.run(with_slots_taken(5.0, episode_deadline_s=1.0))  # past 3 deadlines
  # (cut at its wall time, as at its deadline: not mostly on the server, so its own)
  assert not ep.infra_error and (ep.status, ep.reason) == ("truncated", "episode_wall")

  pool.slot_timeout_s = 0.5  # for the workspaces made from here on
  ep = asyncio.run(with_slots_taken(2.0))
  assert ep.infra_error and ep.infra_kind == "sandbox" and "no execution slot" in ep.reason
  pool.slot_timeout_s = 60.0

  ep = asyncio.run(with_slots_taken(1.0))  # waits ~1 s, then runs and is graded
  assert not ep.infra_error and ep.verdict["status"] == "fail"
  assert 0.7 < ep.infra_wait_s < 5.0 and ep.env_s < ep.latency_s - 0.7


def test_a_grading_queued_behind_the_crowd_is_graded_and_its_own_time_is_bounded():
  """A verify waits on the run's own load too (the grader's sandbox slots, a worker's
  turns): the bound of EPISODE_WALL_FACTOR episode deadlines counts its own time, not
  its waits. Counted in wall time, a crowded grading was an infrastructure error,
  re-rolled, and failing answers (their tests run to their limits) met it more often
  than passing ones. A grading whose own time passes the bound is still cut."""
  from envs import base, waits
  from envs.base import Observation, StepResult, Verdict, VerdictStatus

  class Grading(base.Env):
    """Its verify waits on shared infrastructure (`wait_s`) and works (`work_s`)."""

    def __init__(self, wait_s, work_s):
      self.wait_s, self.work_s = wait_s, work_s

    async def reset(self, task):
      return Observation([{"role": "user", "content": "go"}])

    async def step(self, action):
      return StepResult(Observation([]), 0.0, True, False)

    async def verify(self):
      with waits.waiting():
        await asyncio.sleep(self.wait_s)
      await asyncio.sleep(self.work_s)
      return Verdict(VerdictStatus.FAIL, 0.0, "g@1", "g@1")

  def play(wait_s, work_s, deadline_s=0.5):
    return asyncio.run(run_whitebox(
        Grading(wait_s, work_s), TaskSpec("g", "grading"), ScriptedEngine(["DONE"]), TOK,
        dataclasses.replace(CFG, episode_deadline_s=deadline_s), session_id="s",
        group_id="g"))

  assert not play(0.0, 0.0, 60.0).infra_error  # (the first episode's compiles)
  ep = play(2.0, 0.1)  # queued past 3 deadlines (1.5 s): graded
  assert not ep.infra_error and ep.verdict["status"] == "fail", ep.reason
  ep = play(0.0, 2.0)  # its own time past them: the verifier's infrastructure error
  assert ep.infra_error and ep.infra_kind == "verifier" and "of its own" in ep.reason, (
      ep.reason)

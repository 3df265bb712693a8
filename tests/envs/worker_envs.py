"""The environments the worker tests register (each plays a worker's call of a known
shape: a slow step, a slow reset, a bug, a blocking tool, a long sandboxed command, a
marked wait)."""
import asyncio
import datetime
import time

import pytest

from envs import base, waits
from envs.base import VerdictStatus
from envs.isolation import available_isolations
from jaxagent.errors import InfraError

needs_isolation = pytest.mark.skipif(available_isolations() == ("rlimits",),
                                     reason="python_tests needs sandbox isolation")


@base.register("slow_test_env")
class SlowEnv(base.Env):
  """Sleeps in step for as long as the action says."""

  async def reset(self, task):
    return base.Observation([{"role": "user", "content": "go"}])

  async def step(self, action):
    await asyncio.sleep(float(action))
    return base.StepResult(base.Observation([]), 0.0, True, False)

  async def verify(self):
    return base.Verdict(VerdictStatus.FAIL, 0.0, "slow@1", "slow@1")


@base.register("slow_reset_test_env")
class SlowResetEnv(SlowEnv):
  """Its reset takes `params.reset_s` seconds."""

  async def reset(self, task):
    await asyncio.sleep(float(task.params["reset_s"]))
    return base.Observation([{"role": "user", "content": "go"}])


@base.register("nan_reward_test_env")
class NanRewardEnv(SlowEnv):
  """Its step's reward is a NaN (an environment's bug)."""

  async def step(self, action):
    return base.StepResult(base.Observation([]), float("nan"), True, False)


@base.register("harsh_test_env")
class HarshEnv(SlowEnv):
  """Pays -1 for an episode the policy cut before it answered (as its wrong answers)."""

  cut_reward = -1.0


@base.register("numpy_test_env")
class NumpyEnv(SlowEnv):
  """Gives NumPy's numbers where it gives numbers, and a set, a date and a NaN in its
  step's info (`params.odd`: a value JSON cannot carry, an object with nothing to
  write, in its reset's observation or its step's info)."""

  async def reset(self, task):
    import numpy as np

    self.task = task
    await super().reset(task)
    odd = object() if task.params.get("odd") == "reset" else np.int64(3)
    return base.Observation([{"role": "user", "content": "go", "n": odd}])

  async def step(self, action):
    import numpy as np

    odd = object() if self.task.params.get("odd") == "step" else np.arange(2)
    return base.StepResult(base.Observation([]), np.float32(0.5), True, False,
                           {"seen": odd, "turn": np.int64(1), "kinds": {"a"},
                            "when": datetime.date(2026, 12, 7), "nan": float("nan")})

  async def verify(self):
    import numpy as np

    return base.Verdict("pass", np.float64(1.0), "numpy@1", "numpy@1")


@base.register("buggy_test_env")
class BuggyEnv(SlowEnv):
  """Its step raises (`params.raise`: an AttributeError, say) or counts a tool call; its
  verdict's status is `params.status`."""

  async def reset(self, task):
    self.task = task
    return await super().reset(task)

  async def step(self, action):
    if self.task.params.get("raise") == "host":
      raise OSError(28, "No space left on device")
    if self.task.params.get("raise") == "infra":  # (a sandbox the worker could not run)
      raise InfraError("sandbox", "sandbox pool is at its limit of 1 workspaces")
    if self.task.params.get("raise"):
      raise AttributeError("grader database down")
    self.counters["tool_calls"] += 2
    self.counters["tool_errors"] += 1
    return base.StepResult(base.Observation([]), 0.0, False, False, self._info())

  async def verify(self):
    if self.task.params.get("raise") == "infra":  # (its grading's sandbox, say)
      raise InfraError("sandbox", "no sandbox slot freed within 60 s")
    return base.Verdict(self.task.params["status"], 0.0, "buggy@1", "buggy@1")


@base.register("blocking_tool_test_env")
class BlockingToolEnv(SlowEnv):
  """Its one tool is a plain function that blocks for as long as its argument says."""

  async def step(self, action):
    from envs.tools import Tool, ToolSet

    tools = ToolSet([Tool("block", "blocks", {"type": "object"},
                          lambda seconds: time.sleep(seconds) or "done")])
    run = await tools.run_turn(self, '<tool_call>{"name": "block", "arguments": '
                                     f'{{"seconds": {float(action)}}}}}</tool_call>')
    return base.StepResult(base.Observation(run.messages), 0.0, False, False, self._info())


@base.register("long_command_test_env")
class LongCommandEnv(SlowEnv):
  """Its step is a sandboxed command of the policy's that takes as long as the action."""

  async def step(self, action):
    with waits.commanding():
      await asyncio.sleep(float(action))
    return base.StepResult(base.Observation([]), 0.0, True, False)


EVENTS: list[str] = []


@base.register("waiting_test_env")
class WaitingEnv(base.Env):
  """A step that waits on shared infrastructure (as a sandbox slot wait is marked) for
  as long as its action says; it records being cancelled and being closed."""

  async def reset(self, task):
    return base.Observation([{"role": "user", "content": "go"}])

  async def step(self, action):
    try:
      with waits.waiting():
        await asyncio.sleep(float(action))
    except asyncio.CancelledError:
      EVENTS.append("cancelled")
      raise
    return base.StepResult(base.Observation([]), 0.0, True, False)

  async def verify(self):
    return base.Verdict(VerdictStatus.FAIL, 0.0, "w@1", "w@1")

  async def close(self):
    EVENTS.append("closed")


@base.register("queued_grading_test_env")
class QueuedGradingEnv(SlowEnv):
  """Its verify waits on shared infrastructure (as a grader's sandbox slot wait is
  marked) for `params.wait_s` seconds."""

  async def reset(self, task):
    self.wait_s = float(task.params["wait_s"])
    return await super().reset(task)

  async def verify(self):
    with waits.waiting(), waits.queued():
      await asyncio.sleep(self.wait_s)
    return await super().verify()


@base.register("failing_reset_test_env")
class FailingResetEnv(WaitingEnv):
  """Its reset fails: the task's (`params.raise` "task": a ValueError) or the host's
  (an OSError); it records being closed."""

  async def reset(self, task):
    if task.params.get("raise") == "task":
      raise ValueError("no such level")
    raise OSError(28, "No space left on device")

"""What the environment tests share: playing an episode with a list of actions, and the
tool calls and `add` solutions the python_tests cases write."""
import asyncio
import json


def play(env, task, actions):
  async def go():
    obs = await env.reset(task)
    steps = []
    for a in actions:
      steps.append(await env.step(a))
      if env.done:
        break
    return obs, steps, await env.verify()
  return asyncio.run(go())


GOOD_ADD = "def add(a, b):\n    return a + b\n"
WRONG_ADD = "def add(a, b):\n    return 0\n"


def _call(name, **arguments):
  return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"

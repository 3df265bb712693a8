"""For `env.imports`: an ordinary bug on one process of a multi-process run
(`BUG_PROCESS`, default 1). `BUG_IN=env` (the default): guess_number's step raises from
its `BUG_AFTER`-th call on (default 150: a few steps in), as an environment's own bug
would, while that process's episodes play. `BUG_IN=eval`: the evaluation during
training raises (on the primary, which alone runs it, after its step's update)."""

import os

from envs import guess_number
from jaxagent import eval as eval_lib

_step, _evaluate = guess_number.GuessNumber.step, eval_lib.evaluate
_calls = [0]


def _here() -> bool:
  import jax

  return jax.process_index() == int(os.environ.get("BUG_PROCESS", "1"))


async def step(self, action):
  _calls[0] += 1
  if (os.environ.get("BUG_IN", "env") == "env" and _here()
      and _calls[0] >= int(os.environ.get("BUG_AFTER", "150"))):
    raise ZeroDivisionError("an environment's bug on one process")
  return await _step(self, action)


async def evaluate(*args, **kwargs):
  if os.environ.get("BUG_IN") == "eval" and _here():
    raise ZeroDivisionError("an evaluation's bug on one process")
  return await _evaluate(*args, **kwargs)


guess_number.GuessNumber.step = step
eval_lib.evaluate = evaluate

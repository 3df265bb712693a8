"""For `env.imports`: guess_number's step raises an ordinary bug on one process of a
multi-process run (`BUG_PROCESS`, default 1) from its `BUG_AFTER`-th call on (default
150: a few steps in), as an environment's own bug would; the other processes are well."""

import os

from envs import guess_number

_step = guess_number.GuessNumber.step
_calls = [0]


async def step(self, action):
  import jax

  _calls[0] += 1
  if (jax.process_index() == int(os.environ.get("BUG_PROCESS", "1"))
      and _calls[0] >= int(os.environ.get("BUG_AFTER", "150"))):
    raise ZeroDivisionError("an environment's bug on one process")
  return await _step(self, action)


guess_number.GuessNumber.step = step

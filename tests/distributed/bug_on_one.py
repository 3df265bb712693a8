"""For `env.imports`: one process of a multi-process run (`BUG_PROCESS`, default 1)
meets an error of its own. `BUG_IN=env` (the default): guess_number's step raises a
bug from its `BUG_AFTER`-th call on (default 150: a few steps in), as an environment's
own bug would, while that process's episodes play. `BUG_IN=records`: the write of step
`BUG_STEP`'s trajectories fails once, the disk full (after the step's update).
`BUG_IN=batch`: packing step `BUG_STEP`'s batch raises a bug (before the step's
collectives)."""

import errno
import os
import sys

from envs import guess_number

_step = guess_number.GuessNumber.step
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


guess_number.GuessNumber.step = step

_train = sys.modules.get("jaxagent.training_run")  # (the trainer's loop, where it runs)
if os.environ.get("BUG_IN") == "records" and _train is not None:
  _dump, _failed = _train.dump_segments, []

  def dump_segments(path, segments, step=None, *args):
    if _here() and step == int(os.environ["BUG_STEP"]) and not _failed:
      _failed.append(step)
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    return _dump(path, segments, step, *args)

  _train.dump_segments = dump_segments

if os.environ.get("BUG_IN") == "batch" and _train is not None:
  _pack, _packs = _train.pack_groups, [0]

  def pack_groups(*args, **kwargs):
    _packs[0] += 1
    if _here() and _packs[0] == int(os.environ["BUG_STEP"]):
      raise IndexError("a bug packing one process's batch")
    return _pack(*args, **kwargs)

  _train.pack_groups = pack_groups

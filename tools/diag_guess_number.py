"""Diagnostic: can the tiny model represent bisection in guess_number's token format?

Plays optimal (bisecting) episodes through the real white-box loop, trains on
them with the learner (REINFORCE with advantage 1, i.e. supervised on the
actions), and measures greedy success with the real engine every few steps.

  python tools/diag_guess_number.py [--steps 200] [--lr 3e-3]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import jax
import numpy as np

from envs.base import make
from envs.guess_number import make_tasks
from jaxagent.agent import run_whitebox
from jaxagent.batch import pack
from jaxagent.config import AgentConfig, LearnerConfig
from jaxagent.learner import Learner
from jaxagent.models import preset
from jaxagent.models.sharding import make_mesh
from jaxagent.tokenizer import Tokenizer
from jaxagent.trajectory import TurnRecord
from rollout_server.client import LocalClient
from rollout_server.engine import Engine
from rollout_server.orchestrator import Orchestrator

TOK = Tokenizer.byte_level()
AGENT = AgentConfig(max_turns=5, max_new_tokens=2, temperature=1.0)


class Oracle:
  """An 'engine' that answers with the environment's bisecting move."""

  def __init__(self, env):
    self.env = env

  async def generate(self, prompt_ids, sampling, session_id=None):
    ids = TOK.encode(self.env.reference_action()) + [TOK.stop_ids[0]]
    return TurnRecord(list(prompt_ids), ids, [0.0] * len(ids), [0] * len(ids), "stop")


async def expert_segments(tasks):
  segs = []
  for i, task in enumerate(tasks):
    env = make("guess_number")
    ep = await run_whitebox(env, task, Oracle(env), TOK, AGENT, session_id=f"x{i}")
    for s in ep.segments:
      s.advantages = s.loss_mask.copy()
      segs.append(s)
  return segs


async def greedy_success(engine, params, tasks) -> float:
  orch = Orchestrator(engine, engine.load_params(params)).start()
  client = LocalClient(orch, engine)
  cfg = AgentConfig(max_turns=5, max_new_tokens=2, temperature=0.0)
  eps = await asyncio.gather(*(run_whitebox(make("guess_number"), t, client, TOK, cfg,
                                            session_id=f"e{i}") for i, t in enumerate(tasks)))
  orch.stop()
  return float(np.mean([e.success for e in eps]))


def main():
  p = argparse.ArgumentParser(
      allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--batch", type=int, default=32)
  args = p.parse_args()
  cfg = preset("tiny")
  train_tasks = make_tasks(512, seed=1)
  eval_tasks = make_tasks(64, seed=2)
  segs = asyncio.run(expert_segments(train_tasks))
  learner = Learner(cfg, LearnerConfig(lr=args.lr, policy_loss="reinforce"), make_mesh())
  state = learner.init_state(0)
  engine = Engine(cfg, max_concurrent_decodes=64, max_prefill_length=128, max_seq_len=160)
  rng = np.random.default_rng(0)
  t0 = time.time()
  for step in range(1, args.steps + 1):
    pick = rng.choice(len(segs), args.batch, replace=False)
    batch, _ = pack([segs[i].to_training() for i in pick], args.batch, 128)
    state, m = learner.step(state, batch)
    if step % 25 == 0 or step == args.steps:
      acc = asyncio.run(greedy_success(engine, jax.device_get(state.params), eval_tasks))
      print(f"step {step}: loss {float(m['loss']):.4f} greedy success {acc:.3f} "
            f"({time.time() - t0:.0f}s)", flush=True)


if __name__ == "__main__":
  main()

"""Chaos: a rollout server process is killed (SIGKILL) while episodes are being played
through the router. No episode is lost, restarted or scored 0, and every token is the
one an undisturbed run samples."""

import asyncio
import contextlib
import signal

import httpx
import numpy as np
import pytest

from envs.base import TaskSpec, make
from jaxagent.agent import run_whitebox
from jaxagent.config import AgentConfig
from jaxagent.tokenizer import Tokenizer
from rollout_server.client import HttpClient
from rollout_server.router import create_router
from rollout_server.routing import HashRing
from rollout_server.serving import ServerThread
from tests.rollout_server.test_cli import free_port
from tests.rollout_server.test_router import _start_server_process, _wait_healthy

CFG = AgentConfig(max_turns=6, max_new_tokens=12, temperature=1.0, turn_deadline_s=60,
                  episode_deadline_s=300)
EPISODES = 8


class Counting:
  """An HttpClient that calls `hook` after its `at`-th answered turn."""

  def __init__(self, url, at=None, hook=None):
    self.client, self.at, self.hook, self.answered = HttpClient(url, timeout_s=120), at, hook, 0

  async def generate(self, *args, **kw):
    out = await self.client.generate(*args, **kw)
    self.answered += 1
    if self.answered == self.at:
      self.hook()
    return out


async def play_all(url, session_ids, kill_at=None, kill=None):
  engine = Counting(url, kill_at, kill)
  tok = Tokenizer.byte_level()

  async def one(i, sid):
    task = TaskSpec(f"t{i}", "guess_number", {"secret": 40 + i, "high": 64, "max_turns": 6})
    return await run_whitebox(make("guess_number"), task, engine, tok, CFG, session_id=sid,
                              group_id="g")

  try:
    return await asyncio.gather(*(one(i, sid) for i, sid in enumerate(session_ids)))
  finally:
    await engine.client.aclose()


@pytest.mark.slow
def test_killing_a_server_mid_run_loses_no_episode_and_changes_no_token():
  ports = [free_port(), free_port()]
  urls = [f"http://127.0.0.1:{p}" for p in ports]
  procs = [_start_server_process(p) for p in ports]
  try:
    for url, proc in zip(urls, procs):
      _wait_healthy(url, proc)
    ring = HashRing(urls)
    # Half the sessions live on the server that will be killed.
    on = {u: [f"chaos-{i}" for i in range(200) if ring.candidates(f"chaos-{i}")[0] == u]
          for u in urls}
    sids = on[urls[0]][:EPISODES // 2] + on[urls[1]][:EPISODES // 2]
    with ServerThread(create_router(urls, health_interval_s=0.5)) as router:
      calm = asyncio.run(play_all(router.url, sids))
      # A quarter into the run, with turns in flight on both servers: kill -9 one.
      stormy = asyncio.run(play_all(router.url, sids, kill_at=EPISODES * CFG.max_turns // 4,
                                    kill=lambda: procs[0].send_signal(signal.SIGKILL)))
      health = httpx.get(f"{router.url}/router/health").json()
    assert procs[0].wait(timeout=10) == -signal.SIGKILL
    assert health["failovers"] >= 1  # the kill hit requests in flight or about to go there
    for a, b in zip(calm, stormy):
      assert not b.infra_error and b.status == a.status, (b.status, b.reason)
      assert b.turn_rewards == a.turn_rewards and b.verdict == a.verdict
      (sa,), (sb,) = a.segments, b.segments
      np.testing.assert_array_equal(sa.tokens, sb.tokens)
      np.testing.assert_allclose(sa.rollout_logp, sb.rollout_logp, atol=1e-5)
    assert sum(len(e.segments[0].tokens) for e in stormy) > EPISODES * 50
  finally:
    for p in procs:
      with contextlib.suppress(Exception):
        p.kill()
        p.wait(timeout=30)

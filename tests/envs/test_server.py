"""The environment worker service against a real server on a loopback port."""

import asyncio
import json

import httpx
import pytest

from envs import base
from envs.base import EnvResources, TaskSpec, VerdictStatus
from envs.server import RemoteEnv, SessionLost, create_app
from rollout_server.serving import ServerThread


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


@pytest.fixture(scope="module")
def worker():
  resources = EnvResources(sandboxes=2)
  app = create_app(resources, max_sessions=4, max_concurrent_calls=2, deadline_s=1.5)
  with ServerThread(app) as srv:
    yield srv
  resources.close()


def test_remote_episode_matches_in_process(worker):
  async def go():
    env = RemoteEnv(worker.url)
    obs = await env.reset(TaskSpec("g", "guess_number", {"secret": 4}))
    r1 = await env.step("8")
    r2 = await env.step("4")
    verdict = await env.verify()
    await env.aclose()
    return obs, r1, r2, verdict

  obs, r1, r2, verdict = asyncio.run(go())
  assert obs.messages[0]["content"].startswith("Guess my number")
  assert r1.observation.messages[0]["content"] == "Lower." and not r1.terminated
  assert r2.terminated and r2.reward == 0.0
  assert verdict.status == VerdictStatus.PASS and verdict.env_version == "guess_number@2" and verdict.reward == 1.0


def test_python_tests_over_the_service(worker):
  async def go():
    env = RemoteEnv(worker.url)
    await env.reset(TaskSpec("p", "python_tests", {"task": "is_even"}))
    call = json.dumps({"name": "write_file", "arguments": {
        "path": "solution.py", "content": "def is_even(n):\n    return n % 2 == 0\n"}})
    await env.step(f"<tool_call>{call}</tool_call>")
    await env.step("DONE")
    verdict = await env.verify()
    await env.aclose()
    return verdict

  assert asyncio.run(go()).status == VerdictStatus.PASS


def test_lost_session_is_a_clear_error_not_a_hang(worker):
  async def go():
    env = RemoteEnv(worker.url)
    await env.reset(TaskSpec("g", "guess_number", {"secret": 4}))
    httpx.delete(f"{worker.url}/sessions/{env.session_id}")  # the worker loses it
    with pytest.raises(SessionLost, match="no session"):
      await env.step("4")
    await env.aclose()

  asyncio.run(asyncio.wait_for(go(), timeout=30))


def test_deadline_closes_the_session(worker):
  async def go():
    env = RemoteEnv(worker.url)
    await env.reset(TaskSpec("s", "slow_test_env"))
    with pytest.raises(RuntimeError, match="504.*deadline"):
      await env.step("5")
    with pytest.raises(SessionLost):
      await env.step("0")
    await env.aclose()

  asyncio.run(asyncio.wait_for(go(), timeout=30))
  assert httpx.get(f"{worker.url}/health").json()["status"] == "ok"


def test_bad_requests_and_limits(worker):
  c = httpx.Client(base_url=worker.url, timeout=30)
  r = c.post("/sessions", json={"task": {"id": "x", "env": "chess"}})
  assert r.status_code == 400 and "unknown environment 'chess'" in r.text
  r = c.post("/sessions", json={"task": {"id": "x"}})
  assert r.status_code == 400 and "env" in r.text
  r = c.post("/sessions", json={"task": {"id": "x", "env": "python_tests",
                                         "params": {"task": "nope"}}})
  assert r.status_code == 400 and "nope" in r.text
  r = c.post("/sessions", json={"tusk": {}})
  assert r.status_code == 422
  ids = [c.post("/sessions", json={"task": {"id": f"g{i}", "env": "guess_number"}}).json()
         for i in range(4)]
  r = c.post("/sessions", json={"task": {"id": "g5", "env": "guess_number"}})
  assert r.status_code == 503 and "session limit" in r.text
  for s in ids:
    if "session_id" in s:
      c.delete(f"/sessions/{s['session_id']}")
  text = c.get("/metrics").text
  assert "env_sessions" in text and 'env_calls_total{kind="step",outcome="deadline"}' in text


def test_concurrency_cap_queues_calls(worker):
  import time

  async def one():
    env = RemoteEnv(worker.url)
    await env.reset(TaskSpec("s", "slow_test_env"))
    await env.step("1.0")
    await env.aclose()

  async def go():
    t0 = time.perf_counter()
    await asyncio.gather(one(), one(), one())  # cap is 2 calls at once
    return time.perf_counter() - t0

  assert asyncio.run(go()) >= 1.9

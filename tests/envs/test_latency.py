"""`envs.base.Latency` / `WithLatency`: made-up step times for benchmarks of asynchrony."""

import asyncio
import math
import statistics
import time

import pytest

from envs.base import Latency, TaskSpec, WithLatency, make


def test_lognormal_latency_has_its_median_and_cap():
  lat = Latency("lognormal", median_s=0.05, sigma=1.5, max_s=2.0, seed=1)
  draws = [lat.sampler(str(i))() for i in range(4000)]
  assert max(draws) <= 2.0 and min(draws) > 0
  assert 0.04 < statistics.median(draws) < 0.06
  # A heavy tail: the 99th percentile is tens of times the median (33x uncapped).
  p99 = sorted(draws)[int(0.99 * len(draws))]
  assert 15 < p99 / statistics.median(draws) < 45
  # Seeded per episode key: the same key draws the same times.
  a, b = lat.sampler("ep-7"), lat.sampler("ep-7")
  assert [a() for _ in range(5)] == [b() for _ in range(5)]
  assert Latency("constant", median_s=0.3, max_s=0.1).sampler("x")() == 0.1


def test_unknown_distribution_is_named():
  with pytest.raises(ValueError, match="unknown 'pareto'"):
    Latency("pareto")
  with pytest.raises(ValueError, match=">= 0"):
    Latency("constant", median_s=-1)


def test_with_latency_waits_each_step_and_is_the_wrapped_env():
  async def go():
    env = WithLatency(make("guess_number"), Latency("constant", median_s=0.05), key="k")
    task = TaskSpec("t1", "guess_number", {"secret": 3, "low": 1, "high": 8})
    await env.reset(task)
    t0 = time.perf_counter()
    r1 = await env.step("5")
    r2 = await env.step("3")
    waited = time.perf_counter() - t0
    verdict = await env.verify()
    await env.close()
    return env, r1, r2, waited, verdict

  env, r1, r2, waited, verdict = asyncio.run(go())
  assert waited >= 0.1 and math.isclose(env.slept_s, 0.1)
  assert "Lower" in r1.observation.messages[0]["content"] and r2.terminated
  assert verdict.status.value == "pass" and verdict.reward == 1.0
  assert env.turns == 2 and env.done and env.name == "guess_number"
  assert env.versions()["env"] == "guess_number@2"

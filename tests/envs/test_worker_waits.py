"""An environment worker's waits against real servers on loopback ports: the run's own
load (a queue for a turn under the call cap, a sandbox slot, the source checks, a
served judge) makes a call slower, never a 504 or a 503 that re-rolls the episode, and
a client waits for as long as its worker says the call runs."""
import asyncio
import json
import re
import time

import httpx
import pytest

from envs import base, waits
from envs.base import EnvResources, TaskSpec, VerdictStatus
from envs.server import RemoteEnv, create_app
from jaxagent.errors import InfraError
from rollout_server.serving import ServerThread
from tests.envs.worker_envs import SlowEnv, needs_isolation


def _status(e: Exception) -> str:
  m = re.search(r": (\d{3}): ", str(e))
  return m.group(1) if m else str(e)


def test_the_deadline_bounds_the_work_and_not_the_wait_for_a_turn():
  """Other calls' load must not turn a call's bounded work into a 504 (its episode
  dropped instead of scored): the deadline counts a call's own time; the wait for a
  turn under the call cap is waited on while calls keep ending (the run's own load; a
  503 after one deadline re-rolled a crowded worker's episodes: red team 34), and is a
  503, the call unrun, only when no call ended for a deadline (stuck)."""
  app = create_app(EnvResources(sandboxes=1), max_sessions=8, max_concurrent_calls=1,
                   deadline_s=1.5, stuck_s=1.5)

  async def step(env, action, after=0.0):
    await asyncio.sleep(after)
    try:
      result = await env.step(action)
      assert result.terminated
      return "ok", env.infra_wait_s
    except RuntimeError as e:
      return _status(e), None

  with ServerThread(app) as srv:
    async def go():
      envs = [RemoteEnv(srv.url) for _ in range(6)]
      for env in envs[:4] + envs[5:]:
        await env.reset(TaskSpec("s", "slow_test_env"))
      await envs[4].reset(TaskSpec("c", "long_command_test_env"))
      # One call at a time: the second waits ~1 s for its turn and then works 1 s (2 s
      # in all, past the 1.5 s deadline, but its own time is inside it); the third
      # waits ~1.8 s, past a deadline, while calls end; alone, a call that works 2 s
      # is cut.
      out = await asyncio.gather(step(envs[0], "1.0"), step(envs[1], "1.0", 0.1),
                                 step(envs[2], "0.1", 0.2))
      out.append(await step(envs[3], "2.0"))
      # A command of 3 s holds the only turn (its time is the policy's, not cut): no
      # call ends for a deadline, and the call waiting for a turn is refused.
      out += await asyncio.gather(step(envs[4], "3.0"), step(envs[5], "0.1", 0.2))
      for env in envs:
        await env.aclose()
      return out

    first, second, third, alone, held, stuck = asyncio.run(asyncio.wait_for(go(), timeout=30))
  assert first[0] == "ok" and first[1] < 0.3
  assert second[0] == "ok" and 0.6 < second[1] < 1.4
  assert third[0] == "ok" and 1.5 < third[1] < 2.6, third
  assert alone == ("504", None) and held[0] == "ok" and stuck == ("503", None), (held, stuck)


def test_a_reset_waits_one_deadline_for_a_turn_and_the_stuck_window_has_a_floor():
  """A reset waits at most one deadline for a turn, as before, whatever moves (its
  client's patience is fixed: queued past it, a start read as the worker's timeout; red
  team 35), and a step's stuck window is at least STUCK_FLOOR_S (a grading run and its
  kill outlast a short deadline: a looping solution's grading made a sibling a 503)."""
  from envs.server import STUCK_FLOOR_S

  app = create_app(EnvResources(sandboxes=1), max_concurrent_calls=1, deadline_s=1.0)

  async def go(url):
    busy, late, behind = RemoteEnv(url), RemoteEnv(url), RemoteEnv(url)
    await busy.reset(TaskSpec("c", "long_command_test_env"))
    await behind.reset(TaskSpec("s", "slow_test_env"))
    held = asyncio.ensure_future(busy.step("2.5"))  # (nothing else moves meanwhile)
    await asyncio.sleep(0.2)
    waiting = asyncio.ensure_future(behind.step("0.1"))  # (2.3 s for its turn)
    t0 = time.perf_counter()
    with pytest.raises(InfraError, match="503.*reset waited 1s for a turn"):
      await late.reset(TaskSpec("s", "slow_test_env"))
    refused_after = time.perf_counter() - t0
    await held
    answered = (await waiting).terminated
    for env in (busy, behind):
      await env.aclose()
    return refused_after, answered

  with ServerThread(app) as srv:
    refused_after, answered = asyncio.run(asyncio.wait_for(go(srv.url), timeout=30))
  assert 0.9 < refused_after < 2.0 and answered, refused_after
  assert STUCK_FLOOR_S >= 30.0  # (a grading run's 20 s and its kill)


def test_a_client_waits_as_long_as_its_worker_may_take():
  """A worker with a long deadline says how long a call may take there (`call_wall_s`)
  and its clients wait that long: a call within the worker's deadline is answered, not
  given up by the client as an infrastructure failure (the client's own timeout was a
  fixed 180 s, below a call's bound for workers started with a deadline over 90 s)."""
  app = create_app(EnvResources(sandboxes=1), deadline_s=2.0)
  url = None
  with ServerThread(app) as srv:
    url = srv.url
    assert httpx.get(f"{srv.url}/health").json()["call_wall_s"] == 4.0

    async def go():
      RemoteEnv._call_walls.pop(srv.url, None)
      env = RemoteEnv(srv.url, timeout_s=0.5)
      try:
        await env.reset(TaskSpec("s", "slow_test_env"))  # learns the worker's bound
        result = await env.step("1.0")  # past the client's 0.5 s, within the worker's 2 s
        fresh = RemoteEnv(srv.url, timeout_s=0.5)  # a new client of the same worker knows
        await fresh.reset(TaskSpec("s", "slow_test_env"))
        await fresh.step("1.0")
        await fresh.aclose()
        verdict = await env.verify()
        return result, verdict
      finally:
        await env.aclose()

    result, verdict = asyncio.run(asyncio.wait_for(go(), timeout=30))
  assert result.terminated and verdict.status == VerdictStatus.FAIL
  assert RemoteEnv._call_walls.pop(url) == 4.0


@needs_isolation
def test_waiting_for_a_sandbox_slot_is_not_charged_to_the_deadline():
  """Two python_tests sessions on a worker with one execution slot: the second's command
  waits for the first's, then runs; neither is cut, and the wait is reported."""
  resources = EnvResources(sandboxes=1)
  app = create_app(resources, max_sessions=8, deadline_s=3.0)
  action = '<tool_call>{"name": "run_python", "arguments": {"code": ' \
           '"import time; time.sleep(2.0); print(7)"}}</tool_call>'

  async def one(url, after):
    await asyncio.sleep(after)
    env = RemoteEnv(url)
    await env.reset(TaskSpec("p", "python_tests", {"task": "add"}))
    try:
      t0 = time.perf_counter()
      result = await env.step(action)
      return (json.loads(result.observation.messages[0]["content"])["stdout"].strip(),
              env.infra_wait_s, time.perf_counter() - t0)
    finally:
      await env.aclose()

  with ServerThread(app) as srv:
    async def go():
      return await asyncio.gather(one(srv.url, 0.0), one(srv.url, 0.3))

    first, second = asyncio.run(asyncio.wait_for(go(), timeout=60))
    # A command that gets no slot in time: the infrastructure's failure (503), which
    # the client raises as such; it never reaches the policy as a tool output.
    resources.pool().slot_timeout_s = 0.5
    with pytest.raises(InfraError, match="503.*no execution slot"):
      asyncio.run(asyncio.wait_for(go(), timeout=60))
  assert first[0] == second[0] == "7"
  assert second[1] > 1.0 and second[2] > 3.0  # past the deadline in wall time, not cut


@base.register("crowded_test_env")
class CrowdedEnv(SlowEnv):
  """A step that waits in a sandbox pool's queue, then runs a command of the policy's,
  for the two times its action says (`"queue command"`)."""

  async def step(self, action):
    queue, command = map(float, action.split())
    with waits.waiting(), waits.queued():
      await asyncio.sleep(queue)
    with waits.commanding():
      await asyncio.sleep(command)
    return base.StepResult(base.Observation([]), 0.0, True, False)


def test_a_crowded_pools_queue_and_the_policys_commands_do_not_spend_the_wall(monkeypatch):
  """Red team 34: a step's commands and its wait in a sandbox pool's queue (the run's
  own load: the pool frees slots) counted toward the worker's wall, so a turn of long
  commands on a crowded worker was a 504, an infrastructure error, its episode re-rolled
  instead of scored. They make a call slower now, not cut, and the client waits past
  the worker's wall while the worker says the call runs. A plain wait still counts."""
  monkeypatch.setattr("envs.server.CALL_MARGIN_S", 0.3)
  app = create_app(EnvResources(sandboxes=1), deadline_s=1.0)  # a 2 s wall

  async def go(url):
    RemoteEnv._call_walls.pop(url, None)
    env = RemoteEnv(url, timeout_s=0.3)
    out = []
    try:
      # Each past the wall and the client's 2.3 s by one of the two alone.
      for action in ("2.5 0.1", "0.1 2.5"):
        await env.reset(TaskSpec("w", "crowded_test_env"))
        t0, waited = time.perf_counter(), env.infra_wait_s
        result = await env.step(action)
        out.append((result.terminated, time.perf_counter() - t0, env.infra_wait_s - waited))
      await env.reset(TaskSpec("w", "waiting_test_env"))
      with pytest.raises(InfraError, match="504"):
        await env.step("3")  # (a wait of another kind: cut at the wall)
      return out
    finally:
      await env.aclose()

  with ServerThread(app) as srv:
    queue, command = asyncio.run(asyncio.wait_for(go(srv.url), timeout=30))
  assert queue[0] and 2.5 < queue[1] < 5.0 and 2.3 < queue[2] < 3.0, queue
  assert command[0] and 2.5 < command[1] < 5.0 and command[2] < 0.5, command


def test_a_call_whose_client_went_away_is_cancelled_and_its_session_closed():
  """The wall no longer bounds a call's queue and commands: a call whose client gave up
  (an agent's episode cut, a learner gone) held its turn under the cap and its sandbox
  slot until a DELETE that may never come (a reviewer). It is cancelled, and its
  session closed, when its client goes away."""
  app = create_app(EnvResources(sandboxes=1), deadline_s=1.0)
  with ServerThread(app) as srv:
    sid = httpx.post(f"{srv.url}/sessions", json={"task": {
        "id": "w", "env": "crowded_test_env"}}).json()["session_id"]
    t0 = time.perf_counter()
    with pytest.raises(httpx.ReadTimeout):
      httpx.post(f"{srv.url}/sessions/{sid}/step", json={"action": "30 0"}, timeout=0.5)
    while (httpx.get(f"{srv.url}/sessions/{sid}/waits").status_code != 404
           and time.perf_counter() - t0 < 10):
      time.sleep(0.1)
    closed_after = time.perf_counter() - t0
    metrics = httpx.get(f"{srv.url}/metrics").text
  assert closed_after < 3.0, closed_after
  assert 'env_calls_total{kind="step",outcome="abandoned"} 1.0' in metrics


def _hung_worker(waits_answer, steps: dict) -> RemoteEnv:
  """A client of a fake worker (at http://w, its wall 0.2 s) whose steps never answer:
  `waits_answer()` answers each GET /sessions/{id}/waits; `steps` counts the steps
  started and cancelled."""
  async def worker(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/sessions":
      return httpx.Response(200, json={"session_id": "s1", "observation": {"messages": []},
                                       "call_wall_s": 0.2})
    if request.url.path.endswith("/waits"):
      return waits_answer()
    steps["started"] = steps.get("started", 0) + 1
    try:
      await asyncio.sleep(30)
    except asyncio.CancelledError:
      steps["cancelled"] = steps.get("cancelled", 0) + 1
      raise
    return httpx.Response(500)

  RemoteEnv._call_walls.pop("http://w", None)
  return RemoteEnv("http://w", timeout_s=0.1,
                   client=httpx.AsyncClient(transport=httpx.MockTransport(worker)))


def test_a_new_sessions_calls_are_counted_from_its_own_first():
  """A call that ended as its client cut it (its answer never counted) keeps the waits
  its worker says; one whose answer was counted says them no more. The count is the
  session's: a client that played five calls in its last session and then cut its new
  session's first call read that call as counted (its 3 s wait taken for the policy's
  own time)."""
  sessions = iter(["s1", "s2"])

  async def worker(request: httpx.Request) -> httpx.Response:
    path = request.url.path
    if path == "/sessions":
      return httpx.Response(200, json={"session_id": next(sessions),
                                       "observation": {"messages": []}})
    if path == "/sessions/s1/step":
      return httpx.Response(200, json={
          "observation": {"messages": []}, "reward": 0.0, "terminated": False,
          "truncated": False, "info": {}, "call": 5})
    if path == "/sessions/s2/waits":  # (its first call ended, its answer not counted)
      return httpx.Response(200, json={"running": False, "call": 1, "infra_wait_s": 3.0,
                                       "infra_held_s": 0.5})
    if path == "/sessions/s1/waits":  # (its fifth call's answer was counted)
      return httpx.Response(200, json={"running": False, "call": 5, "infra_wait_s": 3.0})
    return httpx.Response(200, json={})  # (DELETE)

  async def go():
    env = RemoteEnv("http://w2", client=httpx.AsyncClient(
        transport=httpx.MockTransport(worker)))
    await env.reset(TaskSpec("s", "slow_test_env"))
    await env.step("1")
    counted = await env.in_flight_waits()
    await env.reset(TaskSpec("s", "slow_test_env"))
    return counted, await env.in_flight_waits()

  counted, cut = asyncio.run(asyncio.wait_for(go(), timeout=10))
  assert counted == (0.0, 0.0) and cut == (3.0, 0.5), (counted, cut)


def test_a_client_gives_up_on_a_call_its_worker_does_not_say_runs(monkeypatch):
  """Past its patience (the worker's wall and a margin), a client asks the worker
  whether the session's call still runs: a worker that lost it, or cannot say, is the
  infrastructure's failure (the client waited on it for ever otherwise)."""
  monkeypatch.setattr("envs.server.CALL_MARGIN_S", 0.2)
  asks = []

  def waits_answer():
    asks.append(time.perf_counter())
    return httpx.Response(200, json={"running": len(asks) < 3, "call": 1})

  async def go():
    env = _hung_worker(waits_answer, {})
    await env.reset(TaskSpec("s", "slow_test_env"))
    t0 = time.perf_counter()
    with pytest.raises(InfraError, match="does not say that the call still runs"):
      await env.step("1")
    return time.perf_counter() - t0

  took = asyncio.run(asyncio.wait_for(go(), timeout=10))
  RemoteEnv._call_walls.pop("http://w", None)
  # (asked at each 0.4 s of patience; on its third "not running", 0.2 s more for the
  # answer; then once more as it gives up, for what the call waited)
  assert len(asks) == 4 and 1.2 < took < 3.0, (asks, took)


@pytest.mark.parametrize("status", [404, 401, 500])
def test_a_worker_that_cannot_say_a_call_runs_is_not_waited_on(monkeypatch, status):
  """A worker that restarted (404: no such session), refuses the token (401) or fails
  (500) when asked whether the call runs is not waited on for ever; and a client whose
  caller gives up (an episode's deadline) cancels its request."""
  monkeypatch.setattr("envs.server.CALL_MARGIN_S", 0.2)
  steps: dict = {}

  async def go():
    env = _hung_worker(lambda: httpx.Response(status, json={"detail": "no"}), steps)
    await env.reset(TaskSpec("s", "slow_test_env"))
    with pytest.raises(InfraError, match="does not say that the call still runs"):
      await env.step("1")
    await asyncio.sleep(0.05)
    given_up = dict(steps)
    with pytest.raises(asyncio.TimeoutError):  # (the caller's own deadline)
      await asyncio.wait_for(env.step("1"), 0.2)
    await asyncio.sleep(0.05)
    return given_up, dict(steps)

  given_up, cut = asyncio.run(asyncio.wait_for(go(), timeout=10))
  RemoteEnv._call_walls.pop("http://w", None)
  assert given_up == {"started": 1, "cancelled": 1} and cut == {"started": 2, "cancelled": 2}, \
      (given_up, cut)


def _sleeps(seconds: float) -> str:
  """A run_python tool call that sleeps `seconds` (a command of the policy's)."""
  return "<tool_call>" + json.dumps({"name": "run_python", "arguments": {
      "code": f"import time; time.sleep({seconds})"}}) + "</tool_call>"


async def _exit_codes(url: str, turn: str, after: float, timeout_s: float = 180.0):
  """A python_tests session on the worker at `url` that plays `turn` `after` seconds past
  its start: its commands' exit codes, or the text of the InfraError it ended in."""
  env = RemoteEnv(url, timeout_s=timeout_s)
  await env.reset(TaskSpec("p", "python_tests", {"task": "add"}))
  await asyncio.sleep(after)
  try:
    result = await env.step(turn)
    return [json.loads(m["content"]).get("exit_code") for m in result.observation.messages]
  except InfraError as e:
    return str(e)
  finally:
    await env.aclose()


@needs_isolation
def test_a_queue_for_the_one_sandbox_slot_past_the_wall_is_answered(monkeypatch):
  """Four sessions' 1.6 s commands on one slot, started 0.3 s apart: the last waits
  past the worker's 3 s wall in the pool's queue alone (a reviewer: the other tests
  passed with the queue counted), and every step is answered."""
  from envs.isolation import Limits

  monkeypatch.setattr("envs.server.CALL_MARGIN_S", 0.5)
  resources = EnvResources(sandboxes=1, sandbox_limits=Limits(wall_s=2.0))
  app = create_app(resources, deadline_s=1.5)
  turn = _sleeps(1.6)

  async def one(url, after, envs):
    env = RemoteEnv(url, timeout_s=0.5)
    await env.reset(TaskSpec("p", "python_tests", {"task": "add"}))
    envs.append(env)
    while len(envs) < 4:  # (all started before the first command)
      await asyncio.sleep(0.01)
    await asyncio.sleep(after)
    try:
      result = await env.step(turn)
      return json.loads(result.observation.messages[0]["content"]).get("exit_code"), \
          env.infra_wait_s
    finally:
      await env.aclose()

  with ServerThread(app) as srv:
    async def go():
      envs = []
      return await asyncio.gather(*(one(srv.url, 0.3 * i, envs) for i in range(4)))

    out = asyncio.run(asyncio.wait_for(go(), timeout=60))
  resources.close()
  assert [code for code, _ in out] == [0] * 4 and max(w for _, w in out) > 3.0, out


@needs_isolation
def test_a_turn_of_long_commands_on_a_crowded_worker_is_answered(monkeypatch):
  """Red team 34 with real sandboxes: one turn of three 1.2 s commands (3.6 s, past a
  3 s wall) and another session's command queued behind them on the one slot were both
  504s, re-rolled instead of scored. Both are answered."""
  from envs.isolation import Limits

  monkeypatch.setattr("envs.server.CALL_MARGIN_S", 0.5)
  resources = EnvResources(sandboxes=1, sandbox_limits=Limits(wall_s=2.0))
  app = create_app(resources, deadline_s=1.5)

  sleep = _sleeps(1.2)
  with ServerThread(app) as srv:
    async def go():
      return await asyncio.gather(_exit_codes(srv.url, sleep * 3, 0.0, timeout_s=0.5),
                                  _exit_codes(srv.url, sleep, 0.3, timeout_s=0.5))

    long_turn, queued = asyncio.run(asyncio.wait_for(go(), timeout=60))
  resources.close()
  assert long_turn == [0, 0, 0] and queued == [0], (long_turn, queued)


def test_a_workers_waits_are_the_infrastructures_time_at_an_episode_deadline():
  """A step that waits on the worker's load (here a marked wait; in a worker, a sandbox
  slot) past the episode's deadline: the agent asks the worker how long the running
  call waited, and a wait does not spend the episode's budget (as in process): the
  episode goes on and is graded, instead of its wait being scored as the policy's slow
  tool call."""
  from jaxagent.agent import run_whitebox
  from jaxagent.config import AgentConfig
  from tests.test_agent import TOK, ScriptedEngine

  app = create_app(EnvResources(sandboxes=1), deadline_s=10.0)
  config = AgentConfig(max_turns=2, max_new_tokens=4, episode_deadline_s=1.5)
  with ServerThread(app) as srv:
    ep = asyncio.run(run_whitebox(RemoteEnv(srv.url), TaskSpec("w", "waiting_test_env"),
                                  ScriptedEngine(["3.0"]), TOK, config, session_id="b",
                                  group_id="g"))
  assert not ep.infra_error and ep.verdict["status"] == "fail", ep.reason
  assert ep.infra_wait_s > 2.5 and ep.env_s < 1.0


def test_a_grading_queued_on_a_worker_is_graded():
  """A remote verify queued behind the worker's crowd past EPISODE_WALL_FACTOR episode
  deadlines: the agent asks the worker what it waited and grades the episode (bounded in
  wall time, it was the verifier's infrastructure error, re-rolled)."""
  from jaxagent.agent import run_whitebox
  from jaxagent.config import AgentConfig
  from tests.test_agent import TOK, ScriptedEngine

  config = AgentConfig(max_turns=2, max_new_tokens=4, episode_deadline_s=0.6)
  task = TaskSpec("q", "queued_grading_test_env", {"wait_s": 2.5})
  with ServerThread(create_app(EnvResources(sandboxes=1), deadline_s=10.0)) as srv:
    ep = asyncio.run(run_whitebox(RemoteEnv(srv.url), task, ScriptedEngine(["0"]), TOK,
                                  config, session_id="q", group_id="g"))
  assert not ep.infra_error and ep.verdict["status"] == "fail", ep.reason


def test_the_waits_of_a_call_whose_answer_was_not_counted_are_reported():
  """An episode's deadline judged in the moment between the worker's call ending and its
  answer being counted (the answer then discarded with the cut call) asked the worker,
  which said the call was not running: its 3 s wait was lost and read as the policy's
  time (CI, under load). The worker numbers a session's calls; a call that ended whose
  answer the client has not counted still has its waits reported. (A worker that takes
  the run's environment token: the ask carries it, else its 401 read as no wait.)"""
  app = create_app(EnvResources(sandboxes=1), deadline_s=10.0, token="the-env-token")

  async def episode(url):
    env = RemoteEnv(url, token="the-env-token")
    try:
      await env.reset(TaskSpec("w", "waiting_test_env"))
      request = env._client.request

      async def slow_answer(*args, **kw):  # (the answer arrives, then is held here)
        r = await request(*args, **kw)
        if "/step" in args[1]:
          await asyncio.sleep(1.0)
        return r

      env._client.request = slow_answer
      call = asyncio.ensure_future(env.step("0.4"))
      await asyncio.sleep(0.8)  # (the worker's call ended; its answer not yet counted)
      in_flight = (await env.in_flight_waits())[0]
      call.cancel()  # (as an episode's deadline cuts it: that answer is never counted)
      with pytest.raises(asyncio.CancelledError):
        await call
      env._client.request = request
      await env.step("0.1")  # (answered and counted: not reported again)
      after = (await env.in_flight_waits())[0]
      return in_flight, after, env.infra_wait_s
    finally:
      await env.aclose()

  with ServerThread(app) as srv:
    in_flight, after, counted = asyncio.run(episode(srv.url))
  assert 0.35 < in_flight < 0.8 and after == 0.0 and 0.05 < counted < 0.4, \
      (in_flight, after, counted)


@needs_isolation
def test_a_slow_judge_is_the_infrastructures_wait_not_the_worker_calls_deadline():
  """A hard-coded table that passes the tests and that the judge FAILs, made slow in the
  grader: with the judge's time charged to the worker's 3 s call deadline, verify ran
  past it (504, an infrastructure error: the fail re-rolled, never trained; red team).
  The judge's time is a wait on shared infrastructure: the fail is scored."""
  from envs.base import Verdict

  class SlowJudge:  # a judge queued behind the run's rollouts: it FAILs the table
    async def confirm(self, verdict, task, answer):
      await asyncio.sleep(1.6)
      if verdict.status != VerdictStatus.PASS:
        return verdict
      return Verdict(VerdictStatus.FAIL, 0.0, verdict.env_version, verdict.verifier_version,
                     {"false_positive": True})

  from envs.python_tasks_data import TASKS
  cases = {args: expected for args, expected in next(t for t in TASKS if t[0] == "add")[4]}
  table = (f"T = {cases!r}\nimport time\nn = [0]\n"
           "def add(a, b):\n    n[0] += 1\n    if n[0] == len(T):\n        time.sleep(1.8)\n"
           "    return T[(a, b)]\n")

  async def episode(url):
    env = RemoteEnv(url)
    try:
      await env.reset(TaskSpec("t", "python_tests", {"task": "add"}))
      call = {"name": "write_file", "arguments": {"path": "solution.py", "content": table}}
      await env.step(f"<tool_call>{json.dumps(call)}</tool_call>")
      await env.step("DONE")
      return await env.verify()
    finally:
      await env.close()

  resources = EnvResources(sandboxes=1, judge=SlowJudge())
  with ServerThread(create_app(resources, deadline_s=3.0)) as srv:
    verdict = asyncio.run(episode(srv.url))
  assert verdict.status == VerdictStatus.FAIL and verdict.details["false_positive"]


@needs_isolation
def test_a_turn_waits_while_the_calls_ahead_run_commands(monkeypatch):
  """One call at a time: a turn of three 0.8 s commands holds the only turn past the
  1.5 s deadline while another session's call waits for it. Its commands end meanwhile
  (the worker moves): the waiting call is answered, not refused as stuck (at the
  defaults, 40 sessions' turns of four 9.5 s commands: every call of the worker's ended
  together after 2 minutes, and the 8 waiting for a turn were 503s, re-rolled)."""
  monkeypatch.setattr("envs.server.CALL_MARGIN_S", 0.5)
  resources = EnvResources(sandboxes=1)
  app = create_app(resources, max_concurrent_calls=1, deadline_s=1.5, stuck_s=1.5)
  sleep = _sleeps(0.8)
  with ServerThread(app) as srv:
    async def go():
      return await asyncio.gather(_exit_codes(srv.url, sleep * 3, 0.0),
                                  _exit_codes(srv.url, sleep, 0.3))

    ahead, waiting = asyncio.run(asyncio.wait_for(go(), timeout=60))
  resources.close()
  assert ahead == [0, 0, 0] and waiting == [0], (ahead, waiting)


def test_a_call_given_up_keeps_what_its_worker_said_it_waited(monkeypatch):
  """A worker closes the session of a call whose client went away, so an episode cut at
  its deadline that asked afterwards what the call waited read 0 (a CI failure): the
  client asks as it gives the call up, and answers that."""
  monkeypatch.setattr("envs.server.CALL_MARGIN_S", 0.2)
  steps: dict = {}
  state = {"gone": False}

  def waits_answer():
    if state["gone"]:
      return httpx.Response(404, json={"detail": "no session 's1'"})
    return httpx.Response(200, json={"running": True, "call": 1, "infra_wait_s": 2.5,
                                     "infra_held_s": 0.5})

  async def go():
    env = _hung_worker(waits_answer, steps)
    await env.reset(TaskSpec("s", "slow_test_env"))
    with pytest.raises(asyncio.TimeoutError):  # (the episode's deadline)
      await asyncio.wait_for(env.step("1"), 0.3)
    state["gone"] = True
    return await env.in_flight_waits(), await env.in_flight_waits()

  given_up, after = asyncio.run(asyncio.wait_for(go(), timeout=10))
  RemoteEnv._call_walls.pop("http://w", None)
  assert given_up == (2.5, 0.5) and after == (0.0, 0.0) and steps["cancelled"] == 1

"""The environment worker service against a real server on a loopback port."""

import asyncio
import json
import re
import socket
import time

import httpx
import pytest

from envs import base, waits
from envs.base import EnvResources, TaskSpec, VerdictStatus
from envs.server import RemoteEnv, SessionLost, create_app
from envs.isolation import available_isolations
from jaxagent.errors import InfraError
from rollout_server.serving import ServerThread

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
    if self.task.params.get("raise"):
      raise AttributeError("grader database down")
    self.counters["tool_calls"] += 2
    self.counters["tool_errors"] += 1
    return base.StepResult(base.Observation([]), 0.0, False, False, self._info())

  async def verify(self):
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


def test_a_reward_that_is_not_a_number_is_the_environments_bug_over_the_service(worker):
  """The worker's environment gave a NaN: BadReward at the client as in process (the run
  names the task), not a refused call of the client's ("a bug" of the learner)."""
  async def go():
    env = RemoteEnv(worker.url)
    try:
      await env.reset(TaskSpec("n", "nan_reward_test_env", {}))
      with pytest.raises(base.BadReward, match="a step's reward must be a finite number"):
        await env.step("x")
    finally:
      await env.aclose()

  asyncio.run(go())


def test_an_environments_bug_on_a_worker_is_named_not_the_infrastructures(worker):
  """An exception of the environment's own (not ValueError, KeyError or RuntimeError) was
  a 500, read as the infrastructure's: a misspelt verdict status was re-rolled 365 times
  until the run stopped blaming the workers (a new user). Now a 400 naming the line that
  raised; a bad status is BadReward at the client, as in process."""
  async def go(params, call):
    env = RemoteEnv(worker.url)
    try:
      await env.reset(TaskSpec("b", "buggy_test_env", params))
      return await call(env)
    finally:
      await env.aclose()

  with pytest.raises(RuntimeError, match=r"400: step failed: tests/envs/test_server.py:\d+: "
                     r"AttributeError: grader database down") as got:
    asyncio.run(go({"raise": True, "status": "fail"}, lambda env: env.step("x")))
  assert got.value.on_worker and not isinstance(got.value, InfraError)
  with pytest.raises(InfraError, match="503: step failed in the infrastructure: .*No space"):
    asyncio.run(go({"raise": "host", "status": "fail"}, lambda env: env.step("x")))
  with pytest.raises(base.BadReward, match="status must be a VerdictStatus.*'passs'"):
    asyncio.run(go({"status": "passs"}, lambda env: env.verify()))

  async def counted(env):  # (the environment's tool counters reach the episode too)
    await env.step("x")
    await env.step("x")
    return env.counters

  assert asyncio.run(go({"status": "fail"}, counted)) == {
      "tool_calls": 4, "invalid_tool_calls": 0, "tool_errors": 2}
  assert httpx.get(f"{worker.url}/health").json()["status"] == "ok"


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


def test_a_wrong_answer_padded_past_what_the_checks_read_fails_over_the_service(worker):
  """A wrong solution and a megabyte of short non-ASCII lines beside it (one tool call):
  the source checks read every file, each string again, about 5 s a MiB, which took the
  verify past the worker's deadline: a 504, an infrastructure error, a re-roll the
  policy could buy on every answer it doubted (red team 16). Past what the checks read
  (`MAX_CHECKED_CHARS`), the answer fails, at once."""
  pad = ("body = (\"'\\u00e9;'\\n\" * (1 << 17)).encode()\n"
         "for i in range(2):\n    open(f'pad{i}.py', 'wb').write(body)\n")

  async def go():
    env = RemoteEnv(worker.url)
    await env.reset(TaskSpec("p", "python_tests", {"task": "is_even"}))
    calls = [json.dumps({"name": "write_file", "arguments": {
        "path": "solution.py", "content": "def is_even(n):\n    return True\n"}}),
        json.dumps({"name": "run_python", "arguments": {"code": pad}})]
    await env.step("".join(f"<tool_call>{c}</tool_call>" for c in calls))
    await env.step("DONE")
    t0 = time.perf_counter()
    verdict = await env.verify()
    took = time.perf_counter() - t0
    await env.aclose()
    return verdict, took

  verdict, took = asyncio.run(go())
  assert verdict.status == VerdictStatus.FAIL and verdict.reward == 0.0
  assert "characters to check" in verdict.details.get("reason", ""), verdict.details
  assert took < 1.5, took


def test_a_solution_raising_a_lone_surrogate_fails_over_the_service(worker):
  """A wrong solution whose error holds a lone surrogate (`raise ValueError("\\ud800")`,
  or at import) made the worker's verdict unencodable as UTF-8: a 500, so an
  infrastructure error, so a wrong answer retried and dropped, never scored 0 (red-team)."""
  sources = ['def is_even(n):\n    raise ValueError("\\ud800 no idea")\n',
             'raise ImportError("\\udcff")\n']

  async def go(source):
    env = RemoteEnv(worker.url)
    await env.reset(TaskSpec("p", "python_tests", {"task": "is_even"}))
    call = json.dumps({"name": "write_file", "arguments": {"path": "solution.py",
                                                           "content": source}})
    await env.step(f"<tool_call>{call}</tool_call>")
    await env.step("DONE")
    verdict = await env.verify()
    await env.aclose()
    return verdict

  raised, unloaded = (asyncio.run(go(source)) for source in sources)
  assert raised.status == unloaded.status == VerdictStatus.FAIL
  assert raised.details["cases"]["0"] == "raised ValueError: \\ud800 no idea"
  assert unloaded.details["reason"] == "solution did not load: ImportError: \\udcff"


def test_lost_session_is_a_clear_error_not_a_hang(worker):
  async def go():
    env = RemoteEnv(worker.url)
    await env.reset(TaskSpec("g", "guess_number", {"secret": 4}))
    httpx.delete(f"{worker.url}/sessions/{env.session_id}")  # the worker loses it
    with pytest.raises(SessionLost, match="no session"):
      await env.step("4")
    await env.aclose()

  asyncio.run(asyncio.wait_for(go(), timeout=30))


def test_values_json_cannot_carry_are_a_wrong_answer_not_a_worker_error(worker):
  """A 400-digit answer (a float's infinity) once made the worker's verdict unsendable:
  a 500, so an infrastructure error, so a re-roll of a wrong answer (red-team)."""
  async def go():
    env = RemoteEnv(worker.url)
    await env.reset(TaskSpec("c", "calculator", {"expression": "2 + 3 * 4"}))
    await env.step("ANSWER: " + "9" * 400)
    verdict = await env.verify()
    await env.aclose()
    return verdict

  assert asyncio.run(go()).status == VerdictStatus.FAIL
  details = base.Verdict(VerdictStatus.FAIL, 0.0, "e", "v", {"x": float("inf")}).to_dict()
  assert json.loads(json.dumps(details, allow_nan=False))["details"] == {"x": "inf"}
  with pytest.raises(ValueError, match="finite"):
    base.Verdict(VerdictStatus.PASS, float("nan"), "e", "v")


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
  assert 'env_calls_total{kind="step",outcome="deadline"}' in \
      httpx.get(f"{worker.url}/metrics").text


def test_a_blocking_tool_meets_the_workers_deadline_and_the_worker_serves_on(worker):
  """A tool written as a plain function that blocked held the worker's event loop: no 504
  at its deadline, /health unanswered, SIGTERM ignored (a new user). It runs in a
  thread: the call is cut at the deadline and the worker answers meanwhile."""
  async def go():
    env = RemoteEnv(worker.url)
    await env.reset(TaskSpec("b", "blocking_tool_test_env"))
    assert (await env.step("0.05")).observation.messages[0]["content"] == "done"
    t0 = time.perf_counter()
    step = asyncio.ensure_future(env.step("6"))
    await asyncio.sleep(0.3)
    async with httpx.AsyncClient() as client:  # (the worker answers while it blocks)
      assert (await client.get(f"{worker.url}/health", timeout=2)).status_code == 200
    with pytest.raises(RuntimeError, match="504.*deadline"):
      await step
    assert time.perf_counter() - t0 < 5.0
    await env.aclose()

  asyncio.run(asyncio.wait_for(go(), timeout=30))


def test_the_policys_sandboxed_commands_are_not_charged_to_the_deadline(worker):
  """A command that stalled its own kill for a minute made a wrong answer's call pass
  the deadline: a 504, an infrastructure error, re-rolled (red team 44). The commands'
  time is the policy's; their wall limits bound them."""
  async def go():
    env = RemoteEnv(worker.url)
    await env.reset(TaskSpec("c", "long_command_test_env"))
    result = await env.step("2.0")  # (past the worker's 1.5 s deadline)
    await env.aclose()
    return result

  assert asyncio.run(asyncio.wait_for(go(), timeout=30)).terminated


def test_a_session_whose_client_gave_up_on_its_start_is_closed(worker):
  """A client that gives up on a slow reset never learns its session: the worker closes
  it (red team 22: it was kept for the client's idle time, holding a session slot and a
  workspace; enough of them and every new episode got a 503)."""
  task = {"task": {"id": "r", "env": "slow_reset_test_env", "params": {"reset_s": 0.6}}}
  for _ in range(5):  # (more than the worker's 4 sessions)
    with pytest.raises(httpx.ReadTimeout):
      httpx.post(f"{worker.url}/sessions", json=task, timeout=0.2)
  deadline = time.time() + 10
  while httpx.get(f"{worker.url}/health").json()["sessions"] and time.time() < deadline:
    time.sleep(0.1)
  assert httpx.get(f"{worker.url}/health").json()["sessions"] == 0
  r = httpx.post(f"{worker.url}/sessions", json=task, timeout=10)
  assert r.status_code == 200, r.text
  httpx.delete(f"{worker.url}/sessions/{r.json()['session_id']}")
  assert 'env_calls_total{kind="reset",outcome="abandoned"}' in \
      httpx.get(f"{worker.url}/metrics").text


def test_bad_requests_and_limits(worker):
  c = httpx.Client(base_url=worker.url, timeout=30)
  r = c.post("/sessions", json={"task": {"id": "x", "env": "chess"}})
  assert r.status_code == 400 and "unknown environment 'chess'" in r.text
  assert r.json()["detail"].startswith("reset failed: task 'x' cannot start: unknown "), r.text
  r = c.post("/sessions", json={"task": {"id": "x"}})
  assert r.status_code == 400 and "env" in r.text
  r = c.post("/sessions", json={"task": {"id": "x", "env": "python_tests",
                                         "params": {"task": "nope"}}})
  assert r.status_code == 400 and "nope" in r.text
  r = c.post("/sessions", json={"tusk": {}})
  assert r.status_code == 422
  # Parameters of the wrong type or shape are the task's fault (400), not the worker's
  # (a 500 read as an infrastructure failure: retried and dropped; red team).
  for params, err in (({"low": [1]}, "low must be an integer"),
                      ({"prompt": "{x}"}, "{x} is not one of")):
    r = c.post("/sessions", json={"task": {"id": "t", "env": "guess_number", "params": params}})
    assert r.status_code == 400 and "task 't' cannot start" in r.text and err in r.text, r.text
    assert "envs/waits.py" not in r.text and "CannotStart" not in r.text, r.text  # (a new user)
  # (1e400 was an OverflowError, "reset failed" as the worker's own; red team 115)
  r = c.post("/sessions", headers={"content-type": "application/json"},
             content='{"task": {"id": "t", "env": "guess_number", "params": {"low": 1e400}}}')
  assert r.status_code == 400 and "cannot start" in r.text and "got inf" in r.text, r.text
  r = c.post("/sessions", json={"task": {"id": "t", "env": "calculator",
                                         "params": {"expression": "1", "question": "{0}"}}})
  assert r.status_code == 400 and "{0} is not one of {expression}" in r.text
  # ... an expression without a value, a prompt that is not text (red team 14: a 500)
  for env, params, err in (("calculator", {"expression": "1/0"}, "ZeroDivisionError"),
                           ("calculator", {"expression": "999999.0**63.5"}, "OverflowError"),
                           # (exact: a decimal is its value as written, its power an int)
                           ("calculator", {"expression": "999999.0**64"}, "no finite real"),
                           ("calculator", {"expression": "(-8)**0.5"}, "no finite real"),
                           ("calculator", {"expression": "1e308*10"}, "no finite real"),
                           ("calculator", {"expression": "1", "question": 5}, "question must"),
                           ("guess_number", {"prompt": 5}, "prompt must be a string")):
    r = c.post("/sessions", json={"task": {"id": "t", "env": env, "params": params}})
    assert r.status_code == 400 and "task 't' cannot start" in r.text and err in r.text, r.text

  async def remote_reset():
    env = RemoteEnv(worker.url)
    try:
      await env.reset(TaskSpec("t", "guess_number", {"low": [1]}))
    finally:
      await env.aclose()
  # (a TaskError to the agent; where it was raised, on the worker)
  with pytest.raises(ValueError, match="cannot start: envs/guess_number.py:\\d+: ValueError: "
                                       "task t: low must be an integer"):
    asyncio.run(remote_reset())
  ids = [c.post("/sessions", json={"task": {"id": f"g{i}", "env": "guess_number"}}).json()
         for i in range(4)]
  r = c.post("/sessions", json={"task": {"id": "g5", "env": "guess_number"}})
  assert r.status_code == 503 and "session limit" in r.text
  for s in ids:
    if "session_id" in s:
      c.delete(f"/sessions/{s['session_id']}")
  text = c.get("/metrics").text
  # (its own calls: a step cut at its deadline is another test's, which may run on
  # another xdist worker)
  assert "env_sessions" in text and 'env_calls_total{kind="reset",outcome=' in text


def test_concurrency_cap_queues_calls(worker):
  import time

  async def one():
    env = RemoteEnv(worker.url)
    await env.reset(TaskSpec("s", "slow_test_env"))
    await env.step("0.6")
    await env.aclose()

  async def go():
    t0 = time.perf_counter()
    await asyncio.gather(one(), one(), one())  # cap is 2 calls at once
    return time.perf_counter() - t0

  assert asyncio.run(go()) >= 1.15


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


def test_request_bodies_are_capped():
  app = create_app(EnvResources(sandboxes=1), max_body_bytes=4000)
  with ServerThread(app) as srv:
    sid = httpx.post(f"{srv.url}/sessions", json={"task": {"id": "g", "env": "guess_number"}}
                     ).json()["session_id"]
    r = httpx.post(f"{srv.url}/sessions/{sid}/step", json={"action": "8" * 5000})
    assert r.status_code == 413 and "4000 bytes" in r.text

    def chunks():  # no Content-Length: counted as it streams
      yield b'{"action": "'
      for _ in range(10):
        yield b"8" * 500
      yield b'"}'

    r = httpx.post(f"{srv.url}/sessions/{sid}/step", content=chunks(),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413
    deep = b'{"action": ' + b"[" * 1500 + b"]" * 1500 + b"}"
    r = httpx.post(f"{srv.url}/sessions/{sid}/step", content=deep,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["detail"] == "body: JSON nested too deep to read"
    # ... and just under the parser's limit, where its 422 echoing the input could not be
    # written (a 500: reviewer), and just past MAX_BODY_DEPTH (Python 3.13's parser reads
    # 5,000 levels): named alike on every Python version.
    from jaxagent.serve_http import MAX_BODY_DEPTH
    for depth in [MAX_BODY_DEPTH, *range(900, 1060, 3)]:
      r = httpx.post(f"{srv.url}/sessions/{sid}/step", headers={"content-type": "application/json"},
                     content=b'{"action": ' + b"[" * depth + b"]" * depth + b"}")
      assert r.status_code == 400 and r.json()["detail"] == "body: JSON nested too deep to read", (
          depth, r.status_code, r.text[:200])
    task = {"id": "g", "env": "guess_number", "params": {"x": [[]]}}
    for _ in range(MAX_BODY_DEPTH - 4):  # (the body, task, params and two lists: 5 levels)
      task["params"]["x"] = [task["params"]["x"]]
    r = httpx.post(f"{srv.url}/sessions", json={"task": task})
    assert r.status_code == 400 and r.json()["detail"] == "body: JSON nested too deep to read", (
        r.status_code, r.text[:200])
    r = httpx.post(f"{srv.url}/sessions/{sid}/step", json={"action": "8"})
    assert r.status_code == 200 and httpx.get(f"{srv.url}/health").json()["status"] == "ok"


def test_idle_sessions_are_reaped():
  app = create_app(EnvResources(sandboxes=1), idle_timeout_s=0.4)
  with ServerThread(app) as srv:
    sid = httpx.post(f"{srv.url}/sessions", json={"task": {"id": "g", "env": "guess_number"}}
                     ).json()["session_id"]
    time.sleep(1.2)
    assert httpx.get(f"{srv.url}/health").json()["sessions"] == 0
    assert httpx.post(f"{srv.url}/sessions/{sid}/step", json={"action": "8"}).status_code == 404
    assert "env_sessions_reaped_total 1.0" in httpx.get(f"{srv.url}/metrics").text


def test_a_session_lives_as_long_idle_as_its_client_asks_from_its_last_calls_end():
  """An agent waits on its policy's turns between calls, and a turn is as long as its
  tokens: `RemoteEnv` asks for its episode's wall time (a worker's 300 s closed the
  session of a long last turn, making a failing episode an infrastructure error: red
  team). Idle time runs from a call's end, not its start."""
  app = create_app(EnvResources(sandboxes=1), idle_timeout_s=0.4)
  task = {"id": "g", "env": "guess_number", "params": {"secret": 11}}
  with ServerThread(app) as srv:
    asked = httpx.post(f"{srv.url}/sessions", json={"task": task, "idle_timeout_s": 30}
                       ).json()["session_id"]
    default = httpx.post(f"{srv.url}/sessions", json={"task": task}).json()["session_id"]
    time.sleep(1.2)
    assert httpx.post(f"{srv.url}/sessions/{asked}/step", json={"action": "8"}
                      ).status_code == 200
    assert httpx.post(f"{srv.url}/sessions/{default}/step", json={"action": "8"}
                      ).status_code == 404
    bad = httpx.post(f"{srv.url}/sessions", json={"task": task, "idle_timeout_s": -1})
    assert bad.status_code == 422 and "idle_timeout_s" in bad.text
  # A client's ask is capped by the worker's --max-idle-timeout-s (a huge episode
  # deadline asks for years: taken, capped, not refused).
  capped = create_app(EnvResources(sandboxes=1), idle_timeout_s=0.4, max_idle_timeout_s=0.4)
  with ServerThread(capped) as srv:
    sid = httpx.post(f"{srv.url}/sessions", json={"task": task, "idle_timeout_s": 3e9}
                     ).json()["session_id"]
    time.sleep(1.2)
    assert httpx.post(f"{srv.url}/sessions/{sid}/step", json={"action": "8"}
                      ).status_code == 404

  async def remote():
    env = RemoteEnv(srv.url, idle_timeout_s=30)
    try:
      await env.reset(TaskSpec("g", "guess_number", {"secret": 11}))
      await asyncio.sleep(1.0)
      return (await env.step("11")).terminated
    finally:
      await env.close()

  with ServerThread(create_app(EnvResources(sandboxes=1), idle_timeout_s=0.4)) as srv:
    assert asyncio.run(remote())


def test_an_unreachable_worker_is_infrastructure():
  from jaxagent.errors import InfraError
  from jaxagent.launch import free_port

  env = RemoteEnv(f"http://127.0.0.1:{free_port()}", timeout_s=5)
  with pytest.raises(InfraError) as e:
    asyncio.run(env.reset(TaskSpec("t", "guess_number", {"secret": 3})))
  assert e.value.kind == "env_worker" and "ConnectError" in str(e.value)
  assert issubclass(SessionLost, InfraError)


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


def test_a_call_ends_within_two_deadlines_and_closing_cancels_it_first():
  """Waits are not charged to a call's deadline, but a call answers within two deadlines
  in all (a client's timeout must not pass first: a review finding); a session closed
  while a call runs (the client gave up) has the call cancelled before the environment
  closes under it."""
  app = create_app(EnvResources(sandboxes=1), max_sessions=8, deadline_s=1.0)

  async def go(url):
    env = RemoteEnv(url)
    await env.reset(TaskSpec("w", "waiting_test_env"))
    t0 = time.perf_counter()
    with pytest.raises(InfraError, match="504"):
      await env.step("5")  # waits 5 s: cut at 2 s
    cut_after = time.perf_counter() - t0
    await env.aclose()
    EVENTS.clear()
    env = RemoteEnv(url)
    await env.reset(TaskSpec("w", "waiting_test_env"))
    running = asyncio.ensure_future(env.step("1.5"))
    await asyncio.sleep(0.3)
    async with httpx.AsyncClient() as c:  # another client closes the session
      assert (await c.delete(f"{url}/sessions/{env.session_id}")).status_code == 200
    with pytest.raises(Exception):
      await running
    return cut_after

  with ServerThread(app) as srv:
    cut_after = asyncio.run(asyncio.wait_for(go(srv.url), timeout=30))
  assert 1.9 < cut_after < 4.0
  assert EVENTS == ["cancelled", "closed"]


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


def test_a_rush_of_starts_keeps_the_session_limit_and_a_close_answers_its_calls_409():
  """Red team 14: the limit was checked before the resets' awaits (12 concurrent starts
  got past a limit of 4); a session closed while its calls ran answered the one running
  a plain 500, and a second call waiting on the first's lock ran on the closed one."""
  app = create_app(EnvResources(sandboxes=1), max_sessions=3, deadline_s=5.0)
  task = {"task": {"id": "w", "env": "waiting_test_env"}}

  async def go(url):
    async with httpx.AsyncClient(timeout=30) as c:
      rush = await asyncio.gather(*(c.post(f"{url}/sessions", json=task) for _ in range(8)))
      assert sorted(r.status_code for r in rush) == [200] * 3 + [503] * 5, \
          [r.text for r in rush]
      assert (await c.get(f"{url}/health")).json()["sessions"] == 3
      sid = next(r for r in rush if r.status_code == 200).json()["session_id"]
      EVENTS.clear()
      calls = [asyncio.ensure_future(c.post(f"{url}/sessions/{sid}/step",
                                            json={"action": wait})) for wait in ("2", "0")]
      await asyncio.sleep(0.3)
      assert (await c.delete(f"{url}/sessions/{sid}")).status_code == 200
      return await asyncio.gather(*calls), list(EVENTS)

  with ServerThread(app) as srv:
    answers, events = asyncio.run(asyncio.wait_for(go(srv.url), timeout=30))
  for r in answers:
    assert r.status_code == 409 and "closed during this call" in r.text, r.text
  assert events == ["cancelled", "closed"]  # (the second call never ran)


def test_a_start_is_counted_once_while_its_handler_wakes(monkeypatch):
  """A CI failure: a rush of 8 starts at a limit of 3 opened 2. A started session was
  counted twice, as open and as starting, until its handler woke from its reset (a few
  turns of the loop, longer on a loaded host): a start checked meanwhile was refused.
  Here the handler wakes 0.5 s late and a second start comes meanwhile."""
  import envs.server as server

  class LateWaking:  # (asyncio, with a handler's wait ending 0.5 s after its call's)
    def __getattr__(self, name):
      return getattr(asyncio, name)

    @staticmethod
    async def wait(*args, **kwargs):
      out = await asyncio.wait(*args, **kwargs)
      await asyncio.sleep(0.5)
      return out

  monkeypatch.setattr(server, "asyncio", LateWaking())
  app = create_app(EnvResources(sandboxes=1), max_sessions=2, deadline_s=5.0)
  task = {"task": {"id": "w", "env": "waiting_test_env"}}

  async def go(url):
    async with httpx.AsyncClient(timeout=30) as c:
      first = asyncio.ensure_future(c.post(f"{url}/sessions", json=task))
      await asyncio.sleep(0.25)
      second = await c.post(f"{url}/sessions", json=task)
      third = await c.post(f"{url}/sessions", json=task)
      return (await first).status_code, second.status_code, third

  with ServerThread(app) as srv:
    first, second, third = asyncio.run(asyncio.wait_for(go(srv.url), timeout=30))
  assert (first, second) == (200, 200)
  assert third.status_code == 503 and "session limit (2)" in third.text, third.text


def test_http_clients_share_one_tls_context(monkeypatch):
  """Each httpx client loaded the CA certificates on the event loop (47 ms): an episode's
  environment client, a black-box episode's two, a judge call's; 32 remote episodes held a
  run's loop 1.2 s a step and `envs.loopwatch` blamed envs/server.py (a new user's round).
  They share `jaxagent.tls.shared_tls`, loaded once."""
  import ssl

  from jaxagent.tls import shared_tls
  from rollout_server.client import HttpClient

  context = shared_tls()
  loads = []
  load = ssl.SSLContext.load_verify_locations
  monkeypatch.setattr(ssl.SSLContext, "load_verify_locations",
                      lambda self, *a, **k: loads.append(a or k) or load(self, *a, **k))
  with socket.socket() as s:  # (a port nothing listens on)
    s.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{s.getsockname()[1]}"

  async def calls():
    for _ in range(3):
      env = RemoteEnv(url, timeout_s=2)
      with pytest.raises(InfraError):
        await env.reset(TaskSpec("t", "guess_number", {}))
      await env.aclose()
    client = HttpClient(url)
    await client._client.aclose()

  asyncio.run(calls())
  assert loads == [] and shared_tls() is context
  httpx.AsyncClient()  # (without it, httpx loads them for the client: the patch sees it)
  assert len(loads) == 1


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

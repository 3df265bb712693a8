"""The environment worker service against a real server on a loopback port."""
import asyncio
import json
import socket
import time

import httpx
import pytest

from envs import base
from envs.base import EnvResources, TaskSpec, VerdictStatus
from envs.server import RemoteEnv, SessionLost, create_app
from jaxagent.errors import InfraError
from rollout_server.serving import ServerThread
from tests.envs.worker_envs import EVENTS


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


def test_a_workers_environment_says_what_a_cut_episode_scores(worker):
  """`Env.cut_reward` (an environment whose wrong answers pay -1 pays a cut -1, or
  stalling pays better than answering wrong) reaches a remote episode's agent."""
  async def go():
    said = []
    for env_name in ("harsh_test_env", "guess_number"):
      env = RemoteEnv(worker.url)
      try:
        await env.reset(TaskSpec("h", env_name, {"secret": 4} if env_name == "guess_number"
                                 else {}))
        said.append(env.cut_reward)
      finally:
        await env.aclose()
    return said

  assert asyncio.run(go()) == [-1.0, 0.0]
  with pytest.raises(ValueError, match="cut_reward must be a finite number"):
    @base.register("nan_cut_test_env")
    class _NanCut(base.Env):
      cut_reward = float("nan")

  @base.register("per_task_cut_test_env")  # (one read per episode: not checked here)
  class _PerTask(base.Env):
    @property
    def cut_reward(self):
      return -float(self.task.params.get("cost", 1.0)) if self.task else 0.0


def test_numpy_values_cross_the_service_and_values_json_cannot_are_the_environments(worker):
  """A reviewer: an environment's np.float32 reward or NumPy value in its info (numbers
  in process) was a 500 after its call had run, read as the worker's failure and the
  episode re-rolled; at a reset, its session was left open. NumPy's values cross as
  numbers, sets, dates and a NaN as FastAPI writes them (a NaN as text); a value JSON
  cannot carry (an object with nothing to write) is the environment's bug, a 400
  naming it, and a reset's session is closed."""
  async def go():
    env = RemoteEnv(worker.url)
    try:
      obs = await env.reset(TaskSpec("n", "numpy_test_env", {}))
      step = await env.step("x")
      verdict = await env.verify()
    finally:
      await env.aclose()
    refused = []
    for odd in ("reset", "step"):
      env = RemoteEnv(worker.url)
      try:
        with pytest.raises(RuntimeError, match="JSON cannot carry") as e:
          await env.reset(TaskSpec("n", "numpy_test_env", {"odd": odd}))
          await env.step("x")
        refused.append(str(e.value))
      finally:
        await env.aclose()
    return obs, step, verdict, refused

  obs, step, verdict, refused = asyncio.run(go())
  assert obs.messages[0]["n"] == 3 and step.reward == 0.5
  assert step.info["seen"] == [0, 1] and step.info["turn"] == 1
  assert (step.info["kinds"], step.info["when"], step.info["nan"]) == (["a"], "2026-12-07",
                                                                       "nan")
  assert verdict.reward == 1.0 and type(verdict.reward) is float
  assert all(" 400: " in r and "failed: the environment's answer" in r for r in refused)
  assert httpx.get(f"{worker.url}/health").json()["sessions"] == 0  # (none left open)


def test_an_answer_that_is_no_workers_is_the_infrastructures():
  """A reviewer: a proxy's HTML page (a 404 on a session's path, or a 200) in front of
  a worker was a ValueError: a bug that stopped the run, or at a reset the task's."""
  pages = iter([(200, "<html>up</html>"), (404, "<html>not found</html>")])

  def answer(request):
    status, text = next(pages)
    return httpx.Response(status, text=text, headers={"content-type": "text/html"})

  async def go():
    client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    env = RemoteEnv("http://worker.invalid", client=client)
    with pytest.raises(InfraError, match="no worker's answer"):
      await env.reset(TaskSpec("g", "guess_number", {"secret": 4}))
    env.session_id = "abc"
    with pytest.raises(InfraError, match="404 not from the worker"):
      await env.step("4")
    await client.aclose()

  asyncio.run(go())


def test_an_action_larger_than_the_worker_takes_truncates_its_episode():
  """A reviewer: a step's action past the worker's body bound (a degenerate policy's
  escaped bytes) was a 413, read as a bad call of ours that stopped the run. It is the
  policy's truncation, `action_too_large`."""
  from jaxagent.agent import MeasuredEnv

  resources = EnvResources(sandboxes=1)
  app = create_app(resources, max_body_bytes=4096)
  try:
    with ServerThread(app) as small:
      async def go():
        env = MeasuredEnv(RemoteEnv(small.url))
        await env.reset(TaskSpec("g", "guess_number", {"secret": 4}))
        result = await env.step("\x00" * 2000)  # (6 bytes each as JSON)
        verdict = await env.verify()
        await env.env.aclose()
        return env, result, verdict

      env, result, verdict = asyncio.run(go())
  finally:
    resources.close()
  assert result.truncated and not result.terminated and result.reward == 0.0
  assert result.info["truncation"] == "action_too_large" and env.truncation == "action_too_large"
  assert env.ended and verdict.status == VerdictStatus.FAIL


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

  with pytest.raises(RuntimeError, match=r"400: step failed: tests/envs/worker_envs.py:\d+: "
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




def test_a_sessions_calls_run_one_at_a_time_not_holding_the_cap(worker):
  """Calls sent at once to one session waited for its lock holding places under the
  worker's cap: one harness stalled every other client's calls (a reviewer). A call while
  another of its session is under way is refused; other sessions' calls go on."""
  sid = httpx.post(f"{worker.url}/sessions", json={"task": {"id": "s", "env": "slow_test_env"}},
                   timeout=30).json()["session_id"]
  other = httpx.post(f"{worker.url}/sessions", json={"task": {"id": "g", "env": "guess_number"}},
                     timeout=30).json()["session_id"]

  async def go():
    async with httpx.AsyncClient(base_url=worker.url, timeout=30) as c:
      first = asyncio.ensure_future(c.post(f"/sessions/{sid}/step", json={"action": "0.8"}))
      await asyncio.sleep(0.3)
      again = await asyncio.gather(*(c.post(f"/sessions/{sid}/step", json={"action": "0.8"})
                                     for _ in range(3)))
      t0 = time.perf_counter()
      step = await c.post(f"/sessions/{other}/step", json={"action": "8"})
      return await first, again, step, time.perf_counter() - t0

  first, again, step, took = asyncio.run(go())
  assert first.status_code == 200, first.text
  assert all(r.status_code == 409 and "call 1 of this session is still under way" in r.text
             for r in again), [r.text for r in again]
  assert step.status_code == 200 and took < 0.5, (step.text, took)
  for s in (sid, other):
    httpx.delete(f"{worker.url}/sessions/{s}")


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


def test_an_unreachable_worker_is_infrastructure_said_once_an_outage(caplog):
  """A worker killed for 15 s was seen only in a step's time and its drops' counts (a new
  user): its outage is said once, and its return."""
  from jaxagent.errors import InfraError
  from jaxagent.launch import free_port

  port = free_port()
  url = f"http://127.0.0.1:{port}"
  task = TaskSpec("t", "guess_number", {"secret": 3})
  for _ in range(2):
    env = RemoteEnv(url, timeout_s=5)
    with pytest.raises(InfraError) as e:
      asyncio.run(env.reset(task))
    assert e.value.kind == "env_worker" and "ConnectError" in str(e.value)
  assert issubclass(SessionLost, InfraError)
  said = [r.getMessage() for r in caplog.records if r.name == "envs.server"]
  assert len(said) == 1 and said[0].startswith(f"environment worker {url} is unreachable "
                                               "(ConnectError"), said

  async def back():
    env = RemoteEnv(url, timeout_s=5)
    await env.reset(task)
    await env.aclose()

  with ServerThread(create_app(EnvResources(sandboxes=1)), port=port):
    asyncio.run(back())
  said = [r.getMessage() for r in caplog.records if r.name == "envs.server"]
  assert said[1:] == [f"environment worker {url} answers again"], said


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
  # (the second, sent while the first ran, is refused at once: a session's calls run one
  # at a time)
  assert [(r.status_code, "closed during this call" in r.text,
           "still under way" in r.text) for r in answers] == [(409, True, False),
                                                                (409, False, True)], answers
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



def test_a_run_waits_at_its_start_for_workers_starting_beside_it():
  """A cluster starts the learner and its workers together: a run's start waits for each
  worker's /health (saying so, once), a URL that never answers stops it after
  env.startup_wait_s naming that, and one that answers as something else than a worker
  (a rollout server) is the config's error at once (a wrong URL was an infrastructure
  failure at the first reset, exit 3, without a word of waiting)."""
  from fastapi import FastAPI

  from envs.server import wait_workers
  from jaxagent import config as config_lib
  from jaxagent.launch import free_port
  from jaxagent.run_services import env_workers_ready

  resources = EnvResources(sandboxes=1)
  port = free_port()
  late = f"http://127.0.0.1:{port}"
  said = []

  async def start_late():
    await asyncio.sleep(1.5)
    return ServerThread(create_app(resources), port=port).start()

  async def both():
    return await asyncio.gather(wait_workers([late, late + "/"], 60, said.append),
                                start_late())

  t0 = time.monotonic()
  try:
    _, server = asyncio.run(both())
  except BaseException:
    resources.close()
    raise
  try:
    assert 1.5 <= time.monotonic() - t0 < 20
    assert said == [f"waiting up to 60 s for the environment worker {late} to be ready "
                    "(ConnectError: All connection attempts failed)", f"{late} is ready"]
    said.clear()
    asyncio.run(wait_workers([server.url], 60, said.append))  # (up: nothing said)
    assert said == []
    gone = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(InfraError, match=f"{gone}/health did not answer 200 within 1 s "
                       r"\(env.startup_wait_s; last: ConnectError"):
      asyncio.run(wait_workers([server.url, gone], 1, said.append))
    assert time.monotonic() - t0 < 10
    assert said == [f"waiting up to 1 s for the environment worker {gone} to be ready "
                    "(ConnectError: All connection attempts failed)"]
    said.clear()
    other = FastAPI()
    other.get("/health")(lambda: {"status": "ok"})
    with ServerThread(other) as not_a_worker:
      cfg = config_lib.load(config_lib.RunConfig, "configs/tiny.yaml",
                            [f'env.urls=["{server.url}", "{not_a_worker.url}"]'])
      with pytest.raises(config_lib.ConfigError,
                         match=f"env.urls: {not_a_worker.url} answers /health but is not "
                         r"an environment worker \(python -m envs.server\)"):
        asyncio.run(env_workers_ready(cfg, said.append))
      with pytest.raises(ValueError, match=f"{not_a_worker.url}/v1/health is not found "
                         r"there \(404\)"):  # (a URL with a path of another service)
        asyncio.run(wait_workers([f"{not_a_worker.url}/v1"], 60, said.append))
    assert said == []
  finally:
    server.stop()
    resources.close()


def test_a_sandbox_the_worker_could_not_run_is_infrastructure_never_a_verdict(worker):
  """An InfraError raised in an environment's step or verify (a sandbox the worker
  could not run: its pool full, no slot freed) is the worker's failure: a 503, an
  InfraError at the client (re-rolled), never a refused call of ours nor a failed
  verdict scored 0."""
  async def go(call):
    env = RemoteEnv(worker.url)
    try:
      await env.reset(TaskSpec("b", "buggy_test_env", {"raise": "infra", "status": "fail"}))
      return await call(env)
    finally:
      await env.aclose()

  with pytest.raises(InfraError, match="503: step failed in the infrastructure: sandbox: "
                                       "sandbox pool is at its limit"):
    asyncio.run(go(lambda env: env.step("x")))
  with pytest.raises(InfraError, match="503: verify failed in the infrastructure: sandbox: "
                                       "no sandbox slot freed"):
    asyncio.run(go(lambda env: env.verify()))
  assert 'env_calls_total{kind="verify",outcome="infra"}' in \
      httpx.get(f"{worker.url}/metrics").text


def _reset_on_a_worker_answering(status: int, detail: str) -> None:
  """A `RemoteEnv` reset against a worker that answers every call `status`."""
  async def worker(request: httpx.Request) -> httpx.Response:
    return httpx.Response(status, json={"detail": detail})

  async def go():
    env = RemoteEnv("http://w", client=httpx.AsyncClient(
        transport=httpx.MockTransport(worker)))
    await env.reset(TaskSpec("g", "guess_number", {"secret": 4}))

  asyncio.run(go())


@pytest.mark.parametrize("status", [500, 502, 503, 504])
def test_a_worker_that_fails_is_infrastructure(status):
  """Any 5xx from a worker (its own failure, a proxy's) is the infrastructure's: an
  InfraError, re-rolled; never a refused call of ours (a bug, the run stopped)."""
  with pytest.raises(InfraError, match=f"{status}: down"):
    _reset_on_a_worker_answering(status, "down")


@pytest.mark.parametrize("status", [400, 409, 422])
def test_a_worker_that_refuses_a_call_is_not_infrastructure(status):
  """A 4xx is a bad call of ours (or the environment's bug, named): a RuntimeError, never
  an InfraError that would re-roll the episode."""
  with pytest.raises(RuntimeError, match=f"{status}: no") as got:
    _reset_on_a_worker_answering(status, "no")
  assert not isinstance(got.value, InfraError)


def test_a_session_is_idle_only_between_calls():
  """A session whose call runs longer than its idle time is not reaped under it (the
  call was cancelled: a 409 for a step that was merely slow), and its idle time runs
  from that call's end, not its start (the next call, soon after, is served)."""
  app = create_app(EnvResources(sandboxes=1), idle_timeout_s=2.0)  # (a reaper tick: 0.5 s)
  with ServerThread(app) as srv:
    sid = httpx.post(f"{srv.url}/sessions", json={"task": {"id": "s", "env": "slow_test_env"}}
                     ).json()["session_id"]
    r = httpx.post(f"{srv.url}/sessions/{sid}/step", json={"action": "2.6"}, timeout=10)
    assert r.status_code == 200, r.text
    # (past a tick: idle counted from the call's start, the session is gone by now; 1.4 s
    # of margin for a loaded machine)
    time.sleep(0.6)
    r = httpx.post(f"{srv.url}/sessions/{sid}/step", json={"action": "0"}, timeout=10)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 15  # (then reaped: /health touches no session)
    while httpx.get(f"{srv.url}/health").json()["sessions"]:
      assert time.monotonic() < deadline, "an idle session was never reaped"
      time.sleep(0.1)
    assert httpx.post(f"{srv.url}/sessions/{sid}/step", json={"action": "0"}
                      ).status_code == 404


def test_an_environment_whose_start_failed_is_closed(worker):
  """A reset that fails (the task's parameters, or the host) keeps nothing: the
  environment is closed (its workspace released; kept, each failed start leaked a
  sandbox until the pool was full), the task's failure a CannotStart and the host's an
  InfraError (re-rolled), and no session is left open."""
  async def go(params):
    env = RemoteEnv(worker.url)
    try:
      await env.reset(TaskSpec("f", "failing_reset_test_env", params))
    finally:
      await env.aclose()

  EVENTS.clear()
  open_before = httpx.get(f"{worker.url}/health").json()["sessions"]
  with pytest.raises(base.CannotStart, match="cannot start: .*ValueError: no such level"):
    asyncio.run(go({"raise": "task"}))
  with pytest.raises(InfraError, match="503: reset failed in the infrastructure: .*No space"):
    asyncio.run(go({}))
  assert EVENTS == ["closed", "closed"]
  assert httpx.get(f"{worker.url}/health").json()["sessions"] == open_before


def test_a_clients_new_episode_closes_its_last_session(worker):
  """A `RemoteEnv` reset again (its next episode) closes the session it had: kept, it
  held a session slot and a workspace on the worker for its whole idle time. Its
  `done` says the episode ended once a step terminated it."""
  async def go():
    env = RemoteEnv(worker.url)
    try:
      await env.reset(TaskSpec("g", "guess_number", {"secret": 4}))
      first = env.session_id
      await env.reset(TaskSpec("g", "guess_number", {"secret": 5}))
      await env.step("8")
      going = env.done
      result = await env.step("5")
      return first, env.session_id, not going and result.terminated and env.done
    finally:
      await env.aclose()

  first, second, done = asyncio.run(go())
  assert first != second and done
  assert httpx.post(f"{worker.url}/sessions/{first}/step", json={"action": "4"}
                    ).status_code == 404
  gone = httpx.delete(f"{worker.url}/sessions/{first}")  # (not a session it has)
  assert gone.status_code == 404 and "no session" in gone.text


@pytest.mark.parametrize("down", ["503", "unreachable", "409"])
def test_closing_a_session_its_worker_cannot_close_ends_quietly(down):
  """An episode's close after its worker failed (a 503, unreachable) or refused (the
  session already gone) does not raise: the session is gone either way, and an error
  there turned a scored episode into a dropped one."""
  async def worker(request: httpx.Request) -> httpx.Response:
    if request.method == "POST":
      return httpx.Response(200, json={"session_id": "s1", "observation": {"messages": []}})
    if down == "unreachable":
      raise httpx.ConnectError("refused", request=request)
    return httpx.Response(int(down), json={"detail": "no"})

  async def go():
    env = RemoteEnv("http://wc", client=httpx.AsyncClient(
        transport=httpx.MockTransport(worker)))
    await env.reset(TaskSpec("g", "guess_number", {"secret": 4}))
    await env.aclose()
    return env.session_id

  assert asyncio.run(go()) is None


def test_a_call_waiting_for_a_turn_past_its_sessions_idle_time_is_served():
  """A call queued behind another under the worker's cap for several times its session's
  idle time is still served: a session with a call in flight is never idle (the reaper
  spared only a session whose lock a call held, taken after the turn: the queued call's
  session was closed under it, a 409 its client read as a bad call of its own, not the
  worker's load; red team 52)."""
  app = create_app(EnvResources(sandboxes=1), max_concurrent_calls=1, idle_timeout_s=1.0)
  task = {"task": {"id": "s", "env": "slow_test_env"}}
  with ServerThread(app) as srv:
    async def go():
      async with httpx.AsyncClient(timeout=30) as c:
        a, b = [(await c.post(f"{srv.url}/sessions", json=task)).json()["session_id"]
                for _ in range(2)]
        # (both at once: one runs 3 s, the other waits 3 s for its turn, three idle times)
        return await asyncio.gather(*(c.post(f"{srv.url}/sessions/{sid}/step",
                                             json={"action": "3"}) for sid in (a, b)))

    first, second = asyncio.run(asyncio.wait_for(go(), timeout=30))
  assert first.status_code == 200, first.text
  assert second.status_code == 200, second.text

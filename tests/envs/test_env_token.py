"""The environment token (`jaxagent.control.ENVS`): an environment worker's session
routes answer only the run's learners, and a learner whose token a worker refuses stops
at its start, naming the variable."""

import asyncio

import httpx
import pytest

from envs.base import EnvResources, TaskSpec, VerdictStatus
from envs.server import RemoteEnv, access_problem, create_app
from jaxagent import config as config_lib, control
from rollout_server.serving import ServerThread

TOKEN = "env-token-" + "e" * 30
KEY = control.ENVS
TASK = {"id": "g", "env": "guess_number", "params": {"secret": 4}}


@pytest.fixture(scope="module")
def guarded():
  resources = EnvResources(sandboxes=1)
  with ServerThread(create_app(resources, max_sessions=4, token=TOKEN)) as srv:
    yield srv
  resources.close()


async def _episode(env) -> VerdictStatus:
  """Plays TASK right (its secret at once) on `env`; the verdict's status."""
  try:
    await env.reset(TaskSpec.from_dict(TASK))
    await env.step("4")
    return (await env.verify()).status
  finally:
    await env.aclose()


def _session_calls(c: httpx.Client, sid: str) -> dict:
  """Each session route, called with what it would take."""
  return {
      "create": lambda h: c.post("/sessions", json={"task": TASK}, headers=h),
      "step": lambda h: c.post(f"/sessions/{sid}/step", json={"action": "4"}, headers=h),
      "verify": lambda h: c.post(f"/sessions/{sid}/verify", headers=h),
      "waits": lambda h: c.get(f"/sessions/{sid}/waits", headers=h),
      "delete": lambda h: c.delete(f"/sessions/{sid}", headers=h),
      "access": lambda h: c.get("/access", headers=h),
  }


def test_a_workers_session_routes_take_its_token_and_its_reads_none(guarded):
  c = httpx.Client(base_url=guarded.url, timeout=60)
  ruled = {KEY.header: TOKEN}
  sid = c.post("/sessions", json={"task": TASK}, headers=ruled).json()["session_id"]
  for name, call in _session_calls(c, sid).items():
    for headers, why in (({}, "has no"), ({KEY.header: TOKEN[:-1] + "f"}, "wrong"),
                         ({KEY.header: ""}, "wrong"),
                         ({control.HEADER: TOKEN}, "has no")):  # (the other token's header)
      r = call(headers)
      assert r.status_code == 401, (name, r.text)
      assert why in r.text and KEY.env in r.text and TOKEN not in r.text, r.text
  # (refused before its body's fields are checked: a 401, not a 422 naming them)
  assert c.post("/sessions", json={"junk": 1}).status_code == 401
  assert c.post(f"/sessions/{sid}/step", content=b"not json").status_code == 401
  # the refused calls changed nothing: the session is there and plays on
  assert c.post(f"/sessions/{sid}/step", json={"action": "4"}, headers=ruled).json()[
      "terminated"]
  assert c.post(f"/sessions/{sid}/verify", headers=ruled).json()["status"] == "pass"
  assert c.delete(f"/sessions/{sid}", headers=ruled).status_code == 200
  assert c.get("/access", headers=ruled).json() == {"ok": True}
  health = c.get("/health").json()
  assert health["env_token"] is True and health["sessions"] == 0
  assert c.get("/metrics").status_code == 200
  # a worker without a token: open, and says so
  with ServerThread(create_app(EnvResources(sandboxes=1), token="")) as srv:
    assert httpx.get(f"{srv.url}/health").json()["env_token"] is False
    assert httpx.get(f"{srv.url}/access").status_code == 200


def test_a_remote_env_carries_the_token_its_process_holds(guarded, monkeypatch):
  assert asyncio.run(_episode(RemoteEnv(guarded.url, token=TOKEN))) == VerdictStatus.PASS
  monkeypatch.setenv(KEY.env, TOKEN)
  assert asyncio.run(_episode(RemoteEnv(guarded.url))) == VerdictStatus.PASS
  monkeypatch.delenv(KEY.env)
  with pytest.raises(RuntimeError, match=f"401.*has no {KEY.header}.*{KEY.env}") as e:
    asyncio.run(_episode(RemoteEnv(guarded.url)))
  assert getattr(e.value, "on_worker", False) and TOKEN not in str(e.value)
  assert httpx.get(f"{guarded.url}/health").json()["sessions"] == 0


def test_a_learner_whose_token_a_worker_refuses_stops_at_its_start(guarded, monkeypatch):
  from jaxagent.run_services import make_env_factory
  from jaxagent.launch import free_port

  gone = f"http://127.0.0.1:{free_port()}"  # (a worker not up yet: left to its episodes)
  assert access_problem([guarded.url, gone], TOKEN) is None
  assert access_problem([gone], None) is None
  problem = access_problem([gone, guarded.url], None)
  assert guarded.url in problem and "has none" in problem and KEY.env in problem
  problem = access_problem([guarded.url], "another")
  assert "differs" in problem and KEY.env in problem and "another" not in problem
  with ServerThread(create_app(EnvResources(sandboxes=1))) as open_worker:
    assert access_problem([open_worker.url], None) is None
    assert access_problem([open_worker.url], "any") is None

  cfg = config_lib.load(config_lib.RunConfig, "configs/tiny.yaml",
                        [f'env.urls=["{guarded.url}"]'])
  monkeypatch.delenv(KEY.env, raising=False)
  with pytest.raises(config_lib.ConfigError, match=f"env.urls: .*{KEY.env}"):
    make_env_factory(cfg)
  monkeypatch.setenv(KEY.env, TOKEN)
  factory, close = make_env_factory(cfg)
  monkeypatch.delenv(KEY.env)  # (the factory's environments hold the token it read)
  assert asyncio.run(_episode(factory(TaskSpec.from_dict(TASK)))) == VerdictStatus.PASS
  close()

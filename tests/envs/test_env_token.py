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


def test_what_a_worker_answers_at_its_access_route_is_read_as_it_means(guarded):
  """A refusal is a 401 or a 403 (a proxy's); a 404 or a 5xx (an older worker, a proxy,
  one restarting) is nothing a start check can tell: the episodes' calls will say. An
  address given with a trailing slash is the same worker."""
  from fastapi import FastAPI, Response

  answers = {"code": 403}
  app = FastAPI()

  @app.get("/access")
  async def access():
    return Response(status_code=answers["code"])

  with ServerThread(app) as srv:
    assert "refuses" in access_problem([srv.url], "t")
    for code in (404, 500, 503, 200):
      answers["code"] = code
      assert access_problem([srv.url + "/"], "t") is None, code
  assert access_problem([guarded.url + "/"], TOKEN) is None
  assert "differs" in access_problem([guarded.url + "/"], "another")


@pytest.mark.parametrize("entry", ["train", "launch", "eval", "rollout_server", "router",
                                   "envs.server", "envs.play"])
def test_a_token_a_header_cannot_carry_stops_each_entry_point_at_once(entry, monkeypatch,
                                                                        capsys):
  """A token with a space, a line end or a non-ASCII character failed each call (or
  passed a start check as a worker not up yet): each command says which variable."""
  import importlib

  mains = {"train": ("jaxagent.train", ["--config", "configs/tiny.yaml"]),
           "launch": ("jaxagent.launch", ["local", "--config", "configs/tiny.yaml"]),
           "eval": ("jaxagent.eval", ["--policy", "nowhere", "--tasks", "none.jsonl"]),
           "rollout_server": ("rollout_server.__main__", ["--config", "configs/server_tiny.yaml"]),
           "router": ("rollout_server.router", ["--backends", "http://127.0.0.1:9"]),
           "envs.server": ("envs.server", []), "envs.play": ("envs.play", ["--task-file", "x"])}
  module, argv = mains[entry]
  main = importlib.import_module(module).main
  for var, bad in ((KEY.env, "two words"), (control.CONTROL.env, "caf\u00e9-token"),
                   (KEY.env, "line\nend")):
    monkeypatch.delenv(KEY.env, raising=False)
    monkeypatch.delenv(control.CONTROL.env, raising=False)
    monkeypatch.setenv(var, bad)
    assert main(argv) == 2, (entry, var)
    err = capsys.readouterr().err
    assert f"error: {var}: a token is visible ASCII" in err and bad not in err, err

"""The run's control token (`jaxagent.control`): a server's and a router's control
routes answer only the run's processes; the gateway's routes stay open to agents."""

import asyncio
import contextlib
import os
import time

import httpx
import pytest

from jaxagent import control
from rollout_server.router import create_router
from rollout_server.serving import ServerThread
from tests.rollout_server.conftest import running_server

TOKEN = "run-token-" + "x" * 30
RULED = {control.HEADER: TOKEN}
BODY = {"input_ids": [1, 2, 3], "max_new_tokens": 3}


def _export(params, tmp_path, version: int) -> str:
  import jax
  from jaxagent.checkpoint import export_policy

  root = str(tmp_path / "policy")
  export_policy(root, version, jax.device_put(params), dtype=None)
  return root


def _control_calls(c: httpx.Client) -> dict:
  """Each control route, called with what it would take (a body past its guard)."""
  return {
      "update_weights": lambda h: c.post("/update_weights", json={"path": "/no/such"},
                                         headers=h),
      "abort": lambda h: c.post("/abort", json={"request_id": "nobody"}, headers=h),
      "handover": lambda h: c.post("/handover", headers=h, json={
          "session_id": "s", "turns": [{"prompt_ids": [1], "output_ids": [2]}]}),
      "delete": lambda h: c.delete("/sessions/nobody", headers=h),
  }


def test_a_servers_control_routes_take_the_run_token_and_its_gateway_none(
    random_params, tokenizer, tmp_path):
  root = _export(random_params, tmp_path, 5)
  with running_server(random_params, tokenizer, control_token=TOKEN) as (srv, _):
    c = httpx.Client(base_url=srv.url, timeout=120)
    for name, call in _control_calls(c).items():
      for headers, why in (({}, "has no"), ({control.HEADER: TOKEN[:-1] + "y"}, "wrong"),
                           ({control.HEADER: ""}, "wrong")):
        r = call(headers)
        assert r.status_code == 401, (name, r.text)
        assert why in r.text and control.ENV in r.text and TOKEN not in r.text, r.text
      # (refused before its body's fields are checked: a 401, not a 422 naming them)
      if name != "delete":
        assert c.post(f"/{name}", json={"junk": 1}).status_code == 401
    ruled = {name: call(RULED).status_code for name, call in _control_calls(c).items()}
    # past the guard: each route's own answer (no export there; nothing to abort; a
    # handover it checks; no such session)
    assert ruled == {"update_weights": 400, "abort": 200, "handover": 422, "delete": 404}, ruled

    # The gateway's routes take no token: an agent plays, reads its record, asks how a
    # turn stands, and lists the models.
    assert c.post("/generate", json=BODY, headers={"X-Session-Id": "a"}).status_code == 200
    assert c.get("/sessions/a").status_code == 200
    assert c.get("/requests", params={"session_id": "a"}).status_code == 200
    assert c.get("/v1/models").status_code == 200
    assert c.get("/health").json()["control_token"] is True
    assert c.get("/control").status_code == 401  # (the check: 200 for the run's token)
    assert c.get("/control", headers=RULED).json()["control"] == "ok"
    # ... but not its record's delete, nor a new policy.
    assert c.delete("/sessions/a").status_code == 401
    assert c.delete("/sessions/a", headers=RULED).status_code == 200
    r = c.post("/update_weights", json={"path": root}, headers=RULED)
    assert r.status_code == 200 and r.json()["version"] == 5, r.text
  with running_server(random_params, tokenizer) as (srv, _):  # no token: open, and said
    assert httpx.get(f"{srv.url}/health").json()["control_token"] is False
    assert httpx.post(f"{srv.url}/abort", json={"request_id": "x"}).status_code == 200


def test_a_router_guards_its_control_routes_and_rules_its_backends_with_the_token(
    random_params, tokenizer, tmp_path):
  """The router's own control calls (a policy's push, a session's delete, a failed-over
  session's handover) carry the token to guarded backends; a client's token is not
  passed on; a router without the token is refused by them."""
  root = _export(random_params, tmp_path, 5)
  with contextlib.ExitStack() as stack:
    servers = [stack.enter_context(running_server(random_params, tokenizer,
                                                  control_token=TOKEN))[0] for _ in range(2)]
    urls = [s.url for s in servers]
    router = stack.enter_context(ServerThread(create_router(urls, control_token=TOKEN,
                                                            health_interval_s=0.2)))
    c = httpx.Client(base_url=router.url, timeout=120)
    assert c.post("/update_weights", json={"path": root}).status_code == 401
    r = c.post("/update_weights", json={"path": root}, headers=RULED)
    assert r.status_code == 200 and [x["body"]["version"] for x in r.json()["results"]] \
        == [5, 5], r.text
    assert c.get("/health").json()["control_token"] is True

    r = c.post("/generate", json=BODY, headers={"X-Session-Id": "s1"})
    home = r.headers["x-routed-to"]
    assert c.delete("/sessions/s1").status_code == 401
    assert c.delete("/sessions/s1", headers=RULED).status_code == 200
    assert httpx.get(f"{home}/sessions/s1").status_code == 404  # gone from its backend
    # A client's token is not forwarded: through the router, the backend's guarded
    # route is not reached with it (the router's own answers: /abort is refused there).
    assert c.post("/abort", json={"request_id": "x"}, headers=RULED).status_code == 403

    # A session failed over: the other backend takes its threads (a handover, ruled).
    ask = [{"role": "user", "content": "say something"}]
    r = c.post("/v1/chat/completions", headers={"X-Session-Id": "s2"},
               json={"messages": ask, "max_tokens": 4})
    s2_home, reply = r.headers["x-routed-to"], r.json()["choices"][0]["message"]
    servers[urls.index(s2_home)].stop()
    r = c.post("/v1/chat/completions", headers={"X-Session-Id": "s2"}, json={
        "messages": ask + [reply, {"role": "user", "content": "more"}], "max_tokens": 4})
    assert r.status_code == 200 and r.headers["x-routed-to"] != s2_home
    health = c.get("/router/health").json()
    assert health["handovers"] == 1 and health["handovers_failed"] == 0, health


@pytest.mark.parametrize("router_token", [None, "another-token"])
def test_a_router_its_servers_refuse_says_so(random_params, tokenizer, tmp_path, caplog,
                                             router_token):
  """A router without the servers' token, or with another: its /health names them, it
  warns once of each (it warned at each health check for each session owed a delete: 81
  lines in 35 s, a new user's round), its updates' 502 says the router's token is the
  cause (the servers' own 401 said the call had none), its deletes are a 502, and a
  learner stops at its start."""
  import logging

  root = _export(random_params, tmp_path, 5)
  caplog.set_level(logging.WARNING, logger="rollout_server.router")
  with contextlib.ExitStack() as stack:
    servers = [stack.enter_context(running_server(random_params, tokenizer,
                                                  control_token=TOKEN))[0] for _ in range(2)]
    router = stack.enter_context(ServerThread(create_router(
        [s.url for s in servers], health_interval_s=0.2, control_token=router_token)))
    c = httpx.Client(base_url=router.url, timeout=120)
    r = c.post("/update_weights", json={"path": root},
               headers=control.headers(router_token))
    assert r.status_code == 502 and [x["status"] for x in r.json()["results"]] == [401, 401]
    why = "it has none" if router_token is None else "it holds another"
    assert f"refused this router's control token ({why})" in r.json()["detail"], r.text
    # A delete its servers refuse is said, not reported done (it was a 200, the record
    # left there: red team 30) ...
    home = c.post("/generate", json=BODY, headers={"X-Session-Id": "kept"}
                  ).headers["x-routed-to"]
    r = c.delete("/sessions/kept", headers=control.headers(router_token))
    assert r.status_code == 502 and control.ENV in r.text and home in r.text, r.text
    assert httpx.get(f"{home}/sessions/kept").status_code == 200
    # ... and its /health names the servers it cannot rule, which a learner reads at its
    # start (with a token of its own or none).
    from rollout_server.client import GenerateError, HttpClient

    deadline = time.monotonic() + 30
    while sorted(c.get("/health").json().get("backends_need_token", [])) != sorted(
        s.url for s in servers):
      assert time.monotonic() < deadline, c.get("/health").json()
      time.sleep(0.1)

    async def start():
      client = HttpClient(router.url, control_token=router_token or TOKEN)
      try:
        await client.wait_ready(10)
      finally:
        await client.aclose()

    with pytest.raises(GenerateError, match="the router at .* cannot use its servers'"):
      asyncio.run(start())
    time.sleep(1.0)  # (five health rounds more: nothing said again)
    said = [r.getMessage() for r in caplog.records if "refuses this router's" in
            r.getMessage() or "refused to delete" in r.getMessage()]
    assert len(said) == 2 and all(any(s.url in m for m in said) for s in servers), said


def test_the_routers_guard_holds_alone(random_params, tokenizer):
  """A router holding the token in front of a server that holds none (started by hand):
  `DELETE //sessions/x` fell to the router's pass-through, which forwarded it as the
  backend's `DELETE /sessions/x`, past the router's guard (red team 30)."""
  with running_server(random_params, tokenizer) as (srv, _):
    with ServerThread(create_router([srv.url], control_token=TOKEN)) as router:
      c = httpx.Client(base_url=router.url, timeout=120)
      assert c.post("/generate", json=BODY, headers={"X-Session-Id": "v"}).status_code == 200
      for path in ("//sessions/v", "///sessions/v", "/./sessions/v", "/sessions/v/",
                   "/%2Fsessions/v", "/v1/../sessions/v"):
        r = c.request("DELETE", router.url + path)
        assert r.status_code in (401, 404, 405), (path, r.status_code, r.text)
        assert httpx.get(f"{srv.url}/sessions/v").status_code == 200, path
      assert c.delete("/sessions/v", headers=RULED).status_code == 200
      assert httpx.get(f"{srv.url}/sessions/v").status_code == 404


def test_a_blank_token_is_none(random_params, tokenizer):
  """`control_token=""` said guarded and let a blank header in: blank is none."""
  with running_server(random_params, tokenizer, control_token="") as (srv, _):
    assert httpx.get(f"{srv.url}/health").json()["control_token"] is False
  assert control.allows("", None) and control.allows(None, None)
  assert not control.allows("t", "") and not control.allows("t", None)


def test_a_client_carries_the_token_and_says_at_once_when_it_has_none(
    random_params, tokenizer, tmp_path, monkeypatch):
  from rollout_server.client import GenerateError, HttpClient

  root = _export(random_params, tmp_path, 5)
  monkeypatch.delenv(control.ENV, raising=False)

  async def go(url):
    from jaxagent import config as config_lib
    from jaxagent.eval import check_control

    # (`eval --server` with a black-box agent: said before its episodes, each of which
    # would fail to clear its record)
    with pytest.raises(config_lib.ConfigError, match=f"--server: .*{control.ENV}"):
      await check_control(url)
    bare = HttpClient(url)
    with pytest.raises(GenerateError, match=control.ENV):
      await bare.wait_ready(10)
    with pytest.raises(GenerateError, match="401"):
      await bare.update_weights(root, 5)
    await bare.aclose()
    monkeypatch.setenv(control.ENV, "not-the-servers")  # another: said at the start too
    wrong = HttpClient(url)
    with pytest.raises(GenerateError, match=f"refuses this process's control token: its "
                                            f"{control.ENV} differs"):
      await wrong.wait_ready(10)
    with pytest.raises(GenerateError, match="differs from the servers'"):
      await wrong.update_weights(root, 5)
    await wrong.aclose()
    with pytest.raises(config_lib.ConfigError, match="differs"):
      await check_control(url)
    monkeypatch.setenv(control.ENV, TOKEN)  # (as launch gives it to its processes)
    ruled = HttpClient(url)
    await ruled.wait_ready(10)
    await check_control(url)
    assert (await ruled.update_weights(root, 5))["version"] == 5
    await ruled.aclose()

  with running_server(random_params, tokenizer, control_token=TOKEN) as (srv, _):
    asyncio.run(go(srv.url))


def test_a_blackbox_episode_clears_and_takes_its_record_with_the_token(random_params):
  from envs.base import TaskSpec, make
  from jaxagent.blackbox import run_blackbox
  from jaxagent.config import AgentConfig
  from tests.test_agent import TOK

  task = TaskSpec("t", "guess_number", {"secret": 3, "max_turns": 2})
  config = AgentConfig(max_turns=2, max_new_tokens=3)
  with running_server(random_params, TOK, control_token=TOKEN) as (srv, _):
    ep = asyncio.run(run_blackbox(make("guess_number"), task, srv.url, config,
                                  session_id="bb-1", control_token=TOKEN))
    assert not ep.infra_error and ep.segments, ep.reason
    # (that the record it took is gone: test_blackbox's test of a guarded server; the
    # session id alone, without the wire id's secret, is never recorded)
    ep = asyncio.run(run_blackbox(make("guess_number"), task, srv.url, config,
                                  session_id="bb-2"))
    assert ep.infra_error and "401" in ep.reason and control.ENV in ep.reason, ep.reason


def test_launch_gives_each_token_to_its_holders_alone(tmp_path, monkeypatch):
  """The servers and the learners share the control token, the environment workers and
  the learners the environment token; a worker never gets the control token (it runs the
  policy's code), nor a server the environments'."""
  import argparse

  from jaxagent import config as config_lib
  from jaxagent.launch import plan

  args = argparse.Namespace(config="configs/tiny.yaml", servers=2, env_workers=2,
                            learner_processes=2, resume=False, overrides=[])
  cfg = config_lib.load(config_lib.RunConfig, args.config, args.overrides)
  ctl, envs = control.CONTROL.env, control.ENVS.env
  for shell in (None, "from-the-shell"):
    for var in (ctl, envs):
      if shell:
        monkeypatch.setenv(var, f"{shell}-{var}")
      else:
        monkeypatch.delenv(var, raising=False)
    services, learners = plan(args, cfg, str(tmp_path / "run"))
    servers = [c for c in services if c.name.startswith("server")]
    workers = [c for c in services if c.name.startswith("env")]
    assert len(servers) == 2 and len(workers) == 2 and len(learners) == 2
    given = {var: {c.env[var] for c in holders + learners}
             for var, holders in ((ctl, servers), (envs, workers))}
    for var, tokens in given.items():
      assert tokens == {f"{shell}-{var}"} if shell else (
          len(tokens) == 1 and len(next(iter(tokens))) >= 40), (var, tokens)
    assert given[ctl] != given[envs]
    assert all(ctl not in c.env for c in workers) and all(envs not in c.env for c in servers)
    assert shell or (ctl not in os.environ and envs not in os.environ)


def _guarded_backend():
  """A backend whose control routes take `state["token"]`, answering as `state["instance"]`
  (a restart: a new one), with switches: `down` (its /health fails), `control_503` (its
  GET /control answers 503); it keeps the headers each /generate came with."""
  from fastapi import FastAPI, Request
  from fastapi.responses import JSONResponse

  state = {"token": TOKEN, "instance": "i1", "down": False, "control_503": False,
           "headers": [], "records": {}}
  app = FastAPI()

  def allowed(request: Request) -> bool:
    return request.headers.get(control.HEADER) == state["token"]

  @app.get("/health")
  async def health():
    await asyncio.sleep(state.get("health_s", 0.0))  # (a loaded server answers late)
    if state["down"]:
      return JSONResponse({"status": "down"}, status_code=503)
    return {"status": "ok", "version": 0, "instance": state["instance"], "control_token": True}

  @app.get("/control")
  async def check(request: Request):
    if state["control_503"]:
      return JSONResponse({"detail": "busy"}, status_code=503)
    return JSONResponse({"control": "ok"}, status_code=200 if allowed(request) else 401)

  @app.post("/generate")
  async def generate(request: Request):
    state["headers"].append({k.lower(): v for k, v in request.headers.items()})
    sid = request.headers.get("x-session-id")
    state["records"].setdefault(sid, []).append({"turn": len(state["records"].get(sid, [])),
                                                 "recorded_at": time.time()})
    return {"output_ids": [5], "finish_reason": "length"}

  @app.get("/sessions/{sid}")
  async def read(sid: str, since: int = 0):
    if sid not in state["records"]:
      return JSONResponse({"detail": "none"}, status_code=404)
    turns = state["records"][sid]
    return {"turns": turns[since:], "count": len(turns), "record_id": "r-" + sid}

  @app.delete("/sessions/{sid}")
  async def delete(sid: str, request: Request):
    if not allowed(request):
      return JSONResponse({"detail": "no"}, status_code=401)
    found = state["records"].pop(sid, None) is not None
    return JSONResponse({"deleted": found}, status_code=200 if found else 404)

  return app, state


def test_a_router_asks_again_a_server_restarted_with_another_token_and_owes_it_its_deletes():
  """(A reviewer's mutations passed the tests above: a client's token passed on, a
  restarted server's token never asked again, a delete it refused dropped.) A client's
  token reaches no backend; a server restarted with another token (its first GET
  /control a 503) is found out; a delete it refused while out of rotation stays owed,
  and it stays out, until it takes the delete."""
  app, state = _guarded_backend()

  def until(test, what):
    deadline = time.monotonic() + 20
    while not test():
      assert time.monotonic() < deadline, what
      time.sleep(0.05)

  with ServerThread(app) as backend, ServerThread(create_router(
      [backend.url], control_token=TOKEN, health_interval_s=0.1)) as router:
    c = httpx.Client(base_url=router.url, timeout=30)
    health = lambda: c.get("/router/health").json()["backends"][0]["healthy"]  # noqa: E731
    refusing = lambda: c.get("/health").json()["backends_need_token"]  # noqa: E731
    assert c.post("/generate", json=BODY, headers={"X-Session-Id": "s",
                                                   control.HEADER: "a-client's"}).status_code == 200
    assert control.HEADER.lower() not in state["headers"][-1]  # (its own, not passed on)
    assert refusing() == []

    # Down, the session deleted through the router (owed there), back with another
    # token: the delete is refused, and stays owed; the server stays out of rotation.
    state["down"] = True
    until(lambda: not health(), "the router never saw it down")
    assert c.delete("/sessions/s", headers=RULED).status_code == 200
    state.update(down=False, instance="i2", token="another", control_503=True)
    time.sleep(0.5)
    state["control_503"] = False  # (a 503 said nothing of the token: asked again)
    until(lambda: refusing() == [backend.url], "a restarted server's token never asked")
    time.sleep(0.5)
    assert not health() and "s" in state["records"]
    # Restarted with the run's token: it takes the delete and serves again.
    state.update(instance="i3", token=TOKEN)
    # (both waited on: its GET /control asked in a round that timed out under load keeps
    # the last answer until the next; a CI run beside a benchmark)
    until(lambda: health() and refusing() == [], "the server never came back")
    assert "s" not in state["records"]
    # Restarted again with another token and busy at first, no delete owed: its token is
    # asked again once it answers about it.
    state.update(instance="i4", token="another", control_503=True)
    time.sleep(0.5)
    state["control_503"] = False
    until(lambda: refusing() == [backend.url], "a 503 was taken for the token's answer")


def test_a_learner_meets_a_fresh_router_after_its_first_checks():
  """A router's /health answered before its first round of checks: every backend healthy,
  none refusing its token, so a learner's start check passed a router whose servers
  refuse it (a reviewer). Its /health waits for that round."""
  from rollout_server.client import GenerateError, HttpClient

  app, state = _guarded_backend()
  state["health_s"] = 0.5  # (the router's first round outlasts the learner's first look)

  async def start(url):
    client = HttpClient(url, control_token=TOKEN)
    try:
      await client.wait_ready(10)
    finally:
      await client.aclose()

  with ServerThread(app) as backend:
    for _ in range(3):  # (the in-process router of a learner: made just before its check)
      with ServerThread(create_router([backend.url], health_interval_s=600)) as router:
        with pytest.raises(GenerateError, match="cannot use its servers' control routes"):
          asyncio.run(start(router.url))


def test_the_guarded_routes_are_the_control_routes(random_params, tokenizer):
  """Which routes take the token, on a server and a router: a route added without it, or
  given it, shows here."""
  from rollout_server.router import create_router

  def guarded(app):
    return {(method, r.path) for r in app.routes if getattr(r, "dependant", None)
            and any(d.call.__name__ == "controlled" for d in r.dependant.dependencies)
            for method in r.methods}

  with running_server(random_params, tokenizer, control_token=TOKEN) as (srv, _):
    server_app = srv.server.config.app
    assert guarded(server_app) == {
        ("POST", "/update_weights"), ("POST", "/abort"), ("POST", "/handover"),
        ("DELETE", "/sessions/{session_id:path}"), ("GET", "/control")}
  assert guarded(create_router(["http://127.0.0.1:9"], control_token=TOKEN)) == {
      ("POST", "/update_weights"), ("DELETE", "/sessions/{session_id:path}"),
      ("GET", "/control"), ("POST", "/router/policy")}


def test_a_learner_holds_the_runs_tokens_out_of_the_environment_its_programs_inherit(
    monkeypatch):
  """A reviewer: `launch local` gives the learner both tokens in its environment, which a
  black-box harness's programs (a coding agent's command line) inherited. The learner's
  command takes them out of it and keeps them for its own calls."""
  import subprocess
  import sys

  from jaxagent import control

  monkeypatch.setenv(control.CONTROL.env, "c" * 43)
  monkeypatch.setenv(control.ENVS.env, "e" * 43)
  monkeypatch.setattr(control, "_held", {})
  control.hold_tokens()
  assert control.CONTROL.env not in __import__("os").environ
  assert control.from_env() == "c" * 43 and control.ENVS.from_env() == "e" * 43
  child = subprocess.run([sys.executable, "-c", "import os; print(sorted(k for k in "
                          "os.environ if k.startswith('JAXAGENT_')))"],
                         capture_output=True, text=True, check=True)
  assert "TOKEN" not in child.stdout


def test_a_service_listening_beyond_this_machine_without_its_token_is_refused(
    monkeypatch, capsys):
  """A reviewer: a server, router or environment worker given --host 0.0.0.0 and no
  token served its control (or session) routes to anyone who reached it (loading any
  file as weights, running code in its sandboxes), and said so in one line. It is
  refused unless given --open-routes; loopback and a token are as before."""
  from envs import server as env_server
  from jaxagent import control
  from rollout_server import __main__ as server_main, router

  monkeypatch.delenv(control.CONTROL.env, raising=False)
  monkeypatch.delenv(control.ENVS.env, raising=False)
  monkeypatch.setattr(control, "_held", {})
  for main, args, key in (
      (server_main.main, ["--config", "configs/server_tiny.yaml"], control.CONTROL),
      (router.main, ["--backends", "http://127.0.0.1:1"], control.CONTROL),
      (env_server.main, [], control.ENVS)):
    for host in ("0.0.0.0", "10.1.2.3", "my-host.example"):
      assert main([*args, "--host", host, "--port", "1"]) == 2, (main, host)
      err = capsys.readouterr().err
      assert f"listening on {host} (beyond this machine) with {key.env} unset" in err, err
  for host in ("127.0.0.1", "::1", "localhost", "[::1]"):
    assert control.open_beyond_this_machine(control.CONTROL, None, host) is None, host
  assert control.open_beyond_this_machine(control.CONTROL, "t" * 43, "0.0.0.0") is None

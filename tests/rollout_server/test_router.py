"""Router: consistent hashing on the session id, health checks, failover; real servers."""

import contextlib

import httpx
import pytest

from rollout_server.router import HashRing, create_router
from rollout_server.serving import ServerThread
from tests.rollout_server.conftest import running_server


def test_ring_spreads_keys_and_moves_few_on_removal():
  ring3 = HashRing(["a", "b", "c"])
  ring2 = HashRing(["a", "b"])
  owners = [ring3.candidates(str(i))[0] for i in range(3000)]
  assert all(owners.count(b) > 600 for b in "abc")
  # Removing c only moves c's keys.
  assert all(ring2.candidates(str(i))[0] == o for i, o in enumerate(owners) if o != "c")
  assert sorted(ring3.candidates("x")) == ["a", "b", "c"]
  with pytest.raises(ValueError):
    HashRing([])


def test_sessions_stick_and_fail_over(random_params, tokenizer):
  with contextlib.ExitStack() as stack:
    servers = [stack.enter_context(running_server(random_params, tokenizer, version=v))[0]
               for v in (1, 2)]
    # Health checks only at start: the failover below must come from the failed request.
    router = stack.enter_context(ServerThread(create_router([s.url for s in servers],
                                                            health_interval_s=600)))
    c = httpx.Client(base_url=router.url, timeout=120)
    body = {"input_ids": [1, 2, 3], "max_new_tokens": 3}
    routed = {}
    for i in range(12):
      sid = f"session-{i}"
      seen = {c.post("/generate", json=body, headers={"X-Session-Id": sid})
              .headers["x-routed-to"] for _ in range(3)}
      assert len(seen) == 1  # every turn of a session lands on one server
      routed[sid] = seen.pop()
    assert set(routed.values()) == {s.url for s in servers}  # sessions spread over both
    # The session's record lives where its turns ran; the router finds it.
    turns = c.get("/sessions/session-0").json()["turns"]
    assert len(turns) == 3
    assert c.get("/router/health").json()["backends"][0]["healthy"]

    # Take down the server of session-0: its next turn fails over to the other one.
    victim = next(s for s in servers if s.url == routed["session-0"])
    victim.stop()
    r = c.post("/generate", json=body, headers={"X-Session-Id": "session-0"})
    assert r.status_code == 200 and r.headers["x-routed-to"] != victim.url
    health = c.get("/router/health").json()
    assert health["failovers"] >= 1
    assert {b["url"]: b["healthy"] for b in health["backends"]}[victim.url] is False
    assert c.get("/health").status_code == 200  # one healthy backend left


def test_update_weights_goes_to_every_backend(random_params, tokenizer, tmp_path):
  import jax
  from jaxagent.checkpoint import export_policy

  root = str(tmp_path / "policy")
  export_policy(root, 5, jax.device_put(random_params), dtype=None)
  with contextlib.ExitStack() as stack:
    servers = [stack.enter_context(running_server(random_params, tokenizer))[0]
               for _ in range(2)]
    router = stack.enter_context(ServerThread(create_router([s.url for s in servers])))
    r = httpx.post(f"{router.url}/update_weights", json={"path": root}, timeout=120)
    assert r.status_code == 200, r.text
    assert [x["body"]["version"] for x in r.json()["results"]] == [5, 5]
    for s in servers:
      assert httpx.get(f"{s.url}/health").json()["version"] == 5

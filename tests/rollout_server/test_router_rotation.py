"""The router's backends in rotation: their connection pools, the policy they are held to
while it is pushed or updated, and what their /health may say (`router_backends`)."""

import asyncio
import concurrent.futures
import json
import logging
import threading
import time

import httpx
import pytest

from rollout_server.router import create_router
from rollout_server.router_backends import Rotation
from rollout_server.serving import ServerThread


def _backend(state: dict):
  """A fake rollout server: /health names `state["version"]` (and `state["instance"]`),
  /update_weights takes `state["update_s"]` and then serves the version it was sent
  (refuses with `state["refuse"]`), /generate waits while `state["hold"]` is set; /health
  answers what it was `state["health_s"]` before."""
  from fastapi import FastAPI, Request
  from fastapi.responses import JSONResponse

  app = FastAPI()

  @app.get("/health")
  async def health():
    if not state.get("up", True):
      return JSONResponse({"status": "down"}, status_code=503)
    said = {"status": "ok", "version": state["version"], "policy_id": None,
            "instance": state.get("instance", "one")}
    await asyncio.sleep(state.get("health_s", 0.0))  # (said, on its way: as it was)
    return said

  @app.post("/update_weights")
  async def update(request: Request):
    body = await request.json()
    state["updating"] = True
    await asyncio.sleep(state.get("update_s", 0.0))
    state["updating"] = False
    if state.get("refuse"):
      return JSONResponse({"detail": "cannot load it"}, status_code=500)
    if body.get("model") not in (None, "jaxagent"):  # (another served model's, as a
      # server's: the policy is None in its answer, however the request named it)
      state.setdefault("models", {})[body["model"]] = body["version"]
      return {"version": body["version"], "model": body["model"]}
    state["version"] = body.get("version", state.get("latest"))  # (none: the latest export)
    return {"version": state["version"], "model": None}

  @app.post("/generate")
  async def generate():
    state["in_flight"] = state.get("in_flight", 0) + 1
    try:
      while state.get("hold") is not None and state["hold"].is_set():
        await asyncio.sleep(0.05)
      return {"output_ids": [5], "finish_reason": "length", "version": state["version"]}
    finally:
      state["in_flight"] -= 1

  return app


def _healthy(router_url: str) -> dict:
  got = httpx.get(f"{router_url}/router/health", timeout=10).json()
  return {b["url"]: b["healthy"] for b in got["backends"]}


def _while_running(job: concurrent.futures.Future, read) -> list:
  """`read()` every 50 ms while `job` runs (a read it outlasted is left out)."""
  seen = []
  while not job.done():
    now = read()
    if not job.done():
      seen.append(now)
    time.sleep(0.05)
  return seen


def test_turns_past_a_hundred_in_flight_leave_health_checks_and_updates_alone():
  """On one pool of 100 connections, 101 turns in flight made the health checks wait for a
  connection past their 5 s: every backend went out of rotation and /update_weights
  answered 503 (a reviewer). Turns have a pool of their own (`max_connections`)."""
  hold = threading.Event()
  hold.set()
  state = {"version": 0, "hold": hold}
  with ServerThread(_backend(state)) as b, \
      ServerThread(create_router([b.url], health_interval_s=0.2, health_timeout_s=1.0)) as r:

    async def turns(n):
      async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=n)) as c:
        return await asyncio.gather(*(
            c.post(f"{r.url}/generate", json={"input_ids": [1]},
                   headers={"X-Session-Id": f"s{i}"}) for i in range(n)))

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      sent = pool.submit(asyncio.run, turns(130))
      deadline = time.time() + 60
      while state.get("in_flight", 0) < 130 and time.time() < deadline:
        time.sleep(0.1)
      assert state["in_flight"] == 130  # (all of them held at the backend at once)
      time.sleep(2.5)  # (past a health check's bound)
      assert _healthy(r.url) == {b.url: True}
      up = httpx.post(f"{r.url}/update_weights", json={"path": "/p", "version": 1}, timeout=60)
      assert up.status_code == 200, up.text
      hold.clear()
      answers = sent.result(timeout=60)
    assert [a.status_code for a in answers] == [200] * 130


def test_a_backend_whose_turns_hang_holds_only_its_own_connections():
  """The turns of every backend shared one pool: a backend whose turns hung (its /health
  answering) took all of its connections, and another's turns were 503s after 30 s (a
  reviewer). Each backend has its own."""
  from rollout_server.routing import HashRing

  hold = threading.Event()
  hold.set()
  a, b = {"version": 0}, {"version": 0, "hold": hold}
  with ServerThread(_backend(a)) as sa, ServerThread(_backend(b)) as sb, ServerThread(
      create_router([sa.url, sb.url], health_interval_s=0.2, max_connections=3)) as r:
    ring = HashRing([sa.url, sb.url])
    on = {url: [f"s{i}" for i in range(100) if ring.candidates(f"s{i}")[0] == url][:3]
          for url in (sa.url, sb.url)}

    async def turns(sessions):
      async with httpx.AsyncClient(timeout=120) as c:
        return await asyncio.gather(*(
            c.post(f"{r.url}/generate", json={"input_ids": [1]},
                   headers={"X-Session-Id": s}) for s in sessions))

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      held = pool.submit(asyncio.run, turns(on[sb.url]))
      deadline = time.time() + 60
      while b.get("in_flight", 0) < 3 and time.time() < deadline:
        time.sleep(0.1)
      assert b["in_flight"] == 3  # (its every connection)
      t0 = time.monotonic()
      answers = asyncio.run(turns(on[sa.url]))
      assert [x.status_code for x in answers] == [200] * 3, [x.text for x in answers]
      assert time.monotonic() - t0 < 10
      hold.clear()
      assert [x.status_code for x in held.result(timeout=60)] == [200] * 3


def test_a_backend_is_out_of_rotation_while_it_catches_up_and_while_an_update_goes_on():
  """A backend that restarted (on its first weights) took turns while the router pushed
  the policy to it; and one that came back during an update (skipped by it) was let in
  on the old policy, and served it on (a reviewer). Neither is in rotation until it
  serves the router's policy."""
  a, b = {"version": 0}, {"version": 0}
  with ServerThread(_backend(a)) as sa, ServerThread(_backend(b)) as sb, \
      ServerThread(create_router([sa.url, sb.url], health_interval_s=0.1)) as r:
    assert httpx.post(f"{r.url}/update_weights", json={"path": "/p", "version": 1},
                      timeout=60).status_code == 200
    # A restarts on its first weights; the push of the policy to it takes 1.5 s.
    a.update(version=0, instance="two", update_s=1.5)
    deadline = time.time() + 10
    while not a.get("updating") and time.time() < deadline:
      time.sleep(0.02)
    assert a.get("updating") and _healthy(r.url)[sa.url] is False  # (out while it loads)
    while a["version"] != 1 and time.time() < deadline:
      time.sleep(0.05)
    time.sleep(0.4)
    assert _healthy(r.url) == {sa.url: True, sb.url: True}

    # A goes down; an update (B slow to take it) goes on while A comes back on version 1.
    a.update(up=False, update_s=0.0)
    while _healthy(r.url)[sa.url] and time.time() < deadline:
      time.sleep(0.05)
    b["update_s"] = 1.5
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      update = pool.submit(httpx.post, f"{r.url}/update_weights",
                           json={"path": "/p", "version": 2}, timeout=60)
      while not b.get("updating") and time.time() < deadline:
        time.sleep(0.02)
      a["up"] = True
      seen = _while_running(update, lambda: _healthy(r.url)[sa.url])
      assert update.result().status_code == 200
    assert seen and not any(seen), seen  # (out while the update went on without it)
    deadline = time.time() + 10
    while not _healthy(r.url)[sa.url] and time.time() < deadline:
      time.sleep(0.05)
    assert _healthy(r.url)[sa.url] and a["version"] == 2  # (back in on the new policy)


def test_an_update_is_given_as_long_as_the_turns_it_drains():
  """The router's update call had its 600 s client bound, under a drain's (the turns in
  flight, each up to `turn_timeout_s`): a backend that took the update after the router
  gave up was caught up to the old policy at its next check, rolled back."""
  state = {"version": 0, "update_s": 2.0}
  with ServerThread(_backend(state)) as b, \
      ServerThread(create_router([b.url], timeout_s=0.5, turn_timeout_s=5.0)) as r:
    up = httpx.post(f"{r.url}/update_weights", json={"path": "/p", "version": 1}, timeout=60)
    assert up.status_code == 200 and up.json()["version"] == 1, up.text


def test_a_health_version_that_is_no_version_is_a_backend_not_well(caplog):
  """A /health naming a list as its version made the mix of versions unhashable, and the
  health loop died: no backend was checked again (a reviewer)."""
  caplog.set_level(logging.WARNING, logger="rollout_server.router")
  a, b = {"version": [1]}, {"version": 0}
  with ServerThread(_backend(a)) as sa, ServerThread(_backend(b)) as sb, \
      ServerThread(create_router([sa.url, sb.url], health_interval_s=0.1)) as r:
    time.sleep(0.6)
    assert _healthy(r.url) == {sa.url: False, sb.url: True}
    a["version"] = 0
    time.sleep(0.6)
    assert _healthy(r.url) == {sa.url: True, sb.url: True}  # (the loop went on)
  said = [x.getMessage() for x in caplog.records if "out of rotation" in x.getMessage()]
  assert any("names version [1]" in s for s in said), said


def test_a_failover_tries_a_backend_out_of_rotation_only_on_the_routers_policy():
  rot = Rotation(["a", "b", "c", "d"], health_interval_s=1, timeout_s=1, turn_timeout_s=1,
                 max_sessions=10, control_token=None, max_connections=10)
  rot.healthy.update(a=False, b=True, c=False, d=False)
  rot.serves.update(a=(2, None), c=(1, None))
  assert rot.in_order(["a", "b", "c", "d"]) == ["b", "a", "c", "d"]  # (no policy pinned yet)
  rot.policy["version"] = 2
  assert rot.in_order(["a", "b", "c", "d"]) == ["b", "a"]
  # (none in rotation or on the policy: one whose version is not known; one known on
  # another, or gone, never: red team 43)
  rot.healthy["b"] = False
  rot.serves["a"] = (1, None)
  rot.gone("d").set()
  assert rot.in_order(["a", "b", "c", "d"]) == ["b"]
  rot.serves["b"] = (0, None)
  assert rot.in_order(["a", "b", "c", "d"]) == []


def test_deletes_owed_past_the_bound_are_said_once(caplog):
  caplog.set_level(logging.WARNING, logger="rollout_server.router")
  rot = Rotation(["a"], health_interval_s=1, timeout_s=1, turn_timeout_s=1, max_sessions=2,
                 control_token=None, max_connections=10)
  for sid in ("s1", "s2", "s3", "s4"):
    rot.must_delete("a", sid)
  assert list(rot.undeleted["a"]) == ["s3", "s4"]
  said = [x.getMessage() for x in caplog.records if "session deletes" in x.getMessage()]
  assert len(said) == 1 and "the oldest are forgotten" in said[0], said


def test_a_backend_that_dies_mid_answer_is_a_502_in_the_apis_shape_not_the_routers_500():
  """A turn's whole answer read after its headers: a backend that closed the connection
  in its body raised out of the router (a 500 without a word; a reviewer)."""
  import socket

  listener = socket.socket()
  listener.bind(("127.0.0.1", 0))
  listener.listen(16)
  url = f"http://127.0.0.1:{listener.getsockname()[1]}"

  def serve():  # (headers promising 1000 bytes, then a cut)
    while True:
      try:
        conn, _ = listener.accept()
      except OSError:
        return
      with conn:
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: 1000\r\n\r\n{\"id\": ")

  threading.Thread(target=serve, daemon=True).start()
  try:
    with ServerThread(create_router([url], health_interval_s=600)) as r:
      got = httpx.post(f"{r.url}/v1/chat/completions", timeout=30,
                       json={"messages": [{"role": "user", "content": "hi"}]})
      assert got.status_code == 502, got.text
      assert "mid-answer" in got.json()["error"]["message"]
      assert httpx.get(f"{r.url}/router/health").json()["streams_cut"] == 1
  finally:
    listener.close()


def test_a_body_over_the_bound_is_refused_in_the_apis_own_error_shape(random_params, tokenizer):
  """A 413 of the body bound was FastAPI's `detail` on every path, at a server and at a
  router: the `openai` client read 'Error code: 413' and no more."""
  from tests.rollout_server.conftest import running_server

  with running_server(random_params, tokenizer, max_body_bytes=4096) as (srv, _), \
      ServerThread(create_router([srv.url], max_body_bytes=4096)) as r:
    for url in (srv.url, r.url):
      big = {"messages": [{"role": "user", "content": "x" * 8000}]}
      got = httpx.post(f"{url}/v1/chat/completions", json=big, timeout=30)
      assert got.status_code == 413
      assert "request body over 4096 bytes" in got.json()["error"]["message"], got.text
      got = httpx.post(f"{url}/v1/messages", json=big, timeout=30)
      assert got.status_code == 413 and got.json()["type"] == "error", got.text
      got = httpx.post(f"{url}/generate", json={"input_ids": [1] * 3000}, timeout=30)
      assert got.status_code == 413 and "request body over" in got.json()["detail"]


def test_a_copy_that_fails_part_way_is_copied_whole_again_not_twice(monkeypatch):
  """A copy that raised after some of its turns were appended kept them, and the next
  copy (its place not moved) appended them again: a turn twice in the record."""
  from rollout_server.sessions import SessionStore
  from tests.rollout_server.test_router import _recording_backend

  real = SessionStore.extend
  fail = {"once": True}

  def extend(self, session_id, turns, number=False):
    if fail.pop("once", False):
      real(self, session_id, turns[:1], number=number)
      raise RuntimeError("disk on fire")
    return real(self, session_id, turns, number=number)

  monkeypatch.setattr(SessionStore, "extend", extend)
  fake, _state = _recording_backend()
  with ServerThread(fake) as b, ServerThread(create_router([b.url], health_interval_s=600)) as r:
    c = httpx.Client(base_url=r.url, timeout=30)
    for _ in range(2):
      assert c.post("/generate", json={"input_ids": [1]},
                    headers={"X-Session-Id": "s"}).status_code == 200
    assert [t["output_ids"] for t in c.get("/sessions/s").json()["turns"]] == [[0], [1]]


def test_turns_on_a_backend_gone_without_a_word_are_cut_not_held(caplog):
  """A backend whose host went away without resetting its connections (a node gone, a
  partition) held each of its streams and turns up to `turn_timeout_s` (an hour; a
  reviewer). Once its /health goes unanswered `UNREACHABLE_CHECKS` times in a row, its
  streams end with the API's error event and its turns answer 502; answering again, it
  takes turns again."""
  from fastapi import FastAPI, Request
  from fastapi.responses import StreamingResponse

  from rollout_server.router_backends import UNREACHABLE_CHECKS

  caplog.set_level(logging.WARNING, logger="rollout_server.router")
  state = {"hang": False}
  app = FastAPI()

  @app.get("/health")
  async def health():
    while state["hang"]:
      await asyncio.sleep(0.05)
    return {"status": "ok", "version": 0}

  @app.post("/v1/chat/completions")
  async def chat(request: Request):
    body = await request.json()

    async def events():
      yield b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n'
      while True:  # (silent from here on: its host is gone)
        await asyncio.sleep(0.05)
    if body.get("stream"):
      return StreamingResponse(events(), media_type="text/event-stream")
    while state["hang"] or not body.get("quick"):
      await asyncio.sleep(0.05)
    return {"choices": [{"message": {"role": "assistant", "content": "a"}}]}

  chat_body = {"messages": [{"role": "user", "content": "hi"}]}
  with ServerThread(app) as b, \
      ServerThread(create_router([b.url], health_interval_s=0.1, health_timeout_s=0.3)) as r:
    got = {}

    def stream():
      with httpx.stream("POST", f"{r.url}/v1/chat/completions", json={**chat_body, "stream": True},
                        timeout=60) as s:
        got["stream"] = b"".join(s.iter_raw())

    def turn():
      got["turn"] = httpx.post(f"{r.url}/v1/chat/completions", json=chat_body, timeout=60)

    threads = [threading.Thread(target=stream), threading.Thread(target=turn)]
    for t in threads:
      t.start()
    time.sleep(0.5)
    state["hang"] = True
    t0 = time.time()
    for t in threads:
      t.join(timeout=30)
    assert time.time() - t0 < 30 and not any(t.is_alive() for t in threads)
    assert got["stream"].startswith(b'data: {"choices"'), got["stream"]
    assert b"went away mid-stream (unreachable" in got["stream"], got["stream"]
    assert got["turn"].status_code == 502, got["turn"].text
    assert "unreachable mid-turn" in got["turn"].json()["error"]["message"]
    state["hang"] = False
    deadline = time.time() + 10
    while not _healthy(r.url)[b.url] and time.time() < deadline:
      time.sleep(0.05)
    again = httpx.post(f"{r.url}/v1/chat/completions", json={**chat_body, "quick": True},
                       timeout=30)
    assert again.status_code == 200, again.text
  said = [x.getMessage() for x in caplog.records if "health checks in a row" in x.getMessage()]
  assert said == [f"router: {b.url} has not answered {UNREACHABLE_CHECKS} health checks in a "
                  "row: its turns in flight are cut"], said


def test_a_check_that_outlasts_an_update_holds_the_backend_to_the_policy_after_it():
  """A check read the policy before its /health answered: one landing after an update
  took a backend that had taken the update out of rotation and pushed the policy to it
  again (a drain and a load more), and put one that had refused it back in on the old
  policy (a reviewer)."""
  state = {"version": 0}
  with ServerThread(_backend(state)) as b, \
      ServerThread(create_router([b.url], health_interval_s=0.05)) as r:
    assert httpx.post(f"{r.url}/update_weights", json={"path": "/p", "version": 1},
                      timeout=30).status_code == 200
    pushes = httpx.get(f"{r.url}/router/health").json()["policy_pushes"]
    state["health_s"] = 0.6  # (a busy server: a check now waits on its /health)
    time.sleep(0.1)
    assert httpx.post(f"{r.url}/update_weights", json={"path": "/p", "version": 2},
                      timeout=30).status_code == 200
    seen = []
    for _ in range(12):
      seen.append(_healthy(r.url)[b.url])
      time.sleep(0.1)
    assert all(seen), seen
    assert httpx.get(f"{r.url}/router/health").json()["policy_pushes"] == pushes
  taking, refusing = {"version": 0}, {"version": 0}
  with ServerThread(_backend(taking)) as a, ServerThread(_backend(refusing)) as b, \
      ServerThread(create_router([a.url, b.url], health_interval_s=0.05)) as r:
    assert httpx.post(f"{r.url}/update_weights", json={"path": "/p", "version": 1},
                      timeout=30).status_code == 200
    refusing.update(health_s=0.6, refuse=True)
    time.sleep(0.1)
    assert httpx.post(f"{r.url}/update_weights", json={"path": "/p", "version": 2},
                      timeout=30).status_code == 502
    for _ in range(12):  # (out until it serves version 2: it refuses every push)
      assert _healthy(r.url) == {a.url: True, b.url: False} and refusing["version"] == 1
      time.sleep(0.1)


def test_one_backends_policy_load_holds_no_other_backends_check():
  """Checks went in rounds: a backend loading the policy (up to `update_timeout`) held
  every other's check, and a backend that died meanwhile was taken for healthy."""
  a, b = {"version": 0}, {"version": 0}
  with ServerThread(_backend(a)) as sa, ServerThread(_backend(b)) as sb, \
      ServerThread(create_router([sa.url, sb.url], health_interval_s=0.1)) as r:
    assert httpx.post(f"{r.url}/update_weights", json={"path": "/p", "version": 1},
                      timeout=30).status_code == 200
    a.update(version=0, instance="two", update_s=5.0)  # A restarts; its load takes 5 s
    deadline = time.time() + 10
    while not a.get("updating") and time.time() < deadline:
      time.sleep(0.02)
    b["up"] = False
    while _healthy(r.url)[sb.url] and time.time() < deadline:
      time.sleep(0.05)
    assert a.get("updating") and _healthy(r.url) == {sa.url: False, sb.url: False}


def test_a_backend_restarted_during_an_update_is_out_until_it_serves_the_policy():
  """One that took an update and restarted (on its first weights) while another was still
  loading it served version 0 in rotation for the whole update (a reviewer)."""
  a, b = {"version": 0}, {"version": 0}
  with ServerThread(_backend(a)) as sa, ServerThread(_backend(b)) as sb, \
      ServerThread(create_router([sa.url, sb.url], health_interval_s=0.1)) as r:
    b["update_s"] = 2.0
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      update = pool.submit(httpx.post, f"{r.url}/update_weights",
                           json={"path": "/p", "version": 1}, timeout=60)
      deadline = time.time() + 10
      while a["version"] != 1 and time.time() < deadline:
        time.sleep(0.02)
      a.update(version=0, instance="two")  # (restarted, on its first weights)
      time.sleep(0.4)
      seen = _while_running(update, lambda: _healthy(r.url)[sa.url])
      assert update.result().status_code == 200
    assert seen and not any(seen), seen
    while not _healthy(r.url)[sa.url] and time.time() < deadline:
      time.sleep(0.05)
    assert _healthy(r.url)[sa.url] and a["version"] == 1


def test_an_update_naming_the_policy_by_its_name_is_the_policys_and_pinned():
  """The router pinned only updates that named no model: one naming the policy by its
  own name (as OpenAI clients send one) was read as another model's, and the next check
  loaded the version before back into every backend (a reviewer). Another model's
  update is passed on and pinned as no policy."""
  a, b = {"version": 0}, {"version": 0}
  with ServerThread(_backend(a)) as sa, ServerThread(_backend(b)) as sb, \
      ServerThread(create_router([sa.url, sb.url], health_interval_s=0.1)) as r:
    for body, policy in (({"path": "/p", "version": 1}, 1),
                         ({"path": "/p", "version": 2, "model": "jaxagent"}, 2),
                         ({"path": "/q", "version": 7, "model": "judge"}, 2)):
      got = httpx.post(f"{r.url}/update_weights", json=body, timeout=60)
      assert got.status_code == 200 and got.json()["version"] == policy, got.text
    time.sleep(0.6)  # (checks)
    assert a["version"] == b["version"] == 2 and a["models"] == b["models"] == {"judge": 7}
    assert all(_healthy(r.url).values())


def test_an_update_of_no_version_the_backends_took_two_of_is_the_newests():
  """An update naming no version: each backend loads the latest export it finds, and one
  landing meanwhile gave two versions. The first answer's was pinned, the backend of the
  newer one pushed back to it (a reviewer); the newest is, the other out of rotation
  until it serves it."""
  a, b = {"version": 0, "latest": 3}, {"version": 0, "latest": 4}
  with ServerThread(_backend(a)) as sa, ServerThread(_backend(b)) as sb, \
      ServerThread(create_router([sa.url, sb.url], health_interval_s=0.1)) as r:
    got = httpx.post(f"{r.url}/update_weights", json={"path": "/p"}, timeout=60)
    assert got.status_code == 200 and got.json()["version"] == 4, got.text
    time.sleep(0.6)  # (checks: a is sent version 4)
    assert a["version"] == b["version"] == 4
    assert all(_healthy(r.url).values())


def test_updates_back_to_back_keep_backends_whose_checks_they_outlast_in_rotation():
  """A new user's run stopped at step 16, both servers up: a check whose /health answered
  before an update and went on after it judged the backend by the old version, pushed
  the policy to it out of rotation, and kept it out as the next update began; both
  backends at once, and the learner's next update found none (503)."""
  a, b = {"version": 0, "health_s": 0.3}, {"version": 0, "health_s": 0.3}
  with ServerThread(_backend(a)) as sa, ServerThread(_backend(b)) as sb, \
      ServerThread(create_router([sa.url, sb.url], health_interval_s=0.05)) as r:
    answers = []
    for version in range(1, 25):
      answers.append(httpx.post(f"{r.url}/update_weights",
                                json={"path": "/p", "version": version}, timeout=30).status_code)
      time.sleep(0.1)
    assert answers == [200] * 24, answers
    assert httpx.get(f"{r.url}/router/health").json()["policy_pushes"] == 0


def test_a_backend_behind_the_policy_catches_up_with_updates_faster_than_its_load():
  """A restarted backend was pushed the policy at its next check, out of rotation, and
  the updates went on without it: with updates coming faster than its load, each push
  ended a version behind and it stayed out for good. An update is sent to it too."""
  a, b = {"version": 0, "update_s": 0.2}, {"version": 0, "update_s": 0.2}
  with ServerThread(_backend(a)) as sa, ServerThread(_backend(b)) as sb, \
      ServerThread(create_router([sa.url, sb.url], health_interval_s=0.05)) as r:
    assert httpx.post(f"{r.url}/update_weights", json={"path": "/p", "version": 1},
                      timeout=30).status_code == 200
    b.update(version=0, instance="two")  # (restarted, on its first weights)
    deadline = time.time() + 10
    while _healthy(r.url)[sb.url] and time.time() < deadline:
      time.sleep(0.01)
    seen = []
    for version in range(2, 16):
      up = httpx.post(f"{r.url}/update_weights", json={"path": "/p", "version": version},
                      timeout=30)
      assert up.status_code == 200, up.text
      time.sleep(0.1)  # (a step's training)
      if version > 4:
        seen.append((version, b["version"], _healthy(r.url)[sb.url]))
    # (it took updates as they came, not one behind each: in the background, beside the
    # others, so as an update returns or a moment after; and was let in between them)
    assert any(v == took for v, took, _ in seen[-4:]), seen
    assert any(healthy for _, _, healthy in seen), seen


def test_an_update_waits_for_no_backend_behind_the_policy():
  """A backend out of rotation behind the policy is sent each update, not waited for: one
  slow to load held every update (0.14 s to 4.5 s with a 4 s load; a reviewer), and its
  answer is not the update's."""
  a, b = {"version": 0}, {"version": 0}
  with ServerThread(_backend(a)) as sa, ServerThread(_backend(b)) as sb, \
      ServerThread(create_router([sa.url, sb.url], health_interval_s=0.05)) as r:
    assert httpx.post(f"{r.url}/update_weights", json={"path": "/p", "version": 1},
                      timeout=30).status_code == 200
    b.update(version=0, instance="two", update_s=1.0)  # (restarted; its loads take 1 s)
    deadline = time.time() + 20
    while not b.get("updating") and time.time() < deadline:  # (pushed version 1)
      time.sleep(0.01)
    assert httpx.post(f"{r.url}/update_weights", json={"path": "/p", "version": 2},
                      timeout=30).status_code == 200
    while b["version"] != 1 and time.time() < deadline:
      time.sleep(0.01)
    while not b.get("updating") and time.time() < deadline:  # (pushed version 2: behind)
      time.sleep(0.01)
    t0 = time.time()
    up = httpx.post(f"{r.url}/update_weights", json={"path": "/p", "version": 3}, timeout=30)
    took = time.time() - t0
    assert up.status_code == 200 and up.json()["version"] == 3, up.text
    assert took < 0.8, took
    assert [x.get("skipped", "") for x in up.json()["results"]
            if x["backend"] == sb.url][0].startswith("out of rotation behind the policy")
    while not (b["version"] == 3 and _healthy(r.url)[sb.url]) and time.time() < deadline:
      time.sleep(0.05)  # (it takes it in the background, and a check lets it in)
    assert b["version"] == 3 and _healthy(r.url)[sb.url]


def test_a_learners_update_is_asked_again_while_no_backend_can_take_it(caplog):
  """The learner stopped at the first 503 of an update (a router with its backends out of
  rotation a moment): asked again for up to `rollout.infra_grace_s`; a router's 502 of a
  version some backends took is the update made, its refusals said; a token refused is
  the run's error at once."""
  from fastapi import FastAPI
  from fastapi.responses import JSONResponse

  from rollout_server.client import GenerateError, HttpClient
  from rollout_server.engine import SamplingParams
  from rollout_server.routing import NONE_AVAILABLE

  caplog.set_level(logging.WARNING, logger="rollout_server.client")
  answers = []
  app = FastAPI()

  @app.post("/update_weights")
  async def update():
    status, body = answers.pop(0) if answers else (503, {"detail": "no healthy backend"})
    return JSONResponse(body, status_code=status)

  @app.post("/generate")
  async def generate():  # (a router none of whose backends can take a turn now)
    return JSONResponse({"detail": f"{NONE_AVAILABLE}: none is in rotation"}, status_code=503)

  def push(url, retry_s):
    async def go():
      client = HttpClient(url, update_retry_s=retry_s, control_token="t")
      try:
        return await client.update_weights("/p", 3)
      finally:
        await client._client.aclose()
    return asyncio.run(go())

  partly = {"version": 3, "ok": False, "results": [
      {"backend": "http://a", "status": 200, "body": {"version": 3}},
      {"backend": "http://b", "error": "ReadError: gone"}]}
  with ServerThread(app) as s:
    answers[:] = [(503, {"detail": "no healthy backend to update"})] * 2 + [(200, {"version": 3})]
    assert push(s.url, 30)["version"] == 3 and not answers
    answers[:] = [(502, partly)]
    assert push(s.url, 30)["version"] == 3
    said = [x.getMessage() for x in caplog.records]
    assert any("version 3 taken, but not by http://b (ReadError: gone)" in x for x in said), said
    answers[:] = [(502, {**partly, "results": [partly["results"][0], {
        "backend": "http://b", "status": 401, "body": {"detail": "token"}}]})]
    with pytest.raises(GenerateError, match="502"):
      push(s.url, 30)
    # (none took it, the version the router's own, pinned before; an export not there)
    for results in ([partly["results"][1]], [partly["results"][0], {
        "backend": "http://b", "status": 400, "body": {"detail": "no policy export"}}]):
      answers[:] = [(502, {**partly, "results": results})]
      with pytest.raises(GenerateError, match="502"):
        push(s.url, 30)
    t0 = time.monotonic()
    with pytest.raises(GenerateError, match=r"503: .*asked for 1 s"):
      push(s.url, 1.0)
    assert time.monotonic() - t0 < 10

    async def turn():  # (the servers' kind, not a full queue's: its outage hint says so)
      client = HttpClient(s.url)
      try:
        await client.generate([1], SamplingParams(max_new_tokens=1))
      finally:
        await client._client.aclose()
    with pytest.raises(GenerateError) as refused:
      asyncio.run(turn())
    assert refused.value.kind == "server"


def test_an_update_is_cut_at_a_backend_gone_mid_update():
  """A backend whose host stopped without a reset (SIGSTOP, a partition) held every
  policy update through the router up to update_timeout (turn_timeout_s + timeout_s, an
  hour): its health checks unanswered, its update is cut as its turns are (red team 43)."""
  async def main():
    rot = Rotation(["http://a", "http://b"], health_interval_s=1, timeout_s=1,
                   turn_timeout_s=3600, max_sessions=10, control_token=None,
                   max_connections=10)

    async def handler(request: httpx.Request) -> httpx.Response:
      if request.url.host == "b":
        await asyncio.sleep(3600)  # (stopped: never answers)
      return httpx.Response(200, json={"version": 7})

    mock = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    rot.clients.update({("calls", b): mock for b in ("http://a", "http://b")})
    asyncio.get_running_loop().call_later(0.2, rot.gone("http://b").set)
    t0 = time.monotonic()
    answer, status = await asyncio.wait_for(rot.update(b'{"path": "p"}'), 10)
    assert time.monotonic() - t0 < 5
    assert status == 200 and answer["version"] == 7, answer
    assert rot.healthy == {"http://a": True, "http://b": False}
    assert "unreachable" in answer["results"][1]["error"]
    await rot.aclose()

  asyncio.run(main())


def _mock_rotation(backends, handler, **kw) -> Rotation:
  """A Rotation whose calls of every pool go to `handler` (httpx.MockTransport)."""
  rot = Rotation(backends, health_interval_s=1, timeout_s=5, turn_timeout_s=5,
                 max_sessions=10, control_token=None, max_connections=10, **kw)
  client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
  rot.clients.update({(pool, b): client for pool in ("turns", "calls") for b in backends})
  rot.clients["health", None] = client
  return rot


def test_a_backend_is_gone_after_three_unanswered_checks_in_a_row_and_a_busy_pool_is_no_answer():
  """`UNREACHABLE_CHECKS` unanswered /health in a row (no connection) make a backend gone
  (its turns cut); an answer between them starts the count again, and a check that found
  the router's own pool busy (PoolTimeout) says nothing of the backend either way."""
  mode = {"now": "down"}

  async def handler(request: httpx.Request) -> httpx.Response:
    if mode["now"] == "down":
      raise httpx.ConnectError("refused")
    if mode["now"] == "busy":
      raise httpx.PoolTimeout("the pool is full")
    return httpx.Response(200, json={"status": "ok", "version": None})

  async def main():
    rot = _mock_rotation(["http://a"], handler)
    gone = rot.gone("http://a")
    for now in ("down", "down", "up", "down", "down", "busy", "busy", "busy", "busy"):
      mode["now"] = now
      await rot.check("http://a")
      assert not rot.gone("http://a").is_set(), now
    assert rot.healthy["http://a"] is False
    mode["now"] = "down"
    await rot.check("http://a")
    assert rot.gone("http://a").is_set() and gone.is_set()
    mode["now"] = "up"
    await rot.check("http://a")
    assert rot.healthy["http://a"] and not rot.gone("http://a").is_set()
    await rot.aclose()

  asyncio.run(main())


def test_an_update_is_done_only_where_every_healthy_backend_took_it():
  """A backend that answered its update with an error (a 500, even a JSON one) or could
  not be reached did not take it: the update is a 502 with `ok` false, and each of them
  is out of rotation (loading the policy before it serves again) while the one that took
  it stays in and the router holds the backends to its version. With none healthy, a
  503 (asked again by the learner)."""
  async def handler(request: httpx.Request) -> httpx.Response:
    host = request.url.host
    if request.url.path == "/update_weights":
      if host == "a":
        return httpx.Response(200, json={"version": 4})
      if host == "b":
        return httpx.Response(500, json={"detail": "cannot load it"})
      raise httpx.ConnectError("refused")
    return httpx.Response(404)

  async def main():
    rot = _mock_rotation(["http://a", "http://b", "http://c"], handler)
    answer, status = await rot.update(b'{"path": "/p", "version": 4}')
    assert status == 502 and answer["ok"] is False and answer["version"] == 4, answer
    assert rot.healthy == {"http://a": True, "http://b": False, "http://c": False}
    by = {x["backend"]: x for x in answer["results"]}
    assert by["http://b"]["status"] == 500 and "ConnectError" in by["http://c"]["error"]
    assert rot.policy["version"] == 4 and rot.serves["http://a"][0] == 4
    assert rot.in_order(["http://b", "http://c", "http://a"]) == ["http://a"]
    rot.healthy["http://a"] = False
    answer, status = await rot.update(b'{"path": "/p", "version": 5}')
    assert status == 503 and rot.policy["version"] == 4, answer
    await rot.aclose()

  asyncio.run(main())


def test_a_backend_is_back_only_once_it_loaded_the_policy_and_did_the_deletes_it_owes():
  """A backend on another version is out of rotation while the router pushes it the
  policy, stays out while it answers the push with another version than the router's,
  and while a delete it owes is refused (401: the token; owed until it is allowed)."""
  state = {"serves": 0, "loads": 3, "delete": 401, "seen_healthy": [], "deleted": []}

  async def handler(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/health":
      return httpx.Response(200, json={"status": "ok", "version": state["serves"],
                                       "policy_id": None, "instance": "one"})
    if request.url.path == "/update_weights":
      state["seen_healthy"].append(rot.healthy["http://a"])
      state["serves"] = state["loads"]
      return httpx.Response(200, json={"version": state["loads"]})
    if request.method == "DELETE":
      state["deleted"].append(request.url.path)
      return httpx.Response(state["delete"], json={"detail": "x"})
    return httpx.Response(404)

  async def main():
    rot.policy.update(body=b'{"path": "/p", "version": 4}', version=4)
    await rot.check("http://a")  # (loads 3, not 4)
    assert rot.healthy["http://a"] is False and state["seen_healthy"] == [False]
    assert rot.in_order(["http://a"]) == []
    state["loads"] = 4
    rot.must_delete("http://a", "s1")
    await rot.check("http://a")  # (loads 4; its delete refused: owed, out)
    assert state["serves"] == 4 and state["deleted"] == ["/sessions/s1"]
    assert rot.healthy["http://a"] is False and "s1" in rot.undeleted["http://a"]
    state["delete"] = 200
    await rot.check("http://a")
    assert rot.healthy["http://a"] is True and not rot.undeleted["http://a"]
    assert state["seen_healthy"] == [False, False]  # (pushed twice, out both times)
    await rot.aclose()

  rot = _mock_rotation(["http://a"], handler)
  asyncio.run(main())


def test_a_router_following_anothers_policy_holds_its_backends_to_it_and_pushes_none():
  """A reviewer: a learner's second process routes through a router of its own, and only
  the first process updates the servers; that router held no policy, let a restarted
  server in on its first weights, and the process's turns there were stale (a group
  wasted). Following the policy (`POST /router/policy`), it keeps the server out until
  the other router has loaded it, and loads nothing itself."""
  from rollout_server.client import GenerateError, HttpClient

  a, b = {"version": 1}, {"version": 1}
  with ServerThread(_backend(a)) as sa, ServerThread(_backend(b)) as sb, \
      ServerThread(create_router([sa.url, sb.url], health_interval_s=0.1,
                                 control_token="t")) as r:
    policy = {"path": "/p", "version": 1}
    assert httpx.post(f"{r.url}/router/policy", json=policy, timeout=10).status_code == 401
    for bad in ({"path": "/p"}, {"version": [1]}, [1]):
      got = httpx.post(f"{r.url}/router/policy", json=bad, headers={"x-control-token": "t"},
                       timeout=10)
      assert got.status_code == 400 and "version" in got.json()["detail"], got.text

    async def follow():
      client = HttpClient(r.url, control_token="t")
      try:
        await client.follow_policy("/p", 1)
        assert client._policy == {"path": "/p", "version": 1, "mode": "drain"}
      finally:
        await client.aclose()

    asyncio.run(follow())
    a.update(version=0, instance="two")  # (restarted, on its first weights)
    deadline = time.time() + 10
    while _healthy(r.url)[sa.url] and time.time() < deadline:
      time.sleep(0.05)
    assert not _healthy(r.url)[sa.url]
    time.sleep(0.5)  # (checks go on: none loads the policy into it)
    assert not a.get("updating") and a["version"] == 0 and not _healthy(r.url)[sa.url]
    got = httpx.get(f"{r.url}/router/health", timeout=10).json()
    assert got["policy_version"] == 1 and got["policy_pushes"] == 0
    a["version"] = 1  # (the first process's router loaded it)
    while not _healthy(r.url)[sa.url] and time.time() < deadline:
      time.sleep(0.05)
    assert _healthy(r.url)[sa.url]
    # The other router's next update, under way: servers on it stay in (they were out
    # until this one was told of it, after the whole update; a reviewer)
    a["version"] = b["version"] = 2
    time.sleep(0.5)
    assert all(_healthy(r.url).values())
    assert httpx.post(f"{r.url}/generate", json={"input_ids": [1]}, timeout=10).status_code \
        == 200
    # (a follow asked late, of a version before the one held, holds nothing back)
    httpx.post(f"{r.url}/router/policy", json={"path": "/p", "version": 2},
               headers={"x-control-token": "t"}, timeout=10)
    assert httpx.post(f"{r.url}/router/policy", json=policy, timeout=10,
                      headers={"x-control-token": "t"}).json()["version"] == 2

  # One router shared by every process (a deployment's): it takes the first's updates and
  # follows none (following, it loaded the policy into a restarted server no more, and
  # with one server no turn could be served again; a reviewer)
  d = {"version": 0}
  with ServerThread(_backend(d)) as sd, \
      ServerThread(create_router([sd.url], health_interval_s=0.1)) as shared:
    assert httpx.post(f"{shared.url}/update_weights", json={"path": "/p", "version": 1},
                      timeout=30).status_code == 200
    refused = httpx.post(f"{shared.url}/router/policy", json={"path": "/p", "version": 1},
                         timeout=10)
    assert refused.status_code == 409 and "follows none" in refused.json()["detail"]

    async def shared_follow():
      client = HttpClient(shared.url)
      try:
        await client.follow_policy("/p", 1)  # (409: left as it is)
      finally:
        await client.aclose()

    asyncio.run(shared_follow())
    d.update(version=0, instance="two")
    deadline = time.time() + 10
    while d["version"] != 1 and time.time() < deadline:
      time.sleep(0.05)
    assert d["version"] == 1  # (loaded again by the router)

  # A client of one server (no router: 404) holds its turns to the policy all the same: a
  # turn served from before it is asked again; the client that updates the server loads
  # it again (both did: it drained twice, and one a version behind rolled it back).
  from fastapi import FastAPI, Request

  from jaxagent.trajectory import SamplingParams

  served, app = {"version": 0}, FastAPI()

  @app.get("/health")
  async def health():
    return {"status": "ok", "version": served["version"]}

  @app.post("/update_weights")
  async def update(request: Request):
    served["version"] = (await request.json())["version"]
    return {"version": served["version"], "model": None}

  @app.post("/generate")
  async def generate():
    return {"prompt_ids": [1, 2], "output_ids": [5], "output_logprobs": [-0.5],
            "versions": [served["version"]], "finish_reason": "length"}

  with ServerThread(app) as one:
    async def turn():
      client = HttpClient(one.url)
      try:
        await client.follow_policy("/p", 3)
        with pytest.raises(GenerateError, match="served version 0 after it took version 3 "
                                                r"\(restarted\?\): asked again"):
          await client.generate([1, 2], SamplingParams(max_new_tokens=1))
        assert served["version"] == 0  # (not this client's to load)
        leader = HttpClient(one.url)
        try:
          await leader.update_weights("/p", 4)  # (the leader's next update, meanwhile)
        finally:
          await leader.aclose()
        assert (await client.generate([1, 2], SamplingParams(max_new_tokens=1))).versions == [4]
      finally:
        await client.aclose()

    asyncio.run(turn())


def test_a_servers_200_that_is_no_turn_is_the_servers_failure_not_the_episodes_bug():
  """A reviewer: a server's (or router's) 200 that was not JSON, or not a turn, raised a
  JSONDecodeError or a KeyError from the client: the episode's bug, the run stopped (exit
  1); one of log-probs that are not numbers went on to the learner. A GenerateError of
  the server's now (retried as its failure)."""
  from fastapi import FastAPI
  from fastapi.responses import PlainTextResponse

  from rollout_server.client import GenerateError, HttpClient
  from jaxagent.trajectory import SamplingParams

  turn = {"prompt_ids": [1], "output_ids": [2], "output_logprobs": [-0.5], "versions": [0],
          "finish_reason": "length"}
  bodies = ["not json", "[1, 2]", json.dumps({"output_ids": [1]}),
            json.dumps(dict(turn, output_logprobs=["x"])),
            json.dumps(dict(turn, output_logprobs=[float("nan")])),  # (NaN: Python's JSON)
            json.dumps(dict(turn, versions=[0, 1])), json.dumps(dict(turn, output_ids=[True]))]
  said = {"body": None}
  app = FastAPI()

  @app.post("/generate")
  async def generate():
    return PlainTextResponse(said["body"], media_type="application/json")

  async def ask(url):
    client = HttpClient(url)
    try:
      return await client.generate([1], SamplingParams(max_new_tokens=1))
    finally:
      await client.aclose()

  with ServerThread(app) as s:
    for body in bodies:
      said["body"] = body
      with pytest.raises(GenerateError, match="answered 200 with no turn") as e:
        asyncio.run(ask(s.url))
      assert e.value.kind == "server", body
    said["body"] = json.dumps(turn)
    assert asyncio.run(ask(s.url)).output_logprobs == [-0.5]

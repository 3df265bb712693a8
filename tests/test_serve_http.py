"""`jaxagent.serve_http`'s bound on how deep a request's JSON body nests."""

import json
import random

from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient

from envs.values import json_depth
from jaxagent.serve_http import MAX_BODY_DEPTH, NESTED_TOO_DEEP, body_depth, name_deep_bodies


def test_a_bodys_depth_is_measured_past_brackets_in_its_strings_in_any_encoding():
  """Measured on the text (strings cut out), as deep as the parsed value walked: brackets,
  quotes and backslashes inside strings do not count, in UTF-8, UTF-16 and UTF-32."""
  rng = random.Random(0)
  odd = ["[x", "]", '\\"]', "\\", '"', "{", "\u2200]", "\U0001f600[", 1, 2.5, None]

  def value(depth: int):
    if depth > 6 or rng.random() < 0.3:
      return rng.choice(odd)
    if rng.random() < 0.5:
      return [value(depth + 1) for _ in range(rng.randint(0, 3))]
    return {str(rng.choice(odd)): value(depth + 1) for _ in range(rng.randint(0, 3))}

  values = [value(0) for _ in range(500)] + [[], {}, [[[]]], "[[[", 7]
  for v in values:
    for ascii_only in (True, False):
      text = json.dumps(v, ensure_ascii=ascii_only)
      for encoding in ("utf-8", "utf-16", "utf-32"):
        body = text.encode(encoding)
        assert body_depth(body, json.loads(body)) == json_depth(v), (text, encoding)


def test_a_body_nested_past_the_bound_is_refused_and_one_within_it_parsed_once(monkeypatch):
  app = FastAPI()
  name_deep_bodies(app)

  @app.post("/x")
  async def x(body: dict):
    return {"n": len(body["a"])}

  client = TestClient(app)
  wide = json.dumps({"a": [[] for _ in range(3 * MAX_BODY_DEPTH)]}).encode()
  parses = []
  loads = json.loads
  monkeypatch.setattr(json, "loads", lambda s, *a, **k: parses.append(s) or loads(s, *a, **k))
  r = client.post("/x", content=wide, headers={"content-type": "application/json"})
  assert r.json() == {"n": 3 * MAX_BODY_DEPTH} and parses.count(wide) == 1, parses.count(wide)
  for levels, status in [(MAX_BODY_DEPTH, 200), (MAX_BODY_DEPTH + 1, 400), (5000, 400)]:
    inner = levels - 1  # (the object around "a")
    body = b'{"a": ' + b"[" * inner + b"]" * inner + b"}"
    r = client.post("/x", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, (levels, r.text)
    if status == 400:
      assert r.json()["detail"] == NESTED_TOO_DEEP
  # Text that is not JSON: a 400 naming it, as other unreadable bodies (it was a 422).
  r = client.post("/x", content=b"{bad", headers={"content-type": "application/json"})
  assert r.status_code == 400 and r.json()["detail"].startswith("body: not valid JSON ("), r.text


def test_a_path_no_route_takes_is_named_with_the_routes():
  """A bare "Not Found" left a client of `/v1/completions` guessing (a new user): the 404
  names the request and the app's routes; a route's own 404 is kept."""
  app = FastAPI()
  name_deep_bodies(app)

  @app.post("/v1/chat/completions")
  async def chat():
    return {}

  @app.get("/sessions/{sid}")
  async def session(sid: str):
    raise HTTPException(404, f"no session {sid!r}")

  client = TestClient(app)
  r = client.post("/v1/completions", json={})
  assert r.status_code == 404 and r.json()["detail"] == (
      "no route POST '/v1/completions'; this server's routes: /sessions/{sid}, "
      "/v1/chat/completions"), r.text
  assert client.get("/sessions/x").json()["detail"] == "no session 'x'"


def test_a_bad_number_json_cannot_write_back_is_a_422_not_a_500():
  """A red team: `{"idle_timeout_s": 1e400}` (inf to Python's parser), or NaN, failed its
  check, and the 422 that echoes the input could not be written (JSON has no inf): a 500,
  which a client reads as the server's failure and plays its episode again."""
  from pydantic import BaseModel, Field

  class Body(BaseModel):
    idle_timeout_s: float = Field(gt=0, allow_inf_nan=False)
    action: str = ""

  app = FastAPI()
  name_deep_bodies(app)

  @app.post("/sessions")
  async def sessions(body: Body):
    return {}

  client = TestClient(app, raise_server_exceptions=False)
  for raw, field in (('{"idle_timeout_s": 1e400}', "idle_timeout_s"),
                     ('{"idle_timeout_s": -Infinity}', "idle_timeout_s"),
                     ('{"idle_timeout_s": 1, "action": NaN}', "action")):
    r = client.post("/sessions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422, (raw, r.status_code, r.text)
    assert r.json()["detail"][0]["loc"] == ["body", field], r.text


def test_a_service_stopped_by_sigterm_runs_its_exit_handlers_and_exits_143(tmp_path):
  """uvicorn shuts down on SIGTERM, then raises it again: the default handler killed the
  process (exit -15), its exit handlers not run (an environment worker's sandbox lock
  file was left behind; a reviewer)."""
  import signal
  import subprocess
  import sys
  import time

  import httpx

  from tests.conftest import REPO

  done = tmp_path / "exited"
  code = (
      "import atexit, socket, sys\n"
      "from fastapi import FastAPI\n"
      "from jaxagent.serve_http import serve\n"
      "atexit.register(lambda: open(sys.argv[1], 'w').write('ran'))\n"
      "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
      "print(s.getsockname()[1], flush=True)\n"
      "serve(FastAPI(), s, log_level='warning')\n")
  p = subprocess.Popen([sys.executable, "-c", code, str(done)], cwd=REPO,
                       stdout=subprocess.PIPE, text=True)
  try:
    port = int(p.stdout.readline())
    deadline = time.monotonic() + 60
    while True:
      try:
        httpx.get(f"http://127.0.0.1:{port}/none", timeout=5)
        break
      except httpx.TransportError:
        assert time.monotonic() < deadline, "the service never answered"
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 143
    assert done.read_text() == "ran"
  finally:
    p.kill()

"""Fixtures: a small model that has memorised two chat answers, and servers on loopback."""

import contextlib
import fcntl
import hashlib
import os
import pathlib
import pickle
from typing import Optional

import jax
import numpy as np
import pytest

from jaxagent.batch import pack
from jaxagent.config import LearnerConfig
from jaxagent.learner import Learner
from jaxagent.models import preset
from jaxagent.models.sharding import make_mesh
from jaxagent.tokenizer import Tokenizer
from rollout_server.engine import Engine
from rollout_server.orchestrator import Orchestrator
from rollout_server.server import create_app
from rollout_server.serving import ServerThread

CFG = preset("tiny", n_layers=2)
TOOLS = [{"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]
# (messages, tools, memorised answer)
MEMORISED = [
    ([{"role": "user", "content": "What is 2+3?"}], TOOLS,
     '<tool_call>{"name": "calculate", "arguments": {"expression": "2+3"}}</tool_call>'),
    ([{"role": "user", "content": "Say hi"}], None, "Hi there!"),
]


@pytest.fixture(scope="session")
def tokenizer():
  return Tokenizer.byte_level()


def memorise(pairs, *, steps: int = 150, seed: int = 0, row_len: int = 512, lr: float = 3e-3,
             shared: Optional[pathlib.Path] = None):
  """Tiny-model weights trained (REINFORCE with advantage 1) to answer each prompt of
  `pairs` ((prompt ids, answer ids)) with its answer greedily. With `shared` (a folder
  the session's xdist workers share), one worker trains them and the others load what
  it saved (each trained its own copy: ~30 s of a core apiece)."""
  if shared is None:
    return _memorise(pairs, steps=steps, seed=seed, row_len=row_len, lr=lr)
  key = hashlib.sha256(repr(([list(map(int, a)) + [-1] + list(map(int, b)) for a, b in pairs],
                             steps, seed, row_len, lr, CFG)).encode()).hexdigest()[:16]
  path = shared / f"memorised-{key}.pkl"
  with open(shared / f"memorised-{key}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file closes)
    if not path.exists():
      params = _memorise(pairs, steps=steps, seed=seed, row_len=row_len, lr=lr)
      with open(path.with_suffix(".part"), "wb") as f:
        pickle.dump(params, f)
      os.replace(path.with_suffix(".part"), path)
      return params
  with open(path, "rb") as f:
    return pickle.load(f)


def _memorise(pairs, *, steps, seed, row_len, lr):
  segs = []
  for i, (prompt, target) in enumerate(pairs):
    seq = np.asarray(list(prompt) + list(target), np.int32)
    mask = np.zeros(len(seq), np.float32)
    mask[len(prompt):] = 1.0
    segs.append(dict(tokens=seq, loss_mask=mask, advantages=mask, rollout_id=i,
                     rollout_logp=np.zeros(len(seq), np.float32)))
  batch, placed = pack(segs, len(segs), row_len)
  assert (placed >= 0).all()
  learner = Learner(CFG, LearnerConfig(lr=lr, policy_loss="reinforce"), make_mesh())
  state = learner.init_state(seed)
  for _ in range(steps):
    state, m = learner.step(state, batch)
  assert float(m["loss"]) < 0.05, float(m["loss"])
  return jax.device_get(state.params)


@pytest.fixture(scope="session")
def memorised_params(tokenizer, shared_dir):
  """Tiny-model weights trained to answer MEMORISED greedily."""
  return memorise([(tokenizer.apply_chat_template(messages, tools=tools),
                    tokenizer.encode(answer + "<|im_end|>"))
                   for messages, tools, answer in MEMORISED], shared=shared_dir)


def make_engine(**kw):
  opts = dict(max_concurrent_decodes=4, max_prefill_length=512, max_seq_len=640)
  opts.update(kw)
  return Engine(CFG, **opts)


@contextlib.contextmanager
def running_server(params, tokenizer, *, version=0, prefix_cache=True, engine=None, **app_kw):
  """A real server on a loopback port, stopped afterwards."""
  engine = engine or make_engine()
  orch = Orchestrator(engine, engine.load_params(params, version=version),
                      prefix_cache_tokens=engine.page_size * (engine.num_pages // 2)
                      if prefix_cache else 0).start()

  def load(path, version):
    from rollout_server.serving import resolve_policy
    path, version = resolve_policy(path, version)
    return engine.load_params(path=path, version=version)

  app = create_app(orch, tokenizer, load_params=load, **app_kw)
  server = ServerThread(app).start()
  try:
    yield server, orch
  finally:
    server.stop()
    orch.stop()


def called_and_left(app, path: str, body: dict, orch: Orchestrator) -> tuple[dict, list]:
  """Calls the ASGI `app` with `body` at `path` as a client gone by the time it is
  answered (the disconnect is the first thing its response hears; its socket slow,
  so the response's start is still being sent), then waits, in the same event loop
  (the requests' tokens are sent to it), until `orch` runs nothing, for at most a
  minute: (`orch.stats()`, the message types the app sent)."""
  import asyncio
  import json
  import time

  sent = json.dumps(body).encode()
  messages = [{"type": "http.request", "body": sent, "more_body": False}]
  started: list = []

  async def receive():
    return messages.pop(0) if messages else {"type": "http.disconnect"}

  async def send(message):
    started.append(message["type"])
    await asyncio.sleep(0.05)

  scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
           "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
           "raw_path": path.encode(), "query_string": b"", "root_path": "",
           "headers": [(b"content-type", b"application/json"),
                       (b"content-length", str(len(sent)).encode())],
           "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}

  async def answered_and_ended():
    await app(scope, receive, send)
    deadline = time.time() + 60
    while orch.stats()["live_slots"] and time.time() < deadline:
      await asyncio.sleep(0.01)

  asyncio.run(answered_and_ended())
  return orch.stats(), started


@pytest.fixture(scope="module")
def server(memorised_params, tokenizer):
  """A real server of the memorised model (policy version 3), one a test module."""
  with running_server(memorised_params, tokenizer, version=3) as (srv, orch):
    yield srv, orch


def finished_turn(tokenizer, output: str, finish: str = "stop", budget: int = 256, *,
                  kind: str = "chat", id_prefix: str = "call", request_id: str = "r1"):
  """A chat turn whose request has ended with `output` (and the stop token, when it
  stopped), as a gateway answers it; no engine."""
  from rollout_server.chat import ChatTurn
  from rollout_server.engine import SamplingParams
  from rollout_server.orchestrator import Request
  from rollout_server.sessions import SessionStore

  req = Request(tokenizer.encode("x"), SamplingParams(max_new_tokens=budget), request_id,
                output_ids=tokenizer.encode(output) + (
                    list(tokenizer.stop_ids[:1]) if finish == "stop" else []),
                finish_reason=finish)
  req._done.set()
  return ChatTurn(req, tokenizer, None, messages=[], tools=None, sessions=SessionStore(1),
                  session_id=None, kind=kind, id_prefix=id_prefix)

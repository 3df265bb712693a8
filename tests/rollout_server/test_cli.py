import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import REPO


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow  # (a server process started and stopped: the end-to-end tier)
def test_server_cli_serves_and_stops():
  port = free_port()
  proc = subprocess.Popen([sys.executable, "-m", "rollout_server", "--config",
                           "configs/server_tiny.yaml", f"port={port}", "engine.slots=2",
                           "models.ref.model.preset=nano", "models.ref.engine.slots=1"],
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.time() + 120
    while True:
      try:
        r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
        if r.status_code == 200:
          break
      except httpx.HTTPError:
        pass
      assert proc.poll() is None and time.time() < deadline, proc.stdout.read()
      time.sleep(0.3)
    out = httpx.post(f"http://127.0.0.1:{port}/generate",
                     json={"input_ids": [72, 105], "max_new_tokens": 4}, timeout=60).json()
    assert len(out["output_ids"]) == 4
    # A second model served beside the policy, by name.
    ids = [m["id"] for m in httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]]
    assert ids == ["server-tiny", "ref"]
    scored = httpx.post(f"http://127.0.0.1:{port}/v1/score",
                        json={"model": "ref", "input_ids": [[72, 105, 33]]}, timeout=60).json()
    assert len(scored["logprobs"][0]) == 3 and scored["logprobs"][0][0] == 0.0
  finally:
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)


def test_server_cli_bad_config():
  # (as `rollout_server.server` too: it did nothing and exited 0, a red team)
  for module in ("rollout_server", "rollout_server.server"):
    proc = subprocess.run([sys.executable, "-m", module, "--config",
                           "configs/server_tiny.yaml", "engine.slot=2"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "engine.slot" in proc.stderr and "'slots'" in proc.stderr


def test_bad_arguments_are_one_line_before_anything_listens(capsys, tmp_path):
  from envs import filter as env_filter, server as env_server
  from rollout_server import __main__ as server_cli, router

  unknown = tmp_path / "unknown.jsonl"
  unknown.write_text('{"id": "x", "env": "nosuch"}\n')

  for main, args, needle in (
      (router.main, ["--backends", "notaurl"], "--backends: give server URLs"),
      (router.main, ["--backends", "http://127.0.0.1:1", "--port", "99999"], "--port"),
      (server_cli.main, ["--config", "configs/server_tiny.yaml", "port=99999"], "port must"),
      (server_cli.main, ["--config", "configs/server_tiny.yaml", "--port", "0"], "port must"),
      (server_cli.main, ["--config", "configs/server_tiny.yaml", "model.preset=tinyy"],
       "model.preset: unknown 'tinyy' (did you mean 'tiny'?)"),
      (server_cli.main, ["--config", "configs/server_tiny.yaml", "engine.slots=0"],
       "engine.slots must be >= 1"),
      # (red team 15: every request failed while /health said ok)
      (server_cli.main, ["--config", "configs/server_tiny.yaml", "engine.prefill_chunk=-1"],
       "engine.prefill_chunk must be >= 0 (0: whole prompts), got -1"),
      (router.main, ["--backends", "http://h:1,http://h:2,http://h:1"],
       "--backends: http://h:1 listed more than once"),
      (router.main, ["--backends", "http://h:1,http://H:1/"], "listed more than once"),
      (router.main, ["--backends", "http://h:1", "--max-body-bytes", "-5"],
       "--max-body-bytes must be at least 1, got -5"),
      (server_cli.main, ["--config", "configs/server_tiny.yaml", "max_sessions=-1"],
       "max_sessions must be > 0, got -1"),
      (server_cli.main, ["--config", "configs/server_tiny.yaml", "max_body_bytes=0"],
       "max_body_bytes must be > 0, got 0"),
      (server_cli.main, ["--config", "configs/server_tiny.yaml", "session_ttl_s=-5"],
       "session_ttl_s must be > 0, or null (unbounded), got -5"),
      (server_cli.main, ["--config", "configs/server_tiny.yaml", "session_max_bytes=-1"],
       "session_max_bytes must be > 0, or null (unbounded), got -1"),
      (server_cli.main, ["--config", "configs/server_tiny.yaml", "stall_s=0"],
       "stall_s must be > 0 seconds, or null (never), got 0"),
      (server_cli.main, ["--config", "configs/server_tiny.yaml", "mesh.fsdp=0"],
       "mesh.fsdp must be >= 1, got 0"),  # (was a ZeroDivisionError's traceback)
      (server_cli.main, ["--config", "configs/server_tiny.yaml",
                         "models={judge: {engine: {page_size: 0}}}"],
       "models.judge.engine.page_size must be >= 1, got 0"),
      # a served model's own settings, before it is built (was the engine's error)
      (server_cli.main, ["--config", "configs/server_tiny.yaml",
                         "models={judge: {model: {preset: nanoo}}}"],
       "models.judge.model.preset: unknown 'nanoo' (did you mean 'nano'?)"),
      (server_cli.main, ["--config", "configs/server_tiny.yaml",
                         f"models={{old: {{policy: {tmp_path}/none}}}}"],
       "models.old.policy: no such export"),
      (env_filter.main, ["envs/tasks/python_tests.jsonl", "--concurrency", "0"],
       "--concurrency must be >= 1"),
      (env_filter.main, [str(unknown)], "unknown environment 'nosuch'"),
      (env_server.main, ["--port", "99999"], "a port is 0..65535")):
    assert main(args) == 2, args
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, (args, err)


def test_a_workspace_root_no_workspace_can_be_made_in_is_refused_at_the_start(capsys):
  """A red team: `--workspace-root /proc` started a worker whose every episode failed in
  the infrastructure (FileNotFoundError making its workspace)."""
  from envs import server as env_server

  assert env_server.main(["--port", str(free_port()), "--workspace-root", "/proc"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("envs.server: ") and "/proc" in err[-1], err


def test_an_engine_larger_than_the_memory_is_one_line_naming_its_sizes(capsys):
  """A red team: `engine.slots=100000000` was 32 lines of JAX's traceback, exit 1."""
  from rollout_server import __main__ as server_cli

  assert server_cli.main(["--config", "configs/server_tiny.yaml", f"port={free_port()}",
                          "engine.slots=100000000"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(
      "error: the model and its KV cache do not fit in the device's memory (engine.slots "
      "100000000 x engine.max_seq_len"), err
  # (a served model's: it named the policy's engine; a reviewer)
  assert server_cli.main(["--config", "configs/server_tiny.yaml", f"port={free_port()}",
                          "models={judge: {engine: {slots: 100000000}}}"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(
      "error: models.judge: the model and its KV cache do not fit in the device's memory "
      "(models.judge.engine.slots 100000000 x models.judge.engine.max_seq_len"), err


def test_a_port_in_use_is_one_line_before_anything_loads(capsys, tmp_path):
  """Every service CLI binds its port before it says where it serves (or loads a model):
  a port in use is one line and exit 2, not "serving on ..." then uvicorn's error log."""
  from envs import server as env_server
  from jaxagent import view
  from rollout_server import __main__ as server_cli, router

  (tmp_path / "trajectories.jsonl").write_text("")
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    for main, args in (
        (server_cli.main, ["--config", "configs/server_tiny.yaml", f"port={port}"]),
        (router.main, ["--backends", "http://127.0.0.1:1", "--port", str(port)]),
        (env_server.main, ["--port", str(port)]),
        (view.main, [str(tmp_path), "--port", str(port)])):
      assert main(args) == 2, args
      out = capsys.readouterr()
      assert out.out == "", (args, out.out)  # nothing said it serves
      err = out.err.strip()
      assert len(err.splitlines()) == 1 and f"cannot listen on 127.0.0.1:{port}: the port " \
          "is in use" in err, (args, err)


def _serving(*overrides):
  """A server of configs/server_tiny.yaml on a free port, answering /health."""
  port = free_port()
  proc = subprocess.Popen([sys.executable, "-m", "rollout_server", "--config",
                           "configs/server_tiny.yaml", f"port={port}", "engine.slots=2",
                           *overrides], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  deadline = time.time() + 120
  while True:
    try:
      if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
        return proc, f"http://127.0.0.1:{port}"
    except httpx.HTTPError:
      pass
    if proc.poll() is not None or time.time() > deadline:
      proc.kill()
      raise AssertionError(proc.stdout.read())
    time.sleep(0.3)


@pytest.mark.slow  # (server processes and training runs: the end-to-end tier)
def test_the_readmes_server_serves_the_default_run_and_another_model_is_a_config_error(
    tmp_path):
  """configs/server_tiny.yaml, as the README starts it, served the tiny preset while the
  default run trains the nano one: the run stopped with exit 3, "the infrastructure
  failed", as for an outage a resume waits out (a new user). It serves the run's model,
  and a server of another model is refused at the start naming serving.urls (exit 2)."""
  from tests.test_train_cli import run_train

  for preset, code in (("nano", 0), ("tiny", 2)):
    proc, url = _serving(f"model.preset={preset}")
    try:
      run = run_train("--config", "configs/tiny.yaml", "--run-dir", str(tmp_path / preset),
                      "steps=1", "rollout.groups_per_step=1", "rollout.group_size=2",
                      f"serving.urls=[{url}]")
    finally:
      proc.send_signal(signal.SIGINT)
      proc.wait(timeout=30)
    assert run.returncode == code, run.stderr[-2000:]
    if code:
      assert "error: serving.urls:" in run.stderr and "serves another model" in run.stderr, (
          run.stderr[-2000:])


def test_another_model_is_read_from_a_server_or_a_routers_answer():
  """A server's 409 at /update_weights, or a router's 502 whose results hold one, is a
  server of another model (`other_model`: the learner's start names serving.urls)."""
  from rollout_server.client import _other_model

  assert _other_model(httpx.Response(409, json={"detail": "another model"}))
  assert _other_model(httpx.Response(502, json={"results": [
      {"backend": "a", "status": 200}, {"backend": "b", "status": 409}], "ok": False}))
  assert not _other_model(httpx.Response(502, json={"results": [{"status": 500}]}))
  assert not _other_model(httpx.Response(400, text="not json"))
  assert not _other_model(httpx.Response(502, json=[1, 2]))

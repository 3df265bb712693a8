"""Building a rollout server from its config, and running ASGI apps in a thread.

`ServerThread` runs uvicorn in a background thread on a loopback port, for
tests, benchmarks and the in-process servers of a training run.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any, Optional

import uvicorn

from jaxagent import control
from jaxagent.build import build_model
from jaxagent.checkpoint import (REGISTRY, existing_export, export_id, export_stands,
                                 latest_version, list_versions, version_dir, version_of_dir)
from jaxagent.config import EngineConfig, ModelSpec, ServedModelConfig, ServerConfig
from jaxagent.models.params import init_params
from jaxagent.models.sharding import SAMPLE_RULES, make_mesh
from jaxagent.serve_http import KEEP_ALIVE_S
from jaxagent.tokenizer import renders_tools
from rollout_server.engine import Engine
from rollout_server.orchestrator import Orchestrator
from rollout_server.server import create_app


def resolve_policy(path: str, version: Optional[int] = None) -> tuple[str, int]:
  """A policy export's version directory and version number.

  `path` is a version directory (`.../v00000007`) or an export root with a
  registry (then `version`, or the latest). FileNotFoundError where the directory it
  names is not there (it was returned, and its callers failed later, deep in the load).
  """
  missing = None
  try:  # (`.../v7` for `.../v00000007`, as a user writes the version)
    path = existing_export(path)
  except FileNotFoundError as e:  # (raised below, once the path is not a run's checkpoint)
    missing = None if export_stands(os.path.abspath(path)) else e
  path = os.path.abspath(path)  # (relative to where the command runs; Orbax needs it whole)
  if (not os.path.exists(os.path.join(path, REGISTRY))
      and os.path.exists(os.path.join(path, "policy", REGISTRY))):
    path = os.path.join(path, "policy")  # a run directory: its exports
  if os.path.exists(os.path.join(path, REGISTRY)):
    entries = {e["version"] for e in list_versions(path)}
    if not entries:
      raise FileNotFoundError(f"{path} holds no policy export yet (its registry lists none)")
    v = latest_version(path) if version is None else int(version)
    if v not in entries:
      raise FileNotFoundError(f"policy version {v} is not in {path} (have {sorted(entries)})")
    # The export beside the registry (a run directory copied or moved elsewhere reads its
    # own exports, not the paths the registry was written with).
    if not export_stands(version_dir(path, v)):  # (dropped since: a transient export)
      raise FileNotFoundError(f"policy version {v} is in {path}'s registry but its "
                              f"directory {version_dir(path, v)} is gone")
    return version_dir(path, v), v
  run = _run_of_checkpoint(path)
  if run is not None:  # (it read as an export of no version, or failed deep in Orbax)
    raise ValueError(f"{path} is a run's checkpoint (its training state), not a policy "
                     f"export: give the run's exports, {os.path.join(run, 'policy')} (the "
                     "latest) or one version of them (policy/v00000007)")
  if missing is not None:
    raise missing
  named = version_of_dir(path)
  if version is None and named is None:
    raise ValueError(f"cannot tell the policy version of {path}: a policy export is a "
                     "version directory (RUN_DIR/policy/v00000007), an export root or a run "
                     "directory; or give the version with the path")
  if named is not None and version is not None and int(version) != named:
    # (a server took it, and stamped version 99 on the tokens of export v6)
    raise ValueError(f"{path} is policy version {named}, not {version}")
  return path, int(version if version is not None else named)


def _run_of_checkpoint(path: str) -> Optional[str]:
  """The run directory when `path` is one of its checkpoints (`RUN_DIR/checkpoints/STEP`,
  which holds the train state and its metadata) or their directory, else None."""
  if os.path.isdir(os.path.join(path, "state")) and os.path.isdir(os.path.join(path, "meta")):
    return os.path.dirname(os.path.dirname(path))
  if os.path.basename(path) == "checkpoints" and os.path.isdir(path) and any(
      d.isdigit() for d in os.listdir(path)):
    return os.path.dirname(path)
  return None


def make_engine(model_cfg, e: EngineConfig, mesh) -> Engine:
  """The engine an `EngineConfig` describes."""
  return Engine(model_cfg, max_concurrent_decodes=e.slots,
                max_prefill_length=e.max_prefill_length, max_seq_len=e.max_seq_len,
                mesh=mesh, min_prefill_bucket=e.min_prefill_bucket,
                prefill_rows=min(e.prefill_rows, e.slots), page_size=e.page_size,
                num_pages=e.kv_pages or None,
                extra_pages=-(-e.prefix_cache_tokens // e.page_size),
                pages_per_block=e.pages_per_block, dtype=e.dtype,
                attention_kernel=e.attention_kernel)


def start_orchestrator(engine: Engine, engine_params, e: EngineConfig) -> Orchestrator:
  """The engine's orchestrator (started), with the prefix cache and queue `e` describes."""
  return Orchestrator(engine, engine_params, prefix_cache_tokens=e.prefix_cache_tokens,
                      max_queue=e.max_queue, cache_finished=e.cache_finished,
                      prefill_chunk=e.prefill_chunk or None,
                      length_aware=e.length_aware,
                      speculative=e.speculative_tokens,
                      decode_steps=e.decode_steps).start()


@dataclasses.dataclass
class ServedModel:
  """A model a server hosts beside its policy (a reference, a teacher, a judge): its
  engine, running orchestrator and tokenizer; `update_weights` False: frozen."""

  name: str
  engine: Engine
  orch: Orchestrator
  tokenizer: Any
  update_weights: bool = False

  def score(self, sequences, temperature: float = 1.0):
    """Each sequence's per-token log-probs under the weights the model serves now."""
    return self.engine.score(self.orch.params, sequences, temperature)

  def load(self, path: str, version: Optional[int] = None):
    """Engine params of a policy export, for a weight update of this model."""
    path, version = resolve_policy(path, version)
    return self.engine.load_params(path=path, version=version)


def _start_model(spec: ModelSpec, e: EngineConfig, policy: Optional[str], seed: int, mesh):
  """Builds `spec`, loads `policy` (an export) or the built/random weights, starts serving."""
  model_cfg, params, tokenizer = build_model(spec, mesh, SAMPLE_RULES)
  engine = make_engine(model_cfg, e, mesh)
  if policy is not None:
    path, version = resolve_policy(policy)
    engine_params = engine.load_params(path=path, version=version)
  else:
    if params is None:
      params = init_params(model_cfg, seed, mesh, SAMPLE_RULES)
    engine_params = engine.load_params(params, version=0)
  return engine, start_orchestrator(engine, engine_params, e), tokenizer


def memory_problem(e: BaseException, engine: EngineConfig, key: str = "") -> Optional[str]:
  """What an engine's start failing for the device's memory (XLA's RESOURCE_EXHAUSTED)
  says, naming the sizes to lower (each setting `key` + its name), or None for another
  failure (it was a JAX traceback of 32 lines: a red team)."""
  if "RESOURCE_EXHAUSTED" not in str(e):
    return None
  return (f"the model and its KV cache do not fit in the device's memory ({key}engine.slots "
          f"{engine.slots} x {key}engine.max_seq_len {engine.max_seq_len}"
          + (f", {key}engine.kv_pages {engine.kv_pages}" if engine.kv_pages else "")
          + f", {key}engine.prefix_cache_tokens {engine.prefix_cache_tokens}): lower them; "
          + str(e).strip().splitlines()[0][:300])


def build_served_models(models: dict[str, ServedModelConfig], mesh) -> dict[str, ServedModel]:
  """The extra models of a config (`models:`), each started on `mesh`."""
  out = {}
  for name, m in models.items():
    try:
      engine, orch, tokenizer = _start_model(m.model, m.engine, m.policy, m.seed, mesh)
    except Exception as e:
      for started in out.values():
        started.orch.stop()
      too_large = memory_problem(e, m.engine, f"models.{name}.")
      if too_large:  # (the policy's engine was blamed: a reviewer)
        raise ValueError(f"models.{name}: {too_large}") from None
      if not isinstance(e, (OSError, ValueError, KeyError)):
        raise
      said = e.args[0] if isinstance(e, KeyError) and e.args else e
      raise ValueError(f"models.{name}: {said}") from e
    out[name] = ServedModel(name, engine, orch, tokenizer, m.update_weights)
  return out


def build_orchestrator(cfg: ServerConfig, mesh=None):
  """Engine, orchestrator (started) and tokenizer for a server config."""
  if mesh is None:
    mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
  return _start_model(cfg.model, cfg.engine, cfg.policy, cfg.seed, mesh)


def build_app(cfg: ServerConfig):
  """The app of a server config, its policy's orchestrator and its other models."""
  mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
  policy_id = None
  if cfg.policy is not None:  # resolved once: the export loaded is the one named
    path, _ = resolve_policy(cfg.policy)
    cfg, policy_id = dataclasses.replace(cfg, policy=path), export_id(path)
  engine, orch, tokenizer = build_orchestrator(cfg, mesh)
  if policy_id is not None and export_id(cfg.policy) != policy_id:
    policy_id = None  # exported again while it loaded: which one it read is not known
  try:
    models = build_served_models(cfg.models, mesh)
  except Exception:
    orch.stop()
    raise

  def load(path: str, version: Optional[int]):
    path, version = resolve_policy(path, version)
    return engine.load_params(path=path, version=version)

  app = create_app(orch, tokenizer, load_params=load, update_mode=cfg.update_mode,
                   max_sessions=cfg.max_sessions, session_ttl_s=cfg.session_ttl_s,
                   session_max_bytes=cfg.session_max_bytes, model_name=cfg.name,
                   models=models, policy_id=policy_id, max_body_bytes=cfg.max_body_bytes,
                   control_token=control.from_env(), stall_s=cfg.stall_s)
  if not renders_tools(tokenizer):  # said at the start, not only to each request
    print(f"note: the chat template of {tokenizer.name} drops tools: chat requests with "
          "tools are refused (400); model.chat_template=chatml_tools renders them", flush=True)
  return app, orch, models


class ServerThread:
  """Serves an ASGI app with uvicorn on `host:port` (0: any free port) in a thread."""

  def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
    # log_config None: uvicorn leaves the process's logging alone (its own config binds
    # handlers to the sys.stderr of the moment, which a caller may close: pytest's capture).
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=5, log_config=None,
                            timeout_keep_alive=KEEP_ALIVE_S)
    self.server = uvicorn.Server(config)
    self.host = host
    self._thread = threading.Thread(target=self.server.run, daemon=True, name="uvicorn")

  def start(self, timeout: float = 30.0) -> "ServerThread":
    self._thread.start()
    deadline = time.time() + timeout
    while not self.server.started:
      if not self._thread.is_alive() or time.time() > deadline:
        raise RuntimeError("server failed to start")
      time.sleep(0.01)
    self.port = self.server.servers[0].sockets[0].getsockname()[1]
    return self

  @property
  def url(self) -> str:
    return f"http://{self.host}:{self.port}"

  def stop(self) -> None:
    self.server.should_exit = True
    self._thread.join(timeout=15)

  def __enter__(self):
    return self.start()

  def __exit__(self, *exc):
    self.stop()

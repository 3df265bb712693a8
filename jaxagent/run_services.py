"""What a run plays its episodes with: the devices (`run_meshes`), the rollout side (`Serving`: an in-process engine,
or servers by URL behind a local router, and the gateway black-box agents and the judge
call), the environments (`make_env_factory`), the judge, the tools the tasks offer, and
the served models that score segments (a KL reference, a teacher)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from typing import Optional, Sequence

import jax
import numpy as np

from jaxagent import config as config_lib, control, distributed
from jaxagent.blackbox import is_blackbox
from jaxagent.errors import EpisodeBug, InfraError
from jaxagent.run_checks import env_latency, policy_token_readers


# What a learner of several processes refuses (`run_meshes`; `deploy gke` before a slice).
MULTI_PROCESS_DEVICES = ("mesh.devices: a multi-process learner spans every process's "
                         "devices; choose devices per process only for the engine "
                         "(serving.devices)")
MULTI_PROCESS_MESH = ("a multi-process learner spans every process's devices (mesh.data -1 "
                      "takes the rest)")


def run_meshes(mesh_cfg: config_lib.MeshConfig, serving_devices) -> tuple:
  """(the learner's mesh, the in-process engine's) for a run: the learner over
  `mesh_cfg`'s axes on its devices (every process's when the learner spans several), the
  engine on `serving_devices` (`serving.devices`), on this process's devices when the
  learner spans several processes, or else on the learner's mesh (colocated,
  time-shared). A mesh the devices cannot make is a ConfigError naming the keys."""
  from jaxagent.models.sharding import make_mesh, select_devices

  multi = jax.process_count() > 1
  if multi and mesh_cfg.devices:
    raise config_lib.ConfigError(MULTI_PROCESS_DEVICES)
  try:
    learner_devices = jax.devices() if multi else select_devices(mesh_cfg.devices)
    mesh = make_mesh(mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor, devices=learner_devices)
    serving_mesh = (make_mesh(devices=select_devices(serving_devices))
                    if serving_devices or multi else mesh)
  except ValueError as e:
    hint = ""
    if jax.device_count() == 1 and jax.devices()[0].platform == "cpu":
      hint = ("; this CPU is one device: simulate more with "
              "XLA_FLAGS=--xla_force_host_platform_device_count=8 before the command")
    raise config_lib.ConfigError(f"mesh / serving.devices: {e}{hint}") from None
  if mesh.devices.size < len(learner_devices):  # (the last were left out, unsaid: with
    # several processes, every device of the last ones, which fed rows to none)
    said = (f"mesh.data x mesh.fsdp x mesh.tensor is {mesh.devices.size} devices, of "
            f"the {len(learner_devices)} the learner has")
    if multi:
      raise config_lib.ConfigError(f"{said}: {MULTI_PROCESS_MESH}")
    if not serving_devices:  # (else they may be the engine's)
      print(f"note: {said}; the rest are idle (mesh.data -1 takes them, mesh.devices "
            "chooses which)", file=sys.stderr)
  return mesh, serving_mesh


def other_vocabulary(m, tokenizer) -> Optional[str]:
  """Why served model `m` cannot read the policy's token ids (its tokenizer's tokens are
  others, or its embedding has fewer rows than the policy's tokens), or None. Embeddings
  padded to other sizes are the same vocabulary (the sizes alone were compared: a
  7B teacher of the same tokenizer, padded to 152,064 rows, was refused for a 1.5B
  student's 151,936, and another tokenizer of one size passed)."""
  if m.tokenizer.identity()["vocab_sha256"] != tokenizer.identity()["vocab_sha256"]:
    return (f"its tokenizer ({m.tokenizer.name}) is not the policy's ({tokenizer.name}): "
            "its token ids mean other tokens")
  if m.engine.vocab_size < tokenizer.vocab_size:
    return (f"its embedding has {m.engine.vocab_size} rows, fewer than the policy's "
            f"{tokenizer.vocab_size} tokens")
  return None


class Serving:
  """The rollout side of a run: an engine client, and a gateway URL for black-box agents
  (and the judge). The in-process engine starts from `params`, or from the policy
  export `policy` = (path, version). `control_token` is what its control calls carry
  (`jaxagent.control`): the environment's with servers by URL; with the in-process
  engine, its gateway's own (the environment's, or one made for it)."""

  def __init__(self, cfg: config_lib.RunConfig, model_cfg, params, tokenizer, mesh, *,
               policy: Optional[tuple[str, int]] = None):
    from rollout_server.client import HttpClient, LocalClient
    from rollout_server.serving import ServerThread

    self._threads = []
    self.orch = None
    self._device_sync = True  # (`engine_copy`)
    self.models = {}
    s = cfg.serving
    self.control_token = control.from_env()
    if s.urls:
      url = s.urls[0]
      if len(s.urls) > 1:  # several servers: route by session through a local router
        from rollout_server.router import create_router

        router = ServerThread(create_router(s.urls, control_token=self.control_token)).start()
        self._threads.append(router)
        url = router.url
      self.client = HttpClient(url, control_token=self.control_token,
                               update_retry_s=cfg.rollout.infra_grace_s)
      self.gateway_url = url
      return
    from rollout_server.serving import build_served_models, make_engine, start_orchestrator
    from rollout_server.server import create_app

    engine = make_engine(model_cfg, s.engine, mesh)
    first = (engine.load_params(path=policy[0], version=policy[1]) if policy is not None
             else engine.load_params(jax.device_put(params, engine.weight_shardings), version=0))
    try:
      self.models = build_served_models(s.models, mesh)
    except ValueError as e:  # (an export of another shape than its model: named)
      raise config_lib.ConfigError(f"serving.{e}") from None
    readers = {name for _, name in policy_token_readers(cfg).values()}
    for name, m in self.models.items():  # the policy's tokens must mean the same to both
      why = other_vocabulary(m, tokenizer) if name in readers else None
      if why is not None:
        self.close_models()
        raise config_lib.ConfigError(f"serving.models.{name}: {why}")
    self.orch = start_orchestrator(engine, first, s.engine)
    self.client = LocalClient(self.orch, engine, models=self.models)
    self.gateway_url = None
    # The gateway serves black-box agents, and the judge of in-process environments.
    if s.gateway or is_blackbox(cfg.agent.kind) or (cfg.env.judge and not cfg.env.judge_url):
      # (on loopback, but any local user reaches it: its control routes are the run's)
      self.control_token = self.control_token or control.new_token()
      app = create_app(self.orch, tokenizer,
                       load_params=lambda path, v: engine.load_params(path=path, version=v),
                       models=self.models, control_token=self.control_token)
      gateway = ServerThread(app).start()
      self._threads.append(gateway)
      self.gateway_url = gateway.url

  def engine_copy(self, params) -> tuple:
    """(the learner's `params` as the in-process engine takes them, how: "reshard" or
    "host"). A device-to-device reshard onto the engine's mesh (its own devices or the
    learner's; with several processes, each process's engine gets the whole model by
    collectives); through the host once the processes' engines do not cover the
    learner's devices (serving.devices a subset), which is said once."""
    if self._device_sync:
      engine = self.client.engine
      try:
        return distributed.copy_to_local(params, engine.weight_shardings,
                                         engine.model_cfg.param_dtype), "reshard"
      except distributed.MeshCoverageError as e:
        self._device_sync = False
        if distributed.is_primary():
          print(f"weight sync through the host: {e}", flush=True)
    return distributed.host_copy(params), "host"

  async def close(self) -> None:
    await self.client.aclose()
    for t in self._threads:
      t.stop()
    if self.orch is not None:
      self.orch.stop()
    self.close_models()

  def close_models(self) -> None:
    for m in self.models.values():
      m.orch.stop()


async def env_workers_ready(cfg: config_lib.RunConfig, say=print) -> None:
  """With `env.urls`, returns once every worker answers /health (a cluster starts them
  with the learner), waiting up to `env.startup_wait_s`; a URL that answers as something
  else than a worker is a ConfigError."""
  if not cfg.env.urls:
    return
  from envs.server import wait_workers

  try:
    await wait_workers(cfg.env.urls, cfg.env.startup_wait_s, say)
  except ValueError as e:
    raise config_lib.ConfigError(f"env.urls: {e}") from None


def make_env_factory(cfg: config_lib.RunConfig):
  """`factory(task) -> Env` (in-process or a remote worker's), and a closer. With
  `env.latency` set, every environment waits that made-up time at each step. The
  modules of `env.imports` are imported here (their workers import them for `env.urls`)."""
  from envs.base import EnvResources, WithLatency, load_modules, make

  latency = env_latency(cfg)
  counter = iter(range(1 << 62))

  def delayed(env):
    if latency.distribution == "none":
      return env
    return WithLatency(env, latency, key=str(next(counter)))

  if cfg.env.urls:
    from envs.server import RemoteEnv, access_problem
    from jaxagent import control

    urls = list(cfg.env.urls)
    token = control.ENVS.from_env()
    problem = access_problem(urls, token)  # (at the start, not at every episode's reset)
    if problem:
      raise config_lib.ConfigError(f"env.urls: {problem}")
    # A session outlives the longest wait between its calls: a policy's turns, as long as
    # their tokens, up to the episode's wall time (a worker closing it as idle made a
    # long last turn's episode an infrastructure error, a re-roll: red team).
    from jaxagent.agent import EPISODE_WALL_FACTOR

    idle_s = EPISODE_WALL_FACTOR * cfg.agent.episode_deadline_s + 60.0
    return (lambda task: delayed(RemoteEnv(urls[next(counter) % len(urls)],
                                           idle_timeout_s=idle_s, token=token))), \
        (lambda: None)
  try:
    load_modules(cfg.env.imports)
  except ValueError as e:
    raise config_lib.ConfigError(f"env.imports: {e}") from None
  from envs.cgroups import check_delegated_cgroups

  try:
    check_delegated_cgroups(cfg.env.cgroups)
  except ValueError as e:
    raise config_lib.ConfigError(f"env.cgroups: {e}") from None
  resources = EnvResources(sandboxes=cfg.env.sandboxes,
                           allow_unisolated=cfg.env.allow_unisolated,
                           cgroups=tuple(cfg.env.cgroups))
  factory = lambda task: delayed(make(task.env, resources))  # noqa: E731
  factory.resources = resources
  return factory, resources.close


def attach_judge(cfg: config_lib.RunConfig, env_factory, serving: Serving,
                 environments=()) -> None:
  """With `env.judge`, in-process environments show their passes to the served judge.
  Says so once when none of `environments` (the names the tasks play) asks a judge, and
  when the judge served here takes shorter prompts (in tokens) than the answers it is
  shown (in characters): a pass it cannot read whole is failed."""
  e = cfg.env
  if not e.judge:
    return
  from envs.base import ENVS
  from envs.judge import DEFAULT_RUBRIC, LLMJudge

  env_factory.resources.judge = LLMJudge(e.judge_url or serving.gateway_url, e.judge,
                                         rubric=e.judge_rubric or DEFAULT_RUBRIC,
                                         max_answer_chars=e.judge_max_answer_chars,
                                         max_tokens=e.judge_max_tokens)
  names = sorted(set(environments))
  if names and not any(getattr(ENVS.get(n), "asks_judge", False) for n in names):
    askers = sorted(n for n, c in ENVS.items() if getattr(c, "asks_judge", False))
    print(f"note: env.judge {e.judge!r} goes unused: none of the tasks' environments "
          f"({', '.join(names)}) asks a judge ("
          + (f"{', '.join(askers)} {'does' if len(askers) == 1 else 'do'}; " if askers else "")
          + "an environment of your own says it does with asks_judge = True)",
          file=sys.stderr)
  served = serving.models.get(e.judge) if not e.judge_url else None
  if served is not None and served.engine.max_prefill_length < e.judge_max_answer_chars:
    print(f"note: the judge {e.judge!r} takes prompts of at most "
          f"{served.engine.max_prefill_length} tokens (its engine's max_prefill_length) and "
          f"is shown answers of up to {e.judge_max_answer_chars} characters "
          "(env.judge_max_answer_chars): a pass too long for it is failed (judge_too_long "
          "in the metrics)", file=sys.stderr)


def first_tasks(path: str) -> dict:
  """{environment name: its first task} over a task file, in the file's order; a file
  that cannot be used (a bad line, a task id on two lines, no tasks) raises ValueError.
  (A stopped run's logged episodes are replayed by the next group of their task's id:
  a task sharing another's id would be handed that task's logs.)"""
  from envs.base import load_tasks

  first = {}
  for task in load_tasks(path, unique=True):
    first.setdefault(task.env, task)
  if not first:
    raise ValueError(f"task file {path} has no tasks")
  return first


async def task_tools(path: str, env_factory, first: Optional[dict] = None,
                     own_envs: Optional[str] = None) -> list[dict]:
  """The tools (OpenAI `tools` entries) the environments of a task file offer: the first
  observation of the first task of each environment the file names (`first`, when the
  caller read them already). A task file that cannot be used (a bad line, no tasks, an
  unknown environment) raises ValueError; an unknown environment's says `own_envs`, how
  the caller's user registers one of their own (`UnknownEnv.said`)."""
  import pydantic

  from envs.base import BAD_TASK, CannotStart, UnknownEnv, cannot_start, failure
  from envs.isolation import IsolationUnavailable
  from rollout_server.server import ToolDef

  first = first_tasks(path) if first is None else first
  tools = {}
  for task in first.values():
    try:
      env = env_factory(task)
    except UnknownEnv as e:  # an environment nobody registered
      raise ValueError(f"task {task.id!r}: {e.said(own_envs or e.OWN)}") from None
    except KeyError as e:  # (a factory's own: its message, unquoted)
      raise ValueError(f"task {task.id!r}: {e.args[0] if e.args else e}") from None
    try:
      try:
        obs = await env.reset(task)
      finally:
        await env.close()
    except (CannotStart, InfraError, IsolationUnavailable, OSError, MemoryError,
            asyncio.CancelledError):
      raise  # (the task's, said already; the infrastructure's; this host's)
    except BAD_TASK as e:  # (the task's parameters of the wrong type or shape: named with
      # its task and the line that raised, as a later task's are; a bad value in the
      # file's first task was a bare "invalid literal for int()": a new user)
      raise cannot_start(task, e) from e
    except Exception as e:  # the environment's bug: named with its task and its line
      raise EpisodeBug(task, e, f"task {task.id!r} ({task.env}): the environment's reset "
                       f"raised {failure(e)} (a bug, not the task's)") from e
    for t in obs.tools:
      try:  # (as the chat gateway takes them: a black-box agent's turns would be refused)
        ToolDef.model_validate(t)
      except pydantic.ValidationError:
        raise ValueError(f"environment {task.env!r} offers a tool that is not an OpenAI "
                         "tools entry ({'type': 'function', 'function': {'name': ...}}): "
                         f"{t!r:.200}") from None
      tools.setdefault(t["function"]["name"], t)
  return list(tools.values())


async def check_task_params(path: str, checked: Sequence, limit_s: float = 5.0
                            ) -> Optional[str]:
  """Resets each task of a task file whose environment runs in this process, needs no
  shared resources and does not opt out (`Env.check_at_start`: its reset checks its
  parameters; `checked`: tasks reset already), for `limit_s` seconds in all: raises
  CannotStart for the first bad one (a misspelt parameter was found only when its task
  was drawn, steps into a run or never; a new user), and returns a note when time ran
  out first. A reset that errs otherwise, or outlasts the time left, is left for its
  play to name."""
  from envs.base import BAD_TASK, ENVS, _load_builtins, cannot_start, load_tasks, make

  _load_builtins()
  done = {t.id for t in checked}

  def checkable(task) -> bool:
    cls = ENVS.get(task.env)
    return (task.id not in done and getattr(cls, "check_at_start", False)
            and not getattr(cls, "needs_resources", True))

  tasks = [t for t in load_tasks(path, unique=True) if checkable(t)]
  t0 = time.monotonic()
  for n, task in enumerate(tasks):
    left = limit_s - (time.monotonic() - t0)
    if left <= 0:
      return (f"data.tasks: {n} of {len(tasks)} tasks' parameters checked in "
              f"{limit_s:.0f}s, not the rest (python -m envs.filter checks a whole file)")
    env = make(task.env)
    try:
      await asyncio.wait_for(env.reset(task), left)
    except BAD_TASK as e:
      raise cannot_start(task, e) from e
    except Exception:  # (the environment's own, or a slow reset: named when played)
      pass
    finally:
      with contextlib.suppress(Exception):  # (a close's error is no task's)
        await env.close()
  return None


async def score_segments(client, groups, scorers: dict, temperature: float,
                         attempts: int = 3) -> dict:
  """Fills in each field of `scorers` on every segment of `groups` with the named served
  model's log-probs of its tokens (a failed call is retried; the last failure is
  raised). Returns metrics: with a teacher, the mean over action tokens of
  log pi_student - log pi_teacher (a sampled estimate of the per-token reverse KL)."""
  segments = [s for g in groups for e in g.episodes for s in e.segments if s.num_action_tokens]
  if not segments:
    return {}
  for field, (key, model) in scorers.items():
    for attempt in range(attempts):
      try:
        scores = await client.score(model, [s.tokens.tolist() for s in segments], temperature)
        break
      except InfraError:
        if attempt == attempts - 1:
          raise
        await asyncio.sleep(0.5 * 2 ** attempt)
    for s, x in zip(segments, scores):
      x = np.asarray(x, np.float32)
      bad = np.flatnonzero(~np.isfinite(x) & (s.loss_mask > 0))
      if bad.size:  # (a reference's -inf went into the KL penalty: the update was not
        # finite, and the run stopped naming its learning rate; a reviewer)
        raise ValueError(f"{key} {model!r} scored token {bad[0]} of segment {s.segment_id} "
                         f"{float(x[bad[0]])}: its log-probs must be finite (a broken scorer)")
      setattr(s, field, x)
  if "teacher_logp" not in scorers:
    return {}
  mask = np.concatenate([s.loss_mask for s in segments])
  gap = np.concatenate([s.rollout_logp - s.teacher_logp for s in segments])
  return {"opd_reverse_kl": float(np.sum(gap * mask) / max(np.sum(mask), 1.0))}

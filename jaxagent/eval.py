"""`python -m jaxagent.eval --policy RUN_DIR/policy[/vN] --tasks FILE [--k 1,4,8] ...`

Plays held-out tasks with a trained policy and reports, per environment and overall:
success rate, pass@k (the unbiased estimator of Chen et al. 2021: with n samples of
which c pass, 1 - C(n - c, k) / C(n, k)), terminal and process rewards, turns, tool
calls, invalid tool calls and episode latency p50/p95/p99. Writes a JSON report
(`--out`, default `eval-<tasks>.json` in the evaluated version's directory,
`<policy>/vN/`; `eval-<tasks>-greedy.json` with `--greedy`) and prints a table. An
episode the infrastructure failed (a server or worker down) is played again twice, on
the same seeds (one that failed by its own actions fails again, never replaced by a
luckier sample), then left out of every figure and counted.

The policy is served in process (an engine built from the run's `config.json`, loaded
with the export's weights, with the models served beside it and a gateway where the
run has them) or by a running server (`--server URL`, which must serve that policy).
Episodes are played as the run plays them: its built-in agent, or its black-box
harness (`agent.kind`) through the gateway; with `env.judge`, passes are shown to the
judge as in training. Each task is played max(k) times (`--samples` to play more) at the run's
temperature, or once greedily with `--greedy` (then only pass@1). Sampling seeds
follow from the task, the sample index and the turn, so a report is reproducible (a
black-box harness of your own that sends no seed has the gateway draw one:
`jaxagent.blackbox.turn_seed` gives it the built-in agents').
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import math
import os
import sys
import time
from typing import Optional, Sequence

import numpy as np

from jaxagent import config as config_lib, control
from jaxagent.errors import EpisodeBug, InfraError, TaskError


def pass_at_k(n: int, c: int, k: int) -> float:
  """The unbiased pass@k estimate from n samples with c successes (k <= n)."""
  if k > n:
    raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
  if n - c < k:
    return 1.0
  return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(episodes_by_task: dict, ks: Sequence[int]) -> dict:
  """Report figures over tasks: {task_id: (env name, [Episode, ...])}."""
  from jaxagent.metrics import percentiles

  everything = [e for _, eps in episodes_by_task.values() for e in eps]
  # An episode the infrastructure failed (retried first) is left out, never a 0.
  episodes = [e for e in everything if not e.infra_error]
  infra = len(everything) - len(episodes)
  if not episodes:  # (figures of nothing: null, never NaN in JSON)
    return {"tasks": len(episodes_by_task), "episodes": 0, "infra_errors": infra,
            "success_rate": None, **{f"pass@{k}": None for k in ks}}
  terminal = [float(e.verdict.get("reward", 0.0) or 0.0) for e in episodes]
  out = {
      "tasks": len(episodes_by_task), "episodes": len(episodes),
      "success_rate": float(np.mean([e.success for e in episodes])),
      "reward_mean": float(np.mean([e.reward for e in episodes])),
      "reward_terminal_mean": float(np.mean(terminal)),
      "reward_process_mean": float(np.mean([e.reward - t for e, t in zip(episodes, terminal)])),
      "turns_mean": float(np.mean([e.turns for e in episodes])),
      "tool_calls_mean": float(np.mean([e.tool_calls for e in episodes])),
      "invalid_tool_calls_mean": float(np.mean([e.invalid_tool_calls for e in episodes])),
      "tool_errors_mean": float(np.mean([getattr(e, "tool_errors", 0) for e in episodes])),
      "truncated": int(sum(e.status == "truncated" for e in episodes)),
      "first_prompt_too_long": len(_unfit(episodes)),
      "infra_errors": infra,
  }
  scored = [[e for e in eps if not e.infra_error] for _, eps in episodes_by_task.values()]
  # Every pass@k over the same tasks: those with max(k) scored samples. Each k over the
  # tasks with k of them read the tasks that lost a sample to the infrastructure (the long,
  # hard ones) into the small k's and out of the large: a task that failed its 7 scored
  # samples and lost its 8th left pass@8 at 1.0 beside pass@1 0.5 (a reviewer).
  whole = [eps for eps in scored if len(eps) >= max(ks, default=0)]
  for k in ks:
    values = [pass_at_k(len(eps), sum(e.success for e in eps), k) for eps in whole]
    out[f"pass@{k}"] = float(np.mean(values)) if values else None
    out[f"pass@{k}_tasks"] = len(values)
  # (the episodes played: one scored 0 unplayed, its first prompt too long, took no time)
  unfit = {id(e) for e in _unfit(episodes)}
  out.update(percentiles([e.latency_s for e in episodes if id(e) not in unfit], "latency_s"))
  return out


def seen_in_training(train_path: str, held_out: list, held_out_path: str) -> Optional[str]:
  """A warning when the held-out tasks are not held out: `held_out_path` is the training
  file (`train_path`) itself, or tasks of both share ids (None: neither, or no training
  file to read). Tasks alike in their environment and parameters are not said: a game of
  few secrets (guess_number's 16) has them in any two files."""
  from envs.base import load_tasks
  from jaxagent.data import tasks_digest

  try:
    if tasks_digest(train_path) == tasks_digest(held_out_path):
      return (f"the held-out tasks {held_out_path} are the training tasks ({train_path}): "
              "the figures are of tasks the policy trained on")
    ids = {t.id for t in load_tasks(train_path)}
  except (OSError, ValueError):  # (the run's file moved or gone: nothing to compare)
    return None
  shared = [t.id for t in held_out if t.id in ids]
  if not shared:
    return None
  return (f"{len(shared)} of the {len(held_out)} held-out tasks in {held_out_path} share "
          f"their ids with training tasks in {train_path} (e.g. {shared[0]!r}): tasks the "
          "policy may have trained on")


def _unfit(episodes) -> list:
  """The episodes whose first prompt did not fit the context (scored 0 unplayed)."""
  from jaxagent.agent import FIRST_PROMPT_TOO_LONG

  return [e for e in episodes if getattr(e, "reason", "") == FIRST_PROMPT_TOO_LONG]


def report(episodes_by_task: dict, ks: Sequence[int]) -> dict:
  """Overall figures and the same per environment; `unfit`: why a first prompt did not
  fit, where one did not (what to raise)."""
  envs = sorted({env for env, _ in episodes_by_task.values()})
  unfit = _unfit([e for _, eps in episodes_by_task.values() for e in eps])
  return {"overall": summarize(episodes_by_task, ks),
          **({"unfit": unfit[0].unfit} if unfit else {}),
          "by_env": {env: summarize({t: v for t, v in episodes_by_task.items() if v[0] == env},
                                    ks) for env in envs}}


async def evaluate(tasks, play, samples: int, concurrency: int = 64, retries: int = 2,
                   warmup: bool = False) -> dict:
  """Plays each task `samples` times (`play(task, session_id)` -> Episode), at most
  `concurrency` episodes at once; an episode the infrastructure failed is played again up
  to `retries` times; {task_id: (env name, [Episode, ...])}. With `warmup`, the first
  task is played once before, in no figure: a new engine compiles on its first requests,
  and the first episodes' latencies held that compilation."""
  if warmup and tasks:
    await play(tasks[0], "eval-warmup")
  slots = asyncio.Semaphore(concurrency)

  async def one(task, j):
    for attempt in range(retries + 1):
      async with slots:
        ep = await play(task, f"eval-{task.id}-{j}" + (f"-r{attempt}" if attempt else ""))
      if not ep.infra_error:
        break
    return ep

  results = await asyncio.gather(*(one(t, j) for t in tasks for j in range(samples)))
  out: dict = {}
  for (task, _), ep in zip(((t, j) for t in tasks for j in range(samples)), results):
    out.setdefault(task.id, (task.env, []))[1].append(ep)
  return out


async def play_as_configured(env, task, serving, tokenizer, agent, session_id: str):
  """One held-out episode played as the run plays its own (`agent.kind`): the built-in
  agent against the engine, or the black-box harness through the gateway."""
  from jaxagent.agent import run_whitebox
  from jaxagent.blackbox import is_blackbox, run_blackbox

  if is_blackbox(agent.kind):
    return await run_blackbox(env, task, serving.gateway_url, agent, session_id=session_id,
                              group_id="eval", tokenizer=tokenizer, api=agent.kind,
                              control_token=serving.control_token)
  return await run_whitebox(env, task, serving.client, tokenizer, agent,
                            session_id=session_id, group_id="eval")


def _num(x) -> float:
  return float("nan") if x is None else x


def print_table(rep: dict, ks: Sequence[int], file=None) -> None:
  cols = ["success_rate", *[f"pass@{k}" for k in ks], "reward_mean", "reward_terminal_mean",
          "turns_mean", "tool_calls_mean", "invalid_tool_calls_mean", "latency_s_p50",
          "latency_s_p95", "latency_s_p99"]
  say = functools.partial(print, file=file)
  names = ["success", *[f"pass@{k}" for k in ks], "reward", "terminal", "turns", "tools",
           "invalid", "p50 s", "p95 s", "p99 s"]
  say(f"{'env':<16} {'tasks':>5} {'eps':>5} {'trunc':>5} {'infra':>5} "
        + " ".join(f"{n:>8}" for n in names))
  rows = [(env, r) for env, r in rep["by_env"].items()] + [("all", rep["overall"])]
  for env, r in rows:
    vals = " ".join(f"{_num(r.get(c)):>8.3f}" for c in cols)
    say(f"{env:<16} {r.get('tasks', 0):>5} {r.get('episodes', 0):>5} "
          f"{r.get('truncated', 0):>5} {r.get('infra_errors', 0):>5} {vals}")
  if rep["overall"].get("infra_errors"):
    say(f"({rep['overall']['infra_errors']} episodes failed in the infrastructure after "
          "retries: left out of every figure)")
  short = [(env, r) for env, r in rows if ks and r.get(f"pass@{ks[0]}_tasks") is not None
           and r[f"pass@{ks[0]}_tasks"] < r.get("tasks", 0)]
  for env, r in short:  # (the table's tasks column is every task's)
    say(f"({env}: pass@k over {r[f'pass@{ks[0]}_tasks']} of its {r['tasks']} tasks, those "
        f"with {max(ks)} scored samples: the others lost some to the infrastructure)")
  if rep["overall"].get("first_prompt_too_long"):  # (scored 0 unplayed: a new user's
    # walkthrough saw a success of 0 and no reason)
    say(f"({rep['overall']['first_prompt_too_long']} episodes scored 0 without a turn: "
        f"their first prompt did not fit. For example: {rep.get('unfit', '')})")


def policy_option(policy: str) -> str:
  """A `--policy` export as given, or as `checkpoint.existing_export` finds it
  (`RUN_DIR/policy/v7` for `.../v00000007`); a ConfigError naming the option where
  there is none (one wording for eval, rollout_server and export_hf)."""
  from jaxagent.checkpoint import existing_export

  try:
    return existing_export(policy)
  except FileNotFoundError as e:
    raise config_lib.ConfigError(f"--policy: {e}") from None


def run_config_of(policy: str, config: Optional[str]) -> config_lib.RunConfig:
  """The run's config: --config, else the config.json of the run the export belongs to."""
  if config is not None:
    return config_lib.load(config_lib.RunConfig, config)
  if not os.path.exists(policy):  # (not "no config.json above it": a new user's finding)
    raise config_lib.ConfigError(f"--policy: no such export {policy}")
  d = os.path.abspath(policy)
  for _ in range(3):  # RUN_DIR/policy/vN, RUN_DIR/policy, RUN_DIR
    path = os.path.join(d, "config.json")
    if os.path.exists(path):
      return config_lib.load(config_lib.RunConfig, path)
    d = os.path.dirname(d)
  raise config_lib.ConfigError(f"--policy: no config.json in the run directory above "
                               f"{policy}; give the run's config with --config")


async def served_policy(url: str) -> tuple[Optional[int], Optional[str]]:
  """The policy version a rollout server (or a router) at `url` serves, and the id of
  the export it loaded it from (`jaxagent.checkpoint.export_id`); None for what cannot
  be told (a router says no id; a server that is down: its episodes will say so)."""
  import httpx

  from jaxagent.tls import shared_tls

  async with httpx.AsyncClient(timeout=10, verify=shared_tls()) as client:
    for path, key in (("/health", "version"), ("/router/health", "policy_version")):
      try:
        r = await client.get(url.rstrip("/") + path)
        got = r.json() if r.status_code == 200 else {}
        value = got.get(key)
      except (httpx.HTTPError, ValueError, AttributeError):
        got, value = {}, None
      if isinstance(value, int):
        served_id = got.get("policy_id")
        return value, served_id if isinstance(served_id, str) else None
  return None, None


async def check_served(url: str, path: str, version: int) -> None:
  """A ConfigError unless the server at `url` serves the export at `path` (`version`):
  another version, or another export of the same version (another run's, or this one
  exported again), would be graded and filed under this export."""
  served, served_id = await served_policy(url)
  if served is not None and served != version:
    raise config_lib.ConfigError(
        f"--server {url} serves policy version {served}, not {path}'s {version}: "
        "evaluate the export it serves, or load this one into it (POST /update_weights, "
        "with the X-Control-Token header where it takes one)")
  from jaxagent.checkpoint import export_id

  mine = export_id(path)
  if served_id is not None and mine is not None and served_id != mine:
    raise config_lib.ConfigError(
        f"--server {url} serves another export of policy version {version} than {path} "
        f"(export id {served_id}, not {mine}: another run's, or this version exported "
        "again): load this one into it (POST /update_weights, with the X-Control-Token "
        "header where it takes one), or evaluate the one it serves")


async def check_control(url: str) -> None:
  """A ConfigError when this process cannot use the control routes of the server at
  `url` (`jaxagent.control`): a black-box episode clears and takes its session's record
  there, and each would fail in the infrastructure."""
  import httpx

  from jaxagent.tls import shared_tls
  from rollout_server.client import control_problem

  url = url.rstrip("/")
  async with httpx.AsyncClient(timeout=10, verify=shared_tls()) as client:
    try:
      health = (await client.get(url + "/health")).json()
    except (httpx.HTTPError, ValueError):
      return  # (a server that is down: its episodes will say so)
    problem = await control_problem(client, url, health, control.from_env())
  if problem:
    raise config_lib.ConfigError(f"--server: {problem} (a black-box agent's episodes "
                                 "clear and take their session's record there)")


async def run(args) -> dict:
  from envs.base import load_tasks
  from envs.loopwatch import LoopWatch
  from jaxagent.build import build_model
  from jaxagent.models.sharding import SAMPLE_RULES, make_mesh
  from jaxagent.run_checks import check_config
  from jaxagent.run_services import (Serving, attach_judge, env_workers_ready,
                                     make_env_factory, task_tools)
  from rollout_server.serving import resolve_policy

  cfg = run_config_of(args.policy, args.config)
  # Checked as a run's (an `agent.kind: opnai` played the built-in agent unnoticed), with
  # these tasks as its data and no eval of its own.
  check_config(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tasks=args.tasks),
                                   eval=config_lib.EvalConfig()))
  # The run's own servers (serving.urls) are not this eval's: --server, or in process;
  # nor are its environment workers (a launch's are gone with it): in process, unless
  # --config names some.
  cfg = dataclasses.replace(cfg, serving=dataclasses.replace(
      cfg.serving, urls=[args.server] if args.server else []))
  if args.config is None:
    cfg = dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, urls=[]))
  ks = sorted({int(k) for k in args.k.split(",")}) if not args.greedy else [1]
  samples = 1 if args.greedy else max(args.samples or 0, max(ks))
  agent = dataclasses.replace(cfg.agent, temperature=0.0 if args.greedy else
                              (args.temperature if args.temperature is not None
                               else cfg.agent.temperature))
  tasks = load_tasks(args.tasks, unique=True)
  if args.limit:
    tasks = tasks[:args.limit]
  # (the run's training file, which --tasks replaced in the check above only; a reviewer:
  # the training file given as held out was evaluated without a word)
  seen = cfg.data.tasks and seen_in_training(cfg.data.tasks, tasks, args.tasks)
  if seen:
    print(f"warning: {seen}", file=sys.stderr, flush=True)
  await env_workers_ready(cfg, lambda m: print(m, file=sys.stderr, flush=True))
  env_factory, close_envs = make_env_factory(cfg)
  serving = None
  try:
    path, version = resolve_policy(args.policy, None)  # (in the try: the environments
    # were left open when it raised; a reviewer)
    if args.server:
      await check_served(args.server, path, version)
      from jaxagent.blackbox import is_blackbox

      if is_blackbox(agent.kind):
        await check_control(args.server)
    try:
      tools = await task_tools(args.tasks, env_factory, own_envs=(
          "eval imports the env.imports of the run's config.json, or of a --config given"))
    except ValueError as e:  # an unknown environment, bad parameters
      raise config_lib.ConfigError(f"--tasks: {e}") from None
    mesh = make_mesh()
    model_cfg, _, tokenizer = build_model(cfg.model, mesh, SAMPLE_RULES, tools=tools)
    # Served as the run serves it: the policy (in process, or --server), the models
    # beside it (a judge), a gateway for a black-box agent.
    serving = Serving(cfg, model_cfg, None, tokenizer, mesh, policy=(path, version))
    attach_judge(cfg, env_factory, serving, {t.env for t in tasks})

    async def play(task, session_id):
      try:
        return await play_as_configured(env_factory(task), task, serving, tokenizer, agent,
                                        session_id)
      except (TaskError, InfraError, EpisodeBug):  # (the task's: exit 2; the
        # infrastructure's; a bug named already: an environment's bad reward)
        raise
      except Exception as e:  # a bug: named with its task and line, as a run names it
        raise EpisodeBug(task, e) from e

    t0 = time.time()
    # (an engine started here compiles on its first requests: not the policy's latency)
    async with LoopWatch() as watch:  # (names an environment's code holding the loop)
      by_task = await evaluate(tasks, play, samples, warmup=not args.server)
    rep = report(by_task, ks)
  finally:
    if serving is not None:
      await serving.close()
    close_envs()
  rep.update(policy=path, policy_version=version, tasks_file=args.tasks, samples=samples,
             temperature=agent.temperature, agent=agent.kind, k=ks,
             wall_s=round(time.time() - t0, 2), loop_held_s=round(watch.held_s, 3))
  return rep


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
      allow_abbrev=False, prog="python -m jaxagent.eval", description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--policy", required=True,
                 help="a policy export: RUN_DIR/policy (latest) or RUN_DIR/policy/vN")
  p.add_argument("--tasks", required=True, help="held-out tasks (JSONL)")
  p.add_argument("--k", default="1", help="pass@k for these k (comma-separated)")
  p.add_argument("--samples", type=int, default=None, help="samples a task (default max k)")
  p.add_argument("--greedy", action="store_true", help="one greedy sample a task (pass@1)")
  p.add_argument("--temperature", type=float, default=None,
                 help="sampling temperature (default: the run's agent.temperature)")
  p.add_argument("--limit", type=int, default=None, help="only the first N tasks")
  p.add_argument("--server", default=None, help="a rollout server serving this policy")
  p.add_argument("--config", default=None, help="the run's config (default: its config.json)")
  p.add_argument("--out", default=None, help="JSON report path")
  p.add_argument("--json", action="store_true", help="print the report as one JSON line")
  args = p.parse_args(argv)
  problem = control.env_problem()
  if problem:
    print(f"error: {problem}", file=sys.stderr)
    return 2
  try:
    if not os.path.isfile(args.tasks):
      raise config_lib.ConfigError(f"--tasks: no such file {args.tasks}" + (
          " (a directory)" if os.path.isdir(args.tasks) else ""))
    args.policy = policy_option(args.policy)
    if args.greedy and (args.k != "1" or args.samples is not None
                        or args.temperature is not None):
      raise config_lib.ConfigError("--greedy plays one sample a task at temperature 0 "
                                   "(pass@1): it takes no --k, --samples or --temperature")
    if args.out is not None:  # (checked before the episodes, not after: red team 25)
      where = os.path.dirname(os.path.abspath(args.out))
      if os.path.isdir(args.out) or not os.path.isdir(where) or not os.access(where, os.W_OK):
        raise config_lib.ConfigError(f"--out: cannot write a report at {args.out} ("
                                     + ("a directory" if os.path.isdir(args.out) else
                                        f"no writable directory {where}") + ")")
    try:
      ks = [int(k) for k in args.k.split(",")]
    except ValueError:
      raise config_lib.ConfigError(f"--k: whole numbers separated by commas, got {args.k!r}"
                                   ) from None
    if min(ks) < 1:
      raise config_lib.ConfigError(f"--k: each k must be >= 1, got {args.k}")
    if args.samples is not None and args.samples < 1:  # (it blamed --k)
      raise config_lib.ConfigError(f"--samples must be >= 1, got {args.samples}")
    if args.samples is not None and args.samples < max(ks):
      raise config_lib.ConfigError(f"--k: each k must be <= --samples ({args.samples}), got "
                                   f"{max(ks)}")
    from jaxagent.run_checks import temperature_problem

    # (inf was every episode an infrastructure failure, exit 3; 1e300 sampled at inf)
    problem = (None if args.temperature is None
               else temperature_problem(args.temperature, "--temperature"))
    if problem:
      raise config_lib.ConfigError(problem)
    if args.limit is not None and args.limit < 1:
      raise config_lib.ConfigError(f"--limit must be >= 1, got {args.limit}")
    if args.server and not args.server.startswith(("http://", "https://")):
      raise config_lib.ConfigError(f"--server: a URL (http://HOST:PORT), got {args.server!r}")
    rep = asyncio.run(run(args))
  except (config_lib.ConfigError, ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except EpisodeBug as e:
    e.say(": no report written")
    return 1
  except InfraError as e:  # (env.urls' workers not up within env.startup_wait_s)
    print(f"error: the infrastructure failed: {e}: no report written", file=sys.stderr)
    return 3
  except KeyboardInterrupt:  # (Ctrl-C: its episodes cancelled, no partial report)
    print("interrupted: no report written", file=sys.stderr)
    return 130
  if not rep["overall"].get("episodes"):  # nothing to report: no report overwritten
    print(f"error: all {rep['overall'].get('infra_errors', 0)} episodes failed in the "
          f"infrastructure{' (is --server ' + args.server + ' up?)' if args.server else ''}: "
          "no report written", file=sys.stderr)
    return 3
  name = (os.path.splitext(os.path.basename(args.tasks))[0] + ("-greedy" if args.greedy else "")
          + (f"-first{args.limit}" if args.limit else ""))  # (never a whole run's report)
  # In the evaluated version's own directory: an eval of RUN_DIR/policy (the latest) after
  # more training does not overwrite the report of the version before.
  out = args.out or os.path.join(rep["policy"], f"eval-{name}.json")
  replaced = os.path.exists(out)  # (an eval of other settings: said, not silent)
  try:
    with open(out, "w") as f:
      json.dump(rep, f, indent=1)
  except OSError as e:  # (the figures, played for, are not lost: printed)
    print(json.dumps(rep))
    print(f"error: the report could not be written at {out} ({e.strerror}): printed "
          "above as JSON; --out names another place", file=sys.stderr)
    return 1
  if args.json:  # the report alone on stdout, for a pipe
    print(json.dumps(rep))
  print_table(rep, rep["k"], file=sys.stderr if args.json else sys.stdout)
  print(f"report: {out}" + (" (it replaces the report that was there; --out keeps both)"
                             if replaced else ""), file=sys.stderr if args.json else sys.stdout)
  return 0


if __name__ == "__main__":
  from jaxagent.checkpoint import end_command

  end_command(main())

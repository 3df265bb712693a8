"""A run's config, checked before anything is built or written: each error a
`ConfigError` naming its key. `jaxagent.train` checks with these at its start, and
`jaxagent.launch` and `jaxagent.eval` before they start anything."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

import numpy as np

from jaxagent import config as config_lib
from jaxagent.blackbox import BLACKBOX_AGENTS, BLACKBOX_CLIENTS, blackbox_agent, is_blackbox
from jaxagent.models.paged_attention import PAGED_KERNELS
from jaxagent.scheduler import check_advantage_config


def temperature_problem(value: float, key: str) -> Optional[str]:
  """What is wrong with sampling temperature `value` (named `key`), or None: one >= 0 (0:
  greedy), finite in float32 (the engine's: 1e300 sampled at inf), and 0 or >= 1e-6 (the
  learner scores at 1e-6 at least: another distribution than the one sampled, its ratios
  not 1; a reviewer)."""
  if not value >= 0 or math.isinf(value):
    return f"{key} must be a finite number >= 0 (0: greedy), got {value}"
  if value > float(np.finfo(np.float32).max):  # (finite, but inf in the engine's float32)
    return f"{key} must be a float32 number (at most 3.4e38), got {value}"
  if 0 < value < 1e-6:
    return f"{key} must be 0 (greedy) or >= 1e-6, got {value}"
  return None


def env_latency(cfg: config_lib.RunConfig):
  """`env.latency` as an `envs.base.Latency`; a bad one is a ConfigError naming it."""
  from envs.base import Latency

  try:
    return Latency(**dataclasses.asdict(cfg.env.latency))
  except ValueError as e:
    raise config_lib.ConfigError(f"env.latency: {e}") from None


def check_model_and_learner(cfg: config_lib.RunConfig) -> None:
  """The model and learner settings, checked before anything is built (each error
  names its key)."""
  from jaxagent import learner as learner_lib

  check_model(cfg.model)
  try:
    learner_lib.check_config(cfg.learner)
  except ValueError as e:
    raise config_lib.ConfigError(str(e)) from None


def check_lengths(cfg: config_lib.RunConfig, checkpoint_positions: Optional[int] = None
                  ) -> None:
  """The context's length against the engine's, a row's and the model's positions: every
  setting that does not fit in one error, with the overrides that fit them all (they came
  one at a time, the first saying to lower agent.max_context_tokens below the task's
  prompt: a new user). A checkpoint's positions are known once it is read (reading a
  GGUF's metadata alone took 2.5 s): the run checks them again then, passing
  `checkpoint_positions`."""
  from jaxagent.models.config import PRESETS, preset

  a, e, m = cfg.agent, cfg.serving.engine, cfg.model
  n = a.max_context_tokens
  if a.kind == "whitebox" and n <= a.max_new_tokens:  # (no turn could ever be sampled:
    # the run trained nothing, saying only that first prompts did not fit; a black-box
    # agent's context is its harness's)
    raise config_lib.ConfigError(
        f"agent.max_context_tokens ({n}) must be more than agent.max_new_tokens "
        f"({a.max_new_tokens}): a turn's prompt and its reply fit in the context")
  if a.kind == "whitebox" and a.compaction == "summary" and \
      not 1 <= a.summary_max_tokens < n - a.max_new_tokens:
    # (0 failed the first compaction, mid-run, naming no key; one as long as the context
    # left the summary's prompt no room)
    raise config_lib.ConfigError(
        f"agent.summary_max_tokens must be in 1..{n - a.max_new_tokens - 1} with "
        f"agent.compaction summary (less than agent.max_context_tokens {n} minus "
        f"agent.max_new_tokens {a.max_new_tokens}), got {a.summary_max_tokens}")
  takes = min(e.max_prefill_length + a.max_new_tokens, e.max_seq_len)
  problems = []
  if not cfg.serving.urls and n > takes:
    # (compaction triggers at max_context_tokens: the engine's limit must not come first)
    problems.append(
        f"agent.max_context_tokens ({n}) is more than the engine takes (prompts of "
        f"serving.engine.max_prefill_length {e.max_prefill_length} plus agent.max_new_tokens "
        f"{a.max_new_tokens}, within max_seq_len {e.max_seq_len}: {takes})")
  if cfg.data.seq_len < n and a.kind == "whitebox":
    # A longer episode would train only its first seq_len tokens (its failure's last
    # turns never pushed down).
    problems.append(f"data.seq_len ({cfg.data.seq_len}) is shorter than "
                    f"agent.max_context_tokens ({n}): an episode must fit a row")
  positions, whose = m.max_seq_len, "set"
  if positions is None and m.checkpoint is None and m.preset in PRESETS:
    positions, whose = preset(m.preset).max_seq_len, f"preset {m.preset}'s"
  elif positions is None and m.checkpoint is not None:  # (contexts past the one it was
    positions, whose = checkpoint_positions, "the checkpoint's"  # trained on, unsaid)
  longest = max(cfg.data.seq_len, 0 if cfg.serving.urls else e.max_seq_len)
  if positions is not None and longest > positions:
    problems.append(f"the model is for {positions} positions (model.max_seq_len, {whose}), "
                    f"and its contexts run to {longest} (data.seq_len, "
                    "serving.engine.max_seq_len)")
  if not problems:
    return
  seq = max(n + a.max_new_tokens, e.max_seq_len)
  fit = [f"agent.max_context_tokens={n}",
         f"serving.engine.max_prefill_length={max(n, e.max_prefill_length)}",
         f"serving.engine.max_seq_len={seq}", f"data.seq_len={max(n, cfg.data.seq_len)}"]
  if positions is not None:
    fit.append(f"model.max_seq_len={max(positions, seq, cfg.data.seq_len)}")
  lower = min(takes if not cfg.serving.urls else n,
              cfg.data.seq_len if a.kind == "whitebox" else n)
  raise config_lib.ConfigError(
      "; ".join(problems) + f" (contexts of {n} tokens fit with {' '.join(fit)}"
      + (f"; or lower agent.max_context_tokens to {lower})" if lower < n else ")"))


def check_model(m: config_lib.ModelSpec, key: str = "model") -> None:
  """A model's settings (the policy's, or a served model's under `key`), checked before
  anything is built."""
  from jaxagent.build import TEMPLATES, hf_tokenizer_file, model_overrides
  from jaxagent.models.config import PRESETS, preset

  for field in ("dtype", "param_dtype"):  # (another was a numpy or JAX traceback)
    if getattr(m, field) not in config_lib.FLOAT_DTYPES:
      raise config_lib.ConfigError(f"{key}.{field}: {', '.join(config_lib.FLOAT_DTYPES)}, got "
                                   f"{getattr(m, field)!r}")
  if m.checkpoint is None:
    if m.preset not in PRESETS:
      import difflib

      close = difflib.get_close_matches(m.preset, PRESETS, n=1)
      hint = f" (did you mean {close[0]!r}?)" if close else ""
      raise config_lib.ConfigError(f"{key}.preset: unknown {m.preset!r}{hint}; known: "
                                   f"{', '.join(sorted(PRESETS))}")
    try:
      preset(m.preset, **model_overrides(m))
    except (ValueError, TypeError) as e:
      raise config_lib.ConfigError(f"{key}: {e}") from None
  elif m.checkpoint != "smollm2" and not os.path.exists(m.checkpoint):
    raise config_lib.ConfigError(f"{key}.checkpoint: no such file or directory "
                                 f"{m.checkpoint!r} (a .gguf file, a Hugging Face directory "
                                 "or 'smollm2')")
  elif os.path.isdir(m.checkpoint):
    hf_tokenizer_file(m.checkpoint, m.tokenizer)
  if m.chat_template not in TEMPLATES:
    raise config_lib.ConfigError(f"{key}.chat_template: unknown {m.chat_template!r}; known: "
                                 "null (the tokenizer's own), chatml_tools")


def check_served_models(models: dict, key: str = "serving.models") -> None:
  """Each of the served `models` (a run's `serving.models`, a server's `models`): its
  model, and the export it loads (before anything is built: they were tracebacks from
  the engine, after the run directory was made)."""
  from rollout_server.serving import resolve_policy

  for name, m in models.items():
    check_model(m.model, f"{key}.{name}.model")
    config_lib.check_engine(m.engine, f"{key}.{name}.engine")
    if m.policy:
      from jaxagent.checkpoint import existing_export

      try:  # (`.../v7` names `.../v00000007`, as `--policy` does)
        existing_export(m.policy)
      except FileNotFoundError:
        raise config_lib.ConfigError(f"{key}.{name}.policy: no such export {m.policy!r}") \
            from None
      try:
        resolve_policy(m.policy, None)
      except (ValueError, FileNotFoundError, OSError) as e:
        raise config_lib.ConfigError(f"{key}.{name}.policy: {e}") from None


def _check_ranges(cfg: config_lib.RunConfig) -> None:
  """Counts and limits that must be positive (a 0 made the run hang with no output,
  sampling nothing or learning from nothing), and the sampling parameters."""
  r, a, d = cfg.rollout, cfg.agent, cfg.data
  at_least_one = {"steps": cfg.steps, "rollout.groups_per_step": r.groups_per_step,
                  "rollout.max_concurrent_episodes": r.max_concurrent_episodes,
                  "rollout.window": r.window, "rollout.sync_every": r.sync_every,
                  "agent.max_turns": a.max_turns, "agent.max_new_tokens": a.max_new_tokens,
                  "data.rows": d.rows, "data.seq_len": d.seq_len,
                  "serving.engine.slots": cfg.serving.engine.slots,
                  "stop_window": cfg.stop_window}
  for key, value in at_least_one.items():
    if value < 1:
      raise config_lib.ConfigError(f"{key} must be >= 1, got {value}")
  if r.mode == "window" and r.window < r.groups_per_step:  # (it waited for ever)
    raise config_lib.ConfigError(
        f"rollout.window ({r.window}) must be >= rollout.groups_per_step "
        f"({r.groups_per_step}): a step takes its groups from the oldest `window` in flight")
  c = cfg.checkpoint
  if c.export_dtype is not None and c.export_dtype not in config_lib.FLOAT_DTYPES:
    # (it was ignored)
    raise config_lib.ConfigError(f"checkpoint.export_dtype: null (the parameters' own), "
                                 f"{', '.join(config_lib.FLOAT_DTYPES)}, got {c.export_dtype!r}")
  if not 0 <= cfg.stop_success_rate <= 1:  # (2 was taken: a stop that could never come)
    raise config_lib.ConfigError(f"stop_success_rate must be in [0, 1] (0: no early stop), "
                                 f"got {cfg.stop_success_rate}")
  if c.keep < 1:  # (0 kept none: a resume started again from step 0)
    raise config_lib.ConfigError(f"checkpoint.keep must be >= 1 (checkpoints kept), got "
                                 f"{c.keep}")
  not_negative = {"rollout.max_retries": r.max_retries, "rollout.max_staleness":
                  r.max_staleness, "agent.turn_retries": a.turn_retries, "agent.top_k": a.top_k,
                  "checkpoint.every_steps": c.every_steps,
                  "checkpoint.export_every": c.export_every,
                  "checkpoint.canary_tasks": c.canary_tasks,
                  "serving.startup_wait_s": cfg.serving.startup_wait_s,
                  "env.startup_wait_s": cfg.env.startup_wait_s}
  not_negative["agent.keep_last_messages"] = a.keep_last_messages
  for key, value in not_negative.items():
    if not value >= 0:  # (nan too)
      raise config_lib.ConfigError(f"{key} must be >= 0, got {value}")
  # (nan passed `< 0` checks: a redundancy of nan killed the async producer, and the run
  # hung without a word; an infra_grace_s of nan would never let an outage stop it)
  for key, value in {"rollout.redundancy": r.redundancy, "rollout.infra_grace_s":
                     r.infra_grace_s, "rollout.retry_backoff_s": r.retry_backoff_s}.items():
    if not (value >= 0 and math.isfinite(value)):
      raise config_lib.ConfigError(f"{key} must be a number >= 0, got {value}")
  if not 0 <= r.max_infra_fraction <= 1:
    raise config_lib.ConfigError(f"rollout.max_infra_fraction must be in [0, 1] (1: never "
                                 f"stop), got {r.max_infra_fraction}")
  adv = cfg.advantage
  if not 0 <= adv.gamma <= 1:  # (nan trained every weight to nan, saved as a checkpoint)
    raise config_lib.ConfigError(f"advantage.gamma must be in [0, 1], got {adv.gamma}")
  if not math.isfinite(adv.opd_coef):
    raise config_lib.ConfigError(f"advantage.opd_coef must be a finite number, got "
                                 f"{adv.opd_coef}")
  config_lib.check_engine(cfg.serving.engine, "serving.engine")
  config_lib.check_mesh(cfg.mesh)
  if cfg.env.sandboxes < 1:
    raise config_lib.ConfigError(f"env.sandboxes must be >= 1, got {cfg.env.sandboxes}")
  positive = {"learner.lr": cfg.learner.lr, "agent.turn_deadline_s": a.turn_deadline_s,
              "agent.episode_deadline_s": a.episode_deadline_s,
              "agent.env_call_deadline_s": a.env_call_deadline_s}
  for key, value in positive.items():
    if not (value > 0 and math.isfinite(value)):
      raise config_lib.ConfigError(f"{key} must be a number > 0, got {value}")
  if cfg.learner.lr > float(np.finfo(np.float32).max):  # (inf in the step: 1e39)
    raise config_lib.ConfigError(f"learner.lr must be a float32 number, got {cfg.learner.lr}")
  problem = temperature_problem(a.temperature, "agent.temperature")
  if problem:
    raise config_lib.ConfigError(problem)
  if not 0 < a.top_p <= 1:
    raise config_lib.ConfigError(f"agent.top_p must be in (0, 1], got {a.top_p}")
  if a.temperature == 0:  # (red team 26: the gradient of a greedy token's log-prob is 0)
    raise config_lib.ConfigError(
        "agent.temperature: 0 (greedy) trains nothing (the learner's log-prob of a greedy "
        "token has no gradient); sample at a temperature > 0, and evaluate greedily with "
        "eval.greedy")
  if (a.top_p < 1 or a.top_k) and cfg.learner.correction_mode != "none":
    # (the engine's log-probs are of the truncated distribution, the learner's of the
    # whole: every token's weight was the mass kept, 0.55 at top_k 5: red team 26)
    raise config_lib.ConfigError(
        f"learner.correction_mode {cfg.learner.correction_mode}: with agent.top_p < 1 or "
        "agent.top_k > 0 the engine's log-probs are of the truncated distribution and the "
        "learner's of the whole one, so the correction would weigh every token by the "
        "mass kept; sample from the whole distribution or set learner.correction_mode: none")


def ignored_temperature(cfg: config_lib.RunConfig) -> Optional[str]:
  """A note for a `learner.temperature` of the run's own, which it ignores (it scores
  tokens at the temperature they were sampled at: ignored without a word before; a
  note, not an error, so that a run saved with one still resumes)."""
  t, a = cfg.learner.temperature, cfg.agent.temperature
  if t in (1.0, a, max(a, 1e-6)):
    return None
  return (f"learner.temperature ({t}) is ignored: a run scores tokens at the temperature "
          f"they were sampled at, agent.temperature ({a})")


def _no_such_file(key: str, path: str, why: str = "") -> config_lib.ConfigError:
  """`key: no such file PATH`, and for a relative path where it was looked for (a new
  user ran the bundled config from another directory)."""
  where = ""
  if not os.path.isabs(path):
    where = f"; relative paths are read from the working directory ({os.getcwd()})"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.exists(os.path.join(root, path)) and os.path.realpath(root) != os.path.realpath(
        os.getcwd()):  # (a new user ran a bundled config from another directory)
      where += (f": run from the repository root ({root}), or give {key}="
                f"{os.path.join(root, path)}")
  return config_lib.ConfigError(f"{key}: no such file {path!r}{why}{where}")


def check_config(cfg: config_lib.RunConfig) -> None:
  if (not cfg.name or cfg.name in (".", "..") or len(cfg.name) > 200
      or any(c in "/\\" or not c.isprintable() for c in cfg.name)):
    # (it names the run's directory, runs/<name>-<time>: `../x` wrote outside runs/, a
    # `/` made directories; a reviewer. Spaces and other scripts stay: runs so named
    # resume and evaluate as before)
    raise config_lib.ConfigError(
        f"name: {cfg.name!r}: a run's name holds no '/', '\\' or unprintable character, "
        "is not '.' or '..', and is 1-200 characters (it names the run's directory, "
        "runs/<name>-<time>; a run so named goes on with name=... given)")
  _check_ranges(cfg)
  check_model_and_learner(cfg)
  check_served_models(cfg.serving.models)
  if not cfg.data.tasks:
    raise config_lib.ConfigError("data.tasks: a task file (JSONL) is required")
  if not os.path.isfile(cfg.data.tasks):
    raise _no_such_file("data.tasks", cfg.data.tasks,
                        " (a directory)" if os.path.isdir(cfg.data.tasks) else "")
  if cfg.rollout.mode not in ("sync", "async", "window"):
    raise config_lib.ConfigError(config_lib.unknown_value(
        "rollout.mode", cfg.rollout.mode, ("sync", "async", "window")))
  if cfg.rollout.update_mode not in UPDATE_MODES:  # (it failed the first weight sync,
    # a rollout and a step in, naming no key)
    raise config_lib.ConfigError(config_lib.unknown_value(
        "rollout.update_mode", cfg.rollout.update_mode, UPDATE_MODES))
  if cfg.eval.limit < 0:  # (-1 evaluated every held-out task but the last)
    raise config_lib.ConfigError(f"eval.limit must be >= 0 (0: every task), got "
                                 f"{cfg.eval.limit}")
  t = cfg.trajectories
  if t.mode not in ("all", "sample", "none"):
    raise config_lib.ConfigError(config_lib.unknown_value("trajectories.mode", t.mode,
                                                          ("all", "sample", "none")))
  if t.compress not in ("gzip", "none"):
    raise config_lib.ConfigError(config_lib.unknown_value("trajectories.compress", t.compress,
                                                          ("gzip", "none")))
  if t.sample_every < 1:
    raise config_lib.ConfigError(f"trajectories.sample_every must be >= 1, got "
                                 f"{t.sample_every}")
  if cfg.eval.every:
    if cfg.eval.every < 0:
      raise config_lib.ConfigError(f"eval.every must be >= 0 (0: never), got {cfg.eval.every}")
    if cfg.eval.every % cfg.rollout.sync_every:  # (it would play older weights than its step's)
      raise config_lib.ConfigError(
          f"eval.every ({cfg.eval.every}) must be a multiple of rollout.sync_every "
          f"({cfg.rollout.sync_every}): an evaluation plays the served weights, which are "
          "the learner's only every sync_every steps")
    if not cfg.eval.tasks:
      raise config_lib.ConfigError("eval.every needs eval.tasks (a task file of held-out "
                                   "tasks)")
    if not os.path.isfile(cfg.eval.tasks):
      raise _no_such_file("eval.tasks", cfg.eval.tasks, " (a directory)" if os.path.isdir(
          cfg.eval.tasks) else " (needed with eval.every)")
    from envs.base import load_tasks
    try:  # (at the start, not at the first evaluation)
      load_tasks(cfg.eval.tasks, unique=True)
    except ValueError as e:
      raise config_lib.ConfigError(f"eval.tasks: {e}") from None
    samples = 1 if cfg.eval.greedy else cfg.eval.samples
    if not cfg.eval.k or min(cfg.eval.k) < 1 or max(cfg.eval.k) > samples:
      raise config_lib.ConfigError(f"eval.k: each k must be in 1..{samples} (eval.samples; "
                                   "1 when eval.greedy)")
  if cfg.agent.kind != "whitebox" and not is_blackbox(cfg.agent.kind):
    raise config_lib.ConfigError(config_lib.unknown_value(
        "agent.kind", cfg.agent.kind, ("whitebox", *BLACKBOX_AGENTS),
        ", or module:function (a harness of your own)"))
  if is_blackbox(cfg.agent.kind) and cfg.agent.kind not in BLACKBOX_AGENTS:
    try:
      blackbox_agent(cfg.agent.kind)
    except ValueError as e:
      raise config_lib.ConfigError(str(e)) from None
  if cfg.agent.kind in BLACKBOX_AGENTS:
    import importlib
    library = BLACKBOX_CLIENTS[cfg.agent.kind]
    try:  # (imported here, before any episode: at an episode's first turn, anthropic's
      # 1.1 s held the loop every episode moves on, and the loop watch said so)
      importlib.import_module(library)
    except ImportError:  # (the episode's ImportError)
      raise config_lib.ConfigError(
          f"agent.kind {cfg.agent.kind}: its client library is not installed (pip install "
          f"'jaxagent[blackbox]', or pip install {library})")
  if cfg.agent.compaction not in ("none", "summary", "fork"):
    raise config_lib.ConfigError(config_lib.unknown_value(
        "agent.compaction", cfg.agent.compaction, ("none", "summary", "fork")))
  check_lengths(cfg)
  if cfg.rollout.group_size < 2:
    raise config_lib.ConfigError("rollout.group_size must be >= 2 for group advantages")
  if cfg.rollout.infra_window < 1:
    raise config_lib.ConfigError(f"rollout.infra_window must be >= 1, got "
                                 f"{cfg.rollout.infra_window}")
  if cfg.rollout.max_sample_rounds < 1:
    raise config_lib.ConfigError("rollout.max_sample_rounds must be >= 1")
  kernel = cfg.serving.engine.attention_kernel
  if kernel not in ("auto",) + PAGED_KERNELS:
    raise config_lib.ConfigError(config_lib.unknown_value(
        "serving.engine.attention_kernel", kernel, ("auto", *PAGED_KERNELS)))
  page_size = cfg.serving.engine.page_size
  if kernel == "triton" and not (page_size >= 16 and page_size & (page_size - 1) == 0):
    # head_dim, known once the model is built, is checked by the engine.
    raise config_lib.ConfigError(f"serving.engine.attention_kernel: triton needs page_size a "
                                 f"power of two >= 16, got {page_size}")
  if kernel == "triton" and cfg.mesh.tensor > 1 and not cfg.serving.devices:
    raise config_lib.ConfigError("serving.engine.attention_kernel: triton reads whole KV "
                                 "heads, and the engine shares the learner's mesh, which "
                                 "splits them (mesh.tensor > 1): use gather, or give the "
                                 "engine devices of its own (serving.devices)")
  try:
    check_advantage_config(cfg.advantage)
  except ValueError as e:
    raise config_lib.ConfigError(str(e)) from None
  if cfg.advantage.teacher and (cfg.agent.temperature <= 0 or cfg.agent.top_p < 1
                                or cfg.agent.top_k):
    # The student's log-probs must be of the distribution the teacher is compared with.
    raise config_lib.ConfigError("advantage.teacher: sample the student from its whole "
                                 "distribution (agent.temperature > 0, agent.top_p 1, "
                                 "agent.top_k 0)")
  for key, urls in (("serving.urls", cfg.serving.urls), ("env.urls", cfg.env.urls),
                    ("env.judge_url", [cfg.env.judge_url] if cfg.env.judge_url else [])):
    for url in urls:
      check_url(key, url)
  if cfg.serving.models and cfg.serving.urls:
    raise config_lib.ConfigError("serving.models: only for in-process serving; with "
                                 "serving.urls declare the models in the servers' configs")
  if cfg.env.judge and cfg.env.urls:
    raise config_lib.ConfigError("env.judge: in-process environments only (not with env.urls)")
  if not cfg.serving.urls:
    check_served_names(cfg)
  env_latency(cfg)


UPDATE_MODES = ("drain", "abort")


def check_url(key: str, url) -> None:
  """A server's address, `http(s)://host[:port]`, or a ConfigError naming `key` (one
  without its scheme was waited on for serving.startup_wait_s, an error that could not
  clear: a new user)."""
  from urllib.parse import urlsplit

  try:
    parts = urlsplit(url)
    ok = parts.scheme in ("http", "https") and bool(parts.hostname)
    parts.port  # noqa: B018 (a port out of range or not a number raises)
  except (ValueError, TypeError, AttributeError):
    ok = False
  if not ok:
    raise config_lib.ConfigError(f"{key}: {url!r} is not a server's address (give "
                                 "http://HOST:PORT or https://...)")


def check_served_names(cfg: config_lib.RunConfig) -> None:
  """Each served model the run names (a KL reference, a teacher, a judge, a summariser)
  is one of its `serving.models` (ConfigError naming the key); one that reads the
  policy's tokens (`policy_token_readers`) takes them as long as an episode's segment
  runs (a teacher of the default 1,024 failed every step of 4,096-token episodes)."""
  judge = {"judge": ("env.judge", cfg.env.judge)} if cfg.env.judge and not cfg.env.judge_url \
      else {}
  for key, name in {**policy_token_readers(cfg), **judge}.values():
    if name not in cfg.serving.models:
      raise config_lib.ConfigError(f"{key}: no served model {name!r} in serving.models "
                                   f"(have {sorted(cfg.serving.models)})")
  a, e = cfg.agent, cfg.serving.engine
  longest, whose = ((a.max_context_tokens, "agent.max_context_tokens") if a.kind == "whitebox"
                    else (e.max_seq_len, "serving.engine.max_seq_len"))
  for key, name in served_scorers(cfg).values():
    theirs = cfg.serving.models[name].engine.max_seq_len
    if theirs < longest:
      raise config_lib.ConfigError(
          f"{key}: serving.models.{name}.engine.max_seq_len ({theirs}) is shorter than the "
          f"episodes it scores ({whose}: {longest})")


def policy_token_readers(cfg: config_lib.RunConfig) -> dict[str, tuple[str, str]]:
  """The served models that read the policy's token ids as they are (scorers, a
  summariser, whose prompt the policy's tokenizer renders and whose reply it decodes):
  their vocabulary must be the policy's. Field or role -> (config key, model name)."""
  out = dict(served_scorers(cfg))
  if cfg.agent.compaction == "summary" and cfg.agent.summarizer:
    out["summary"] = ("agent.summarizer", cfg.agent.summarizer)
  return out


def served_scorers(cfg: config_lib.RunConfig) -> dict[str, tuple[str, str]]:
  """The segment fields a served model fills in before batching: field -> (the config
  key that asks for it, the model's name)."""
  out = {}
  if cfg.learner.kl_coef and cfg.learner.kl_reference != "initial":
    out["ref_logp"] = ("learner.kl_reference", cfg.learner.kl_reference)
  if cfg.advantage.teacher:
    out["teacher_logp"] = ("advantage.teacher", cfg.advantage.teacher)
  return out

"""`python -m rollout_server --config configs/server_tiny.yaml [key=value ...]`, or
`python -m rollout_server --policy RUN_DIR/policy [key=value ...]` to serve a trained
run's policy (its latest export, or `.../vN`) with the run's model and engine settings
(from its `config.json`). With JAXAGENT_CONTROL_TOKEN set, its control routes
(update_weights, abort, handover, a session's delete) take the X-Control-Token header
(docs/serving.md); unset, they are open."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from jaxagent import config as config_lib, control
from jaxagent.serve_http import add_log_level, listen_or_say, serve
from rollout_server.serving import build_app


def main(argv=None) -> int:
  from jaxagent.cli_args import log_to_console

  log_to_console()
  p = argparse.ArgumentParser(
      allow_abbrev=False, prog="python -m rollout_server", description=__doc__)
  p.add_argument("--config", help="YAML server config (see configs/)")
  p.add_argument("--policy", help="a trained run's policy export (RUN_DIR/policy: the latest "
                                  "version, or RUN_DIR/policy/vN)")
  p.add_argument("--host", help="where to listen (the config's host; as the override host=)")
  p.add_argument(control.OPEN_FLAG, action="store_true",
                 help="serve the control routes without a token beyond this machine")
  p.add_argument("--port", type=int, help="the port (the config's port; as the override port=)")
  add_log_level(p)
  p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. port=8001")
  args = config_lib.parse_with_overrides(p, argv, config_lib.ServerConfig)
  problem = control.env_problem()
  if problem:
    print(f"error: {problem}", file=sys.stderr)
    return 2
  args.overrides += [f"{k}={v}" for k, v in (("host", args.host), ("port", args.port))
                     if v is not None]
  try:
    if args.config is None and args.policy is None:
      raise config_lib.ConfigError("give --config (a server config) or --policy (a run's "
                                   "policy export)")
    base = None
    if args.policy is not None:
      from jaxagent.eval import policy_option, run_config_of

      args.policy = policy_option(args.policy)
      run = run_config_of(args.policy, None)
      base = config_lib.ServerConfig(name=run.name, model=run.model,
                                     engine=run.serving.engine, policy=args.policy)
    cfg = config_lib.load(config_lib.ServerConfig, args.config, args.overrides, base=base)
    if args.policy is not None and args.config is not None:
      changes = base.model.weight_changes(cfg.model)
      if changes:  # (its weights would not fit: an Orbax shape error)
        raise config_lib.ConfigError(
            f"--config {args.config} sets a model other than the policy's ("
            + ", ".join(f"model.{c}" for c in changes) + "); with --policy, leave the model "
            "out of --config")
      cfg = dataclasses.replace(cfg, policy=args.policy)
    if not 0 < cfg.port < 65536:
      raise config_lib.ConfigError(f"port must be in 1..65535, got {cfg.port}")
    if cfg.stall_s is not None and not cfg.stall_s > 0:  # (0 read every step as hung)
      raise config_lib.ConfigError(f"stall_s must be > 0 seconds, or null (never), got "
                                   f"{cfg.stall_s}")
    # (each started, and refused every request, or lost every session's record, or
    # failed every turn of one with a 500: a red team)
    for key, bounded in (("max_sessions", True), ("max_body_bytes", True),
                         ("session_max_bytes", False), ("session_ttl_s", False)):
      value = getattr(cfg, key)
      if (value is None and bounded) or value is not None and not value > 0:
        raise config_lib.ConfigError(f"{key} must be > 0" + (
            "" if bounded else ", or null (unbounded)") + f", got {value}")
    from jaxagent.run_checks import UPDATE_MODES, check_model_and_learner, check_served_models

    if cfg.update_mode not in UPDATE_MODES:  # (each weight update was refused, 400)
      raise config_lib.ConfigError(config_lib.unknown_value("update_mode", cfg.update_mode,
                                                            UPDATE_MODES))

    check_model_and_learner(config_lib.RunConfig(model=cfg.model))  # as train names them
    check_served_models(cfg.models, "models")
    config_lib.check_engine(cfg.engine, "engine")
    config_lib.check_mesh(cfg.mesh)
  except config_lib.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  unguarded = control.open_beyond_this_machine(control.CONTROL, control.from_env(), cfg.host)
  if unguarded and not args.open_routes:
    print(f"error: {unguarded}", file=sys.stderr)
    return 2
  sock = listen_or_say(cfg.host, cfg.port)  # (before the model loads: fails at once)
  if sock is None:
    return 2
  try:
    app, orch, models = build_app(cfg)
  except (ValueError, KeyError) as e:  # e.g. a served model whose export is missing
    sock.close()
    print(f"error: {e.args[0] if isinstance(e, KeyError) and e.args else e}", file=sys.stderr)
    return 2
  except Exception as e:
    from rollout_server.serving import memory_problem

    too_large = memory_problem(e, cfg.engine)
    if not too_large:
      raise
    sock.close()
    print(f"error: {too_large}", file=sys.stderr)
    return 2
  print(f"rollout server {cfg.name} on http://{cfg.host}:{cfg.port} "
        f"(policy version {orch.version}"
        + (f"; also serving {', '.join(sorted(models))})" if models else ")")
        + f"; {control.describe(control.from_env())}", flush=True)
  try:
    serve(app, sock, log_level=args.log_level)
  finally:
    orch.stop()
    for m in models.values():
      m.orch.stop()
  return 0


if __name__ == "__main__":
  sys.exit(main())

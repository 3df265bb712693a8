"""`python -m rollout_server --config configs/server_tiny.yaml [key=value ...]`."""

from __future__ import annotations

import argparse
import sys

import uvicorn

from jaxagent import config as config_lib
from rollout_server.serving import build_app


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m rollout_server", description=__doc__)
  p.add_argument("--config", required=True, help="YAML server config (see configs/)")
  p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. port=8001")
  args = p.parse_args(argv)
  try:
    cfg = config_lib.load(config_lib.ServerConfig, args.config, args.overrides)
  except config_lib.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  app, orch = build_app(cfg)
  print(f"rollout server {cfg.name} on http://{cfg.host}:{cfg.port} "
        f"(policy version {orch.version})", flush=True)
  try:
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="info")
  finally:
    orch.stop()
  return 0


if __name__ == "__main__":
  sys.exit(main())

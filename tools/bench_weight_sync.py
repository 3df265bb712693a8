"""Weight-sync time from the learner to the rollout engine, by path, in one run.

  python tools/bench_weight_sync.py [--presets tiny,smollm2-135m] [--devices 8] [--repeats 5]
      [--json]

Paths (each the time until the engine's weights are placed and ready):
- `colocated`: learner and engine share all devices (time-shared); the engine's
  sampling shardings (no FSDP) are resharded from the learner's (FSDP) on device;
- `reshard`: the learner on the first half of the devices (FSDP over them), the
  engine on the other half (`mesh.devices` / `serving.devices`): a device-to-device
  reshard between two meshes, no host copy;
- `export`: what remote servers do: an Orbax policy export (bfloat16) and the
  engine's load of it from disk.
On CPU the "devices" are host threads (`--xla_force_host_platform_device_count`), so
the reshard paths are memory copies; the ratio to `export` is what carries over.
Prints one JSON line per (preset, path), then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--presets", default="tiny,smollm2-135m")
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--json", action="store_true")
  args = p.parse_args()
  if "jax" in sys.modules:
    raise SystemExit("run as a script: the device count is set before JAX starts")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={args.devices}")
  import jax
  import numpy as np

  from jaxagent.checkpoint import export_policy
  from jaxagent.models.config import preset
  from jaxagent.models.params import init_params
  from jaxagent.models.sharding import make_mesh
  from rollout_server.engine import Engine

  devs = jax.devices()
  half = len(devs) // 2
  rows = []
  for name in args.presets.split(","):
    cfg = preset(name)
    nbytes = 4 * cfg.num_params()
    cases = {"colocated": (make_mesh(fsdp=len(devs), devices=devs), make_mesh(devices=devs)),
             "reshard": (make_mesh(fsdp=half, devices=devs[:half]),
                         make_mesh(devices=devs[half:])),
             "export": (make_mesh(fsdp=half, devices=devs[:half]),
                        make_mesh(devices=devs[half:]))}
    for path, (learner_mesh, engine_mesh) in cases.items():
      params = init_params(cfg, 0, learner_mesh)
      engine = Engine(cfg, max_concurrent_decodes=2, max_prefill_length=16, max_seq_len=64,
                      mesh=engine_mesh)
      times = []
      with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats + 1):
          t0 = time.perf_counter()
          if path == "export":
            where = export_policy(tmp, i + 1, params)  # bfloat16, as training exports
            out = engine.load_params(path=where, version=i + 1)
          else:
            out = engine.load_params(params, version=i + 1)
          jax.block_until_ready(out)
          if i:  # the first compiles / warms caches
            times.append(time.perf_counter() - t0)
      engine_devices = {d.id for x in jax.tree.leaves(out["weights"]) for d in x.devices()}
      learner_devices = {d.id for x in jax.tree.leaves(params) for d in x.devices()}
      rows.append({"bench": "weight_sync", "preset": name, "path": path,
                   "param_bytes_f32": nbytes, "sync_s": round(statistics.median(times), 4),
                   "gb_per_s": round(nbytes / statistics.median(times) / 1e9, 2),
                   "disjoint_devices": not engine_devices & learner_devices})
    base = next(r["sync_s"] for r in rows if r["preset"] == name and r["path"] == "export")
    for r in rows:
      if r["preset"] == name:
        r["export_over_this"] = round(base / r["sync_s"], 2)
  if args.json:
    for r in rows:
      print(json.dumps(r))
  print(f"{len(devs)} {devs[0].platform} devices; median of {args.repeats}")
  print(f"{'preset':>14} {'path':>10} {'MB f32':>8} {'sync s':>8} {'GB/s':>6} "
        f"{'export/this':>11} {'disjoint':>8}")
  for r in rows:
    print(f"{r['preset']:>14} {r['path']:>10} {r['param_bytes_f32'] / 1e6:>8.1f} "
          f"{r['sync_s']:>8.4f} {r['gb_per_s']:>6.2f} {r['export_over_this']:>11.2f} "
          f"{str(r['disjoint_devices']):>8}")


if __name__ == "__main__":
  main()

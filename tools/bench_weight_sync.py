"""Weight-sync time from the learner to the rollout engine, by path, in one run.

  python tools/bench_weight_sync.py [--presets tiny,smollm2-135m] [--devices 8] [--repeats 5]
      [--processes 2] [--json]

Paths (each the time until the engine's weights are placed and ready):
- `colocated`: learner and engine share all devices (time-shared); the engine's
  sampling shardings (no FSDP) are resharded from the learner's (FSDP) on device;
- `reshard`: the learner on the first half of the devices (FSDP over them), the
  engine on the other half (`mesh.devices` / `serving.devices`): a device-to-device
  reshard between two meshes, no host copy;
- `export`: what remote servers do: an Orbax policy export (bfloat16) and the
  engine's load of it from disk.
With `--processes N` the learner is N `jax.distributed` processes (the devices split
evenly, FSDP over all of them) and each process has its own in-process engine on its
own devices, as `python -m jaxagent.train` run as N processes:
- `multi_reshard`: `distributed.copy_to_local`, every process's engine gets the whole
  model device to device (collectives across processes);
- `multi_host`: the same through host numpy (`distributed.host_copy`, then placed).
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
  p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--presets", default="tiny,smollm2-135m")
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--processes", type=int, default=1)
  p.add_argument("--json", action="store_true")
  p.add_argument("--worker", help=argparse.SUPPRESS)  # COORDINATOR,PROCESS_ID (internal)
  args = p.parse_args()
  if "jax" in sys.modules:
    raise SystemExit("run as a script: the device count is set before JAX starts")
  if args.processes > 1 and not args.worker:
    return launch_workers(args)
  devices = args.devices // args.processes
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={devices}")
  if args.worker:
    return multi_process_worker(args)
  import jax

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
  print_rows(rows, args, f"{len(devs)} {devs[0].platform} devices")


def print_rows(rows, args, where: str, ratio: str = "export") -> None:
  """JSON lines (with --json), then a table whose ratio column is `ratio`'s sync time
  over each path's."""
  if args.json:
    for r in rows:
      print(json.dumps(r), flush=True)
  print(f"{where}; median of {args.repeats}")
  print(f"{'preset':>14} {'path':>13} {'MB f32':>8} {'sync s':>8} {'GB/s':>6} "
        f"{ratio + '/this':>11} {'disjoint':>8}")
  for r in rows:
    print(f"{r['preset']:>14} {r['path']:>13} {r['param_bytes_f32'] / 1e6:>8.1f} "
          f"{r['sync_s']:>8.4f} {r['gb_per_s']:>6.2f} {r[ratio + '_over_this']:>11.2f} "
          f"{str(r.get('disjoint_devices', '')):>8}")


def launch_workers(args) -> None:
  """Starts `--processes` copies of this script as one jax.distributed job and prints
  process 0's report."""
  import subprocess

  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from jaxagent.launch import free_port

  coordinator = f"127.0.0.1:{free_port()}"
  base = [sys.executable, os.path.abspath(__file__), "--presets", args.presets, "--devices",
          str(args.devices), "--repeats", str(args.repeats), "--processes",
          str(args.processes)] + (["--json"] if args.json else [])
  if args.devices % args.processes:
    raise SystemExit(f"--devices {args.devices} do not split over {args.processes} processes")
  with tempfile.TemporaryDirectory() as tmp:  # files, not pipes: no worker blocks on output
    logs = [open(os.path.join(tmp, f"{i}.log"), "w+") for i in range(args.processes)]
    procs = [subprocess.Popen(base + ["--worker", f"{coordinator},{i}"], stdout=log,
                              stderr=subprocess.STDOUT, text=True)
             for i, log in enumerate(logs)]
    codes = [proc.wait() for proc in procs]
    outs = []
    for log in logs:
      log.seek(0)
      outs.append(log.read())
      log.close()
  for i, (code, out) in enumerate(zip(codes, outs)):
    if code:
      raise SystemExit(f"process {i} failed:\n{out[-3000:]}")
  print(outs[0], end="")


def multi_process_worker(args) -> None:
  """One process of `--processes`: learner FSDP over every process's devices, this
  process's engine on its own devices; times both multi-process paths."""
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from jaxagent import distributed

  coordinator, process_id = args.worker.split(",")
  distributed.initialize(coordinator, args.processes, int(process_id))
  import jax

  from jaxagent.models.config import preset
  from jaxagent.models.params import init_params
  from jaxagent.models.sharding import make_mesh
  from rollout_server.engine import Engine

  rows = []
  for name in args.presets.split(","):
    cfg = preset(name)
    nbytes = 4 * cfg.num_params()
    params = init_params(cfg, 0, make_mesh(fsdp=jax.device_count(), devices=jax.devices()))
    engine = Engine(cfg, max_concurrent_decodes=2, max_prefill_length=16, max_seq_len=64,
                    mesh=make_mesh(devices=jax.local_devices()))
    paths = {"multi_reshard": lambda: distributed.copy_to_local(
                 params, engine.weight_shardings, engine.model_cfg.param_dtype),
             "multi_host": lambda: distributed.host_copy(params)}
    for path, take in paths.items():
      times = []
      for i in range(args.repeats + 1):
        t0 = time.perf_counter()
        out = engine.load_params(take(), version=i + 1)
        jax.block_until_ready(out)
        if i:
          times.append(time.perf_counter() - t0)
      rows.append({"bench": "weight_sync", "preset": name, "path": path,
                   "processes": args.processes, "param_bytes_f32": nbytes,
                   "sync_s": round(statistics.median(times), 4),
                   "gb_per_s": round(nbytes / statistics.median(times) / 1e9, 2)})
    base = rows[-1]["sync_s"]  # multi_host
    for r in rows[-2:]:
      r["host_over_this"] = round(base / r["sync_s"], 2)
  if distributed.is_primary():
    print_rows(rows, args, f"{args.processes} processes x {jax.local_device_count()} "
                           f"{jax.devices()[0].platform} devices", ratio="host")


if __name__ == "__main__":
  main()

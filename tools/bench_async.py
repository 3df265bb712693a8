"""Asynchrony on a heavy-tailed environment: valid trajectories trained per second in
sync, async and window modes, measured side by side in one run.

  python tools/bench_async.py [--config configs/tiny.yaml] [--steps 30] [--skip 3]
      [--median-s 0.05] [--sigma 1.5] [--max-s 2.0] [--staleness 1] [--modes sync,async,window]
      [--json] [override ...]

Every mode runs the same job (the default CPU job unless `--config`), with every
environment step sleeping a lognormal time (median `--median-s`, log-space spread
`--sigma`: 1.5 puts the 99th percentile at 33x the median; capped at `--max-s`),
for `--steps` learner steps in a fresh process (`python -m jaxagent.train`; early
stopping off). From its metrics.jsonl: `valid_trajectories_per_s` is the episodes
trained on (those the steps' batches held) from step `--skip` + 1 to the last, divided by
the wall time between the end of step `--skip` and the end of the last (the first
steps compile); `policy_lag_mean` the learner's version minus the oldest token's
version of the trained groups; success over the first and last thirds of the steps
(still rising?). Extra arguments are config overrides for every mode.

`--json`: one JSON object per mode, then `{"async_over_sync": ..., "window_over_sync": ...}`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np


def run_mode(args, mode: str, run_dir: str) -> dict:
  overrides = [
      f"steps={args.steps}", "stop_success_rate=0", f"rollout.mode={mode}",
      f"rollout.max_staleness={args.staleness}", "checkpoint.every_steps=0",
      "checkpoint.export_every=0", "env.latency.distribution=lognormal",
      f"env.latency.median_s={args.median_s}", f"env.latency.sigma={args.sigma}",
      f"env.latency.max_s={args.max_s}", *args.overrides]
  cmd = [sys.executable, "-m", "jaxagent.train", "--config", args.config, "--run-dir", run_dir,
         *overrides]
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, capture_output=True, text=True)
  wall = time.perf_counter() - t0
  if proc.returncode != 0:
    raise SystemExit(f"{mode}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  timed = rows[args.skip:]
  span = rows[-1]["wall_time_s"] - rows[args.skip - 1]["wall_time_s"]
  third = max(1, len(rows) // 3)
  success = lambda rs: float(np.average([r.get("success_rate", 0) for r in rs],
                                        weights=[r["episodes"] for r in rs]))
  return {
      "bench": "async", "mode": mode, "steps": len(rows), "timed_steps": len(timed),
      "valid_trajectories_per_s": round(sum(r["episodes_trained"] for r in timed) / span, 3),
      "episodes_played_per_s": round(sum(r["episodes"] for r in timed) / span, 3),
      "policy_lag_mean": round(float(np.mean([r.get("policy_lag_mean", 0) for r in timed])), 3),
      "policy_lag_max": max(r.get("policy_lag_max", 0) for r in timed),
      "groups_dropped_stale": rows[-1].get("dropped_stale", 0),
      "learner_s_mean": round(float(np.mean([r["learner_s"] for r in timed])), 4),
      "weight_sync_s_mean": round(float(np.mean([r["weight_sync_s"] for r in timed])), 4),
      "step_s_mean": round(span / len(timed), 4),
      "success_first_third": round(success(rows[:third]), 3),
      "success_last_third": round(success(rows[-third:]), 3),
      "process_wall_s": round(wall, 1),
  }


def main() -> None:
  from jaxagent.cli_args import names_of, positive_float, positive_int

  p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="configs/tiny.yaml")
  p.add_argument("--steps", type=positive_int, default=30)
  p.add_argument("--skip", type=int, default=3, help="first steps left out (compiles)")
  p.add_argument("--median-s", type=positive_float, default=0.05)
  p.add_argument("--sigma", type=float, default=1.5)
  p.add_argument("--max-s", type=positive_float, default=2.0)
  p.add_argument("--staleness", type=int, default=1)
  p.add_argument("--modes", default="sync,async,window",
                 type=names_of(("sync", "async", "window"), "rollout mode"))
  p.add_argument("--json", action="store_true")
  p.add_argument("overrides", nargs="*", help="config overrides for every mode (key=value)")
  from jaxagent.config import parse_with_overrides

  args = parse_with_overrides(p)
  # (with --json, stdout holds the JSON lines alone: the table goes to stderr)
  say = functools.partial(print, file=sys.stderr if args.json else sys.stdout)
  if not 1 <= args.skip < args.steps:
    p.error("--skip must be in [1, steps)")

  results = {}
  with tempfile.TemporaryDirectory(prefix="jaxagent-bench-async-") as tmp:
    for mode in args.modes:
      r = run_mode(args, mode, os.path.join(tmp, mode))
      results[mode] = r
      if args.json:
        print(json.dumps(r), flush=True)
  if "sync" in results:
    base = results["sync"]["valid_trajectories_per_s"]
    ratios = {f"{m}_over_sync": round(r["valid_trajectories_per_s"] / base, 3)
              for m, r in results.items() if m != "sync"}
    if args.json:
      print(json.dumps(ratios), flush=True)
  say(f"lognormal step latency: median {args.median_s}s, sigma {args.sigma}, cap "
        f"{args.max_s}s; {args.steps} steps ({args.skip} untimed); staleness "
        f"{args.staleness}")
  say(f"{'mode':>7} {'valid/s':>8} {'played/s':>9} {'lag':>5} {'stale':>6} {'step s':>7} "
        f"{'learner s':>9} {'sync s':>7} {'success 1st->last third':>24}")
  for m, r in results.items():
    say(f"{m:>7} {r['valid_trajectories_per_s']:>8.2f} {r['episodes_played_per_s']:>9.2f} "
          f"{r['policy_lag_mean']:>5.2f} {r['groups_dropped_stale']:>6} {r['step_s_mean']:>7.3f} "
          f"{r['learner_s_mean']:>9.3f} {r['weight_sync_s_mean']:>7.3f} "
          f"{r['success_first_third']:>11.3f} -> {r['success_last_third']:.3f}")
  if "sync" in results:
    say("  ".join(f"{k}: {v:.2f}x" for k, v in ratios.items()))


if __name__ == "__main__":
  main()

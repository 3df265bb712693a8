"""The token write-ahead log's cost per token, against the engine's decode time per token
measured in the same run.

  python tools/bench_wal.py [--json] [--turns 200] [--tokens-per-turn 32] [--dir /tmp]

Each turn of `--tokens-per-turn` sampled tokens is one `EpisodeLog.turn` commit (a JSON
line written, flushed and, with fsync, forced to the disk) plus one observation record,
as `run_whitebox` writes them; the baseline is the in-process engine's time per generated
token (the tiny shape with a 1024-token vocabulary, 0.92M parameters, 16 requests of 64
tokens, 128-token cache).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxagent.cli_args import positive_int  # noqa: E402


def wal_cost(directory: str, turns: int, tokens: int, fsync: bool) -> dict:
  from envs.base import Observation, StepResult
  from jaxagent.trajectory import TurnRecord
  from jaxagent.wal import TokenWAL

  wal = TokenWAL(directory, fsync=fsync)
  log = wal.open(f"bench-{fsync}", group_id="g", task={"id": "t"}, episode=0)
  prompt = list(range(300))
  step = StepResult(Observation([{"role": "user", "content": "Higher."}]), 0.0, False, False)
  t0 = time.perf_counter()
  for t in range(turns):
    rec = TurnRecord(prompt, list(range(tokens)), [-0.5] * tokens, [3] * tokens, "stop")
    log.turn(t, rec)
    log.observation(t, step)
  dt = time.perf_counter() - t0
  log.close()
  return {"bench": "wal", "fsync": fsync, "turns": turns, "tokens_per_turn": tokens,
          "us_per_turn": round(dt / turns * 1e6, 1),
          "us_per_token": round(dt / (turns * tokens) * 1e6, 2),
          "bytes_per_token": round(log.bytes / (turns * tokens), 1)}


def decode_us_per_token(repeats: int = 5) -> float:
  from jaxagent.config import EngineConfig, LearnerConfig
  from jaxagent.learner import Learner
  from jaxagent.models.config import preset
  from jaxagent.models.sharding import make_mesh
  from rollout_server.engine import SamplingParams
  from rollout_server.serving import make_engine, start_orchestrator

  cfg = preset("tiny", vocab_size=1024, n_layers=4, d_model=128, n_heads=4, n_kv_heads=2,
               head_dim=32, d_ff=384)
  mesh = make_mesh()
  params = Learner(cfg, LearnerConfig(), mesh).init_state(0).params
  e = EngineConfig(slots=16, max_seq_len=128, max_prefill_length=128)
  engine = make_engine(cfg, e, mesh)
  orch = start_orchestrator(engine, engine.load_params(params), e)
  times = []
  try:
    for r in range(repeats + 1):
      t0 = time.perf_counter()
      reqs = [orch.submit(list(range(1 + r, 33 + r)), SamplingParams(seed=i, max_new_tokens=64))
              for i in range(16)]
      for q in reqs:
        q.wait()
      times.append((time.perf_counter() - t0) / (16 * 64))
  finally:
    orch.stop()
  return statistics.median(times[1:]) * 1e6  # the first compiles


def main() -> None:
  p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--turns", type=positive_int, default=200)
  p.add_argument("--tokens-per-turn", type=positive_int, default=32)
  p.add_argument("--dir", default=None, help="where the logs go (default: a temp dir)")
  p.add_argument("--json", action="store_true")
  args = p.parse_args()
  decode = decode_us_per_token()
  rows = []
  with tempfile.TemporaryDirectory(dir=args.dir) as d:
    for fsync in (True, False):
      row = wal_cost(d, args.turns, args.tokens_per_turn, fsync)
      row["decode_us_per_token"] = round(decode, 1)
      row["wal_over_decode"] = round(row["us_per_token"] / decode, 4)
      rows.append(row)
      if args.json:
        print(json.dumps(row), flush=True)
  print(f"\n{'fsync':<6} {'us/turn':>9} {'us/token':>9} {'bytes/token':>12} "
        f"{'decode us/token':>16} {'wal/decode':>11}")
  for r in rows:
    print(f"{str(r['fsync']):<6} {r['us_per_turn']:>9} {r['us_per_token']:>9} "
          f"{r['bytes_per_token']:>12} {r['decode_us_per_token']:>16} {r['wal_over_decode']:>11}")


if __name__ == "__main__":
  main()

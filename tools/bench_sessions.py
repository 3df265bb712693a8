"""The memory a rollout server's session records hold, against keeping every turn whole
(what the store did before: each turn's record holds its whole prompt and messages),
measured in the same run.

  python tools/bench_sessions.py [--json] [--sessions 20] [--turns 30,60] [--new-tokens 300]

Each session plays `--turns` turns whose context grows by `--new-tokens` tool-result
tokens, 40 sampled tokens and two messages (1.3 kB) a turn, as a black-box agent's do.
The figures: the bytes the store counts against its bound (`session_max_bytes`) and the
Python heap it holds (tracemalloc), for `rollout_server.sessions.SessionStore` and for
a store of whole turns. One JSON line per case, then a table.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxagent.cli_args import positive_int, positive_ints  # noqa: E402


class WholeTurns:
  """The baseline: every turn kept as recorded, counted as its JSON."""

  def __init__(self):
    self.sessions: dict = collections.defaultdict(list)
    self.bytes = 0

  def record(self, session_id: str, turn: dict) -> None:
    self.sessions[session_id].append(turn)
    self.bytes += len(json.dumps(turn))


def turns_of(n: int, new_tokens: int, seed: int) -> list[dict]:
  import numpy as np

  rng = np.random.default_rng(seed)
  prompt, messages, out = [1, 2, 3], [{"role": "user", "content": "go"}], []
  for t in range(n):
    ids = [int(i) for i in rng.integers(0, 50_000, 40)]
    out.append(dict({
        "prompt_ids": prompt, "output_ids": ids, "versions": [t] * 40,
        "output_logprobs": [float(x) for x in -rng.random(40)],
        "raw_logprobs": [float(x) for x in -rng.random(40)], "messages": messages,
        "tools": [{"type": "function", "function": {"name": "run"}}],
        "finish_reason": "stop", "recorded_at": float(t)}))
    prompt = prompt + ids + [int(i) for i in rng.integers(0, 50_000, new_tokens)]
    messages = messages + [{"role": "assistant", "content": "x" * 100},
                           {"role": "tool", "content": "y" * 1200}]
  return out


def measure(store, sessions: list[list[str]]) -> dict:
  """Records each turn as a server gets it (parsed from its request's JSON)."""
  tracemalloc.start()
  for i, turns in enumerate(sessions):
    for turn in turns:
      store.record(f"s{i}", json.loads(turn))
  held = tracemalloc.get_traced_memory()[0]
  tracemalloc.stop()
  return {"counted_bytes": store.bytes, "heap_bytes": held}


def main(argv=None) -> int:
  from rollout_server.sessions import SessionStore

  p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--json", action="store_true", help="JSON lines only")
  p.add_argument("--sessions", type=positive_int, default=20)
  p.add_argument("--turns", default="30,60", type=positive_ints)
  p.add_argument("--new-tokens", type=positive_int, default=300)
  args = p.parse_args(argv)
  rows = []
  for n in args.turns:
    sessions = [[json.dumps(t) for t in turns_of(n, args.new_tokens, seed)]
                for seed in range(args.sessions)]
    context = len(json.loads(sessions[0][-1])["prompt_ids"]) + 40
    base = measure(WholeTurns(), sessions)
    ours = measure(SessionStore(max_sessions=10 * args.sessions), sessions)
    row = {"sessions": args.sessions, "turns": n, "context_tokens": context,
           "whole_heap_bytes": base["heap_bytes"], "whole_counted_bytes": base["counted_bytes"],
           "heap_bytes": ours["heap_bytes"], "counted_bytes": ours["counted_bytes"],
           "heap_over_whole": round(ours["heap_bytes"] / base["heap_bytes"], 4),
           "heap_over_counted": round(ours["heap_bytes"] / ours["counted_bytes"], 3)}
    rows.append(row)
    print(json.dumps(row), flush=True)
  if not args.json:
    print(f"\n{'turns':>5} {'context':>8} {'whole (MB)':>11} {'store (MB)':>11} "
          f"{'store/whole':>11} {'held/counted':>12}")
    for r in rows:
      print(f"{r['turns']:>5} {r['context_tokens']:>8} {r['whole_heap_bytes'] / 1e6:>11.1f} "
            f"{r['heap_bytes'] / 1e6:>11.1f} {r['heap_over_whole']:>11.3f} "
            f"{r['heap_over_counted']:>12.2f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

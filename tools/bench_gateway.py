"""A model served through the gateways: completion tokens/s by concurrency and API.

  python tools/bench_gateway.py [--checkpoint smollm2] [--concurrency 1,16] [--max-tokens 64]
                                [--apis chat,responses,messages]

Starts a rollout server in this process on a loopback port (the model of
`--checkpoint`, or `--preset` with random weights), then for each concurrency
level and each API sends that many calls at once with the official client (`openai`'s
chat completions or Responses API, `anthropic`'s messages; the token budget,
temperature 1, a seed per request, a prompt that asks for a long answer) and reports
completion tokens (as the server counts them; a reply may end early at the model's end
token) per second of wall time. The first round of each compiles the shapes and is not
timed; the baselines of the ratios are the first level (of the first API) and, at each
level, the first API, measured in the same run. One JSON line per level and API, then
a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxagent import config as config_lib  # noqa: E402
from jaxagent.cli_args import positive_int, positive_ints  # noqa: E402
from rollout_server.serving import ServerThread, build_app  # noqa: E402


PROMPT = "Write a long story about a robot who learns to paint. Describe every day of its life."


async def level(url: str, n: int, max_tokens: int, rounds: int, api: str = "chat") -> dict:
  if api == "messages":
    import anthropic

    client = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0,
                                      timeout=1800)
  else:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                timeout=1800)
  messages = [{"role": "user", "content": PROMPT}]

  async def one(i):
    t0 = time.perf_counter()
    if api == "chat":
      r = await client.chat.completions.create(model="policy", messages=messages,
                                               max_tokens=max_tokens, temperature=1.0, seed=i)
      tokens = r.usage.completion_tokens
    elif api == "responses":
      r = await client.responses.create(model="policy", input=PROMPT, temperature=1.0,
                                        max_output_tokens=max_tokens, extra_body={"seed": i})
      tokens = r.usage.output_tokens
    else:
      r = await client.messages.create(model="policy", messages=messages,
                                       max_tokens=max_tokens,
                                       extra_body={"temperature": 1.0, "seed": i})
      tokens = r.usage.output_tokens
    return tokens, time.perf_counter() - t0

  out = None
  for timed in [False] + [True] * rounds:
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - t0
    if timed:
      tokens = sum(t for t, _ in results)
      rate = tokens / wall
      if out is None or rate > out["tok_per_s"]:
        out = {"api": api, "concurrency": n, "completion_tokens": tokens,
               "wall_s": round(wall, 2),
               "tok_per_s": round(rate, 2)}
  await client.close()
  return out


def main() -> int:
  p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--checkpoint", default="smollm2")
  p.add_argument("--preset", default=None, help="a preset with random weights instead")
  p.add_argument("--concurrency", default="1,16", type=positive_ints)
  p.add_argument("--max-tokens", type=positive_int, default=64)
  p.add_argument("--rounds", type=positive_int, default=1,
                 help="timed rounds per level (best kept)")
  p.add_argument("--max-seq-len", type=positive_int, default=1024)
  p.add_argument("--apis", default="chat",
                 help="comma-separated, of chat (OpenAI chat completions), responses "
                      "(OpenAI's Responses API), messages (Anthropic's)")
  args = p.parse_args()
  levels = args.concurrency
  apis = [a for a in args.apis.split(",") if a]
  bad = [a for a in apis if a not in ("chat", "responses", "messages")]
  if not apis or bad:
    p.error(f"--apis: give chat, responses or messages, got {bad or 'none'}")
  overrides = [f"engine.slots={max(levels)}", f"engine.max_seq_len={args.max_seq_len}",
               "engine.max_prefill_length=512", "engine.prefix_cache_tokens=0"]
  overrides += ([f"model.preset={args.preset}"] if args.preset else
                [f"model.checkpoint={args.checkpoint}", "model.chat_template=chatml_tools"])
  cfg = config_lib.load(config_lib.ServerConfig, None, overrides)
  app, orch, _ = build_app(cfg)
  rows = []
  with ServerThread(app) as srv:
    for n in levels:
      for api in apis:  # (interleaved: each level's APIs measured side by side)
        row = asyncio.run(level(srv.url, n, args.max_tokens, args.rounds, api))
        row["model"] = args.preset or args.checkpoint
        rows.append(row)
        print(json.dumps(row), flush=True)
  orch.stop()
  first = {r["concurrency"]: r for r in rows if r["api"] == apis[0]}
  base = rows[0]
  for r in rows[1:]:
    if r["api"] == apis[0]:
      print(json.dumps({"ratio": f"{r['api']} concurrency {r['concurrency']} / "
                                 f"{base['concurrency']}",
                        "value": round(r["tok_per_s"] / base["tok_per_s"], 2)}))
    else:
      print(json.dumps({"ratio": f"{r['api']} / {apis[0]} at concurrency {r['concurrency']}",
                        "value": round(r["tok_per_s"] / first[r["concurrency"]]["tok_per_s"],
                                       2)}))
  print(f"\n{'api':>9} {'concurrency':>11} {'tokens':>7} {'wall s':>7} {'tok/s':>8}")
  for r in rows:
    print(f"{r['api']:>9} {r['concurrency']:>11} {r['completion_tokens']:>7} "
          f"{r['wall_s']:>7} {r['tok_per_s']:>8}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

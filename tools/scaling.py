"""The numbers that decide a pod layout, computed from the model presets.

  python tools/scaling.py [--models qwen2.5-7b,llama-3.1-70b] [--chip v5p]
      [--learner-chips 64] [--episode-tokens 8192,32768] [--json]
  python tools/scaling.py --check      # the formulas against what JAX reports (tiny, CPU)

Per model and episode length: the learner's memory per chip under the default
sharding rules (parameters, gradients and Adam's two moments in float32, sharded
over every learner chip by FSDP; activations with full remat: each layer's input
kept, one layer's working set recomputed, the log-prob chunk); KV-cache bytes per
token and the concurrent sequences a rollout chip holds beside its bfloat16
weights; the weight-sync bytes (bfloat16) and time at the chip's interconnect
bandwidth; and the rollout:learner chip ratio at which a GRPO step's rollouts take
as long as its update (a decode step is bound by reading weights + KV from HBM or
by its FLOPs at peak, prefill and the update by FLOPs at an assumed MFU). Chip figures are public peak specifications,
inputs rather than measurements: `CHIPS` below.

`--check` builds the tiny presets on this CPU and compares: the train state's bytes
(exactly), the engine KV pool's bytes per token (exactly), and the activation
estimate against XLA's temporary bytes for the compiled train step (XLA keeps
1.5-2.8x the formula's live set there; plans budget ACTIVATION_MARGIN times it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

from jaxagent.models.config import PRESETS, ModelConfig, preset

GIB = 2**30
# XLA keeps more than the formula's live set (the attention kernel's float32
# accumulators, gradient buffers, fusion temporaries): on the tiny presets its
# temporaries were 1.5-2.8x `activation_bytes` (`--check`), so plans budget 3x.
ACTIVATION_MARGIN = 3.0


@dataclasses.dataclass(frozen=True)
class Chip:
  hbm_gib: float  # memory per chip
  bf16_tflops: float  # peak dense bf16
  hbm_gbps: float  # HBM bandwidth, GB/s
  link_gbps: float  # chip-to-chip bandwidth for weight sync, GB/s (one direction)


# Public peak figures (vendor specifications), the inputs of every estimate below.
CHIPS = {
    "v5e": Chip(hbm_gib=16, bf16_tflops=197, hbm_gbps=819, link_gbps=200),
    "v5p": Chip(hbm_gib=95, bf16_tflops=459, hbm_gbps=2765, link_gbps=600),
    "v6e": Chip(hbm_gib=32, bf16_tflops=918, hbm_gbps=1640, link_gbps=400),
    "h100": Chip(hbm_gib=80, bf16_tflops=989, hbm_gbps=3350, link_gbps=450),
    "h200": Chip(hbm_gib=141, bf16_tflops=989, hbm_gbps=4800, link_gbps=450),
}


def train_state_bytes(cfg: ModelConfig) -> int:
  """Float32 parameters + Adam's two float32 moments (+ its step counters), as the
  learner's `TrainState` holds them."""
  return 3 * 4 * cfg.num_params()


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
  """Keys and values of one token in every layer."""
  return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype_bytes


def activation_bytes(cfg: ModelConfig, tokens: int, *, seq_len: int, logits_chunk: int = 256,
                     dtype_bytes: int = 2, attention_block: int = 512) -> int:
  """Activation memory of a train step on `tokens` tokens (one chip's share) with full
  remat: every layer's input kept for the backward pass, plus one layer's working set
  while it is recomputed and differentiated (norms, q/k/v, attention output, the MLP's
  gate/up/activation, float32 gradients of the same), plus the blockwise attention's
  float32 scores of one block pair and the log-prob chunk's float32 logits."""
  d, f = cfg.d_model, cfg.d_ff
  qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
  saved = cfg.n_layers * tokens * d * dtype_bytes
  layer = tokens * (4 * d + qkv + cfg.n_heads * cfg.head_dim + 3 * f) * (dtype_bytes + 4)
  rows = max(1, tokens // seq_len)
  block = min(attention_block, seq_len)
  scores = rows * cfg.n_heads * block * block * 4 * 2
  logits = rows * min(logits_chunk, seq_len) * cfg.vocab_size * 4 * 2
  return saved + layer + scores + logits


@dataclasses.dataclass
class Plan:
  model: str
  chip: str
  episode_tokens: int
  params_b: float
  learner_chips: int
  state_gib_per_chip: float
  activation_gib_per_chip: float
  learner_gib_per_chip: float
  fits: bool
  kv_kib_per_token: float
  weights_gib_bf16: float
  rollout_chips_per_replica: int
  sequences_per_rollout_chip: int
  sync_gb: float
  sync_s: float
  learner_step_s: float
  rollout_step_s_per_replica: float
  rollout_to_learner_chips: float


def plan(name: str, chip_name: str, learner_chips: int, episode_tokens: int,
         episodes: int = 512, tokens_per_chip: int = 0, mfu: float = 0.4,
         new_fraction: float = 0.5) -> Plan:
  """A GRPO step of `episodes` episodes of `episode_tokens` tokens (half of them
  generated, `new_fraction`), on `learner_chips` learner chips with FSDP over all;
  each chip's microbatch holds `tokens_per_chip` tokens (0: one episode)."""
  tokens_per_chip = tokens_per_chip or episode_tokens
  cfg = preset(name)
  chip = CHIPS[chip_name]
  n = cfg.num_params()
  state = train_state_bytes(cfg) / learner_chips
  act = ACTIVATION_MARGIN * activation_bytes(cfg, tokens_per_chip, seq_len=episode_tokens)
  learner_gib = (state + act) / GIB
  kv = kv_bytes_per_token(cfg)
  weights = 2 * n  # bfloat16 sampling copy
  # A rollout replica: the fewest chips (a power of two, tensor parallel) whose memory
  # holds the weights with at least half of it left for KV.
  rep = 1
  while weights / rep > 0.5 * chip.hbm_gib * GIB:
    rep *= 2
  kv_room = rep * chip.hbm_gib * GIB * 0.9 - weights  # 10% for the runtime
  seqs = int(kv_room // (kv * episode_tokens))
  # Decode: each step reads the weights and every live sequence's KV (average half the
  # episode) from HBM across the replica's chips; one token per live sequence a step.
  new_tokens = episode_tokens * new_fraction
  # A step is bound by HBM (reading) or, at large batches, by FLOPs at peak; prompts
  # are prefilled at the learner's MFU (no prefix cache hits counted).
  step_read = weights + seqs * kv * episode_tokens / 2
  decode_step_s = max(step_read / (rep * chip.hbm_gbps * 1e9),
                      2 * n * seqs / (rep * chip.bf16_tflops * 1e12))
  prefill_s = episodes * episode_tokens * (1 - new_fraction) * 2 * n / (
      rep * chip.bf16_tflops * 1e12 * mfu)
  rollout_s = math.ceil(episodes / max(seqs, 1)) * new_tokens * decode_step_s + prefill_s
  total_tokens = episodes * episode_tokens
  flops = cfg.train_flops(total_tokens, total_tokens * (episode_tokens + 1) / 2)
  learner_s = flops / (learner_chips * chip.bf16_tflops * 1e12 * mfu)
  # Rollout chips needed so that the rollouts of one step take as long as its update.
  ratio = rollout_s * rep / learner_s / learner_chips
  sync_gb = weights / 1e9
  return Plan(
      model=name, chip=chip_name, episode_tokens=episode_tokens, params_b=round(n / 1e9, 3),
      learner_chips=learner_chips, state_gib_per_chip=round(state / GIB, 2),
      activation_gib_per_chip=round(act / GIB, 2), learner_gib_per_chip=round(learner_gib, 2),
      fits=learner_gib < 0.9 * chip.hbm_gib, kv_kib_per_token=round(kv / 1024, 1),
      weights_gib_bf16=round(weights / GIB, 2), rollout_chips_per_replica=rep,
      sequences_per_rollout_chip=seqs // rep, sync_gb=round(sync_gb, 2),
      sync_s=round(weights / (chip.link_gbps * 1e9), 3),
      learner_step_s=round(learner_s, 1), rollout_step_s_per_replica=round(rollout_s, 1),
      rollout_to_learner_chips=round(ratio, 2))


def check_against_jax(presets=("nano", "tiny")) -> list[dict]:
  """The formulas against what JAX reports for the tiny presets on this CPU."""
  import jax

  from jaxagent.batch import pack
  from jaxagent.config import LearnerConfig
  from jaxagent.data import synthetic_segment
  from jaxagent.learner import Learner
  from jaxagent.models.sharding import make_mesh
  from rollout_server.engine import Engine

  out = []
  for name in presets:
    cfg = preset(name, remat="full", attention="flash", attention_block=128)
    learner = Learner(cfg, LearnerConfig(logits_chunk=128), make_mesh())
    state = learner.init_state(0)
    counted = train_state_bytes(cfg)
    actual = sum(x.nbytes for x in jax.tree.leaves((state.params, state.opt_state)))
    engine = Engine(cfg, max_concurrent_decodes=4, max_prefill_length=64, max_seq_len=256,
                    mesh=make_mesh(), page_size=16, dtype="bfloat16")
    pool = engine.init_decode_state().pages
    kv_actual = (pool.k.nbytes + pool.v.nbytes) / (pool.num_pages * pool.page_size)
    seq_len, rows = 1024, 4
    segs = [synthetic_segment(i, seed=0, vocab=256, target=97, min_len=seq_len // 4,
                              max_len=seq_len // 2) for i in range(rows * 4)]
    batch, _ = pack(segs, rows, seq_len)
    compiled = learner._step.lower(state, learner.shard_batch(batch)).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    est = activation_bytes(cfg, rows * seq_len, seq_len=seq_len, logits_chunk=128,
                           dtype_bytes=4, attention_block=128)
    out.append({"preset": name, "state_bytes_formula": counted,
                "state_bytes_jax": int(actual) - 8,  # less Adam's two int32 step counters
                "kv_bytes_per_token_formula": kv_bytes_per_token(cfg, 2),
                "kv_bytes_per_token_jax": kv_actual,
                "activation_bytes_formula": est, "xla_temp_bytes": int(temp),
                "activation_over_xla": round(est / temp, 2)})
  return out


def main() -> None:
  p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--models", default="qwen2.5-7b,llama-3.1-70b")
  p.add_argument("--chip", default="v5p", choices=sorted(CHIPS))
  p.add_argument("--learner-chips", default="32,256",
                 help="learner chips per model, in --models order")
  p.add_argument("--episode-tokens", default="8192,32768")
  p.add_argument("--episodes", type=int, default=512, help="episodes per GRPO step")
  p.add_argument("--mfu", type=float, default=0.4)
  p.add_argument("--tokens-per-chip", type=int, default=0,
                 help="tokens in a learner chip's microbatch (0: one episode)")
  p.add_argument("--check", action="store_true")
  p.add_argument("--json", action="store_true")
  args = p.parse_args()

  if args.check:
    for r in check_against_jax():
      print(json.dumps(r))
    return
  models = args.models.split(",")
  unknown = [m for m in models if m not in PRESETS]
  if unknown:
    p.error(f"--models: unknown {', '.join(unknown)}; known: {', '.join(sorted(PRESETS))}")
  try:
    chips = [int(c) for c in args.learner_chips.split(",")]
    tokens = [int(t) for t in args.episode_tokens.split(",")]
  except ValueError:
    p.error("--learner-chips and --episode-tokens: whole numbers separated by commas")
  if min(chips) < 1 or min(tokens) < 1 or args.episodes < 1 or args.tokens_per_chip < 0 \
      or not 0 < args.mfu <= 1:
    p.error("--learner-chips, --episode-tokens and --episodes must be >= 1, "
            "--tokens-per-chip >= 0, --mfu in (0, 1]")
  chips += [chips[-1]] * (len(models) - len(chips))
  plans = [plan(m, args.chip, c, t, episodes=args.episodes, mfu=args.mfu,
                tokens_per_chip=args.tokens_per_chip)
           for m, c in zip(models, chips) for t in tokens]
  if args.json:
    for pl in plans:
      print(json.dumps(dataclasses.asdict(pl)))
  print(f"chip {args.chip}: {CHIPS[args.chip]}; {args.episodes} episodes a step, half "
        f"of each generated; MFU {args.mfu}")
  print(f"{'model':>14} {'tokens':>6} {'chips L':>7} {'GiB/chip L':>10} {'fits':>5} "
        f"{'KV KiB/tok':>10} {'seqs/chip R':>11} {'sync GB':>8} {'sync s':>7} "
        f"{'learn s':>8} {'rollout:learner':>15}")
  for pl in plans:
    print(f"{pl.model:>14} {pl.episode_tokens:>6} {pl.learner_chips:>7} "
          f"{pl.learner_gib_per_chip:>10.1f} {str(pl.fits):>5} {pl.kv_kib_per_token:>10.1f} "
          f"{pl.sequences_per_rollout_chip:>11} {pl.sync_gb:>8.1f} {pl.sync_s:>7.2f} "
          f"{pl.learner_step_s:>8.1f} {pl.rollout_to_learner_chips:>15.2f}")


if __name__ == "__main__":
  main()

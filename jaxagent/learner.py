"""The learner: a pure, jitted, sharded `train_step(state, batch) -> (state, metrics)`.

The step runs the forward pass, the pure losses of `jaxagent.losses`, and an
optax update. Microbatches are accumulated exactly: each microbatch returns
the gradient of its unreduced loss *sum* and its denominator; the summed
gradient is divided by the summed denominator once, so the update equals the
full-batch update however the batch is split (and over however many devices).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import chex
import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxagent import losses
from jaxagent.batch import TrajectoryBatch
from jaxagent.config import LearnerConfig, unknown_value
from jaxagent.models.config import ModelConfig
from jaxagent.models.params import Params, abstract_model, bind, init_params
from jaxagent.models.sharding import (ActivationSharding, Rules, TRAIN_RULES, logical_to_spec,
                                      state_shardings)


class TrainState(struct.PyTreeNode):
  """Everything the step updates. `rng` is a raw uint32[2] key (checkpoints as plain data)."""

  step: jax.Array
  params: Params
  opt_state: Any
  rng: jax.Array
  policy_version: jax.Array


def _cosine(cfg: LearnerConfig) -> optax.Schedule:
  if cfg.lr_decay_steps < 1:
    raise ValueError("learner.lr_decay_steps must be >= 1 for the cosine schedule (the train "
                     "CLI sets it to the run's steps when it is 0)")
  # Updates are counted from 0: the last of lr_decay_steps x epochs updates is at the floor
  # (one past it, the run's last step stopped short of lr * lr_end_factor).
  updates = max(cfg.lr_decay_steps * cfg.epochs - 1 - cfg.warmup_steps, 1)
  return optax.cosine_decay_schedule(cfg.lr, updates, alpha=cfg.lr_end_factor)


# `learner.lr_schedule` names one of these (after the optional linear warm-up).
SCHEDULES = {"constant": lambda cfg: optax.constant_schedule(cfg.lr), "cosine": _cosine}


# `learner.optimizer` names one of these, given the schedule and the config.
OPTIMIZERS = {
    # (mu in float32 from the start: the float32 gradients made it so after the first
    # update of bfloat16 weights, so the state changed dtype, a checkpoint held what the
    # restore cast back down, and the step compiled twice: a reviewer)
    "adamw": lambda sched, cfg: optax.adamw(sched, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                                            weight_decay=cfg.weight_decay,
                                            mu_dtype=jnp.float32),
    # Plain gradient descent: an update proportional to the gradient (tests compare
    # runs to float rounding with it; Adam's first step is a sign step that is not).
    "sgd": lambda sched, cfg: optax.sgd(sched),
}


def make_optimizer(cfg: LearnerConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """The optimiser (AdamW by default) with linear warm-up, after global-norm clipping."""
  schedule = SCHEDULES[cfg.lr_schedule](cfg)
  if cfg.warmup_steps > 0:
    schedule = optax.join_schedules(
        [optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps), schedule], [cfg.warmup_steps])
  tx = optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm),
                   OPTIMIZERS[cfg.optimizer](schedule, cfg))
  return tx, schedule


# Each loss's own clip range, for `learner.clip_low` / `clip_high` left null: PPO's token
# ratios (DAPO's clip-higher) and GSPO's sequence ratios, which live much nearer 1.
CLIPS = {"ppo": (0.2, 0.28), "gspo": (3e-4, 4e-4)}


def clip_range(cfg: LearnerConfig) -> tuple[float, float]:
  """`(clip_low, clip_high)` the configured loss uses: the config's, else the loss's own
  (GSPO ran with PPO's 0.2 / 0.28, some 500 times its own range)."""
  low, high = CLIPS.get(cfg.policy_loss, (None, None))
  return (low if cfg.clip_low is None else cfg.clip_low,
          high if cfg.clip_high is None else cfg.clip_high)


def _ppo(cfg: LearnerConfig, logp, old_logp, adv, mask, segment_ids, reduce, is_w):
  low, high = clip_range(cfg)
  return losses.ppo_clip_loss(logp, old_logp, adv, mask, reduce=reduce, clip_low=low,
                              clip_high=high, dual_clip=cfg.dual_clip, is_weights_BxT=is_w)


def _gspo(cfg: LearnerConfig, logp, old_logp, adv, mask, segment_ids, reduce, is_w):
  low, high = clip_range(cfg)
  return losses.gspo_loss(logp, old_logp, adv, mask, segment_ids, reduce=reduce,
                          clip_low=low, clip_high=high, is_weights_BxT=is_w)


def _reinforce(cfg: LearnerConfig, logp, old_logp, adv, mask, segment_ids, reduce, is_w):
  return losses.reinforce_loss(logp, adv, mask, reduce=reduce, is_weights_BxT=is_w)


# `learner.policy_loss` names one of these; each closes the config over a loss of `losses`.
POLICY_LOSSES = {"ppo": _ppo, "gspo": _gspo, "reinforce": _reinforce}


def check_config(cfg: LearnerConfig) -> None:
  """Fails early, naming the config key, on settings the step cannot run with."""
  if cfg.policy_loss not in POLICY_LOSSES:
    raise ValueError(unknown_value("learner.policy_loss", cfg.policy_loss,
                                   sorted(POLICY_LOSSES)))
  if cfg.reduction not in losses.REDUCTIONS:
    raise ValueError(unknown_value("learner.reduction", cfg.reduction,
                                   sorted(losses.REDUCTIONS)))
  if cfg.kl_estimator not in losses.KL_ESTIMATORS:
    raise ValueError(unknown_value("learner.kl_estimator", cfg.kl_estimator,
                                   sorted(losses.KL_ESTIMATORS)))
  if cfg.correction_mode != "none" and cfg.correction_mode not in losses.CORRECTION_MODES:
    raise ValueError(unknown_value("learner.correction_mode", cfg.correction_mode,
                                   ["none", *sorted(losses.CORRECTION_MODES)]))
  if cfg.correction_level not in losses.CORRECTION_LEVELS:
    raise ValueError(unknown_value("learner.correction_level", cfg.correction_level,
                                   sorted(losses.CORRECTION_LEVELS)))
  if cfg.optimizer not in OPTIMIZERS:
    raise ValueError(unknown_value("learner.optimizer", cfg.optimizer, sorted(OPTIMIZERS)))
  if cfg.lr_schedule not in SCHEDULES:
    raise ValueError(unknown_value("learner.lr_schedule", cfg.lr_schedule, sorted(SCHEDULES)))
  if cfg.staleness not in losses.STALENESS_MODES:
    raise ValueError(unknown_value("learner.staleness", cfg.staleness,
                                   losses.STALENESS_MODES))
  if cfg.max_token_staleness < 0:
    raise ValueError(f"learner.max_token_staleness must be >= 0, got {cfg.max_token_staleness}")
  if not 0.0 < cfg.staleness_decay <= 1.0:
    raise ValueError(f"learner.staleness_decay must be in (0, 1], got {cfg.staleness_decay}")
  if cfg.epochs < 1:
    raise ValueError(f"learner.epochs must be >= 1, got {cfg.epochs}")
  if cfg.microbatches < 1:
    raise ValueError(f"learner.microbatches must be >= 1, got {cfg.microbatches}")
  # Values each loss takes as given: out of range, they trained without a word (a user's
  # round: dual_clip 0.5, a negative clip or KL coefficient, correction_low above high).
  for key, value in zip(("clip_low", "clip_high"), clip_range(cfg)):
    if value is not None and not (math.isfinite(value) and value >= 0):
      raise ValueError(f"learner.{key} must be >= 0 (null: the loss's own), got {value}")
  if not (math.isfinite(cfg.max_grad_norm) and cfg.max_grad_norm > 0):
    raise ValueError(f"learner.max_grad_norm must be > 0 (the global norm gradients are "
                     f"clipped to; 0 zeroed every update), got {cfg.max_grad_norm}")
  if cfg.kl_coef and cfg.kl_estimator == "k1":
    raise ValueError("learner.kl_estimator k1 with a kl_coef: as a loss its gradient is "
                     "zero in expectation (E_pi[grad log pi] = 0): it adds noise, not a "
                     "penalty; use k2 (the gradient of KL(pi || ref)) or k3 (GRPO's)")
  for key in ("kl_coef", "entropy_coef", "weight_decay", "warmup_steps", "lr_decay_steps",
              "norm_len", "logits_chunk", "logits_vocab_chunk"):
    value = getattr(cfg, key)
    if not (math.isfinite(value) and value >= 0):
      raise ValueError(f"learner.{key} must be >= 0, got {value}")
  if cfg.dual_clip is not None and not cfg.dual_clip > 1:
    raise ValueError(f"learner.dual_clip must be > 1 (a bound on the ratio of negative "
                     f"advantages; null: none), got {cfg.dual_clip}")
  if cfg.dual_clip is not None and cfg.policy_loss != "ppo":
    raise ValueError(f"learner.dual_clip is PPO's (learner.policy_loss {cfg.policy_loss!r} "
                     "has none: it was ignored)")
  if not 0 <= cfg.correction_low <= 1 <= cfg.correction_high:
    raise ValueError(f"learner.correction_low and correction_high must bracket 1 "
                     f"(0 <= low <= 1 <= high), got {cfg.correction_low}, "
                     f"{cfg.correction_high}")
  if not 0 <= cfg.lr_end_factor <= 1:
    raise ValueError(f"learner.lr_end_factor must be in [0, 1] (the decay's end, a "
                     f"fraction of lr), got {cfg.lr_end_factor}")
  if not (0 <= cfg.b1 < 1 and 0 <= cfg.b2 < 1 and cfg.eps > 0):
    raise ValueError(f"learner.b1 and b2 must be in [0, 1) and eps > 0, got {cfg.b1}, "
                     f"{cfg.b2}, {cfg.eps}")


def loss_notes(cfg: LearnerConfig) -> list[str]:
  """What a run is told of its loss settings that are allowed but easy to mistake."""
  notes = []
  if cfg.policy_loss == "gspo" and cfg.reduction != "seq_mean_token_mean":
    notes.append(f"learner.policy_loss gspo with reduction {cfg.reduction}: sequences weigh "
                 "by their length; GSPO's own gradient (a mean over sequences) is reduction "
                 "seq_mean_token_mean")
  return notes


def token_logps(model, batch: TrajectoryBatch, cfg: LearnerConfig
                ) -> tuple[jax.Array, jax.Array]:
  """Per-token log-probs and entropies `[B, T]` of the batch's tokens under `model`
  (chunked over positions, `cfg.logits_chunk`; never the whole logits unless 0)."""
  targets = losses.shifted_targets(batch.tokens)
  if cfg.logits_chunk <= 0:
    logits, _ = model(batch.tokens, batch.positions, batch.segment_ids)
    logp, entropy = losses.token_logp_and_entropy(logits, targets, cfg.temperature)
  else:
    hidden, _ = model.hidden_states(batch.tokens, batch.positions, batch.segment_ids)
    logp, entropy = losses.chunked_token_logp_and_entropy(
        hidden, model.head_matrix(), targets, cfg.temperature, chunk=cfg.logits_chunk,
        vocab_chunk=cfg.logits_vocab_chunk)
  return losses.align_to_tokens(logp), losses.align_to_tokens(entropy)


def microbatch_objective(model, batch: TrajectoryBatch, cfg: LearnerConfig,
                         policy_version: Optional[jax.Array] = None
                         ) -> tuple[jax.Array, tuple[jax.Array, dict]]:
  """Unreduced objective sum of one microbatch, its denominator and metric (sum, denom)
  pairs. `policy_version` is the version this update trains (for token staleness)."""
  logp, entropy = token_logps(model, batch, cfg)
  mask = batch.loss_mask
  # Tokens out of the loss get values that cannot reach it: an inf or nan there (a prompt
  # token's log-prob of -inf) met the losses' zero cotangent with a nan derivative (0 x
  # nan) and made every weight's gradient nan (a reviewer of red team 19).
  keep = mask > 0
  sure = jax.lax.stop_gradient(logp)
  advantages = jnp.where(keep, batch.advantages, 0.0)
  metrics: dict[str, tuple] = {}
  if cfg.staleness != "none" and batch.versions is not None and policy_version is not None:
    stale = losses.staleness_weighting(batch.versions, policy_version, mask,
                                       mode=cfg.staleness, max_staleness=cfg.max_token_staleness,
                                       decay=cfg.staleness_decay)
    advantages, mask = advantages * stale.scale, stale.mask
    metrics.update(stale.metrics)
  # On-policy single update: the learner's "old" policy is the current one.
  old_logp = sure if batch.old_logp is None else jnp.where(keep, batch.old_logp, sure)
  is_w = None
  if cfg.correction_mode != "none":
    corr = losses.rollout_correction(old_logp, batch.rollout_logp, mask, batch.segment_ids,
                                     mode=cfg.correction_mode, level=cfg.correction_level,
                                     low=cfg.correction_low, high=cfg.correction_high)
    is_w, mask = corr.weights, corr.mask
    metrics.update(corr.metrics)
  reduce = losses.make_reduce(
      cfg.reduction, segment_ids_BxT=batch.segment_ids,
      rollout_weight_BxT=batch.rollout_weight,
      norm_len=float(cfg.norm_len or batch.tokens.shape[1]), loss_mask_BxT=batch.loss_mask)
  pl = POLICY_LOSSES[cfg.policy_loss](cfg, logp, old_logp, advantages, mask,
                                       batch.segment_ids, reduce, is_w)
  metrics.update(pl.metrics)
  metrics["pg_loss"] = (pl.sum, pl.denom)
  total = pl.sum
  # The metrics are means over the trained tokens whatever the loss's reduction (Dr.
  # GRPO's sum / norm_len, per_rollout's dropped tokens made them other numbers).
  metrics["entropy"] = losses.token_mean(entropy, mask)
  if cfg.entropy_coef:
    total = total - cfg.entropy_coef * reduce(entropy, mask)[0]
  if batch.ref_logp is not None:
    kl = losses.kl_penalty(logp, jnp.where(keep, batch.ref_logp, sure), cfg.kl_estimator)
    metrics["kl_ref"] = losses.token_mean(kl, mask)
    if cfg.kl_coef:
      total = total + cfg.kl_coef * reduce(kl, mask)[0]
  return total, (pl.denom, metrics)


def _split_microbatches(batch: TrajectoryBatch, n: int, sharding: Optional[NamedSharding]):
  """[B, T] -> [n, B/n, T]; microbatch i takes rows i, i+n, ... so each spans every device."""

  def split(x):
    b = x.shape[0]
    x = x.reshape(b // n, n, *x.shape[1:]).swapaxes(0, 1)
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)

  return jax.tree.map(split, batch)


def accumulate_gradients(params: Params, batch: TrajectoryBatch, objective, microbatches: int,
                         micro_sharding: Optional[NamedSharding] = None):
  """Gradient of the full-batch objective sum(sums) / sum(denominators), by microbatches.

  `objective(params, batch) -> (sum, (denominator, metrics))`. Returns the
  summed gradient of the sums (not yet divided), the summed loss, the summed
  denominator and summed metric (sum, denominator) pairs. Gradients are summed in
  float32 whatever the parameters' dtype.
  """
  rows = batch.tokens.shape[0]
  if rows % microbatches:
    raise ValueError(f"batch rows ({rows}) must be divisible by learner.microbatches "
                     f"({microbatches})")
  value_and_grad = jax.value_and_grad(objective, has_aux=True)

  def grad_fn(params, mb):
    out, grads = value_and_grad(params, mb)
    return out, jax.tree.map(lambda g: g.astype(jnp.float32), grads)

  if microbatches == 1:
    (total, (denom, metrics)), grads = grad_fn(params, batch)
    return grads, total, denom, metrics
  mbs = _split_microbatches(batch, microbatches, micro_sharding)
  shapes = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], mbs))
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

  def body(acc, mb):
    return jax.tree.map(jnp.add, acc, grad_fn(params, mb)), None

  ((total, (denom, metrics)), grads), _ = jax.lax.scan(body, zeros, mbs)
  return grads, total, denom, metrics


def old_logps(params: Params, batch: TrajectoryBatch, *, graphdef, abstract_state,
              cfg: LearnerConfig, micro_sharding: Optional[NamedSharding] = None) -> jax.Array:
  """Log-probs `[B, T]` under `params` (no gradient), by the learner's microbatches."""
  model = bind(graphdef, abstract_state, jax.lax.stop_gradient(params))
  if cfg.microbatches == 1:
    return token_logps(model, batch, cfg)[0]
  mbs = _split_microbatches(batch, cfg.microbatches, micro_sharding)
  out = jax.lax.map(lambda mb: token_logps(model, mb, cfg)[0], mbs)
  return out.swapaxes(0, 1).reshape(batch.tokens.shape)  # undo the row interleaving


def _update(state: TrainState, batch: TrajectoryBatch, objective, tx, cfg: LearnerConfig,
            micro_sharding) -> tuple[TrainState, dict]:
  """One optimiser update on the full-batch objective; returns metrics as means."""
  grads, total, denom, metrics = accumulate_gradients(state.params, batch, objective,
                                                      cfg.microbatches, micro_sharding)
  # The objective is sum / denom; the denominator does not depend on the params.
  scale = jnp.where(denom > 0, 1.0 / jnp.maximum(denom, 1e-12), 0.0)
  grads = jax.tree.map(lambda g: g * scale, grads)
  grad_norm = optax.tree.norm(grads)

  def apply(_):
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    return optax.apply_updates(state.params, updates), opt_state

  # A batch with no token to train on (every one dropped as stale or by the correction's
  # mask) leaves the weights and the optimiser as they were: Adam's momentum and the
  # weight decay moved the weights, and its step count went on. Judged by the tokens
  # kept (the entropy's denominator), not the loss's: per_rollout counts its rollouts on
  # the batch's own mask, > 0 with every token dropped (a reviewer).
  trained = metrics["entropy"][1]
  params, opt_state = jax.lax.cond((denom > 0) & (trained > 0), apply,
                                   lambda _: (state.params, state.opt_state), None)
  out = {k: jnp.where(d > 0, s / jnp.maximum(d, 1e-12), 0.0) for k, (s, d) in metrics.items()}
  out.update(loss=total * scale, grad_norm=grad_norm, denom=denom)
  return state.replace(params=params, opt_state=opt_state), out


def train_step(state: TrainState, batch: TrajectoryBatch, ref_params: Optional[Params] = None,
               *, graphdef, abstract_state, tx: optax.GradientTransformation,
               schedule: optax.Schedule, cfg: LearnerConfig,
               micro_sharding: Optional[NamedSharding] = None) -> tuple[TrainState, dict]:
  """`cfg.epochs` optimiser updates on `batch` (one new policy version), each accumulating
  `cfg.microbatches` exactly. With several epochs the ratios of later updates are taken
  against the policy before the first (PPO); the metrics are the last update's, with the
  first update's loss as `loss_first`. `ref_params`: a frozen reference whose log-probs
  of the batch (computed here, unless the batch brings `ref_logp`) the KL penalty uses."""
  chex.assert_rank(batch.tokens, 2)
  if ref_params is not None and batch.ref_logp is None:
    batch = batch._replace(ref_logp=old_logps(
        ref_params, batch, graphdef=graphdef, abstract_state=abstract_state, cfg=cfg,
        micro_sharding=micro_sharding))

  version = state.policy_version  # the version these updates train (token staleness)

  def objective(params, mb):
    return microbatch_objective(bind(graphdef, abstract_state, params), mb, cfg, version)

  if cfg.epochs > 1 and batch.old_logp is None:
    batch = batch._replace(old_logp=old_logps(
        state.params, batch, graphdef=graphdef, abstract_state=abstract_state, cfg=cfg,
        micro_sharding=micro_sharding))
  # The rate of this step's first update: the schedule's own count of the updates made
  # (the step's count logged the rate of updates long past with epochs > 1, and one an
  # update skipped for an empty batch never made).
  (made,) = [count for path, count in optax.tree_utils.tree_get_all_with_path(
      state.opt_state, "count") if path[-1].tuple_name == "ScaleByScheduleState"]
  lr = schedule(made)
  first = None
  for _ in range(cfg.epochs):  # unrolled: epochs is a small static number
    state, out = _update(state, batch, objective, tx, cfg, micro_sharding)
    first = out["loss"] if first is None else first
  rng, _ = jax.random.split(state.rng)
  out.update(lr=lr, tokens=jnp.sum(batch.loss_mask))
  if cfg.epochs > 1:
    out["loss_first"] = first
  new_state = state.replace(step=state.step + 1, rng=rng,
                            policy_version=state.policy_version + 1)
  return new_state, out


class Learner:
  """Owns the model definition, optimiser and the jitted, sharded train step."""

  def __init__(self, model_cfg: ModelConfig, cfg: LearnerConfig, mesh: Mesh,
               rules: Rules = TRAIN_RULES):
    check_config(cfg)
    self.model_cfg, self.cfg, self.mesh, self.rules = model_cfg, cfg, mesh, rules
    self.graphdef, self.abstract_params = abstract_model(
        model_cfg, ActivationSharding(mesh, rules))
    self.tx, self.schedule = make_optimizer(cfg)
    self.param_shardings = state_shardings(self.abstract_params, rules, mesh)
    replicated = NamedSharding(mesh, P())
    abstract_opt = jax.eval_shape(self.tx.init, self._abstract_param_values())
    opt_shardings = optax.tree_map_params(
        self.tx, lambda _, s: s, abstract_opt, self.param_shardings,
        transform_non_params=lambda _: replicated)
    self.state_shardings = TrainState(step=replicated, params=self.param_shardings,
                                      opt_state=opt_shardings, rng=replicated,
                                      policy_version=replicated)
    batch_axes = logical_to_spec(("batch",), rules, mesh)[0]
    self.batch_sharding = NamedSharding(mesh, P(batch_axes, None))
    axes = () if batch_axes is None else (batch_axes if isinstance(batch_axes, tuple)
                                          else (batch_axes,))
    # Batch rows must split evenly over the batch shards and then the microbatches.
    self.row_multiple = cfg.microbatches * math.prod(mesh.shape[a] for a in axes)
    micro = NamedSharding(mesh, P(None, batch_axes, None))
    step = functools.partial(train_step, graphdef=self.graphdef,
                             abstract_state=self.abstract_params, tx=self.tx,
                             schedule=self.schedule, cfg=cfg, micro_sharding=micro)
    self._step = jax.jit(step, in_shardings=(self.state_shardings, self.batch_sharding),
                         out_shardings=(self.state_shardings, replicated), donate_argnums=0)
    self._step_ref = jax.jit(
        step, in_shardings=(self.state_shardings, self.batch_sharding, self.param_shardings),
        out_shardings=(self.state_shardings, replicated), donate_argnums=0)

  def _abstract_param_values(self):
    from flax import nnx
    return nnx.to_pure_dict(self.abstract_params)

  def init_state(self, seed: int, params: Optional[Params] = None) -> TrainState:
    """A fresh state: random parameters (or `params`, resharded), zeroed optimiser."""
    if params is None:
      params = init_params(self.model_cfg, seed, self.mesh, self.rules)
    else:
      params = jax.device_put(params, self.param_shardings)
    opt_state = jax.jit(self.tx.init, out_shardings=self.state_shardings.opt_state)(params)
    rep = self.state_shardings.step
    return TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), rep), params=params,
                      opt_state=opt_state,
                      rng=jax.device_put(jax.random.PRNGKey(seed), rep),
                      policy_version=jax.device_put(jnp.zeros((), jnp.int32), rep))

  def abstract_state(self) -> TrainState:
    """Shapes, dtypes and shardings of the state (the target of a checkpoint restore)."""
    shapes = jax.eval_shape(lambda: self.init_state_shapes())
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, self.state_shardings)

  def init_state_shapes(self) -> TrainState:
    params = self._abstract_param_values()
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=self.tx.init(params), rng=jax.random.PRNGKey(0),
                      policy_version=jnp.zeros((), jnp.int32))

  def shard_batch(self, batch: TrajectoryBatch) -> TrajectoryBatch:
    """A host batch onto the mesh. With several processes, `batch` is this process's
    rows (`distributed.process_rows` of the global batch) and the global batch is
    assembled from every process's part."""
    if jax.process_count() == 1:
      return jax.device_put(batch, self.batch_sharding)
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(self.batch_sharding, x), batch)

  def step(self, state: TrainState, batch: TrajectoryBatch,
           ref_params: Optional[Params] = None) -> tuple[TrainState, dict]:
    """Runs the jitted step. `state` is donated: do not use it afterwards. `ref_params`
    (params placed like the state's, e.g. a copy of the initial ones): the frozen
    reference the learner scores the batch with for the KL penalty."""
    if ref_params is None:
      return self._step(state, self.shard_batch(batch))
    return self._step_ref(state, self.shard_batch(batch), ref_params)

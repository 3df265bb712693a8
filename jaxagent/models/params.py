"""Building a model's parameters: sharded initialisation and placement of loaded weights.

Parameters travel as a pure dict of arrays (`nnx.to_pure_dict`), which optax,
Orbax and `jit` shardings all take as they are; `bind` turns them back into a
`Decoder` inside a traced function.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxagent.models.config import ModelConfig
from jaxagent.models.llama import Decoder
from jaxagent.models.sharding import ActivationSharding, Rules, TRAIN_RULES, state_shardings

Params = dict


def abstract_model(cfg: ModelConfig, act_sharding: Optional[ActivationSharding] = None
                   ) -> tuple[nnx.GraphDef, nnx.State]:
  """Graph definition and abstract (shape-only) state of a decoder; allocates nothing."""
  model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0), act_sharding=act_sharding))
  return nnx.split(model)


def param_shardings(cfg: ModelConfig, mesh: Mesh, rules: Rules = TRAIN_RULES) -> Params:
  _, state = abstract_model(cfg)
  return state_shardings(state, rules, mesh)


def init_params(cfg: ModelConfig, seed: int, mesh: Optional[Mesh] = None,
                rules: Rules = TRAIN_RULES) -> Params:
  """Random parameters, created already sharded (`jit` with `out_shardings`)."""

  def init():
    return nnx.to_pure_dict(nnx.state(Decoder(cfg, rngs=nnx.Rngs(seed))))

  shardings = None if mesh is None else param_shardings(cfg, mesh, rules)
  return jax.jit(init, out_shardings=shardings)()


def place_params(cfg: ModelConfig, arrays: Mapping[str, Any], mesh: Optional[Mesh] = None,
                 rules: Rules = TRAIN_RULES) -> Params:
  """Checks host arrays against the model's shapes and puts them on devices, sharded.

  A value may be a thunk returning the array: it is built, cast to the parameter dtype,
  placed and dropped before the next one, so a checkpoint never sits on the host whole.
  """
  _, state = abstract_model(cfg)
  expected = nnx.to_pure_dict(state)
  missing = sorted(set(expected) - set(arrays))
  extra = sorted(set(arrays) - set(expected))
  if missing or extra:
    raise ValueError(f"parameter names do not match the model: missing {missing}, "
                     f"unexpected {extra}")
  shardings = param_shardings(cfg, mesh, rules) if mesh is not None else None
  out = {}
  for name, abstract in expected.items():
    value = arrays[name]
    arr = np.asarray(value() if callable(value) else value)
    if arr.shape != abstract.shape:
      raise ValueError(f"{name}: shape {arr.shape} does not match the model's {abstract.shape}")
    arr = arr.astype(abstract.dtype)
    out[name] = jax.device_put(arr, shardings[name]) if shardings else jnp.asarray(arr)
  return out


def bind(graphdef: nnx.GraphDef, abstract_state: nnx.State, params: Params) -> Decoder:
  """A `Decoder` whose variables are `params` (usable inside `jit`)."""
  state = jax.tree.map(lambda x: x, abstract_state)  # a fresh copy to fill in
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(graphdef, state)


def cast_params(params: Params, dtype) -> Params:
  """Casts floating-point parameters (for example to bfloat16 for a policy export)."""
  dtype = jnp.dtype(dtype)
  return jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())

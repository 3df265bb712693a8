"""Logical axis names and the rules that map them onto a device mesh.

Every parameter carries `logical_axes` metadata (for example
`("layers", "embed", "q_heads", "head_dim")`). A rule set maps each logical
name to a mesh axis (or a tuple of them, or None for replicated). Training
shards weights over `fsdp` and `tensor`; the sampling copy keeps no FSDP so a
decode step needs no all-gather of the weights (as in MaxText and Tunix).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence, Union

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

MeshAxes = Union[None, str, tuple[str, ...]]
Rules = tuple[tuple[str, MeshAxes], ...]

TRAIN_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("layers", None),
    ("norm", None),
    # activations
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)

# The sampling copy: tensor parallel only; batch (decode slots) over data.
SAMPLE_RULES: Rules = tuple(
    (name, None if name == "embed" else ("data",) if name == "batch" else axes)
    for name, axes in TRAIN_RULES)


def select_devices(spec: str, devices: Optional[Sequence[jax.Device]] = None
                   ) -> list[jax.Device]:
  """Devices named by `spec`, a list of indices and inclusive ranges as for CPU sets
  ("0-3", "4-7", "0,2,4-5"); "" is all of `devices` (default: this process's).
  Raises ValueError naming the spec when it is malformed or indexes past the devices."""
  devices = list(jax.local_devices() if devices is None else devices)
  spec = str(spec).strip()
  if not spec:
    return devices
  chosen = []
  try:
    for part in spec.split(","):
      lo, _, hi = part.strip().partition("-")
      for i in range(int(lo), int(hi or lo) + 1):
        if i >= len(devices) or i < 0:
          raise IndexError
        chosen.append(devices[i])
  except (ValueError, IndexError):
    raise ValueError(f"devices {spec!r}: expected indices and ranges like '0-3' or "
                     f"'0,2,4-5' within {len(devices)} devices") from None
  if len({id(d) for d in chosen}) != len(chosen):
    raise ValueError(f"devices {spec!r} names a device twice")
  return chosen


def mesh_data(data: int, fsdp: int, tensor: int, n_devices: int) -> int:
  """The size of the `data` axis of a mesh of `n_devices` devices (`data=-1`: the devices
  fsdp x tensor leave); ValueError where they cannot make the mesh."""
  if data == -1:
    if n_devices % (fsdp * tensor):
      raise ValueError(f"{n_devices} devices do not divide into fsdp={fsdp} x tensor={tensor}")
    data = n_devices // (fsdp * tensor)
  n = data * fsdp * tensor
  if n > n_devices:
    raise ValueError(f"mesh data={data} fsdp={fsdp} tensor={tensor} needs {n} devices, "
                     f"have {n_devices}")
  return data


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1,
              devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """A mesh with axes (data, fsdp, tensor); `data=-1` takes the remaining devices."""
  devices = list(jax.devices() if devices is None else devices)
  data = mesh_data(data, fsdp, tensor, len(devices))
  n = data * fsdp * tensor
  grid = np.asarray(devices[:n], dtype=object).reshape(data, fsdp, tensor)
  return Mesh(grid, MESH_AXES)


def logical_to_spec(logical_axes: Sequence[Optional[str]], rules: Rules,
                    mesh: Optional[Mesh] = None,
                    shape: Optional[Sequence[int]] = None) -> P:
  """Maps logical axis names to a PartitionSpec.

  A mesh axis is used at most once per spec (first dimension wins). With
  `mesh` and `shape` given, mesh axes that do not divide a dimension are
  dropped for it, so odd head counts (SmolLM2's 9 heads) fall back to
  replication instead of failing.
  """
  table = dict(rules)
  used: set[str] = set()
  out = []
  for i, name in enumerate(logical_axes):
    axes = table.get(name) if name is not None else None
    if axes is None:
      out.append(None)
      continue
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    kept = []
    size = 1
    for ax in axes:
      if ax in used:
        continue
      ax_size = mesh.shape[ax] if mesh is not None else 1
      if shape is not None and mesh is not None and shape[i] % (size * ax_size):
        continue
      kept.append(ax)
      size *= ax_size
    used.update(kept)
    out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return P(*out)


def state_specs(state: nnx.State, rules: Rules, mesh: Optional[Mesh] = None) -> dict:
  """PartitionSpecs for every variable of an NNX state, as a pure (nested) dict.

  Specs come from each variable's `logical_axes` metadata; a variable without
  it is replicated.
  """
  out: dict = {}
  for path, var in nnx.to_flat_state(state):
    axes = var.get_metadata().get("logical_axes")
    shape = getattr(var.get_value(), "shape", ())
    if axes is None:
      spec = P()
    elif len(axes) != len(shape):
      raise ValueError(f"{'/'.join(map(str, path))}: logical_axes {axes} do not match "
                       f"shape {shape}")
    else:
      spec = logical_to_spec(axes, rules, mesh, shape)
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = spec
  return out


def state_shardings(state: nnx.State, rules: Rules, mesh: Mesh) -> dict:
  """NamedShardings for every variable of an NNX state, as a pure dict."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs(state, rules, mesh),
                      is_leaf=lambda x: isinstance(x, P))


@dataclasses.dataclass(frozen=True)
class ActivationSharding:
  """Static (hashable) sharding context for activation constraints inside the model."""

  mesh: Mesh
  rules: Rules

  def constrain(self, x: jax.Array, logical_axes: Sequence[Optional[str]]) -> jax.Array:
    spec = logical_to_spec(logical_axes, self.rules, self.mesh, x.shape)
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))


def num_bytes(tree: Any) -> int:
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))

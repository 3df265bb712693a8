"""Orbax checkpoints of the whole run state, and immutable policy exports.

Run checkpoints (`RunCheckpointer`): one Orbax `CheckpointManager` step holds
- `state`: the `TrainState` pytree (parameters, optimiser state, step, PRNG
  key, policy version), sharded as it lives on the mesh;
- `data_iter`: the grain iterator's position (grain's own Orbax handler);
- `meta`: JSON with the run config, model config, tokenizer / chat-template
  identities and anything else the caller adds (buffer cursors, ...).
Saves are asynchronous; the last `keep` steps are kept.

Policy exports (`export_policy`, `load_policy`): parameters only (optionally
cast to bfloat16), one immutable directory per policy version under a root,
with a `versions.json` registry. Readers restore onto any mesh: they pass the
shapes and shardings they want and Orbax reshards on read.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from jaxagent.models.params import Params, cast_params

REGISTRY = "versions.json"


class RunCheckpointer:
  """Saves and restores the run state, data-iterator position and metadata together."""

  def __init__(self, directory: str, keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                             enable_async_checkpointing=async_save))

  def save(self, step: int, state: Any, meta: dict, data_iter: Any = None,
           force: bool = False) -> bool:
    """Starts saving `state` (asynchronously); returns whether a save was started."""
    import grain

    items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
    if data_iter is not None:
      items["data_iter"] = grain.checkpoint.CheckpointSave(data_iter)
    return self.manager.save(step, args=ocp.args.Composite(**items), force=force)

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def restore(self, abstract_state: Any, data_iter: Any = None, step: Optional[int] = None
              ) -> tuple[Any, dict]:
    """Restores onto `abstract_state`'s shapes and shardings; `data_iter` is set in place."""
    import grain

    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    items = {"state": ocp.args.StandardRestore(abstract_state), "meta": ocp.args.JsonRestore()}
    if data_iter is not None:
      items["data_iter"] = grain.checkpoint.CheckpointRestore(data_iter)
    out = self.manager.restore(step, args=ocp.args.Composite(**items))
    return out["state"], out["meta"]

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


# -- policy exports -------------------------------------------------------------------


def version_dir(root: str, version: int) -> str:
  return os.path.join(os.path.abspath(root), f"v{int(version):08d}")


def list_versions(root: str) -> list[dict]:
  """The registry's entries (version, path, dtype, time), oldest first."""
  path = os.path.join(root, REGISTRY)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return json.load(f)["versions"]


def latest_version(root: str) -> Optional[int]:
  versions = list_versions(root)
  return versions[-1]["version"] if versions else None


def export_policy(root: str, version: int, params: Params, dtype: Optional[str] = "bfloat16",
                  extra: Optional[dict] = None) -> str:
  """Writes `params` as policy `version` under `root` and registers it.

  A version directory is written once: exporting an existing version fails.
  Returns the directory.
  """
  from jaxagent import distributed

  os.makedirs(root, exist_ok=True)
  path = version_dir(root, version)
  exists = os.path.exists(path)
  # Every process of a multi-process run writes its shards; all look before any writes.
  distributed.barrier(f"export-policy-{version}")
  if exists:
    raise FileExistsError(f"policy version {version} already exported at {path}")
  if dtype is not None:
    params = cast_params(params, dtype)
  t0 = time.time()
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, params)
    ckptr.wait_until_finished()
  if not distributed.is_primary():  # process 0 alone keeps the registry
    return path
  entry = {"version": int(version), "path": path, "dtype": dtype or "as-trained",
           "time": time.time(), "save_s": round(time.time() - t0, 4), **(extra or {})}
  versions = [v for v in list_versions(root) if v["version"] != int(version)] + [entry]
  tmp = os.path.join(root, REGISTRY + ".tmp")
  with open(tmp, "w") as f:
    json.dump({"versions": sorted(versions, key=lambda v: v["version"])}, f, indent=1)
  os.replace(tmp, os.path.join(root, REGISTRY))  # atomic: readers never see half a registry
  return path


def load_policy(path: str, abstract_params: Any) -> Params:
  """Restores an exported policy onto `abstract_params`.

  `abstract_params`: a pytree of `jax.ShapeDtypeStruct` with the shardings (and
  dtypes) the reader wants, which need not match the writer's mesh.
  """
  if not os.path.isdir(path):
    raise FileNotFoundError(f"no exported policy at {path}")
  with ocp.StandardCheckpointer() as ckptr:
    return ckptr.restore(path, abstract_params)


def abstract_params_like(params_or_shapes: Any, shardings: Any, dtype=None) -> Any:
  """ShapeDtypeStructs of `params_or_shapes` with `shardings` (and optionally `dtype`)."""
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=s),
      params_or_shapes, shardings)

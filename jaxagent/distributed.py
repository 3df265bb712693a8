"""Multi-controller JAX: joining a run of several processes, and the few things that
differ when one process is not the whole run.

Under multi-controller JAX every process runs this same program over a global mesh;
each feeds the rows of the batch that its own devices hold, and only process 0
writes files other readers share (metrics, TensorBoard, trajectories, the policy
registry). Orbax checkpoints are written and read by every process together.

How a process learns it is one of several, first match wins:
1. explicit arguments (`--coordinator HOST:PORT --num-processes N --process-id I`);
2. the environment variables `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
   `JAX_PROCESS_ID` (what `jaxagent.launch local` and the GKE manifests set);
3. a TPU pod slice or a cluster JAX detects itself (`TPU_WORKER_HOSTNAMES` with
   more than one host, Slurm, Open MPI): `jax.distributed.initialize()` with no
   arguments.
Otherwise the process is alone and nothing is initialised.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


def _auto_detectable() -> bool:
  hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  return (len([h for h in hosts.split(",") if h]) > 1 or "SLURM_JOB_ID" in os.environ
          or "OMPI_COMM_WORLD_SIZE" in os.environ)


def initialize(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None) -> bool:
  """Joins the run's processes if this is one of several; returns whether it did.

  Must run before anything touches a JAX device. Raises `ValueError` naming what
  is missing when only some of the three settings are given.
  """
  import jax

  coordinator = coordinator or os.environ.get(ENV_COORDINATOR) or None
  if num_processes is None and os.environ.get(ENV_NUM_PROCESSES):
    num_processes = int(os.environ[ENV_NUM_PROCESSES])
  if process_id is None and os.environ.get(ENV_PROCESS_ID):
    process_id = int(os.environ[ENV_PROCESS_ID])
  given = {"coordinator": coordinator, "num_processes": num_processes,
           "process_id": process_id}
  if any(v is not None for v in given.values()):
    missing = [k for k, v in given.items() if v is None]
    if missing:
      raise ValueError(f"a multi-process run needs coordinator, num_processes and "
                       f"process_id; missing: {', '.join(missing)} (flags --coordinator, "
                       f"--num-processes, --process-id or ${ENV_COORDINATOR}, "
                       f"${ENV_NUM_PROCESSES}, ${ENV_PROCESS_ID})")
    if not 0 <= process_id < num_processes:
      raise ValueError(f"process_id {process_id} is not in [0, {num_processes})")
    if num_processes == 1:
      return False
    jax.distributed.initialize(coordinator, num_processes, process_id)
    return True
  if _auto_detectable():
    jax.distributed.initialize()
    return True
  return False


def is_primary() -> bool:
  """Whether this process writes the run's shared files (process 0)."""
  import jax

  return jax.process_index() == 0


def agree_max(value: int) -> int:
  """The largest of every process's `value` (all processes must call it)."""
  import jax
  from jax.experimental import multihost_utils

  if jax.process_count() == 1:
    return int(value)
  return int(np.max(multihost_utils.process_allgather(np.asarray(value, np.int64))))


def host_copy(tree: Any) -> Any:
  """The whole value of every array in `tree` as host numpy arrays, on every process
  (arrays sharded over other processes' devices are gathered)."""
  import jax
  from jax.experimental import multihost_utils

  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))

  return jax.tree.map(one, tree)


def process_rows(rows: int) -> slice:
  """The rows of a global batch of `rows` that this process feeds (its devices hold
  them contiguously under a batch-sharded mesh in device order)."""
  import jax

  n, i = jax.process_count(), jax.process_index()
  if rows % n:
    raise ValueError(f"batch rows ({rows}) must be divisible by the number of processes "
                     f"({n})")
  per = rows // n
  return slice(i * per, (i + 1) * per)


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier `name` (no-op when alone)."""
  import jax
  from jax.experimental import multihost_utils

  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def gather_json(value: Any) -> list:
  """Every process's `value` (JSON-serialisable), in process order (all must call it;
  alone: `[value]`)."""
  import json

  import jax
  from jax.experimental import multihost_utils

  if jax.process_count() == 1:
    return [value]
  data = np.frombuffer(json.dumps(value).encode(), np.uint8)
  size = agree_max(len(data))
  padded = np.zeros(size, np.uint8)
  padded[:len(data)] = data
  rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(-1, size)
  return [json.loads(bytes(r).rstrip(b"\0").decode()) for r in rows]


def sum_episode_counts(row: dict) -> dict:
  """A step's episode counts and rates over every process (all must call it): the
  metrics process 0 writes and the early-stopping rule then see the whole run."""
  from jax.experimental import multihost_utils

  n = float(row.get("episodes", 0))
  local = np.asarray([n, row.get("success_rate", 0.0) * n, row.get("reward_mean", 0.0) * n,
                      row.get("episodes_trained", 0), row.get("groups", 0),
                      row.get("groups_accepted", 0)], np.float64)
  total = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, len(local)).sum(0)
  episodes = max(total[0], 1.0)
  return {"episodes": int(total[0]), "success_rate": float(total[1] / episodes),
          "reward_mean": float(total[2] / episodes), "episodes_trained": int(total[3]),
          "groups": int(total[4]), "groups_accepted": int(total[5])}

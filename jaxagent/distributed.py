"""Multi-controller JAX: joining a run of several processes, and the few things that
differ when one process is not the whole run.

Under multi-controller JAX every process runs this same program over a global mesh;
each feeds the rows of the batch that its own devices hold, and only process 0
writes files other readers share (metrics, TensorBoard, trajectories, the policy
registry). Orbax checkpoints are written and read by every process together.

How a process learns it is one of several, first match wins:
1. explicit arguments (`--coordinator HOST:PORT --num-processes N --process-id I`);
2. the environment variables `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
   `JAX_PROCESS_ID` (what `jaxagent.launch local` sets);
3. a TPU pod slice or a cluster JAX detects itself (`TPU_WORKER_HOSTNAMES` with
   more than one host, which GKE's TPU webhook sets on the GKE manifests' slice pods;
   Slurm, Open MPI): `jax.distributed.initialize()` with no arguments.
Otherwise the process is alone and nothing is initialised.
"""

from __future__ import annotations

import functools
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


HEARTBEAT_TIMEOUT_S = 100  # (jax.distributed's default)


def _env_int(name: str) -> Optional[int]:
  """The whole number in environment variable `name`, or None where it is unset or empty."""
  text = os.environ.get(name)
  if not text:
    return None
  try:
    return int(text)
  except ValueError:
    raise ValueError(f"${name}={text!r}: not a whole number") from None


def check_coordinator(address: str) -> None:
  """Raises `ValueError` unless `address` reads as HOST:PORT with a port in 1..65535 (an
  IPv6 host in brackets). JAX's coordination client took `localhost` with a traceback,
  `nope:abc` with a segmentation fault, and `localhost:99999` by waiting forever."""
  host, sep, port = address.rpartition(":")
  if host.startswith("[") and host.endswith("]"):
    host = host[1:-1]
  if not sep or not host or any(c.isspace() for c in host):
    raise ValueError(f"coordinator {address!r}: expected HOST:PORT (e.g. 10.0.0.2:8476)")
  if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
    raise ValueError(f"coordinator {address!r}: the port must be a number in 1..65535")


def initialize(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None,
               heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S) -> bool:
  """Joins the run's processes if this is one of several; returns whether it did.

  Must run before anything touches a JAX device. Raises `ValueError` naming what
  is missing when only some of the three settings are given. `heartbeat_timeout_s`:
  how long the coordination service waits for a silent process (one killed while the
  others wait in a collective that does not fail on it, or stopped) before it stops
  the run.
  """
  import jax

  if isinstance(heartbeat_timeout_s, bool) or not (
      isinstance(heartbeat_timeout_s, int) and heartbeat_timeout_s >= 1):
    raise ValueError(f"heartbeat timeout {heartbeat_timeout_s!r}: a whole number of "
                     "seconds, at least 1")

  coordinator = coordinator or os.environ.get(ENV_COORDINATOR) or None
  if num_processes is None:
    num_processes = _env_int(ENV_NUM_PROCESSES)
  if process_id is None:
    process_id = _env_int(ENV_PROCESS_ID)
  given = {"coordinator": coordinator, "num_processes": num_processes,
           "process_id": process_id}
  if any(v is not None for v in given.values()):
    missing = [k for k, v in given.items() if v is None]
    if missing:
      raise ValueError(f"a multi-process run needs coordinator, num_processes and "
                       f"process_id; missing: {', '.join(missing)} (flags --coordinator, "
                       f"--num-processes, --process-id or ${ENV_COORDINATOR}, "
                       f"${ENV_NUM_PROCESSES}, ${ENV_PROCESS_ID})")
    if num_processes < 1:
      raise ValueError(f"num_processes {num_processes}: a run has at least 1 process")
    if not 0 <= process_id < num_processes:
      raise ValueError(f"process_id {process_id} is not in [0, {num_processes})")
    check_coordinator(coordinator)
    if num_processes == 1:
      return False
    jax.distributed.initialize(coordinator, num_processes, process_id,
                               heartbeat_timeout_seconds=heartbeat_timeout_s)
    return True
  if _auto_detectable():
    jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout_s)
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


class MeshCoverageError(ValueError):
  """The processes' local meshes do not hold the arrays' devices exactly once."""


@functools.lru_cache(maxsize=8)
def _process_replicator(local_mesh, specs: tuple, dtype: Optional[str]):
  """(A jitted copy of a list of arrays onto the global mesh (processes, *local mesh)
  with `specs` within each process and replication across them (built once per local
  mesh and specs: every process calls it in the same order, as it gathers), that mesh)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  rows = gather_json([d.id for d in local_mesh.devices.flat])
  by_id = {d.id: d for d in jax.devices()}
  ids = [i for row in rows for i in row]
  if len(set(ids)) != len(ids):
    raise MeshCoverageError("copy_to_local: the processes' local meshes share devices")
  grid = np.asarray([by_id[i] for i in ids], dtype=object).reshape(
      (len(rows),) + local_mesh.devices.shape)
  global_mesh = Mesh(grid, ("process",) + tuple(local_mesh.axis_names))
  # jnp.copy keeps the outputs from aliasing the inputs (the caller's next train step
  # donates them).
  copy = jax.jit(lambda xs: [jnp.copy(x) if dtype is None else x.astype(dtype) for x in xs],
                 out_shardings=[NamedSharding(global_mesh, PartitionSpec(*s)) for s in specs])
  return copy, global_mesh


def copy_to_local(tree: Any, local_shardings: Any, dtype: Any = None) -> Any:
  """Every array of `tree` (sharded over the devices of every process), whole, on this
  process's devices with `local_shardings` (a matching tree of `NamedSharding`s over one
  local mesh, the same shape on every process): device to device, by collectives.

  The arrays are resharded onto a global mesh of shape (processes, *local mesh) that
  lays each process's local mesh along a `process` axis, split within a process as
  `local_shardings` say and replicated across processes; this process's shards of the
  result are then the local arrays: each process holds the model as its engine lays it
  out (split or replicated over its own devices), and nothing crosses the host.
  `dtype` (e.g. the engine's bfloat16) casts on the way, so the copy moves and holds
  only the engine's bytes. All processes must call it; their local meshes together must
  be the devices the arrays live on (else `MeshCoverageError`: use `host_copy`). One
  process: a plain reshard.
  """
  import jax
  import jax.numpy as jnp

  leaves, treedef = jax.tree.flatten(tree)
  targets = treedef.flatten_up_to(local_shardings)
  if not leaves:
    return tree
  local_mesh = targets[0].mesh
  if any(t.mesh != local_mesh for t in targets):
    raise ValueError("copy_to_local: every target sharding must use one local mesh")
  if jax.process_count() == 1:  # never aliasing the input (the next train step donates it)
    return jax.tree.unflatten(treedef, [
        jax.device_put(x if dtype is None or x.dtype == dtype else x.astype(dtype), t,
                       may_alias=False) for x, t in zip(leaves, targets)])
  copy, global_mesh = _process_replicator(local_mesh, tuple(t.spec for t in targets),
                                          None if dtype is None else jnp.dtype(dtype).name)
  sources = {d.id for x in leaves for d in x.sharding.device_set}
  if sources != {d.id for d in global_mesh.devices.flat}:
    raise MeshCoverageError("copy_to_local: the processes' local meshes do not cover the "
                            "arrays' devices exactly once")
  copied = copy(leaves)
  out = [jax.make_array_from_single_device_arrays(
             y.shape, t, [shard.data for shard in y.addressable_shards])
         for y, t in zip(copied, targets)]
  return jax.tree.unflatten(treedef, out)


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


# What a collective says when a process it needs is gone (its transport's connection to
# it, the coordination service's heartbeats); not any collective's failure (a CUDA error
# in NCCL, a shape mismatch in Gloo are this process's own).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "heartbeat", "stopped sending heartbeats", "tasks are unhealthy")


def peer_gone(e: BaseException) -> bool:
  """Whether `e`, raised in a multi-process run, is a collective's failure because
  another process is gone: JAX's runtime error, or Gloo's failure as a CPU allgather
  raises it (a ValueError "Gloo AllGather failed: ... Connection reset by peer": it was
  taken for this process's own bug, two tracebacks and exit 1, not the line and exit 3)."""
  import jax

  collective = isinstance(e, jax.errors.JaxRuntimeError) or (
      isinstance(e, ValueError) and "Gloo" in str(e))
  return (jax.process_count() > 1 and collective
          and any(s in str(e) for s in _PEER_GONE))


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
  # (every process's row has the same keys where they do not follow its episodes: their
  # configs are the run's; a process with no episode this step has no means, and counts
  # 0, in a vector as long as the others')
  summed = SUMMED + tuple(k for k in SUMMED_WHERE_COUNTED if k in row)
  means = ("success_rate", "reward_mean", *EPISODE_MEANS)
  local = np.asarray([n] + [row.get(k, 0.0) * n for k in means]
                     + [row.get(k, 0) for k in summed], np.float64)
  total = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, len(local)).sum(0)
  episodes = max(total[0], 1.0)
  out = {"episodes": int(total[0]),
         **{k: int(v) for k, v in zip(summed, total[1 + len(means):])}}
  for k, v in zip(means, total[1:]):
    if k in ("success_rate", "reward_mean") or total[0]:  # (the others: with episodes)
      out[k] = float(v / episodes)
  return out


# The counts of a step's row that are every process's sum (each packs its own groups,
# plays its own episodes), and those only a run with their source counts (the token
# WAL's turns replayed were process 0's alone: a new user). The tool calls, tokens and
# means over episodes were process 0's alone too, beside the whole run's episode count
# (tool calls an episode read 4x too low on 4 processes; a reviewer).
SUMMED = ("episodes_trained", "groups", "groups_accepted", "batch_segments",
          "batch_overflow", "batch_overflow_groups", "batch_too_long", "tool_calls",
          "invalid_tool_calls", "tool_errors", "compactions", "groups_with_signal",
          "output_tokens")
SUMMED_WHERE_COUNTED = ("wal_replayed_turns",)
# Means over a step's episodes: every process's, weighted by its episodes.
EPISODE_MEANS = ("reward_terminal_mean", "reward_process_mean", "turns_mean",
                 "tool_call_rate", "generate_s_mean", "env_s_mean", "infra_wait_s_mean")

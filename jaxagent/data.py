"""Data pipelines on grain: task files and the synthetic trajectories of the smoke run.

grain gives shuffling, per-host sharding and a checkpointable iterator whose
position is saved with the run (`RunCheckpointer`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Iterator

import grain
import jax
import numpy as np

from jaxagent.config import ConfigError


def tasks_digest(path: str) -> str:
  """The task file's tasks as a short SHA-256 (a checkpoint's data place is an index into
  the order the file's tasks come in): of their values in the file's order, as
  `task_dataset` reads them, so that an edit that changes no task (a blank line, a key's
  place, spacing) is no change. ValueError for a line that is not JSON."""
  digest = hashlib.sha256()
  with open(path) as f:
    for line in f:
      if line.strip():
        digest.update(json.dumps(json.loads(line), sort_keys=True).encode() + b"\n")
  return digest.hexdigest()[:16]


def file_digest(path: str) -> str:
  """The file's bytes as a short SHA-256 (what checkpoints saved before `tasks_digest`
  recorded as `tasks_sha256`)."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()[:16]


# How a run orders its tasks (a checkpoint records it, `task_order`: a run resumes in the
# order its data place indexes). 1: each process shuffled its own slice of the file
# (`tasks[p::n]`), and `data.seed` was grain's shuffle seed itself. 2: one order for all
# processes, each taking every n-th task of it, from a seed mixed out of `data.seed`.
TASK_ORDER = 2


def shuffle_seed(seed: int) -> int:
  """grain's shuffle seed for `data.seed`: grain shuffles epoch e with seed + e, so
  neighbouring data seeds gave the same orders one epoch apart (seed 1's first epoch was
  seed 0's second; a reviewer); mixed, they are unrelated."""
  return int.from_bytes(hashlib.sha256(f"jaxagent-tasks-{seed}".encode()).digest()[:4],
                        "little")


def task_dataset(path: str, *, seed: int, shuffle: bool = True,
                 num_epochs: int | None = None, order: int = TASK_ORDER) -> grain.IterDataset:
  """Tasks from a JSONL file (one task spec per line), shuffled, sharded over hosts.

  One endless order (each epoch shuffled anew), of which process p of n takes tasks p,
  p + n, p + 2n, ...: every task comes once an epoch of the whole run, whatever the
  count. (Each process shuffling its own slice played a process's tasks more often when
  its slice was smaller: 7 tasks over 3 processes came 20, 30 and 30 times; a reviewer.)
  `order` 1: the order of runs saved before (`TASK_ORDER`)."""
  with open(path) as f:
    tasks = [json.loads(line) for line in f if line.strip()]
  if not tasks:
    raise ValueError(f"task file {path} has no tasks")
  ds = grain.MapDataset.source(tasks)
  if order >= 2:
    if shuffle:
      ds = ds.shuffle(seed=shuffle_seed(seed))
    ds = ds.repeat(num_epochs)[jax.process_index()::jax.process_count()]
    return ds.to_iter_dataset()
  # Each host of a multi-controller run reads its own slice.
  if len(tasks) < jax.process_count():
    # (a host with an empty slice stopped at its first task with a bare StopIteration;
    # a reviewer)
    raise ConfigError(f"data.tasks: {path} has {len(tasks)} tasks for "
                      f"{jax.process_count()} processes: each process plays its own slice "
                      "of the tasks, so it needs at least one task a process")
  ds = ds[jax.process_index()::jax.process_count()]
  if shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat(num_epochs)
  return ds.to_iter_dataset()


def synthetic_segment(index: int, *, seed: int, vocab: int, target: int, min_len: int = 16,
                      max_len: int = 64) -> dict:
  """A made-up trajectory: a prompt, then a response that is either `target` repeated
  (advantage +1) or random tokens (advantage -1). Learning raises p(target)."""
  rng = np.random.default_rng([seed, index])
  n = int(rng.integers(min_len, max_len + 1))
  prompt = int(rng.integers(2, n // 2))
  tokens = rng.integers(0, vocab, n).astype(np.int32)
  good = bool(rng.random() < 0.5)
  if good:
    tokens[prompt:] = target
  mask = np.zeros(n, np.float32)
  mask[prompt:] = 1.0
  return dict(tokens=tokens, loss_mask=mask,
              rollout_logp=np.where(mask > 0, -np.log(vocab), 0.0).astype(np.float32),
              advantages=mask * (1.0 if good else -1.0), rollout_id=index,
              reward=1.0 if good else 0.0)


def synthetic_dataset(*, seed: int, vocab: int, target: int, shuffle: bool = True,
                      size: int = 1_000_000) -> grain.IterDataset:
  ds = grain.MapDataset.range(size)
  if shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds.map(lambda i: synthetic_segment(int(i), seed=seed, vocab=vocab, target=target))
  return ds.to_iter_dataset()


def take(it: Iterator, n: int) -> list:
  return [next(it) for _ in range(n)]

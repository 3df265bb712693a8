"""The `TrajectoryBatch` handed to the learner, and host-side packing into it.

Contracts tier: NumPy and the standard library only. A `TrajectoryBatch` is a
NamedTuple, hence a JAX pytree, of `[B, T]` arrays aligned with `tokens`.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np


class TrajectoryBatch(NamedTuple):
  """Packed training rows. Position t of every array describes token t.

  tokens:          token ids
  positions:       position of the token within its segment (restarts at 0)
  segment_ids:     1, 2, ... per packed segment in a row; 0 on padding
  loss_mask:       1 on model-sampled action tokens only
  rollout_logp:    log-prob the engine sampled the token with (0 where mask is 0)
  advantages:      per-token advantage (0 where mask is 0)
  rollout_weight:  1 / action tokens of the token's whole rollout (per-rollout reduction)
  old_logp:        learner log-probs before this update (None: on-policy, use the current)
  ref_logp:        reference-policy log-probs for a KL penalty (None: no KL)
  versions:        policy version that sampled the token (int32; -1 where mask is 0;
                   None: not recorded); the learner's staleness weighting reads it
  """

  tokens: np.ndarray
  positions: np.ndarray
  segment_ids: np.ndarray
  loss_mask: np.ndarray
  rollout_logp: np.ndarray
  advantages: np.ndarray
  rollout_weight: np.ndarray
  old_logp: Optional[np.ndarray] = None
  ref_logp: Optional[np.ndarray] = None
  versions: Optional[np.ndarray] = None

  @property
  def shape(self) -> tuple[int, int]:
    return tuple(self.tokens.shape)

  def num_action_tokens(self) -> int:
    return int(np.sum(self.loss_mask))


FLOAT_FIELDS = ("loss_mask", "rollout_logp", "advantages", "rollout_weight", "old_logp",
                "ref_logp")


def rollout_weights(loss_mask: np.ndarray, rollout_ids: np.ndarray) -> np.ndarray:
  """Per-token 1 / (action tokens of the rollout), over every segment of each rollout."""
  ids = np.asarray(rollout_ids).reshape(-1)
  mask = np.asarray(loss_mask, np.float64).reshape(-1)
  uniq, inv = np.unique(ids, return_inverse=True)
  counts = np.bincount(inv, weights=mask, minlength=len(uniq))
  w = np.where(mask > 0, 1.0 / np.maximum(counts[inv], 1.0), 0.0)
  return w.reshape(np.shape(loss_mask)).astype(np.float32)


def row_ladder(max_rows: int, multiple: int = 1) -> list[int]:
  """The row counts a batch may take: multiples of `multiple` at 1, 1.25, 1.5 and 1.75
  times powers of two (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, ... times `multiple`),
  up to `max_rows` (included, rounded up to the multiple). Four shapes an octave: a
  batch wastes at most a quarter of its rows past 8 x `multiple`, and the train step
  compiles once per shape."""
  top = -(-max_rows // multiple)
  units = {1, 2, 3}
  p = 4
  while p < top:
    units.update(p * k // 4 for k in (4, 5, 6, 7))
    p *= 2
  return sorted(u * multiple for u in units if u < top) + [top * multiple]


def pack(segments: Sequence[dict], rows: int, seq_len: int, pad_id: int = 0, *,
         decreasing: bool = False, with_ref: bool = False
         ) -> tuple[TrajectoryBatch, np.ndarray]:
  """Packs segments into `rows` rows of `seq_len` tokens (first fit).

  Each segment is a dict of 1-D arrays `tokens`, `loss_mask`, `rollout_logp`,
  `advantages` (and optionally `old_logp`, `ref_logp`, `versions`) plus a `rollout_id`
  (any hashable; segments of one rollout share it). Segments are placed in order, or
  longest first with `decreasing` (first-fit decreasing: fuller rows; the rows used
  are then a prefix of the batch). Returns the batch and, for each segment, its row
  (-1: it did not fit and was left out; the caller decides what to do with it).
  `versions` is always there (-1 where unknown), and `ref_logp` with `with_ref` even
  when no segment has one: every process of a run then hands the step the same
  structure, whatever it packed.
  """
  shape = (rows, seq_len)
  out = {name: np.zeros(shape, np.float32) for name in FLOAT_FIELDS}
  tokens = np.full(shape, pad_id, np.int32)
  positions = np.zeros(shape, np.int32)
  segment_ids = np.zeros(shape, np.int32)
  rollout_ids = np.full(shape, -1, np.int64)
  versions = np.full(shape, -1, np.int32)
  fill = np.zeros(rows, np.int64)
  placed = np.full(len(segments), -1, np.int64)
  has = {name: any(name in s for s in segments) for name in ("old_logp", "ref_logp",
                                                             "versions")}
  rollout_index: dict = {}  # rollout ids may be any hashable (strings from sessions)
  order = range(len(segments))
  if decreasing:  # stable: equal lengths keep their order
    order = sorted(order, key=lambda i: -len(segments[i]["tokens"]))
  for i in order:
    seg = segments[i]
    n = len(seg["tokens"])
    if n > seq_len:
      raise ValueError(f"segment {i} has {n} tokens, more than the row length {seq_len}")
    trained = np.asarray(seg["loss_mask"]) > 0
    if n and trained[0]:
      # (packed, its log-prob came from the row's previous segment, and its gradient went
      # there; alone in a row it was 0: red team 37)
      raise ValueError(f"segment {i}'s first token is in the loss: no position of the "
                       "segment predicts it (a segment begins with its prompt)")
    if np.isnan(np.asarray(seg["rollout_logp"], np.float32)[trained]).any():
      raise ValueError(f"segment {i} has a behaviour log-prob that is NaN on a token in "
                       "the loss (its sampler's record is broken)")
    fits = np.nonzero(fill + n <= seq_len)[0]
    if not len(fits):
      continue
    r = int(fits[0])
    sl = slice(fill[r], fill[r] + n)
    tokens[r, sl] = seg["tokens"]
    positions[r, sl] = np.arange(n)
    segment_ids[r, sl] = segment_ids[r].max() + 1  # ids follow placement within a row
    rollout_ids[r, sl] = rollout_index.setdefault(seg["rollout_id"], len(rollout_index))
    for name in FLOAT_FIELDS:
      if name in seg:
        out[name][r, sl] = seg[name]
    if "versions" in seg:
      versions[r, sl] = np.where(np.asarray(seg["loss_mask"]) > 0, seg["versions"], -1)
    fill[r] += n
    placed[i] = r
  out["rollout_weight"] = rollout_weights(out["loss_mask"], rollout_ids)
  batch = TrajectoryBatch(
      tokens=tokens, positions=positions, segment_ids=segment_ids,
      loss_mask=out["loss_mask"], rollout_logp=out["rollout_logp"],
      advantages=out["advantages"], rollout_weight=out["rollout_weight"],
      old_logp=out["old_logp"] if has["old_logp"] else None,
      ref_logp=out["ref_logp"] if has["ref_logp"] or with_ref else None,
      versions=versions)
  return batch, placed


def take_rows(batch: TrajectoryBatch, rows: int) -> TrajectoryBatch:
  """The first `rows` rows of every array of the batch."""
  return TrajectoryBatch(*(None if x is None else x[:rows] for x in batch))

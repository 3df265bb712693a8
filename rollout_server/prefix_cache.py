"""A radix tree over token ids holding KV for shared prompt prefixes (as SGLang's RadixAttention).

Each node owns the KV of the tokens on its edge (`[layers, edge_len, kv_heads,
head_dim]`, host arrays), so a prefix shared by many sequences is stored once.
`match` returns the KV of the longest cached prefix; `insert` adds the KV of a
new sequence's uncached tail. Memory is bounded in tokens: least recently used
leaves are evicted first. Counters record hits (requests that reused any
prefix) and tokens reused versus looked up.
"""

from __future__ import annotations

import itertools
import threading
from typing import Optional, Sequence

import numpy as np


class _Node:
  __slots__ = ("edge", "k", "v", "children", "parent", "last_used")

  def __init__(self, edge: tuple[int, ...], k, v, parent: Optional["_Node"]):
    self.edge = edge
    self.k = k
    self.v = v
    self.children: dict[int, _Node] = {}
    self.parent = parent
    self.last_used = 0

  def split(self, at: int) -> "_Node":
    """Splits this node's edge at `at`; returns the new upper node (this one becomes its child)."""
    upper = _Node(self.edge[:at], self.k[:, :at], self.v[:, :at], self.parent)
    self.parent.children[self.edge[0]] = upper
    self.edge, self.k, self.v = self.edge[at:], self.k[:, at:], self.v[:, at:]
    self.parent = upper
    upper.children[self.edge[0]] = self
    upper.last_used = self.last_used
    return upper


class PrefixCache:
  """Bounded radix-tree KV cache keyed by token ids. Thread-safe."""

  def __init__(self, capacity_tokens: int):
    if capacity_tokens < 1:
      raise ValueError(f"capacity_tokens must be >= 1, got {capacity_tokens}")
    self.capacity = capacity_tokens
    self._root = _Node((), None, None, None)
    self._clock = itertools.count(1)
    self._lock = threading.Lock()
    self.tokens = 0
    self.hits = 0
    self.misses = 0
    self.hit_tokens = 0
    self.lookup_tokens = 0
    self.evicted_tokens = 0

  def _walk(self, tokens: Sequence[int]):
    """Yields (node, matched length on its edge) along the longest matching path."""
    node, i = self._root, 0
    while i < len(tokens):
      child = node.children.get(tokens[i])
      if child is None:
        return
      n = 0
      limit = min(len(child.edge), len(tokens) - i)
      while n < limit and child.edge[n] == tokens[i + n]:
        n += 1
      yield child, n
      if n < len(child.edge):
        return
      node, i = child, i + n

  def match(self, tokens: Sequence[int], max_length: Optional[int] = None
            ) -> tuple[int, Optional[np.ndarray], Optional[np.ndarray]]:
    """Longest cached prefix of `tokens` (at most `max_length`): (length, k, v)."""
    tokens = list(tokens[:max_length] if max_length is not None else tokens)
    with self._lock:
      now = next(self._clock)
      ks, vs, length = [], [], 0
      for node, n in self._walk(tokens):
        node.last_used = now
        ks.append(node.k[:, :n])
        vs.append(node.v[:, :n])
        length += n
      self.lookup_tokens += len(tokens)
      self.hit_tokens += length
      if length:
        self.hits += 1
        return length, np.concatenate(ks, axis=1), np.concatenate(vs, axis=1)
      self.misses += 1
      return 0, None, None

  def insert(self, tokens: Sequence[int], k: np.ndarray, v: np.ndarray) -> int:
    """Caches the KV of `tokens` (`k`, `v`: `[layers, len(tokens), ...]`); returns new tokens stored."""
    tokens = tuple(int(t) for t in tokens)
    if k.shape[1] != len(tokens) or v.shape[1] != len(tokens):
      raise ValueError(f"KV covers {k.shape[1]} positions but {len(tokens)} tokens were given")
    if not tokens:
      return 0
    with self._lock:
      now = next(self._clock)
      node, i = self._root, 0
      for child, n in self._walk(tokens):
        child.last_used = now
        if n < len(child.edge):
          child = child.split(n)
        node, i = child, i + n
      if i == len(tokens):
        return 0
      leaf = _Node(tokens[i:], np.array(k[:, i:]), np.array(v[:, i:]), node)
      leaf.last_used = now
      node.children[tokens[i]] = leaf
      added = len(tokens) - i
      self.tokens += added
      self._evict(protect=leaf)
      return added

  def _leaves(self):
    stack = [self._root]
    while stack:
      node = stack.pop()
      if not node.children and node is not self._root:
        yield node
      stack.extend(node.children.values())

  def _evict(self, protect: _Node) -> None:
    while self.tokens > self.capacity:
      leaves = [n for n in self._leaves() if n is not protect]
      if not leaves:  # only the new entry is left and it alone is too big: trim nothing more
        if self.tokens > self.capacity:
          self._remove(protect)
        return
      self._remove(min(leaves, key=lambda n: n.last_used))

  def _remove(self, leaf: _Node) -> None:
    parent = leaf.parent
    del parent.children[leaf.edge[0]]
    self.tokens -= len(leaf.edge)
    self.evicted_tokens += len(leaf.edge)
    # A parent left with one child and no use of its own is merged with it.
    if parent is not self._root and len(parent.children) == 1:
      (only,) = parent.children.values()
      parent.edge = parent.edge + only.edge
      parent.k = np.concatenate([parent.k, only.k], axis=1)
      parent.v = np.concatenate([parent.v, only.v], axis=1)
      parent.children = only.children
      for c in parent.children.values():
        c.parent = parent
      parent.last_used = max(parent.last_used, only.last_used)

  def clear(self) -> None:
    """Drops every entry (for example after a weight update: the KV is of old weights)."""
    with self._lock:
      self._root = _Node((), None, None, None)
      self.tokens = 0

  def stats(self) -> dict:
    with self._lock:
      return {"tokens": self.tokens, "capacity": self.capacity, "hits": self.hits,
              "misses": self.misses, "hit_tokens": self.hit_tokens,
              "lookup_tokens": self.lookup_tokens, "evicted_tokens": self.evicted_tokens,
              "hit_rate": self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0}

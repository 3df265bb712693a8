"""Host-side bookkeeping of the engine's device KV pages: an allocator with reference
counts, and a radix tree of token prefixes whose values are page ids (as vLLM's
block manager and SGLang's RadixAttention).

The KV itself never leaves the device: these structures only decide which page
ids a sequence's page table lists. A page holds `page_size` consecutive
positions of one sequence. Page 0 is reserved as the null page: page-table
entries past a sequence's pages point there, and nothing valid is written there.

Sharing: the tree maps every whole page of a cached prefix to its page id, so
the next turn of a session and the samples of a GRPO group list the same pages
for their common prefix. Only whole pages are shared; a sequence that diverges
inside a page writes its own copy of that page's positions (copy-on-write by
recomputing at most `page_size - 1` tokens). Pages are reference-counted (one
reference per sequence that lists a page, one for the tree); a page is free
again when its count reaches 0. Tree entries whose pages no sequence uses are
evicted least recently used first when the allocator runs short.
"""

from __future__ import annotations

import itertools
import threading
from typing import Optional, Sequence

import numpy as np

NULL_PAGE = 0


class OutOfPages(RuntimeError):
  """Not enough free KV pages, even after evicting every unused cached prefix."""


class PageAllocator:
  """Free list and reference counts of `num_pages` pages (page 0 is the null page)."""

  def __init__(self, num_pages: int):
    if num_pages < 2:
      raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
    self.num_pages = num_pages
    self.refs = np.zeros(num_pages, np.int32)
    self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first

  @property
  def free(self) -> int:
    return len(self._free)

  @property
  def used(self) -> int:
    return self.num_pages - 1 - len(self._free)

  def alloc(self, n: int) -> list[int]:
    """`n` fresh pages, each with one reference."""
    if n > len(self._free):
      raise OutOfPages(f"{n} pages wanted, {len(self._free)} free")
    pages = [self._free.pop() for _ in range(n)]
    self.refs[pages] = 1
    return pages

  def ref(self, pages: Sequence[int]) -> None:
    for p in pages:
      if self.refs[p] <= 0:
        raise ValueError(f"page {p} is not allocated")
      self.refs[p] += 1

  def unref(self, pages: Sequence[int]) -> None:
    for p in pages:
      if self.refs[p] <= 0:
        raise ValueError(f"page {p} is not allocated")
      self.refs[p] -= 1
      if self.refs[p] == 0:
        self._free.append(p)


class _Node:
  __slots__ = ("edge", "pages", "children", "parent", "last_used")

  def __init__(self, edge: tuple[int, ...], pages: list[int], parent: Optional["_Node"]):
    self.edge = edge  # a whole number of pages of tokens
    self.pages = pages
    self.children: dict[tuple[int, ...], _Node] = {}  # keyed by the child's first page
    self.parent = parent
    self.last_used = 0


class PagedPrefixCache:
  """Radix tree from token prefixes (whole pages) to the device pages holding their KV.

  Thread-safe. `match` returns the pages of the longest cached whole-page prefix (and
  takes a reference on them for the caller); `insert` records a sequence's whole pages
  (the tree takes its own reference on pages it did not have); `evict` frees unused
  entries, least recently used first.
  """

  def __init__(self, allocator: PageAllocator, page_size: int,
               capacity_pages: Optional[int] = None):
    self.allocator = allocator
    self.page_size = page_size
    self.capacity_pages = capacity_pages or allocator.num_pages
    self._root = _Node((), [], None)
    self._clock = itertools.count(1)
    self._lock = threading.RLock()
    self.pages = 0  # pages the tree references
    self.hits = 0
    self.misses = 0
    self.hit_tokens = 0
    self.lookup_tokens = 0
    self.evicted_pages = 0

  def _key(self, tokens: Sequence[int], i: int) -> tuple[int, ...]:
    return tuple(tokens[i:i + self.page_size])

  def _walk(self, tokens: tuple[int, ...]):
    """Yields (node, whole pages matched on its edge) along the longest matching path."""
    node, i, P = self._root, 0, self.page_size
    while i + P <= len(tokens):
      child = node.children.get(self._key(tokens, i))
      if child is None:
        return
      n = 0
      while n < len(child.pages) and i + (n + 1) * P <= len(tokens) and (
          child.edge[n * P:(n + 1) * P] == tokens[i + n * P:i + (n + 1) * P]):
        n += 1
      yield child, n
      if n < len(child.pages):
        return
      node, i = child, i + n * P

  def match(self, tokens: Sequence[int], max_length: Optional[int] = None
            ) -> tuple[int, list[int]]:
    """(tokens matched, their pages) for the longest cached whole-page prefix of `tokens`
    (at most `max_length` tokens). The caller owns one reference on each returned page."""
    tokens = tuple(int(t) for t in (tokens[:max_length] if max_length is not None else tokens))
    with self._lock:
      now = next(self._clock)
      pages: list[int] = []
      for node, n in self._walk(tokens):
        node.last_used = now
        pages += node.pages[:n]
      self.allocator.ref(pages)
      matched = len(pages) * self.page_size
      self.lookup_tokens += len(tokens)
      self.hit_tokens += matched
      if matched:
        self.hits += 1
      else:
        self.misses += 1
      return matched, pages

  def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
    """Records the whole pages of `tokens` (`pages[j]` holds positions j*P..(j+1)*P-1);
    a partial last page is ignored. Returns the pages newly referenced by the tree."""
    P = self.page_size
    whole = min(len(tokens) // P, len(pages))
    tokens = tuple(int(t) for t in tokens[:whole * P])
    if not whole:
      return 0
    with self._lock:
      now = next(self._clock)
      node, i = self._root, 0
      # The path is read whole before the tree changes: a split shortens the node the
      # walk stands on, and walking on from it read the children of its lower half at
      # the upper half's position (another sequence's pages, matched at the wrong place).
      for child, n in list(self._walk(tokens)):
        child.last_used = now
        if n < len(child.pages):
          child = self._split(child, n)
        node, i = child, i + n * P
      if i == len(tokens):
        return 0
      new = list(pages[i // P:whole])
      leaf = _Node(tokens[i:], new, node)
      leaf.last_used = now
      node.children[self._key(tokens, i)] = leaf
      self.allocator.ref(new)
      self.pages += len(new)
      if self.pages > self.capacity_pages:
        self.evict(self.pages - self.capacity_pages, protect=leaf)
      return len(new)

  def _split(self, node: _Node, n: int) -> _Node:
    """Splits `node` after its first `n` pages; returns the new upper node."""
    P = self.page_size
    upper = _Node(node.edge[:n * P], node.pages[:n], node.parent)
    node.parent.children[self._key(node.edge, 0)] = upper
    node.edge, node.pages = node.edge[n * P:], node.pages[n:]
    node.parent = upper
    upper.children[self._key(node.edge, 0)] = node
    upper.last_used = node.last_used
    return upper

  def _leaves(self):
    stack = [self._root]
    while stack:
      node = stack.pop()
      if not node.children and node is not self._root:
        yield node
      stack.extend(node.children.values())

  def evict(self, pages_wanted: int, protect: Optional[_Node] = None) -> int:
    """Drops least recently used pages no running sequence lists, until `pages_wanted`
    pages are free again or no such page is left; returns pages freed. A leaf goes from
    its end: a sequence lists a prefix of a path's pages, so a leaf's unused pages are
    its last ones (those after a running sequence's match go, its own stay)."""
    freed = 0
    with self._lock:
      while freed < pages_wanted:
        unused = [(n, k) for n in self._leaves() if n is not protect
                  for k in [self._unused_tail(n)] if k]
        if not unused:
          return freed
        leaf, k = min(unused, key=lambda nk: nk[0].last_used)
        before = self.allocator.free
        if k == len(leaf.pages):
          self._remove(leaf)
        else:
          tail, keep = leaf.pages[-k:], len(leaf.pages) - k
          leaf.edge, leaf.pages = leaf.edge[:keep * self.page_size], leaf.pages[:keep]
          self.allocator.unref(tail)
          self.pages -= k
          self.evicted_pages += k
        freed += self.allocator.free - before
      return freed

  def _unused_tail(self, leaf: _Node) -> int:
    """How many of the leaf's last pages only the tree lists."""
    k = 0
    while k < len(leaf.pages) and self.allocator.refs[leaf.pages[-1 - k]] == 1:
      k += 1
    return k

  def _remove(self, leaf: _Node) -> None:
    parent = leaf.parent
    del parent.children[self._key(leaf.edge, 0)]
    self.allocator.unref(leaf.pages)
    self.pages -= len(leaf.pages)
    self.evicted_pages += len(leaf.pages)
    # A parent left with one child is merged into it (the child keeps its identity: a
    # leaf `evict` protects stays that leaf).
    if parent is not self._root and len(parent.children) == 1:
      (only,) = parent.children.values()
      only.edge = parent.edge + only.edge
      only.pages = parent.pages + only.pages
      only.parent = parent.parent
      only.last_used = max(parent.last_used, only.last_used)
      parent.parent.children[self._key(only.edge, 0)] = only

  def clear(self) -> None:
    """Drops every entry (after a weight update the KV is of old weights)."""
    with self._lock:
      for leaf in list(self._leaves()):
        node = leaf
        while node is not self._root:
          self.allocator.unref(node.pages)
          node.pages = []
          node = node.parent
      self._root = _Node((), [], None)
      self.pages = 0

  @property
  def tokens(self) -> int:
    return self.pages * self.page_size

  def stats(self) -> dict:
    with self._lock:
      return {"tokens": self.tokens, "pages": self.pages, "hits": self.hits,
              "misses": self.misses, "hit_tokens": self.hit_tokens,
              "lookup_tokens": self.lookup_tokens, "evicted_pages": self.evicted_pages,
              "hit_rate": self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0}

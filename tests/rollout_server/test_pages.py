"""Host bookkeeping of device KV pages: allocator reference counts and the page radix tree."""

import pytest

from rollout_server.pages import OutOfPages, PageAllocator, PagedPrefixCache


def test_allocator_counts_references_and_reserves_the_null_page():
  a = PageAllocator(5)
  pages = a.alloc(4)
  assert sorted(pages) == [1, 2, 3, 4] and a.free == 0
  with pytest.raises(OutOfPages):
    a.alloc(1)
  a.ref(pages[:2])
  a.unref(pages)
  assert a.free == 2 and sorted(a.alloc(2)) == sorted(pages[2:])
  a.unref(pages[:2])
  assert a.free == 2
  with pytest.raises(ValueError, match="not allocated"):
    a.unref([pages[0]])


def test_whole_pages_are_shared_and_matched():
  a = PageAllocator(32)
  cache = PagedPrefixCache(a, page_size=4)
  seq = list(range(10))  # 2 whole pages + 2 tokens
  pages = a.alloc(3)
  assert cache.insert(seq, pages) == 2  # the partial page is not shared
  a.unref(pages)  # the sequence ends: the tree keeps its whole pages
  assert a.free == 31 - 2
  n, got = cache.match(list(range(9)) + [99])
  assert n == 8 and got == pages[:2]  # the caller now holds a reference too
  assert a.refs[pages[0]] == 2
  n, got2 = cache.match([0, 1, 2, 3, 7, 7, 7, 7])
  assert n == 4 and got2 == pages[:1]
  # A diverging sequence splits the edge after the shared page.
  other = a.alloc(2)
  assert cache.insert([0, 1, 2, 3, 9, 9, 9, 9], [pages[0], other[1]]) == 1
  assert cache.match([0, 1, 2, 3, 9, 9, 9, 9, 5])[1] == [pages[0], other[1]]
  s = cache.stats()
  assert s["hits"] == 3 and s["pages"] == 3 and s["hit_tokens"] == 8 + 4 + 8


def test_eviction_frees_only_unused_pages_least_recently_used_first():
  a = PageAllocator(7)  # 6 usable pages
  cache = PagedPrefixCache(a, page_size=2)
  p1, p2, p3 = a.alloc(2), a.alloc(2), a.alloc(2)
  cache.insert([1, 1, 1, 1], p1)
  cache.insert([2, 2, 2, 2], p2)
  cache.insert([3, 3, 3, 3], p3)
  a.unref(p1 + p3)  # sequences 1 and 3 end; sequence 2 still runs
  a.unref(cache.match([1, 1])[1])  # a lookup (its reference returned) makes [1] recent
  assert a.free == 0
  assert cache.evict(2) == 2 and cache.match([3, 3])[0] == 0  # [3] was older than [1]
  assert cache.evict(10) == 2  # [1] goes; [2] is in use and stays
  assert cache.match([2, 2, 2, 2])[0] == 4
  cache.clear()
  assert cache.pages == 0


def test_capacity_bounds_the_tree():
  a = PageAllocator(64)
  cache = PagedPrefixCache(a, page_size=2, capacity_pages=4)
  for i in range(5):
    pages = a.alloc(2)
    cache.insert([i] * 4, pages)
    a.unref(pages)
  assert cache.pages <= 4 and a.free == 63 - cache.pages


def test_a_split_far_into_an_edge_keeps_each_sequence_on_its_own_pages():
  # [1, 2, 3, 4] then [1, 2, 4, 9]: the second splits the first's edge after two pages,
  # past its middle; its own pages must hang at position 2, and [1, 2, 3, 4, 9] must not
  # find its 9's page (which holds token 9 at position 3 after [1, 2, 4]).
  a = PageAllocator(64)
  cache = PagedPrefixCache(a, page_size=1)
  pa, pb, pc = a.alloc(3), a.alloc(4), a.alloc(4)
  cache.insert([1, 2, 3], pa)
  cache.insert([1, 2, 3, 4], pb)
  cache.insert([1, 2, 4, 9], pc)
  n, got = cache.match([1, 2, 3, 4, 9, 5])
  assert n == 4 and got == pa + pb[3:]
  n, got = cache.match([1, 2, 4, 9, 7])
  assert n == 4 and got == pa[:2] + pc[2:]


@pytest.mark.parametrize("seed", range(40))
def test_matched_pages_hold_the_querys_own_prefix(seed):
  """Random traffic of shared prefixes: each page notes the tokens its KV was computed
  after; every match returns pages of exactly the query's prefix, and every page's
  reference count is the tree's listings plus the running sequences'."""
  import random
  rnd = random.Random(seed)
  P = rnd.choice([1, 2, 3])
  a = PageAllocator(rnd.choice([40, 200]))
  cache = PagedPrefixCache(a, P, capacity_pages=rnd.choice([None, 12]))
  holds: dict[int, tuple] = {}  # page -> the prefix (through this page) its KV is of
  running: list[tuple[tuple, list]] = []
  for _ in range(300):
    if rnd.random() < 0.6:
      base = rnd.choice(running)[0] if running and rnd.random() < 0.7 else ()
      seq = base[:rnd.randint(0, len(base))] + tuple(rnd.choice([1, 2, 3])
                                                     for _ in range(rnd.randint(1, 10)))
      n, got = cache.match(seq, max_length=len(seq) - 1)
      assert [holds[p] for p in got] == [seq[:(j + 1) * P] for j in range(len(got))]
      need = -(-len(seq) // P) - len(got)
      cache.evict(max(0, need - a.free))
      try:
        new = a.alloc(need)
      except OutOfPages:
        a.unref(got)
        continue
      for j, p in enumerate(new, start=len(got)):
        holds[p] = seq[:(j + 1) * P]
      running.append((seq, got + new))
      if rnd.random() < 0.5:
        cache.insert(seq, got + new)
    elif running:
      seq, pages = running.pop(rnd.randrange(len(running)))
      if rnd.random() < 0.7:
        cache.insert(seq, pages)
      a.unref(pages)
    listed = [0] * a.num_pages
    stack = [cache._root]
    while stack:
      node = stack.pop()
      stack.extend(node.children.values())
      for p in node.pages:
        listed[p] += 1
    for _, pages in running:
      for p in pages:
        listed[p] += 1
    assert listed[1:] == list(a.refs[1:])


def test_eviction_frees_the_unused_end_of_a_leaf_a_sequence_uses_the_start_of():
  a = PageAllocator(64)
  cache = PagedPrefixCache(a, page_size=1)
  # A running sequence holds [1, 2]; two finished continuations of it are not in use.
  held = a.alloc(2)
  cache.insert([1, 2], held)
  for tail in ([3, 3], [4, 4]):
    pages = a.alloc(2)
    cache.insert([1, 2] + tail, held + pages)
    a.unref(pages)
  # The first continuation's removal merges [1, 2] with the second: its unused end goes
  # too (a merged leaf whose start was in use kept its end for good).
  assert cache.evict(100) == 4 and cache.match([1, 2, 4])[0] == 2
  # A leaf whose first pages a sequence matched: the pages after them go, its stay.
  b = PageAllocator(64)
  cache = PagedPrefixCache(b, page_size=1)
  long = b.alloc(6)
  cache.insert([7] * 6, long)
  b.unref(long)
  n, got = cache.match([7, 7, 7, 9])
  assert n == 3 and cache.evict(100) == 3 and cache.match([7] * 6)[0] == 3
  # A protected leaf stays whole when the removal of its sibling merges its parent in.
  c = PageAllocator(64)
  cache = PagedPrefixCache(c, page_size=1)
  long, other = c.alloc(6), c.alloc(2)
  cache.insert([7] * 6, long)
  cache.insert([7, 8], long[:1] + other[1:])
  c.unref(long + other)
  cache.evict(100, protect=cache._root.children[(7,)].children[(7,)])
  assert cache.match([7] * 6)[0] == 6 and cache.match([7, 8])[0] == 1


def test_a_free_page_cannot_be_referenced_and_page_counts_stay_exact():
  """A reference taken on a free page (one the free list hands out again) would let two
  sequences write one page's KV: refused, and the page stays free. The tree's page count
  is the pages it lists, through partial and whole evictions, so its capacity bound and
  stats hold."""
  a = PageAllocator(8)
  pages = a.alloc(2)
  a.unref(pages[1:])
  with pytest.raises(ValueError, match="not allocated"):
    a.ref(pages[1:])
  with pytest.raises(ValueError, match="not allocated"):
    a.ref([7])
  assert a.free == 6 and list(a.refs) == [0, 1, 0, 0, 0, 0, 0, 0]
  assert sorted(a.alloc(6)) == [2, 3, 4, 5, 6, 7]

  def listed(cache):
    stack, n = [cache._root], 0
    while stack:
      node = stack.pop()
      stack.extend(node.children.values())
      n += len(node.pages)
    return n

  b = PageAllocator(64)
  cache = PagedPrefixCache(b, page_size=1)
  long = b.alloc(6)
  cache.insert([7] * 6, long)
  b.unref(long)
  n, got = cache.match([7, 7, 7, 9])  # a sequence holds the first three
  assert cache.evict(100) == 3 and cache.pages == listed(cache) == 3
  other = b.alloc(2)
  cache.insert([7, 8], got[:1] + other[1:])
  b.unref(other + got)
  assert cache.pages == listed(cache) == 4
  assert cache.evict(1) == 1 and cache.pages == listed(cache) == 3
  assert cache.evict(100) == 3 and cache.pages == listed(cache) == 0 and b.free == 63
  assert cache.stats()["evicted_pages"] == 7


def test_clear_drops_the_trees_reference_once_per_page_a_sequence_keeps_its_own():
  """After a weight update the tree is cleared: each page it listed loses the tree's one
  reference (an edge shared by two branches too), so a running sequence's pages stay
  allocated to it and are not handed out again while it writes them."""
  a = PageAllocator(16)
  cache = PagedPrefixCache(a, page_size=1)
  running = a.alloc(3)
  cache.insert([1, 2, 3], running)
  done = a.alloc(3)
  cache.insert([1, 2, 4], running[:2] + done[2:])
  a.unref(done)  # (its first two pages were never the tree's: freed now)
  cache.insert([5, 6], a.alloc(2))
  cache.clear()
  assert cache.pages == 0 and cache.match([1, 2, 3])[0] == 0
  assert [int(a.refs[p]) for p in running] == [1, 1, 1] and a.free == 15 - 3 - 2
  fresh = a.alloc(a.free)
  assert not set(fresh) & set(running)

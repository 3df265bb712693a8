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

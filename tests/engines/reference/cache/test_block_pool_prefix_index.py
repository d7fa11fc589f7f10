"""Prefix index on its own: leaves-first eviction even against LRU order, and clear()."""

from __future__ import annotations

import pytest

from prfaas.engines.reference.cache.prefix_index import PrefixIndex


def chain(index: PrefixIndex, blocks: list[int]) -> None:
    """Cache `blocks` as one chain with hashes 100 + block id."""
    parent = None
    for block in blocks:
        index.insert(block, 100 + block, parent)
        parent = 100 + block


def test_eviction_skips_a_parent_that_still_has_a_cached_child() -> None:
    """An LRU-older parent is not evicted while its child is cached: the child goes first."""
    index = PrefixIndex(4)
    chain(index, [0, 1, 2])
    for block in (0, 1, 2):  # parent first: the opposite of the pool's release order
        index.unpin(block)
    assert index.evict() == (2, 102)
    assert index.evict() == (1, 101)
    assert index.evict() == (0, 100)
    assert len(index) == 0 and index.lookup(100) is None


def test_pinned_blocks_are_never_evicted() -> None:
    """Only unpinned blocks are candidates; with none, evict raises LookupError."""
    index = PrefixIndex(2)
    chain(index, [0, 1])
    index.unpin(1)
    index.unpin(0)
    index.pin(1)
    with pytest.raises(LookupError):
        index.evict()  # 0 is unpinned but has a cached child


def test_clear_returns_the_unpinned_blocks_in_lru_order() -> None:
    """clear() forgets every block and hands back the evictable ones, oldest first."""
    index = PrefixIndex(3)
    chain(index, [2, 0, 1])
    index.unpin(1)
    index.unpin(2)
    assert index.clear() == [1, 2]
    assert len(index) == 0 and index.num_evictable == 0
    index.check([0, 0, 0])

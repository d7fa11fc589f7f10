"""The simulated prefix cache: full blocks only, leaf-first LRU eviction, and KV events that
the gateway's real KV index turns into the same longest-prefix answers."""

from __future__ import annotations

from prfaas.common.hashing import hash_blocks
from prfaas.gateway.kv_index import KVIndexManager
from prfaas.protocol.kv_events import BlockRemoved, BlockStored
from prfaas.sim.cache import SimPrefixCache

BS = 4


def _prompt(*blocks: int, tail: int = 0) -> tuple[int, ...]:
    """Blocks of BS equal ids (block b is [b]*BS) plus `tail` extra ids."""
    out = [b for b in blocks for _ in range(BS)]
    return tuple(out + [999] * tail)


def test_only_full_blocks_are_keys_and_match_counts_leading_hits() -> None:
    """A partial tail is never cached; match stops at the first missing block."""
    cache = SimPrefixCache(BS, None)
    ids = _prompt(1, 2, tail=3)
    assert len(cache.keys(ids)) == 2
    cache.store(ids, cache.keys(ids))
    other = _prompt(1, 2, 3)
    assert cache.match(cache.keys(other)) == 2
    assert cache.match(cache.keys(_prompt(2, 1))) == 0


def test_store_emits_only_new_blocks_chained_to_the_cached_parent() -> None:
    """A second prompt sharing one block stores its two new blocks with that block as parent."""
    cache = SimPrefixCache(BS, None)
    first = _prompt(1, 2)
    k1 = cache.keys(first)
    (stored,) = cache.store(first, k1)
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash is None and stored.block_hashes == tuple(k1)
    second = _prompt(1, 5, 6)
    k2 = cache.keys(second)
    (stored2,) = cache.store(second, k2)
    assert isinstance(stored2, BlockStored)
    assert stored2.parent_block_hash == k1[0]
    assert stored2.block_hashes == tuple(k2[1:])
    assert stored2.token_ids == second[BS:]
    assert cache.store(second, k2) == []  # nothing new, nothing evicted


def test_eviction_takes_leaves_before_their_prefixes() -> None:
    """Over capacity, the oldest leaves go first and every cached block keeps its parent."""
    cache = SimPrefixCache(BS, 3)
    a, b = _prompt(1, 2), _prompt(1, 3)
    cache.store(a, cache.keys(a))
    events = cache.store(b, cache.keys(b))
    assert len(cache) == 3
    events = cache.store(_prompt(4), cache.keys(_prompt(4)))
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved((cache.keys(a)[1],))]  # a's leaf, not the shared root
    cache.check_integrity()
    assert cache.match(cache.keys(b)) == 2


def test_events_feed_the_real_index_to_the_same_prefix_lengths() -> None:
    """The index, fed only by the cache's events, reports exactly the cache's prefix hits."""
    cache = SimPrefixCache(BS, 5)
    index = KVIndexManager(block_size=BS)
    prompts = [_prompt(1, 2, 3), _prompt(1, 2, 7), _prompt(8, 9), _prompt(1, 5, 6, 7)]
    for ids in prompts:
        index.apply("p0", cache.store(ids, cache.keys(ids)))
        for probe in prompts:
            hit = cache.match(cache.keys(probe)) * BS
            assert index.longest_prefix(hash_blocks(probe, BS)).get("p0", 0) == hit
    cache.check_integrity()

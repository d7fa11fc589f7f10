"""Hybrid prefix cache pool: exact block ids, free-list and LRU order after each step."""

from __future__ import annotations

import pytest

from prfaas.common.hashing import hash_blocks
from prfaas.engines.reference.cache.block_pool import (
    BlockPool,
    BlockPoolConfig,
    OutOfKVCapacity,
    PrefixMatch,
    StaleMatch,
)
from prfaas.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    StatesRemoved,
    StatesStored,
)

BS = 4


def toks(n: int, start: int = 0) -> list[int]:
    """`n` distinct token ids from `start`."""
    return list(range(start, start + n))


def make_pool(num_blocks: int = 8, slots: int = 4) -> BlockPool:
    return BlockPool(BlockPoolConfig(num_blocks=num_blocks, block_size=BS, num_state_slots=slots))


def match(pool: BlockPool, prompt: list[int]) -> PrefixMatch:
    """The engine's lookup: hashes of all but the last token, so one token is computed."""
    return pool.match_prefix(hash_blocks(prompt[:-1], BS))


def run_prefill(pool: BlockPool, rid: str, prompt: list[int], extra: int = 0) -> tuple[int, ...]:
    """Allocate with the hybrid match and index every full block of the prompt."""
    table = pool.allocate(rid, len(prompt) + extra, match(pool, prompt))
    pool.cache_full_blocks(rid, prompt)
    pool.check_integrity()
    return table


def snapshot(pool: BlockPool) -> tuple[object, ...]:
    return (pool.free_block_ids(), pool.evictable_block_ids(), pool.stats())


@pytest.mark.parametrize(
    ("kwargs", "bad"),
    [({"num_blocks": 0}, "0"), ({"num_blocks": 4, "block_size": -1}, "-1"),
     ({"num_blocks": 4, "num_state_slots": -2}, "-2"), ({"num_blocks": 2.5}, "2.5"),
     ({"num_blocks": 4, "block_size": True}, "True")],
)  # fmt: skip
def test_config_rejects_bad_sizes_naming_the_value(kwargs: dict[str, int], bad: str) -> None:
    """Invalid sizes fail at construction with the bad value in the message."""
    with pytest.raises(ValueError, match=bad):
        BlockPoolConfig(**kwargs)


def test_fresh_allocation_takes_lowest_ids_in_order() -> None:
    """A cold pool hands out blocks 0, 1, 2, ... and the free list keeps the rest in order."""
    pool = make_pool()
    assert pool.allocate("a", 10) == (0, 1, 2)
    assert pool.free_block_ids() == (3, 4, 5, 6, 7)
    assert pool.block_table("a") == (0, 1, 2)
    pool.check_integrity()


def test_private_blocks_return_to_free_list_tail_first() -> None:
    """Uncommitted blocks go back to the free list, last block first (vLLM order)."""
    pool = make_pool()
    pool.allocate("a", 10)
    pool.free("a")
    assert pool.free_block_ids() == (3, 4, 5, 6, 7, 2, 1, 0)
    assert pool.evictable_block_ids() == ()
    pool.check_integrity()


def test_committed_blocks_become_evictable_deepest_first() -> None:
    """Full blocks enter the index (one BlockStored); on free they are LRU, deepest oldest."""
    pool = make_pool()
    prompt = toks(9)
    run_prefill(pool, "a", prompt)
    h = hash_blocks(prompt, BS)
    assert pool.num_cached_blocks("a") == 2
    assert pool.take_events() == [BlockStored(tuple(h), None, tuple(prompt[:8]), BS)]
    pool.free("a")
    assert pool.free_block_ids() == (3, 4, 5, 6, 7, 2)
    assert pool.evictable_block_ids() == (1, 0)
    pool.check_integrity()


def test_incremental_commits_chain_their_events() -> None:
    """A later commit's BlockStored names the previous block as parent; re-hashing agrees."""
    pool = make_pool()
    prompt = toks(12)
    pool.allocate("a", 12)
    assert pool.cache_full_blocks("a", prompt[:5]) == 1
    assert pool.cache_full_blocks("a", prompt[:5]) == 0  # idempotent
    assert pool.cache_full_blocks("a", prompt) == 2
    h = hash_blocks(prompt, BS)
    assert pool.take_events() == [
        BlockStored((h[0],), None, tuple(prompt[:4]), BS),
        BlockStored((h[1], h[2]), h[0], tuple(prompt[4:12]), BS),
    ]


def test_block_only_hit_shares_blocks_by_reference() -> None:
    """A second request reuses cached blocks (same ids); they outlive the first request."""
    pool = make_pool()
    run_prefill(pool, "a", toks(9))
    pool.free("a")
    m = match(pool, [*toks(8), 100, 101]).without_state()
    assert m.block_ids == (0, 1) and m.state_slot is None and m.num_tokens == 8
    assert pool.allocate("b", 10, m) == (0, 1, 3)
    assert pool.evictable_block_ids() == ()
    pool.check_integrity()
    assert pool.allocate("c", 10, match(pool, [*toks(8), 200, 201]).without_state()) == (0, 1, 4)
    pool.free("b")
    assert pool.evictable_block_ids() == ()  # c still holds 0 and 1
    pool.free("c")
    assert pool.evictable_block_ids() == (1, 0)
    pool.check_integrity()


def test_hybrid_match_needs_a_state_snapshot_at_its_end() -> None:
    """The usable hybrid prefix is the longest cached run ending at a saved state."""
    pool = make_pool()
    prompt = toks(13)
    run_prefill(pool, "a", prompt)
    slot = pool.save_state("a", 8)
    assert slot == 0
    pool.free("a")
    m = match(pool, [*prompt, 50])
    assert m.block_only_ids == (0, 1, 2)
    assert m.block_ids == (0, 1) and m.state_slot == 0 and m.num_tokens == 8
    assert m.num_block_only_tokens == 12


def test_state_is_reusable_only_at_its_exact_length() -> None:
    """A prompt diverging before the snapshot's length gets no hybrid reuse at all."""
    pool = make_pool()
    run_prefill(pool, "a", toks(9))
    pool.save_state("a", 8)
    pool.free("a")
    m = match(pool, [*toks(4), 99, 98, 97, 96, 95])
    assert m.block_only_ids == (0,)
    assert m.block_ids == () and m.state_slot is None and m.num_tokens == 0


def test_match_never_covers_the_last_prompt_token() -> None:
    """With the last token excluded, a block-aligned fully cached prompt still computes one."""
    pool = make_pool()
    prompt = toks(8)
    run_prefill(pool, "a", prompt)
    pool.save_state("a", 4)
    pool.save_state("a", 8)
    pool.free("a")
    m = match(pool, prompt)
    assert m.block_only_ids == (0,) and m.block_ids == (0,) and m.num_tokens == 4


def test_matched_state_slot_is_pinned_until_free() -> None:
    """A request's matched snapshot cannot be evicted while the request runs."""
    pool = make_pool(slots=1)
    run_prefill(pool, "a", toks(9))
    assert pool.save_state("a", 8) == 0
    pool.free("a")
    run_prefill(pool, "b", [*toks(8), 7])
    assert pool.block_table("b")[:2] == (0, 1)
    run_prefill(pool, "c", toks(5, start=200))
    assert pool.save_state("c", 4) is None  # b pins the only slot
    pool.free("b")
    assert pool.save_state("c", 4) == 0  # now the unpinned snapshot gives way
    assert match(pool, [*toks(8), 7]).state_slot is None
    pool.check_integrity()


def test_eviction_is_lru_and_reports_removed_hashes() -> None:
    """Allocation past the free list evicts the least recently used leaves first."""
    pool = make_pool(num_blocks=6)
    a, b = toks(9), toks(9, start=100)
    run_prefill(pool, "a", a)
    run_prefill(pool, "b", b)
    pool.free("a")
    pool.free("b")
    assert pool.free_block_ids() == (2, 5)
    assert pool.evictable_block_ids() == (1, 0, 4, 3)
    pool.take_events()
    assert pool.allocate("c", 16) == (2, 5, 1, 0)
    ha = hash_blocks(a, BS)
    assert pool.take_events() == [BlockRemoved((ha[1], ha[0]))]
    assert pool.evictable_block_ids() == (4, 3)
    assert not pool.is_cached(ha[0]) and pool.is_cached(hash_blocks(b, BS)[0])
    pool.check_integrity()


def test_eviction_takes_the_leaf_so_the_chain_keeps_no_hole() -> None:
    """Evicting one block of a chain removes its deepest block; the rest still matches."""
    pool = make_pool(num_blocks=4)
    prompt = toks(13)
    run_prefill(pool, "a", prompt)
    pool.save_state("a", 4)
    pool.save_state("a", 12)
    pool.free("a")
    assert pool.allocate("x", 4) == (3,)  # the free block first
    assert pool.allocate("y", 4) == (2,)  # then the deepest cached block
    m = match(pool, [*prompt, 0])
    assert m.block_only_ids == (0, 1)
    assert m.block_ids == (0,)  # the snapshot at 12 went with its block
    pool.check_integrity()


def test_eviction_drops_the_snapshot_of_an_evicted_block() -> None:
    """A state snapshot disappears with the block whose hash keys it."""
    pool = make_pool(num_blocks=2, slots=2)
    run_prefill(pool, "a", toks(5))
    assert pool.save_state("a", 4) == 0
    pool.free("a")
    assert pool.stats().held_state_slots == 1
    pool.allocate("b", 8)
    assert pool.stats().held_state_slots == 0
    pool.check_integrity()


def test_exhaustion_raises_and_leaves_the_pool_unchanged() -> None:
    """OutOfKVCapacity names requested vs available; nothing is allocated or evicted."""
    pool = make_pool(num_blocks=4)
    run_prefill(pool, "a", toks(9))
    pool.free("a")
    run_prefill(pool, "b", toks(4, start=50))
    pool.take_events()
    before = snapshot(pool)
    assert pool.can_allocate(3) and not pool.can_allocate(4)
    with pytest.raises(OutOfKVCapacity, match="requested 4 blocks, 3 available") as err:
        pool.allocate("c", 13)
    assert (err.value.requested, err.value.available) == (4, 3)
    with pytest.raises(OutOfKVCapacity):
        pool.reserve("b", 20)
    assert snapshot(pool) == before and pool.take_events() == []
    assert not pool.has_request("c") and pool.block_table("b") == (3,)
    pool.check_integrity()


def test_capacity_check_does_not_count_the_match_as_evictable() -> None:
    """Blocks the request itself reuses cannot also be evicted to make room for it."""
    pool = make_pool(num_blocks=4)
    prompt = toks(9)
    run_prefill(pool, "a", prompt)
    pool.save_state("a", 8)
    pool.free("a")
    m = match(pool, prompt)
    with pytest.raises(OutOfKVCapacity, match="requested 3 blocks, 2 available"):
        pool.allocate("b", 20, m)
    assert pool.allocate("b", 16, m) == (0, 1, 3, 2)
    pool.check_integrity()


def test_reserve_grows_the_table_for_decode() -> None:
    """reserve adds only the blocks needed to hold the new token count."""
    pool = make_pool()
    pool.allocate("a", 4)
    assert pool.reserve("a", 4) == ()
    assert pool.reserve("a", 5) == (1,)
    assert pool.reserve("a", 13) == (2, 3)
    assert pool.block_table("a") == (0, 1, 2, 3)
    pool.check_integrity()


def test_transfer_blocks_are_never_indexed_and_freed_with_the_request() -> None:
    """Transfer-cache blocks hold a received tail: no index entry, no event, no snapshot."""
    pool = make_pool()
    prompt = toks(10)
    assert pool.allocate("t", 10, transfer=True) == (0, 1, 2)
    assert pool.cache_full_blocks("t", prompt) == 0
    assert pool.save_state("t", 8) is None
    pool.free("t")
    assert pool.take_events() == []
    assert pool.evictable_block_ids() == () and pool.stats().cached_blocks == 0
    assert pool.free_block_ids() == (3, 4, 5, 6, 7, 2, 1, 0)


def test_transfer_after_a_local_prefix_keeps_the_prefix_shared() -> None:
    """A decode-side request reuses its local cached prefix and receives only the tail."""
    pool = make_pool()
    prompt = toks(13)
    run_prefill(pool, "local", prompt[:9])
    pool.free("local")
    m = match(pool, prompt).without_state()
    assert pool.allocate("t", 14, m, transfer=True) == (0, 1, 3, 4)
    assert pool.cache_full_blocks("t", prompt) == 0
    pool.free("t")
    assert pool.evictable_block_ids() == (1, 0)
    assert pool.free_block_ids()[-2:] == (4, 3)
    pool.check_integrity()


def test_duplicate_content_is_adopted_and_the_chain_goes_on() -> None:
    """Two requests computing the same blocks: the second adopts the first's cached copies
    (its own go back to the free list at once) and indexes its blocks past them, so a later
    turn of either conversation hits its whole chain."""
    pool = make_pool()
    prompt = toks(9)
    pool.allocate("a", 9)  # blocks 0, 1, 2
    pool.allocate("b", 13)  # blocks 3, 4, 5, 6
    assert pool.cache_full_blocks("a", prompt[:8]) == 2
    pool.take_events()
    longer = [*prompt, 100, 101, 102, 103]
    assert pool.cache_full_blocks("b", longer) == 1  # blocks 0, 1 adopted; its 3rd indexed
    assert pool.block_table("b") == (0, 1, 5, 6)
    assert pool.free_block_ids() == (7, 3, 4)
    h = hash_blocks(longer, BS)
    assert pool.take_events() == [BlockStored((h[2],), h[1], tuple(longer[8:12]), BS)]
    assert pool.save_state("b", 4) is not None  # a state where b adopted a's block
    pool.free("a")
    pool.free("b")
    assert match(pool, [*longer, 7]).block_ids == (0,)  # the state at block 0
    assert match(pool, [*longer, 7]).block_only_ids == (0, 1, 5)
    pool.check_integrity()


def test_kept_states_are_events_for_the_gateway() -> None:
    """A saved snapshot is a `StatesStored`; one evicted to make room a `StatesRemoved`."""
    pool = make_pool(slots=1)
    prompt = toks(8)
    run_prefill(pool, "a", prompt)
    pool.take_events()
    h = hash_blocks(prompt, BS)
    assert pool.save_state("a", 4) is not None
    assert pool.take_events() == [StatesStored((h[0],))]
    assert pool.save_state("a", 4) is None and pool.take_events() == []  # kept already
    assert pool.save_state("a", 8) is not None  # the only slot: the first snapshot goes
    assert pool.take_events() == [StatesRemoved((h[0],)), StatesStored((h[1],))]


def test_stale_match_is_rejected_without_change() -> None:
    """A match whose blocks were evicted meanwhile raises StaleMatch, pool unchanged."""
    pool = make_pool(num_blocks=3)
    prompt = toks(9)
    run_prefill(pool, "a", prompt)
    pool.save_state("a", 8)
    pool.free("a")
    m = match(pool, prompt)
    pool.allocate("x", 12)
    pool.free("x")
    before = snapshot(pool)
    with pytest.raises(StaleMatch):
        pool.allocate("b", 9, m)
    assert snapshot(pool) == before and not pool.has_request("b")


def test_clear_flushes_the_index_but_not_running_requests() -> None:
    """clear() frees unreferenced cache, keeps running requests' blocks (now private)."""
    pool = make_pool()
    run_prefill(pool, "old", toks(5, start=100))
    pool.free("old")
    run_prefill(pool, "a", toks(9))
    assert pool.save_state("a", 8) is not None
    pool.take_events()
    pool.clear()
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.stats().cached_blocks == 0 and pool.stats().held_state_slots == 0
    assert pool.free_block_ids() == (5, 6, 7, 1, 0)
    assert pool.block_table("a") == (2, 3, 4)
    assert pool.cache_full_blocks("a", toks(12)) == 0
    pool.check_integrity()
    pool.free("a")
    assert pool.free_block_ids()[-3:] == (4, 3, 2)
    assert match(pool, toks(9)).block_only_ids == ()
    pool.check_integrity()


def test_request_id_errors_are_clear() -> None:
    """Unknown ids raise KeyError; a second allocate for a live id raises ValueError."""
    pool = make_pool()
    pool.allocate("a", 4)
    with pytest.raises(ValueError, match="'a' already holds blocks"):
        pool.allocate("a", 4)
    for call in (pool.free, pool.block_table):
        with pytest.raises(KeyError, match="'zz'"):
            call("zz")
    with pytest.raises(ValueError, match="multiple of 4, got 6"):
        pool.save_state("a", 6)
    pool.check_integrity()


def test_save_state_returns_nothing_to_write_when_saved_or_unindexed() -> None:
    """A snapshot is written once per hash; unindexed boundaries get none."""
    pool = make_pool()
    pool.allocate("a", 12)
    pool.cache_full_blocks("a", toks(8))
    assert pool.save_state("a", 12) is None  # block 2 not indexed yet
    assert pool.save_state("a", 8) == 0
    assert pool.save_state("a", 8) is None
    assert pool.save_state("a", 4) == 1


def test_clear_with_a_shared_prefix_frees_it_after_the_last_holder() -> None:
    """A prefix two running requests share survives a flush until both have finished."""
    pool = make_pool()
    prompt = toks(9)
    run_prefill(pool, "a", prompt)
    pool.allocate("b", 10, match(pool, [*prompt, 1]).without_state())
    pool.clear()
    pool.free("a")
    assert pool.free_block_ids() == (4, 5, 6, 7, 2)  # blocks 0 and 1 are still b's
    pool.check_integrity()
    pool.free("b")
    assert pool.free_block_ids() == (4, 5, 6, 7, 2, 3, 1, 0)
    pool.check_integrity()

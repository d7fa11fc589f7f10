"""The global KV index: re-hashing of engine events, longest prefix per instance, removal,
clears, rejected events, the memory bound, and hybrid engines' state checkpoints."""

from __future__ import annotations

import random
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from prfaas.common import hashing
from prfaas.common.hashing import hash_blocks, iter_block_hashes
from prfaas.gateway.kv_index import KVIndexManager, batch
from prfaas.gateway.kv_index import manager as manager_module
from prfaas.gateway.kv_index.manager import _salt
from prfaas.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    SaltedBlockStored,
    StatesRemoved,
    StatesStored,
)

BS = 4


def _stored(tokens: list[int], engine_hashes: list[int], parent: int | None = None) -> BlockStored:
    return BlockStored(tuple(engine_hashes), parent, tuple(tokens), BS)


def test_rehashes_engine_events_with_our_hash() -> None:
    """Engine hashes are arbitrary; lookups use our chained hash of the token ids, and a
    chain continued in a second event (parent given by engine hash) resolves."""
    index = KVIndexManager(block_size=BS)
    tokens = list(range(12))
    index.apply("e0", [_stored(tokens[:8], [111, 222]), _stored(tokens[8:], [333], parent=222)])
    ours = hash_blocks([*tokens, 99, 98], BS)
    assert index.longest_prefix(ours) == {"e0": 12}
    assert index.longest_prefix(hash_blocks([5, 5, 5, 5], BS)) == {"e0": 0}


def test_longest_prefix_per_instance() -> None:
    """Each instance reports its own longest chained prefix."""
    index = KVIndexManager(block_size=BS)
    tokens = list(range(16))
    index.apply("a", [_stored(tokens[:4], [1])])
    index.apply("b", [_stored(tokens, [1, 2, 3, 4])])
    assert index.longest_prefix(hash_blocks(tokens, BS)) == {"a": 4, "b": 16}


def test_a_prompt_shorter_than_a_block_matches_nothing() -> None:
    """No block to look up (an empty chain, or a prompt shorter than a block, as the router
    hashes it lazily): every known instance at 0."""
    index = KVIndexManager(block_size=BS)
    index.apply("a", [_stored([1, 2, 3, 4], [1])])
    assert index.longest_prefix([]) == {"a": 0}
    assert index.longest_prefix(iter_block_hashes([1, 2, 3], BS)) == {"a": 0}


def test_lookups_across_more_instances_than_a_word_of_bits() -> None:
    """Instances past the first 64 (holder sets grow a word): an instance known with
    nothing indexed yet (its only event rejected) matches 0, and once it stores, its
    prefix; the others keep theirs."""
    index = KVIndexManager(block_size=BS)
    tokens = list(range(8))
    for i in range(64):
        index.apply(f"e{i}", [_stored(tokens[: 4 + 4 * (i % 2)], [1, 2][: 1 + i % 2])])
    index.apply("late", [_stored(tokens[4:], [9], parent=404)])  # unknown parent: rejected
    found = index.longest_prefix(hash_blocks(tokens, BS))
    assert found == {**{f"e{i}": 4 + 4 * (i % 2) for i in range(64)}, "late": 0}
    index.apply("late", [_stored(tokens, [5, 6])])
    index.apply("later", [_stored(tokens[:4], [7])])
    found = index.longest_prefix(hash_blocks(tokens, BS))
    assert found["late"] == 8 and found["later"] == 4 and found["e63"] == 8
    index.apply("e63", [AllBlocksCleared()])
    found = index.longest_prefix(hash_blocks(tokens, BS))
    assert "e63" not in found and found["e62"] == 4 and found["late"] == 8


def _counting(hashes: Iterator[int], seen: list[int]) -> Iterator[int]:
    for h in hashes:
        seen.append(h)
        yield h


def test_lazy_hashes_stop_soon_after_the_first_uncached_block() -> None:
    """`iter_block_hashes` equals `hash_blocks`; a lookup reads hashes in chunks (it looks
    them up as arrays): none from an empty index, one where the first block is cold, and
    otherwise at most a chunk (64 blocks, or a quarter more) past the first block no
    instance holds."""
    tokens = list(range(40))
    assert list(iter_block_hashes(tokens, BS)) == hash_blocks(tokens, BS)
    index = KVIndexManager(block_size=BS)
    seen: list[int] = []
    assert index.longest_prefix(_counting(iter_block_hashes(tokens, BS), seen)) == {}
    assert seen == []
    index.apply("a", [_stored(tokens[:8], [1, 2])])
    index.apply("b", [_stored(tokens[:12], [1, 2, 3])])
    assert index.longest_prefix(_counting(iter_block_hashes(tokens, BS), seen)) == {
        "a": 8,
        "b": 12,
    }
    assert seen == hash_blocks(tokens, BS)  # 1 then 63 asked: all 10 read
    seen.clear()
    assert index.longest_prefix(_counting(iter_block_hashes([7, *tokens], BS), seen)) == {
        "a": 0,
        "b": 0,
    }
    assert len(seen) == 1
    long = list(range(BS * 1000))
    index.apply("c", [_stored(long[: BS * 500], list(range(1000, 1500)))])
    seen.clear()
    assert index.longest_prefix(_counting(iter_block_hashes(long, BS), seen))["c"] == BS * 500
    assert seen == hash_blocks(long, BS)[: len(seen)]
    assert 501 <= len(seen) <= 500 * 5 // 4 + 64


def test_removed_and_cleared() -> None:
    """BlockRemoved cuts the chain at the removed block; AllBlocksCleared empties one
    instance only."""
    index = KVIndexManager(block_size=BS)
    tokens = list(range(12))
    index.apply("a", [_stored(tokens, [1, 2, 3])])
    index.apply("b", [_stored(tokens, [7, 8, 9])])
    index.apply("a", [BlockRemoved((2,))])
    assert index.longest_prefix(hash_blocks(tokens, BS)) == {"a": 4, "b": 12}
    index.apply("b", [AllBlocksCleared()])
    assert index.longest_prefix(hash_blocks(tokens, BS)) == {"a": 4}
    assert len(index) == 2


def test_rejects_mismatched_block_size_and_unknown_parent() -> None:
    """Events the index cannot re-hash are counted and ignored, never half-applied."""
    index = KVIndexManager(block_size=BS)
    index.apply("a", [BlockStored((1,), None, (1, 2, 3, 4, 5, 6, 7, 8), 8)])
    index.apply("a", [_stored([1, 2, 3, 4], [5], parent=404)])
    assert index.rejected_events == 2 and len(index) == 0


def test_a_store_under_a_lora_adapter_is_rejected(caplog: pytest.LogCaptureFixture) -> None:
    """The index hashes tokens alone: a LoRA adapter's blocks, credited to the same tokens
    without the adapter, would over-report (the engine keys them by the adapter too). So
    they are counted and ignored (logged once), and what chains after them too."""
    index = KVIndexManager(block_size=BS)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    index.apply("a", [BlockStored((1,), None, tuple(tokens[:4]), BS, 3)])
    index.apply("a", [_stored(tokens[4:], [2], parent=1), _stored(tokens[:4], [9])])
    assert index.longest_prefix(hash_blocks(tokens, BS)) == {"a": 4}  # the base model's
    assert index.rejected_events == 2 and len(index) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert sum("LoRA adapter 3" in e for e in errors) == 1, errors


def test_salted_and_plain_stores_go_in_as_one_run() -> None:
    """A flush batches an instance's consecutive stores as one run, salted or not (one
    event per round would cost a whole store pass each)."""
    salted = SaltedBlockStored((1,), None, (1, 2, 3, 4), BS, None, "s")
    plain = _stored([5, 6, 7, 8], [2], parent=1)
    runs = list(manager_module._runs([salted, salted, plain, BlockRemoved((1,)), salted]))
    assert [len(run) for run in runs] == [3, 1, 1]


def test_a_salted_chain_is_credited_only_to_prompts_with_its_salt() -> None:
    """Engines key a request's blocks by its `cache_salt` too: a salted chain's first block
    is re-hashed from `salt_root(salt)`, and what chains after it follows, so only a prompt
    looked up from that root matches it (another salt's or an unsalted one recomputes the
    prefix on the engine, so crediting it would over-report); an unsalted chain of the same
    tokens stays apart."""
    index = KVIndexManager(block_size=BS)
    tokens = list(range(1, 13))
    index.apply("a", [SaltedBlockStored((1,), None, tuple(tokens[:4]), BS, None, "tenant-1")])
    index.apply("a", [_stored(tokens[4:8], [2], parent=1)])  # (the continuation: no salt)
    index.apply("b", [_stored(tokens[:4], [1])])  # unsalted, the same engine hash even

    def cached(salt: str | None) -> dict[str, int]:
        root = None if salt is None else hashing.salt_root(salt)
        return index.longest_prefix(iter_block_hashes(tokens, BS, parent=root))

    assert cached("tenant-1") == {"a": 8, "b": 0}
    assert cached("tenant-2") == {"a": 0, "b": 0}
    assert cached(None) == {"a": 0, "b": 4}
    assert index.rejected_events == 0


@pytest.mark.parametrize("loops", ["c", "python"])
def test_packed_token_ids_that_are_not_uint32_are_rejected(
    loops: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Token ids left packed (as the feed decodes events) are checked when hashed: an event
    whose ids are not uint32 integers, or whose count does not fit its blocks, is counted
    and ignored (logged once per instance), and the events around it still apply; with the
    C loops and with the Python ones that stand in where they are not built."""
    if loops == "python":
        monkeypatch.setattr(hashing, "_packed_count", hashing._packed_count_py)
        monkeypatch.setattr(hashing, "_unpack_ids", hashing._unpack_ids_py)
        monkeypatch.setattr(manager_module, "chain_stores", batch.chain_stores_python)
    index = KVIndexManager(block_size=BS)
    good = msgspec.Raw(msgspec.msgpack.encode([1, 2, 3, 4]))
    negative = msgspec.Raw(msgspec.msgpack.encode([1, 2, -3, 4]))
    short = msgspec.Raw(msgspec.msgpack.encode([1, 2, 3]))
    text = msgspec.Raw(msgspec.msgpack.encode("1234"))
    mixed = msgspec.Raw(msgspec.msgpack.encode([1, "x", 3, 4]))
    index.apply("a", [BlockStored((9,), None, negative, BS), BlockStored((9,), None, short, BS)])
    index.apply("a", [BlockStored((9,), None, text, BS), BlockStored((7,), None, negative, BS)])
    index.apply("a", [BlockStored((8,), None, mixed, BS), BlockStored((5,), None, good, BS)])
    assert index.longest_prefix(hash_blocks([1, 2, 3, 4], BS)) == {"a": 4}
    assert index.rejected_events == 5 and len(index) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert sum("not a msgpack array of uint32 ids" in e for e in errors) == 1, errors
    assert sum("3 token ids for 1 blocks of 4" in e for e in errors) == 1, errors


def test_a_block_size_mismatch_is_logged_once_per_instance_and_size(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An engine paging in another block size sends it in every event: the error (naming
    both sizes and the fix) is logged once per instance and size, every event counted."""
    index = KVIndexManager(block_size=BS)
    for instance in ("a", "a", "b"):
        index.apply(instance, [BlockStored((1,), None, (1, 2, 3, 4, 5, 6, 7, 8), 8)])
    len(index)  # applies what is buffered
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert index.rejected_events == 3 and len(errors) == 2, errors
    assert "block_size 8" in errors[0] and f"block size {BS}" in errors[0]


def test_memory_bound_forgets_least_recently_used() -> None:
    """At the byte budget (here one bucket of 16 per table) a new block evicts the least
    recently stored or used; a chain stored at once goes from its end, and a block a lookup
    matched outlives one stored after it. The index never over-reports."""
    index = KVIndexManager(block_size=BS, max_index_mb=1e-6)
    tokens = list(range(4 * 20))
    index.apply("a", [_stored(tokens[:48], list(range(1, 13)))])  # 12 blocks
    assert index.longest_prefix(hash_blocks(tokens, BS)) == {"a": 48}  # all 12 used now
    index.apply("a", [_stored(tokens[48:], list(range(13, 21)), parent=12)])  # 8 more
    assert len(index) == 16 and index.evicted_entries == 4
    # the 8 new blocks, stored after the lookup, stay; 4 of the chain's end are gone
    assert index.longest_prefix(hash_blocks(tokens, BS)) == {"a": 32}
    other = list(range(1000, 1000 + 4 * 16))
    index.apply("b", [_stored(other, list(range(100, 116)))])
    assert len(index) == 16
    assert index.longest_prefix(hash_blocks(tokens, BS)) == {"a": 0, "b": 0}
    assert index.longest_prefix(hash_blocks(other, BS)) == {"a": 0, "b": 64}


def _use_times(index: KVIndexManager) -> dict[int, int]:
    """Each indexed block's use time, by our hash."""
    keys = index._blocks._table.keys.reshape(-1)
    taken = keys != 0
    return dict(
        zip(keys[taken].tolist(), index._blocks.column("used")[taken].tolist(), strict=True)
    )


@pytest.mark.parametrize("held_back", [8192, 100])
@pytest.mark.parametrize("budget_mb", [0.01, 64])
@pytest.mark.parametrize("seed", range(3))
def test_use_marks_written_after_the_lookup_are_those_written_at_once(
    seed: int, budget_mb: float, held_back: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup's use marks wait for the next change to the table (a flush, a clear), or
    until `held_back` wait: two indexes given the same events, lookups and clears, one
    writing each lookup's marks at once, hold the same use times, and evict alike under a
    small budget; under a large one, flushes split buckets holding blocks a lookup marked.
    The use clock starts near its top, so it is halved on the way."""
    monkeypatch.setattr(manager_module, "_MAX_TOUCHES", held_back)
    rng = random.Random(seed)
    later, at_once = (KVIndexManager(block_size=BS, max_index_mb=budget_mb) for _ in range(2))
    later._clock = at_once._clock = 2**32 - 3_000
    chains = [list(range(1000 * c, 1000 * c + 4 * rng.randint(1, 60))) for c in range(40)]
    moved_marked = 0  # flushes that split buckets with marks waiting
    for step in range(600):
        choice = rng.random()
        instance = f"e{rng.randrange(3)}"
        chain = rng.choice(chains)
        if choice < 0.25:
            blocks = len(chain) // BS
            event = _stored(chain, [hash((step, b)) & 0xFFFF_FFFF for b in range(blocks)])
            for index in (later, at_once):
                index.apply(instance, [event])
        elif choice < 0.7:
            answers = [index.longest_prefix(hash_blocks(chain, BS)) for index in (later, at_once)]
            assert answers[0] == answers[1]
            at_once._write_touches()
        elif choice < 0.97:
            fresh = list(range(10**6 * (step + 1), 10**6 * (step + 1) + 4 * rng.randint(1, 60)))
            event = _stored(
                fresh, [hash((step, b, 1)) & 0xFFFF_FFFF for b in range(len(fresh) // BS)]
            )
            waiting, buckets = bool(later._touches), later._blocks.buckets
            for index in (later, at_once):
                index.apply(instance, [event])
                len(index)  # applies it
            moved_marked += waiting and later._blocks.buckets > buckets
        else:
            for index in (later, at_once):
                index.clear_instance(instance)
    assert later.evicted_entries == at_once.evicted_entries
    assert later.evicted_entries > 0 if budget_mb < 1 else moved_marked > 0
    assert later._clock < 2**32 - 3_000  # halved on the way
    later._write_touches()
    assert _use_times(later) == _use_times(at_once)


def test_use_marks_waiting_when_the_use_clock_is_halved_are_halved_too() -> None:
    """A lookup that halves the use clock (near its top) first writes the marks waiting, so
    they are halved with every other use time, as marks written at once are."""
    later, at_once = (KVIndexManager(block_size=BS) for _ in range(2))
    first, second = list(range(32)), list(range(100, 132))
    for index in (later, at_once):
        index.apply("a", [_stored(first, list(range(1, 9)))])
        index.apply("b", [_stored(second, list(range(11, 19)))])
        len(index)  # applied
        index._clock = 2**32 - 12
    for chain in (first, second):  # 8 blocks each: the second lookup's ticks halve
        for index in (later, at_once):
            assert index.longest_prefix(hash_blocks(chain, BS))
        at_once._write_touches()
    later._write_touches()
    assert later._clock < 2**31 + 100 and _use_times(later) == _use_times(at_once)


def test_lookup_with_many_blocks() -> None:
    """128K-token chains over 100k+ indexed blocks resolve exactly (timings live in
    benchmarks/gateway.py)."""
    index = KVIndexManager(block_size=64)
    for inst in range(4):
        tokens = [inst * 1_000_000 + i for i in range(64 * 30_000)]
        hashes = list(range(inst * 10**6, inst * 10**6 + 30_000))
        index.apply(f"e{inst}", [BlockStored(tuple(hashes), None, tuple(tokens), 64)])
    assert len(index) == 120_000
    query = hash_blocks([i for i in range(64 * 2048)], 64)
    result = index.longest_prefix(query)
    assert result == {"e0": 64 * 2048, "e1": 0, "e2": 0, "e3": 0}


def test_a_hybrid_instance_matches_only_up_to_its_last_kept_state() -> None:
    """An instance that reports states reuses a prefix only up to a block it kept them
    after. Four blocks cached, states after the second and the fourth: 16 tokens; the
    fourth's state dropped: 8; the second block evicted (its state goes with it): 0; the
    second block and its state stored again: 8. An instance that never reported states
    keeps every cached block; a state for a block the index does not hold is ignored."""
    index = KVIndexManager(block_size=BS)
    tokens = list(range(16))
    prompt = hash_blocks([*tokens, 7, 7, 7, 7], BS)
    index.apply("plain", [_stored(tokens, [1, 2, 3, 4])])
    index.apply("hybrid", [StatesStored((2, 4, 99)), _stored(tokens, [1, 2, 3, 4])])
    assert index.longest_prefix(prompt) == {"plain": 16, "hybrid": 16}
    index.apply("hybrid", [StatesRemoved((4,))])
    assert index.longest_prefix(prompt) == {"plain": 16, "hybrid": 8}
    index.apply("hybrid", [BlockRemoved((2,))])
    assert index.longest_prefix(prompt) == {"plain": 16, "hybrid": 0}
    index.apply("hybrid", [_stored(tokens[4:8], [2], parent=1), StatesStored((2,))])
    assert index.longest_prefix(prompt) == {"plain": 16, "hybrid": 8}
    assert index.longest_prefix(hash_blocks(tokens[:4], BS)) == {"plain": 4, "hybrid": 0}


def test_a_hybrid_instance_cleared_keeps_no_states_until_it_reports_some() -> None:
    """A clear (the engine's `AllBlocksCleared`, or a restart the feed saw) forgets what a
    hybrid instance cached but not that it is hybrid: the blocks it stores next, before it
    reports where it kept states, match nothing (counting them whole would over-report)."""
    index = KVIndexManager(block_size=BS)
    tokens = list(range(8))
    prompt = hash_blocks([*tokens, 7, 7, 7, 7], BS)
    index.apply("hybrid", [_stored(tokens, [1, 2]), StatesStored((2,))])
    assert index.longest_prefix(prompt) == {"hybrid": 8}
    index.apply("hybrid", [AllBlocksCleared(), _stored(tokens, [1, 2])])
    assert index.longest_prefix(prompt) == {"hybrid": 0}
    index.clear_instance("hybrid")
    index.apply("hybrid", [_stored(tokens, [1, 2])])
    assert index.longest_prefix(prompt) == {"hybrid": 0}
    index.apply("hybrid", [StatesStored((1,))])
    assert index.longest_prefix(prompt) == {"hybrid": 4}


def test_an_engine_hash_stored_twice_in_one_batch_names_one_block() -> None:
    """An engine whose hash covers only a page's own tokens may report one hash for two
    different blocks: the first one stored is the block it names (as the oracle keeps it),
    and its removal and a clear leave nothing behind."""
    index = KVIndexManager(block_size=BS)
    index.apply("a", [_stored([1, 2, 3, 4], [7]), _stored([5, 6, 7, 8], [7])])
    assert index.longest_prefix(hash_blocks([1, 2, 3, 4], BS)) == {"a": 4}
    assert index.longest_prefix(hash_blocks([5, 6, 7, 8], BS)) == {"a": 0}
    index.apply("a", [BlockRemoved((7,))])
    assert len(index) == 0
    index.apply("a", [_stored([5, 6, 7, 8], [9]), AllBlocksCleared()])
    assert len(index) == 0 and index.longest_prefix(hash_blocks([5, 6, 7, 8], BS)) == {}


def test_a_salted_key_collision_drops_the_second_pair() -> None:
    """Translations are keyed by engine hash xor a per-instance salt: a second instance's
    hash chosen to collide with the first's key is refused (counted), never half-held,
    whether the two arrive in one flush or the first is in the table already."""
    index = KVIndexManager(block_size=BS)
    index.apply("a", [_stored([1, 2, 3, 4], [1234])])
    index.apply("b", [_stored([9, 9, 9, 9], [5])])  # b gets its member number
    salts = _salt(np.array([0, 1]))
    colliding = int(np.uint64(1234) ^ salts[0] ^ salts[1])
    index.apply("b", [_stored([1, 2, 3, 4], [colliding])])  # in a's batch (one flush)
    assert index.rejected_events == 1
    assert index.longest_prefix(hash_blocks([1, 2, 3, 4], BS)) == {"a": 4, "b": 0}
    index.apply("b", [_stored([1, 2, 3, 4], [colliding])])  # against a's row
    assert index.rejected_events == 2
    index.apply("b", [BlockRemoved((colliding,))])
    assert index.longest_prefix(hash_blocks([1, 2, 3, 4], BS)) == {"a": 4, "b": 0}


def test_holder_sets_are_freed_when_no_block_names_them() -> None:
    """Reference counts follow the blocks: once every block is removed or cleared, no
    holder set but the empty one is left (a leak would grow the sets' table for ever), and
    sets freed are reused."""
    index = KVIndexManager(block_size=BS)
    shared = list(range(8))
    for name, engine in (("a", [1, 2]), ("b", [1, 2]), ("c", [7, 8])):
        index.apply(name, [_stored(shared, engine), _stored([9, 9, 9, 9], [3], parent=2)])
    len(index)
    assert set(index._sets._ids) == {0, 0b111, 0b011}  # {}, {a, b, c}, {a, b} (c's parent
    # 2 is not its own: its last store rejected), and the sets the flush went through freed
    index.apply("a", [BlockRemoved((1, 2, 3))])
    index.apply("b", [AllBlocksCleared()])
    index.clear_instance("c")
    assert len(index) == 0
    assert list(index._sets._ids) == [0] and set(index._sets._refs[1:]) == {0}
    allocated = len(index._sets._members)
    index.apply("a", [_stored(shared, [1, 2])])
    assert len(index) == 2 and list(index._sets._ids) == [0, 0b001]
    assert len(index._sets._members) == len(index._sets._refs) == allocated  # an id reused

"""The KV index against its previous implementation (`kv_index_oracle.py`): random event
streams from a few engines (stores chained to earlier blocks, removals, clears, kept states,
restarts) give the same `longest_prefix` answers where nothing was evicted, and never more
where a small byte budget made the index forget. Half the batches reach the index as the
gateway's feed decodes them (token ids left packed), the oracle always decoded."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas.common.hashing import hash_blocks
from prfaas.gateway.kv_index import KVIndexManager, growing
from prfaas.gateway.kv_index import holder_sets as holder_sets_module
from prfaas.gateway.kv_index import manager as manager_module
from prfaas.gateway.kv_index import table as table_module
from prfaas.gateway.kv_index.batch import chain_stores_python, group_numpy, salted_keys_numpy
from prfaas.gateway.kv_index.walk import walk_numpy
from prfaas.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    StatesRemoved,
    StatesStored,
    decode_batch,
    encode_batch,
)
from tests.gateway.kv_index_oracle import OracleKVIndex

BS = 2
VOCAB = 3  # few distinct tokens: engines share prefixes often


def _streams(seed: int, steps: int) -> tuple[list[tuple[str, list[KVEvent]]], list[list[int]]]:
    """Seeded engine event batches, and the prompts (token lists) they cached. An engine's
    block hash is a function of the prefix it ends (as vLLM's and SGLang's are): a block
    stored again, after a removal or not, comes back under its old hash."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    ids: dict[tuple[str, tuple[int, ...]], int] = {}  # (instance, prefix) -> engine hash
    cached: dict[str, dict[int, list[int]]] = {}  # instance -> engine hash -> prefix tokens
    batches: list[tuple[str, list[KVEvent]]] = []
    for _ in range(steps):
        instance = rng.choice(["a", "b", "c"])
        blocks = cached.setdefault(instance, {})
        events: list[KVEvent] = []
        for _ in range(rng.randint(1, 4)):
            kind = rng.random()
            if kind < 0.55 or not blocks:
                parent = rng.choice([None, *blocks]) if blocks else None
                prefix = [] if parent is None else blocks[parent]
                tokens = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 4) * BS)]
                hashes = []
                for end in range(BS, len(tokens) + 1, BS):
                    chain = (*prefix, *tokens[:end])
                    h = ids.setdefault((instance, chain), len(ids) + 1)
                    hashes.append(h)
                    blocks[h] = list(chain)
                events.append(BlockStored(tuple(hashes), parent, tuple(tokens), BS))
                prompts.append(prefix + tokens + [rng.randrange(VOCAB) for _ in range(BS)])
            elif kind < 0.75:
                gone = rng.sample(list(blocks), k=min(len(blocks), rng.randint(1, 3)))
                events.append(BlockRemoved(tuple(gone)))
                for h in gone:
                    blocks.pop(h, None)
            elif kind < 0.8:
                events.append(AllBlocksCleared())
                blocks.clear()
            elif kind < 0.95:
                kept = rng.sample(list(blocks), k=min(len(blocks), rng.randint(1, 3)))
                events.append(StatesStored((*kept, 10**9 + rng.randrange(9))))
            else:
                events.append(StatesRemoved(tuple(rng.sample(list(blocks), k=1))))
        batches.append((instance, events))
    return batches, prompts


def _compare(seed: int, steps: int, budget_mb: float, equal: bool) -> None:
    batches, prompts = _streams(seed, steps)
    index = KVIndexManager(block_size=BS, max_index_mb=budget_mb)
    oracle = OracleKVIndex(block_size=BS, max_blocks=10**9)
    rng = random.Random(seed)
    for step, (instance, events) in enumerate(batches):
        if rng.random() < 0.03:  # a restart or a lost stretch: the feed clears the instance
            index.clear_instance(instance)
            oracle.clear_instance(instance)
        if rng.random() < 0.5:  # through the wire, as the feed decodes it
            wire = encode_batch(KVEventBatch(0.0, tuple(events)))
            index.apply(instance, decode_batch(wire, packed_ids=True).events)
        else:
            index.apply(instance, events)
        oracle.apply(instance, events)
        if step % 5 == 0 or step == len(batches) - 1:
            for prompt in rng.sample(prompts, k=min(len(prompts), 6)):
                hashes = hash_blocks(prompt, BS)
                got, expected = index.longest_prefix(hashes), oracle.longest_prefix(hashes)
                if equal:
                    assert got == expected, (step, prompt)
                else:
                    assert set(got) <= set(expected)
                    assert all(tokens <= expected[i] for i, tokens in got.items()), (step, prompt)
    if equal:
        assert len(index) == len(oracle)
        assert index.rejected_events == oracle.rejected_events


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_same_answers_as_the_oracle_when_nothing_is_evicted(seed: int) -> None:
    _compare(seed, steps=120, budget_mb=64, equal=True)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_never_more_than_the_oracle_under_a_small_budget(seed: int) -> None:
    """Two buckets of 16 blocks: most of what the engines cache is forgotten."""
    _compare(seed, steps=120, budget_mb=2 * 16 * 36 / 2**20, equal=False)


def _nearly_full(patch: pytest.MonkeyPatch) -> None:
    """Tables split only as far as 97% load, so that inserts meet full bucket pairs (cuckoo
    steps, keys finding no room and the table splitting more) and evictions meet them."""
    patch.setattr(growing, "_MAX_LOAD", 0.97)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_same_answers_as_the_oracle_in_nearly_full_tables(seed: int) -> None:
    with pytest.MonkeyPatch.context() as patch:
        _nearly_full(patch)
        _compare(seed, steps=120, budget_mb=64, equal=True)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_never_more_than_the_oracle_in_nearly_full_tables_at_a_small_budget(
    seed: int,
) -> None:
    with pytest.MonkeyPatch.context() as patch:
        _nearly_full(patch)
        _compare(seed, steps=120, budget_mb=8 * 16 * 36 / 2**20, equal=False)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_without_the_c_operations_the_same_answers(seed: int) -> None:
    """Where the C extensions are not built, table.py's numpy operations, `walk_numpy` and
    batch.py's numpy and Python loops run: the same answers as the oracle, with and without
    evictions."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(table_module, "_native", None)
        patch.setattr(manager_module, "walk", walk_numpy)
        patch.setattr(manager_module, "group", group_numpy)
        patch.setattr(manager_module, "salted_keys", salted_keys_numpy)
        patch.setattr(manager_module, "chain_stores", chain_stores_python)
        patch.setattr(holder_sets_module, "group", group_numpy)
        _compare(seed, steps=120, budget_mb=64, equal=True)
        _compare(seed, steps=120, budget_mb=2 * 16 * 36 / 2**20, equal=False)

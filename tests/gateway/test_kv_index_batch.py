"""A flush's per-key loops in C (`prfaas.gateway.kv_index._batch`) against the numpy and
Python ones in batch.py, and both against what they mean: grouping equal keys in the order
they first occur, salting engine hashes (any int, modulo 2**64) into translation keys, and
re-hashing stored events chained to their parents."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas.common.hashing import hash_blocks
from prfaas.gateway.kv_index import batch
from prfaas.gateway.kv_index.batch import chain_stores_python, group_numpy, salted_keys_numpy
from prfaas.gateway.kv_index.holder_sets import MULTIPLE
from prfaas.gateway.kv_index.manager import _grouped
from prfaas.gateway.kv_index.table import ZERO_STAND_IN
from prfaas.protocol.kv_events import BlockStored

try:
    from prfaas.gateway.kv_index import _batch
except ImportError:  # every test here then fails: the project's setup builds it
    _batch = None  # type: ignore[assignment]

_SALTS = np.array([0, 1, 0xFFFFFFFFFFFFFFFF, 0x9E3779B97F4A7C15], dtype=np.uint64)


def test_the_c_loops_are_what_flushes_run() -> None:
    assert _batch is not None, "prfaas.gateway.kv_index._batch is not built"
    assert batch._native_module is _batch
    assert batch.group is batch._group_native
    assert batch.salted_keys is batch._salted_keys_native
    assert batch.chain_stores is batch._chain_stores_native


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 5), max_size=200))
def test_group_in_c_and_numpy_is_grouping_by_first_occurrence(values: list[int]) -> None:
    keys = np.array(values, dtype=np.uint64)
    got = batch.group(keys)
    want = group_numpy(keys)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == np.int64
        assert a.tolist() == b.tolist()
    first, inverse, last = got
    # what it means, written out
    order: list[int] = []
    for value in values:
        if value not in order:
            order.append(value)
    assert inverse.tolist() == [order.index(v) for v in values]
    assert first.tolist() == [values.index(v) for v in order]
    assert last.tolist() == [len(values) - 1 - values[::-1].index(v) for v in order]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(-(2**63), 2**64 - 1) | st.integers(-3, 3), st.integers(0, 3)),
        max_size=100,
    )
)
def test_salted_keys_in_c_and_numpy(pairs: list[tuple[int, int]]) -> None:
    hashes = [h for h, _ in pairs]
    bits = np.array([b for _, b in pairs], dtype=np.int64)
    got = batch.salted_keys(hashes, bits, _SALTS)
    want = salted_keys_numpy(hashes, bits, _SALTS)
    assert got.dtype == want.dtype == np.uint64
    assert got.tolist() == want.tolist()
    for (h, b), key in zip(pairs, got.tolist(), strict=True):
        salted = (h % 2**64) ^ int(_SALTS[b])
        assert key == (salted or int(ZERO_STAND_IN))  # 0 marks an empty slot: stood in for


def test_a_tuple_of_hashes_is_read_as_a_list() -> None:
    bits = np.zeros(2, dtype=np.int64)
    assert batch.salted_keys((5, 6), bits, _SALTS).tolist() == [5, 6]


def test_numpy_integer_hashes_are_read_as_ints() -> None:
    bits = np.zeros(3, dtype=np.int64)
    hashes = [np.uint64(2**64 - 1), np.int64(-1), 7]
    got = batch.salted_keys(hashes, bits, _SALTS)
    assert got.tolist() == [2**64 - 1, 2**64 - 1, 7]
    assert got.tolist() == salted_keys_numpy(hashes, bits, _SALTS).tolist()


def test_bad_arguments_are_errors_not_crashes() -> None:
    assert _batch is not None
    bits = np.zeros(1, dtype=np.int64)
    out = np.empty(1, dtype=np.uint64)
    with pytest.raises(TypeError, match="not an int"):
        _batch.salted_keys(["1"], bits, _SALTS, out, 7)
    with pytest.raises(IndexError, match="no salt"):
        _batch.salted_keys([1], np.array([4], dtype=np.int64), _SALTS, out, 7)
    with pytest.raises(ValueError, match="as long as"):
        _batch.salted_keys([1, 2], bits, _SALTS, out, 7)
    with pytest.raises(TypeError, match="list or tuple"):
        _batch.salted_keys(iter([1]), bits, _SALTS, out, 7)
    keys = np.arange(4, dtype=np.uint64)
    short = np.empty(3, dtype=np.int64)
    with pytest.raises(ValueError, match="as long as keys"):
        _batch.group(keys, short, np.empty(4, np.int64), np.empty(4, np.int64))
    with pytest.raises(TypeError):
        _batch.group(keys, np.empty(4, np.int64), np.empty(4, np.int64))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.integers(0, 5)), min_size=1, max_size=60))
def test_a_batch_grouped_by_block_names_each_block_s_instances(
    pairs: list[tuple[int, int]],
) -> None:
    """`_grouped`: each distinct block once, in first-occurrence order, with the instance
    that names it, or a mask of all that do (numbered from `MULTIPLE`), and its last
    position."""
    ours = np.array([block for block, _ in pairs], dtype=np.uint64)
    bits = np.array([bit for _, bit in pairs], dtype=np.int64)
    distinct, changes, masks, last = _grouped(ours, bits)
    blocks = list(dict.fromkeys(block for block, _ in pairs))
    assert distinct.tolist() == blocks
    for block, change, end in zip(blocks, changes.tolist(), last.tolist(), strict=True):
        named = {bit for b, bit in pairs if b == block}
        if len(named) == 1:
            assert change == next(iter(named))
        else:
            assert change >= MULTIPLE and masks[change] == sum(1 << bit for bit in named)
        assert end == max(i for i, (b, _) in enumerate(pairs) if b == block)
    assert len(masks) == sum(change >= MULTIPLE for change in changes.tolist())


_BS = 2


def _event(hashes: list[int], parent: int | None, ids: list[int], form: int) -> BlockStored:
    """A store with its ids as the uint32 ids the scan decodes (`IdArray`), as a tuple, or
    as numpy integers in a tuple with its hashes in a list."""
    if form == 0:
        return BlockStored(tuple(hashes), parent, np.array(ids, dtype="<u4").data, _BS)
    if form == 1:
        return BlockStored(tuple(hashes), parent, tuple(ids), _BS)
    numpy_ids = tuple(np.uint32(i) for i in ids)
    return BlockStored(list(hashes), parent, numpy_ids, _BS)  # type: ignore[arg-type]


_stores = st.lists(
    st.tuples(
        st.integers(0, 2),  # member number
        st.lists(st.integers(-2, 5) | st.integers(2**64 - 2, 2**64 + 1), min_size=1, max_size=3),
        st.none() | st.integers(-2, 5) | st.just(2**64 + 1),  # parent engine hash
        st.none() | st.integers(0, 2**64 - 1),  # known start
        st.integers(0, 2),  # ids' form
        st.integers(0, 3),  # ids seed
    ),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(_stores)
def test_chain_stores_in_c_and_python(stores: list[tuple[Any, ...]]) -> None:
    """Random flushes (engine hashes repeating within and across instances, past 2**64 and
    negative, parents stored earlier, later, by another instance or not at all, some given
    a start; ids in each form an event carries them): the C loop and
    the Python one write the same blocks and reject the same events; and each block's hash
    is its event's ids chained from its start, or from the block the first earlier event of
    its instance stored under its parent's engine hash."""
    events, bits, starts = [], [], []
    for bit, hashes, parent, start, form, seed in stores:
        ids = [(seed * 7 + i) % 5 for i in range(_BS * len(hashes))]
        events.append(_event(hashes, parent, ids, form))
        bits.append(bit)
        starts.append(start)
    bit_array = np.array(bits, dtype=np.int64)
    got = batch.chain_stores(events, bit_array, starts, _BS, _SALTS)
    want = chain_stores_python(events, bit_array, starts, _BS, _SALTS)
    assert [a.tolist() for a in got[:3]] == [a.tolist() for a in want[:3]]
    assert got[3] == want[3]
    # what it means, written out
    stored: dict[tuple[int, int], int] = {}
    expected: list[int] = []
    rejected = 0
    for event, bit, start in zip(events, bits, starts, strict=True):
        if start is None and event.parent_block_hash is not None:
            start = stored.get((bit, event.parent_block_hash % 2**64))
            if start is None:
                rejected += 1
                continue
        hashes = hash_blocks([int(i) for i in event.token_ids], _BS, parent=start)
        for engine, ours in zip(event.block_hashes, hashes, strict=True):
            stored.setdefault((bit, engine % 2**64), ours)
        expected += hashes
    assert got[2].tolist() == expected and got[3] == rejected


def test_chain_stores_rejects_what_it_cannot_read() -> None:
    """Ids that are neither ints nor uint32 (bytes, signed ids, a count that does not fill
    the blocks) and hashes that are not ints are errors, in C as in Python."""
    bits = np.zeros(1, dtype=np.int64)
    bad = [
        BlockStored((1,), None, b"\x01\x00\x00\x00\x02\x00\x00\x00", _BS),
        BlockStored((1,), None, np.array([1, 2], dtype=np.int64).data, _BS),
        BlockStored((1,), None, (1, 2, 3), _BS),
        BlockStored((1,), None, (1, -2), _BS),
        BlockStored(("x",), None, (1, 2), _BS),
    ]
    for event in bad:
        for loop in (batch.chain_stores, chain_stores_python):
            with pytest.raises((TypeError, ValueError, OverflowError)):
                loop([event], bits, [None], _BS, _SALTS)
    assert _batch is not None
    with pytest.raises(TypeError, match="lists of one length"):
        _batch.chain_stores([], bits, [None], _BS, _SALTS, bits, bits, bits, 7)
    with pytest.raises(IndexError, match="no salt"):
        batch.chain_stores([_event([1], None, [1, 2], 0)], bits + 9, [None], _BS, _SALTS)
    with pytest.raises(ValueError, match="block_size"):
        batch.chain_stores([_event([1], None, [1, 2], 0)], bits, [None], 1 << 21, _SALTS)
    big_endian = BlockStored((1,), None, np.array([1, 2], dtype=">u4").data, _BS)
    for loop in (batch.chain_stores, chain_stores_python):
        with pytest.raises(TypeError, match="format"):
            loop([big_endian], bits, [None], _BS, _SALTS)

"""A lookup's walk along a chain (`prfaas.gateway.kv_index._walk`) against `walk_numpy`,
which defines it: the same instances left, the same block where each one's match ended,
the same count of blocks held, over random holder sets, chains with runs, and several words
of instances."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas.gateway.kv_index import walk as walk_module
from prfaas.gateway.kv_index.walk import walk_numpy

try:
    from prfaas.gateway.kv_index._walk import walk as walk_c
except ImportError:  # every test here then fails: the project's setup builds it
    walk_c = None  # type: ignore[assignment]


def test_the_c_walk_is_what_lookups_run() -> None:
    assert walk_c is not None, "prfaas.gateway.kv_index._walk is not built"
    assert walk_module.walk is walk_c


@settings(max_examples=300, deadline=None)
@given(
    words=st.integers(1, 3),
    sets=st.integers(1, 12),
    runs=st.lists(st.tuples(st.integers(0, 11), st.integers(1, 5)), min_size=1, max_size=30),
    offset=st.integers(0, 10_000),
    seed=st.integers(0, 2**32 - 1),
)
def test_c_equals_numpy(
    words: int, sets: int, runs: list[tuple[int, int]], offset: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    # dense rows, so that instances drop out a few at a time and chains run long
    bits = rng.integers(0, 2**64, size=(sets, words), dtype=np.uint64)
    bits |= rng.integers(0, 2**64, size=(sets, words), dtype=np.uint64)
    bits[0] = 0  # id 0: the empty set (a block nobody holds)
    holders = np.array([i % sets for i, n in runs for _ in range(n)], dtype=np.uint32)
    alive = rng.integers(0, 2**64, size=words, dtype=np.uint64)
    got_alive, want_alive = alive.copy(), alive.copy()
    got_ends = np.full(64 * words, -1, dtype=np.int64)
    want_ends = got_ends.copy()
    assert walk_c is not None
    got = walk_c(bits, holders, got_alive, got_ends, offset)
    want = walk_numpy(bits, holders, want_alive, want_ends, offset)
    assert got == want
    assert got_alive.tolist() == want_alive.tolist()
    assert got_ends.tolist() == want_ends.tolist()
    # and what it means: each instance alive at the start ends at its first block not held
    for bit in range(64 * words):
        if not (int(alive[bit // 64]) >> (bit % 64)) & 1:
            assert got_ends[bit] == -1
            continue
        holds = [(int(bits[h, bit // 64]) >> (bit % 64)) & 1 for h in holders.tolist()]
        first_gap = holds.index(0) if 0 in holds else None
        assert got_ends[bit] == (-1 if first_gap is None else offset + first_gap)


def test_bad_arguments_raise() -> None:
    assert walk_c is not None
    bits = np.ones((2, 1), dtype=np.uint64)
    ends = np.full(64, -1, dtype=np.int64)
    alive = np.ones(1, dtype=np.uint64)
    with pytest.raises(IndexError, match="holder set 2"):
        walk_c(bits, np.array([1, 2], dtype=np.uint32), alive, ends, 0)
    with pytest.raises(ValueError, match="one int64 per bit"):
        walk_c(bits, np.array([1], dtype=np.uint32), alive, ends[:63], 0)
    with pytest.raises(ValueError):
        walk_c(np.ones(3, dtype=np.uint8), np.array([1], dtype=np.uint32), alive, ends, 0)

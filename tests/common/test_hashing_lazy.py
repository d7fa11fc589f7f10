"""`iter_block_hashes` packs the prompt in growing slices: the hashes equal `hash_blocks`
across slice boundaries, and ids past what a lookup reads are never packed."""

from __future__ import annotations

import random

import numpy as np
import pytest

from prfaas.common.hashing import hash_blocks, iter_block_hashes


@pytest.mark.parametrize("block_size", [1, 3, 64, 5000, 9000])
def test_lazy_hashes_equal_eager_ones(block_size: int) -> None:
    """Lengths around one block, and past several capped slices; list, tuple and numpy."""
    rng = random.Random(block_size)
    for n in (0, block_size - 1, block_size, block_size + 1, 3 * 8192 + 5, 40_000):
        ids = [rng.randrange(2**32) for _ in range(n)]
        eager = hash_blocks(ids, block_size)
        assert list(iter_block_hashes(ids, block_size)) == eager
        assert list(iter_block_hashes(tuple(ids), block_size)) == eager
        assert list(iter_block_hashes(np.array(ids, dtype=np.uint32), block_size)) == eager


def test_ids_past_the_read_blocks_are_not_packed() -> None:
    """An id no uint32 holds, after the first block, fails `hash_blocks` but not a lookup
    that reads only the first block's hash."""
    ids = [5] * 64 + [-1] * 64
    with pytest.raises(OverflowError):
        hash_blocks(ids, 64)
    assert next(iter_block_hashes(ids, 64)) == hash_blocks(ids[:64], 64)[0]

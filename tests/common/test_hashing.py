"""Chained block hashes: only full blocks, chaining makes a block's hash depend on its whole
prefix, and the values are stable (engines and gateway must agree across versions)."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from prfaas.common.hashing import hash_block, hash_blocks, iter_block_hashes, salt_root


def test_only_full_blocks_are_hashed() -> None:
    """A partial tail block never becomes a key."""
    assert len(hash_blocks(list(range(10)), 4)) == 2
    assert hash_blocks(list(range(3)), 4) == []


def test_chaining_depends_on_whole_prefix() -> None:
    """Equal second blocks after different first blocks hash differently."""
    a = hash_blocks([1, 2, 3, 4, 9, 9, 9, 9], 4)
    b = hash_blocks([1, 2, 3, 5, 9, 9, 9, 9], 4)
    assert a[1] != b[1]
    assert a[1] == hash_block(a[0], [9, 9, 9, 9])


def test_definition_is_stable() -> None:
    """xxh3-64 over the parent (8 bytes LE, absent for the root) + uint32 LE token ids."""
    root = xxhash.xxh3_64_intdigest(np.array([1, 2], dtype="<u4").tobytes())
    assert hash_blocks([1, 2], 2) == [root]
    child = xxhash.xxh3_64_intdigest(root.to_bytes(8, "little") + np.array([3, 4], "<u4").tobytes())
    assert hash_blocks([1, 2, 3, 4], 2) == [root, child]
    assert hash_blocks(np.array([1, 2, 3, 4]), 2) == [root, child]


def test_hashes_continue_a_chain_from_parent() -> None:
    """With `parent`, the hashes are the tail of the whole prompt's chain."""
    whole = hash_blocks([1, 2, 3, 4, 5, 6], 2)
    assert hash_blocks([3, 4, 5, 6], 2, parent=whole[0]) == whole[1:]
    assert hash_blocks([3, 4], 2, parent=whole[0]) == [hash_block(whole[0], [3, 4])]


def test_bad_block_size() -> None:
    """A non-positive block size is an error naming the value."""
    with pytest.raises(ValueError, match="got 0"):
        hash_blocks([1], 0)


def test_a_salted_chain_starts_from_its_salts_root() -> None:
    """`salt_root` is xxh3-64 of a tag and the salt (so every component agrees on it), each
    salt's differs, and a lazy lookup from it hashes as `hash_blocks` from that parent."""
    ids = list(range(40))
    root = salt_root("tenant-1")
    assert root == xxhash.xxh3_64_intdigest(b"prfaas-cache-salt\0tenant-1")
    assert len({salt_root(s) for s in ("tenant-1", "tenant-2", "é", "\ud800")}) == 4
    salted = list(iter_block_hashes(ids, 4, parent=root))
    assert salted == hash_blocks(ids, 4, parent=root)
    assert set(salted).isdisjoint(hash_blocks(ids, 4))

"""Chained block hashes over token ids: the one prefix-cache key shared by every component.

A block's hash is xxh3-64 over its parent's hash (8 bytes, little-endian; absent for the
first block) followed by the block's token ids (uint32, little-endian). Equal hashes mean an
equal whole prefix, not just an equal block, so a lookup walks the chain from the start.
Only fully populated blocks are hashed: a partial tail block is never a prefix-cache key.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash


def hash_block(parent: int | None, token_ids: Sequence[int] | np.ndarray) -> int:
    """Hash one block of token ids chained to its parent's hash (None for the first block)."""
    h = xxhash.xxh3_64()
    if parent is not None:
        h.update(parent.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype="<u4").tobytes())
    return h.intdigest()


def hash_blocks(token_ids: Sequence[int] | np.ndarray, block_size: int) -> list[int]:
    """Chained hashes of every fully populated block of `token_ids`, in order.

    Raises:
        ValueError: if `block_size` is not positive.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    tokens = np.asarray(token_ids, dtype="<u4")
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes

"""Chained block hashes over token ids: the one prefix-cache key shared by every component.

A block's hash is xxh3-64 over its parent's hash (8 bytes, little-endian; absent for the
first block) followed by the block's token ids (uint32, little-endian). Equal hashes mean an
equal whole prefix, not just an equal block, so a lookup walks the chain from the start.
Only fully populated blocks are hashed: a partial tail block is never a prefix-cache key.

Speed matters (the gateway hashes every prompt; the simulator hashes ~300M tokens an hour):
Python int sequences are packed with `array.array` (3x faster than numpy for tuples and
lists), hashed one-shot; `hash_blocks` packs a prompt once, `iter_block_hashes` in a few
growing slices, never once per block. Values are bit-identical to the definition above
(tests/common/test_hashing.py pins them).
"""

from __future__ import annotations

import array
import sys
from collections.abc import Iterator, Sequence

import numpy as np
import xxhash

_ARRAY_U32 = "I" if array.array("I").itemsize == 4 else "L"
_PACK_WITH_ARRAY = sys.byteorder == "little" and array.array(_ARRAY_U32).itemsize == 4


def _u32_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """The token ids as uint32 little-endian bytes."""
    if _PACK_WITH_ARRAY and not isinstance(token_ids, np.ndarray):
        try:
            return array.array(_ARRAY_U32, token_ids).tobytes()
        except (TypeError, OverflowError):
            pass  # numpy scalars or out-of-range ids: numpy's conversion decides
    return np.asarray(token_ids, dtype="<u4").tobytes()


def hash_block(parent: int | None, token_ids: Sequence[int] | np.ndarray) -> int:
    """Hash one block of token ids chained to its parent's hash (None for the first block)."""
    data = _u32_bytes(token_ids)
    if parent is not None:
        data = parent.to_bytes(8, "little") + data
    return int(xxhash.xxh3_64_intdigest(data))


def hash_blocks(
    token_ids: Sequence[int] | np.ndarray, block_size: int, *, parent: int | None = None
) -> list[int]:
    """Chained hashes of every fully populated block of `token_ids`, in order (the ids are
    packed once, up front); the first block chains to `parent` (None: a prompt's start).

    Raises:
        ValueError: if `block_size` is not positive.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return list(_chain(_u32_bytes(token_ids), 4 * block_size, parent))


def iter_block_hashes(token_ids: Sequence[int] | np.ndarray, block_size: int) -> Iterator[int]:
    """`hash_blocks`, lazily: a prefix lookup that stops at the first uncached block never
    hashes, nor packs, the rest of the prompt. Ids are packed in slices that double from one
    block up to `_MAX_SLICE_TOKENS` (a few packing calls per prompt, at most one slice packed
    beyond what is read); an id that cannot be packed raises when its slice is reached.

    Raises:
        ValueError: if `block_size` is not positive (at the call, not at the first hash).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return _lazy_chain(token_ids, block_size)


# Largest slice packed at once by `iter_block_hashes`: the per-slice overhead stays ~1% of
# the packing, and a lookup packs at most this many ids it does not hash.
_MAX_SLICE_TOKENS = 8192


def _lazy_chain(token_ids: Sequence[int] | np.ndarray, block_size: int) -> Iterator[int]:
    digest = xxhash.xxh3_64_intdigest
    step = 4 * block_size
    end = len(token_ids) - len(token_ids) % block_size
    max_size = max(block_size, _MAX_SLICE_TOKENS // block_size * block_size)
    parent = None
    start, size = 0, block_size
    while start < end:
        stop = min(start + size, end)
        data = _u32_bytes(token_ids[start:stop])
        for offset in range(0, len(data), step):
            block = data[offset : offset + step]
            parent = digest(block if parent is None else parent.to_bytes(8, "little") + block)
            yield parent
        start, size = stop, min(2 * size, max_size)


def _chain(data: bytes, step: int, parent: int | None) -> Iterator[int]:
    digest = xxhash.xxh3_64_intdigest
    for start in range(0, len(data) - step + 1, step):
        block = data[start : start + step]
        parent = digest(block if parent is None else parent.to_bytes(8, "little") + block)
        yield parent

"""Chained block hashes over token ids: the one prefix-cache key shared by every component.

A block's hash is xxh3-64 over its parent's hash (8 bytes, little-endian; absent for the
first block) followed by the block's token ids (uint32, little-endian). Equal hashes mean an
equal whole prefix, not just an equal block, so a lookup walks the chain from the start.
Only fully populated blocks are hashed: a partial tail block is never a prefix-cache key.
A request whose engine keys its cache by a salt too (`cache_salt`, which vLLM and SGLang
read) chains its first block to `salt_root(salt)` instead, so its chain shares no hash with
another salt's or an unsalted prompt's, as in the engines' caches.

Speed matters (the gateway hashes every prompt; the KV index re-hashes every block engines
report; the simulator hashes ~300M tokens an hour), so the loop over blocks is C
(`_chain_hash.c`: a list's ids read in place, no packing, no per-block Python call; a
128K-token prompt from the tokenizer's list in about 0.6 ms, most of it reading the Python
ints, against about 1.2 ms in Python; from uint32 ids about 0.1 ms). Where that
extension is not built (an interpreter it was not compiled for) the same loop runs in
Python (`_hash_range_py`, which the tests hold the C to): ids packed with `array.array`
(3x faster than numpy for tuples and lists), each block hashed one-shot.
`iter_block_hashes` hashes in a few growing slices, never once per block. Values are
bit-identical to the definition above (tests/common/test_hashing.py pins them).
"""

from __future__ import annotations

import array
import logging
import operator
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import xxhash

Packed = bytes | msgspec.Raw
"""Token ids as a msgpack array's bytes (an event's `PackedIds`)."""

logger = logging.getLogger(__name__)

_ARRAY_U32 = "I" if array.array("I").itemsize == 4 else "L"
_PACK_WITH_ARRAY = sys.byteorder == "little" and array.array(_ARRAY_U32).itemsize == 4
_LITTLE_U32 = sys.byteorder == "little" and array.array("I").itemsize == 4


def hash_block(parent: int | None, token_ids: Sequence[int] | np.ndarray) -> int:
    """Hash one block of token ids chained to its parent's hash (None for the first block).

    Raises:
        ValueError: no ids (a block holds at least one).
    """
    if not len(token_ids):
        raise ValueError("a block holds at least one token id")
    return _hash_range(_ids(token_ids), len(token_ids), parent, 0, 1)[0]


def hash_blocks(
    token_ids: Sequence[int] | np.ndarray, block_size: int, *, parent: int | None = None
) -> list[int]:
    """Chained hashes of every fully populated block of `token_ids`, in order; the first
    block chains to `parent` (None: a prompt's start).

    Raises:
        ValueError: if `block_size` is not positive.
        OverflowError, TypeError: an id that is not an integer in [0, 2**32).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return _hash_range(_ids(token_ids), block_size, parent, 0, len(token_ids) // block_size)


def unpack_ids(packed_ids: Packed) -> bytes:
    """The ids of `packed_ids` (a msgpack array of integers, as engines' KV events carry
    them) as uint32 little-endian bytes, what the hash loops read: the KV index reads what
    engines report without making a Python int of each id.

    Raises:
        ValueError: `packed_ids` not a msgpack array alone (cut short, or followed by other
            bytes).
        OverflowError, TypeError: an id that is not an integer in [0, 2**32).
    """
    return _unpack_ids(packed_ids)


def packed_count(packed_ids: Packed) -> int:
    """How many ids `packed_ids` (a msgpack array) holds, from its header.

    Raises:
        ValueError: `packed_ids` does not start with a msgpack array's header.
    """
    return _packed_count(packed_ids)


def iter_block_hashes(
    token_ids: Sequence[int] | np.ndarray, block_size: int, *, parent: int | None = None
) -> Iterator[int]:
    """`hash_blocks`, lazily: a prefix lookup that stops at the first uncached block never
    hashes the rest of the prompt. Blocks are hashed in slices that double from one block
    up to `_MAX_SLICE_TOKENS` tokens (a few calls per prompt, at most one slice hashed
    beyond what is read); an id that cannot be hashed raises when its slice is reached.

    Raises:
        ValueError: if `block_size` is not positive (at the call, not at the first hash).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return _lazy_chain(token_ids, block_size, _parent(parent))


def salt_root(salt: str) -> int:
    """The hash a salted chain's first block chains to (its `parent`): xxh3-64 of a tag and
    the salt's UTF-8 bytes. Engines that read a request's `cache_salt` key its blocks by the
    salt and the tokens; so does the index, re-hashing a salted store from this root, and
    so does the router, looking a salted prompt up from it."""
    return xxhash.xxh3_64_intdigest(b"prfaas-cache-salt\0" + salt.encode("utf-8", "surrogatepass"))


# Largest slice `iter_block_hashes` hashes at once: a lookup hashes at most this many ids
# it does not read.
_MAX_SLICE_TOKENS = 8192


def _lazy_chain(
    token_ids: Sequence[int] | np.ndarray, block_size: int, parent: int | None
) -> Iterator[int]:
    ids = _ids(token_ids)
    blocks = len(token_ids) // block_size
    max_blocks = max(1, _MAX_SLICE_TOKENS // block_size)
    start, size = 0, 1
    while start < blocks:
        stop = min(start + size, blocks)
        hashes = _hash_range(ids, block_size, parent, start, stop)
        yield from hashes
        parent = hashes[-1]
        start, size = stop, min(2 * size, max_blocks)


def _ids(token_ids: Sequence[int] | np.ndarray) -> Sequence[int] | bytes | memoryview:
    """What the hash loop reads: a list or tuple as it is, a KV event's `IdArray` (uint32
    ids in a memoryview) as it is, anything else (numpy arrays, ranges) as uint32
    little-endian bytes, checked as a list's ids are (TypeError for ids that are not
    integers, OverflowError for ids outside [0, 2**32))."""
    if isinstance(token_ids, list | tuple):
        return token_ids
    if (
        isinstance(token_ids, memoryview)
        and token_ids.format == "I"
        and token_ids.ndim == 1
        and token_ids.c_contiguous
        and _LITTLE_U32
    ):
        return token_ids  # an event's `IdArray`: uint32 ids already
    ids = np.asarray(token_ids)
    if ids.size and ids.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got {ids.dtype}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= 2**32):
        raise OverflowError("a token id does not fit uint32")
    return ids.astype("<u4").tobytes()


def _hash_range_py(
    token_ids: Sequence[int] | bytes, block_size: int, parent: int | None, start: int, stop: int
) -> list[int]:
    """Chained hashes of blocks `start` to `stop` (excluded), the first chained to `parent`:
    `_chain_hash.hash_range`, in Python (the reference the tests hold it to)."""
    parent = _parent(parent)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if isinstance(token_ids, bytes | bytearray | memoryview):  # uint32 ids
        raw = memoryview(token_ids).cast("B")
        if len(raw) % 4:
            raise ValueError("token bytes must be uint32 ids (a multiple of 4)")
        count = len(raw) // 4
    else:
        count = len(token_ids)
    if not 0 <= start <= stop <= count // block_size:
        raise ValueError(f"blocks {start} to {stop} are not within {count} tokens")
    if isinstance(token_ids, bytes | bytearray | memoryview):
        data = bytes(raw[4 * block_size * start : 4 * block_size * stop])
    else:
        data = _u32_bytes(token_ids[block_size * start : block_size * stop])
    digest = xxhash.xxh3_64_intdigest
    step = 4 * block_size
    hashes = []
    for offset in range(0, len(data), step):
        block = data[offset : offset + step]
        parent = digest(block if parent is None else parent.to_bytes(8, "little") + block)
        hashes.append(parent)
    return hashes


def _parent(parent: int | None) -> int | None:
    """The parent hash as an int in [0, 2**64), as the C loop reads it."""
    if parent is None:
        return None
    value = operator.index(parent)
    if not 0 <= value < 2**64:
        raise OverflowError(f"parent hash {value} does not fit uint64")
    return value


def _u32_bytes(token_ids: Sequence[int]) -> bytes:
    """The token ids as uint32 little-endian bytes (OverflowError or TypeError for an id
    that is not an integer in [0, 2**32), as the C loop raises)."""
    if _PACK_WITH_ARRAY:
        try:
            return array.array(_ARRAY_U32, token_ids).tobytes()
        except TypeError:  # an id that is no integer: the path below names the error
            pass
    ids = [operator.index(i) for i in token_ids]
    if any(not 0 <= i < 2**32 for i in ids):
        raise OverflowError("a token id does not fit uint32")
    return np.asarray(ids, dtype="<u4").tobytes()


_PACKED = msgspec.msgpack.Decoder(tuple[int, ...])


def _unpack_ids_py(packed_ids: Packed) -> bytes:
    """`_chain_hash.unpack_ids`, in Python."""
    return _u32_bytes(_decode_packed(packed_ids))


def _packed_count_py(packed_ids: Packed) -> int:
    """`_chain_hash.packed_count`, in Python: the count in the msgpack array's header (a
    fixarray, array 16 or array 32), at most one id per byte after it."""
    data = memoryview(packed_ids).cast("B")
    if len(data) >= 1 and data[0] & 0xF0 == 0x90:
        start, count = 1, data[0] & 0x0F
    elif len(data) >= 3 and data[0] == 0xDC:
        start, count = 3, int.from_bytes(data[1:3], "big")
    elif len(data) >= 5 and data[0] == 0xDD:
        start, count = 5, int.from_bytes(data[1:5], "big")
    else:
        raise ValueError("packed token ids are not a msgpack array")
    if count > len(data) - start:
        raise ValueError("packed token ids end before their count")
    return count


def _decode_packed(packed_ids: Packed) -> tuple[int, ...]:
    """The ids, with the C loop's errors for what is not a msgpack array of integers alone:
    ValueError for another value (its header read by `_packed_count_py`) or one cut short
    or followed by other bytes, TypeError for an id that is not an integer (the range of
    each is `_u32_bytes`'s to check)."""
    _packed_count_py(packed_ids)
    try:
        return _PACKED.decode(packed_ids)
    except msgspec.ValidationError as exc:  # an array's header: an id is no integer
        raise TypeError(f"packed token id is not an integer: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ValueError(f"packed token ids are cut short or followed by bytes: {exc}") from exc


if TYPE_CHECKING:
    HashRange = Callable[[Sequence[int] | bytes, int, int | None, int, int], list[int]]
    UnpackIds = Callable[[Packed], bytes]
    PackedCount = Callable[[Packed], int]


def _native() -> tuple[HashRange, UnpackIds, PackedCount]:
    """The C loops, or the Python ones where the extension is not built (logged once)."""
    try:
        from prfaas.common import _chain_hash

        loops = _chain_hash.hash_range, _chain_hash.unpack_ids, _chain_hash.packed_count
    except (ImportError, AttributeError):  # not built, or built from an older source
        logger.warning(
            "prfaas.common._chain_hash is not built for this interpreter: block hashes are "
            "computed in Python (several times slower; `pip install -e .` builds it)"
        )
        return _hash_range_py, _unpack_ids_py, _packed_count_py
    return loops


_hash_range, _unpack_ids, _packed_count = _native()

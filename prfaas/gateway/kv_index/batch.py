"""A flush's per-key loops over a batch: grouping equal keys, salting engine hashes into
translation keys, and re-hashing the stored events' chains.

They run in C (`_batch.c`) where the extension is built, else in numpy and Python
(`group_numpy`, `salted_keys_numpy`, `chain_stores_python`: what the tests hold the C to).
A flush groups its batch's keys three times and salts its hashes twice; in numpy each is a
sort or a conversion of Python ints that costs 15-20 us for a batch of 256, in C a pass over
the batch. Chaining and re-hashing the stored events was a Python loop of about 8 us an
event of 18 blocks.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from prfaas.common.hashing import hash_blocks
from prfaas.gateway.kv_index.table import I64, U64, ZERO_STAND_IN, as_keys
from prfaas.protocol.kv_events import BlockStored

_MASK = (1 << 64) - 1


def group_numpy(keys: U64) -> tuple[I64, I64, I64]:
    """For equal `keys` (uint64) grouped, numbered in the order of their first occurrence:
    each group's first and last position, and each key's group."""
    distinct, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # groups by first occurrence
    number = np.empty(len(distinct), dtype=np.int64)
    number[order] = np.arange(len(distinct))
    inverse = number[inverse.reshape(-1)]
    last = np.zeros(len(distinct), dtype=np.int64)
    np.maximum.at(last, inverse, np.arange(len(keys)))
    return first[order].astype(np.int64), inverse, last


def salted_keys_numpy(hashes: Sequence[int], bits: I64, salts: U64) -> U64:
    """Each hash (any int, taken modulo 2**64) xor the salt of the member number beside it
    in `bits`, as table keys."""
    try:
        engine = np.asarray(hashes, dtype=np.uint64)
    except OverflowError:  # a negative hash (SGLang's may be signed)
        engine = np.array([h & _MASK for h in hashes], dtype=np.uint64)
    return as_keys(engine.reshape(-1) ^ salts[bits])


def chain_stores_python(
    events: list[BlockStored[Any]],
    bits: I64,
    starts: list[int | None],
    block_size: int,
    salts: U64,
) -> tuple[I64, U64, U64, int]:
    """Our hashes of a flush's stored events' blocks, in order: event k (of the instance
    whose member number is `bits[k]`; its ids a sequence of ints or uint32 ids, filling its
    blocks) chained to `starts[k]` where that is an int, else to the block an earlier event
    of the same instance stored under its `parent_block_hash` (the first such), else to
    nothing where it names no parent; an event whose parent is neither is rejected. Returns
    each block's member number, translation key (`salted_keys`) and our hash, and how many
    events were rejected."""
    chained: dict[tuple[int, int], int] = {}  # (member, engine hash mod 2**64) -> ours
    block_bits: list[int] = []
    engine: list[int] = []
    ours: list[int] = []
    rejected = 0
    for event, bit, start in zip(events, bits.tolist(), starts, strict=True):
        parent = start
        if parent is None and event.parent_block_hash is not None:
            parent = chained.get((bit, event.parent_block_hash & _MASK))
            if parent is None:
                rejected += 1
                continue
        ids = event.token_ids
        if not isinstance(ids, list | tuple):
            view = memoryview(ids)
            little = view.format.startswith("<") or sys.byteorder == "little"
            if view.itemsize != 4 or view.format.lstrip("<=@") != "I" or not little:
                raise TypeError(f"token ids must be a list, a tuple or uint32 ids, not a "
                                f"buffer of format {view.format}")  # fmt: skip
        hashes = hash_blocks(ids, block_size, parent=parent)
        if len(hashes) != len(event.block_hashes) or len(ids) % block_size:
            raise ValueError(f"{len(ids)} token ids for "
                             f"{len(event.block_hashes)} blocks of {block_size}")  # fmt: skip
        for engine_hash, our_hash in zip(event.block_hashes, hashes, strict=True):
            chained.setdefault((bit, engine_hash & _MASK), our_hash)
        block_bits.extend([bit] * len(hashes))
        engine.extend(event.block_hashes)
        ours.extend(hashes)
    block_array = np.array(block_bits, dtype=np.int64)
    keys = salted_keys_numpy(engine, block_array, salts)
    return block_array, keys, np.array(ours, dtype=np.uint64), rejected


def _group_native(keys: U64) -> tuple[I64, I64, I64]:
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    first, inverse, last = np.empty((3, len(keys)), dtype=np.int64)
    count = _native_module.group(keys, first, inverse, last)
    return first[:count], inverse, last[:count]


def _salted_keys_native(hashes: Sequence[int], bits: I64, salts: U64) -> U64:
    keys = np.empty(len(hashes), dtype=np.uint64)
    if not isinstance(hashes, list | tuple):
        hashes = list(hashes)
    bits = np.ascontiguousarray(bits, dtype=np.int64)
    salts = np.ascontiguousarray(salts, dtype=np.uint64)
    _native_module.salted_keys(hashes, bits, salts, keys, int(ZERO_STAND_IN))
    return keys


def _chain_stores_native(
    events: list[BlockStored[Any]],
    bits: I64,
    starts: list[int | None],
    block_size: int,
    salts: U64,
) -> tuple[I64, U64, U64, int]:
    room = sum(len(event.block_hashes) for event in events)
    block_bits = np.empty(room, dtype=np.int64)
    keys, ours = np.empty(room, dtype=np.uint64), np.empty(room, dtype=np.uint64)
    written, rejected = _native_module.chain_stores(
        events,
        np.ascontiguousarray(bits, dtype=np.int64),
        starts,
        block_size,
        np.ascontiguousarray(salts, dtype=np.uint64),
        block_bits,
        keys,
        ours,
        int(ZERO_STAND_IN),
    )
    return block_bits[:written], keys[:written], ours[:written], rejected


def _load() -> ModuleType | None:
    """The C loops, or None where the extension is not built (logged once)."""
    try:
        from prfaas.gateway.kv_index import _batch
    except ImportError:
        logging.getLogger(__name__).warning(
            "prfaas.gateway.kv_index._batch is not built for this interpreter: the KV "
            "index groups and salts its batches in numpy (slower; `pip install -e .` builds it)"
        )
        return None
    return _batch


_native_module: Any = _load()
group = group_numpy if _native_module is None else _group_native
salted_keys = salted_keys_numpy if _native_module is None else _salted_keys_native
chain_stores = chain_stores_python if _native_module is None else _chain_stores_native

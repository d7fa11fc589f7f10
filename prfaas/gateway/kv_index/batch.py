"""A flush's per-key loops over a batch: grouping equal keys, and salting engine hashes
into translation keys.

Both run in C (`_batch.c`) where the extension is built, else in numpy (`group_numpy`,
`salted_keys_numpy`: what the tests hold the C to). A flush groups its batch's keys three
times and salts its hashes twice; in numpy each is a sort or a conversion of Python ints
that costs 15-20 us for a batch of 256, in C a pass over the batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from prfaas.gateway.kv_index.table import I64, U64, ZERO_STAND_IN, as_keys

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


def _group_native(keys: U64) -> tuple[I64, I64, I64]:
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    first, inverse, last = (np.empty(len(keys), dtype=np.int64) for _ in range(3))
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

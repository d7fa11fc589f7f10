"""`GrowingTable`: a `HashTable` that grows a few buckets with each insert, never all at once.

Before each insert the table splits as many buckets as keep it at most `_MAX_LOAD` full
with the new keys in (linear hashing: `HashTable.split`), so the work of growing is spread
over the inserts in proportion to the keys they add (a bucket split per dozen keys), the
memory grows with the keys (no second table, no doubling), and a lookup always searches
one table. Past `_MAX_LOAD` the buckets not split yet in the current round, which draw
keys from twice the hash range of the split ones, fill and need cuckoo steps; at 80% one
insert in five or six takes one.

A key that finds no room (both buckets full, no resident able to move: not seen on the
benchmark's workloads) makes the table split more (`_MORE_PER_MISS` of its buckets) and
try again. Arrays are allocated for a capacity: a small table doubles it by copying, and a
table whose doubled arrays would reach `_RESERVED_FROM_BYTES` reserves, once, its cap's
worth (or the machine's memory where it has none) without committing it, so that a large
table never copies (where the kernel refuses that, it goes on doubling).

`max_buckets` caps growth; a full bucket pair at the cap is the caller's to empty
(`victims`). Slot numbers are valid until the next insert or delete, as in `HashTable`.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from prfaas.gateway.kv_index.table import I64, U64, WAYS, HashTable

_MAX_LOAD = 0.8  # at most this share of the slots taken once an insert's keys are in
_MORE_PER_MISS = 1 / 64  # share of the buckets split more when a key found no room
_RESERVED_FROM_BYTES = 1 << 20  # a table this large reserves its whole capacity at once

Rows = dict[str, npt.NDArray[np.generic]]

_log = logging.getLogger(__name__)


class GrowingTable:
    """uint64 keys -> one row of `columns`, growing by splitting buckets as keys come."""

    def __init__(
        self, columns: Mapping[str, npt.DTypeLike], max_buckets: int = 0, uniform: bool = False
    ) -> None:
        """`max_buckets` caps growth (0: none). `uniform`: see `HashTable`."""
        self.max_buckets = max_buckets
        self._table = HashTable(columns, uniform=uniform)
        self._reserves_whole = True  # False once the kernel refused such a reservation

    @property
    def size(self) -> int:
        return self._table.size

    @property
    def nbytes(self) -> int:
        return self._table.nbytes

    @property
    def buckets(self) -> int:
        return self._table.buckets

    @property
    def slots(self) -> int:
        """The number of slot numbers in use."""
        return self._table.buckets * WAYS

    @property
    def dtypes(self) -> dict[str, np.dtype[Any]]:
        return self._table.dtypes

    def find(self, keys: U64) -> I64:
        """The slot of each key (`as_keys` applied), -1 where absent."""
        return self._table.find(keys)

    def find_values(self, keys: U64, name: str, missing: int) -> tuple[I64, npt.NDArray[Any]]:
        """The slot of each key, and column `name` there (`missing` where absent)."""
        return self._table.find_values(keys, name, missing)

    def column(self, name: str) -> npt.NDArray[Any]:
        """Column `name` as a flat array indexed by slot (a view: writes go to the table)."""
        return self._table.column(name)

    def get(self, name: str, slots: I64) -> npt.NDArray[Any]:
        """Column `name` at `slots` (a copy; what a slot of -1 gives is unspecified)."""
        return self._table.column(name).take(slots, mode="clip")

    def set(self, name: str, slots: I64, values: npt.ArrayLike) -> None:
        """Write column `name` at `slots` (distinct, taken)."""
        self._table.column(name)[slots] = values

    def taken(self, slots: I64) -> npt.NDArray[np.bool_]:
        """Whether each slot holds a key."""
        return self._table.taken(slots)

    def select(self, name: str, value: int) -> I64:
        """Every slot holding a key whose column `name` equals `value`."""
        table = self._table
        slots: I64 = np.flatnonzero((table.column(name) == value) & (table.keys.reshape(-1) != 0))
        return slots

    def insert(self, keys: U64, values: Mapping[str, npt.ArrayLike]) -> tuple[U64, Rows]:
        """Add `keys` (distinct, absent, `as_keys` applied), the buckets that keep the load
        at most `_MAX_LOAD` split first. Returns the keys, with their values, that found no
        room: only at `max_buckets`."""
        rows = {n: np.asarray(v, dtype=self._table.dtypes[n]) for n, v in values.items()}
        needed = math.ceil((self._table.size + len(keys)) / (_MAX_LOAD * WAYS))
        self._grow(needed - self._table.buckets)
        left, rows = self._table.insert(keys, rows)
        while len(left) and not self._capped():
            self._grow(max(1, int(self._table.buckets * _MORE_PER_MISS)))
            left, rows = self._table.insert(left, rows)
        return left, rows

    def delete(self, slots: I64) -> None:
        """Empty `slots` (distinct, taken)."""
        self._table.delete(slots)

    def candidates(self, keys: U64) -> I64:
        """The slots of each key's two buckets (a row each)."""
        return self._table.candidates(keys)

    def victims(self, keys: U64, column: str) -> I64:
        """For each key, the slot with the smallest `column` among its two buckets (the
        one to evict so that the key fits). For keys `insert` handed back."""
        return self._table.victims(keys, column)

    def _capped(self) -> bool:
        return bool(self.max_buckets) and self._table.buckets >= self.max_buckets

    def _grow(self, count: int) -> None:
        """Split `count` more buckets (fewer at the cap), the capacity reserved first."""
        table = self._table
        if self.max_buckets:
            count = min(count, self.max_buckets - table.buckets)
        if count <= 0:
            return
        wanted = table.buckets + count
        if wanted > table.capacity:
            self._reserve(wanted)
        table.split(count)

    def _reserve(self, buckets: int) -> None:
        """Capacity for at least `buckets`: twice that for a small table (copied again as
        it grows), and for a large one its cap's worth, or the machine's memory where it
        has none, reserved once (the pages mapped as it grows into them)."""
        table = self._table
        bucket_bytes = max(1, table.nbytes // table.buckets)
        if 2 * buckets * bucket_bytes < _RESERVED_FROM_BYTES:
            table.reserve(2 * buckets)
            return
        if self._reserves_whole:
            whole = self.max_buckets or _memory_bytes() // bucket_bytes
            try:
                table.reserve(max(whole, 2 * buckets))
                return
            except OSError as exc:  # a kernel that commits what is reserved: copy from here
                self._reserves_whole = False
                _log.warning("KV index: reserving %d buckets failed (%s); copying", whole, exc)
        table.reserve(2 * buckets)


def _memory_bytes() -> int:
    """The machine's physical memory (what one table could fill at most)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 36

"""A hash table of uint64 keys with fixed-width numpy columns, operated on whole arrays.

Layout: `buckets` rows of `WAYS` slots (keys in one uint64 array, each column in its own
array of the same shape). A key lives in one of two buckets chosen by its mixed hash
(two-choice hashing: it goes to the emptier one), and a bucket's keys are packed at its
start, so `fill` says which slots are taken. A key's lookup reads its two buckets' tags
(2 bytes a slot) and one key; when both buckets are full, a resident moves to its other
bucket (cuckoo hashing, up to three steps deep in C), which is what keeps the bytes per
entry low.

The table grows a bucket at a time (linear hashing, as Litwin's): `split` adds bucket
`n`, which takes the keys of the next bucket in order whose hash bits now choose it. A
key's bucket is the low bits of its hash, one bit past the level (the largest power of two
at most `buckets`) where that bucket exists, at the level otherwise (`_address`), so a
split moves keys only from the bucket split to the one added, and never between two
tables: no second table, no rehash. Arrays are allocated for a `capacity` of buckets
(large ones over their own memory mapping, reserved, not committed: pages are mapped as
the table grows into them); `reserve` copies into a larger one. The owner decides when to
split and where to stop (`growing.GrowingTable`); at its cap, `insert` reports the keys
that found no room and the owner frees room in those very buckets (`victims`) and retries:
set-associative eviction, as in CPU caches, with no global pass.

Slot numbers are valid until the next insert, delete or split (deletes repack buckets).

`find`, `insert`, `delete` and `split` run in C (`_buckets.c`: one call per batch instead
of a dozen numpy calls of a few microseconds each, inserting one key at a time) where the
extension is built; the numpy operations below (a batch's find: two row gathers and
compares) are what runs where it is not, and what the tests hold the C to (the numpy
insert takes one cuckoo step, not three).
"""

from __future__ import annotations

import logging
import mmap
import platform
import sys
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

import numpy as np
import numpy.ma  # (np.unique imports it on first use: 20 ms inside the first flush)
import numpy.typing as npt

WAYS = 16
_MAPPED_BYTES = 1 << 20  # arrays this large get their own memory mapping
# Linux's MAP_NORESERVE (Python's mmap names it from 3.13; 0x4000 on x86-64 and arm64)
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0)
if not _NORESERVE and sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64"):
    _NORESERVE = 0x4000
_EMPTY = np.uint64(0)
ZERO_STAND_IN = np.uint64(0x9E3779B97F4A7C15)  # key 0 marks an empty slot; 0 is stored as this
_SCRAMBLE = np.uint64(0x9E3779B97F4A7C15)  # odd: keys times it, then split into two halves

# Array aliases naming the dtype (numpy's stubs type most results as generic arrays).
U64 = npt.NDArray[Any]  # uint64
I64 = npt.NDArray[Any]  # int64


def _native_module() -> ModuleType | None:
    """The C operations, or None where the extension is not built (logged once)."""
    try:
        from prfaas.gateway.kv_index import _buckets
    except ImportError:
        logging.getLogger(__name__).warning(
            "prfaas.gateway.kv_index._buckets is not built for this interpreter: the KV "
            "index's tables run in numpy (several times slower; `pip install -e .` builds it)"
        )
        return None
    return _buckets


_native = _native_module()


def as_keys(values: Sequence[int] | npt.NDArray[Any]) -> U64:
    """`values` (in [0, 2**64)) as table keys (uint64, 0 replaced by its stand-in). A list
    or tuple of Python ints is read in C where it is built, else through `np.fromiter` (a
    third faster than `np.asarray` for hashes past 2**63, which is half of them)."""
    if isinstance(values, np.ndarray):
        keys = values.astype(np.uint64, copy=False)
    elif _native is not None and isinstance(values, list | tuple):
        keys = np.empty(len(values), dtype=np.uint64)
        _native.as_keys(values, keys, int(ZERO_STAND_IN))
        return keys
    else:
        keys = np.fromiter(values, dtype=np.uint64, count=len(values))
    return np.where(keys == _EMPTY, ZERO_STAND_IN, keys)


def _mix(keys: U64) -> U64:
    """splitmix64's finaliser, to spread keys that are not uniform hashes."""
    x = keys ^ (keys >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    mixed: U64 = x ^ (x >> np.uint64(31))
    return mixed


def _address(bits: U64, buckets: int) -> I64:
    """The bucket that hash `bits` choose in a table of `buckets` (linear hashing): their
    low bits one past the level (the largest power of two at most `buckets`), or at the
    level where that bucket is not split yet."""
    level = 1 << (buckets.bit_length() - 1)
    high = bits & np.uint64(2 * level - 1)
    address: I64 = np.where(high < buckets, high, bits & np.uint64(level - 1)).astype(np.int64)
    return address


class HashTable:
    """uint64 keys -> one row of `columns`, in `buckets` that `split` adds to; every
    operation takes and returns arrays."""

    def __init__(
        self,
        columns: Mapping[str, npt.DTypeLike],
        buckets: int = 1,
        uniform: bool = False,
        capacity: int = 0,
    ) -> None:
        """`uniform`: the keys are hashes already (our xxh3), used as they are; else they
        are mixed first (engine hashes may be small or sequential integers). `capacity`:
        the buckets the arrays have room for (at least `buckets`)."""
        self.uniform = uniform
        self.dtypes = {name: np.dtype(dtype) for name, dtype in columns.items()}
        self.size = 0
        self.buckets = max(1, buckets)
        self.capacity = max(self.buckets, capacity)
        self._all = self._allocate(self.capacity)
        self._layout = self._layout_of(self.buckets)
        self._whole = self._layout_of(self.capacity)  # what `split` hands the C

    def _allocate(self, capacity: int) -> dict[str, npt.NDArray[Any]]:
        """Zeroed arrays for `capacity` buckets: keys, tags, fill, marks (scratch: duplicate
        buckets in a batch), then each column (named by the column, with a leading dot)."""
        arrays = {
            "keys": _zeros((capacity, WAYS), np.uint64),
            "tags": _zeros((capacity, WAYS), np.uint16),
            "fill": _zeros((capacity,), np.int8),
            "marks": _zeros((capacity,), np.int32),
        }
        return arrays | {"." + n: _zeros((capacity, WAYS), d) for n, d in self.dtypes.items()}

    def _layout_of(self, buckets: int) -> Any:
        """The first `buckets` of the arrays as the C operations take them."""
        every = self._all
        return (
            every["keys"][:buckets],
            every["tags"][:buckets],
            every["fill"][:buckets],
            tuple(every["." + name][:buckets] for name in self.dtypes),
            int(_SCRAMBLE),
            self.uniform,
        )

    @property
    def keys(self) -> U64:
        keys: U64 = self._layout[0]
        return keys

    @property
    def tags(self) -> npt.NDArray[np.uint16]:
        tags: npt.NDArray[np.uint16] = self._layout[1]
        return tags

    @property
    def fill(self) -> npt.NDArray[np.int8]:
        fill: npt.NDArray[np.int8] = self._layout[2]
        return fill

    @property
    def _marks(self) -> npt.NDArray[np.int32]:
        return self._all["marks"][: self.buckets]

    @property
    def columns(self) -> dict[str, npt.NDArray[Any]]:
        return dict(zip(self.dtypes, self._layout[3], strict=True))

    @property
    def nbytes(self) -> int:
        """Bytes of the buckets in use (what the table's memory holds: the rest of its
        capacity is reserved, not committed)."""
        return sum(a.nbytes // self.capacity * self.buckets for a in self._all.values())

    def column(self, name: str) -> npt.NDArray[np.generic]:
        """A column as a flat array indexed by slot (a view: writes go to the table)."""
        column: npt.NDArray[np.generic] = self._all["." + name][: self.buckets].reshape(-1)
        return column

    def reserve(self, capacity: int) -> None:
        """Room for `capacity` buckets: the arrays copied into larger ones (where they
        have less)."""
        if capacity <= self.capacity:
            return
        larger = self._allocate(capacity)
        for name, array in self._all.items():
            larger[name][: self.buckets] = array[: self.buckets]
        self._all, self.capacity = larger, capacity
        self._layout = self._layout_of(self.buckets)
        self._whole = self._layout_of(self.capacity)

    def split(self, count: int) -> None:
        """Add `count` buckets (within the capacity), each splitting the next bucket in
        order: its keys whose hash now chooses the new bucket move there."""
        if count <= 0:
            return
        if self.buckets + count > self.capacity:
            raise ValueError(f"{self.buckets} + {count} buckets exceed {self.capacity}")
        if _native is not None:
            self.buckets = _native.split(self._whole, self.buckets, count)
            self._layout = self._layout_of(self.buckets)
            return
        while count:
            level = 1 << (self.buckets.bit_length() - 1)
            start = self.buckets - level
            chunk = min(count, level - start)  # splits within one level
            self.buckets += chunk
            self._layout = self._layout_of(self.buckets)
            self._split_rows(np.arange(start, start + chunk), level)
            count -= chunk

    def _split_rows(self, rows: I64, level: int) -> None:
        """Numpy's split of `rows` into `rows + level` (the buckets already counted in),
        leaving the arrays as the C leaves them: each row's kept keys packed at its start
        in order, the moved ones packed in order into the new row."""
        keys = self.keys[rows]
        first, second, _ = self._choices(keys.reshape(-1))
        stays = (first.reshape(keys.shape) == rows[:, None]) | (
            second.reshape(keys.shape) == rows[:, None]
        )
        taken = keys != _EMPTY
        kept, moved = taken & stays, taken & ~stays
        ways = np.arange(WAYS)
        keep_order = np.argsort(~kept, axis=1, kind="stable")
        move_order = np.argsort(~moved, axis=1, kind="stable")
        n_kept = kept.sum(axis=1)[:, None]
        n_moved = moved.sum(axis=1)[:, None]
        for array in (self.keys, self.tags, *self.columns.values()):
            old = array[rows]
            array[rows + level] = np.where(
                ways < n_moved, np.take_along_axis(old, move_order, axis=1), 0
            )
            stale = 0 if array is self.keys else old  # emptied slots keep their tags, values
            array[rows] = np.where(
                ways < n_kept, np.take_along_axis(old, keep_order, axis=1), stale
            )
        self.fill[rows] = n_kept[:, 0]
        self.fill[rows + level] = n_moved[:, 0]

    def _choices(self, keys: U64) -> tuple[I64, I64, npt.NDArray[np.uint16]]:
        """Each key's two buckets and its tag (16 more bits of its mixed hash)."""
        mixed = (keys if self.uniform else _mix(keys)) * _SCRAMBLE
        first = _address(mixed & np.uint64(0xFFFFFFFF), self.buckets)
        second = _address(mixed >> np.uint64(32), self.buckets)
        # the tag from a product, not from bits the bucket choices read: keys that share a
        # bucket must not share their tag too
        tags = ((mixed * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(48)).astype(np.uint16)
        return first, second, tags

    def find(self, keys: U64) -> I64:
        """The slot of each key (`as_keys` applied), -1 where absent. Both buckets' tags at
        once (2 bytes a slot to compare, not 8), then the key where a tag matched; a key
        whose first matching tag was another key's is looked up by key. (`np.take` gathers
        rows several times faster than fancy indexing.)"""
        if _native is not None:
            slots: I64 = np.empty(len(keys), dtype=np.int64)
            _native.find(self._layout, np.ascontiguousarray(keys, dtype=np.uint64), slots)
            return slots
        first, second, tags = self._choices(keys)
        buckets = np.stack([first, second], axis=1)  # (n, 2)
        equal = np.take(self.tags, buckets, axis=0) == tags[:, None, None]  # (n, 2, WAYS)
        pick = equal.reshape(len(keys), 2 * WAYS).argmax(axis=1)
        slots = np.where(pick < WAYS, first, second) * WAYS + pick % WAYS
        hit = np.take(self.keys.reshape(-1), slots) == keys
        wrong = np.flatnonzero(~hit & (np.take(self.tags.reshape(-1), slots) == tags))
        if len(wrong):
            rows = np.take(self.keys, buckets[wrong], axis=0).reshape(len(wrong), 2 * WAYS)
            by_key = rows == keys[wrong, None]
            pick = by_key.argmax(axis=1)
            slots[wrong] = np.where(pick < WAYS, first[wrong], second[wrong]) * WAYS + pick % WAYS
            hit[wrong] = by_key[np.arange(len(wrong)), pick]
        found: I64 = np.where(hit, slots, -1)
        return found

    def find_values(self, keys: U64, name: str, missing: int) -> tuple[I64, npt.NDArray[Any]]:
        """`find`, and column `name`'s value at each key's slot (`missing` where absent):
        in C, read in the find's own pass over the keys, while each slot's cache lines are
        being fetched anyway (a separate gather after it found them gone again at 10M)."""
        if _native is not None:
            slots: I64 = np.empty(len(keys), dtype=np.int64)
            values = np.empty(len(keys), dtype=self.dtypes[name])
            index = list(self.dtypes).index(name)
            keys = np.ascontiguousarray(keys, dtype=np.uint64)
            _native.find(self._layout, keys, slots, index, values, missing)
            return slots, values
        slots = self.find(keys)
        values = np.where(slots >= 0, self.column(name).take(slots, mode="clip"), missing)
        return slots, values.astype(self.dtypes[name], copy=False)

    def insert(
        self, keys: U64, values: Mapping[str, npt.ArrayLike]
    ) -> tuple[U64, dict[str, npt.NDArray[np.generic]]]:
        """Add `keys` (distinct, absent, `as_keys` applied) with their column values.
        Returns the keys, with their values, that found no room (both buckets full, and
        no resident of theirs could move to its other bucket)."""
        assert values.keys() == self.dtypes.keys(), "a value for every column"
        rows = {n: np.asarray(v, dtype=self.dtypes[n]) for n, v in values.items()}
        return self._place(keys, rows)

    def _place(
        self, keys: U64, rows: dict[str, npt.NDArray[np.generic]]
    ) -> tuple[U64, dict[str, npt.NDArray[np.generic]]]:
        """Place what fits, emptier bucket first then the other; returns what did not."""
        if _native is not None:
            placed = np.empty(len(keys), dtype=bool)
            values = tuple(np.ascontiguousarray(rows[name]) for name in self.dtypes)
            count = _native.insert(self._layout, np.ascontiguousarray(keys), values, placed)
            self.size += count
            if count == len(keys):  # (the common case: no boolean indexing)
                return keys[:0], {n: v[:0] for n, v in rows.items()}
            left = ~placed
            return keys[left], {n: v[left] for n, v in rows.items()}
        first, second, tags = self._choices(keys)
        prefer_second = self.fill[second] < self.fill[first]
        other = np.where(prefer_second, first, second)
        placed = self._put(np.where(prefer_second, second, first), keys, tags, rows)
        keys, rows = keys[~placed], {n: v[~placed] for n, v in rows.items()}
        other, tags = other[~placed], tags[~placed]
        placed = self._put(other, keys, tags, rows)
        keys, rows, tags = keys[~placed], {n: v[~placed] for n, v in rows.items()}, tags[~placed]
        if len(keys):  # both buckets full: move residents to their other buckets, retry
            first, second, _ = self._choices(keys)
            for attempt in range(2):
                buckets = second if attempt else first
                freed = np.isin(buckets, self._make_room(np.unique(buckets)))
                placed = np.zeros(len(keys), dtype=bool)
                placed[freed] = self._put(
                    buckets[freed], keys[freed], tags[freed], {n: v[freed] for n, v in rows.items()}
                )
                keys, tags = keys[~placed], tags[~placed]
                rows = {n: v[~placed] for n, v in rows.items()}
                first, second = first[~placed], second[~placed]
        return keys, rows

    def _make_room(self, buckets: I64) -> I64:
        """Free a slot in each of `buckets` (distinct, full) where one of its keys can move
        to that key's other bucket; returns the buckets freed. One step of cuckoo hashing
        (the C goes deeper: see `_buckets.c`'s `make_room`)."""
        residents = np.take(self.keys, buckets, axis=0)  # (n, WAYS)
        one, two, _ = self._choices(residents.reshape(-1))
        one, two = one.reshape(residents.shape), two.reshape(residents.shape)
        other = np.where(one == buckets[:, None], two, one)
        movable = (other != buckets[:, None]) & (self.fill[other] < WAYS)
        way = movable.argmax(axis=1)
        rows = np.flatnonzero(movable[np.arange(len(buckets)), way])
        target = other[rows, way[rows]]
        _, first_per_target = np.unique(target, return_index=True)  # one move per target
        rows, target = rows[first_per_target], target[first_per_target]
        src = buckets[rows] * WAYS + way[rows]
        dst = target * WAYS + self.fill[target]
        for array in (self.keys, self.tags, *self.columns.values()):
            flat = array.reshape(-1)
            flat[dst] = flat[src]
        self.fill[target] += 1
        self.size += len(rows)
        self.delete(src)
        freed: I64 = buckets[rows]
        return freed

    def _put(
        self,
        buckets: I64,
        keys: U64,
        tags: npt.NDArray[np.uint16],
        rows: Mapping[str, npt.NDArray[np.generic]],
    ) -> npt.NDArray[np.bool_]:
        """Put each key in its given bucket where room is left; returns which went in."""
        first = np.arange(len(buckets))
        self._marks[buckets] = first
        if (self._marks[buckets] == first).all():  # one key per bucket: no ranks needed
            fits = self.fill[buckets] < WAYS
            slots = buckets[fits] * WAYS + self.fill[buckets[fits]]
            self.keys.reshape(-1)[slots] = keys[fits]
            self.tags.reshape(-1)[slots] = tags[fits]
            for name, value in rows.items():
                self.columns[name].reshape(-1)[slots] = value[fits]
            self.fill[buckets[fits]] += 1
            self.size += len(slots)
            return fits
        way = self.fill[buckets] + _rank_within(buckets)
        fits = way < WAYS
        slots = buckets[fits] * WAYS + way[fits]
        self.keys.reshape(-1)[slots] = keys[fits]
        self.tags.reshape(-1)[slots] = tags[fits]
        for name, value in rows.items():
            self.columns[name].reshape(-1)[slots] = value[fits]
        filled, counts = np.unique(buckets[fits], return_counts=True)
        self.fill[filled] += counts.astype(self.fill.dtype)
        self.size += len(slots)
        return fits

    def candidates(self, keys: U64) -> I64:
        """The slots of each key's two buckets, one row of 2 x WAYS per key."""
        first, second, _ = self._choices(keys)
        ways = np.arange(WAYS)
        slots: I64 = np.concatenate(
            [first[:, None] * WAYS + ways, second[:, None] * WAYS + ways], axis=1
        )
        return slots

    def victims(self, keys: U64, column: str) -> I64:
        """For each key, the slot holding the smallest `column` value among its two
        buckets (the one to evict so that the key fits)."""
        candidates = self.candidates(keys)
        pick = np.take(self.columns[column].reshape(-1), candidates).argmin(axis=1)
        slots: I64 = candidates[np.arange(len(candidates)), pick]
        return slots

    def delete(self, slots: I64) -> None:
        """Empty `slots` (distinct, taken) and repack their buckets."""
        if not len(slots):
            return
        if _native is not None:
            self.size -= _native.delete(self._layout, np.ascontiguousarray(slots, dtype=np.int64))
            return
        self.keys.reshape(-1)[slots] = _EMPTY
        self.size -= len(slots)
        buckets = np.unique(slots // WAYS)
        keys = self.keys[buckets]
        order = np.argsort(keys == _EMPTY, axis=1, kind="stable")  # taken slots first
        self.keys[buckets] = np.take_along_axis(keys, order, axis=1)
        self.tags[buckets] = np.take_along_axis(self.tags[buckets], order, axis=1)
        for values in self.columns.values():
            values[buckets] = np.take_along_axis(values[buckets], order, axis=1)
        self.fill[buckets] = (keys != _EMPTY).sum(axis=1)

    def taken(self, slots: I64) -> npt.NDArray[np.bool_]:
        """Whether each slot holds a key."""
        taken: npt.NDArray[np.bool_] = np.take(self.keys.reshape(-1), slots) != _EMPTY
        return taken


def _zeros(shape: tuple[int, ...], dtype: npt.DTypeLike) -> npt.NDArray[Any]:
    """A zeroed array; a large one over its own anonymous memory mapping, reserved without
    committing memory (`MAP_NORESERVE`: a table's capacity may be far more than it fills,
    and its pages are mapped only as buckets are split into them). numpy asks the kernel for
    transparent huge pages on its large arrays (`madvise`), and where the kernel then tries
    to compact memory on every fault and fails (this machine: no huge page ever granted), a
    first write to a page cost 10-80 us instead of about 3 us."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if nbytes < _MAPPED_BYTES:
        return np.zeros(shape, dtype=dtype)
    flags = mmap.MAP_PRIVATE | _NORESERVE
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype=dtype).reshape(shape)


def _rank_within(groups: I64) -> I64:
    """For each element, how many earlier elements share its group value."""
    order = np.argsort(groups, kind="stable")
    ordered = groups[order]
    new_group = np.empty(len(groups), dtype=bool)
    new_group[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=new_group[1:])
    if new_group.all():  # the common case: every key in its own bucket
        return np.zeros_like(groups)
    starts = np.flatnonzero(new_group)
    first_of = np.repeat(starts, np.diff(np.append(starts, len(ordered))))
    rank = np.empty_like(groups)
    rank[order] = np.arange(len(groups)) - first_of
    return rank

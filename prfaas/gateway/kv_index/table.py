"""A hash table of uint64 keys with fixed-width numpy columns, operated on whole arrays.

Layout: `buckets` rows of `WAYS` slots (keys in one uint64 array, each column in its own
array of the same shape). A key lives in one of two buckets chosen by its mixed hash
(two-choice hashing: it goes to the emptier one), and a bucket's keys are packed at its
start, so `fill` says which slots are taken. A key's lookup reads its two buckets' tags
(2 bytes a slot) and one key; two choices of 16 slots fill to ~84% before the first bucket
pair overflows, and moving one key of a full pair to its other bucket (one step of cuckoo
hashing) to ~95%, which is what keeps the bytes per entry low.

The table's size is fixed: `insert` reports the keys that found no room, and the owner
either grows (`growing.GrowingTable` moves the keys into a larger table a few buckets at a
time) or, at its cap, frees room in those very buckets (`victims`) and retries:
set-associative eviction, as in CPU caches, with no global pass.

Slot numbers are valid until the next insert or delete (deletes repack buckets).

`find`, `insert` and `delete` run in C (`_buckets.c`: one call per batch instead of a dozen
numpy calls of a few microseconds each, inserting one key at a time) where the extension is
built; the numpy operations below (a batch's find: two row gathers and compares) are what
runs where it is not, and what the tests hold the C to.
"""

from __future__ import annotations

import errno
import logging
import mmap
import sys
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

import numpy as np
import numpy.ma  # (np.unique imports it on first use: 20 ms inside the first flush)
import numpy.typing as npt

WAYS = 16
_PAGE = mmap.PAGESIZE
_MAPPED_BYTES = 1 << 20  # arrays this large get their own memory mapping
_FAULT_IN_BYTES = 4 << 20  # bytes faulted in per system call by `fault_in`
# Linux's MADV_DONTNEED gives a private anonymous page back and reads it as zeros after;
# elsewhere the advice may keep the contents, so rows are zeroed by writing instead.
_RELEASES_AS_ZEROS = sys.platform == "linux" and hasattr(mmap, "MADV_DONTNEED")
# Linux's madvise advice that faults pages in for writing (5.14 and later; not named by
# Python's mmap module before 3.14)
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23) if sys.platform == "linux" else None
_EMPTY = np.uint64(0)
ZERO_STAND_IN = np.uint64(0x9E3779B97F4A7C15)  # key 0 marks an empty slot; 0 is stored as this

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


class HashTable:
    """uint64 keys -> one row of `columns`, in a fixed number of buckets; every operation
    takes and returns arrays."""

    def __init__(
        self,
        columns: Mapping[str, npt.DTypeLike],
        buckets: int = 1,
        uniform: bool = False,
        seed: int = 0,
    ) -> None:
        """`uniform`: the keys are hashes already (our xxh3), used as they are; else they
        are mixed first (engine hashes may be small or sequential integers). `seed` picks
        the bucket choices: a table that keys move into from another must choose
        independently of it (with the same choices scaled, a run of full buckets moved in
        stays a run of full buckets)."""
        self.uniform = uniform
        self.seed = seed
        self._scramble = np.uint64((0x9E3779B97F4A7C15 * (2 * seed + 1)) % 2**64 | 1)
        self.dtypes = {name: np.dtype(dtype) for name, dtype in columns.items()}
        self.size = 0
        buckets = max(1, buckets)
        self.buckets = buckets
        self.keys: U64 = _zeros((buckets, WAYS), np.uint64)
        self.tags = _zeros((buckets, WAYS), np.uint16)
        self.fill = _zeros((buckets,), np.int8)
        self._marks = _zeros((buckets,), np.int32)  # scratch: duplicate buckets in a batch
        self.columns = {n: _zeros((buckets, WAYS), d) for n, d in self.dtypes.items()}
        # the arrays as the C operations take them (a table's arrays are never replaced)
        self._layout = (
            self.keys,
            self.tags,
            self.fill,
            tuple(self.columns.values()),
            int(self._scramble),
            self.uniform,
        )

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in self._arrays())

    def _arrays(self) -> list[npt.NDArray[Any]]:
        return [self.keys, self.tags, self.fill, self._marks, *self.columns.values()]

    def touch(self, position: int, nbytes: int) -> int:
        """Fault in the memory pages of bytes `position` to `position + nbytes` of the
        table's arrays (taken end to end), with one `madvise` call per array over its own
        mapping (`_populate`), else by rewriting one byte per page with itself; returns
        where the next call starts (`nbytes` of the table when all are in). A new
        table's zeroed pages are mapped on first write, and writes scattered by hashing
        fault nearly one page each (about 3 us a page here: milliseconds for the first
        thousand inserts into a large table)."""
        end = position + nbytes
        offset = 0
        for array in self._arrays():
            raw = array.reshape(-1).view(np.uint8)
            low, high = max(position, offset), min(end, offset + len(raw))
            if low < high and not _populate(array, low - offset, high - offset):
                pages = raw[low - offset : high - offset : _PAGE]
                np.bitwise_or(pages, 0, out=pages)
                last = raw[high - offset - 1 : high - offset]
                np.bitwise_or(last, 0, out=last)
            offset += len(raw)
        return min(end, offset)

    def can_fault_in_aside(self) -> bool:
        """Whether `fault_in` can run in a thread beside the loop: its system call releases
        the GIL and leaves the contents alone (the loop may be writing them meanwhile)."""
        return _native is not None and _POPULATE_WRITE is not None

    def fault_in(self) -> bool:
        """Fault in the pages of the table's arrays over their own mappings (`touch`'s
        work, at once; the small arrays fault on first write), a few MB per system call
        (the call holds the process's memory map, which the loop's own mappings wait
        for); meant for a thread, where `can_fault_in_aside`. Returns whether all went in
        (not where the kernel refused the advice: then `touch` writes instead)."""
        for array in self._arrays():
            if _mapping(array) is None:
                continue
            for start in range(0, array.nbytes, _FAULT_IN_BYTES):
                if not _populate(array, start, min(array.nbytes, start + _FAULT_IN_BYTES)):
                    return False
        return True

    def release(self) -> None:
        """Give back the pages of the table's arrays over their own mappings (a table no
        longer used: unmapping one that still holds a few hundred MB held the loop for
        milliseconds), with the GIL released; meant for a thread, which then drops the
        table. Nothing where the C operations are not built (the table is unmapped when
        dropped) or off Linux (there rows were zeroed, not given back)."""
        if _native is None or not _RELEASES_AS_ZEROS:
            return
        for array in self._arrays():
            if _mapping(array) is not None:
                _native.advise(array, 0, array.nbytes, mmap.MADV_DONTNEED)

    def column(self, name: str) -> npt.NDArray[np.generic]:
        """A column as a flat array indexed by slot (a view: writes go to the table)."""
        return self.columns[name].reshape(-1)

    def _choices(self, keys: U64) -> tuple[I64, I64, npt.NDArray[np.uint16]]:
        """Each key's two buckets and its tag (16 more bits of its mixed hash)."""
        mixed = (keys if self.uniform else _mix(keys)) * self._scramble
        n = np.uint64(self.buckets)
        first = ((mixed & np.uint64(0xFFFFFFFF)) * n) >> np.uint64(32)
        second = ((mixed >> np.uint64(32)) * n) >> np.uint64(32)
        # the tag from a product, not from bits the bucket choices read: keys that share a
        # bucket must not share their tag too
        tags = ((mixed * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(48)).astype(np.uint16)
        return first.astype(np.int64), second.astype(np.int64), tags

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
        to that key's other bucket; returns the buckets freed. One step of cuckoo hashing:
        with it the table fills to ~95% before it must grow, not ~80%."""
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

    def pop_buckets(self, start: int, stop: int) -> tuple[U64, dict[str, npt.NDArray[np.generic]]]:
        """Empty buckets `start` to `stop` (excluded), returning their memory to the system
        where it can (a table emptied this way frees its pages as it goes, not all at its
        end: unmapping a few hundred MB at once took milliseconds); returns their keys with
        their column values (copies)."""
        rows = slice(start, stop)
        taken = self.keys[rows] != _EMPTY
        keys = self.keys[rows][taken]
        values = {n: c[rows][taken] for n, c in self.columns.items()}
        for array in self._arrays():
            _clear(array, start, stop)
        self.size -= len(keys)
        return keys, values

    def taken(self, slots: I64) -> npt.NDArray[np.bool_]:
        """Whether each slot holds a key."""
        taken: npt.NDArray[np.bool_] = np.take(self.keys.reshape(-1), slots) != _EMPTY
        return taken


def _zeros(shape: tuple[int, ...], dtype: npt.DTypeLike) -> npt.NDArray[Any]:
    """A zeroed array; a large one over its own anonymous memory mapping. numpy asks the
    kernel for transparent huge pages on its large arrays (`madvise`), and where the kernel
    then tries to compact memory on every fault and fails (this machine: no huge page ever
    granted), a first write to a page cost 10-80 us instead of about 3 us."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if nbytes < _MAPPED_BYTES:
        return np.zeros(shape, dtype=dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=dtype).reshape(shape)


def _mapping(array: npt.NDArray[Any]) -> mmap.mmap | None:
    """The memory mapping `array` lies over from its start (see `_zeros`), if any."""
    base = array.base
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return base if isinstance(base, mmap.mmap) else None


def _populate(array: npt.NDArray[Any], low: int, high: int) -> bool:
    """Fault in the pages holding bytes `low` to `high` of an array over its own mapping in
    one system call (`MADV_POPULATE_WRITE`, Linux 5.14: 1.2-1.9 us a page here, against
    3-6 us writing a byte per page from numpy), with the GIL released where the C
    operations are built (so that a thread can run it beside the loop); False where it
    cannot (then write)."""
    global _POPULATE_WRITE
    mapping = _mapping(array)
    if mapping is None or _POPULATE_WRITE is None:
        return False
    first = low // _PAGE * _PAGE
    error: int
    if _native is not None:
        error = int(_native.advise(array, first, high, _POPULATE_WRITE))
    else:
        try:
            mapping.madvise(_POPULATE_WRITE, first, high - first)
            error = 0
        except OSError as exc:
            error = exc.errno or errno.EINVAL
    if error in (errno.EINVAL, errno.ENOSYS, errno.EPERM):  # not this kernel's
        _POPULATE_WRITE = None
    return error == 0


def _clear(array: npt.NDArray[Any], start: int, stop: int) -> None:
    """Zero rows `start` to `stop` (excluded) of `array`; the whole pages among them of an
    array over its own mapping are given back instead (they read as zeros)."""
    row_bytes = array.nbytes // max(1, len(array))
    low, high = start * row_bytes, stop * row_bytes
    mapping = _mapping(array)
    first, last = -(-low // _PAGE) * _PAGE, high // _PAGE * _PAGE
    if _RELEASES_AS_ZEROS and mapping is not None and last > first:
        try:
            mapping.madvise(mmap.MADV_DONTNEED, first, last - first)
        except OSError:  # refused: zero the rows instead
            array[start:stop] = 0
            return
        raw = array.reshape(-1).view(np.uint8)
        raw[low:first] = 0
        raw[last:high] = 0
    else:
        array[start:stop] = 0


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

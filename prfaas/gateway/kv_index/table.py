"""A hash table of uint64 keys with fixed-width numpy columns, operated on whole arrays.

Layout: `buckets` rows of `WAYS` slots (keys in one uint64 array, each column in its own
array of the same shape). A key lives in one of two buckets chosen by its mixed hash
(two-choice hashing: it goes to the emptier one), and a bucket's keys are packed at its
start, so `fill` says which slots are taken. Finding a batch of keys is a fixed dozen numpy
operations whatever the load (two row gathers and compares), which is what makes a
2,000-block lookup a few tens of microseconds; two choices of 16 slots fill to ~84% before
the first bucket pair overflows, and moving one key of a full pair to its other bucket (one
step of cuckoo hashing) to ~95%, which is what keeps the bytes per entry low.

A full bucket pair either grows the table (rehashing every key, vectorised) or, when the
owner caps the table's slots, reports the keys it could not place so that the owner frees
room in those very buckets (`victims`) and retries: set-associative eviction, as in CPU
caches, with no global pass.

Slot numbers are valid until the next insert or delete (deletes repack buckets).
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

WAYS = 16
GROWTH = 1.25
_REHASH_CHUNK = 1 << 14  # keys placed at a time when rehashing
_EMPTY = np.uint64(0)
_ZERO_STAND_IN = np.uint64(0x9E3779B97F4A7C15)  # key 0 marks an empty slot; 0 is stored as this

# Array aliases naming the dtype (numpy's stubs type most results as generic arrays).
U64 = npt.NDArray[Any]  # uint64
I64 = npt.NDArray[Any]  # int64


def as_keys(values: npt.ArrayLike) -> U64:
    """`values` as table keys (uint64, 0 replaced by its stand-in)."""
    keys = np.asarray(values, dtype=np.uint64)
    return np.where(keys == _EMPTY, _ZERO_STAND_IN, keys)


def _mix(keys: U64) -> U64:
    """splitmix64's finaliser, to spread keys that are not uniform hashes."""
    x = keys ^ (keys >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    mixed: U64 = x ^ (x >> np.uint64(31))
    return mixed


class HashTable:
    """uint64 keys -> one row of `columns`; every operation takes and returns arrays."""

    def __init__(
        self,
        columns: Mapping[str, npt.DTypeLike],
        buckets: int = 1,
        max_buckets: int = 0,
        uniform: bool = False,
    ) -> None:
        """`max_buckets` caps growth (0: none); a full bucket pair at the cap is the
        caller's to empty (see `insert`). `uniform`: the keys are hashes already (our
        xxh3), used as they are; else they are mixed first (engine hashes may be small or
        sequential integers)."""
        self._uniform = uniform
        self._dtypes = {name: np.dtype(dtype) for name, dtype in columns.items()}
        self.max_buckets = max_buckets
        self.size = 0
        self._allocate(max(1, buckets))

    def _allocate(self, buckets: int) -> None:
        self.buckets = buckets
        self.keys: U64 = np.zeros((buckets, WAYS), dtype=np.uint64)
        self.tags = np.zeros((buckets, WAYS), dtype=np.uint16)
        self.fill = np.zeros(buckets, dtype=np.int8)
        self._marks = np.zeros(buckets, dtype=np.int32)  # scratch: duplicate buckets in a batch
        self.columns = {n: np.zeros((buckets, WAYS), dtype=d) for n, d in self._dtypes.items()}

    @property
    def nbytes(self) -> int:
        fixed = self.keys.nbytes + self.tags.nbytes + self.fill.nbytes + self._marks.nbytes
        return fixed + sum(c.nbytes for c in self.columns.values())

    def column(self, name: str) -> npt.NDArray[np.generic]:
        """A column as a flat array indexed by slot (a view: writes go to the table)."""
        return self.columns[name].reshape(-1)

    def _choices(self, keys: U64) -> tuple[I64, I64, npt.NDArray[np.uint16]]:
        """Each key's two buckets and its tag (16 more bits of its mixed hash)."""
        mixed = keys if self._uniform else _mix(keys)
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
        Returns the keys, with their values, that found no room: only at `max_buckets`,
        and they may include keys that were in the table (a rehash into the last size can
        overflow a bucket pair). Empty a slot in one of their two buckets (`victims`) and
        insert them again."""
        assert values.keys() == self._dtypes.keys(), "a value for every column"
        rows = {n: np.asarray(v, dtype=self._dtypes[n]) for n, v in values.items()}
        keys, rows = self._place(keys, rows)
        while len(keys) and (self.max_buckets == 0 or self.buckets < self.max_buckets):
            keys, rows = self._grow(keys, rows)
        return keys, rows

    def _place(
        self, keys: U64, rows: dict[str, npt.NDArray[np.generic]]
    ) -> tuple[U64, dict[str, npt.NDArray[np.generic]]]:
        """Place what fits, emptier bucket first then the other; returns what did not."""
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

    def _grow(
        self, keys: U64, rows: dict[str, npt.NDArray[np.generic]]
    ) -> tuple[U64, dict[str, npt.NDArray[np.generic]]]:
        """Rehash into ~GROWTH times the buckets (capped) with `keys` added; returns the
        keys that still found no room."""
        held, held_rows = self.items()
        wanted = max(int(self.buckets * GROWTH) + 1, (self.size + len(keys)) // WAYS + 1)
        if self.max_buckets:
            wanted = min(wanted, self.max_buckets)
        self._allocate(wanted)
        self.size = 0
        everything = np.concatenate([held, keys])
        values = {n: np.concatenate([held_rows[n], rows[n]]) for n in rows}
        del held, held_rows
        left: list[tuple[U64, dict[str, npt.NDArray[np.generic]]]] = []
        for start in range(0, len(everything), _REHASH_CHUNK):  # so fills inform choices
            part = slice(start, start + _REHASH_CHUNK)
            left.append(self._place(everything[part], {n: v[part] for n, v in values.items()}))
        del everything, values
        _trim_heap()
        return (
            np.concatenate([k for k, _ in left]),
            {n: np.concatenate([r[n] for _, r in left]) for n in rows},
        )

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

    def items(self) -> tuple[U64, dict[str, npt.NDArray[np.generic]]]:
        """Every key with its column values (copies), in slot order."""
        used = self.keys.reshape(-1) != _EMPTY
        return self.keys.reshape(-1)[used], {
            n: c.reshape(-1)[used] for n, c in self.columns.items()
        }


def _trim_heap() -> None:
    """Give freed heap memory back to the system (glibc's `malloc_trim`; elsewhere
    nothing). A rehash's copies are freed into the heap, which otherwise keeps them:
    measured, a quarter more resident memory than the tables hold."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


_LIBC = _load_libc()


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

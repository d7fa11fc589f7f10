"""`GrowingTable`: a `HashTable` that grows without stopping the event loop for a rehash.

A table filled past `_MAX_LOAD` (past it most batches find a full bucket pair and pay a
cuckoo step: ingest ran 25-35% slower filling to 97%), or with no room for a key, grows
into one `GROWTH` times larger in two phases, each spread over the inserts that follow, so
that no call does more than a bounded step:

1. *Preparing*: the larger table is allocated and its memory faulted in a slice per insert
   (`_TOUCH_BYTES`, or more for a large insert: all of it before the full table takes 3%
   more), or by a thread beside the loop for a table of `_FAULT_ASIDE_BYTES` and more,
   while inserts still go to the full table and only what it has no room for goes to the
   new one. Writes scattered by hashing would otherwise fault nearly a page each in a
   fresh table: the first thousand inserts into a large table would pay milliseconds of
   page faults.
2. *Moving*: inserts go to the new table, and each one first moves `_STEP_BUCKETS` of the
   old table's buckets, plus half a bucket per key inserted (`_MOVE_PER_KEY`), into it
   (incremental rehashing, as Redis does); the old table, emptied, is given back by a
   thread where it is large. The move ends well before the new table fills: it holds the
   old table's keys at 60% load, filling it to 90% takes about seven inserted keys per old
   bucket, and moving takes two.

The threads (faulting a large next table in, giving a moved-out one back) are short-lived
daemons, each one bounded job of `madvise` calls with the GIL released, that end on their
own; the table keeps their handles, and a table dropped meanwhile lives until its thread
ends.

Moving every key at once held the gateway's loop for seconds at 10M entries. A table that
fills up while still moving finishes the move at once first (not seen on the benchmark's
workloads). The new table draws its bucket choices independently of the old one (its
`seed`): with the same choices scaled, runs of full buckets moved over stayed runs of full
buckets, and new tables overflowed at 70% load.

While growing, the table is two: the one inserts go to and the other (the next table while
preparing, the old one while moving); finds look in the other for what the first lacks.
A slot below `boundary` is in the first, one from `boundary` up in the other (offset by
`boundary`), so every slot names one row whichever table holds it. Slot numbers are valid
until the next insert or delete, as in `HashTable`.

`max_buckets` caps growth; a full bucket pair at the cap is the caller's to empty
(`victims`), and the keys `insert` hands back then may include some the table held (moved
into the capped table and not fitting there).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from prfaas.gateway.kv_index.table import I64, U64, WAYS, HashTable

GROWTH = 1.5  # fewer growths than 1.25: each key moves about twice, not four times
_MAX_LOAD = 0.9  # a growth starts past this load (fuller, most inserts need a cuckoo step)
_STEP_BUCKETS = 32  # old buckets moved per insert call, besides _MOVE_PER_KEY per key
_MOVE_PER_KEY = 0.5  # old buckets moved per key inserted
_TOUCH_BYTES = 1 << 18  # bytes of the next table faulted in per insert call, at least
_TOUCH_WITHIN = 0.03  # all of it in by the time the full table takes this share more keys
_PLACE_CHUNK = 1 << 14  # keys placed at a time when moving everything at once
# Tables this large are faulted in by a thread beside the loop, not a slice per insert (on
# this virtual machine a page fault now and then costs tens of microseconds, and a slice of
# 256 KiB held the loop 4-7 ms), and given back by one once moved out (unmapping a 280 MB
# table that still held the pages its moving steps only partly covered took 10 ms).
_FAULT_ASIDE_BYTES = 16 << 20

Rows = dict[str, npt.NDArray[np.generic]]


class GrowingTable:
    """uint64 keys -> one row of `columns`, growing by incremental rehash."""

    def __init__(
        self,
        columns: Mapping[str, npt.DTypeLike],
        max_buckets: int = 0,
        uniform: bool = False,
        phase: float = 1.0,
    ) -> None:
        """`max_buckets` caps growth (0: none). `uniform`: see `HashTable`. `phase`: the
        table grows through sizes of `phase * GROWTH ** k` buckets (rounded up), so that
        two tables holding about as many keys but of different phases grow at different
        times."""
        self.max_buckets = max_buckets
        self.phase = phase
        self._table = HashTable(columns, uniform=uniform)  # where inserts go
        self._other: HashTable | None = None  # the next table (preparing), the old (moving)
        self._moving = False
        self._touched = 0  # preparing: bytes of the next table faulted in
        self._touch_per_key = 0.0  # preparing: bytes faulted in per key inserted
        # short-lived threads, each one bounded job of system calls, ending on their own
        self._faulting: threading.Thread | None = None  # preparing: faulting it in aside
        self._faulted_aside = False  # whether it all went in
        self._releasing: threading.Thread | None = None  # the last table moved out
        self._moved = 0  # moving: old buckets moved
        self.growths = 0

    @property
    def size(self) -> int:
        return sum(table.size for table in self.tables)

    @property
    def nbytes(self) -> int:
        return sum(table.nbytes for table in self.tables)

    @property
    def tables(self) -> tuple[HashTable, ...]:
        """The table inserts go to, then the other one while growing."""
        return (self._table,) if self._other is None else (self._table, self._other)

    @property
    def boundary(self) -> int:
        """Slots from here up are the other table's."""
        return self._table.buckets * WAYS

    @property
    def slots(self) -> int:
        """The number of slot numbers in use (both tables' while growing)."""
        return sum(table.buckets * WAYS for table in self.tables)

    @property
    def growing(self) -> bool:
        return self._other is not None

    @property
    def moving(self) -> bool:
        return self._moving

    def find(self, keys: U64) -> I64:
        """The slot of each key (`as_keys` applied), -1 where absent."""
        slots = self._table.find(keys)
        if self._other is not None and self._other.size:  # a next table often holds none
            missing = np.flatnonzero(slots < 0)
            if len(missing):
                other = self._other.find(keys[missing])
                slots[missing] = np.where(other >= 0, other + self.boundary, -1)
        return slots

    def get(self, name: str, slots: I64) -> npt.NDArray[Any]:
        """Column `name` at `slots` (a copy; what a slot of -1 gives is unspecified)."""
        values = self._table.column(name).take(slots, mode="clip")
        if self._other is not None:
            other = np.flatnonzero(slots >= self.boundary)
            if len(other):
                values[other] = np.take(self._other.column(name), slots[other] - self.boundary)
        return values

    def set(self, name: str, slots: I64, values: npt.ArrayLike) -> None:
        """Write column `name` at `slots` (distinct, taken)."""
        if self._other is None:
            self._table.column(name)[slots] = values
            return
        values = np.broadcast_to(np.asarray(values, dtype=self._table.dtypes[name]), slots.shape)
        for table, offset, part in self._split(slots):
            table.column(name)[slots[part] - offset] = values[part]

    def taken(self, slots: I64) -> npt.NDArray[np.bool_]:
        """Whether each slot holds a key."""
        if self._other is None:
            return self._table.taken(slots)
        taken = np.zeros(len(slots), dtype=bool)
        for table, offset, part in self._split(slots):
            taken[part] = table.taken(slots[part] - offset)
        return taken

    def select(self, name: str, value: int) -> I64:
        """Every slot holding a key whose column `name` equals `value`."""
        found = [
            np.flatnonzero((table.column(name) == value) & (table.keys.reshape(-1) != 0)) + offset
            for table, offset in zip(self.tables, (0, self.boundary), strict=False)
        ]
        slots: I64 = np.concatenate(found)
        return slots

    def insert(self, keys: U64, values: Mapping[str, npt.ArrayLike]) -> tuple[U64, Rows]:
        """Add `keys` (distinct, absent, `as_keys` applied), after one step of a growth
        under way. Returns the keys, with their values, that found no room: only at
        `max_buckets` (see the module docstring)."""
        rows = {n: np.asarray(v, dtype=self._table.dtypes[n]) for n, v in values.items()}
        if self._other is not None and not self._moving:
            self._touch_next(len(keys))
        elif self._other is None and self._full(len(keys)):
            self._prepare(len(keys))
        if self._moving:
            moved_left = self._move(_STEP_BUCKETS + int(len(keys) * _MOVE_PER_KEY))
            keys, rows = _joined(moved_left, self._table.insert(keys, rows))
        else:
            keys, rows = self._table.insert(keys, rows)
        return self._overflow(keys, rows)

    def advance(self) -> tuple[U64, Rows]:
        """One step of a growth under way with no key inserted, as an insert does (a slice
        of the next table faulted in, or `_STEP_BUCKETS` buckets moved): inserts end a
        growth, and an index that gets few calls this now and then so that one ends anyway.
        Returns what found no room (only at `max_buckets`)."""
        return self.insert(*_nothing(self._table))

    def delete(self, slots: I64) -> None:
        """Empty `slots` (distinct, taken)."""
        if self._other is None:
            self._table.delete(slots)
            return
        for table, offset, part in self._split(slots):
            table.delete(slots[part] - offset)

    def candidates(self, keys: U64) -> I64:
        """The slots of each key's two buckets (a row each). For keys `insert` handed
        back, so no growth is under way."""
        assert self._other is None, "keys are handed back only at the cap, not growing"
        return self._table.candidates(keys)

    def victims(self, keys: U64, column: str) -> I64:
        """For each key, the slot with the smallest `column` among its two buckets (the
        one to evict so that the key fits). For keys `insert` handed back."""
        assert self._other is None, "keys are handed back only at the cap, not growing"
        return self._table.victims(keys, column)

    def _split(self, slots: I64) -> Iterator[tuple[HashTable, int, npt.NDArray[np.bool_]]]:
        """Each table with its slot offset and which of `slots` are its (while growing)."""
        assert self._other is not None
        other = slots >= self.boundary
        yield self._table, 0, ~other
        yield self._other, self.boundary, other

    def _overflow(self, keys: U64, rows: Rows) -> tuple[U64, Rows]:
        """Find room for the keys the table inserts go to had none for: in the next table
        (a growth starts if none is under way; a next table full already starts its move);
        a move under way whose new table is full finishes at once. Returns what is left at
        `max_buckets`."""
        while len(keys):
            if self._other is None:
                if self.max_buckets and self._table.buckets >= self.max_buckets:
                    break
                self._prepare(len(keys))
            assert self._other is not None
            if self._moving:
                keys, rows = _joined(self._move(self._other.buckets), (keys, rows))
                keys, rows = self._table.insert(keys, rows)
            else:
                keys, rows = self._other.insert(keys, rows)
                if len(keys):
                    self._start_moving()
        return keys, rows

    def _full(self, adding: int) -> bool:
        """Whether `adding` keys would fill the table inserts go to past `_MAX_LOAD` (and it
        may grow)."""
        table = self._table
        if self.max_buckets and table.buckets >= self.max_buckets:
            return False
        return table.size + adding > _MAX_LOAD * table.buckets * WAYS

    def _prepare(self, adding: int) -> None:
        """Allocate the next table (the next size of this table's phase, about GROWTH times
        larger, or one with room for `adding` more keys; capped) and fault in its first
        slice."""
        table = self._table
        needed = int((self.size + adding) / (_MAX_LOAD * WAYS)) + 1
        wanted = self._size_at_least(max(table.buckets + 1, needed))
        if self.max_buckets:
            wanted = min(wanted, self.max_buckets)
        self._other = HashTable(
            table.dtypes, buckets=wanted, uniform=table.uniform, seed=table.seed + 1
        )
        self._touched = 0
        self._touch_per_key = self._other.nbytes / (_TOUCH_WITHIN * table.buckets * WAYS)
        self.growths += 1
        self._faulting = None
        if self._other.nbytes >= _FAULT_ASIDE_BYTES and self._other.can_fault_in_aside():
            self._faulted_aside = False
            self._faulting = threading.Thread(
                target=self._fault_in_aside, args=(self._other,), name="kv-index-fault-in"
            )
            self._faulting.daemon = True
            self._faulting.start()
        self._touch_next(adding)

    def _fault_in_aside(self, table: HashTable) -> None:
        """The fault-in thread's work (see `_FAULT_ASIDE_BYTES`)."""
        self._faulted_aside = table.fault_in()

    def _size_at_least(self, buckets: int) -> int:
        """The smallest size of this table's phase (`phase * GROWTH ** k` buckets, rounded
        up) of at least `buckets`."""
        k = max(0, math.floor(math.log(buckets / self.phase, GROWTH)))
        while math.ceil(self.phase * GROWTH**k) < buckets:
            k += 1
        return math.ceil(self.phase * GROWTH**k)

    def _touch_next(self, adding: int) -> None:
        """Fault in the next slice of the next table (`_TOUCH_BYTES`, or more as `adding`
        keys come in); once all is in, start moving."""
        assert self._other is not None
        if self._faulting is not None:  # a thread faults it in: moving starts once it ends
            if self._faulting.is_alive():
                return
            self._faulting = None
            if self._faulted_aside:
                self._start_moving()
                return
            # (the kernel refused the advice: slices on the loop from here, as for a small
            # table)
        nbytes = max(_TOUCH_BYTES, int(adding * self._touch_per_key))
        self._touched = self._other.touch(self._touched, nbytes)
        if self._touched >= self._other.nbytes:
            self._start_moving()

    def _start_moving(self) -> None:
        assert self._other is not None
        self._faulting = None  # (a thread still faulting it in ends on its own)
        self._table, self._other = self._other, self._table
        self._moving = True
        self._moved = 0

    def _move(self, buckets: int) -> tuple[U64, Rows]:
        """Move the next `buckets` old buckets into the new table (while moving); returns
        the keys that found no room there (with their values)."""
        old = self._other
        if old is None or not self._moving:
            return _nothing(self._table)
        stop = min(old.buckets, self._moved + buckets)
        keys, rows = old.pop_buckets(self._moved, stop)
        self._moved = stop
        if stop == old.buckets:
            self._other, self._moving = None, False
            if old.nbytes >= _FAULT_ASIDE_BYTES:  # its pages given back, then dropped, aside
                self._releasing = threading.Thread(target=old.release, name="kv-index-release")
                self._releasing.daemon = True
                self._releasing.start()
        left: list[tuple[U64, Rows]] = []
        for start in range(0, len(keys), _PLACE_CHUNK):  # so fills inform the choices
            part = slice(start, start + _PLACE_CHUNK)
            left.append(self._table.insert(keys[part], {n: v[part] for n, v in rows.items()}))
        return _joined(_nothing(self._table), *left)


def _nothing(table: HashTable) -> tuple[U64, Rows]:
    return np.empty(0, np.uint64), {n: np.empty(0, d) for n, d in table.dtypes.items()}


def _joined(*parts: tuple[U64, Rows]) -> tuple[U64, Rows]:
    """Keys with their rows, concatenated in order (the one part that has keys, as it is)."""
    filled = [part for part in parts if len(part[0])]
    if len(filled) <= 1:
        return filled[0] if filled else parts[-1]
    keys: U64 = np.concatenate([k for k, _ in parts])
    names = parts[0][1].keys()
    return keys, {n: np.concatenate([r[n] for _, r in parts]) for n in names}

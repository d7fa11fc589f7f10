"""Interned sets of instances: which instances hold a block, as a 4-byte id per block.

A fleet's blocks fall into few distinct holder sets (a conversation's blocks sit on one
instance; a shared system prompt on many, the same many), so a block row stores the id of
its set and each set is stored once: as a Python int bitset (instance i is bit i) for
adding and removing members, and as a row of `bits` (uint64 words) so that a lookup turns
a batch of ids into bitsets with one gather. Ids are reference-counted by the rows that
hold them and reused once unreferenced; id 0 is the empty set.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from prfaas.gateway.kv_index.batch import group

EMPTY = 0
MULTIPLE = 1 << 16
"""`update`'s change numbers from here up name several instances (below: one instance)."""
_WORD = (1 << 64) - 1


class HolderSets:
    """Set ids <-> instance bitsets, with per-id reference counts."""

    def __init__(self) -> None:
        self._members: list[int] = [0]  # id -> bitset
        self._ids: dict[int, int] = {0: EMPTY}  # bitset -> id
        self._free: list[int] = []
        self._refs: list[int] = [0]  # id -> rows holding it
        self.bits: npt.NDArray[np.uint64] = np.zeros((1, 1), dtype=np.uint64)

    @property
    def nbytes(self) -> int:
        return self.bits.nbytes + 8 * len(self._refs)

    def members(self, set_id: int) -> int:
        return self._members[set_id]

    def size(self, set_id: int) -> int:
        """How many instances the set holds."""
        return self._members[set_id].bit_count()

    def update(
        self, set_ids: npt.NDArray[Any], changes: npt.NDArray[Any], masks: dict[int, int], add: bool
    ) -> tuple[npt.NDArray[Any], int]:
        """The id of each set with a change made: instance `c` added (or removed) where the
        row's `changes` is c < `MULTIPLE`, else the members `masks[c]` (instance i is bit i).
        Returns the new ids and how many memberships that made (or undid); reference counts
        move from the old ids to the new ones. One set operation per distinct (set,
        change) pair: a batch's blocks share a few (a flush of 256 blocks about 15), so the
        counts move in a Python loop over those, not in numpy calls over the batch."""
        pairs = (set_ids.astype(np.uint64) << np.uint64(32)) | changes.astype(np.uint64)
        first, inverse, _ = group(pairs)
        rows = np.bincount(inverse, minlength=len(first)).tolist()  # rows per distinct pair
        distinct = pairs[first].tolist()
        old_ids = [pair >> 32 for pair in distinct]
        new_ids: list[int] = []
        delta = 0
        for pair, old_id, count in zip(distinct, old_ids, rows, strict=True):
            members = self._members[old_id]
            change = pair & 0xFFFFFFFF
            mask = masks[change] if change >= MULTIPLE else 1 << change
            changed = members | mask if add else members & ~mask
            new_ids.append(self._intern(changed))
            delta += (changed.bit_count() - members.bit_count()) * count
        refs = self._refs
        for new_id, old_id, count in zip(new_ids, old_ids, rows, strict=True):
            refs[new_id] += count
            refs[old_id] -= count
        self._forget_unreferenced(old_ids)
        return np.array(new_ids, dtype=np.uint32)[inverse], delta

    def _intern(self, members: int) -> int:
        set_id = self._ids.get(members)
        if set_id is not None:
            return set_id
        if self._free:
            set_id = self._free.pop()
        else:
            set_id = len(self._members)
            self._members.append(0)
            self._refs.append(0)
        words = max(self.bits.shape[1], (members.bit_length() + 63) // 64)
        if set_id >= len(self.bits) or words > self.bits.shape[1]:
            self._reserve(max(len(self.bits), 2 * set_id + 2), words)
        self._members[set_id] = members
        self._ids[members] = set_id
        self.bits[set_id] = [(members >> (64 * w)) & _WORD for w in range(words)]
        return set_id

    def _reserve(self, sets: int, words: int) -> None:
        bits = np.zeros((sets, words), dtype=np.uint64)
        bits[: len(self.bits), : self.bits.shape[1]] = self.bits
        self.bits = bits

    def retain(self, set_ids: npt.NDArray[Any], count: int) -> None:
        """Add `count` references to each id (once per occurrence); ids left unreferenced
        are freed for reuse."""
        ids = set_ids.tolist()
        refs = self._refs
        for set_id in ids:
            refs[set_id] += count
        if count < 0:
            self._forget_unreferenced(ids)

    def _forget_unreferenced(self, set_ids: list[int]) -> None:
        for set_id in set(set_ids):
            if self._refs[set_id] == 0 and set_id != EMPTY:
                self._forget(set_id)

    def _forget(self, set_id: int) -> None:
        members = self._members[set_id]
        del self._ids[members]
        self._members[set_id] = 0
        self.bits[set_id] = 0
        self._free.append(set_id)

"""Linear-attention state snapshot slots: request-level cache entries keyed by a block hash.

A linear-attention (or SWA) layer's state summarises the whole prefix, so unlike a KV block
it can only be reused at exactly the token count at which it was saved. A slot holds one
snapshot of every linear layer's state (the tensors live in the engine, indexed by slot id),
taken at a block boundary and keyed by the chained hash of the block that ends there.

Pure data structure: integers in, integers out. LRU order is a monotonic counter, not a clock.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class StateSlotPool:
    """Fixed set of `num_slots` snapshot slots with reference counts and LRU eviction.

    A slot is free, or holds the snapshot for one block hash. A held slot with reference
    count 0 is evictable; a pinned one (count > 0) is being restored by a request.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self._num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._by_hash: dict[int, int] = {}
        self._key: dict[int, int] = {}  # slot -> block hash
        self._ref = [0] * num_slots
        self._lru: OrderedDict[int, int] = OrderedDict()  # unpinned held slot -> tick
        self._tick = 0
        self._evicted: list[int] = []  # hashes whose snapshot `save` evicted, until taken

    @property
    def num_slots(self) -> int:
        """Total number of slots."""
        return self._num_slots

    @property
    def num_free(self) -> int:
        """Slots holding nothing."""
        return len(self._free)

    @property
    def num_held(self) -> int:
        """Slots holding a snapshot (pinned or not)."""
        return len(self._key)

    def lookup(self, block_hash: int) -> int | None:
        """The slot holding the snapshot saved at `block_hash`, if any. Does not mutate."""
        return self._by_hash.get(block_hash)

    def key_of(self, slot: int) -> int | None:
        """The block hash whose snapshot `slot` holds, or None if free."""
        return self._key.get(slot)

    def save(self, block_hash: int) -> int | None:
        """Reserve a slot for a new snapshot at `block_hash` and return it.

        Evicts the least recently used unpinned snapshot when no slot is free. Returns None
        when there is nothing to write: the snapshot already exists (it is marked recently
        used) or every slot is pinned.
        """
        existing = self._by_hash.get(block_hash)
        if existing is not None:
            if existing in self._lru:
                self._lru.move_to_end(existing)
                self._lru[existing] = self._next_tick()
            return None
        if not self._free and not self._evict_lru():
            return None
        slot = self._free.popleft()
        self._by_hash[block_hash] = slot
        self._key[slot] = block_hash
        self._lru[slot] = self._next_tick()
        return slot

    def take_evicted(self) -> list[int]:
        """The block hashes whose snapshots `save` evicted since the last call (then
        forgotten); `drop` and `clear` are the caller's own and not listed."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def acquire(self, slot: int) -> None:
        """Pin a held slot so it cannot be evicted while a request restores it."""
        if slot not in self._key:
            raise ValueError(f"state slot {slot} holds no snapshot")
        self._ref[slot] += 1
        self._lru.pop(slot, None)

    def release(self, slot: int) -> None:
        """Unpin a slot pinned by `acquire`; at zero pins it becomes most recently used."""
        if self._ref[slot] <= 0:
            raise ValueError(f"state slot {slot} is not pinned")
        self._ref[slot] -= 1
        if self._ref[slot] == 0 and slot in self._key:
            self._lru[slot] = self._next_tick()

    def drop(self, block_hash: int) -> int | None:
        """Free the snapshot at `block_hash` (its block left the cache); returns the slot.

        Raises:
            ValueError: if the snapshot is pinned.
        """
        slot = self._by_hash.get(block_hash)
        if slot is None:
            return None
        if self._ref[slot] > 0:
            raise ValueError(f"state slot {slot} for hash {block_hash:#x} is pinned")
        self._forget(slot)
        return slot

    def clear(self) -> None:
        """Free every snapshot; pins are forgotten (callers drop their slot references)."""
        for slot in list(self._key):
            self._ref[slot] = 0
            self._forget(slot)

    def pins(self, slot: int) -> int:
        """Current pin count of `slot`."""
        return self._ref[slot]

    def check_integrity(self) -> None:
        """Raise `RuntimeError` naming the first broken invariant."""
        free = set(self._free)
        _require(len(free) == len(self._free), f"duplicate slot in free list {list(self._free)}")
        _require(not (free & set(self._key)), "a slot is both free and holding a snapshot")
        _require(len(free) + len(self._key) == self._num_slots, "slots lost or duplicated")
        _require(
            all(self._by_hash[h] == s for s, h in self._key.items())
            and len(self._by_hash) == len(self._key),
            "hash -> slot map is not the inverse of slot -> hash",
        )
        for slot in range(self._num_slots):
            evictable = slot in self._key and self._ref[slot] == 0
            _require((slot in self._lru) == evictable, f"slot {slot} LRU membership wrong")
            _require(slot in self._key or self._ref[slot] == 0, f"free slot {slot} is pinned")
        ticks = list(self._lru.values())
        _require(ticks == sorted(set(ticks)), f"LRU ticks not increasing: {ticks}")
        _require(all(t < self._tick for t in ticks), "LRU tick from the future")

    def _evict_lru(self) -> bool:
        if not self._lru:
            return False
        slot = next(iter(self._lru))
        self._evicted.append(self._key[slot])
        self._forget(slot)
        return True

    def _forget(self, slot: int) -> None:
        del self._by_hash[self._key.pop(slot)]
        self._lru.pop(slot, None)
        self._free.append(slot)

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick - 1


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(f"state slot pool corrupted: {message}")

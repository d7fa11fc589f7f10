"""A simulated instance's prefix cache: block-level LRU that emits real KV events.

Full blocks of `block_size` tokens are keyed by a chained engine hash (the engine's own hash,
as in SGLang; the gateway's index re-hashes the token ids it receives with PrfaaS's xxh3).
A request's blocks are touched leaf first, root last, so a parent is always used more
recently than its children and LRU eviction takes leaves before the prefixes they extend:
whenever a block is cached, so is its whole prefix (`check_integrity`).

Pure data structure: integers in, `BlockStored`/`BlockRemoved` events out; no clock, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from prfaas.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

_HASH_MASK = (1 << 63) - 1


class SimPrefixCache:
    """Block LRU with `capacity_blocks` (None: unbounded)."""

    def __init__(self, block_size: int, capacity_blocks: int | None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if capacity_blocks is not None and capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be > 0 or None, got {capacity_blocks}")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[int, int | None] = OrderedDict()  # key -> parent key

    def __len__(self) -> int:
        return len(self._lru)

    def keys(self, ids: Sequence[int]) -> list[int]:
        """Chained engine hashes of every full block of `ids` (a partial tail is never cached)."""
        bs, parent, out = self.block_size, 0, []
        tokens = tuple(ids)
        for start in range(0, len(tokens) - bs + 1, bs):
            parent = hash((parent, tokens[start : start + bs])) & _HASH_MASK
            out.append(parent)
        return out

    def match(self, keys: Sequence[int]) -> int:
        """How many leading blocks are cached. Pure read (does not touch the LRU order)."""
        for i, key in enumerate(keys):
            if key not in self._lru:
                return i
        return len(keys)

    def store(self, ids: Sequence[int], keys: Sequence[int]) -> list[KVEvent]:
        """Cache every full block of a computed prompt; returns the events to publish
        (`BlockStored` for the new blocks, then `BlockRemoved` for evictions)."""
        hit = self.match(keys)
        events: list[KVEvent] = []
        for i in range(hit, len(keys)):
            self._lru[keys[i]] = keys[i - 1] if i else None
        if hit < len(keys):
            bs = self.block_size
            events.append(
                BlockStored(
                    block_hashes=tuple(keys[hit:]),
                    parent_block_hash=keys[hit - 1] if hit else None,
                    token_ids=tuple(ids[hit * bs : len(keys) * bs]),
                    block_size=bs,
                )
            )
        for key in reversed(keys):
            self._lru.move_to_end(key)
        evicted = self._evict()
        if evicted:
            events.append(BlockRemoved(tuple(evicted)))
        return events

    def clear(self) -> list[KVEvent]:
        """Drop every block; returns the event to publish."""
        self._lru.clear()
        return [AllBlocksCleared()]

    def _evict(self) -> list[int]:
        if self.capacity_blocks is None:
            return []
        evicted = []
        while len(self._lru) > self.capacity_blocks:
            key, _ = self._lru.popitem(last=False)
            evicted.append(key)
        return evicted

    def check_integrity(self) -> None:
        """Assert the prefix invariant: every cached block's parent is cached too."""
        for key, parent in self._lru.items():
            assert parent is None or parent in self._lru, f"block {key} cached without parent"

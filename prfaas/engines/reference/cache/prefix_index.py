"""Prefix index of the block pool: chained hash <-> cached block, with LRU over unused ones.

Pure data structure (integers only). It knows which blocks are cached under which hash,
their parent links, and the least-recently-used order of the cached blocks no request
references; the pool owns reference counts and the free list.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import pairwise


class PrefixIndex:
    """Cached blocks keyed by chained block hash; evicts unreferenced leaves, LRU first.

    Leaves first: a block is evicted only when no cached block names it as parent, so a
    cached chain never has a hole. Because the pool releases a request's blocks deepest
    first, LRU order already puts children before their parents (checked by `check`).
    """

    def __init__(self, num_blocks: int) -> None:
        self._block_of: dict[int, int] = {}  # hash -> block
        self._hash_of: dict[int, int] = {}  # block -> hash
        self._parent: dict[int, int | None] = {}  # block -> parent hash
        self._num_children = [0] * num_blocks
        self._lru: OrderedDict[int, int] = OrderedDict()  # unreferenced block -> tick
        self._tick = 0

    def __len__(self) -> int:
        return len(self._hash_of)

    def lookup(self, block_hash: int) -> int | None:
        """The block cached under `block_hash`, if any."""
        return self._block_of.get(block_hash)

    def hash_of(self, block: int) -> int | None:
        """The hash `block` is cached under, or None if it is not cached."""
        return self._hash_of.get(block)

    def parent_of(self, block: int) -> int | None:
        """Parent hash of a cached block (None for a first block)."""
        return self._parent[block]

    @property
    def num_evictable(self) -> int:
        """Cached blocks no request references."""
        return len(self._lru)

    def evictable(self) -> tuple[int, ...]:
        """Unreferenced cached blocks, least recently used first."""
        return tuple(self._lru)

    def is_evictable(self, block: int) -> bool:
        """Whether `block` is cached and unreferenced."""
        return block in self._lru

    def insert(self, block: int, block_hash: int, parent: int | None) -> None:
        """Cache `block` under `block_hash`; `parent` must be cached (or None)."""
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        self._parent[block] = parent
        if parent is not None:
            self._num_children[self._block_of[parent]] += 1

    def pin(self, block: int) -> None:
        """A request now references `block`: it leaves the LRU."""
        self._lru.pop(block, None)

    def unpin(self, block: int) -> None:
        """No request references `block` any more: it becomes most recently used."""
        self._lru[block] = self._tick
        self._tick += 1

    def evict(self) -> tuple[int, int]:
        """Remove the least recently used unreferenced leaf; returns (block, hash).

        Raises:
            LookupError: nothing is evictable.
        """
        block = next((b for b in self._lru if self._num_children[b] == 0), None)
        if block is None:
            raise LookupError("no evictable cached block")
        del self._lru[block]
        block_hash = self._hash_of.pop(block)
        del self._block_of[block_hash]
        parent = self._parent.pop(block)
        if parent is not None:
            self._num_children[self._block_of[parent]] -= 1
        return block, block_hash

    def clear(self) -> list[int]:
        """Forget everything; returns the blocks that were evictable, in LRU order."""
        freed = list(self._lru)
        for block in self._hash_of:
            self._num_children[block] = 0
        self._block_of.clear()
        self._hash_of.clear()
        self._parent.clear()
        self._lru.clear()
        return freed

    def check(self, ref: Sequence[int]) -> None:
        """Raise `RuntimeError` on a broken invariant, given the pool's reference counts."""
        _require(len(self._block_of) == len(self._hash_of), "hash and block maps differ")
        _require(all(self._hash_of.get(b) == h for h, b in self._block_of.items()), "not 1:1")
        _require(set(self._parent) == set(self._hash_of), "parent links != cached blocks")
        children = [0] * len(self._num_children)
        for block, parent in self._parent.items():
            if parent is not None:
                _require(parent in self._block_of, f"block {block}'s parent is not cached")
                pb = self._block_of[parent]
                children[pb] += 1
                _require(ref[pb] >= ref[block], f"block {pb} has fewer refs than child {block}")
        _require(children == self._num_children, "child counts are wrong")
        for block in range(len(ref)):
            evictable = block in self._hash_of and ref[block] == 0
            _require((block in self._lru) == evictable, f"block {block} LRU membership wrong")
        self._check_lru()

    def _check_lru(self) -> None:
        ticks = list(self._lru.values())
        _require(all(a < b for a, b in pairwise(ticks)), f"LRU order {ticks}")
        _require(all(t < self._tick for t in ticks), "LRU tick from the future")
        for block, tick in self._lru.items():
            parent = self._parent[block]
            pb = None if parent is None else self._block_of[parent]
            if pb is not None and pb in self._lru:
                _require(self._lru[pb] > tick, f"evictable block {block} newer than its parent")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(f"prefix index corrupted: {message}")

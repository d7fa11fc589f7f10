"""Invariants of the hybrid prefix cache pool, checked from a read-only view of its state.

`BlockPool.check_integrity` builds a `PoolView` and calls `check_block_invariants`; each
check raises `RuntimeError` naming the broken invariant and the offending ids.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prfaas.engines.reference.pool_types import RequestBlocks
from prfaas.engines.reference.state_slots import StateSlotPool


@dataclass(frozen=True)
class PoolView:
    """The pool's internal structures, as `check_block_invariants` reads them."""

    num_blocks: int
    free: Sequence[int]
    ref: Sequence[int]
    index: Mapping[int, int]  # hash -> block
    hash_of: Mapping[int, int]  # block -> hash
    parent: Mapping[int, int | None]  # indexed block -> parent hash
    num_children: Sequence[int]
    lru: Mapping[int, int]  # block -> tick, in LRU order
    tick: int
    requests: Mapping[str, RequestBlocks]
    slots: StateSlotPool


def check_block_invariants(view: PoolView) -> None:
    """Raise `RuntimeError` on the first broken invariant of the pool."""
    _check_partition(view)
    _check_refcounts(view)
    _check_index(view)
    _check_lru(view)
    for request_id, req in view.requests.items():
        _check_request(view, request_id, req)
    _check_slots(view)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(f"block pool corrupted: {message}")


def _check_partition(v: PoolView) -> None:
    """Every block is exactly one of: free, evictable (LRU), referenced."""
    free = set(v.free)
    _require(len(free) == len(v.free), f"duplicate block in free list {list(v.free)}")
    _require(not (free & set(v.lru)), f"blocks both free and evictable: {free & set(v.lru)}")
    for b in range(v.num_blocks):
        if b in free:
            _require(v.ref[b] == 0, f"free block {b} has ref {v.ref[b]}")
            _require(b not in v.hash_of, f"free block {b} is indexed")
        elif b in v.lru:
            _require(v.ref[b] == 0, f"evictable block {b} has ref {v.ref[b]}")
            _require(b in v.hash_of, f"evictable block {b} is not indexed")
        else:
            _require(v.ref[b] > 0, f"block {b} is lost: not free, not evictable, ref 0")


def _check_refcounts(v: PoolView) -> None:
    """A block's reference count is the number of request tables holding it."""
    held: Counter[int] = Counter()
    for request_id, req in v.requests.items():
        _require(len(set(req.blocks)) == len(req.blocks), f"{request_id!r} holds a block twice")
        held.update(req.blocks)
    for b in range(v.num_blocks):
        _require(v.ref[b] == held[b], f"block {b} ref {v.ref[b]} but held {held[b]} times")


def _check_index(v: PoolView) -> None:
    """Index is a bijection, chains have no holes, child counts and refs are consistent."""
    _require(len(v.index) == len(v.hash_of), "index and hash_of differ in size")
    _require(all(v.hash_of.get(b) == h for h, b in v.index.items()), "index not inverse")
    _require(set(v.parent) == set(v.hash_of), "parent map keys differ from indexed blocks")
    children: Counter[int] = Counter()
    for b, parent in v.parent.items():
        if parent is None:
            continue
        _require(parent in v.index, f"block {b}'s parent {parent:#x} is not cached (hole)")
        pb = v.index[parent]
        children[pb] += 1
        _require(v.ref[pb] >= v.ref[b], f"parent block {pb} has fewer refs than child {b}")
    for b in range(v.num_blocks):
        _require(v.num_children[b] == children[b], f"block {b} child count wrong")


def _check_lru(v: PoolView) -> None:
    """LRU ticks increase front to back; an evictable child is older than its parent."""
    ticks = list(v.lru.values())
    _require(all(a < b for a, b in itertools.pairwise(ticks)), f"LRU order {ticks}")
    _require(all(t < v.tick for t in ticks), "LRU tick from the future")
    for b, tick in v.lru.items():
        parent = v.parent[b]
        pb = None if parent is None else v.index[parent]
        if pb is not None and pb in v.lru:
            # Releases go deepest first, so LRU order is already leaves-first.
            _require(v.lru[pb] > tick, f"evictable block {b} is newer than its parent {pb}")


def _check_request(v: PoolView, request_id: str, req: RequestBlocks) -> None:
    """A request's indexed blocks form its chain; the rest are unindexed (and unshared,
    unless a flush unindexed a shared prefix)."""
    _require(0 <= req.num_indexed <= len(req.blocks), f"{request_id!r} num_indexed out of range")
    parent: int | None = None
    for b in req.blocks[: req.num_indexed]:
        _require(b in v.hash_of, f"{request_id!r} chain block {b} is not indexed")
        _require(v.parent[b] == parent, f"{request_id!r} chain broken at block {b}")
        parent = v.hash_of[b]
    _require(req.last_hash == parent, f"{request_id!r} last_hash is not its chain's end")
    for b in req.blocks[req.num_indexed :]:
        _require(b not in v.hash_of, f"{request_id!r} private block {b} is indexed")
        # A flush turns a shared cached prefix into blocks still shared but unindexed.
        shared_ok = req.chain_broken
        _require(shared_ok or v.ref[b] == 1, f"{request_id!r} private block {b} is shared")
    if req.state_slot is not None:
        key = v.slots.key_of(req.state_slot)
        chain = {v.hash_of[b] for b in req.blocks[: req.num_indexed]}
        _require(key in chain, f"{request_id!r} pins slot {req.state_slot} off its chain")


def _check_slots(v: PoolView) -> None:
    """Snapshots are keyed by cached hashes; pins match requests; pinned blocks held."""
    pins = Counter(r.state_slot for r in v.requests.values() if r.state_slot is not None)
    for slot in range(v.slots.num_slots):
        _require(v.slots.pins(slot) == pins[slot], f"slot {slot} pins != requests pinning")
        key = v.slots.key_of(slot)
        if key is None:
            continue
        _require(key in v.index, f"slot {slot} keyed by uncached hash {key:#x}")
        if pins[slot]:
            _require(v.ref[v.index[key]] > 0, f"pinned slot {slot}'s block is unreferenced")

"""Invariants of the hybrid prefix cache pool, checked from a read-only view of its state.

`BlockPool.check_integrity` builds a `PoolView` and calls `check_block_invariants`; each
check raises `RuntimeError` naming the broken invariant and the offending ids. The prefix
index checks its own structure (`PrefixIndex.check`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prfaas.engines.reference.cache.pool_types import RequestBlocks
from prfaas.engines.reference.cache.prefix_index import PrefixIndex
from prfaas.engines.reference.cache.state_slots import StateSlotPool


@dataclass(frozen=True)
class PoolView:
    """The pool's internal structures, as `check_block_invariants` reads them."""

    num_blocks: int
    free: Sequence[int]
    ref: Sequence[int]
    index: PrefixIndex
    requests: Mapping[str, RequestBlocks]
    slots: StateSlotPool


def check_block_invariants(view: PoolView) -> None:
    """Raise `RuntimeError` on the first broken invariant of the pool."""
    _check_partition(view)
    _check_refcounts(view)
    view.index.check(view.ref)
    for request_id, req in view.requests.items():
        _check_request(view, request_id, req)
    _check_slots(view)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(f"block pool corrupted: {message}")


def _check_partition(v: PoolView) -> None:
    """Every block is exactly one of: free, cached and unreferenced (evictable), referenced."""
    free = set(v.free)
    _require(len(free) == len(v.free), f"duplicate block in free list {list(v.free)}")
    for b in range(v.num_blocks):
        cached = v.index.hash_of(b) is not None
        if b in free:
            _require(v.ref[b] == 0, f"free block {b} has ref {v.ref[b]}")
            _require(not cached, f"free block {b} is cached")
        else:
            _require(v.ref[b] > 0 or cached, f"block {b} is lost: not free, not cached, ref 0")
    evictable = v.index.evictable()
    _require(len(free) + len(evictable) + sum(r > 0 for r in v.ref) == v.num_blocks, "count")


def _check_refcounts(v: PoolView) -> None:
    """A block's reference count is the number of request tables holding it."""
    held: Counter[int] = Counter()
    for request_id, req in v.requests.items():
        _require(len(set(req.blocks)) == len(req.blocks), f"{request_id!r} holds a block twice")
        held.update(req.blocks)
    for b in range(v.num_blocks):
        _require(v.ref[b] == held[b], f"block {b} ref {v.ref[b]} but held {held[b]} times")


def _check_request(v: PoolView, request_id: str, req: RequestBlocks) -> None:
    """A request's indexed blocks form its chain; the rest are uncached (and unshared,
    unless a flush uncached a shared prefix)."""
    _require(0 <= req.num_indexed <= len(req.blocks), f"{request_id!r} num_indexed out of range")
    parent: int | None = None
    for b in req.blocks[: req.num_indexed]:
        _require(v.index.hash_of(b) is not None, f"{request_id!r} chain block {b} not cached")
        _require(v.index.parent_of(b) == parent, f"{request_id!r} chain broken at block {b}")
        parent = v.index.hash_of(b)
    _require(req.last_hash == parent, f"{request_id!r} last_hash is not its chain's end")
    for b in req.blocks[req.num_indexed :]:
        _require(v.index.hash_of(b) is None, f"{request_id!r} private block {b} is cached")
        shared_ok = req.chain_broken  # a flush leaves a shared prefix shared but uncached
        _require(shared_ok or v.ref[b] == 1, f"{request_id!r} private block {b} is shared")
    if req.state_slot is not None:
        key = v.slots.key_of(req.state_slot)
        chain = {v.index.hash_of(b) for b in req.blocks[: req.num_indexed]}
        _require(key in chain, f"{request_id!r} pins slot {req.state_slot} off its chain")


def _check_slots(v: PoolView) -> None:
    """Snapshots are keyed by cached hashes; pins match requests; pinned blocks held."""
    pins = Counter(r.state_slot for r in v.requests.values() if r.state_slot is not None)
    for slot in range(v.slots.num_slots):
        _require(v.slots.pins(slot) == pins[slot], f"slot {slot} pins != requests pinning")
        key = v.slots.key_of(slot)
        if key is None:
            continue
        block = v.index.lookup(key)
        _require(block is not None, f"slot {slot} keyed by uncached hash {key:#x}")
        if pins[slot] and block is not None:
            _require(v.ref[block] > 0, f"pinned slot {slot}'s block is unreferenced")

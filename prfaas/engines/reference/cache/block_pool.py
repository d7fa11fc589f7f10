"""Hybrid prefix cache pool: KV blocks for full-attention layers plus linear-state slots.

A pure data structure in the style of nano-vllm's block manager: integers in, integers out,
no tensors, no I/O, no clock (LRU order is a monotonic counter). The engine keeps the
tensors beside it: one KV tensor per full-attention layer indexed by block id, one state
tensor per linear layer indexed by state slot (`StateSlotPool`).

Kinds of block (paper 3.2):

* free: holds nothing, on the free list;
* private: written by one request, not (yet) in the prefix index;
* prefix-cache: a fully populated block entered in the index under its chained hash
  (`prfaas.common.hashing`); shared by reference count; kept after its requests finish and
  evicted least-recently-used once unreferenced;
* transfer-cache: a private block of a request allocated with `transfer=True` (the tail of a
  cross-cluster KV transfer, any length); never entered in the index, freed with its request.

Eviction goes leaves first: only an unreferenced indexed block with no indexed child is
evicted, so the index never holds a chain with a hole, and evicting a block also frees the
state snapshot keyed by its hash. Every index insert/evict/flush, and every state snapshot
kept (`StatesStored`) or evicted, is recorded as a KV event (`prfaas.protocol.kv_events`,
SGLang's format) for the engine to publish (`take_events`).

Typical engine use for one request:

    match = pool.match_prefix(hash_blocks(prompt[:-1], bs))   # always compute >= 1 token
    table = pool.allocate(rid, len(prompt), match)             # may raise OutOfKVCapacity
    ... restore state from match.state_slot, compute prompt[match.num_tokens:] ...
    pool.cache_full_blocks(rid, prompt)        # index the newly filled blocks
    slot = pool.save_state(rid, n)             # n block-aligned; copy the state if not None
    pool.reserve(rid, len(prompt) + 1) ...     # decode growth
    pool.free(rid)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from prfaas.common.hashing import hash_block
from prfaas.engines.reference.cache.pool_integrity import PoolView, check_block_invariants
from prfaas.engines.reference.cache.pool_types import (
    BlockPoolConfig,
    BlockPoolError,
    BlockPoolStats,
    OutOfKVCapacity,
    PrefixMatch,
    RequestBlocks,
    StaleMatch,
)
from prfaas.engines.reference.cache.prefix_index import PrefixIndex
from prfaas.engines.reference.cache.state_slots import StateSlotPool
from prfaas.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    StatesRemoved,
    StatesStored,
)

__all__ = [
    "BlockPool",
    "BlockPoolConfig",
    "BlockPoolError",
    "BlockPoolStats",
    "OutOfKVCapacity",
    "PrefixMatch",
    "StaleMatch",
]


class BlockPool:
    """One pool of KV blocks plus linear-state snapshot slots, with a chained-hash index.

    All methods are synchronous and leave the pool unchanged when they raise.
    """

    def __init__(self, config: BlockPoolConfig) -> None:
        self._config = config
        self._free: deque[int] = deque(range(config.num_blocks))
        self._ref = [0] * config.num_blocks
        self._index = PrefixIndex(config.num_blocks)
        self._slots = StateSlotPool(config.num_state_slots)
        self._requests: dict[str, RequestBlocks] = {}
        self._events: list[KVEvent] = []

    @property
    def config(self) -> BlockPoolConfig:
        """The pool's sizes."""
        return self._config

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation could get now: free plus evictable."""
        return len(self._free) + self._index.num_evictable

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self._config.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether `num_blocks` new blocks could be allocated now (back-pressure check)."""
        return num_blocks <= self.num_available_blocks

    # ------------------------------------------------------------------ lookups

    def match_prefix(self, block_hashes: Sequence[int]) -> PrefixMatch:
        """Longest cached prefix of the chained `block_hashes` of a prompt. Does not mutate.

        Pass the hashes of at most `len(prompt) - 1` tokens so at least one token is
        computed (the model needs it for the next-token logits).
        """
        ids: list[int] = []
        for block_hash in block_hashes:
            block = self._index.lookup(block_hash)
            if block is None:
                break
            ids.append(block)
        k, slot = len(ids), None
        while k > 0 and (slot := self._slots.lookup(block_hashes[k - 1])) is None:
            k -= 1
        return PrefixMatch(
            block_ids=tuple(ids[:k]),
            block_hashes=tuple(block_hashes[:k]),
            state_slot=slot if k > 0 else None,
            block_only_ids=tuple(ids),
            block_only_hashes=tuple(block_hashes[: len(ids)]),
            block_size=self._config.block_size,
        )

    def block_table(self, request_id: str) -> tuple[int, ...]:
        """The request's block ids, in token order."""
        return tuple(self._request(request_id).blocks)

    def num_cached_blocks(self, request_id: str) -> int:
        """How many leading blocks of the request are in the prefix index."""
        return self._request(request_id).num_indexed

    def is_cached(self, block_hash: int) -> bool:
        """Whether a block with this chained hash is in the prefix index."""
        return self._index.lookup(block_hash) is not None

    def has_request(self, request_id: str) -> bool:
        """Whether `request_id` holds blocks."""
        return request_id in self._requests

    # ------------------------------------------------------------------ allocation

    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        prefix: PrefixMatch | None = None,
        *,
        transfer: bool = False,
    ) -> tuple[int, ...]:
        """Give a new request blocks for `num_tokens` tokens, reusing `prefix`'s blocks.

        Mutates: pins the prefix blocks and its state slot (until `free`), takes the rest
        from the free list, evicting LRU leaves if needed. `transfer=True` makes the new
        blocks transfer-cache (never indexed). Returns the request's whole block table.

        Raises:
            ValueError: unknown sizes, or `request_id` already allocated.
            StaleMatch: `prefix` no longer matches the pool.
            OutOfKVCapacity: not enough free or evictable blocks.
        """
        prefix = prefix or self.match_prefix(())
        self._check_new_request(request_id, num_tokens, prefix)
        need = self.blocks_for_tokens(num_tokens) - len(prefix.block_ids)
        pinned_now = sum(1 for b in prefix.block_ids if self._index.is_evictable(b))
        self._check_capacity(need, self.num_available_blocks - pinned_now)
        for block in prefix.block_ids:
            self._acquire(block)
        if prefix.state_slot is not None:
            self._slots.acquire(prefix.state_slot)
        req = RequestBlocks(blocks=[*prefix.block_ids, *self._take(need)], transfer=transfer)
        req.num_indexed = len(prefix.block_ids)
        req.last_hash = prefix.block_hashes[-1] if prefix.block_hashes else None
        req.state_slot = prefix.state_slot
        self._requests[request_id] = req
        return tuple(req.blocks)

    def reserve(self, request_id: str, num_tokens: int) -> tuple[int, ...]:
        """Grow the request's table to hold `num_tokens` tokens; returns the new block ids.

        Raises:
            OutOfKVCapacity: not enough free or evictable blocks (nothing is allocated).
        """
        req = self._request(request_id)
        need = self.blocks_for_tokens(num_tokens) - len(req.blocks)
        if need <= 0:
            return ()
        self._check_capacity(need, self.num_available_blocks)
        new = self._take(need)
        req.blocks.extend(new)
        return tuple(new)

    def free(self, request_id: str) -> None:
        """Release a finished or aborted request's blocks and pinned state slot.

        Private and transfer blocks return to the free list; indexed blocks whose count
        drops to 0 become evictable, the deepest first in LRU order (vLLM's tail-first).
        """
        req = self._requests.pop(request_id, None)
        if req is None:
            raise KeyError(f"unknown request {request_id!r}")
        for block in reversed(req.blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._release(block)
        if req.state_slot is not None:
            self._slots.release(req.state_slot)

    # ------------------------------------------------------------------ caching

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int]) -> int:
        """Enter the request's newly filled full blocks into the prefix index.

        `token_ids` are the request's tokens from position 0 whose KV is already written;
        every full block past the indexed ones is hashed (chained) and indexed. A block whose
        hash is already cached (another request computed the same tokens, or this one
        recomputed a cached prefix that had no state to resume from) is adopted: the request
        references the cached copy and its own goes back to the free list, so its chain goes
        on past it. Transfer requests index nothing. Records one `BlockStored` for the new
        blocks. Returns the number of blocks newly indexed.
        """
        req = self._request(request_id)
        bs = self._config.block_size
        full = min(len(token_ids) // bs, len(req.blocks))
        if req.transfer or req.chain_broken or full <= req.num_indexed:
            return 0
        parent, first = req.last_hash, req.num_indexed
        hashes: list[int] = []
        for i in range(req.num_indexed, full):
            block_hash = hash_block(req.last_hash, token_ids[i * bs : (i + 1) * bs])
            cached = self._index.lookup(block_hash)
            if cached is None:
                self._index.insert(req.blocks[i], block_hash, req.last_hash)
                hashes.append(block_hash)
            else:  # only before the first new block: a cached chain has no hole
                self._adopt(req, i, cached)
                parent, first = block_hash, i + 1
            req.num_indexed, req.last_hash = i + 1, block_hash
        if hashes:
            tokens = tuple(token_ids[first * bs : (first + len(hashes)) * bs])
            self._events.append(BlockStored(tuple(hashes), parent, tokens, bs))
        return len(hashes)

    def _adopt(self, req: RequestBlocks, position: int, cached: int) -> None:
        """Swap the request's private block at `position` for the `cached` block holding
        the same tokens' KV (the private copy returns to the free list)."""
        own = req.blocks[position]
        self._acquire(cached)
        req.blocks[position] = cached
        self._ref[own] -= 1
        if self._ref[own] == 0:
            self._release(own)

    def save_state(self, request_id: str, num_tokens: int) -> int | None:
        """Reserve a snapshot slot for the request's linear state at `num_tokens` tokens.

        `num_tokens` must be a positive multiple of the block size whose last block is in
        the request's indexed chain. Returns the slot to copy the state into, or None when
        there is nothing to write: already saved, block not indexed (transfer or duplicate
        chain), or every slot pinned.
        """
        bs = self._config.block_size
        if num_tokens <= 0 or num_tokens % bs:
            raise ValueError(f"num_tokens must be a positive multiple of {bs}, got {num_tokens}")
        req = self._request(request_id)
        n = num_tokens // bs
        if n > req.num_indexed:
            return None
        block_hash = self._index.hash_of(req.blocks[n - 1])
        if block_hash is None:
            return None
        slot = self._slots.save(block_hash)
        evicted = self._slots.take_evicted()
        if evicted:
            self._events.append(StatesRemoved(tuple(evicted)))
        if slot is not None:
            self._events.append(StatesStored((block_hash,)))
        return slot

    def clear(self) -> None:
        """Flush the prefix index and every snapshot; records `AllBlocksCleared`.

        Unreferenced cached blocks return to the free list (LRU order); blocks running
        requests hold stay theirs as private blocks, and those requests index nothing more.
        """
        self._free.extend(self._index.clear())
        self._slots.clear()
        for req in self._requests.values():
            req.num_indexed, req.last_hash, req.chain_broken = 0, None, True
            req.state_slot = None
        self._events.append(AllBlocksCleared())

    def take_events(self) -> list[KVEvent]:
        """The KV events recorded since the last call, oldest first (then forgotten)."""
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ introspection

    def stats(self) -> BlockPoolStats:
        """Current occupancy."""
        return BlockPoolStats(
            num_blocks=self._config.num_blocks,
            free_blocks=len(self._free),
            cached_blocks=len(self._index),
            evictable_blocks=self._index.num_evictable,
            used_blocks=self._config.num_blocks - self.num_available_blocks,
            num_state_slots=self._slots.num_slots,
            held_state_slots=self._slots.num_held,
            num_requests=len(self._requests),
        )

    def free_block_ids(self) -> tuple[int, ...]:
        """The free list, next-to-allocate first (for tests and debugging)."""
        return tuple(self._free)

    def evictable_block_ids(self) -> tuple[int, ...]:
        """Unreferenced cached blocks, least recently used first."""
        return self._index.evictable()

    def check_integrity(self) -> None:
        """Verify every invariant; raise `RuntimeError` naming the first broken one."""
        self._slots.check_integrity()
        check_block_invariants(
            PoolView(
                num_blocks=self._config.num_blocks,
                free=self._free,
                ref=self._ref,
                index=self._index,
                requests=self._requests,
                slots=self._slots,
            )
        )

    # ------------------------------------------------------------------ internals

    def _request(self, request_id: str) -> RequestBlocks:
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request {request_id!r}")
        return req

    def _check_new_request(self, request_id: str, num_tokens: int, prefix: PrefixMatch) -> None:
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already holds blocks")
        if num_tokens < prefix.num_tokens:
            raise ValueError(
                f"num_tokens {num_tokens} is below the {prefix.num_tokens} prefix tokens"
            )
        if prefix.block_size != self._config.block_size:
            raise ValueError(
                f"match block_size {prefix.block_size} != pool {self._config.block_size}"
            )
        for block, block_hash in zip(prefix.block_ids, prefix.block_hashes, strict=True):
            if self._index.lookup(block_hash) != block:
                raise StaleMatch(f"block {block} no longer cached under {block_hash:#x}")
        slot = prefix.state_slot
        if slot is not None and (
            not prefix.block_hashes or self._slots.lookup(prefix.block_hashes[-1]) != slot
        ):
            raise StaleMatch(f"state slot {slot} no longer holds the match's snapshot")

    @staticmethod
    def _check_capacity(requested: int, available: int) -> None:
        if requested > available:
            raise OutOfKVCapacity(requested, available)

    def _acquire(self, block: int) -> None:
        self._ref[block] += 1
        self._index.pin(block)

    def _release(self, block: int) -> None:
        if self._index.hash_of(block) is not None:
            self._index.unpin(block)
        else:
            self._free.append(block)

    def _take(self, n: int) -> list[int]:
        evicted: list[int] = []
        while len(self._free) < n:
            evicted.append(self._evict_one())
        if evicted:
            self._events.append(BlockRemoved(tuple(evicted)))
        taken = [self._free.popleft() for _ in range(n)]
        for block in taken:
            self._ref[block] = 1
        return taken

    def _evict_one(self) -> int:
        """Evict one cached block (and its snapshot) to the free list; returns its hash."""
        block, block_hash = self._index.evict()
        self._slots.drop(block_hash)
        self._free.append(block)
        return block_hash

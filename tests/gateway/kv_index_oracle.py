"""The previous global KV index (dicts and sets, 550-750 bytes per entry), kept only as the
test oracle of `prfaas.gateway.kv_index`: simple enough to be right by reading.

Engines publish `BlockStored` with their own block hashes plus the token ids; the index
re-hashes the tokens with PrfaaS's chained xxh3-64 (`prfaas.common.hashing`) so lookups never
depend on an engine's hash function. Each instance keeps a map engine-hash -> our hash to
resolve parents and removals. Memory is bounded: past `max_blocks` entries the oldest
insertions are forgotten (the index may then under-report a cache, never over-report it).

Hybrid engines (linear attention beside full attention) reuse a prefix only up to a block
at whose end they kept the linear states. An instance that has sent `StatesStored` is such
an engine: its match is cut back to the last block it kept states for (none: 0). vLLM keeps
none where a prefix was first computed, so without this the index counted that prefix one
request early (`benchmarks/vllm_prefix_reuse.py`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from prfaas.common.hashing import hash_blocks
from prfaas.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    StatesRemoved,
    StatesStored,
)

_NONE: frozenset[str] = frozenset()  # holders of an unknown block

logger = logging.getLogger(__name__)


@dataclass
class _InstanceBlocks:
    ours: dict[int, int] = field(default_factory=dict)  # engine hash -> our hash
    states: set[int] | None = None
    """Our hashes of the blocks after which a hybrid engine kept its linear states (None:
    the engine has reported no states, so every cached block is reusable)."""


class OracleKVIndex:
    """Per-instance prefix-block index with longest-prefix lookups across instances."""

    def __init__(self, *, block_size: int, max_blocks: int = 4_000_000) -> None:
        if block_size <= 0 or max_blocks <= 0:
            raise ValueError(
                f"block_size and max_blocks must be > 0, got {block_size}, {max_blocks}"
            )
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._instances: dict[str, _InstanceBlocks] = {}
        self._hybrid: set[str] = set()  # instances that have reported kept states
        self._holders: dict[int, set[str]] = {}  # our hash -> instances holding it
        self._fifo: OrderedDict[tuple[str, int], None] = OrderedDict()  # (instance, engine hash)
        self.rejected_events = 0

    def __len__(self) -> int:
        """Number of (instance, block) entries held."""
        return len(self._fifo)

    def instances(self) -> list[str]:
        return list(self._instances)

    def apply(self, instance_id: str, events: Iterable[KVEvent]) -> None:
        """Apply one engine's events in order (mutates the index). States stored are taken
        after the batch's blocks: vLLM sends a step's Mamba groups before its attention."""
        states: list[StatesStored] = []
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(instance_id, event)
            elif isinstance(event, BlockRemoved):
                self._remove(instance_id, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.clear_instance(instance_id)
            elif isinstance(event, StatesStored):
                states.append(event)
            elif isinstance(event, StatesRemoved):
                self._states_removed(instance_id, event.block_hashes)
        for stored in states:
            self._states_stored(instance_id, stored.block_hashes)

    def _blocks_of(self, instance_id: str) -> _InstanceBlocks:
        """The instance's blocks, made on first sight: a hybrid engine's (one that has ever
        reported kept states, a clear or restart since included) keeping none yet."""
        blocks = self._instances.get(instance_id)
        if blocks is None:
            states: set[int] | None = set() if instance_id in self._hybrid else None
            blocks = self._instances[instance_id] = _InstanceBlocks(states=states)
        return blocks

    def _states_stored(self, instance_id: str, engine_hashes: Sequence[int]) -> None:
        self._hybrid.add(instance_id)
        blocks = self._blocks_of(instance_id)
        if blocks.states is None:
            blocks.states = set()
        for engine_hash in engine_hashes:
            ours = blocks.ours.get(engine_hash)
            if ours is not None:  # else its block is not indexed: nothing to reuse there
                blocks.states.add(ours)

    def _states_removed(self, instance_id: str, engine_hashes: Sequence[int]) -> None:
        blocks = self._instances.get(instance_id)
        if blocks is None or blocks.states is None:
            return
        for engine_hash in engine_hashes:
            ours = blocks.ours.get(engine_hash)
            if ours is not None:
                blocks.states.discard(ours)

    def clear_instance(self, instance_id: str) -> None:
        """Forget everything an instance caches (restart, flush, or a lost event stream)."""
        blocks = self._instances.pop(instance_id, None)
        if blocks is not None:
            self._remove_known(instance_id, blocks, list(blocks.ours))

    def _stored(self, instance_id: str, event: BlockStored) -> None:
        n = len(event.block_hashes)
        if event.block_size != self.block_size or len(event.token_ids) != n * self.block_size:
            self.rejected_events += 1
            logger.warning(
                "%s: BlockStored with block_size %d / %d tokens for %d blocks does "
                "not match the index's block size %d; ignored",
                instance_id,
                event.block_size,
                len(event.token_ids),
                n,
                self.block_size,
            )
            return
        blocks = self._blocks_of(instance_id)
        parent: int | None = None
        if event.parent_block_hash is not None:
            parent = blocks.ours.get(event.parent_block_hash)
            if parent is None:  # parent unknown (evicted from the index or a missed event)
                self.rejected_events += 1
                return
        ours = hash_blocks(event.token_ids, self.block_size, parent=parent)  # packs ids once
        for engine_hash, our_hash in zip(event.block_hashes, ours, strict=True):
            self._add(instance_id, blocks, engine_hash, our_hash)

    def _add(self, instance_id: str, blocks: _InstanceBlocks, engine_hash: int, ours: int) -> None:
        key = (instance_id, engine_hash)
        if key in self._fifo:
            self._fifo.move_to_end(key)
            return
        blocks.ours[engine_hash] = ours
        self._holders.setdefault(ours, set()).add(instance_id)
        self._fifo[key] = None
        while len(self._fifo) > self.max_blocks:
            (old_instance, old_hash), _ = self._fifo.popitem(last=False)
            self._remove(old_instance, (old_hash,))

    def _remove(self, instance_id: str, engine_hashes: Sequence[int]) -> None:
        blocks = self._instances.get(instance_id)
        if blocks is not None:
            self._remove_known(instance_id, blocks, engine_hashes)

    def _remove_known(
        self, instance_id: str, blocks: _InstanceBlocks, engine_hashes: Sequence[int]
    ) -> None:
        for engine_hash in engine_hashes:
            ours = blocks.ours.pop(engine_hash, None)
            if ours is None:
                continue
            if blocks.states is not None:
                blocks.states.discard(ours)
            self._fifo.pop((instance_id, engine_hash), None)
            holders = self._holders.get(ours)
            if holders is not None:
                holders.discard(instance_id)
                if not holders:
                    del self._holders[ours]

    def longest_prefix(self, block_hashes: Iterable[int]) -> dict[str, int]:
        """Cached prefix length in tokens per instance for a request's chained block hashes
        (every known instance appears, 0 where nothing matches). Pure read. Stops reading
        `block_hashes` once no instance matches (pass `iter_block_hashes` to hash lazily).
        """
        if not self._instances:
            return {}
        result = dict.fromkeys(self._instances, 0)
        alive = set(self._instances)
        holders_of = self._holders.get
        hybrid = {i: b.states for i, b in self._instances.items() if b.states is not None}
        seen: list[int] = []  # the hashes read, kept only when a hybrid instance needs them
        if hybrid:
            block_hashes = _kept(block_hashes, seen)
        matched = 0  # blocks every instance in `alive` holds
        for h in block_hashes:
            holders = holders_of(h, _NONE)
            if alive <= holders:  # the common case: no instance drops out at this block
                matched += 1
                continue
            still = alive & holders
            for gone in alive - still:
                result[gone] = matched * self.block_size
            alive = still
            if not alive:
                break
            matched += 1
        for inst in alive:
            result[inst] = matched * self.block_size
        for inst, states in hybrid.items():
            blocks = result[inst] // self.block_size
            while blocks > 0 and seen[blocks - 1] not in states:
                blocks -= 1
            result[inst] = blocks * self.block_size
        return result


def _kept(hashes: Iterable[int], into: list[int]) -> Iterator[int]:
    """`hashes`, each also appended to `into` as it is read."""
    for h in hashes:
        into.append(h)
        yield h

"""What a KV-event publisher's engine caches now, rebuilt from the events it published, so
the publisher can answer a snapshot request (`publisher.py`) with events that rebuild it.

A pure data structure: events in, events out. It keeps per cached block its parent and its
token ids (a subscriber re-hashes tokens with its own function), and the blocks after which
a hybrid engine kept linear states, with the same meaning a subscriber's index gives them
(`prfaas.gateway.kv_index`): a block removed takes its states with it, `AllBlocksCleared`
forgets every block and state, and an engine that ever sent `StatesStored` stays hybrid
even with no states kept, a clear since included (an empty `StatesStored` in the snapshot
says so: the blocks a hybrid engine stores after a clear, before it reports states kept,
are not reusable, and counting them whole over-reported).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prfaas.protocol.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    StatesRemoved,
    StatesStored,
    TokenIds,
)


@dataclass(frozen=True)
class _Block:
    parent: int | None
    tokens: tuple[int, ...]
    block_size: int
    lora_id: int | None


class CacheMirror:
    """The cached blocks and kept states that a stream of KV events describes."""

    def __init__(self) -> None:
        # Insertion order is a parent-first order: an engine stores a block only after its
        # parent, and evicts leaves first; a block stored again after its removal moves last.
        self._blocks: dict[int, _Block] = {}
        self._states: set[int] = set()
        self._hybrid = False

    def __len__(self) -> int:
        """Cached blocks."""
        return len(self._blocks)

    def apply(self, events: Iterable[KVEvent]) -> None:
        """Apply one batch's events in order (mutates)."""
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self._blocks.pop(block_hash, None)
                    self._states.discard(block_hash)
            elif isinstance(event, AllBlocksCleared):
                self._blocks.clear()
                self._states.clear()
            elif isinstance(event, StatesStored):
                self._hybrid = True
                self._states.update(h for h in event.block_hashes if h in self._blocks)
            elif isinstance(event, StatesRemoved):
                self._states.difference_update(event.block_hashes)

    def _stored(self, event: BlockStored[TokenIds]) -> None:
        parent, size = event.parent_block_hash, event.block_size
        for i, block_hash in enumerate(event.block_hashes):
            if block_hash not in self._blocks:  # a repeat keeps its place after its parent
                tokens = tuple(event.token_ids[i * size : (i + 1) * size])
                self._blocks[block_hash] = _Block(parent, tokens, size, event.lora_id)
            parent = block_hash

    def snapshot(self, max_blocks_per_event: int = 64) -> list[KVEvent]:
        """Events that rebuild this cache from nothing: `BlockStored` chains, parents first
        (at most `max_blocks_per_event` blocks each), then the kept states (one
        `StatesStored`, empty for a hybrid engine that keeps none). Does not mutate."""
        events: list[KVEvent] = list(self._chains(max_blocks_per_event))
        if self._hybrid:
            events.append(StatesStored(tuple(h for h in self._blocks if h in self._states)))
        return events

    def _chains(self, limit: int) -> Iterator[BlockStored[TokenIds]]:
        """Runs of blocks each the child of the one before, as `BlockStored` events."""
        run: list[int] = []
        first: _Block | None = None
        for block_hash, block in self._blocks.items():
            continues = (
                first is not None
                and block.parent == run[-1]
                and (block.block_size, block.lora_id) == (first.block_size, first.lora_id)
                and len(run) < limit
            )
            if not continues and first is not None:
                yield self._event(run, first)
                run = []
            if not run:
                first = block
            run.append(block_hash)
        if first is not None:
            yield self._event(run, first)

    def _event(self, run: list[int], first: _Block) -> BlockStored[TokenIds]:
        tokens = tuple(t for h in run for t in self._blocks[h].tokens)
        return BlockStored(tuple(run), first.parent, tokens, first.block_size, first.lora_id)

"""`KVIndexManager`: which instance caches which prefix blocks, fed by engines' KV events.

Engines publish `BlockStored` with their own block hashes plus the token ids; the index
re-hashes the tokens with PrfaaS's chained xxh3-64 (`prfaas.common.hashing`) so lookups never
depend on an engine's hash function. Two kinds of table hold it (`table.HashTable`, numpy):

* one block table, our hash -> (holder-set id, last stored or used): what a lookup reads;
* per instance, a translation table, engine hash -> our hash: what resolves an event's
  parent, a removal or a kept state.

Memory is bounded in bytes (`max_index_mb`): the block table stops growing at its share of
the budget, then a block that finds its two buckets full evicts the least recently stored or
used block there. A translation whose block was evicted is harmless (it still translates
correctly) and is purged before its table grows, so translations stay as many as the
(instance, block) entries. The index may then under-report a cache, never over-report it.

Hybrid engines (linear attention beside full attention) reuse a prefix only up to a block
at whose end they kept the linear states. An instance that has sent `StatesStored` is such
an engine: its match is cut back to the last block it kept states for (none: 0). vLLM keeps
none where a prefix was first computed, so without this the index counted that prefix one
request early (`benchmarks/vllm_prefix_reuse.py`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from prfaas.common.hashing import hash_blocks
from prfaas.gateway.kv_index.holder_sets import EMPTY, HolderSets
from prfaas.gateway.kv_index.table import U64, WAYS, HashTable, as_keys
from prfaas.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    StatesRemoved,
    StatesStored,
)

logger = logging.getLogger(__name__)

_BLOCK_COLUMNS = {"holders": np.uint32, "used": np.uint64}
_TRANSLATION_COLUMNS = {"ours": np.uint64}
# Bytes of one block slot plus one translation slot: the block table may take as many
# slots as the budget holds such pairs (translations number about the blocks held).
_SLOT_PAIR_BYTES = (8 + 4 + 8) + (8 + 8)
# Buffered blocks past which `apply` applies at once (a read applies what is buffered): at
# a few microseconds a block, a flush holds the loop about a millisecond.
_FLUSH_BLOCKS = 256
# Lazily hashed lookups read their hashes in chunks of at most this many.
_MAX_CHUNK = 4096


@dataclass
class _Instance:
    bit: int  # its member number in holder sets
    ours: HashTable = field(default_factory=lambda: HashTable(_TRANSLATION_COLUMNS))
    states: HashTable | None = None
    """Our hashes of the blocks after which a hybrid engine kept its linear states (None:
    the engine has reported no states, so every cached block is reusable)."""
    dangling: int = 0  # translations whose block was evicted since the last purge


class KVIndexManager:
    """Per-instance prefix-block index with longest-prefix lookups across instances."""

    def __init__(self, *, block_size: int, max_index_mb: float = 1024.0) -> None:
        if block_size <= 0 or max_index_mb <= 0:
            raise ValueError(
                f"block_size and max_index_mb must be > 0, got {block_size}, {max_index_mb}"
            )
        self.block_size = block_size
        self.max_index_mb = max_index_mb
        max_buckets = max(1, int(max_index_mb * 2**20 / (WAYS * _SLOT_PAIR_BYTES)))
        self._blocks = HashTable(_BLOCK_COLUMNS, max_buckets=max_buckets)
        self._columns()
        self._sets = HolderSets()
        self._bits: dict[str, int] = {}  # instance id -> member number, for the index's life
        self._names: list[str] = []  # member number -> instance id
        self._instances: dict[str, _Instance] = {}
        self._clock = 0  # ticks: one per block stored, one per lookup
        self._entries = 0
        self._rejected = 0
        self.evicted_blocks = 0
        self._pending: dict[str, list[KVEvent]] = {}  # events not applied yet, per instance
        self._pending_blocks = 0

    def __len__(self) -> int:
        """Number of (instance, block) entries held."""
        self._flush()
        return self._entries

    @property
    def rejected_events(self) -> int:
        """Events ignored: a block size not the index's, or a parent it does not know."""
        self._flush()
        return self._rejected

    @property
    def nbytes(self) -> int:
        """Bytes held by the index's arrays."""
        self._flush()
        tables = [self._blocks.nbytes, self._sets.nbytes]
        for instance in self._instances.values():
            tables.append(instance.ours.nbytes)
            if instance.states is not None:
                tables.append(instance.states.nbytes)
        return sum(tables)

    def instances(self) -> list[str]:
        self._flush()
        return list(self._instances)

    def apply(self, instance_id: str, events: Iterable[KVEvent]) -> None:
        """Take one engine's events, in order; states stored are taken after the batch's
        blocks (vLLM sends a step's Mamba groups before its attention). They wait in a
        buffer until `_FLUSH_BLOCKS` blocks are waiting or the index is read, then go in
        together: the array operations cost about the same for one block as for hundreds,
        and engines send a few at a time."""
        pending = self._pending.setdefault(instance_id, [])
        states: list[KVEvent] = []
        for event in events:
            if isinstance(event, StatesStored):
                states.append(event)
                continue
            pending.append(event)
            if isinstance(event, BlockStored):
                self._pending_blocks += len(event.block_hashes)
        pending.extend(states)
        if self._pending_blocks >= _FLUSH_BLOCKS:
            self._flush()

    def _flush(self) -> None:
        """Apply the buffered events, one instance at a time."""
        pending, self._pending, self._pending_blocks = self._pending, {}, 0
        for instance_id, events in pending.items():
            self._apply_now(instance_id, events)

    def _apply_now(self, instance_id: str, events: Sequence[KVEvent]) -> None:
        """Apply an instance's events in order, each run of consecutive `BlockStored` as
        one batch."""
        run: list[BlockStored] = []
        for event in events:
            if isinstance(event, BlockStored):
                run.append(event)
                continue
            if run:
                self._stored(instance_id, run)
                run = []
            if isinstance(event, BlockRemoved):
                self._removed(instance_id, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self._forget(instance_id)
            elif isinstance(event, StatesStored):
                self._states_stored(instance_id, event.block_hashes)
            elif isinstance(event, StatesRemoved):
                self._states_removed(instance_id, event.block_hashes)
        if run:
            self._stored(instance_id, run)

    def clear_instance(self, instance_id: str) -> None:
        """Forget everything an instance caches (restart, flush, or a lost event stream).
        What is buffered is applied first, so the rejected-event count stays exact."""
        self._flush()
        self._forget(instance_id)

    def _forget(self, instance_id: str) -> None:
        instance = self._instances.pop(instance_id, None)
        if instance is not None:
            _, rows = instance.ours.items()
            self._release(instance.bit, rows["ours"])

    def _instance(self, instance_id: str) -> _Instance:
        instance = self._instances.get(instance_id)
        if instance is None:
            bit = self._bits.get(instance_id)
            if bit is None:
                bit = self._bits[instance_id] = len(self._names)
                self._names.append(instance_id)
            instance = self._instances[instance_id] = _Instance(bit)
        return instance

    # -- stores ---------------------------------------------------------------------------

    def _stored(self, instance_id: str, events: Sequence[BlockStored]) -> None:
        """Re-hash a run of stores (each chained to its parent: one stored before the run,
        or earlier in it) and add them in one batch."""
        valid = [e for e in events if self._fits(instance_id, e)]
        if not valid:
            return
        instance = self._instance(instance_id)
        parents = [e.parent_block_hash for e in valid if e.parent_block_hash is not None]
        known = self._translate(instance, parents)
        engine: list[int] = []
        ours: list[int] = []
        chained: dict[int, int] = {}
        for event in valid:
            parent: int | None = None
            if event.parent_block_hash is not None:
                parent = chained.get(event.parent_block_hash)
                if parent is None:
                    parent = known.get(event.parent_block_hash)
                if parent is None:  # unknown (evicted from the index or a missed event)
                    self._rejected += 1
                    continue
            hashes = hash_blocks(event.token_ids, self.block_size, parent=parent)
            engine.extend(event.block_hashes)
            ours.extend(hashes)
            chained.update(zip(event.block_hashes, hashes, strict=True))
        if engine:
            self._add(instance, _engine_keys(engine), as_keys(ours))

    def _fits(self, instance_id: str, event: BlockStored) -> bool:
        n = len(event.block_hashes)
        if event.block_size == self.block_size and len(event.token_ids) == n * self.block_size:
            return True
        self._rejected += 1
        logger.warning(
            "%s: BlockStored with block_size %d / %d tokens for %d blocks does "
            "not match the index's block size %d; ignored",
            instance_id,
            event.block_size,
            len(event.token_ids),
            n,
            self.block_size,
        )
        return False

    def _translate(self, instance: _Instance, engine_hashes: Sequence[int]) -> dict[int, int]:
        """Our hash of each engine hash the instance's table holds."""
        if not engine_hashes:
            return {}
        slots = instance.ours.find(_engine_keys(engine_hashes))
        ours = instance.ours.column("ours")[slots[slots >= 0]].tolist()
        known = itertools.compress(engine_hashes, (slots >= 0).tolist())
        return dict(zip(known, ours, strict=True))

    def _add(self, instance: _Instance, engine: U64, ours: U64) -> None:
        """Translate new engine hashes, then mark the blocks held. A known engine hash
        keeps the block it translated to (its removal will name that one)."""
        distinct, first = np.unique(engine, return_index=True)
        slots = instance.ours.find(distinct)
        known = slots >= 0
        held = ours.copy()
        held[first[known]] = instance.ours.column("ours")[slots[known]]
        new = ~known
        instance.ours.insert(distinct[new], {"ours": ours[first[new]]})
        self._hold(instance.bit, held)
        if instance.dangling > max(256, instance.ours.size // 4):
            self._purge(instance)

    def _hold(self, bit: int, ours: U64) -> None:
        """Mark `ours` held by member `bit`, stored now: the chain's first block counts as
        the latest, so a full bucket evicts chains from their ends, as engines do."""
        distinct, first = np.unique(ours, return_index=True)
        used = np.uint64(self._clock) + (len(ours) - first).astype(np.uint64)
        self._clock += len(ours) + 1
        slots = self._blocks.find(distinct)
        found = slots >= 0
        at = slots[found]
        before = self._holders[at]
        after = self._sets.changed(before, bit, add=True)
        self._entries += int((after != before).sum())
        self._holders[at] = after
        self._used[at] = used[found]
        fresh = distinct[~found]
        if len(fresh):
            single = self._sets.changed(np.full(len(fresh), EMPTY, np.uint32), bit, add=True)
            self._entries += len(fresh)
            self._insert_blocks(fresh, single, used[~found])

    def _insert_blocks(self, keys: U64, holders: np.ndarray, used: np.ndarray) -> None:
        left, rows = self._blocks.insert(keys, {"holders": holders, "used": used})
        self._columns()
        while len(left):  # at the budget: evict the least recently used in their buckets
            self._evict(np.unique(self._blocks.victims(left, "used")))
            left, rows = self._blocks.insert(left, rows)
            self._columns()

    def _columns(self) -> None:
        """Views of the block table's columns (again: an insert may have reallocated it)."""
        self._holders = self._blocks.column("holders")
        self._used = self._blocks.column("used")

    def _evict(self, slots: np.ndarray) -> None:
        set_ids = self._holders[slots]
        distinct, counts = np.unique(set_ids, return_counts=True)
        for set_id, count in zip(distinct.tolist(), counts.tolist(), strict=True):
            for bit in _members(self._sets.members(set_id)):
                self._entries -= count
                instance = self._instances.get(self._names[bit])
                if instance is not None:
                    instance.dangling += count
        self._sets.retain(set_ids, -1)
        self._blocks.delete(slots)
        self.evicted_blocks += len(slots)

    def _purge(self, instance: _Instance) -> None:
        """Drop the instance's translations whose block no longer lists it."""
        engine, rows = instance.ours.items()
        slots = self._blocks.find(rows["ours"])
        found = slots >= 0
        listed = np.zeros(len(engine), dtype=bool)
        word, shift = divmod(instance.bit, 64)
        holder_bits = self._sets.bits[self._holders[slots[found]], word]
        listed[found] = (holder_bits >> np.uint64(shift)) & np.uint64(1) == 1
        instance.ours.delete(instance.ours.find(engine[~listed]))
        if instance.states is not None:
            gone = instance.states.find(rows["ours"][~listed])
            instance.states.delete(gone[gone >= 0])
        instance.dangling = 0

    # -- removals and states --------------------------------------------------------------

    def _removed(self, instance_id: str, engine_hashes: Sequence[int]) -> None:
        instance = self._instances.get(instance_id)
        if instance is None or not engine_hashes:
            return
        slots = instance.ours.find(np.unique(_engine_keys(engine_hashes)))
        slots = slots[slots >= 0]
        ours = instance.ours.column("ours")[slots].copy()
        instance.ours.delete(slots)
        if instance.states is not None:
            kept = instance.states.find(ours)
            instance.states.delete(kept[kept >= 0])
        self._release(instance.bit, ours)

    def _release(self, bit: int, ours: U64) -> None:
        """Member `bit` no longer holds `ours`; blocks nobody holds go."""
        slots = self._blocks.find(np.unique(ours))
        at = slots[slots >= 0]
        before = self._holders[at]
        after = self._sets.changed(before, bit, add=False)
        self._entries -= int((after != before).sum())
        self._holders[at] = after
        orphans = at[after == EMPTY]
        self._sets.retain(after[after == EMPTY], -1)
        self._blocks.delete(orphans)

    def _states_stored(self, instance_id: str, engine_hashes: Sequence[int]) -> None:
        instance = self._instance(instance_id)
        if instance.states is None:
            instance.states = HashTable({})
        ours = np.unique(as_keys(list(self._translate(instance, engine_hashes).values())))
        fresh = ours[instance.states.find(ours) < 0]  # else its block is not indexed
        instance.states.insert(fresh, {})

    def _states_removed(self, instance_id: str, engine_hashes: Sequence[int]) -> None:
        instance = self._instances.get(instance_id)
        if instance is None or instance.states is None:
            return
        ours = as_keys(list(self._translate(instance, engine_hashes).values()))
        kept = instance.states.find(np.unique(ours))
        instance.states.delete(kept[kept >= 0])

    # -- lookups --------------------------------------------------------------------------

    def longest_prefix(self, block_hashes: Iterable[int]) -> dict[str, int]:
        """Cached prefix length in tokens per instance for a request's chained block hashes
        (every known instance appears, 0 where nothing matches). Stops reading
        `block_hashes` once no instance matches (pass `iter_block_hashes` to hash lazily).
        Marks the blocks it matched as used (what the budget keeps longest)."""
        self._flush()
        if not self._instances:
            return {}
        result = dict.fromkeys(self._instances, 0)
        words = self._sets.bits.shape[1]
        alive = _words(sum(1 << i.bit for i in self._instances.values()), words)
        read: list[U64] = []
        used: list[np.ndarray] = []  # slots of the blocks some instance matched
        matched = 0  # blocks read before the current chunk
        for chunk in _chunks(block_hashes):
            keys = as_keys(chunk)
            read.append(keys)
            slots = self._blocks.find(keys)
            holders = np.where(slots >= 0, np.take(self._holders, slots), EMPTY)
            bits = np.take(self._sets.bits, holders, axis=0) & alive
            held = np.bitwise_and.accumulate(bits, axis=0)
            before = np.vstack([alive, held[:-1]])
            for row in np.flatnonzero((held != before).any(axis=1)).tolist():
                for bit in _members(_int(before[row] & ~held[row])):
                    result[self._names[bit]] = (matched + row) * self.block_size
            used.append(slots[: int(held.any(axis=1).sum())])
            matched += len(keys)
            alive = held[-1]
            if not alive.any():
                break
        for bit in _members(_int(alive)):
            result[self._names[bit]] = matched * self.block_size
        self._touch(np.concatenate(used) if used else np.empty(0, np.int64))
        self._cut_to_kept_states(result, read)
        return result

    def _touch(self, slots: np.ndarray) -> None:
        """Mark a chain's blocks used now, its first block the latest (as `_hold` does)."""
        self._used[slots] = np.uint64(self._clock) + np.arange(len(slots), 0, -1, dtype=np.uint64)
        self._clock += len(slots) + 1

    def _cut_to_kept_states(self, result: dict[str, int], read: list[U64]) -> None:
        for name, tokens in result.items():
            states = self._instances[name].states
            if states is None or tokens == 0:
                continue
            seen = np.concatenate(read)[: tokens // self.block_size]
            kept = np.flatnonzero(states.find(seen) >= 0)
            result[name] = (int(kept[-1]) + 1) * self.block_size if len(kept) else 0


def _chunks(hashes: Iterable[int]) -> Iterator[Sequence[int] | np.ndarray]:
    """A sequence whole; an iterator in chunks (hashing lazily is what an iterator is for,
    so a lookup that stops reads little past its last match): first one hash (a cold
    prompt costs one), then 63, then a quarter of what was read, at least 64 and at most
    `_MAX_CHUNK`: at most a quarter more than needed, plus 64."""
    if isinstance(hashes, list | tuple | np.ndarray):
        if len(hashes):
            yield hashes
        return
    iterator = iter(hashes)
    read = 0
    size = 1
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk
        read += len(chunk)
        size = min(max(64, read // 4), _MAX_CHUNK) if read > 1 else 63


def _engine_keys(hashes: Sequence[int]) -> U64:
    """Engine hashes as table keys: any int, taken modulo 2**64 (SGLang's may be signed)."""
    try:
        return as_keys(np.asarray(hashes, dtype=np.uint64))
    except OverflowError:
        return as_keys(np.array([h & ((1 << 64) - 1) for h in hashes], dtype=np.uint64))


def _words(bits: int, words: int) -> U64:
    return np.array([(bits >> (64 * w)) & ((1 << 64) - 1) for w in range(words)], np.uint64)


def _int(words: np.ndarray) -> int:
    return int.from_bytes(words.astype("<u8").tobytes(), "little")


def _members(bits: int) -> Iterator[int]:
    while bits:
        low = bits & -bits
        yield low.bit_length() - 1
        bits ^= low

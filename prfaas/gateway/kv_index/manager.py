"""`KVIndexManager`: which instance caches which prefix blocks, fed by engines' KV events.

Engines publish `BlockStored` with their own block hashes plus the token ids; the index
re-hashes the tokens with PrfaaS's chained xxh3-64 (`prfaas.common.hashing`) so lookups never
depend on an engine's hash function. Two numpy hash tables (`growing.GrowingTable`) hold it:

* blocks: our hash -> (holder-set id, last stored or used), what a lookup reads;
* translations: (instance, engine hash) -> our hash, what resolves an event's parent, a
  removal or a kept state (the key is the engine hash xor a per-instance salt; the row keeps
  the instance, so a clear finds its rows).

Events are buffered and applied in batches (`FLUSH_BLOCKS` blocks, or at the next read):
array operations cost about the same for one block as for hundreds, and engines send a few
at a time. A flush takes every instance's events in order, its stores of all instances as
one batch, its removals as one, then the next of each instance's runs.

Memory is bounded in bytes (`max_index_mb`, half to each table): at its cap a table whose
two buckets for a new key are full evicts there, the block least recently stored or used
(set-associative, as CPU caches do; no global pass). A translation whose block was evicted
still translates correctly; a sweep of a few thousand rows per flush drops such rows. The
index may under-report a cache then, never over-report it.

Hybrid engines (linear attention beside full attention) reuse a prefix only up to a block
at whose end they kept the linear states. An instance that has sent `StatesStored` is such
an engine (a clear or restart since included): its match is cut back to the last block it
kept states for (none: 0). vLLM keeps
none where a prefix was first computed, so without this the index counted that prefix one
request early (`benchmarks/vllm_prefix_reuse.py`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import msgspec
import numpy as np

from prfaas.common.hashing import packed_count, salt_root, unpack_ids
from prfaas.gateway.kv_index.batch import chain_stores, group, salted_keys
from prfaas.gateway.kv_index.growing import GrowingTable
from prfaas.gateway.kv_index.holder_sets import EMPTY, MULTIPLE, HolderSets
from prfaas.gateway.kv_index.table import I64, U64, WAYS, as_keys
from prfaas.gateway.kv_index.walk import walk
from prfaas.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    SaltedBlockStored,
    StatesRemoved,
    StatesStored,
    UnreadBlockStored,
)

logger = logging.getLogger(__name__)

_BLOCK_COLUMNS = {"holders": np.uint32, "used": np.uint32}
_TRANSLATION_COLUMNS = {"ours": np.uint64, "instance": np.uint16}
_BLOCK_SLOT_BYTES = 8 + 2 + 4 + 4  # key, tag, holders, used
_TRANSLATION_SLOT_BYTES = 8 + 2 + 8 + 2  # key, tag, ours, instance
# Buffered blocks past which `apply` applies at once (a read applies what is buffered): at
# a few microseconds a block, a flush holds the loop about a millisecond.
FLUSH_BLOCKS = 256
# Translation rows checked per flush for an evicted block while any may be left.
_SWEEP_SLOTS = 4096
# Lookups' use marks held back at most (slots) before a lookup writes them: a few lookups'
# worth (scattered writes into a large table: 0.1-0.2 ms for this many at 10M entries).
_MAX_TOUCHES = 8192
# Lazily hashed lookups read their hashes in chunks of at most this many.
_MAX_CHUNK = 4096
_MAX_INSTANCES = 1 << 16  # the translation row's instance number is 16 bits


class KVIndexManager:
    """Per-instance prefix-block index with longest-prefix lookups across instances."""

    def __init__(self, *, block_size: int, max_index_mb: float = 1024.0) -> None:
        if block_size <= 0 or max_index_mb <= 0:
            raise ValueError(
                f"block_size and max_index_mb must be > 0, got {block_size}, {max_index_mb}"
            )
        self.block_size = block_size
        self.max_index_mb = max_index_mb
        half = max_index_mb * 2**20 / 2
        self._blocks = GrowingTable(
            _BLOCK_COLUMNS,
            max_buckets=max(1, int(half / (WAYS * _BLOCK_SLOT_BYTES))),
            uniform=True,
        )
        self._translations = GrowingTable(
            _TRANSLATION_COLUMNS,
            max_buckets=max(1, int(half / (WAYS * _TRANSLATION_SLOT_BYTES))),
        )
        self._sets = HolderSets()
        self._bits: dict[str, int] = {}  # instance id -> member number, for the index's life
        self._names: list[str] = []  # member number -> instance id
        self._salts = _salt(np.arange(64))  # member number -> its translation keys' salt
        self._known: set[str] = set()  # instances with something indexed (or reported)
        self._members_cache: tuple[list[str], I64, U64] | None = None  # see _lookup_members
        self._states: dict[str, GrowingTable] = {}
        """Per hybrid instance, our hashes of the blocks after which it kept its linear
        states (absent: the engine has reported no states, every cached block reusable)."""
        self._pending: dict[str, list[KVEvent]] = {}  # events not applied yet, per instance
        self._pending_blocks = 0
        self._pending_stores_only = True  # every pending event a `BlockStored`
        self._touches: list[tuple[I64, np.uint32]] = []  # lookups' use marks, see _touch
        self._touched = 0  # slots in them
        self._clock = 0  # use-time ticks: one per block stored or looked up
        self._entries = 0
        self._dangling = 0  # translation rows whose block lost them (evictions)
        self._sweep_at = 0
        self._sweep_clean = False  # this sweep pass found nothing stale so far
        self._rejected = 0
        self._misfits: set[tuple[str, object]] = set()  # (instance, why) logged once
        self.evicted_entries = 0
        """(instance, block) entries forgotten at the byte budget."""

    # -- reads ----------------------------------------------------------------------------

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
        states = sum(table.nbytes for table in self._states.values())
        return self._blocks.nbytes + self._translations.nbytes + self._sets.nbytes + states

    def instances(self) -> list[str]:
        self._flush()
        return [name for name in self._names if name in self._known]

    def longest_prefix(self, block_hashes: Iterable[int]) -> dict[str, int]:
        """Cached prefix length in tokens per instance for a request's chained block hashes
        (every known instance appears, 0 where nothing matches). Stops reading
        `block_hashes` soon after no instance matches (pass `iter_block_hashes` to hash
        lazily). Marks the blocks it matched as used (what the budget keeps longest)."""
        self._flush()
        if not self._known:
            return {}
        names, members, everyone = self._lookup_members()
        alive = everyone.copy()
        # per member number, the block where its match ended; the last entry stands for the
        # members with no holder-set bit yet (nothing of theirs indexed): ended at 0
        ends = np.full(64 * len(alive) + 1, -1, dtype=np.int64)
        ends[-1] = 0
        read: list[U64] = []
        used: list[I64] = []  # slots of the blocks some instance matched
        matched = 0  # blocks read before the current chunk
        for chunk in _chunks(block_hashes):
            keys = as_keys(chunk)
            read.append(keys)
            slots, holders = self._blocks.find_values(keys, "holders", EMPTY)
            held = walk(self._sets.bits, holders, alive, ends[:-1], matched)
            used.append(slots[:held])
            matched += len(keys)
            if held < len(keys):  # nobody holds that block
                break
        ended = ends[members]
        lengths = np.where(ended >= 0, ended, matched) * self.block_size
        result = dict(zip(names, lengths.tolist(), strict=True))
        self._touch(np.concatenate(used) if used else np.empty(0, np.int64))
        if self._states:
            self._cut_to_kept_states(result, read)
        return result

    def _lookup_members(self) -> tuple[list[str], I64, U64]:
        """The known instances, their member numbers, and all of them as holder-set words
        (what a lookup starts from; kept until an instance becomes known or forgotten, or
        the words grow). A member number past the words (an instance none of whose blocks
        is indexed yet) is given as 64 * words."""
        words = self._sets.bits.shape[1]
        if self._members_cache is None or len(self._members_cache[2]) != words:
            names = self.instances()
            members = np.array([self._bits[name] for name in names], dtype=np.int64)
            members = np.minimum(members, 64 * words)
            everyone = _words(sum(1 << int(bit) for bit in set(members.tolist())), words)
            self._members_cache = names, members, everyone
        return self._members_cache

    def _know(self, instance_id: str) -> None:
        """The instance has something indexed (or reported)."""
        if instance_id not in self._known:
            self._known.add(instance_id)
            self._members_cache = None

    def _touch(self, slots: I64) -> None:
        """Mark a chain's blocks used now, its first block the latest (a full bucket then
        evicts chains from their ends, as engines do). Written later (`_write_touches`):
        before the next flush of events or clear, or by a lookup once `_MAX_TOUCHES` wait.
        Use times are read only when the table changes, and scattered writes into a column
        of hundreds of MB were a quarter of a 128K-token lookup at 10M entries: a flush
        pays them with its own scattered writes, a few lookups' worth at a time."""
        if len(slots):
            self._touches.append((slots, self._tick(len(slots))))
            self._touched += len(slots)
            if self._touched > _MAX_TOUCHES:
                self._write_touches()

    def _write_touches(self) -> None:
        """Write the lookups' use marks, in the order they were made (their slot numbers
        hold until the blocks table next changes: this runs before anything changes it)."""
        touches, self._touches, self._touched = self._touches, [], 0
        for slots, base in touches:
            used = base + np.arange(len(slots), 0, -1, dtype=np.uint32)
            self._blocks.set("used", slots, used)

    def _tick(self, n: int) -> np.uint32:
        """Reserve `n` ticks of the use clock (32 bits, halved with every use time when
        it nears the top: order is what eviction reads); returns the one before them."""
        if self._clock + n + 1 >= 2**32:
            self._write_touches()  # (marks not written yet are halved with the rest)
            used = self._blocks.column("used")
            np.right_shift(used, np.uint32(1), out=used)
            self._clock //= 2
        base = np.uint32(self._clock)
        self._clock += n + 1
        return base

    def _cut_to_kept_states(self, result: dict[str, int], read: list[U64]) -> None:
        seen_all: U64 | None = None
        for name, tokens in result.items():
            states = self._states.get(name)
            if states is None or tokens == 0:
                continue
            if seen_all is None:
                seen_all = np.concatenate(read)
            seen = seen_all[: tokens // self.block_size]
            kept = np.flatnonzero(states.find(seen) >= 0)
            result[name] = (int(kept[-1]) + 1) * self.block_size if len(kept) else 0

    # -- events ---------------------------------------------------------------------------

    def apply(self, instance_id: str, events: Iterable[KVEvent]) -> None:
        """Take one engine's events, in order (applied at the next flush, see the module
        docstring); states stored are taken after the batch's blocks (vLLM sends a step's
        Mamba groups before its attention)."""
        if instance_id not in self._bits and len(self._names) >= _MAX_INSTANCES:
            self._rejected += 1
            logger.warning(
                "%s: the KV index holds %d instances at most", instance_id, _MAX_INSTANCES
            )
            return
        self._bit(instance_id)
        pending = self._pending.setdefault(instance_id, [])
        states: list[KVEvent] = []
        for event in events:
            if isinstance(event, BlockStored):
                self._pending_blocks += len(event.block_hashes)
            elif isinstance(event, StatesStored):
                states.append(event)
                continue
            else:
                self._pending_stores_only = False
            pending.append(event)
        if states:
            self._pending_stores_only = False
            pending.extend(states)
        if self._pending_blocks >= FLUSH_BLOCKS:
            self._flush()

    def clear_instance(self, instance_id: str) -> None:
        """Forget everything an instance caches (restart, flush, or a lost event stream).
        What is buffered is applied first, so the rejected-event count stays exact."""
        self._flush()
        self._forget(instance_id)

    def _flush(self) -> None:
        """Apply the buffered events: round by round, each instance's next run of stores,
        of removals, or one other event; a round's stores go in as one batch, and its
        removals (instances are independent of each other, so only each one's own order
        matters)."""
        if not self._pending:
            return
        self._write_touches()
        if self._pending_stores_only:  # (the common case: one round, each run whole)
            pending = list(self._pending.items())
            self._pending, self._pending_blocks = {}, 0
            self._stored(pending)
            if self._dangling:
                self._sweep()
            return
        runs = {i: _runs(events) for i, events in self._pending.items()}
        self._pending, self._pending_blocks = {}, 0
        self._pending_stores_only = True
        while runs:
            stores: list[tuple[str, list[KVEvent]]] = []
            removals: list[tuple[str, list[KVEvent]]] = []
            others: list[tuple[str, KVEvent]] = []
            for instance_id in list(runs):
                run = next(runs[instance_id], None)
                if run is None:
                    del runs[instance_id]
                elif isinstance(run[0], BlockStored):
                    stores.append((instance_id, run))
                elif isinstance(run[0], BlockRemoved):
                    removals.append((instance_id, run))
                else:
                    others.append((instance_id, run[0]))
            self._stored(stores)
            self._removed(removals)
            for instance_id, event in others:
                self._other(instance_id, event)
        if self._dangling:
            self._sweep()

    def _other(self, instance_id: str, event: KVEvent) -> None:
        if isinstance(event, AllBlocksCleared):
            self._forget(instance_id)
        elif isinstance(event, StatesStored):
            self._states_stored(instance_id, event.block_hashes)
        elif isinstance(event, StatesRemoved):
            self._states_removed(instance_id, event.block_hashes)

    def _bit(self, instance_id: str) -> int:
        """The instance's member number, made on first sight."""
        bit = self._bits.get(instance_id)
        if bit is None:  # `apply` keeps the count under _MAX_INSTANCES
            bit = self._bits[instance_id] = len(self._names)
            self._names.append(instance_id)
            if bit >= len(self._salts):
                self._salts = _salt(np.arange(2 * bit))
        return bit

    # -- stores ---------------------------------------------------------------------------

    def _stored(self, runs: list[tuple[str, list[KVEvent]]]) -> None:
        """Re-hash the runs' blocks (each event chained to its parent: one indexed before,
        or earlier in its run) and add them in one batch."""
        events: list[BlockStored[Any]] = []
        bits: list[int] = []
        for instance_id, run in runs:
            bit = self._bit(instance_id)
            for event in run:
                assert isinstance(event, BlockStored)
                if not self._fits(instance_id, event):
                    continue
                self._know(instance_id)
                readable = self._unpacked(instance_id, event)
                if readable is not None:
                    events.append(readable)
                    bits.append(bit)
        if not events:
            return
        bit_array = np.array(bits, dtype=np.int64)
        starts = self._chain_starts(events, bit_array)
        block_bits, keys, ours, rejected = chain_stores(
            events, bit_array, starts, self.block_size, self._salts
        )
        self._rejected += rejected  # (a parent neither indexed nor stored earlier)
        if len(keys):
            self._add(block_bits, keys, ours)

    def _chain_starts(self, events: list[BlockStored[Any]], bits: I64) -> list[int | None]:
        """What each event's chain starts from where the index knows it: its parent's our
        hash where the translations hold it, a salted chain's root; else None (its parent is
        stored earlier in the batch, or it names none)."""
        parents = [event.parent_block_hash for event in events]
        starts: list[int | None] = [None] * len(events)
        named = [k for k, parent in enumerate(parents) if parent is not None]
        if named:
            slots = self._find_translations(bits[named], [p for p in parents if p is not None])
            found = np.flatnonzero(slots >= 0)
            ours = self._translations.get("ours", slots[found]).tolist()
            for k, our_hash in zip(found.tolist(), ours, strict=True):
                starts[named[k]] = our_hash  # (a hash's first translation holds, see `_add`)
        if len(named) < len(events):
            for k, event in enumerate(events):
                if parents[k] is None and isinstance(event, SaltedBlockStored):
                    starts[k] = salt_root(event.cache_salt)  # (a salted chain's start)
        return starts

    def _unpacked(self, instance_id: str, event: BlockStored[Any]) -> BlockStored[Any] | None:
        """The event as `chain_stores` reads it: packed token ids (msgpack, as msgspec
        leaves them where the scan did not read the batch) as uint32 ids; None (the event
        rejected, logged once per instance) where they are not a msgpack array of uint32
        ids. Other ids as they are (decoded ids and an `IdArray`'s were checked when
        decoded)."""
        if not isinstance(event.token_ids, msgspec.Raw):
            return event
        try:
            ids = np.frombuffer(unpack_ids(event.token_ids), dtype="<u4").data
        except (ValueError, OverflowError, TypeError) as exc:
            self._reject(instance_id, "ids", "%s: BlockStored ignored, its token ids are "
                         "not a msgpack array of uint32 ids: %s", exc)  # fmt: skip
            return None
        return msgspec.structs.replace(event, token_ids=ids)

    def _fits(self, instance_id: str, event: BlockStored[Any]) -> bool:
        n = len(event.block_hashes)
        count = _id_count(event)
        if isinstance(event, UnreadBlockStored):
            self._reject(
                instance_id,
                "key",
                "%s: BlockStored keyed by more than its tokens (%s) ignored: the index would "
                "credit its blocks to prompts without that key",
                event.key,
            )
            return False
        if event.lora_id is not None:  # (an engine keys blocks by the adapter too)
            self._reject(
                instance_id,
                "lora",
                "%s: BlockStored under LoRA adapter %s ignored: the index would credit the "
                "adapter's blocks to requests without it",
                event.lora_id,
            )
            return False
        if event.block_size != self.block_size:
            self._reject(
                instance_id,
                event.block_size,
                "%s: BlockStored with block_size %d / %s tokens for %d blocks does not match "
                "the index's block size %d; its events are ignored, so the index never "
                "credits this instance (page the engine in [model] block_size, or set that "
                "to the engine's page size)",
                event.block_size,
                count,
                n,
                self.block_size,
            )
            return False
        if count not in (None, n * self.block_size):  # (an unreadable count: when hashed)
            self._reject(
                instance_id,
                "count",
                "%s: BlockStored with %s token ids for %d blocks of %d ignored (its ids must "
                "fill its blocks)",
                count,
                n,
                self.block_size,
            )
            return False
        return True

    def _reject(self, instance_id: str, kind: object, message: str, *args: object) -> None:
        """Count an event ignored; log why once per instance and `kind` (it repeats)."""
        self._rejected += 1
        if (instance_id, kind) not in self._misfits:
            self._misfits.add((instance_id, kind))
            logger.error(message, instance_id, *args)

    def _find_translations(self, bits: np.ndarray, engine_hashes: Sequence[int]) -> I64:
        """Slots of the (instance, engine hash) rows, -1 where absent."""
        slots = self._translations.find(salted_keys(engine_hashes, bits, self._salts))
        wrong = (slots >= 0) & (self._translations.get("instance", slots) != bits)  # collision
        found: I64 = np.where(wrong, -1, slots)
        return found

    def _translate(self, bits: list[int], engine_hashes: list[int]) -> dict[tuple[int, int], int]:
        """Our hash of each (instance, engine hash) the translations hold."""
        if not engine_hashes:
            return {}
        slots = self._find_translations(np.array(bits, dtype=np.int64), engine_hashes)
        found = (slots >= 0).tolist()
        ours = self._translations.get("ours", slots[slots >= 0]).tolist()
        pairs = itertools.compress(zip(bits, engine_hashes, strict=True), found)
        return dict(zip(pairs, ours, strict=True))

    def _add(self, bits: I64, keys: U64, ours: U64) -> None:
        """Translate new (instance, engine hash) pairs (`keys`: their translation keys),
        then mark the blocks held. A pair names one block: the one it translated to if
        known (its removal will name that one), else its first occurrence's; a pair whose
        salted key another instance's row holds (a 2**-64 chance) is dropped, as the table
        cannot hold both."""
        first, inverse, _ = group(keys)
        distinct = keys[first]
        slots = self._translations.find(distinct)
        if len(distinct) == len(keys) and not (slots >= 0).any():  # all new, each named once
            self._hold(ours, bits)
            values = {"ours": ours, "instance": bits}
            self._insert(self._translations, keys, values, self._evict_translations)
            return
        owner = self._translations.get("instance", slots)
        known = (slots >= 0) & (owner == bits[first])
        collided = (slots >= 0) & ~known
        per_key = ours[first]
        per_key[known] = self._translations.get("ours", slots[known])
        # a pair colliding with a row, or with another instance's pair in this batch
        keep = ~collided[inverse] & (bits == bits[first][inverse])
        if not keep.all():
            self._rejected += int((~keep).sum())
            logger.warning("%d engine hashes collided with another instance's", (~keep).sum())
        self._hold(per_key[inverse][keep], bits[keep])
        # after the blocks: evicting a translation takes its holder off its block, which
        # must not be one this batch marks held again after
        new = ~known & ~collided
        values = {"ours": per_key[new], "instance": bits[first[new]]}
        self._insert(self._translations, distinct[new], values, self._evict_translations)

    def _hold(self, ours: U64, bits: I64) -> None:
        """Mark each block of `ours` held by the instance at the same place in `bits`,
        stored now: a chain's first block counts as the latest (see `_touch`)."""
        if not len(ours):
            return
        distinct, changes, masks, last = _grouped(ours, bits)
        used = self._tick(len(ours)) + (len(ours) - last).astype(np.uint32)
        slots, before = self._blocks.find_values(distinct, "holders", EMPTY)
        found = slots >= 0
        some_found = bool(found.any())  # (a new conversation's blocks: none)
        after, delta = self._sets.update(before, changes, masks, add=True)
        self._entries += delta
        if some_found:
            at = slots[found]
            self._blocks.set("holders", at, after[found])
            self._blocks.set("used", at, used[found])
        if not found.all():
            values = {"holders": after[~found], "used": used[~found]}
            self._insert(self._blocks, distinct[~found], values, self._evict_blocks)

    def _insert(
        self,
        table: GrowingTable,
        keys: U64,
        values: dict[str, np.ndarray],
        evict: Callable[[U64], None],
    ) -> None:
        """Insert; at the table's cap, evict in the full buckets and insert again."""
        self._evict_for(table, table.insert(keys, values), evict)

    @staticmethod
    def _evict_for(
        table: GrowingTable, left: tuple[U64, dict[str, np.ndarray]], evict: Callable[[U64], None]
    ) -> None:
        """Room for what an insert handed back (only at the table's cap): evict in their
        full buckets and insert them again, until all are in."""
        keys, rows = left
        while len(keys):
            evict(keys)
            keys, rows = table.insert(keys, rows)

    def _evict_blocks(self, keys: U64) -> None:
        """Room for `keys`: the least recently used block of each one's buckets goes."""
        slots = np.unique(self._blocks.victims(keys, "used"))
        set_ids = self._blocks.get("holders", slots)
        gone = sum(self._sets.size(int(s)) for s in set_ids.tolist())
        self._entries -= gone
        self._dangling += gone
        self.evicted_entries += gone
        self._sets.retain(set_ids, -1)
        self._blocks.delete(slots)

    def _evict_translations(self, keys: U64) -> None:
        """Room for `keys`: in each one's buckets, the translation whose block was least
        recently used goes (one whose block was evicted first), its block losing that
        holder and its kept state."""
        candidates = self._translations.candidates(keys)
        blocks = self._blocks.find(self._translations.get("ours", candidates.reshape(-1)))
        used = np.where(blocks >= 0, self._blocks.get("used", blocks), 0)
        oldest = used.reshape(candidates.shape).argmin(axis=1)
        slots = np.unique(candidates[np.arange(len(candidates)), oldest])
        ours = self._translations.get("ours", slots)
        bits = self._translations.get("instance", slots).astype(np.int64)
        self._translations.delete(slots)
        self._drop_states(ours, bits)
        before = self._entries
        self._release(ours, bits)
        self.evicted_entries += before - self._entries

    # -- removals, clears, states -----------------------------------------------------------

    def _removed(self, runs: list[tuple[str, list[KVEvent]]]) -> None:
        bits: list[int] = []
        engine: list[int] = []
        for instance_id, run in runs:
            if instance_id not in self._known:
                continue
            bit = self._bits[instance_id]
            for event in run:
                assert isinstance(event, BlockRemoved)
                engine.extend(event.block_hashes)
                bits.extend(itertools.repeat(bit, len(event.block_hashes)))
        if not engine:
            return
        slots = np.unique(self._find_translations(np.array(bits, dtype=np.int64), engine))
        slots = slots[slots >= 0]
        ours = self._translations.get("ours", slots)
        owners = self._translations.get("instance", slots).astype(np.int64)
        self._translations.delete(slots)
        self._drop_states(ours, owners)
        self._release(ours, owners)

    def _release(self, ours: U64, bits: I64) -> None:
        """Each instance in `bits` no longer holds the block at the same place in `ours`;
        blocks nobody holds go."""
        if not len(ours):
            return
        distinct, changes, masks, _ = _grouped(ours, bits)
        slots, holders = self._blocks.find_values(distinct, "holders", EMPTY)
        found = slots >= 0
        at, before = slots[found], holders[found]
        after, delta = self._sets.update(before, changes[found], masks, add=False)
        self._entries += delta
        self._blocks.set("holders", at, after)
        orphans = after == EMPTY
        self._sets.retain(after[orphans], -1)
        self._blocks.delete(at[orphans])

    def _drop_states(self, ours: U64, bits: I64) -> None:
        """The removed blocks' kept states go with them."""
        for bit in np.unique(bits).tolist():
            states = self._states.get(self._names[bit])
            if states is not None:
                kept = states.find(np.unique(ours[bits == bit]))
                states.delete(kept[kept >= 0])

    def _forget(self, instance_id: str) -> None:
        if instance_id not in self._known:
            return
        self._write_touches()
        self._known.discard(instance_id)
        self._members_cache = None
        if instance_id in self._states:  # a hybrid engine stays one: it keeps no states yet
            self._states[instance_id] = GrowingTable({}, uniform=True)
        bit = self._bits[instance_id]
        table = self._translations
        mine = table.select("instance", bit)
        ours = table.get("ours", mine)
        table.delete(mine)
        self._release(ours, np.full(len(mine), bit, dtype=np.int64))

    def _states_stored(self, instance_id: str, engine_hashes: Sequence[int]) -> None:
        bit = self._bit(instance_id)
        self._know(instance_id)
        states = self._states.get(instance_id)
        if states is None:  # not setdefault: that would build a table on every event
            states = self._states[instance_id] = GrowingTable({}, uniform=True)
        ours = self._translate([bit] * len(engine_hashes), list(engine_hashes)).values()
        distinct = np.unique(as_keys(list(ours)))  # a block not indexed keeps nothing
        states.insert(distinct[states.find(distinct) < 0], {})

    def _states_removed(self, instance_id: str, engine_hashes: Sequence[int]) -> None:
        states = self._states.get(instance_id)
        if states is None:
            return
        bit = self._bits[instance_id]
        ours = self._translate([bit] * len(engine_hashes), list(engine_hashes)).values()
        kept = states.find(np.unique(as_keys(list(ours))))
        states.delete(kept[kept >= 0])

    def _sweep(self) -> None:
        """Check the next `_SWEEP_SLOTS` translation rows; drop those whose block no
        longer lists their instance (evicted), with their kept states."""
        table = self._translations
        total = table.slots
        start = self._sweep_at if self._sweep_at < total else 0
        end = min(total, start + _SWEEP_SLOTS)
        self._sweep_at = end
        if start == 0:
            self._sweep_clean = True
        window = np.arange(start, end)
        window = window[table.taken(window)]
        ours = table.get("ours", window)
        bits = table.get("instance", window).astype(np.int64)
        _, holders = self._blocks.find_values(ours, "holders", EMPTY)
        words = np.take(self._sets.bits, holders, axis=0)
        listed = (words[np.arange(len(bits)), bits // 64] >> (bits % 64).astype(np.uint64)) & 1
        stale = listed == 0
        if stale.any():
            self._sweep_clean = False
            self._drop_states(ours[stale], bits[stale])
            table.delete(window[stale])
            self._dangling = max(0, self._dangling - int(stale.sum()))
        if end == total and self._sweep_clean:
            self._dangling = 0  # a whole pass found none left


def _runs(events: list[KVEvent]) -> Iterator[list[KVEvent]]:
    """Consecutive stores as one run, consecutive removals as one, anything else alone."""
    for kind, same in itertools.groupby(events, key=_run_kind):
        if kind is BlockStored or kind is BlockRemoved:
            yield list(same)
        else:
            for event in same:
                yield [event]


def _run_kind(event: KVEvent) -> type:
    """What a run groups by: the event's class, every kind of store (salted, unread) a
    `BlockStored`."""
    return BlockStored if isinstance(event, BlockStored) else type(event)


def _grouped(ours: U64, bits: I64) -> tuple[U64, I64, dict[int, int], I64]:
    """The distinct blocks of `ours`; for each, the instances named beside it in `bits`
    as a `HolderSets.update` change (the instance, or `MULTIPLE` + k with the members in the
    dict), and its last position in `ours`."""
    first, inverse, last = group(ours)
    changes = bits[first]
    masks: dict[int, int] = {}
    others = bits != changes[inverse]
    if others.any():
        several = np.unique(inverse[others])  # blocks named by several
        rows = np.flatnonzero(np.isin(inverse, several))
        rows = rows[np.argsort(inverse[rows], kind="stable")]  # by block, as `several`
        cuts = np.flatnonzero(np.diff(inverse[rows])) + 1
        named = np.split(bits[rows], cuts)
        for k, (block, members) in enumerate(zip(several.tolist(), named, strict=True)):
            masks[MULTIPLE + k] = sum(1 << bit for bit in set(members.tolist()))
            changes[block] = MULTIPLE + k
    return ours[first], changes, masks, last


def _salt(bits: np.ndarray) -> U64:
    """A per-instance 64-bit salt (splitmix64 of the member number)."""
    x = bits.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    salted: U64 = x ^ (x >> np.uint64(31))
    return salted


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


def _id_count(event: BlockStored[Any]) -> int | None:
    """How many token ids the event carries (None: packed ids whose count cannot be read)."""
    ids = event.token_ids
    try:
        return packed_count(ids) if isinstance(ids, msgspec.Raw) else len(ids)
    except ValueError:
        return None


def _words(bits: int, words: int) -> U64:
    return np.array([(bits >> (64 * w)) & ((1 << 64) - 1) for w in range(words)], np.uint64)

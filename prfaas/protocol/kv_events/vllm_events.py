"""KV cache events in vLLM's wire format (`--kv-events-config`), turned into ours.

vLLM publishes the same three ZMQ frames as SGLang (`[topic, seq, payload]`) and the same
batch array `[ts, events, data_parallel_rank]`, but its events are msgpack *maps* tagged by a
`type` key, its block hashes are bytes (or ints), and a hybrid model's blocks are reported per
KV-cache group (`group_idx`, `kv_cache_spec_kind`). Full-attention groups (MLA and
sink-token ones too: `PREFIX_KINDS`) describe the cached token prefix: their events become
ours. A Mamba group's `BlockStored` names only the blocks at whose end vLLM kept the
linear-attention states (none for the request that first computes a prefix), the only places
a hybrid prefix can be reused from: those become `StatesStored` (and its removals
`StatesRemoved`). Other groups' events are dropped. Hashes become ints
(the last 8 bytes), which the index only uses to match a removal with its store and a state
with its block; it re-hashes the token ids with its own function. SGLang 0.5.23 writes its
events in this map form too (with int hashes and no groups), so this decoder reads an
SGLang engine's events as well (`prfaas.gateway.deployment.MAP_EVENTS`). A store keyed by a
request's salt as well as its tokens becomes a `SaltedBlockStored`; one keyed by anything
else the router cannot know from a request (a LoRA adapter, a multimodal input) becomes an
`UnreadBlockStored`, which the index rejects (`stored_salt`), so that it never credits it to
prompts without that key; and the events of tiers other than the device cache are dropped
(`DEVICE_TIERS`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from itertools import repeat
from typing import Annotated, Any, Generic

import msgspec

from prfaas.protocol.kv_events.events import (
    SEQ_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Ids,
    KVEvent,
    KVEventBatch,
    KVEventDecodeError,
    PackedIds,
    SaltedBlockStored,
    StatesRemoved,
    StatesStored,
    TokenIds,
    UnreadBlockStored,
    scan_map_batch,
)

logger = logging.getLogger(__name__)

Hash = int | bytes
FULL_ATTENTION = "full_attention"
PREFIX_KINDS = (None, FULL_ATTENTION, "mla_attention", "sink_full_attention")
"""The spec kinds whose groups cache the whole token prefix (None: not said, SGLang's):
full attention, latent (MLA: DeepSeek's, Kimi Linear's) and with sink tokens."""
MAMBA = "mamba"
DEVICE_TIERS = (None, "GPU")
"""The `medium`s of an engine's device cache (None: not said). Other tiers' events (vLLM's
CPU offloading and storage connectors, SGLang's `CPU_PINNED`, `DISK`, `EXTERNAL` pools) are
dropped: vLLM's `OffloadingConnector` publishes its stores without the extra keys (a salt,
an image) that key the blocks, so crediting them could over-report, and a host copy's
removal would take back a block the device still holds."""


class _VEvent(
    msgspec.Struct, omit_defaults=True, gc=False, frozen=True, tag=True, tag_field="type"
):
    """vLLM's `KVCacheEvent`: a map with a `type` tag; unknown keys are ignored."""


class VBlockStored(_VEvent, Generic[Ids], frozen=True, tag="BlockStored"):
    block_hashes: tuple[Hash, ...]
    parent_block_hash: Hash | None
    token_ids: Ids
    block_size: Annotated[int, msgspec.Meta(gt=0)]
    lora_id: int | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    # What keys a block besides its tokens, and its tier: read as any value, so that a
    # form not foreseen drops the one store (`stored_salt`), not the whole batch.
    lora_name: Any = None
    cache_salt: Any = None  # (SGLang's)
    extra_keys: Any = None  # (vLLM's: one entry per block, each None or a list of keys)
    medium: Any = None


class VBlockRemoved(_VEvent, frozen=True, tag="BlockRemoved"):
    block_hashes: tuple[Hash, ...]
    group_idx: int | None = None
    medium: Any = None


class VAllBlocksCleared(_VEvent, frozen=True, tag="AllBlocksCleared"):
    pass


class VEventBatch(msgspec.Struct, Generic[Ids], array_like=True, gc=False, frozen=True):
    ts: float
    events: tuple[VBlockStored[Ids] | VBlockRemoved | VAllBlocksCleared, ...]
    data_parallel_rank: int | None = None


_DECODERS: dict[bool, msgspec.msgpack.Decoder[VEventBatch[Any]]] = {
    False: msgspec.msgpack.Decoder(VEventBatch[TokenIds]),
    True: msgspec.msgpack.Decoder(VEventBatch[PackedIds]),
}


_SCANNED_CLASSES = (VBlockStored, VBlockRemoved, VAllBlocksCleared, VEventBatch)
"""What `scan_map_batch` builds a batch of, in its order (see `events._SCANNED_CLASSES`)."""


def _int(value: Hash) -> int:
    return value if isinstance(value, int) else int.from_bytes(value[-8:], "big")


def _ints(values: tuple[Hash, ...]) -> tuple[int, ...]:
    """`values` as ints: as they are where all are (vLLM's default), each converted else."""
    if all(map(isinstance, values, repeat(int))):
        return values  # type: ignore[return-value]  # (all ints, checked)
    return tuple(map(_int, values))


class UnreadKey(ValueError):
    """A store keyed by more than its tokens, in a way the index does not read."""


def stored_salt(event: VBlockStored[Any]) -> str | None:
    """The salt that keys the event's blocks besides their tokens, or None (no salt, or an
    empty one, as both engines read it): SGLang's `cache_salt`, or vLLM's, which it
    publishes as the only extra key of a chain's first block (bare, untagged).

    Raises:
        UnreadKey: a LoRA adapter (`lora_id`, `lora_name`: requests name theirs in fields
            the router does not key by) or other extra keys (a multimodal input's identifier
            and offset, a prompt embedding's digest), which it cannot know from a request.
    """
    if event.lora_id is not None or event.lora_name is not None:
        raise UnreadKey(f"LoRA adapter {event.lora_name or event.lora_id!r:.60}")
    salt = event.cache_salt
    if not (salt is None or isinstance(salt, str)):
        raise UnreadKey(f"cache_salt {salt!r:.60}")
    keys = event.extra_keys
    if keys is None or (isinstance(keys, list) and keys.count(None) == len(keys)):
        return salt or None  # (no extra key: the usual store)
    first = keys[0] if isinstance(keys, list) and keys else None
    if (
        event.parent_block_hash is None
        and isinstance(first, list)
        and len(first) == 1
        and isinstance(first[0], str)
        and keys.count(None) == len(keys) - 1
        and salt in (None, first[0])
    ):
        return first[0] or None
    raise UnreadKey(f"extra keys {keys!r:.120}")


class VLLMEventDecoder:
    """Decodes one publisher's map-form batches (vLLM's, SGLang 0.5.23's) into
    `KVEventBatch`es of our events.

    Stateful: a `BlockRemoved` carries no spec kind, so the groups seen storing Mamba
    states, or blocks of another kind, decide what a removal means.
    """

    def __init__(self, *, packed_ids: bool = False) -> None:
        """`packed_ids`: token ids for the KV index, as `decode_batch`'s: an `IdArray` where
        `_scan` reads the batch (`scan_map_batch`), else left in their msgpack encoding."""
        self._decoder = _DECODERS[packed_ids]
        self._scan = scan_map_batch if packed_ids else None
        self._state_groups: set[int] = set()
        self._other_groups: set[int] = set()

    def decode_batch(self, payload: bytes) -> KVEventBatch[Any]:
        """Raises KVEventDecodeError: not a valid vLLM batch (names the path)."""
        scanned = None if self._scan is None else self._scan(payload, _SCANNED_CLASSES)
        if isinstance(scanned, VEventBatch):
            batch = scanned
        else:  # (None: msgspec decodes it)
            try:
                batch = self._decoder.decode(payload)
            except msgspec.DecodeError as exc:
                raise KVEventDecodeError(f"bad map-form KV event batch: {exc}") from exc
            except RecursionError as exc:  # a value nested past msgspec's depth
                raise KVEventDecodeError("bad map-form KV event batch: nested too deep") from exc
        events = [e for e in map(self._convert, batch.events) if e is not None]
        return KVEventBatch(batch.ts, tuple(events), batch.data_parallel_rank)

    def decode_frames(self, frames: Sequence[bytes]) -> tuple[str, int, KVEventBatch[Any]]:
        """`(topic, seq, batch)` from the three frames of one message."""
        if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
            raise KVEventDecodeError("expected 3 frames [topic, 8-byte seq, payload]")
        topic = frames[0].decode("utf-8", errors="replace")
        return topic, int.from_bytes(frames[1], "big"), self.decode_batch(frames[2])

    def _convert(
        self, event: VBlockStored[Any] | VBlockRemoved | VAllBlocksCleared
    ) -> KVEvent | None:
        if isinstance(event, VAllBlocksCleared):
            return AllBlocksCleared()
        if event.medium not in DEVICE_TIERS:
            return None
        hashes = _ints(event.block_hashes)
        if isinstance(event, VBlockRemoved):
            if event.group_idx in self._state_groups:
                return StatesRemoved(hashes)
            return None if event.group_idx in self._other_groups else BlockRemoved(hashes)
        kind, group = event.kv_cache_spec_kind, event.group_idx
        if kind == MAMBA:
            if group is not None:
                self._state_groups.add(group)
            return StatesStored(hashes)
        if kind not in PREFIX_KINDS:
            if group is not None and group not in self._other_groups:
                self._other_groups.add(group)
                logger.info("KV cache group %d (%s) caches no whole prefix: its events are "
                            "not indexed", group, kind)  # fmt: skip
            return None
        parent = None if event.parent_block_hash is None else _int(event.parent_block_hash)
        try:
            salt = stored_salt(event)
        except UnreadKey as exc:  # (the index rejects it, counted and logged)
            return UnreadBlockStored(
                hashes, parent, event.token_ids, event.block_size, None, str(exc)
            )
        if salt is None:
            return BlockStored(hashes, parent, event.token_ids, event.block_size)
        return SaltedBlockStored(hashes, parent, event.token_ids, event.block_size, None, salt)

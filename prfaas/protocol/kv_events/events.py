"""KV events as msgspec structs in PrfaaS's positional layout (see `prfaas.protocol.kv_events`).

The structs are declared as SGLang declared its own before 0.5.23 (`array_like`,
`omit_defaults`, `gc=False`, tagged by class name), so msgspec writes the same bytes
SGLang's publisher wrote then, and typed decoding validates every field in C: hashes and
token ids are ints, `block_size` is positive, token ids fit the uint32 the index hashes
them as.

A `BlockStored`'s token ids come in one of three forms (its type parameter): decoded
(`TokenIds`, what publishers build and most readers take), or for the gateway's KV index
(`decode_batch(..., packed_ids=True)`), which hashes them in C and never makes a Python int
of each id (that was most of what reading an event cost): uint32 ids in an array
(`IdArray`), read by `_scan.c` (C, optional at install) from the batches in the forms it
reads, or, for any other batch, left in their msgpack encoding by msgspec (`PackedIds`),
which the index unpacks and validates when it applies the event
(`prfaas.common.hashing.unpack_ids`).
Why the scan: msgspec skips packed ids one by one, about 8 us of the 9 an event of 18
blocks took, and hashing read them again; the scan reads them once.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Annotated, Any, Generic, TypeVar

import msgspec

_scan: ModuleType | None
try:
    from prfaas.protocol.kv_events import _scan
except ImportError:  # the extension did not build: msgspec reads every batch
    _scan = None
if sys.byteorder != "little" or memoryview(bytes(4)).cast("I").itemsize != 4:
    _scan = None  # its ids are 4 bytes, little-endian
scan_batch = getattr(_scan, "scan_batch", None)
scan_map_batch = getattr(_scan, "scan_map_batch", None)  # (`vllm_events`' decoder's)

SEQ_BYTES = 8

TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]  # packed as uint32 when hashed
BlockSize = Annotated[int, msgspec.Meta(gt=0)]
TokenIds = tuple[TokenId, ...]
PackedIds = msgspec.Raw
"""Token ids as their msgpack array, unread."""
IdArray = memoryview
"""Token ids as uint32 in a `memoryview` of format "I" (its bytes little-endian, as the block
hash reads them). For the index only: `encode_batch` would write it as msgpack bin, not as
the array of ids it was read from."""
Ids = TypeVar("Ids", TokenIds, PackedIds, IdArray)


class _KVEventBase(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True, tag=True
):
    """SGLang's `KVCacheEvent`: an event is the array `[class name, *fields]`.

    Subclasses inherit the config; they repeat `frozen=True` only so mypy sees it.
    """


class BlockStored(_KVEventBase, Generic[Ids], frozen=True):
    """Full blocks entered the prefix cache, chained after `parent_block_hash`.

    `token_ids` holds every token of every stored block, in order, so a subscriber can
    re-hash them with its own function (`len(token_ids) == len(block_hashes) * block_size`).
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: Ids
    block_size: BlockSize
    lora_id: int | None = None


class SaltedBlockStored(BlockStored[Ids], Generic[Ids], frozen=True):
    """PrfaaS-internal, never on the wire: blocks an engine keyed by a request's
    `cache_salt` as well as their tokens (the map-form decoder makes it from vLLM's and
    SGLang 0.5.23's events). The index chains a salted chain's first block to
    `hashing.salt_root(cache_salt)`, as the router chains a salted prompt's."""

    cache_salt: str = ""


class UnreadBlockStored(BlockStored[Ids], Generic[Ids], frozen=True):
    """PrfaaS-internal, never on the wire: blocks an engine keyed by more than their tokens
    in a way the router cannot know from a request (`key` says what: a LoRA adapter, a
    multimodal input), which the index rejects (counted, logged once per instance)."""

    key: str = ""


class BlockRemoved(_KVEventBase, frozen=True):
    """Blocks left the prefix cache (evicted or flushed)."""

    block_hashes: tuple[int, ...]


class AllBlocksCleared(_KVEventBase, frozen=True):
    """The whole prefix cache was flushed."""


class StatesStored(_KVEventBase, frozen=True):
    """PrfaaS extension, not on SGLang's wire (the vLLM decoder makes it from a Mamba
    group's `BlockStored`): a hybrid engine kept its linear-attention states at the end of
    these blocks (its hashes of blocks it reports KV for too). Such an engine reuses a
    prefix only up to a block with states; an empty one says the engine is hybrid."""

    block_hashes: tuple[int, ...]


class StatesRemoved(_KVEventBase, frozen=True):
    """PrfaaS extension: the states kept at the end of these blocks were dropped."""

    block_hashes: tuple[int, ...]


KVEvent = BlockStored[Any] | BlockRemoved | AllBlocksCleared | StatesStored | StatesRemoved


class KVEventBatch(
    msgspec.Struct, Generic[Ids], array_like=True, omit_defaults=True, gc=False, frozen=True
):
    """Events published together; `ts` is the publisher's wall-clock time in seconds."""

    ts: float
    events: tuple[
        BlockStored[Ids] | BlockRemoved | AllBlocksCleared | StatesStored | StatesRemoved, ...
    ]
    attn_dp_rank: int | None = None


class KVEventDecodeError(ValueError):
    """A frame or payload that is not a valid SGLang KV event message."""


_ENCODER = msgspec.msgpack.Encoder()
_DECODERS: dict[bool, msgspec.msgpack.Decoder[KVEventBatch[Any]]] = {
    False: msgspec.msgpack.Decoder(KVEventBatch[TokenIds]),
    True: msgspec.msgpack.Decoder(KVEventBatch[PackedIds]),
}


def encode_batch(batch: KVEventBatch[Any]) -> bytes:
    """msgpack payload of `batch`, byte-identical to SGLang's msgspec encoding."""
    return _ENCODER.encode(batch)


def encode_frames(topic: str, seq: int, batch: KVEventBatch[Any]) -> list[bytes]:
    """The three ZMQ frames `[topic, seq (8 bytes big-endian), payload]`."""
    return [topic.encode("utf-8"), seq.to_bytes(SEQ_BYTES, "big"), encode_batch(batch)]


_SCANNED_CLASSES = (
    BlockStored,
    BlockRemoved,
    AllBlocksCleared,
    StatesStored,
    StatesRemoved,
    KVEventBatch,
)
"""What `scan_batch` builds a batch of, in its order. They must not validate when called
(msgspec's structs do not): the scan vouches for the fields, as msgspec's decoding does."""


def decode_batch(payload: bytes, *, packed_ids: bool = False) -> KVEventBatch[Any]:
    """Inverse of `encode_batch`; unknown trailing fields are ignored (newer publishers).
    `packed_ids`: `BlockStored` token ids for the KV index: an `IdArray` (checked as uint32
    when decoded) where `_scan` reads the batch, else `PackedIds` (checked when hashed).

    Raises:
        KVEventDecodeError: `payload` is not msgpack or not a valid batch (the message
            names the offending path, e.g. ``$[1][0][3]``).
    """
    if packed_ids and scan_batch is not None:
        scanned = scan_batch(payload, _SCANNED_CLASSES)
        if isinstance(scanned, KVEventBatch):  # (None: msgspec decodes it)
            return scanned
    try:
        return _DECODERS[packed_ids].decode(payload)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError too
        raise KVEventDecodeError(f"bad KV event batch: {exc}") from exc
    except RecursionError as exc:  # a value nested past msgspec's depth
        raise KVEventDecodeError(f"bad KV event batch: nested too deep ({exc})") from exc


def decode_frames(
    frames: Sequence[bytes], *, packed_ids: bool = False
) -> tuple[str, int, KVEventBatch[Any]]:
    """`(topic, seq, batch)` from the three frames of one message (`packed_ids`: as
    `decode_batch`'s)."""
    if len(frames) != 3:
        raise KVEventDecodeError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq, payload = frames
    if len(seq) != SEQ_BYTES:
        raise KVEventDecodeError(f"sequence frame must be {SEQ_BYTES} bytes, got {len(seq)}")
    try:
        name = topic.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KVEventDecodeError(f"topic is not UTF-8: {topic!r:.80}") from exc
    return name, int.from_bytes(seq, "big"), decode_batch(payload, packed_ids=packed_ids)


def event_slices(events: Sequence[KVEvent], blocks: int) -> list[tuple[KVEvent, ...]]:
    """`events` cut, in order, into runs of about `blocks` stored blocks each."""
    pieces: list[tuple[KVEvent, ...]] = []
    start = held = 0
    for i, event in enumerate(events):
        if isinstance(event, BlockStored):
            held += len(event.block_hashes)
        if held >= blocks:
            pieces.append(tuple(events[start : i + 1]))
            start, held = i + 1, 0
    if start < len(events):
        pieces.append(tuple(events[start:]))
    return pieces

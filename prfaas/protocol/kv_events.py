"""KV events and their msgpack codec: SGLang's wire layout (see the package docstring)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

SEQ_BYTES = 8


@dataclass(frozen=True)
class BlockStored:
    """Full blocks entered the prefix cache, chained after `parent_block_hash`.

    `token_ids` holds every token of every stored block, in order, so a subscriber can
    re-hash them with its own function (`len(token_ids) == len(block_hashes) * block_size`).
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks left the prefix cache (evicted or flushed)."""

    block_hashes: tuple[int, ...]
    medium: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was flushed."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventBatch:
    """Events published together; `ts` is the publisher's wall-clock time in seconds."""

    ts: float
    events: tuple[KVEvent, ...]
    attn_dp_rank: int | None = None


class KVEventDecodeError(ValueError):
    """A frame or payload that is not a valid SGLang KV event message."""


# ---------------------------------------------------------------------------- encoding


def _event_to_wire(event: KVEvent) -> list[Any]:
    if isinstance(event, BlockStored):
        fields: list[Any] = [
            "BlockStored",
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            event.lora_id,
        ]
        return [*fields, event.medium] if event.medium is not None else fields
    if isinstance(event, BlockRemoved):
        removed: list[Any] = ["BlockRemoved", list(event.block_hashes)]
        return [*removed, event.medium] if event.medium is not None else removed
    return ["AllBlocksCleared"]


def encode_batch(batch: KVEventBatch) -> bytes:
    """msgpack payload of `batch`, byte-identical to SGLang's msgspec encoding."""
    wire = [float(batch.ts), [_event_to_wire(e) for e in batch.events], batch.attn_dp_rank]
    return msgpack.packb(wire, use_bin_type=True)  # type: ignore[no-any-return]


def encode_frames(topic: str, seq: int, batch: KVEventBatch) -> list[bytes]:
    """The three ZMQ frames `[topic, seq (8 bytes big-endian), payload]`."""
    return [topic.encode("utf-8"), seq.to_bytes(SEQ_BYTES, "big"), encode_batch(batch)]


# ---------------------------------------------------------------------------- decoding


def _int_list(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise KVEventDecodeError(f"{what} must be a list of integers, got {value!r:.80}")
    return tuple(value)


def _opt(value: Any, kind: type, what: str) -> Any:
    if value is not None and type(value) is not kind:
        raise KVEventDecodeError(f"{what} must be {kind.__name__} or nil, got {value!r:.80}")
    return value


def _stored(f: list[Any]) -> BlockStored:
    if len(f) < 4:
        raise KVEventDecodeError(f"BlockStored needs at least 4 fields, got {len(f)}")
    if type(f[3]) is not int or f[3] <= 0:
        raise KVEventDecodeError(f"BlockStored block_size must be a positive int, got {f[3]!r}")
    return BlockStored(
        block_hashes=_int_list(f[0], "BlockStored.block_hashes"),
        parent_block_hash=_opt(f[1], int, "BlockStored.parent_block_hash"),
        token_ids=_int_list(f[2], "BlockStored.token_ids"),
        block_size=f[3],
        lora_id=_opt(f[4] if len(f) > 4 else None, int, "BlockStored.lora_id"),
        medium=_opt(f[5] if len(f) > 5 else None, str, "BlockStored.medium"),
    )


def _removed(f: list[Any]) -> BlockRemoved:
    if len(f) < 1:
        raise KVEventDecodeError("BlockRemoved needs block_hashes")
    medium = _opt(f[1] if len(f) > 1 else None, str, "BlockRemoved.medium")
    return BlockRemoved(_int_list(f[0], "BlockRemoved.block_hashes"), medium)


_STORED_KEYS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")
_FIELD_ORDER: dict[str, tuple[str, ...]] = {
    "BlockStored": (*_STORED_KEYS, "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _map_to_fields(tag: str, obj: dict[Any, Any]) -> list[Any]:
    # vLLM encodes events as maps; missing optional fields default to nil.
    return [obj.get(name) for name in _FIELD_ORDER.get(tag, ())]


def decode_event(obj: Any) -> KVEvent:
    """One event from its decoded msgpack value (array form, or vLLM's map form)."""
    if isinstance(obj, list) and obj and isinstance(obj[0], str):
        tag, fields = obj[0], obj[1:]
    elif isinstance(obj, dict) and isinstance(obj.get("type"), str):
        tag = obj["type"]
        fields = _map_to_fields(tag, obj)
    else:
        raise KVEventDecodeError(f"event must be a tagged array or map, got {obj!r:.80}")
    if tag == "BlockStored":
        return _stored(fields)
    if tag == "BlockRemoved":
        return _removed(fields)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise KVEventDecodeError(f"unknown event tag {tag!r}")


def decode_batch(payload: bytes) -> KVEventBatch:
    """Inverse of `encode_batch`; raises `KVEventDecodeError` on anything malformed."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise KVEventDecodeError(f"payload is not msgpack: {exc}") from exc
    if not isinstance(obj, list) or len(obj) < 2 or not isinstance(obj[1], list):
        raise KVEventDecodeError(f"batch must be [ts, events, ...], got {obj!r:.80}")
    ts = obj[0]
    if type(ts) not in (float, int):
        raise KVEventDecodeError(f"batch ts must be a number, got {ts!r:.80}")
    rank = _opt(obj[2] if len(obj) > 2 else None, int, "batch attn_dp_rank")
    return KVEventBatch(float(ts), tuple(decode_event(e) for e in obj[1]), rank)


def decode_frames(frames: Sequence[bytes]) -> tuple[str, int, KVEventBatch]:
    """`(topic, seq, batch)` from the three frames of one message."""
    if len(frames) != 3:
        raise KVEventDecodeError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq, payload = frames
    if len(seq) != SEQ_BYTES:
        raise KVEventDecodeError(f"sequence frame must be {SEQ_BYTES} bytes, got {len(seq)}")
    try:
        name = topic.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KVEventDecodeError(f"topic is not UTF-8: {topic!r:.80}") from exc
    return name, int.from_bytes(seq, "big"), decode_batch(payload)

"""KV cache events in SGLang's ZMQ wire format: dataclasses, codec, publisher, subscriber.

Wire format (byte-compatible with SGLang's `ZmqEventPublisher`, which encodes msgspec
structs declared `array_like=True` with `tag=True` on the events):

* a ZMQ multipart message `[topic, seq, payload]`: `topic` the UTF-8 topic (often empty),
  `seq` the batch sequence number as 8 bytes big-endian (0, 1, 2, ... per publisher),
  `payload` one msgpack `KVEventBatch`;
* `KVEventBatch` = array `[ts, events, attn_dp_rank]` (msgspec writes every field of an
  array-like struct, nil included; SGLang's publisher stamps its DP rank, 0 by default);
  the decoder also takes SGLang's older two-field `[ts, events]`;
* each event is an array whose first element is the class name as the tag:
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id]`
  and `["BlockRemoved", block_hashes]`, each followed by `medium` only when it is set (a
  vLLM field SGLang lacks), and `["AllBlocksCleared"]`.

The decoder also accepts the map form vLLM uses for events (`{"type": "BlockStored", ...}`)
and ignores unknown trailing fields, so newer publishers stay readable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import msgpack
import zmq
import zmq.asyncio

logger = logging.getLogger(__name__)

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


# ---------------------------------------------------------------------------- ZMQ PUB / SUB


class KVEventPublisher:
    """Binds a ZMQ PUB socket and publishes event batches with sequence numbers 0, 1, ...

    `publish` never blocks (ZMQ queues up to `hwm` messages per subscriber, then drops), so
    it is safe to call from the event loop. Not thread-safe: use it from one thread.
    `endpoint` may use a wildcard port (`tcp://127.0.0.1:*`); `.endpoint` gives the bound one.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "",
        hwm: int = 100_000,
        clock: Callable[[], float] = time.time,
        attn_dp_rank: int | None = 0,
    ) -> None:
        if hwm <= 0:
            raise ValueError(f"hwm must be positive, got {hwm}")
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"cannot bind KV event publisher to {endpoint!r}: {exc}") from exc
        self._endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = topic
        self._clock = clock
        self._rank = attn_dp_rank
        self._seq = 0
        self.num_dropped = 0

    @property
    def endpoint(self) -> str:
        """The bound endpoint, wildcard port resolved."""
        return self._endpoint

    @property
    def next_seq(self) -> int:
        """Sequence number the next published batch will carry."""
        return self._seq

    def publish(self, events: Sequence[KVEvent]) -> int | None:
        """Send `events` as one batch stamped with the clock; returns its sequence number.

        Nothing is sent for an empty `events` (returns None).
        """
        if not events:
            return None
        seq = self._seq
        batch = KVEventBatch(self._clock(), tuple(events), self._rank)
        try:
            self._sock.send_multipart(encode_frames(self._topic, seq, batch), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.num_dropped += 1  # the sequence gap tells subscribers
        self._seq += 1
        return seq

    def close(self) -> None:
        """Close the socket and its context (idempotent)."""
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@dataclass(frozen=True)
class ReceivedBatch:
    """One batch as a subscriber saw it, with what the sequence numbers say was lost.

    `missed`: batches skipped just before this one (slow join, HWM drop, reconnect).
    `restarted`: the sequence went backwards, so the publisher restarted; any state built
    from its earlier events is stale. Either way the consumer should resynchronise.
    """

    topic: str
    seq: int
    batch: KVEventBatch
    missed: int
    restarted: bool


class KVEventSubscriber:
    """Connects a ZMQ SUB socket to a publisher and yields decoded batches (asyncio).

    ZMQ reconnects by itself when the publisher goes away and comes back; the sequence
    numbers expose what was lost meanwhile (`ReceivedBatch.missed` / `.restarted`).
    Malformed messages are logged, counted in `num_decode_errors` and skipped.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "",
        reconnect_ivl_ms: int = 100,
        reconnect_ivl_max_ms: int = 5_000,
    ) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RECONNECT_IVL, reconnect_ivl_ms)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, reconnect_ivl_max_ms)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"cannot connect KV event subscriber to {endpoint!r}: {exc}") from exc
        self._last_seq: int | None = None
        self.num_decode_errors = 0
        self.num_missed = 0

    async def recv(self) -> ReceivedBatch:
        """The next well-formed batch (bound the wait with `asyncio.timeout`)."""
        while True:
            frames = await self._sock.recv_multipart()
            try:
                topic, seq, batch = decode_frames(frames)
            except KVEventDecodeError as exc:
                self.num_decode_errors += 1
                logger.warning("dropping malformed KV event message: %s", exc)
                continue
            return self._track(topic, seq, batch)

    def _track(self, topic: str, seq: int, batch: KVEventBatch) -> ReceivedBatch:
        expected = 0 if self._last_seq is None else self._last_seq + 1
        restarted = self._last_seq is not None and seq <= self._last_seq
        missed = seq if restarted else seq - expected
        self._last_seq = seq
        self.num_missed += missed
        return ReceivedBatch(topic, seq, batch, missed, restarted)

    def __aiter__(self) -> KVEventSubscriber:
        return self

    async def __anext__(self) -> ReceivedBatch:
        return await self.recv()

    def close(self) -> None:
        """Close the socket and its context (idempotent)."""
        self._sock.close(linger=0)
        self._ctx.term()

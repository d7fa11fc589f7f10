"""ZMQ SUB side of the KV event stream (asyncio): decoding, gap detection, replay."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio

from prfaas.protocol.kv_events.events import (
    SEQ_BYTES,
    KVEventBatch,
    KVEventDecodeError,
    decode_batch,
    decode_frames,
)
from prfaas.protocol.kv_events.publisher import END_SEQ

logger = logging.getLogger(__name__)


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
    numbers expose what was lost meanwhile (`ReceivedBatch.missed` / `.restarted`). With
    `replay_endpoint` (the publisher's, SGLang's protocol) a gap is first filled from the
    publisher's buffer, so batches come out gapless whenever it still holds them.
    Malformed messages are logged, counted in `num_decode_errors` and skipped.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "",
        reconnect_ivl_ms: int = 100,
        reconnect_ivl_max_ms: int = 5_000,
        replay_endpoint: str | None = None,
        replay_timeout_s: float = 1.0,
        decode: Callable[[Sequence[bytes]], tuple[str, int, KVEventBatch]] = decode_frames,
    ) -> None:
        """`decode` turns one message's frames into `(topic, seq, batch)`: SGLang's format by
        default, `VLLMEventDecoder().decode_frames` for a vLLM publisher."""
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
        self._decode = decode
        self._replay_endpoint = replay_endpoint
        self._replay_timeout = replay_timeout_s
        self._ready: deque[ReceivedBatch] = deque()
        self._last_seq: int | None = None
        self.num_decode_errors = 0
        self.num_missed = 0
        self.num_replayed = 0

    async def recv(self) -> ReceivedBatch:
        """The next well-formed batch (bound the wait with `asyncio.timeout`).

        Raises:
            RuntimeError: the subscriber is closed.
        """
        if self._sock.closed:
            raise RuntimeError("KV event subscriber is closed")
        while not self._ready:
            topic, seq, batch = await self._next_message()
            first_lost = self._first_lost(seq)
            if first_lost is not None and self._replay_endpoint is not None:
                for old_seq, old in await self._fetch_replay(first_lost, seq):
                    self._ready.append(self._track(topic, old_seq, old))
            self._ready.append(self._track(topic, seq, batch))
        return self._ready.popleft()

    async def _next_message(self) -> tuple[str, int, KVEventBatch]:
        while True:
            frames = await self._sock.recv_multipart()
            try:
                return self._decode(frames)
            except KVEventDecodeError as exc:
                self.num_decode_errors += 1
                logger.warning("dropping malformed KV event message: %s", exc)

    def _first_lost(self, seq: int) -> int | None:
        """First sequence number lost just before `seq`, or None when nothing was."""
        last = self._last_seq
        if last is None or seq <= last:  # first message, or a restarted publisher
            return 0 if seq > 0 else None
        return last + 1 if seq > last + 1 else None

    async def _fetch_replay(self, start: int, stop: int) -> list[tuple[int, KVEventBatch]]:
        """Batches with `start <= seq < stop` from the replay endpoint, in order."""
        assert self._replay_endpoint is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        got: list[tuple[int, KVEventBatch]] = []
        try:
            sock.connect(self._replay_endpoint)
            await sock.send_multipart([b"", start.to_bytes(SEQ_BYTES, "big")])
            async with asyncio.timeout(self._replay_timeout):
                while (frames := await sock.recv_multipart())[1:2] != [END_SEQ]:
                    seq = int.from_bytes(frames[1], "big")
                    if len(frames) == 3 and start <= seq < stop:
                        got.append((seq, decode_batch(frames[2])))
        except (TimeoutError, KVEventDecodeError, IndexError) as exc:
            logger.warning("KV event replay from %d incomplete: %r", start, exc)
        finally:
            sock.close(linger=0)
        self.num_replayed += len(got)
        return got

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

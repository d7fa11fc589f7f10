"""ZMQ PUB side of the KV event stream, with SGLang's optional replay endpoint (which also
answers snapshot requests, a PrfaaS extension: see `prfaas.protocol.kv_events`)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from types import TracebackType

import zmq

from prfaas.protocol.kv_events.cache_mirror import CacheMirror
from prfaas.protocol.kv_events.events import (
    SEQ_BYTES,
    KVEvent,
    KVEventBatch,
    encode_batch,
    encode_frames,
    event_slices,
)

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)  # SGLang's end-of-replay marker
SNAPSHOT_SEQ = (-2).to_bytes(SEQ_BYTES, "big", signed=True)
"""A replay request from this "sequence number" asks for a snapshot (PrfaaS extension); an
SGLang or vLLM publisher reads it as 2**64 - 2 and answers with END_SEQ alone."""
SNAPSHOT_BLOCKS_PER_BATCH = 256
"""A snapshot goes out in batches of about this many blocks (its chains whole): a subscriber
decodes one in about a millisecond and yields to its event loop between them (one batch of
256 chains, 16K blocks, held a gateway's loop about 50 ms)."""


class _ReplayServer:
    """SGLang's replay endpoint: a ROUTER socket serving recent batches from a buffer, and
    snapshots of the publisher's cache.

    A request is `[identity, b"", start_seq]`; the reply is one `[identity, b"", seq,
    payload]` per buffered batch with `seq >= start_seq`, then `[identity, b"", END_SEQ,
    b""]`. A snapshot request (`start_seq` = SNAPSHOT_SEQ) is answered `[identity, b"",
    SNAPSHOT_SEQ, next_seq]`, then `[identity, b"", next_seq, payload]` per batch of
    events that rebuild everything cached after every batch before `next_seq` (none after
    it), then END_SEQ. Served from a daemon thread that owns the ROUTER socket; `record`
    runs on the publishing thread, under the lock that keeps buffer, mirror and sequence
    number in step.
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, steps: int) -> None:
        if steps <= 0:
            raise ValueError(f"buffer_steps must be positive, got {steps}")
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close()
            raise ValueError(f"cannot bind KV event replay to {endpoint!r}: {exc}") from exc
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=steps)
        self._mirror = CacheMirror()
        self._next_seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-event-replay", daemon=True)
        self._thread.start()

    def record(self, seq: int, payload: bytes, events: Sequence[KVEvent]) -> None:
        with self._lock:
            self._buffer.append((seq, payload))
            self._mirror.apply(events)
            self._next_seq = seq + 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sock.poll(50):
                    self._answer(self._sock.recv_multipart())
        finally:
            self._sock.close(linger=0)

    def _answer(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[2]) != SEQ_BYTES:
            logger.warning("ignoring malformed KV event replay request (%d frames)", len(frames))
            return
        identity = frames[0]
        if frames[2] == SNAPSHOT_SEQ:
            self._send_snapshot(identity)
        else:
            start = int.from_bytes(frames[2], "big")
            with self._lock:
                batches = [(seq, payload) for seq, payload in self._buffer if seq >= start]
            for seq, payload in batches:
                self._sock.send_multipart([identity, b"", seq.to_bytes(SEQ_BYTES, "big"), payload])
        self._sock.send_multipart([identity, b"", END_SEQ, b""])

    def _send_snapshot(self, identity: bytes) -> None:
        with self._lock:  # a cut between two published batches
            events, seq = self._mirror.snapshot(), self._next_seq
        at = seq.to_bytes(SEQ_BYTES, "big")
        self._sock.send_multipart([identity, b"", SNAPSHOT_SEQ, at])
        for piece in event_slices(events, SNAPSHOT_BLOCKS_PER_BATCH):
            payload = encode_batch(KVEventBatch(time.time(), piece))
            self._sock.send_multipart([identity, b"", at, payload])


class KVEventPublisher:
    """Binds a ZMQ PUB socket and publishes event batches with sequence numbers 0, 1, ...

    `publish` never blocks (ZMQ queues up to `hwm` messages per subscriber, then drops), so
    it is safe to call from the event loop. Not thread-safe: use it from one thread.
    `endpoint` may use a wildcard port (`tcp://127.0.0.1:*`); `.endpoint` gives the bound one.
    With `replay_endpoint`, the last `buffer_steps` batches are also served on SGLang's
    replay protocol, so a subscriber can fill a sequence gap (`KVEventSubscriber`), and so
    is a snapshot of everything the published events say is cached now (a subscriber that
    joins late, e.g. a gateway started beside running engines, loads it first).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "",
        hwm: int = 100_000,
        clock: Callable[[], float] = time.time,
        attn_dp_rank: int | None = 0,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
    ) -> None:
        if hwm <= 0:
            raise ValueError(f"hwm must be positive, got {hwm}")
        self._ctx = zmq.Context()
        self._replay: _ReplayServer | None = None
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"cannot bind KV event publisher to {endpoint!r}: {exc}") from exc
        self._endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if replay_endpoint is not None:
            try:
                self._replay = _ReplayServer(self._ctx, replay_endpoint, buffer_steps)
            except ValueError:
                self.close()
                raise
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
    def replay_endpoint(self) -> str | None:
        """The bound replay endpoint, if replay is on."""
        return None if self._replay is None else self._replay.endpoint

    @property
    def next_seq(self) -> int:
        """Sequence number the next published batch will carry."""
        return self._seq

    def publish(self, events: Sequence[KVEvent]) -> int | None:
        """Send `events` as one batch stamped with the clock; returns its sequence number.

        Nothing is sent for an empty `events` (returns None).

        Raises:
            RuntimeError: the publisher is closed.
        """
        if self._sock.closed:
            raise RuntimeError("KV event publisher is closed")
        if not events:
            return None
        seq = self._seq
        # float(): msgspec writes an int clock reading as a msgpack int, SGLang a float64.
        batch = KVEventBatch(float(self._clock()), tuple(events), self._rank)
        frames = encode_frames(self._topic, seq, batch)
        if self._replay is not None:
            self._replay.record(seq, frames[2], events)
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.num_dropped += 1  # the sequence gap tells subscribers
        self._seq += 1
        return seq

    def close(self) -> None:
        """Stop replay, close the sockets and the context (idempotent)."""
        if self._replay is not None:
            self._replay.close()
            self._replay = None
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

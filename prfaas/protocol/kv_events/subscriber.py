"""ZMQ SUB side of the KV event stream (asyncio): decoding, gap detection, replay, and the
catch-up of a late subscriber (a snapshot, else what the replay buffer still holds)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from prfaas.protocol.kv_events.events import (
    SEQ_BYTES,
    KVEvent,
    KVEventBatch,
    KVEventDecodeError,
    decode_frames,
)
from prfaas.protocol.kv_events.publisher import END_SEQ, SNAPSHOT_SEQ

logger = logging.getLogger(__name__)

Reply = tuple[bytes, bytes, bytes]  # (topic, seq, payload) of one replay answer


@dataclass(frozen=True)
class ReceivedBatch:
    """One batch as a subscriber saw it, with what the sequence numbers say was lost.

    `missed`: batches skipped just before this one (slow join, HWM drop, reconnect).
    `restarted`: the sequence went backwards, so the publisher restarted; any state built
    from its earlier events is stale. Either way the consumer should resynchronise.
    `snapshot`: the events rebuild everything the publisher caches after every batch up
    to `seq` (-1: none): the consumer replaces what it built before with them.
    """

    topic: str
    seq: int
    batch: KVEventBatch[Any]
    missed: int
    restarted: bool
    snapshot: bool = False


class KVEventSubscriber:
    """Connects a ZMQ SUB socket to a publisher and yields decoded batches (asyncio).

    ZMQ reconnects by itself when the publisher goes away and comes back; the sequence
    numbers expose what was lost meanwhile (`ReceivedBatch.missed` / `.restarted`). With
    `replay_endpoint` (the publisher's, SGLang's protocol) a gap is first filled from the
    publisher's buffer, so batches come out gapless whenever it still holds them, and
    `sync` catches a late subscriber up before its first live batch. Where the publisher
    serves snapshots (ours, `KVEventPublisher`), a gap the buffer cannot fill and a
    restart are answered with a fresh snapshot too. Malformed messages are logged, counted
    in `num_decode_errors` and skipped.
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
        decode: Callable[[Sequence[bytes]], tuple[str, int, KVEventBatch[Any]]] = decode_frames,
    ) -> None:
        """`decode` turns one message's frames into `(topic, seq, batch)`: the positional
        layout by default, `VLLMEventDecoder().decode_frames` for a publisher of tagged maps
        (vLLM, SGLang 0.5.23; the gateway's feed tries both). `replay_timeout_s`
        bounds each request to the replay endpoint (a replay or a snapshot)."""
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
        self._live_seen: int | None = None  # the last sequence number read off the SUB socket
        self._stale_below: int | None = None  # a catch-up reflects every batch before this
        self._snapshots = False  # the publisher has answered a snapshot request
        self.num_decode_errors = 0
        self.num_missed = 0
        self.num_replayed = 0
        self.num_stale = 0

    async def sync(self) -> list[ReceivedBatch]:
        """Catch up with what the publisher's events built before this subscriber joined,
        before its first live batch: the publisher's snapshot (one batch, `snapshot=True`)
        where it serves one; else, best effort, what its replay buffer still holds (a vLLM
        or SGLang publisher: the batches of a bounded window, so blocks stored before it
        are missing, never extra); else nothing (no replay endpoint, or no answer within
        `replay_timeout_s` per request). Live batches the catch-up already reflects are
        then skipped. Call it once, before `recv`."""
        if self._replay_endpoint is None:
            return []
        snapshot = await self._fetch_snapshot(missed=0, restarted=False)
        if snapshot is not None:
            return [snapshot]
        replayed = await self._fetch_replay(0, None)
        if not replayed:
            return []
        self._last_seq = replayed[0][0] - 1  # the window's start is not a gap to report
        self._stale_below = replayed[-1][0] + 1
        return [self._track("", seq, batch) for seq, batch in replayed]

    async def recv(self) -> ReceivedBatch:
        """The next well-formed batch (bound the wait with `asyncio.timeout`).

        Raises:
            RuntimeError: the subscriber is closed.
        """
        if self._sock.closed:
            raise RuntimeError("KV event subscriber is closed")
        while not self._ready:
            topic, seq, batch = await self._next_message()
            if self._is_stale(seq):
                self.num_stale += 1
                continue
            self._live_seen = seq
            restarted = self._last_seq is not None and seq <= self._last_seq
            first_lost = self._first_lost(seq)
            if self._replay_endpoint is not None and (first_lost is not None or restarted):
                lost = 0 if first_lost is None else seq - first_lost
                replayed = [] if first_lost is None else await self._fetch_replay(first_lost, seq)
                if self._snapshots and (restarted or len(replayed) < lost):
                    missed = 0 if restarted else lost - len(replayed)
                    snapshot = await self._fetch_snapshot(missed=missed, restarted=restarted)
                    if snapshot is not None:
                        self._ready.append(snapshot)  # it reflects `seq` too: sent before
                        continue
                for old_seq, old in replayed:
                    self._ready.append(self._track(topic, old_seq, old))
            self._ready.append(self._track(topic, seq, batch))
        return self._ready.popleft()

    async def _next_message(self) -> tuple[str, int, KVEventBatch[Any]]:
        while True:
            frames = await self._sock.recv_multipart()
            try:
                return self._decode(frames)
            except KVEventDecodeError as exc:
                self.num_decode_errors += 1
                logger.warning("dropping malformed KV event message: %s", exc)

    def _is_stale(self, seq: int) -> bool:
        """Whether a live batch is one a catch-up already reflects (queued before it was
        taken). A batch from before the last one read live means a restart instead."""
        below = self._stale_below
        if below is None:
            return False
        if seq >= below:
            self._stale_below = None
            return False
        return self._live_seen is None or seq > self._live_seen

    def _first_lost(self, seq: int) -> int | None:
        """First sequence number lost just before `seq`, or None when nothing was."""
        last = self._last_seq
        if last is None or seq <= last:  # first message, or a restarted publisher
            return 0 if seq > 0 else None
        return last + 1 if seq > last + 1 else None

    async def _fetch_replay(
        self, start: int, stop: int | None
    ) -> list[tuple[int, KVEventBatch[Any]]]:
        """Batches with `start <= seq < stop` (no bound: None) from the replay endpoint, in
        order. Takes SGLang's answers (`[b"", seq, payload]`) and vLLM's (`[b"", topic, seq,
        payload]`)."""
        got: list[tuple[int, KVEventBatch[Any]]] = []
        try:
            for topic, seq_bytes, payload in await self._request(start.to_bytes(SEQ_BYTES, "big")):
                seq = int.from_bytes(seq_bytes, "big")
                if start <= seq and (stop is None or seq < stop):
                    got.append((seq, self._decode([topic, seq_bytes, payload])[2]))
        except (TimeoutError, KVEventDecodeError, zmq.ZMQError) as exc:
            logger.warning("KV event replay from %d incomplete: %r", start, exc)
        self.num_replayed += len(got)
        return got

    async def _fetch_snapshot(self, *, missed: int, restarted: bool) -> ReceivedBatch | None:
        """The publisher's snapshot as one batch (None: it serves none, or not in time), and
        from now on the live batches it reflects are skipped."""
        try:
            replies = await self._request(SNAPSHOT_SEQ)
            if not replies or replies[0][1] != SNAPSHOT_SEQ:
                return None  # an SGLang or vLLM publisher: no snapshots
            at = int.from_bytes(replies[0][2], "big")
            events: list[KVEvent] = []
            ts = 0.0
            for topic, seq_bytes, payload in replies[1:]:
                part = self._decode([topic, seq_bytes, payload])[2]
                events.extend(part.events)
                ts = part.ts
                await asyncio.sleep(0)  # a batch's decoding holds the loop, not the snapshot's
        except (TimeoutError, KVEventDecodeError, zmq.ZMQError) as exc:
            logger.warning("KV event snapshot incomplete: %r", exc)
            return None
        self._snapshots = True
        self._last_seq, self._stale_below = at - 1, at
        return ReceivedBatch("", at - 1, KVEventBatch(ts, tuple(events)), missed, restarted, True)

    async def _request(self, start: bytes) -> list[Reply]:
        """One request to the replay endpoint: its answers up to the end marker.

        Raises:
            TimeoutError: no complete answer within `replay_timeout_s`.
        """
        assert self._replay_endpoint is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        replies: list[Reply] = []
        try:
            sock.connect(self._replay_endpoint)
            await sock.send_multipart([b"", start])
            async with asyncio.timeout(self._replay_timeout):
                while True:
                    frames = (await sock.recv_multipart())[1:]  # after the empty delimiter
                    if len(frames) == 2:
                        frames = [b"", *frames]  # SGLang's layout has no topic
                    if len(frames) != 3:
                        raise KVEventDecodeError(f"replay answer of {len(frames)} frames")
                    if frames[1] == END_SEQ:
                        return replies
                    replies.append((frames[0], frames[1], frames[2]))
        finally:
            sock.close(linger=0)

    def _track(self, topic: str, seq: int, batch: KVEventBatch[Any]) -> ReceivedBatch:
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

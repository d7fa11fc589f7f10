"""One decode peer as seen by the sender: its N connections, send queue, window and acks.

Frames wait in one queue shared by the peer's connections; each connection's writer takes
the next frame when the in-flight window allows (work-stealing striping). A frame stays
"in flight" until the receiver ACKs it; when a connection dies, its unacknowledged frames
go back to the front of the queue and are re-sent on the others or on its replacement.
The window bounds the span from the oldest unacknowledged byte to the newest sent byte,
so the receiver's reassembly buffer is bounded by the same amount.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from prfaas.engines.transport.config import SenderConfig
from prfaas.engines.transport.errors import ProtocolError
from prfaas.engines.transport.frames import Frame, Kind
from prfaas.engines.transport.pacing import TokenBucket
from prfaas.engines.transport.tcp_info import sample_tcp_info, set_user_timeout
from prfaas.engines.transport.telemetry import ConnectionTelemetry, EgressMeter
from prfaas.engines.transport.wire import (
    CONTROL_MAX,
    parse_ack,
    read_frame,
    verify,
    write_frame,
)


class PeerEvents(Protocol):
    """What a peer reports to its sender (all called on the event loop)."""

    def on_register(self, peer: SenderPeer, room: int) -> None: ...
    def on_done(self, peer: SenderPeer, room: int) -> None: ...
    def on_cancel(self, peer: SenderPeer, room: int, reason: str) -> None: ...
    def on_peer_lost(self, peer: SenderPeer) -> None: ...


@dataclass(eq=False)
class _Conn:
    index: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    last_read: float
    bytes_sent: int = 0
    closed: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


@dataclass(slots=True)
class _Queued:
    ready_at: float
    frame: Frame
    paced: bool = False
    """Charged to the token buckets (and delayed) already: a frame queued again after its
    connection died is neither charged nor delayed twice."""


@dataclass(slots=True)
class _InFlight:
    item: _Queued
    conn: _Conn
    start: int  # window offset of the frame's first byte


class SenderPeer:
    """Connections, queue and window of one decode peer (identified by its HELLO id)."""

    def __init__(
        self,
        peer_id: str,
        config: SenderConfig,
        events: PeerEvents,
        meter: EgressMeter,
        process_bucket: TokenBucket | None,
    ) -> None:
        self.peer_id = peer_id
        self._config = config
        self._events = events
        self._meter = meter
        self._buckets = [b for b in (process_bucket, self._peer_bucket(config)) if b is not None]
        self._loop = asyncio.get_running_loop()
        self.connections: dict[int, _Conn] = {}
        self._queue: deque[_Queued] = deque()
        self._control: deque[Frame] = deque()
        self._unacked: dict[tuple[int, int, int], _InFlight] = {}
        self._sent = 0
        self.resent_bytes = 0
        self.control_dropped = 0
        self._wake = asyncio.Event()
        self._lost_timer: asyncio.TimerHandle | None = None
        self.closed = False

    @staticmethod
    def _peer_bucket(config: SenderConfig) -> TokenBucket | None:
        rate = config.rate_bytes_per_s
        return TokenBucket(rate, max(config.chunk_bytes, rate * 0.005)) if rate else None

    # -- queue -------------------------------------------------------------------------

    def push(self, frames: list[Frame]) -> None:
        """Queue data frames (in order) behind everything already queued."""
        ready_at = self._loop.time() + self._config.delay_s
        self._queue.extend(_Queued(ready_at, f) for f in frames)
        self._wake.set()

    def push_control(self, frame: Frame) -> None:
        """Queue a control frame ahead of data; not windowed, not acknowledged. Past
        `max_control_frames` queued (a peer that does not read) it is dropped and counted."""
        if len(self._control) >= self._config.max_control_frames:
            self.control_dropped += 1
            return
        self._control.append(frame)
        self._wake.set()

    def purge(self, room: int) -> None:
        """Forget every queued and in-flight frame of `room` (failed or cancelled)."""
        self._queue = deque(q for q in self._queue if q.frame.room != room)
        for key in [k for k in self._unacked if k[0] == room]:
            del self._unacked[key]
        self._wake.set()

    @property
    def in_flight_bytes(self) -> int:
        """Window span: newest sent byte minus oldest unacknowledged byte."""
        if not self._unacked:
            return 0
        return self._sent - next(iter(self._unacked.values())).start

    @property
    def queued_frames(self) -> int:
        return len(self._queue)

    def _window_allows(self, nbytes: int) -> bool:
        return not self._unacked or self.in_flight_bytes + nbytes <= self._config.window_bytes

    async def _next(self, conn: _Conn) -> tuple[Frame, _Queued | None]:
        """The next frame for `conn`: a control frame (None) or a data frame's queue item."""
        while not conn.closed:
            if self._control:
                return self._control.popleft(), None
            if self._queue and self._window_allows(self._queue[0].frame.length):
                item = self._queue.popleft()
                self._unacked[item.frame.key] = _InFlight(item, conn, self._sent)
                self._sent += item.frame.length
                return item.frame, item
            self._wake.clear()
            await self._wake.wait()
        raise ConnectionError("connection closed")

    # -- connections -------------------------------------------------------------------

    def attach(
        self, index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Adopt a new connection for slot `index` (replacing a stale one)."""
        old = self.connections.get(index)
        if old is not None:
            self._drop(old)
        conn = _Conn(index, reader, writer, self._loop.time())
        set_user_timeout(writer.get_extra_info("socket"), self._config.tcp_user_timeout_s)
        self.connections[index] = conn
        conn.tasks = [
            asyncio.create_task(self._write_loop(conn)),
            asyncio.create_task(self._read_loop(conn)),
        ]
        if self._lost_timer is not None:
            self._lost_timer.cancel()
            self._lost_timer = None

    async def _write_loop(self, conn: _Conn) -> None:
        try:
            while True:
                frame, item = await self._next(conn)
                if item is not None and not item.paced:
                    for bucket in self._buckets:
                        await bucket.acquire(frame.length)
                    item.paced = True
                    delay = item.ready_at - self._loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                if conn.closed:
                    return
                nbytes = write_frame(conn.writer, frame)
                del frame, item  # while the next frame is awaited: only `_unacked` holds it
                conn.bytes_sent += nbytes
                self._meter.add(self._loop.time(), nbytes)
                await conn.writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self._drop(conn)

    async def _read_loop(self, conn: _Conn) -> None:
        try:
            while True:
                header, payload = await read_frame(conn.reader, CONTROL_MAX)
                conn.last_read = self._loop.time()
                if not verify(header, payload):
                    raise ProtocolError(f"{header.kind.name} frame with a bad checksum")
                self._dispatch(header.kind, header.room, payload)
        except (ConnectionError, OSError, asyncio.IncompleteReadError, ProtocolError):
            pass
        finally:
            self._drop(conn)

    def _dispatch(self, kind: Kind, room: int, payload: bytes) -> None:
        if kind is Kind.ACK:
            for key in parse_ack(payload):
                self._unacked.pop(key, None)
            self._wake.set()
        elif kind is Kind.REGISTER:
            self._events.on_register(self, room)
        elif kind is Kind.DONE:
            self._events.on_done(self, room)
        elif kind is Kind.CANCEL:
            self._events.on_cancel(self, room, payload.decode("utf-8", "replace"))
        else:
            raise ProtocolError(f"unexpected {kind.name} frame from a decode peer")

    def _drop(self, conn: _Conn) -> None:
        """Close `conn` and put its unacknowledged frames back at the queue front."""
        if conn.closed:
            return
        conn.closed = True
        if self.connections.get(conn.index) is conn:
            del self.connections[conn.index]
        conn.writer.close()
        current = asyncio.current_task()
        for task in conn.tasks:
            if task is not current:
                task.cancel()
        lost = [(k, f) for k, f in self._unacked.items() if f.conn is conn]
        for key, _ in lost:
            del self._unacked[key]
        self._queue.extendleft(f.item for _, f in reversed(lost))
        self.resent_bytes += sum(f.item.frame.length for _, f in lost)
        self._wake.set()
        if not self.connections and not self.closed and self._lost_timer is None:
            self._lost_timer = self._loop.call_later(self._config.peer_timeout_s, self._lost)

    def drop_idle(self, read_before: float) -> None:
        """Close the connections that have read nothing since `read_before` (loop clock)."""
        for conn in list(self.connections.values()):
            if conn.last_read < read_before:
                self._drop(conn)

    def _lost(self) -> None:
        self._lost_timer = None
        if not self.connections and not self.closed:
            self._events.on_peer_lost(self)

    async def close(self) -> None:
        """Close every connection and stop the tasks."""
        self.closed = True
        if self._lost_timer is not None:
            self._lost_timer.cancel()
        conns = list(self.connections.values())
        tasks = [t for c in conns for t in c.tasks]
        for conn in conns:
            self._drop(conn)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def telemetry(self) -> list[ConnectionTelemetry]:
        """A TCP_INFO sample of each live connection."""
        samples = []
        for conn in self.connections.values():
            info = sample_tcp_info(conn.writer.get_extra_info("socket"))  # under TLS too
            tls = conn.writer.get_extra_info("ssl_object")
            samples.append(
                ConnectionTelemetry(
                    peer=self.peer_id,
                    index=conn.index,
                    bytes_sent=conn.bytes_sent,
                    rtt_s=info.rtt_s if info else None,
                    rttvar_s=info.rttvar_s if info else None,
                    retransmits=info.total_retrans if info else None,
                    segments_out=info.segs_out if info else None,
                    delivery_rate_bytes_per_s=(
                        float(info.delivery_rate)
                        if info and info.delivery_rate is not None
                        else None
                    ),
                    cwnd=info.snd_cwnd if info else None,
                    tls=tls.version() if tls is not None else None,
                )
            )
        return samples

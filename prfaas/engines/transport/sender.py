"""Prefill side: `KVSender` owns the bootstrap listener, the decode peers and the rooms.

A decode peer connects N times to the bootstrap port (HELLO names the peer and the
connection slot), then REGISTERs rooms. A room may be opened before or after its peer
registers: early registrations are parked until `open()` or `register_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import socket
import threading
from collections import OrderedDict
from collections.abc import Coroutine, Sequence
from typing import Any

from prfaas.engines.transport.config import SenderConfig
from prfaas.engines.transport.errors import ProtocolError
from prfaas.engines.transport.frames import Kind
from prfaas.engines.transport.handshake import (
    HANDSHAKE_MAX,
    Hello,
    check_auth,
    new_nonce,
    parse_hello,
    welcome_frame,
)
from prfaas.engines.transport.pacing import TokenBucket
from prfaas.engines.transport.sender_peer import SenderPeer
from prfaas.engines.transport.sender_room import SendHandle, check_room
from prfaas.engines.transport.telemetry import EgressMeter, TransportTelemetry
from prfaas.engines.transport.wire import read_frame, reason_frame, write_frame

__all__ = ["KVSender", "SendHandle"]

logger = logging.getLogger(__name__)
TOMBSTONES = 4096


class KVSender:
    """One per prefill engine process: owns the bootstrap listener and the peer connections."""

    def __init__(self, config: SenderConfig | None = None) -> None:
        self.config = config or SenderConfig()
        self._servers: list[asyncio.Server] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._rooms: dict[int, SendHandle] = {}
        self._peers: dict[str, SenderPeer] = {}
        self._parked: dict[int, tuple[SenderPeer, asyncio.TimerHandle]] = {}
        self._tombstones: OrderedDict[int, str] = OrderedDict()
        self._meter = EgressMeter()
        self._bucket: TokenBucket | None = None
        self._handshakes: set[asyncio.Task[None]] = set()
        self._greeting: OrderedDict[asyncio.StreamWriter, None] = OrderedDict()  # in handshake
        self._sweeper: asyncio.TimerHandle | None = None
        self._resent_closed = 0  # resent bytes of peers already gone
        self._closing = False
        self.handshake_failures = 0
        self.parked_refused = 0

    async def start(self, listeners: Sequence[socket.socket] = ()) -> None:
        """Bind the bootstrap listener (config.host, config.port), or serve on `listeners`,
        sockets already bound and listening (a sender process's: its engine binds them, so
        that a restarted process keeps the port), with TLS if configured.

        Raises:
            ValueError: a TLS certificate, key or CA file that does not load (named).
            OSError: the address cannot be bound.
        """
        self._loop = asyncio.get_running_loop()
        rate = self.config.process_rate_bytes_per_s
        if rate:
            self._bucket = TokenBucket(rate, max(self.config.chunk_bytes, rate * 0.005))
        # with TLS, the TLS handshake runs before `_on_connection`, within its own
        # handshake_timeout_s; a close waits as long for the peer's close_notify
        tls, timeout = self.config.tls, self.config.handshake_timeout_s
        serve = functools.partial(
            asyncio.start_server,
            self._on_connection,
            ssl=tls.server_context() if tls is not None else None,
            ssl_handshake_timeout=timeout if tls is not None else None,
            ssl_shutdown_timeout=timeout if tls is not None else None,
        )
        if listeners:
            self._servers = [await serve(sock=sock) for sock in listeners]
        else:
            self._servers = [await serve(self.config.host, self.config.port)]
        self._arm_sweeper()

    def set_process_rate(self, rate_bytes_per_s: float) -> None:
        """Re-pace the whole process's egress (the emulated link's rate) from now on; the
        telemetry's capacity follows.

        Raises:
            ValueError: a rate <= 0, or an egress that was started unpaced.
        """
        if self._bucket is None:
            raise ValueError("this sender's egress is not paced (no process rate at start)")
        burst = max(self.config.chunk_bytes, rate_bytes_per_s * 0.005)
        self._bucket.set_rate(rate_bytes_per_s, burst)
        self.config = dataclasses.replace(
            self.config, process_rate_bytes_per_s=rate_bytes_per_s, capacity_bytes_per_s=None
        )

    @property
    def bootstrap_port(self) -> int:
        """The listening port (after `start`)."""
        if not self._servers:
            raise RuntimeError("KVSender.start() has not been awaited")
        port: int = self._servers[0].sockets[0].getsockname()[1]
        return port

    # -- rooms -------------------------------------------------------------------------

    def open(self, room: int) -> SendHandle:
        """Start a transfer for `room` (a u64); thread-safe; the peer may register later.

        Raises:
            ValueError: room out of range or already open.
            RuntimeError: the sender is not started.
        """
        if self._loop is None or not self._servers:
            raise RuntimeError("KVSender.start() has not been awaited")
        if self._closing:
            raise RuntimeError("KVSender is closed")
        check_room(room)
        handle = SendHandle(
            room, self._loop, self.config.chunk_bytes, self.config.pipelined, self._closed
        )
        with self._lock:
            if room in self._rooms:
                raise ValueError(f"room {room} is already open")
            self._rooms[room] = handle
        self._loop.call_soon_threadsafe(self._start_room, handle)
        return handle

    def _start_room(self, handle: SendHandle) -> None:
        assert self._loop is not None
        if handle.done:  # failed before it started (a sender process's open, then abort)
            parked = self._parked.pop(handle.room, None)
            if parked is not None:
                parked[1].cancel()
                reason = self._tombstones.get(handle.room, "transfer failed")
                parked[0].push_control(reason_frame(Kind.ABORT, handle.room, reason))
            return
        cfg = self.config
        handle.timers = [
            self._loop.call_later(cfg.register_timeout_s, self._register_expired, handle),
            self._loop.call_later(
                cfg.transfer_timeout_s,
                handle.fail,
                f"not delivered within transfer_timeout_s={cfg.transfer_timeout_s}",
            ),
        ]
        self._tombstones.pop(handle.room, None)
        parked = self._parked.pop(handle.room, None)
        if parked is not None:
            parked[1].cancel()
            handle.bind(parked[0])

    def _register_expired(self, handle: SendHandle) -> None:
        if handle.peer is None:
            handle.fail(
                f"no decode peer registered within register_timeout_s="
                f"{self.config.register_timeout_s}"
            )

    def _closed(self, handle: SendHandle, reason: str | None) -> None:
        with self._lock:
            if self._rooms.get(handle.room) is handle:
                del self._rooms[handle.room]
        self._tombstones[handle.room] = reason or "already delivered"
        while len(self._tombstones) > TOMBSTONES:
            self._tombstones.popitem(last=False)

    # -- peer events (PeerEvents) ----------------------------------------------------------

    def on_register(self, peer: SenderPeer, room: int) -> None:
        handle = self._rooms.get(room)
        if handle is not None and handle.peer is None and not handle.done:
            handle.bind(peer)
        elif handle is not None and handle.peer is not peer:
            peer.push_control(reason_frame(Kind.ABORT, room, "room is fetched by another peer"))
        elif handle is None and room in self._tombstones:
            peer.push_control(reason_frame(Kind.ABORT, room, self._tombstones[room]))
        elif handle is None and room not in self._parked:
            if len(self._parked) >= self.config.max_parked_rooms:
                self.parked_refused += 1
                peer.push_control(reason_frame(Kind.ABORT, room, "too many rooms waiting to "
                                               "be opened on the prefill side"))  # fmt: skip
                return
            assert self._loop is not None
            timer = self._loop.call_later(
                self.config.register_timeout_s, self._parked_expired, room
            )
            self._parked[room] = (peer, timer)

    def _parked_expired(self, room: int) -> None:
        peer, _ = self._parked.pop(room)
        reason = (
            f"room was not opened on the prefill side within {self.config.register_timeout_s} s"
        )
        peer.push_control(reason_frame(Kind.ABORT, room, reason))

    def on_done(self, peer: SenderPeer, room: int) -> None:
        handle = self._rooms.get(room)
        if handle is not None and handle.peer is peer:
            handle.complete()

    def on_cancel(self, peer: SenderPeer, room: int, reason: str) -> None:
        handle = self._rooms.get(room)
        if handle is not None and handle.peer is peer:
            handle.fail(f"decode side failed the transfer: {reason}", tell_peer=False)
        parked = self._parked.pop(room, None)
        if parked is not None:
            parked[1].cancel()

    def on_peer_lost(self, peer: SenderPeer) -> None:
        for handle in [h for h in self._rooms.values() if h.peer is peer]:
            handle.fail(
                f"decode peer lost: no connection for peer_timeout_s={self.config.peer_timeout_s}",
                tell_peer=False,
            )
        for room in [r for r, (p, _) in self._parked.items() if p is peer]:
            self._parked.pop(room)[1].cancel()
        if self._peers.get(peer.peer_id) is peer:
            del self._peers[peer.peer_id]
            self._resent_closed += peer.resent_bytes
        self._spawn(peer.close())

    # -- connections -----------------------------------------------------------------------

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self._admit(writer)
        try:
            hello = await asyncio.wait_for(
                self._handshake(reader, writer), self.config.handshake_timeout_s
            )
        except (ProtocolError, OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            self.handshake_failures += 1
            logger.debug("bootstrap connection refused: %r", exc)
            writer.close()
            return
        finally:
            self._greeting.pop(writer, None)
        peer = self._peers.get(hello.peer)
        if peer is None or peer.closed:
            if self._closing or len(self._peers) >= self.config.max_peers:
                writer.close()
                return
            peer = SenderPeer(hello.peer, self.config, self, self._meter, self._bucket)
            self._peers[hello.peer] = peer
        peer.attach(hello.index, reader, writer)

    def _admit(self, writer: asyncio.StreamWriter) -> None:
        """Track a connection in its handshake; past `max_handshakes` the oldest one is cut
        (a flood of idle connections cannot keep a real peer's handshake out for long)."""
        self._greeting[writer] = None
        while len(self._greeting) > self.config.max_handshakes:
            oldest, _ = self._greeting.popitem(last=False)
            oldest.transport.abort()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Hello:
        """HELLO -> WELCOME -> AUTH (PROTOCOL.md); the authenticated HELLO.

        Raises:
            ProtocolError: anything but a valid HELLO, or a wrong AUTH proof.
        """
        key = self.config.auth_key
        hello = parse_hello(*await read_frame(reader, HANDSHAKE_MAX), self.config.connections)
        if self._closing:
            raise ProtocolError("the sender is closing")
        settings = {
            "connections": self.config.connections,
            "window_bytes": self.config.window_bytes,
            "chunk_bytes": self.config.chunk_bytes,
        }
        nonce = new_nonce()
        write_frame(writer, welcome_frame(hello, key, nonce, settings))
        check_auth(hello, key, nonce, *await read_frame(reader, HANDSHAKE_MAX))
        return hello

    def _arm_sweeper(self) -> None:
        assert self._loop is not None
        period = self.config.idle_timeout_s / 4
        self._sweeper = self._loop.call_later(period, self._sweep)

    def _sweep(self) -> None:
        """Close authenticated connections idle past `idle_timeout_s` whose peer has no
        room open or parked."""
        assert self._loop is not None
        busy = {h.peer for h in self._rooms.values()} | {p for p, _ in self._parked.values()}
        now = self._loop.time()
        for peer in list(self._peers.values()):
            if peer not in busy:
                peer.drop_idle(now - self.config.idle_timeout_s)
        self._arm_sweeper()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._handshakes.add(task)
        task.add_done_callback(self._handshakes.discard)

    # -- telemetry and shutdown --------------------------------------------------------------

    def telemetry(self) -> TransportTelemetry:
        """A snapshot of egress rate, utilisation and per-connection TCP_INFO samples."""
        now = self._loop.time() if self._loop is not None else 0.0
        conns = tuple(c for p in self._peers.values() for c in p.telemetry())
        rate = self._meter.rate(now)
        capacity = self.config.capacity
        segs = sum(c.segments_out or 0 for c in conns)
        retrans = sum(c.retransmits or 0 for c in conns)
        rtts = [c.rtt_s for c in conns if c.rtt_s is not None]
        return TransportTelemetry(
            at=now,
            egress_bytes_per_s=rate,
            window_s=self._meter.window_s,
            bytes_total=self._meter.total,
            capacity_bytes_per_s=capacity,
            utilisation=rate / capacity if capacity else None,
            retransmission_rate=retrans / segs if segs else 0.0,
            rtt_s=sum(rtts) / len(rtts) if rtts else None,
            resent_bytes=self._resent_closed + sum(p.resent_bytes for p in self._peers.values()),
            peers=len(self._peers),
            active_transfers=len(self._rooms),
            connections=conns,
            handshake_failures=self.handshake_failures,
            parked_rooms=len(self._parked),
            parked_refused=self.parked_refused,
            control_dropped=sum(p.control_dropped for p in self._peers.values()),
            paced_bytes=self._bucket.charged if self._bucket is not None else 0,
        )

    async def close(self) -> None:
        """Fail open transfers, close connections and the listener; idempotent."""
        self._closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        handles = list(self._rooms.values())
        for handle in handles:
            handle.fail("sender closed")
        if handles:
            await asyncio.sleep(0.01)  # let the writers flush the ABORT frames
        for _, timer in self._parked.values():
            timer.cancel()
        self._parked.clear()
        for server in self._servers:
            server.close()
        for writer in list(self._greeting):
            writer.transport.abort()
        for peer in list(self._peers.values()):
            await peer.close()
        self._peers.clear()
        for task in list(self._handshakes):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1.0)

"""`ReceiverLink`: the decode side's connection pool to one prefill sender.

Slot 0 connects first; the sender's WELCOME says how many connections it wants, and the
other slots follow. Each slot reconnects with backoff while transfers are active; every new
connection re-REGISTERs the active rooms (idempotent at the sender). Every data frame is
ACKed on the connection it came by, whatever its fate, so the sender never resends it; a
frame with a bad checksum fails its room only, garbage closes only its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import ssl
from collections import OrderedDict

from prfaas.engines.transport.config import ReceiverConfig
from prfaas.engines.transport.errors import ProtocolError
from prfaas.engines.transport.frames import LAYER_KINDS, Frame, Header, Kind, make_frame
from prfaas.engines.transport.handshake import Hello, auth_frame, check_welcome, new_nonce
from prfaas.engines.transport.receiver_protocol import FrameProtocol
from prfaas.engines.transport.receiver_transfer import Transfer
from prfaas.engines.transport.tls import untrusted
from prfaas.engines.transport.wire import ack_frame, reason_frame, verify

DATA_KINDS = LAYER_KINDS | {Kind.AUX, Kind.END}
TOMBSTONES = 4096
BACKOFF_S = (0.02, 0.5)


def _bytes(frame: Frame) -> bytes:
    return b"".join([frame.header, *frame.pieces])


class ReceiverLink:
    """Connections to one sender (host, port) shared by every room fetched from it."""

    def __init__(
        self, host: str, port: int, config: ReceiverConfig, tls: ssl.SSLContext | None = None
    ) -> None:
        self.host, self.port = host, port
        self._config = config
        self._tls = tls
        self._loop = asyncio.get_running_loop()
        self.peer_id = secrets.token_hex(16)
        self.transfers: dict[int, Transfer] = {}
        self._dead: OrderedDict[int, None] = OrderedDict()
        self.conns: dict[int, FrameProtocol] = {}
        self._protocols: set[FrameProtocol] = set()  # every open connection, attached or not
        self._welcomes: dict[FrameProtocol, asyncio.Future[tuple[Header, bytes]]] = {}
        self._slots: dict[int, asyncio.Task[None]] = {}
        self._wanted: int | None = None
        self._pending: list[Frame] = []
        self._buffered = 0
        self._paused = False
        self._connected_once = False
        self._lost_since: float | None = None
        self.last_error = "not connected yet"
        self.closed = False

    @property
    def max_message_bytes(self) -> int:
        return self._config.max_message_bytes

    # -- rooms (TransferOwner) ----------------------------------------------------------------

    def add(self, transfer: Transfer) -> None:
        """Start fetching `transfer.room` over this link."""
        self.transfers[transfer.room] = transfer
        self._dead.pop(transfer.room, None)
        self._send(make_frame(Kind.REGISTER, transfer.room, []))
        self._ensure_slots()

    def send_done(self, room: int) -> None:
        self._send(make_frame(Kind.DONE, room, []))

    def send_cancel(self, room: int, reason: str) -> None:
        self._send(reason_frame(Kind.CANCEL, room, reason))

    def forget(self, room: int) -> None:
        self.transfers.pop(room, None)
        self._dead[room] = None
        while len(self._dead) > TOMBSTONES:
            self._dead.popitem(last=False)

    def buffer_changed(self, delta: int) -> None:
        self._buffered += delta
        paused = self._buffered > self._config.max_buffered_bytes
        if paused != self._paused:
            self._paused = paused
            for conn in self.conns.values():
                self._apply_pause(conn)

    def _apply_pause(self, conn: FrameProtocol) -> None:
        if conn.transport is None or conn.transport.is_closing():
            return
        if self._paused:
            conn.transport.pause_reading()
        else:
            conn.transport.resume_reading()

    def describe(self) -> str:
        live = len(self.conns)
        return f"sender {self.host}:{self.port}, {live} live connections, last: {self.last_error}"

    def _send(self, frame: Frame) -> None:
        if self.conns:
            self.conns[min(self.conns)].write(_bytes(frame))
        elif frame.kind is not Kind.REGISTER:  # REGISTERs are re-sent on connect anyway
            self._pending.append(frame)

    # -- connections ----------------------------------------------------------------------------

    def _ensure_slots(self) -> None:
        for index in range(self._wanted or 1):
            task = self._slots.get(index)
            if task is None or task.done():
                self._slots[index] = asyncio.create_task(self._maintain(index))

    async def _maintain(self, index: int) -> None:
        backoff = BACKOFF_S[0]
        while self.transfers and not self.closed and index < (self._wanted or 1):
            try:
                conn = await self._connect(index)
            except (OSError, TimeoutError, ProtocolError, KeyError, ValueError) as exc:
                self.last_error = f"connect: {type(exc).__name__}: {exc}"
                refused = untrusted(exc)
                if refused is not None:  # a configuration error: retrying does not heal it
                    self._fail_rooms(f"sender {self.host}:{self.port}: {refused}")
                    return
                self._check_lost()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_S[1])
                continue
            backoff = BACKOFF_S[0]
            await conn.closed

    async def _connect(self, index: int) -> FrameProtocol:
        timeout = self._config.connect_timeout_s
        _, conn = await asyncio.wait_for(self._open(index, timeout), timeout)
        welcome = self._welcomes[conn] = self._loop.create_future()
        hello, key = Hello(self.peer_id, index, new_nonce()), self._config.auth_key
        try:
            conn.write(_bytes(hello.frame()))
            settings = check_welcome(hello, key, *await asyncio.wait_for(welcome, timeout))
            conn.write(_bytes(auth_frame(hello, key, settings["nonce"])))
            self._wanted = int(settings["connections"])
        except BaseException as exc:
            conn.fail(
                exc if isinstance(exc, ProtocolError) else ConnectionError("handshake failed")
            )
            raise
        finally:
            del self._welcomes[conn]
        self._attach(index, conn)
        return conn

    async def _open(self, index: int, handshake_s: float) -> tuple[object, FrameProtocol]:
        """The TCP connection of slot `index`, with TLS (the sender's certificate checked)
        if configured."""
        tls = self._tls
        name = self._config.tls.server_name if self._config.tls is not None else None
        try:
            return await self._loop.create_connection(
                lambda: self._protocol(index),
                self.host,
                self.port,
                ssl=tls,
                server_hostname=(name or self.host) if tls is not None else None,
                ssl_handshake_timeout=handshake_s if tls is not None else None,
                ssl_shutdown_timeout=handshake_s if tls is not None else None,
            )
        except (ssl.SSLError, ConnectionResetError) as exc:
            if tls is None or untrusted(exc) is not None:
                raise
            raise ConnectionError(f"TLS handshake failed ({type(exc).__name__}: {exc}): does "
                                  "the sender serve transport TLS?") from exc  # fmt: skip

    def _protocol(self, index: int) -> FrameProtocol:
        conn = FrameProtocol(self, index, self._config.max_frame_bytes)
        self._protocols.add(conn)
        return conn

    def _attach(self, index: int, conn: FrameProtocol) -> None:
        if self.closed:  # close() ran while we connected (wait_for may swallow its cancel)
            conn.fail(ConnectionError("receiver closed"))
            return
        self.conns[index] = conn
        self._connected_once = True
        self._lost_since = None
        self._apply_pause(conn)
        for room in list(self.transfers):
            conn.write(_bytes(make_frame(Kind.REGISTER, room, [])))
        for frame in self._pending:
            conn.write(_bytes(frame))
        self._pending.clear()
        self._ensure_slots()

    def connection_closed(self, conn: FrameProtocol, error: BaseException | None) -> None:
        """FrameSink: a connection ended."""
        self._protocols.discard(conn)
        if error is not None:
            self.last_error = f"connection {conn.index}: {type(error).__name__}: {error}"
        welcome = self._welcomes.get(conn)
        if welcome is not None and not welcome.done():
            welcome.set_exception(self._handshake_lost(error))
        if self.conns.get(conn.index) is conn:
            del self.conns[conn.index]
        if not self.conns and self._lost_since is None:
            self._lost_since = self._loop.time()

    def _handshake_lost(self, error: BaseException | None) -> BaseException:
        """The error of a connection the sender closed before its WELCOME."""
        if self._tls is None:
            why = "a sender that serves transport TLS closes a plain connection so"
        else:
            why = "a sender that verifies client certificates closes an untrusted one so"
        return ConnectionError(f"closed during handshake ({error}; {why})")

    def _fail_rooms(self, reason: str) -> None:
        for transfer in list(self.transfers.values()):
            transfer.fail(reason, tell_sender=False)

    def _check_lost(self) -> None:
        """Fail every room once an established link stayed down for connect_timeout_s."""
        if self.conns or not self._connected_once or self._lost_since is None:
            return
        if self._loop.time() - self._lost_since >= self._config.connect_timeout_s:
            self._fail_rooms(
                f"lost the connections to sender {self.host}:{self.port} and could not "
                f"reconnect within {self._config.connect_timeout_s} s ({self.last_error})"
            )

    # -- frames (FrameSink) ------------------------------------------------------------------------

    def buffer_for(self, conn: FrameProtocol, header: Header) -> memoryview:
        """FrameSink: data payloads go straight into their message; the rest to scratch."""
        transfer = self.transfers.get(header.room) if header.kind in DATA_KINDS else None
        slot = transfer.slot(header) if transfer is not None else None
        return slot if slot is not None else memoryview(bytearray(header.length))

    def frame_received(self, conn: FrameProtocol, header: Header, payload: memoryview) -> None:
        """FrameSink: dispatch one frame."""
        kind = header.kind
        if self.conns.get(conn.index) is not conn and kind is not Kind.WELCOME:
            raise ProtocolError(f"{kind.name} frame before the handshake completed")
        if kind in DATA_KINDS:
            conn.write(_bytes(ack_frame([(header.room, header.msg, header.part)])))
            self._on_data(header, payload)
        elif kind is Kind.ABORT:
            transfer = self.transfers.get(header.room)
            if transfer is not None:
                transfer.fail(bytes(payload).decode("utf-8", "replace"), tell_sender=False)
        elif kind is Kind.WELCOME and conn in self._welcomes:
            if not self._welcomes[conn].done():
                self._welcomes[conn].set_result((header, bytes(payload)))
        else:
            raise ProtocolError(f"unexpected {kind.name} frame from a sender")

    def _on_data(self, header: Header, payload: memoryview) -> None:
        transfer = self.transfers.get(header.room)
        if transfer is None:
            if header.room not in self._dead:
                self.forget(header.room)
                self.send_cancel(header.room, "unknown room on the decode side")
        elif transfer.needs(header):
            transfer.frame_done(header, verify(header, payload))

    async def close(self) -> None:
        """Close every connection and stop reconnecting."""
        self.closed = True
        for transfer in list(self.transfers.values()):
            transfer.fail("receiver closed")
        for conn in list(self._protocols):
            conn.fail(ConnectionError("receiver closed"))
        tasks = list(self._slots.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

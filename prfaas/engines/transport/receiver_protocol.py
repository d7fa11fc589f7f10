"""`FrameProtocol`: a zero-copy frame reader for the decode side's data connections.

An asyncio BufferedProtocol: the kernel copies each header into a small buffer and each
payload straight into the buffer its sink chose (a slice of the message it belongs to),
so a layer's bytes are copied once, socket to final array memory.
"""

from __future__ import annotations

import asyncio
from typing import Protocol, cast

from prfaas.engines.transport.errors import ProtocolError
from prfaas.engines.transport.frames import HEADER_SIZE, Header, unpack_header


class FrameSink(Protocol):
    """Where a `FrameProtocol` puts frames (called on the event loop)."""

    def buffer_for(self, conn: FrameProtocol, header: Header) -> memoryview:
        """A writable view of exactly `header.length` bytes for the payload."""
        ...

    def frame_received(self, conn: FrameProtocol, header: Header, payload: memoryview) -> None:
        """A whole frame arrived (payload not yet verified). May raise ProtocolError."""
        ...

    def connection_closed(self, conn: FrameProtocol, error: BaseException | None) -> None:
        """The connection is gone (EOF, reset, or a protocol error)."""
        ...


class FrameProtocol(asyncio.BufferedProtocol):
    """Reads frames from one connection into buffers chosen by a `FrameSink`."""

    def __init__(self, sink: FrameSink, index: int, max_length: int) -> None:
        self.sink = sink
        self.index = index
        self._max_length = max_length
        self._head = bytearray(HEADER_SIZE)
        self._head_view = memoryview(self._head)
        self._filled = 0
        self._header: Header | None = None
        self._target = self._head_view
        self.transport: asyncio.Transport | None = None
        self.error: BaseException | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream transport (uvloop's is not an asyncio.Transport subclass, same interface)
        self.transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._target[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        if self._filled < len(self._target):
            return
        self._filled = 0
        try:
            if self._header is None:
                self._on_header()
            else:
                header, payload = self._header, self._target
                self._header, self._target = None, self._head_view
                self.sink.frame_received(self, header, payload)
        except ProtocolError as exc:
            self.fail(exc)

    def _on_header(self) -> None:
        header = unpack_header(self._head, self._max_length)
        if header.length == 0:
            self.sink.frame_received(self, header, memoryview(b""))
            return
        target = self.sink.buffer_for(self, header)
        if len(target) != header.length:
            raise ProtocolError(f"sink gave {len(target)} bytes for a {header.length}-byte frame")
        self._header, self._target = header, target

    def write(self, data: bytes) -> None:
        """Write to the connection unless it is closing."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def fail(self, error: BaseException) -> None:
        """Close the connection because of `error`."""
        if self.error is None:
            self.error = error
        if self.transport is not None:
            self.transport.abort()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        error = self.error or exc
        if self._header is not None and error is None:
            error = ProtocolError(f"connection closed inside a frame ({self._filled} bytes read)")
        if not self.closed.done():
            self.closed.set_result(None)
        self.sink.connection_closed(self, error)

"""A lean keep-alive HTTP/1.1 client for the gateway's hot path (`POST /generate`).

Why not aiohttp's client: per call it builds a request object, a timer context, a stream
reader, a payload writer and more, about 0.15 ms of CPU per call on our machines; the
gateway makes two calls per request (prefill and decode), which made its added latency
about twice that of SGLang's Rust router. This client does only what the engine protocol
needs: one request per connection at a time, `Content-Length`, chunked or until-close
bodies, byte lines for SSE, pooled connections per engine, and explicit timeouts (connect;
per read, bounded by a whole-call deadline). Everything else (health, stats, aborts) still
goes through the shared aiohttp session.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prfaas.http.wire_whole import WholeCall

MAX_HEAD_BYTES = 64 * 1024
MAX_IDLE_PER_HOST = 256


class WireError(Exception):
    """The HTTP exchange failed: malformed response, closed connection, oversized head."""


class ConnectFailed(WireError):
    """No connection could be opened (refused, unreachable, connect timeout)."""


class _Connection(asyncio.Protocol):
    """One TCP connection: buffers received bytes and wakes its single reader, or hands
    them to the `WholeCall` it carries (http_wire_whole.py)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.WriteTransport | None = None
        self.buffer = bytearray()
        self.closed = False
        self.whole: WholeCall | None = None
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport

    def data_received(self, data: bytes) -> None:
        whole = self.whole
        if whole is not None:
            whole.feed(data)
            return
        self.buffer += data
        self._wake()

    def eof_received(self) -> bool:
        self._lost()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost()

    def _lost(self) -> None:
        self.closed = True
        whole = self.whole
        if whole is not None:
            whole.lost()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, deadline: float, read_s: float) -> None:
        """Wait for more bytes (or EOF). Raises TimeoutError past the read or total time."""
        timeout = min(read_s, deadline - self.loop.time())
        if timeout <= 0:
            raise TimeoutError("the call ran past its total timeout")
        waiter = self._waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class ChunkedDecoder:
    """Decodes a `Transfer-Encoding: chunked` body incrementally (trailers are skipped)."""

    def __init__(self) -> None:
        self.done = False
        self._left = 0  # data bytes left in the current chunk
        self._crlf = False  # the CRLF after a chunk's data is due
        self._trailers = False  # the last chunk was seen; trailers until an empty line

    def feed(self, raw: bytearray, out: bytearray) -> bool:
        """Consume what it can from `raw`, append decoded data to `out`; True on progress.

        Raises:
            WireError: a malformed chunk framing.
        """
        progress = False
        while raw and not self.done:
            if self._left:
                take = min(len(raw), self._left)
                out += raw[:take]
                del raw[:take]
                self._left -= take
                progress = True
                continue
            end = raw.find(b"\r\n")
            if end < 0:
                break
            line = bytes(raw[:end])
            del raw[: end + 2]
            progress = True
            self._line(line)
        return progress

    def _line(self, line: bytes) -> None:
        if self._crlf:
            if line:
                raise WireError(f"chunk data longer than its size: {line[:40]!r}")
            self._crlf = False
        elif self._trailers:
            self.done = not line
        else:
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise WireError(f"bad chunk size line {line[:40]!r}") from None
            self._left, self._crlf, self._trailers = size, size > 0, size == 0


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError("no response bytes within the read timeout"))


class WireResponse:
    """A response whose body is read incrementally. Reading it to its end returns the
    connection to the pool; `close()` drops the connection instead."""

    def __init__(
        self, pool: WirePool, conn: _Connection, status: int, head: dict[bytes, bytes]
    ) -> None:
        self.status = status
        self._pool, self._conn = pool, conn
        length = head.get(b"content-length")
        self._chunks = (
            ChunkedDecoder() if b"chunked" in head.get(b"transfer-encoding", b"") else None
        )
        self._left = _length(length) if length is not None and self._chunks is None else None
        if status in (204, 304) or status < 200:
            self._chunks, self._left = None, 0  # these never carry a body
        self._keep_alive = head.get(b"connection", b"").lower() != b"close" and (
            self._chunks is not None or self._left is not None
        )
        self._data = bytearray()  # decoded body bytes not yet handed out
        self._done = self._left == 0
        self._finished = False
        self.deadline, self.read_s = 0.0, 0.0

    async def read(self) -> bytes:
        """The whole remaining body."""
        while not self._done:
            await self._fill()
        data, self._data = bytes(self._data), bytearray()
        self._finish()
        return data

    async def lines(self) -> AsyncIterator[bytes]:
        """Body lines without their `\\n` (for SSE); the last line may lack one."""
        start = 0
        while True:
            end = self._data.find(b"\n", start)
            if end >= 0:
                yield bytes(self._data[start:end])
                start = end + 1
                continue
            del self._data[:start]
            start = 0
            if self._done:
                break
            await self._fill()
        if self._data:
            yield bytes(self._data)
        self._data = bytearray()
        self._finish()

    def close(self) -> None:
        """Drop the connection (the body was not read to its end, or is not wanted)."""
        if not self._finished:
            self._finished = True
            self._conn.close()

    def _finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        if self._keep_alive and not self._conn.buffer and not self._conn.closed:
            self._pool.release(self._conn)
        else:
            self._conn.close()

    async def _fill(self) -> None:
        """Move more decoded body bytes into `_data`, or mark the body done."""
        conn = self._conn
        while not self._decode(conn.buffer):
            if conn.closed:
                if self._left is None and self._chunks is None:
                    self._done = True  # the body ends with the connection
                    return
                raise WireError("the engine closed the connection mid-response")
            await conn.wait(self.deadline, self.read_s)

    def _decode(self, raw: bytearray) -> bool:
        """Consume what `raw` allows; True when there was progress or the body is done."""
        if self._chunks is not None:
            progress = self._chunks.feed(raw, self._data)
            self._done = self._chunks.done
            return progress or self._done
        if not raw:
            return False
        take = len(raw) if self._left is None else min(len(raw), self._left)
        self._data += raw[:take]
        del raw[:take]
        if self._left is not None:
            self._left -= take
            self._done = self._left == 0
        return True


def _length(value: bytes) -> int:
    if not value.isdigit():
        raise WireError(f"bad Content-Length {value[:40]!r}")
    return int(value)


def _parse_head(head: bytes) -> tuple[int, dict[bytes, bytes]]:
    status_line, *lines = head.split(b"\r\n")
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise WireError(f"bad status line {status_line[:80]!r}")
    try:
        status = int(parts[1])
    except ValueError:
        raise WireError(f"bad status line {status_line[:80]!r}") from None
    headers: dict[bytes, bytes] = {}
    for line in lines:
        name, sep, value = line.partition(b":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return status, headers


class WirePool:
    """Keep-alive connections to one `host:port`, and the requests sent over them."""

    def __init__(self, host: str, port: int, *, tls: bool = False) -> None:
        self.host, self.port, self.tls = host, port, tls
        self._authority = f"{host}:{port}".encode()
        self._idle: list[_Connection] = []

    async def post(
        self, path: str, body: bytes, *, connect_s: float, read_s: float, total_s: float
    ) -> WireResponse:
        """Send `POST path` with a JSON body; returns once the response head has arrived.

        A reused connection the server closed while idle is retried once on a fresh one
        (the server saw no request on it).

        Raises:
            ConnectFailed: the engine cannot be reached.
            WireError: a malformed or cut-off response.
            TimeoutError: the connect, read or total timeout expired.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + total_s
        request = self.request_bytes(path, body)
        while True:
            conn, reused = await self._acquire(loop, connect_s)
            try:
                resp = await self._exchange(conn, request, deadline, read_s)
            except _StaleConnection:
                conn.close()
                if reused:
                    continue
                raise WireError("the engine closed the connection before answering") from None
            except BaseException:
                conn.close()
                raise
            resp.deadline, resp.read_s = deadline, read_s
            return resp

    def request_bytes(self, path: str, body: bytes) -> bytes:
        """The bytes of `POST path` with a JSON body."""
        head = (
            b"POST " + path.encode() + b" HTTP/1.1\r\nHost: " + self._authority
            + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n"
        )  # fmt: skip
        return head + body

    async def _exchange(
        self, conn: _Connection, request: bytes, deadline: float, read_s: float
    ) -> WireResponse:
        assert conn.transport is not None
        conn.transport.write(request)
        answered = False  # an interim 1xx head came: the connection was not stale
        while True:
            end = conn.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(conn.buffer) > MAX_HEAD_BYTES:
                    raise WireError("response head too large")
                if conn.closed:
                    if not conn.buffer and not answered:
                        raise _StaleConnection
                    raise WireError("the engine closed the connection mid-head")
                await conn.wait(deadline, read_s)
                continue
            status, headers = _parse_head(bytes(conn.buffer[:end]))
            del conn.buffer[: end + 4]
            if 100 <= status < 200:  # interim (100 Continue, 103 Early Hints): skip it
                answered = True
                continue
            return WireResponse(self, conn, status, headers)

    async def _acquire(
        self, loop: asyncio.AbstractEventLoop, connect_s: float
    ) -> tuple[_Connection, bool]:
        conn = self.take_idle()
        if conn is not None:
            return conn, True
        return await self.open(loop, connect_s), False

    def take_idle(self) -> _Connection | None:
        """An idle pooled connection that is still open and silent, if any (one that
        received bytes while idle would mistake them for its next answer: it is closed)."""
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and not conn.buffer:
                return conn
            conn.close()
        return None

    async def open(self, loop: asyncio.AbstractEventLoop, connect_s: float) -> _Connection:
        """A new connection.

        Raises:
            ConnectFailed: refused, unreachable, or past `connect_s`.
        """
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(loop), self.host, self.port, ssl=self.tls or None
                ),
                connect_s,
            )
        except (OSError, TimeoutError) as exc:
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {exc!r}") from exc
        return conn

    def release(self, conn: _Connection) -> None:
        """Return a connection whose response was read to its end."""
        if len(self._idle) < MAX_IDLE_PER_HOST:
            self._idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        """Close every idle connection."""
        for conn in self._idle:
            conn.close()
        self._idle.clear()


class _StaleConnection(Exception):
    """A reused connection was closed by the server before any response byte."""

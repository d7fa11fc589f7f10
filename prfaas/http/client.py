"""A lean keep-alive HTTP/1.1 client for the gateway's engine calls (`POST /generate`).

Why not aiohttp's client: per call it builds a request object, a timer context, a stream
reader, a payload writer and more, about 0.15 ms of CPU per call on our machines, and the
gateway makes two calls per request (prefill and decode). Here a call is written at once
and the connection's protocol parses the response as bytes arrive, with llhttp (via
`httptools`, the parser aiohttp uses), handing the status and each piece of the body to a
`ResponseHandler`: no coroutine, task or future per read, whether the caller wants the body
whole or streamed. Health, stats and aborts go through aiohttp's client (not on the hot path).

What it does: one request per connection at a time, bodies framed by `Content-Length`,
chunked encoding or the connection's end, interim 1xx responses skipped, pooled keep-alive
connections per engine (a reused connection the server had closed is retried once on a
fresh one; one that received bytes while idle is dropped), and explicit timeouts: connect,
silence between reads, and the whole call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Protocol

import httptools

MAX_HEAD_BYTES = 64 * 1024
MAX_IDLE_PER_HOST = 256


class ClientError(Exception):
    """The HTTP exchange failed: malformed or cut-off response, oversized head."""


class ConnectFailed(ClientError):
    """No connection could be opened (refused, unreachable, connect timeout)."""


class ResponseHandler(Protocol):
    """Receives one response as it arrives (every method runs on the event loop)."""

    def on_head(self, status: int) -> None:
        """The final status arrived (interim 1xx responses are not reported)."""

    def on_body(self, data: bytes) -> None:
        """A piece of the decoded body (chunk framing removed), in order."""

    def on_end(self, error: BaseException | None) -> None:
        """Called exactly once: None once the body is complete, else `ConnectFailed`,
        `ClientError` (malformed or cut-off response), `TimeoutError`, or the exception
        `on_head` or `on_body` raised. Not called after `HttpCall.cancel()`."""


class _Connection(asyncio.Protocol):
    """One TCP connection: hands received bytes to the call it carries."""

    def __init__(self) -> None:
        self.transport: asyncio.WriteTransport | None = None
        self.call: HttpCall | None = None
        self.closed = False
        self.dirty = False  # bytes arrived while idle: they would pass for the next answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport

    def data_received(self, data: bytes) -> None:
        if self.call is not None:
            self.call.feed(data)
        else:
            self.dirty = True

    def eof_received(self) -> bool:
        self._lost()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost()

    def _lost(self) -> None:
        self.closed = True
        if self.call is not None:
            self.call.lost()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _header_line(name: str, value: str) -> bytes:
    if any(c in name + value for c in "\r\n"):
        raise ValueError(f"header {name!r} contains a line break")
    return f"{name}: {value}\r\n".encode("latin-1")


class ConnectionPool:
    """Keep-alive connections to one `host:port`."""

    def __init__(
        self, host: str, port: int, *, tls: bool = False, headers: Mapping[str, str] | None = None
    ) -> None:
        """`headers` go on every request (e.g. `Authorization`), encoded once here."""
        self.host, self.port, self.tls = host, port, tls
        self._authority = f"{host}:{port}".encode()
        self._extra = b"".join(_header_line(k, v) for k, v in (headers or {}).items())
        self._idle: list[_Connection] = []

    def request_bytes(self, path: str, body: bytes) -> bytes:
        """The bytes of `POST path` with a JSON body."""
        head = (
            b"POST " + path.encode() + b" HTTP/1.1\r\nHost: " + self._authority
            + b"\r\n" + self._extra + b"Content-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n"
        )  # fmt: skip
        return head + body

    def take_idle(self) -> _Connection | None:
        """An idle pooled connection that is still open and silent, if any."""
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and not conn.dirty:
                return conn
            conn.close()
        return None

    async def open(self, connect_s: float) -> _Connection:
        """A new connection.

        Raises:
            ConnectFailed: refused, unreachable, or past `connect_s`.
        """
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_Connection, self.host, self.port, ssl=self.tls or None),
                connect_s,
            )
        except (OSError, TimeoutError) as exc:
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {exc!r}") from exc
        return conn

    def release(self, conn: _Connection) -> None:
        """Return a connection whose response was read to its end."""
        if len(self._idle) < MAX_IDLE_PER_HOST and not conn.closed:
            self._idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        """Close every idle connection."""
        for conn in self._idle:
            conn.close()
        self._idle.clear()


class HttpCall:
    """One `POST` whose response the connection's protocol parses and hands to `handler`.

    Start it with `post`. A reused keep-alive connection that the server had closed (no byte
    of an answer) is retried once on a fresh connection; the handler never sees that.
    """

    def __init__(
        self,
        pool: ConnectionPool,
        request: bytes,
        handler: ResponseHandler,
        *,
        connect_s: float,
        read_s: float,
        total_s: float,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.pool, self.request, self.handler = pool, request, handler
        self.connect_s, self.read_s = connect_s, read_s
        self.deadline = self.loop.time() + total_s
        self.done = False
        self.sent = False  # the request was written (the server may be working on it)
        self._conn: _Connection | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._reused = False
        self._reset()

    def _reset(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._fed = 0  # bytes fed to the parser (all of them head bytes until the head ends)
        self._head_bytes = 0
        self._got_bytes = False
        self._headers_done = False
        self._framed = False  # Content-Length or chunked: the body does not end with the close
        self._interim = False  # the head being parsed is a 1xx
        self._complete = False
        self._keep_alive = False
        self._last = self.loop.time()

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Send on an idle pooled connection, or open one first."""
        conn = self.pool.take_idle()
        if conn is None:
            self._connecting = self.loop.create_task(self._open())
        else:
            self._send(conn, reused=True)

    def cancel(self) -> bool:
        """Give up on the call (drops its connection; the handler hears nothing more).
        True if it was still in flight."""
        if self.done:
            return False
        self.done = True
        self._stop_timer()
        if self._connecting is not None:
            self._connecting.cancel()
        self._drop_connection()
        return True

    async def _open(self) -> None:
        try:
            conn = await self.pool.open(self.connect_s)
        except ConnectFailed as exc:
            self._fail(exc)
            return
        finally:
            self._connecting = None
        if self.done:  # cancelled while connecting
            conn.close()
            return
        self._send(conn, reused=False)

    def _send(self, conn: _Connection, *, reused: bool) -> None:
        assert conn.transport is not None
        self._conn, self._reused = conn, reused
        conn.call = self
        self._last = self.loop.time()
        self._arm(min(self.read_s, self.deadline - self._last))
        self.sent = True
        conn.transport.write(self.request)

    # -- from the connection's protocol ------------------------------------------------------

    def feed(self, data: bytes) -> None:
        if self.done:
            return
        self._got_bytes = True
        self._last = self.loop.time()
        self._fed += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self._complete:  # a whole response, then bytes after it: end, do not reuse
                self._keep_alive = False
                self._finish()
                return
            # a callback's own error (ours, or the handler's) comes wrapped: end with it
            cause = exc.__context__ if isinstance(exc, httptools.HttpParserCallbackError) else None
            self._fail(cause if cause is not None else ClientError(f"bad response: {exc}"))
            return
        except httptools.HttpParserUpgrade:  # not an HttpParserError; 101 answers no POST
            self._fail(ClientError("bad response: unexpected protocol upgrade"))
            return
        if self._complete:
            self._finish()
        elif not self._headers_done and self._fed > MAX_HEAD_BYTES:
            # llhttp buffers a header line until it ends, before `on_header` can count it
            self._fail(ClientError("response head too large"))

    def lost(self) -> None:
        """The connection closed (EOF or error) before the response was complete."""
        if self.done:
            return
        if self._headers_done and not self._framed:
            self._complete = True  # the body ends with the connection
            self._finish()
        elif not self._got_bytes and self._reused:
            self._stop_timer()
            self._drop_connection()
            self._reset()
            self._reused = False
            self._connecting = self.loop.create_task(self._open())  # stale: retry fresh
        elif not self._got_bytes:
            self._fail(ClientError("the server closed the connection before answering"))
        else:
            self._fail(ClientError("the server closed the connection mid-response"))

    # -- parser callbacks (llhttp) ----------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._complete:  # llhttp would parse a second response into this one's body
            raise ClientError("bytes after the response")

    def on_status(self, status: bytes) -> None:
        self._count(len(status))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        name = name.lower()
        if name == b"content-length":
            self._framed = True
        elif name == b"transfer-encoding":  # as llhttp: unless chunked is last, until close
            self._framed = value.rsplit(b",", 1)[-1].strip().lower() == b"chunked"

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        self._interim = status < 200
        if self._interim:
            return
        self._headers_done = True
        if status in (204, 304):
            self._framed = True
        self.handler.on_head(status)

    def on_body(self, body: bytes) -> None:
        if self._interim:  # a 1xx has no body, but llhttp frames one for 104..199
            raise ClientError("bad response: a body in an interim (1xx) response")
        self.handler.on_body(body)

    def on_message_complete(self) -> None:
        if self._interim:  # 100 Continue, 103 Early Hints: the answer follows
            self._interim = self._framed = False
            self._head_bytes = 0
            return
        self._complete = True
        self._keep_alive = self._parser.should_keep_alive()

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > MAX_HEAD_BYTES:
            raise ClientError("response head too large")

    # -- endings ------------------------------------------------------------------------------

    def _finish(self) -> None:
        self.done = True
        self._stop_timer()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.call = None
            if self._keep_alive and self._framed:
                self.pool.release(conn)
            else:
                conn.close()
        self.handler.on_end(None)

    def _fail(self, exc: BaseException) -> None:
        if self.done:
            return
        self.done = True
        self._stop_timer()
        self._drop_connection()
        self.handler.on_end(exc)

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.call = None
            conn.close()

    # -- timeouts -----------------------------------------------------------------------------

    def _arm(self, seconds: float) -> None:
        self._timer = self.loop.call_later(max(seconds, 0.0), self._expire)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        """Fires at the earliest possible timeout; bytes that arrived since re-arm it (one
        timer per call, not one per read)."""
        self._timer = None
        if self.done:
            return
        now = self.loop.time()
        if now >= self.deadline:
            self._fail(TimeoutError("the call ran past its total timeout"))
        elif now - self._last >= self.read_s:
            self._fail(TimeoutError("no response bytes within the read timeout"))
        else:
            self._arm(min(self._last + self.read_s, self.deadline) - now)


def post(
    pool: ConnectionPool,
    path: str,
    body: bytes,
    handler: ResponseHandler,
    *,
    connect_s: float,
    read_s: float,
    total_s: float,
) -> HttpCall:
    """Send `POST path` with a JSON body now (or once connected); `handler` gets the
    response as it arrives. Cancel with the returned call's `cancel()`."""
    call = HttpCall(
        pool,
        pool.request_bytes(path, body),
        handler,
        connect_s=connect_s,
        read_s=read_s,
        total_s=total_s,
    )
    call.start()
    return call

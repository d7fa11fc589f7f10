"""The gateway's HTTP/1.1 server: an asyncio protocol over llhttp (`httptools`).

Why not aiohttp's server: its per-request machinery (request and response objects, a task
switch, header preparation) cost about 90 us more CPU per small POST than a bare asyncio
protocol on our 2-core machines (137-153 vs 43-57 us), and a bare aiohttp proxy making the
gateway's two engine calls only tied SGLang's Rust router; the gateway's added latency is
a benchmark target. This server does what the gateway's routes need and no more, with the
same parser aiohttp uses (llhttp):

- keep-alive and pipelining (responses in request order; reading pauses while
  `MAX_PIPELINED` requests wait), HTTP/1.0 and `Connection: close`; an `Upgrade` request
  is answered as plain HTTP/1.1, then the connection closes;
- exactly one `Host` header in HTTP/1.1 (RFC 9112 3.2; none or several: 400);
- request bodies by `Content-Length` or chunked (any other transfer coding, or one in
  HTTP/1.0, is refused: 400, or 501 for a coding before chunked), `Expect: 100-continue`
  (answered when no earlier request is pending), a body limit (413,
  answered as soon as the declared length is known), a head limit (431), malformed requests
  (400) and requests too slow to arrive (408), each answered by `error_response`; then the
  connection half-closes, drops what the client still sends for `LINGER_S`, and closes;
- whole responses in one write; streamed responses with chunked encoding and write
  back-pressure; `HEAD` answered without a body;
- one task per request: a client that disconnects cancels its handler (so the gateway
  aborts the request on the engines), and a handler that raises gets a 500 without a
  traceback; idle keep-alive connections close after `keepalive_timeout_s`;
- `stop(grace_s)` drains: it closes the listening socket at once (new connections are
  refused), answers every request that was not running yet with `error_response(503)`,
  `Connection: close` and `x-prfaas-not-started: 1` (on connections already open, `/health`
  included, so a load balancer's health check sees the drain; the header tells a proxy that
  the request never ran, so sending it to another server is safe), and lets the handlers
  running finish for up to `grace_s` (`cut()` ends that wait early). A handler still
  running then is cancelled and its response ended by the server: a 503 where nothing was
  sent yet, else the stream's `cut_tail` (the handler's last words, e.g. an SSE error event)
  and the body's proper end, so no client sees a response cut off without a reason.

Handlers return an `HttpResponse`, or start a stream on the `Exchange` and return None
(both in `messages.py`, with the request).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import httptools

from prfaas.http.messages import Exchange, HttpRequest, HttpResponse

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpLimits:
    """Bounds on what one client may send, and how long connections may idle."""

    max_body_bytes: int = 64 * 1024 * 1024
    max_head_bytes: int = 64 * 1024
    """Request line plus headers."""
    keepalive_timeout_s: float = 75.0
    """An idle keep-alive connection is closed after this long."""
    request_timeout_s: float = 60.0
    """A request whose first byte arrived must be complete within this long (408)."""

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")


Handler = Callable[[HttpRequest, Exchange], Awaitable[HttpResponse | None]]
ErrorRenderer = Callable[[int, str, str], HttpResponse]
"""The server's own error answers: (status, message, the request's path, "" when unknown),
so that an application answers each route's errors in that route's own error body."""

MAX_PIPELINED = 16
"""Queued requests on one connection beyond which reading pauses until they are answered."""
LINGER_S = 2.0
"""After an error answer, how long input is still read (and dropped) before closing."""
NOT_STARTED_HEADER = "x-prfaas-not-started"
"""On a draining server's 503 to a request it never ran (value `1`): safe to send elsewhere
(deploy/envoy's front door retries such an answer on another replica)."""
CANCEL_WAIT_S = 1.0
"""How long `stop()` waits for cancelled handlers to end their responses."""


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _HttpProtocol(asyncio.Protocol):
    """One client connection: parses requests, runs one handler task at a time."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.limits = server.limits
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        self._pending: deque[tuple[HttpRequest, bool]] = deque()
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._drain: asyncio.Future[None] | None = None
        self._paused = False
        self._upgraded = False  # the parser stopped at an Upgrade: serve it, then close
        self._failure: tuple[int, str] | None = None  # answered after the requests before it
        self._reading_paused = False  # too many pipelined requests queued
        self._open_part: str | None = None  # "head" or "body" of an incomplete message
        self._lingering = False  # answered an error: dropping input until the client leaves
        self._new_message()

    # -- transport callbacks ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport
        self.server.connections.add(self)
        self._arm(self.limits.keepalive_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self._disarm()
        self._pending.clear()
        if self._task is not None:
            self._task.cancel()  # the client went away: stop its handler
        self._wake_drain()

    def data_received(self, data: bytes) -> None:
        if self._upgraded or self._failure is not None or self.closed or self._lingering:
            return
        was_open = self._open_part is not None
        try:
            self.parser.feed_data(data)
            self._bound_partial(len(data) if was_open else 0)
        except httptools.HttpParserUpgrade:
            self._upgraded = True  # served as plain HTTP/1.1, then the connection closes
        except _BadRequest as exc:  # from _bound_partial
            self._fail(exc.status, str(exc))
        except httptools.HttpParserError as exc:
            cause = exc.__context__  # a callback's own error (HttpParserCallbackError)
            if isinstance(cause, _BadRequest):
                self._fail(cause.status, str(cause))
            else:
                if cause is not None:
                    logger.error("HTTP parser callback failed", exc_info=cause)
                self._fail(400, f"malformed HTTP request: {exc}")

    def _bound_partial(self, fed: int) -> None:
        """Bound a message still incomplete after this read. llhttp buffers a header line,
        or a chunked body's trailer, until it ends, and calls back only then: without this,
        a line that never ends would grow in memory (and cost quadratic copying) until the
        request timeout. The read in which the message began is not counted (part of it
        may belong to earlier messages), so the bound is the limit plus one read."""
        part = self._open_part
        if part is None:
            return
        self._partial_bytes += fed
        if part == "head" and self._partial_bytes > self.limits.max_head_bytes:
            raise _BadRequest(431, f"request head over {self.limits.max_head_bytes} bytes")
        if self._partial_bytes > self.limits.max_head_bytes + self.limits.max_body_bytes:
            raise _BadRequest(413, f"request body over {self.limits.max_body_bytes} bytes")

    def eof_received(self) -> bool:
        # The client closed its side: treat it as gone (as aiohttp does), so its handler is
        # cancelled and the engines abort the request. Half-closed clients get no answer.
        return False

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_drain()

    # -- parser callbacks -------------------------------------------------------------

    def _new_message(self) -> None:
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._length = b""  # Content-Length as sent
        self._expect = False  # Expect: 100-continue
        self._head_bytes = 0
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._hosts = 0  # Host headers seen (RFC 9112 3.2: exactly one in HTTP/1.1)
        self._framed_body = False  # Transfer-Encoding present (a body, maybe chunked)
        self._coding = b""  # Transfer-Encoding as sent (repeated headers joined)
        self._partial_bytes = 0  # bytes read since this message began (see _bound_partial)

    def on_message_begin(self) -> None:
        self._new_message()
        self._open_part = "head"
        if self._task is None and not self._pending:
            self._arm(self.limits.request_timeout_s, 408)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        self._headers.append((name, value))  # decoded only if a handler reads them
        if len(name) == 14 and name.lower() == b"content-length":
            self._length = value
        elif len(name) == 6 and name.lower() == b"expect":
            self._expect = value.strip().lower() == b"100-continue"
        elif len(name) == 4 and name.lower() == b"host":
            self._hosts += 1
        elif len(name) == 17 and name.lower() == b"transfer-encoding":
            self._framed_body = True
            self._coding = b"%s, %s" % (self._coding, value) if self._coding else value

    def on_headers_complete(self) -> None:
        self._open_part = "body"
        if self._hosts > 1 or (self._hosts == 0 and self.parser.get_http_version() == "1.1"):
            raise _BadRequest(400, "an HTTP/1.1 request needs exactly one Host header")
        length = self._length.strip()
        if length.isdigit() and int(length) > self.limits.max_body_bytes:
            raise _BadRequest(413, f"request body over {self.limits.max_body_bytes} bytes")
        if self._framed_body:
            self._check_coding()
        if self.parser.should_upgrade():
            if self._framed_body or (length.isdigit() and int(length) > 0):
                # llhttp hands an upgrading request's body to the new protocol, not to us:
                # serving it without its body would be wrong, so refuse it.
                raise _BadRequest(400, "an Upgrade request with a body is not supported")
            self._upgraded = True  # answered as plain HTTP/1.1 with `Connection: close`
        if (
            self._expect
            and self.parser.get_http_version() == "1.1"
            and not self.busy  # a pipelined request's 100 would overtake earlier answers
            and self.transport is not None
        ):
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _check_coding(self) -> None:
        """Only `chunked` alone frames a body we can read. RFC 9112 6.1: a last coding
        other than chunked, or chunked twice, leaves the length unknown (400); other codings
        before it we cannot decode (501: llhttp would pass their bytes on undecoded); and
        Transfer-Encoding in HTTP/1.0 means faulty framing (400)."""
        if self.parser.get_http_version() == "1.0":
            raise _BadRequest(400, "Transfer-Encoding in an HTTP/1.0 request")
        codings = [c.strip() for c in self._coding.lower().split(b",") if c.strip()]
        if not codings or codings[-1] != b"chunked" or b"chunked" in codings[:-1]:
            raise _BadRequest(400, "Transfer-Encoding must end with one chunked")
        if len(codings) > 1:
            raise _BadRequest(501, "unsupported Transfer-Encoding: only chunked is")

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self.limits.max_body_bytes:
            raise _BadRequest(413, f"request body over {self.limits.max_body_bytes} bytes")
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._open_part = None
        if self._lingering:  # refused (a drain): what follows in this read is dropped
            return
        parser = self.parser
        try:
            url = httptools.parse_url(self._url) if self._url else None
        except httptools.HttpParserInvalidURLError:
            raise _BadRequest(400, "unsupported request target") from None
        path = url.path.decode("latin-1") if url and url.path else "/"
        request = HttpRequest.from_wire(
            parser.get_method().decode("latin-1"),
            path,
            url.query.decode("latin-1") if url and url.query else "",
            self._headers,
            b"".join(self._body),
            parser.get_http_version(),
        )
        self._pending.append((request, parser.should_keep_alive()))
        if self._task is None:
            self._disarm()
            self._next()
        elif len(self._pending) >= MAX_PIPELINED and self.transport is not None:
            self.transport.pause_reading()  # a client pipelining without reading: stop
            self._reading_paused = True

    def _count_head(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.limits.max_head_bytes:
            raise _BadRequest(431, f"request head over {self.limits.max_head_bytes} bytes")

    # -- running handlers -------------------------------------------------------------

    def _next(self) -> None:
        """Start the handler of the next queued request, or wait for one."""
        if self.closed:
            return
        if not self._pending:
            if self._failure is not None:
                self._fail(*self._failure)
            elif self._upgraded:
                self.close()
            else:
                self._arm(self.limits.keepalive_timeout_s)
            return
        request, keep_alive = self._pending.popleft()
        if self.server.draining:
            self._refuse(request)
            return
        if self._reading_paused and len(self._pending) < MAX_PIPELINED // 2 and self.transport:
            self._reading_paused = False
            self.transport.resume_reading()
        exchange = Exchange(self, request, keep_alive and not self._upgraded)
        self._task = self.loop.create_task(self._run(exchange))

    def _refuse(self, request: HttpRequest) -> None:
        """Answer a request that arrived during a drain with 503 and close: the client
        should send it elsewhere (what it pipelined after it is dropped, unanswered)."""
        self._pending.clear()
        resp = self.server.error_response(
            503, "the server is shutting down; retry elsewhere", request.path
        )
        resp = replace(resp, headers={**resp.headers, NOT_STARTED_HEADER: "1"})
        with contextlib.suppress(ConnectionError):
            self.send(Exchange(self, request, keep_alive=False).whole(resp))
        self._linger_close()

    async def _run(self, exchange: Exchange) -> None:
        try:
            resp = await self.server.handler(exchange.request, exchange)
        except asyncio.CancelledError:
            self._task = None
            if not self.closed:  # cancelled by stop(), not by the client leaving
                self._end_cut(exchange)
                self.close()
            raise
        except Exception:
            logger.exception(
                "unhandled error serving %s %s", exchange.request.method, exchange.request.path
            )
            resp = self.server.error_response(500, "internal error", exchange.request.path)
            if exchange.stream is not None and exchange.stream.started:
                self._task = None  # too late for a status: cut the response
                self.close()
                return
            exchange.stream = None  # nothing went out yet: answer the 500 instead
        self._task = None
        if self.server.draining:
            exchange.keep_alive = False  # tell the client not to reuse the connection
        try:
            if exchange.stream is not None:
                await exchange.stream.end()
            else:
                self.send(self._whole(exchange, resp))
            await self.drain()  # a client that does not read gets no further answers
        except ConnectionError:
            self.close()  # the client left while we answered
            return
        if not exchange.keep_alive:
            self.close()
            return
        self._next()

    def _end_cut(self, exchange: Exchange) -> None:
        """End the response of a handler `stop()` cancelled: a 503 if nothing went out yet,
        else the stream's cut tail and end."""
        stream = exchange.stream
        with contextlib.suppress(ConnectionError):
            if stream is not None and stream.started:
                stream.cut()
            else:
                exchange.keep_alive = False
                message = "the server stopped before the answer was ready; retry elsewhere"
                self.send(exchange.whole(
                    self.server.error_response(503, message, exchange.request.path)
                ))  # fmt: skip

    def _whole(self, exchange: Exchange, resp: HttpResponse | None) -> bytes:
        """The response's bytes, or a 500 when its headers cannot be sent."""
        try:
            path = exchange.request.path
            return exchange.whole(resp or self.server.error_response(500, "no response", path))
        except ValueError:  # a line break in a header, a server-owned header, not latin-1
            logger.exception(
                "bad response to %s %s", exchange.request.method, exchange.request.path
            )
            return exchange.whole(
                self.server.error_response(500, "internal error", exchange.request.path)
            )

    # -- writing ----------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        """Write bytes to the client (dropped once the connection is closed).

        Raises:
            ConnectionResetError: the client has gone away.
        """
        if self.closed or self.transport is None:
            raise ConnectionResetError("the client closed the connection")
        self.transport.write(data)

    async def drain(self) -> None:
        """Wait until the transport's write buffer is below its high-water mark."""
        while self._paused and not self.closed:
            self._drain = self.loop.create_future()
            try:
                await self._drain
            finally:
                self._drain = None
        if self.closed:
            raise ConnectionResetError("the client closed the connection")

    def _wake_drain(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def _fail(self, status: int, message: str) -> None:
        """Answer a request that cannot be served and close (after answering the requests
        pipelined before it)."""
        if self._task is not None or self._pending:
            self._failure = (status, message)  # _next() answers it once they are answered
            return
        if self.closed:
            return
        resp = self.server.error_response(status, message, self._target_path())
        request = HttpRequest("GET", "/", "", {}, b"")
        with contextlib.suppress(ConnectionError):
            self.send(Exchange(self, request, keep_alive=False).whole(resp))
        self._linger_close()

    def _target_path(self) -> str:
        """The path of the request being read, as far as it arrived ("" before any)."""
        return self._url.partition(b"?")[0].decode("latin-1")

    def _linger_close(self) -> None:
        """Half-close after an error answer and drop what the client still sends, for up to
        `LINGER_S`: closing outright would reset a connection the client is still
        uploading to (a body over the limit), and it would see the reset, not the answer."""
        transport = self.transport
        if transport is None or not transport.can_write_eof():
            self.close()
            return
        self._lingering = True
        if self._reading_paused:
            transport.resume_reading()
        try:
            transport.write_eof()  # after the answer: the client reads it, then EOF
        except OSError:
            self.close()
            return
        self._arm(LINGER_S)

    def close(self) -> None:
        self._disarm()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        self.closed = True

    # -- timers -----------------------------------------------------------------------

    def _arm(self, seconds: float, status: int | None = None) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._expire, status)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, status: int | None) -> None:
        self._timer = None
        if status is None:
            self.close()  # idle keep-alive connection
        else:
            self._fail(status, "the request did not arrive in time")

    @property
    def busy(self) -> bool:
        return self._task is not None or bool(self._pending)


class HttpServer:
    """Serves `handler` on one listening socket."""

    def __init__(
        self,
        handler: Handler,
        error_response: ErrorRenderer,
        limits: HttpLimits | None = None,
    ) -> None:
        self.handler = handler
        self.error_response = error_response
        self.limits = limits or HttpLimits()
        self.connections: set[_HttpProtocol] = set()
        self.draining = False
        """Set by `stop()`: new requests get 503, answers say `Connection: close`."""
        self._server: asyncio.AbstractServer | None = None
        self._cut = False

    async def start(self, host: str, port: int) -> int:
        """Listen on `host:port` (0: any free port); returns the bound port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _HttpProtocol(self), host, port, reuse_address=True
        )
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self, grace_s: float = 2.0) -> None:
        """Drain, then close (see the module's docstring): stop listening; answer requests
        that were not running yet with 503; wait up to `grace_s` (or until `cut()`) for the
        running handlers; cancel what still runs, ending each response with a 503 or the
        stream's cut tail; close every connection. Idempotent."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while any(c.busy for c in self.connections) and not self._cut:
            if loop.time() >= deadline:
                break
            await asyncio.sleep(0.02)
        tasks = [c._task for c in self.connections if c._task is not None]
        for task in tasks:
            task.cancel()  # each ends its own response (`_HttpProtocol._end_cut`)
        if tasks:
            await asyncio.wait(tasks, timeout=CANCEL_WAIT_S)
        for conn in list(self.connections):
            conn.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

    def cut(self) -> None:
        """End a `stop()`'s wait for running handlers now (e.g. a second signal)."""
        self._cut = True

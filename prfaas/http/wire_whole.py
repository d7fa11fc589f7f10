"""Whole-response calls on the wire pool: the request is written at once and the
connection's protocol parses the response as bytes arrive (llhttp, via `httptools`), then
hands it to a callback. No coroutine, task or future per read.

This is the gateway's hot path for non-streaming requests: it sends the prefill and the
decode call back to back from one coroutine and wakes that coroutine once, when both
answers are in (or the first one fails). Streaming calls keep `WirePool.post`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import httptools

from prfaas.http.wire import (
    MAX_HEAD_BYTES,
    ConnectFailed,
    WireError,
    WirePool,
    _Connection,
)


@dataclass(frozen=True)
class WholeResponse:
    """A response read to its end."""

    status: int
    body: bytes


Outcome = WholeResponse | BaseException
OnDone = Callable[[Outcome], None]


class WholeCall:
    """One `POST` whose response is collected by the connection's protocol.

    `on_done` runs exactly once, from the event loop, with the `WholeResponse` or the error:
    `ConnectFailed` (no connection could be opened), `WireError` (malformed or cut-off
    response), `TimeoutError` (no byte within `read_s`, or the whole call past `total_s`).
    A reused keep-alive connection that the server had closed (no byte of an answer) is
    retried once on a fresh connection.
    """

    def __init__(
        self,
        pool: WirePool,
        request: bytes,
        *,
        connect_s: float,
        read_s: float,
        total_s: float,
        on_done: OnDone,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.pool, self.request, self.on_done = pool, request, on_done
        self.connect_s, self.read_s = connect_s, read_s
        self.deadline = self.loop.time() + total_s
        self.done = False
        self._conn: _Connection | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._reused = False
        self._reset()

    def _reset(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._body: list[bytes] = []
        self._head_bytes = 0
        self._fed = 0  # bytes fed to the parser (all of them head bytes until the head ends)
        self._got_bytes = False
        self._headers_done = False
        self._framed = False  # Content-Length or chunked: the body does not end with the close
        self._complete = False
        self._keep_alive = False
        self._last = self.loop.time()

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Send on an idle pooled connection, or open one first."""
        conn = self.pool.take_idle()
        if conn is None:
            self._connect()
        else:
            self._send(conn, reused=True)

    def cancel(self) -> bool:
        """Give up on the call (drops its connection). True if it was still in flight."""
        if self.done:
            return False
        self.done = True
        self._stop_timer()
        if self._connecting is not None:
            self._connecting.cancel()
        self._drop_connection()
        return True

    def _connect(self) -> None:
        self._connecting = self.loop.create_task(self._open())

    async def _open(self) -> None:
        try:
            conn = await self.pool.open(self.loop, self.connect_s)
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
        conn.whole = self
        self._last = self.loop.time()
        self._arm(min(self.read_s, self.deadline - self._last))
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
            if self._complete:  # a whole response, then bytes after it: deliver, do not reuse
                self._keep_alive = False
                self._finish()
                return
            cause = exc.__context__
            self._fail(cause if isinstance(cause, WireError) else WireError(f"bad response: {exc}"))
            return
        if self._complete:
            self._finish()
        elif not self._headers_done and self._fed > MAX_HEAD_BYTES:
            # httptools buffers a header until it ends, before `on_header` can count it
            self._fail(WireError("response head too large"))

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
            self._reused = False
            self._reset()
            self._connect()  # the server closed an idle connection: retry once, fresh
        elif not self._got_bytes:
            self._fail(WireError("the engine closed the connection before answering"))
        else:
            self._fail(WireError("the engine closed the connection mid-response"))

    # -- parser callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._complete:  # llhttp would parse a second response into this one's body
            raise WireError("bytes after the response")

    def on_status(self, status: bytes) -> None:
        self._count(len(status))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        self._headers_done = True
        status = self._parser.get_status_code()
        if status in (204, 304) or status < 200:
            self._framed = True

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._parser.get_status_code() < 200:  # interim (100, 103): the answer follows
            self._headers_done = self._framed = False
            return
        self._complete = True
        self._keep_alive = self._parser.should_keep_alive()  # reset once the call returns

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > MAX_HEAD_BYTES:
            raise WireError("response head too large")

    # -- endings ------------------------------------------------------------------------------

    def _finish(self) -> None:
        self.done = True
        self._stop_timer()
        conn = self._conn
        keep = self._keep_alive and self._framed
        if conn is not None:
            conn.whole = None
            self._conn = None
            if keep and not conn.closed:
                self.pool.release(conn)
            else:
                conn.close()
        self.on_done(WholeResponse(self._parser.get_status_code(), b"".join(self._body)))

    def _fail(self, exc: BaseException) -> None:
        if self.done:
            return
        self.done = True
        self._stop_timer()
        self._drop_connection()
        self.on_done(exc)

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.whole = None
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


def post_whole(
    pool: WirePool,
    path: str,
    body: bytes,
    *,
    connect_s: float,
    read_s: float,
    total_s: float,
    on_done: OnDone,
) -> WholeCall:
    """Send `POST path` with a JSON body now (or once connected); `on_done` gets the whole
    response or the error. Cancel with the returned call's `cancel()`."""
    call = WholeCall(
        pool,
        pool.request_bytes(path, body),
        connect_s=connect_s,
        read_s=read_s,
        total_s=total_s,
        on_done=on_done,
    )
    call.start()
    return call

"""Whole answers from the lean HTTP/1.1 client (`post` with a collecting handler), against
real servers on loopback sockets: aiohttp apps for well-formed HTTP, raw asyncio servers for
exact bytes on the wire. Connection reuse is seen from the server side (which connection
each request came on)."""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
from aiohttp import web
from aiohttp_helpers import start_app
from http_client_helpers import TIMEOUTS, Collect

from prfaas.http.client import (
    MAX_HEAD_BYTES,
    ClientError,
    ConnectFailed,
    ConnectionPool,
    HttpCall,
    post,
)

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


@dataclass(frozen=True)
class Answer:
    """A response read to its end."""

    status: int
    body: bytes


def start(
    pool: ConnectionPool, body: bytes = b"{}", handler: Collect | None = None, **timeouts: float
) -> tuple[HttpCall, Collect]:
    """`post` with the default timeouts (overridable) and a collecting handler."""
    handler = handler or Collect()
    return post(pool, "/x", body, handler, **{**TIMEOUTS, **timeouts}), handler


async def answer(pool: ConnectionPool, body: bytes = b"{}", **timeouts: float) -> Answer:
    """`post` as an awaitable: the answer, or its error raised. Checks the handler's
    contract: `on_end` exactly once, `on_head` once before any body (never on failure
    before the head)."""
    _, handler = start(pool, body, **timeouts)
    error = await asyncio.wait_for(handler.ended, 10)
    await asyncio.sleep(0.02)
    assert len(handler.ends) == 1, handler.ends
    assert len(handler.heads) <= 1, handler.heads
    assert handler.heads or not handler.pieces
    if error is not None:
        raise error
    return Answer(handler.heads[0], b"".join(handler.pieces))


# -- servers -----------------------------------------------------------------------------------


class RawServer:
    """What an asyncio server saw: connections accepted, requests read (with the index of
    their connection) and the connections the client closed."""

    def __init__(self, port: int) -> None:
        self.connections = 0
        self.requests: list[tuple[int, bytes]] = []
        self.client_closed: set[int] = set()
        self.pool = ConnectionPool("127.0.0.1", port)
        self._changed = asyncio.Event()

    async def until(self, predicate: Callable[[], bool], wait_s: float = 5) -> None:
        """Until `predicate()` holds, rechecked whenever a request or a close is seen."""
        async with asyncio.timeout(wait_s):
            while not predicate():
                self._changed.clear()
                await self._changed.wait()

    async def read_request(self, reader: asyncio.StreamReader, index: int) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        request = head + await reader.readexactly(length)
        self.requests.append((index, request))
        self._changed.set()
        return request

    async def wait_eof(self, reader: asyncio.StreamReader, index: int, wait_s: float = 5) -> None:
        """Until the client closes the connection (bytes it sends first are dropped); a
        reset (the client closed with our bytes unread) counts as closed."""
        async with asyncio.timeout(wait_s):
            try:
                while await reader.read(65536):
                    pass
            except ConnectionResetError:
                pass
        self.client_closed.add(index)
        self._changed.set()

    def connections_of_requests(self) -> list[int]:
        return [index for index, _ in self.requests]


RawHandler = Callable[[RawServer, asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


@asynccontextmanager
async def raw_server(handler: RawHandler) -> AsyncIterator[RawServer]:
    """Serve `handler(raw, reader, writer, connection index)` on a loopback port; `raw.pool`
    is a pool to it."""
    raw: RawServer | None = None

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert raw is not None
        index = raw.connections
        raw.connections += 1
        try:
            await handler(raw, reader, writer, index)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    raw = RawServer(server.sockets[0].getsockname()[1])
    try:
        async with server:
            yield raw
    finally:
        raw.pool.close()


@asynccontextmanager
async def echo_app() -> AsyncIterator[tuple[ConnectionPool, list[int]]]:
    """A pool to an aiohttp app answering a request with its own body (`Content-Length`);
    a body `{"status": n}` is answered with status n. The list collects each request's
    client port (to see connection reuse)."""
    ports: list[int] = []

    async def echo(request: web.Request) -> web.Response:
        ports.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        body = await request.read()
        status = json.loads(body).get("status", 200) if body.startswith(b"{") else 200
        if status == 204:
            return web.Response(status=204)
        return web.Response(status=status, body=body)

    app = web.Application()
    app.router.add_post("/x", echo)
    runner, url = await start_app(app)
    pool = ConnectionPool("127.0.0.1", int(url.rsplit(":", 1)[1]))
    try:
        yield pool, ports
    finally:
        pool.close()
        await runner.cleanup()


# -- bodies, statuses and reuse ----------------------------------------------------------------


async def test_content_length_bodies_and_connection_reuse() -> None:
    """Bodies of every size (one spanning many reads) come back whole; the connection goes
    back to the pool and carries the next call: one client port for all calls."""
    async with echo_app() as (pool, ports):
        for size in (0, 5, 300_000):
            body = bytes(i % 251 for i in range(size))
            assert await answer(pool, body) == Answer(200, body)
        assert len(ports) == 3 and len(set(ports)) == 1


async def test_statuses_are_delivered_as_responses() -> None:
    """A 204 (no body) and error statuses are responses, not errors, with their bodies; none
    of them costs the connection."""
    async with echo_app() as (pool, ports):
        for status in (204, 404, 500, 503, 200):
            body = json.dumps({"status": status}).encode()
            assert await answer(pool, body) == Answer(status, b"" if status == 204 else body)
        assert len(set(ports)) == 1


async def test_chunked_body_with_extensions_and_trailers_then_reuse() -> None:
    """A chunked body, split across writes at awkward places, with chunk extensions and
    trailers, is decoded whole; the connection then carries the second call."""
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunks = b"5;ext=1\r\nhello\r\n1\r\n \r\nB;a=b;c\r\nworld again\r\n0\r\nX-Trailer: 1\r\n\r\n"
    wire = head + chunks

    async def handler(
        raw: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, i: int
    ) -> None:
        for _ in range(2):
            await raw.read_request(reader, i)
            cuts = [0, len(head) - 1, len(head) + 3, len(head) + 12, len(wire) - 8, len(wire)]
            for begin, end in itertools.pairwise(cuts):
                writer.write(wire[begin:end])
                await writer.drain()
                await asyncio.sleep(0.005)
        await raw.wait_eof(reader, i)

    async with raw_server(handler) as raw:
        for _ in range(2):
            assert await answer(raw.pool) == Answer(200, b"hello world again")
        assert raw.connections_of_requests() == [0, 0]


@pytest.mark.parametrize("version", [b"1.1", b"1.0"])
async def test_body_until_close_is_delivered_at_close_and_not_reused(version: bytes) -> None:
    """No length and not chunked (HTTP/1.1 or 1.0): the body is everything until the server
    closes, and the next call needs a new connection."""

    async def handler(
        raw: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, i: int
    ) -> None:
        await raw.read_request(reader, i)
        writer.write(b"HTTP/" + version + b" 200 OK\r\n\r\nall ")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"of it")

    async with raw_server(handler) as raw:
        assert await answer(raw.pool) == Answer(200, b"all of it")
        assert await answer(raw.pool) == Answer(200, b"all of it")
        assert raw.connections_of_requests() == [0, 1]


@pytest.mark.parametrize("codings", [b"gzip", b"chunked, gzip", b"chunked;q=1"])
async def test_transfer_encoding_not_ending_in_chunked_runs_until_close(codings: bytes) -> None:
    """A `Transfer-Encoding` whose final coding is not chunked frames the body by the close
    (RFC 9112 6.3, and what llhttp parses): the bytes come as sent, chunk-like or not, when
    the server closes, and are not a cut-off answer."""
    body = b"5\r\nhello\r\n0\r\n\r\n"

    async def handler(
        raw: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, i: int
    ) -> None:
        await raw.read_request(reader, i)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: " + codings + b"\r\n\r\n" + body)

    async with raw_server(handler) as raw:
        assert await answer(raw.pool) == Answer(200, body)
        assert await answer(raw.pool) == Answer(200, body)
        assert raw.connections_of_requests() == [0, 1]


async def test_connection_close_in_the_response_is_not_reused() -> None:
    """`Connection: close` with a `Content-Length` body: delivered at its end, and the
    client closes the connection itself (the server keeps it open)."""

    async def handler(
        raw: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, i: int
    ) -> None:
        await raw.read_request(reader, i)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")
        await raw.wait_eof(reader, i)

    async with raw_server(handler) as raw:
        assert await answer(raw.pool) == Answer(200, b"ok")
        assert await answer(raw.pool) == Answer(200, b"ok")
        assert raw.connections_of_requests() == [0, 1]
        await raw.until(lambda: raw.client_closed == {0, 1})


# -- cut-off and malformed responses -----------------------------------------------------------


CUT_OFF = [  # the server sends these, then closes
    (b"", "before answering"),
    (b"HTTP/1.1 200 OK\r\nContent-Le", "mid-response"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", "mid-response"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", "mid-response"),
    (b"HTTP/1.1 100 Continue\r\n\r\n", "mid-response"),
]
MALFORMED = [  # the server sends these and keeps the connection open
    (b"SPAM\r\n\r\n", "bad response"),
    (b"HTTP/1.1 2x0 OK\r\nContent-Length: 0\r\n\r\n", "bad response"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n", "bad response"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad response"),
    (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\n", "upgrade"),
    (b"HTTP/1.1 199 X\r\nContent-Length: 5\r\n\r\nhello" + OK, "interim"),  # not b"hellook"
]


@pytest.mark.parametrize(
    ("reply", "match", "server_closes"),
    [(*case, True) for case in CUT_OFF] + [(*case, False) for case in MALFORMED],
)
async def test_cut_off_or_malformed_response_is_client_error(
    reply: bytes, match: str, server_closes: bool
) -> None:
    """On a fresh connection: closed before any byte, mid-head, mid-body (sized or chunked),
    after only an interim answer, bytes llhttp rejects, a 101 Upgrade (no answer to a POST)
    or a 1xx with a body (none has one, though llhttp frames one for 104..199). Each is a
    ClientError with no body handed over; after a malformed one the client closes the
    connection itself, and nothing is pooled."""

    async def handler(
        raw: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, i: int
    ) -> None:
        await raw.read_request(reader, i)
        writer.write(reply)
        await writer.drain()
        if not server_closes:
            await raw.wait_eof(reader, i)

    async with raw_server(handler) as raw:
        with pytest.raises(ClientError, match=match):
            await answer(raw.pool)
        assert raw.pool.take_idle() is None
        assert raw.connections == 1 and len(raw.requests) == 1
        if not server_closes:
            await raw.until(lambda: raw.client_closed == {0})


async def test_head_over_the_limit_is_client_error() -> None:
    """A complete head over MAX_HEAD_BYTES (many headers), and a head that never ends (one
    endless header value, the server holding the connection open), are ClientErrors, not a
    read timeout or unbounded buffering."""
    many = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 100) for i in range(MAX_HEAD_BYTES // 100))
    replies = [
        b"HTTP/1.1 200 OK\r\n" + many + b"Content-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-Endless: " + b"v" * (4 * MAX_HEAD_BYTES),
    ]

    async def handler(
        raw: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, i: int
    ) -> None:
        await raw.read_request(reader, i)
        writer.write(replies[i])
        await raw.wait_eof(reader, i)

    async with raw_server(handler) as raw:
        for _ in replies:
            with pytest.raises(ClientError, match="head too large"):
                await answer(raw.pool, read_s=3, total_s=3)
        await raw.until(lambda: raw.client_closed == {0, 1})


@pytest.mark.parametrize(
    "extra",
    [
        OK,  # a second, unasked-for response
        b"GARBAGE",
        b"HTTP/1.1 200 OK\r\nContent-Le",
    ],
)
async def test_bytes_after_a_complete_response_in_the_same_read(extra: bytes) -> None:
    """A complete response followed by more bytes in the same packet: the response is
    delivered as it was (nothing of the extra in its body), the connection is dropped."""

    async def handler(
        raw: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, i: int
    ) -> None:
        await raw.read_request(reader, i)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc" + extra)
        await raw.wait_eof(reader, i)

    async with raw_server(handler) as raw:
        assert await answer(raw.pool) == Answer(200, b"abc")
        assert await answer(raw.pool) == Answer(200, b"abc")
        assert raw.connections_of_requests() == [0, 1]
        await raw.until(lambda: 0 in raw.client_closed)


async def test_connection_close_response_with_extra_bytes() -> None:
    """`Connection: close`, then bytes llhttp refuses after such a response: still the
    response, on a connection that is dropped."""

    async def handler(
        raw: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, i: int
    ) -> None:
        await raw.read_request(reader, i)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nokXYZ")
        await raw.wait_eof(reader, i)

    async with raw_server(handler) as raw:
        assert await answer(raw.pool) == Answer(200, b"ok")
        assert raw.pool.take_idle() is None
        await raw.until(lambda: raw.client_closed == {0})


async def test_interim_responses_are_skipped() -> None:
    """1xx answers (100 Continue, 103 Early Hints), in the final answer's packet or before
    it, are not the answer and never reach `on_head`: the call gets the final response,
    whose body may even run until the close, and a Content-Length one leaves the connection
    reusable."""
    final = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfinal"
    replies = [
        [b"HTTP/1.1 100 Continue\r\n\r\n" + final],
        [b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n", final],
        [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 200 OK\r\n\r\nuntil close"],
    ]

    async def handler(
        raw: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, i: int
    ) -> None:
        while replies:
            await raw.read_request(reader, i)
            for part in replies.pop(0):
                writer.write(part)
                await writer.drain()
                await asyncio.sleep(0.02)
        # the until-close body ends here

    async with raw_server(handler) as raw:
        assert await answer(raw.pool) == Answer(200, b"final")
        assert await answer(raw.pool) == Answer(200, b"final")
        assert await answer(raw.pool) == Answer(200, b"until close")  # one on_head, checked
        assert raw.connections_of_requests() == [0, 0, 0]


async def test_bytes_arriving_on_an_idle_connection_make_it_unusable() -> None:
    """Bytes the server sends after the response, while the connection sits in the pool,
    are not part of any answer: the next call goes out on a new connection."""

    async def handler(
        raw: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, i: int
    ) -> None:
        await raw.read_request(reader, i)
        writer.write(OK)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstale")
        await raw.wait_eof(reader, i)

    async with raw_server(handler) as raw:
        assert await answer(raw.pool) == Answer(200, b"ok")
        await asyncio.sleep(0.2)
        assert await answer(raw.pool) == Answer(200, b"ok")
        assert raw.connections_of_requests() == [0, 1]


# -- a handler that raises ---------------------------------------------------------------------


class Refuses(Collect):
    """Raises from `on_body` (as a handler does on a bad answer it parses)."""

    def on_body(self, data: bytes) -> None:
        super().on_body(data)
        raise ValueError(f"refused {data!r}")


async def test_an_error_raised_by_the_handler_ends_the_call_with_it() -> None:
    """A handler method that raises fails the call with that very exception (not a parser
    error about a callback), once, and the connection is dropped, not pooled."""
    async with echo_app() as (pool, ports):
        _, handler = start(pool, b"abc", Refuses())
        error = await asyncio.wait_for(handler.ended, 5)
        assert isinstance(error, ValueError) and str(error) == "refused b'abc'"
        await asyncio.sleep(0.02)
        assert handler.ends == [error] and handler.heads == [200]
        assert pool.take_idle() is None
        assert await answer(pool, b"next") == Answer(200, b"next")
        assert len(set(ports)) == 2


# -- stale keep-alive connections --------------------------------------------------------------


async def test_stale_connection_read_then_dropped_is_retried_once_fresh() -> None:
    """The server reads the second request on the kept-alive connection and hangs up without
    a byte (the keep-alive race): the call goes out again on a fresh connection and gets its
    answer. A fresh connection that does the same is an error: one retry, not a loop."""

    async def handler(
        raw: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, i: int
    ) -> None:
        await raw.read_request(reader, i)
        if i < 2:
            writer.write(OK)
            await writer.drain()
        if i == 0:
            await raw.read_request(reader, i)  # read it, then hang up unanswered

    async with raw_server(handler) as raw:
        for _ in range(2):
            assert await answer(raw.pool) == Answer(200, b"ok")
        assert raw.connections_of_requests() == [0, 0, 1]
        assert all(request.startswith(b"POST /x HTTP/1.1\r\n") for _, request in raw.requests)
        with pytest.raises(ClientError, match="before answering"):
            await answer(raw.pool)
        assert raw.connections == 3


class ThenSend(Collect):
    """Once its call ends, sends the next one on the same pool straight from `on_end`, and
    records whether the answered connection was back in the pool, still open, by then."""

    def __init__(self, pool: ConnectionPool, then: Collect) -> None:
        super().__init__()
        self.pool, self.then = pool, then
        self.took_idle: list[bool] = []

    def on_end(self, error: BaseException | None) -> None:
        super().on_end(error)
        conn = self.pool.take_idle()
        self.took_idle.append(conn is not None)
        if conn is not None:
            self.pool.release(conn)
        start(self.pool, handler=self.then)


async def test_idle_connection_closed_by_the_server_is_replaced() -> None:
    """The server closes a keep-alive connection right after answering. A call sent on it
    straight from `on_end`, before the close is seen, goes out again on a fresh connection;
    the server reads each request once (the dead connection's copy is never read)."""

    async def handler(
        raw: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, i: int
    ) -> None:
        await raw.read_request(reader, i)
        writer.write(OK)
        await writer.drain()

    async with raw_server(handler) as raw:
        second = Collect()
        first = ThenSend(raw.pool, second)
        start(raw.pool, handler=first)
        assert await asyncio.wait_for(second.ended, 5) is None
        assert first.ends == [None] and first.took_idle == [True]
        assert (second.heads, second.pieces) == ([200], [b"ok"])
        assert raw.connections_of_requests() == [0, 1]
        # and once the close is seen, the pool no longer offers that connection
        assert await answer(raw.pool) == Answer(200, b"ok")
        assert raw.connections_of_requests() == [0, 1, 2]


# -- connect failures and timeouts -------------------------------------------------------------


async def test_connection_refused_is_connect_failed() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    call, handler = start(ConnectionPool("127.0.0.1", port))
    error = await asyncio.wait_for(handler.ended, 5)
    assert isinstance(error, ConnectFailed) and str(port) in str(error)
    assert not call.sent and handler.heads == [] and handler.ends == [error]


async def test_read_timeout_fails_the_call_and_closes_the_connection() -> None:
    """A server that accepts and reads but never answers: TimeoutError after about read_s
    (not the total timeout), and the client closes the connection."""

    async def handler(
        raw: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, i: int
    ) -> None:
        await raw.read_request(reader, i)
        await raw.wait_eof(reader, i)

    async with raw_server(handler) as raw:
        loop = asyncio.get_running_loop()
        begin = loop.time()
        with pytest.raises(TimeoutError, match="read timeout"):
            await answer(raw.pool, read_s=0.3, total_s=10)
        assert 0.25 <= loop.time() - begin < 3
        await raw.until(lambda: raw.client_closed == {0})


async def test_total_timeout_bounds_a_trickling_response() -> None:
    """A byte of body every 50 ms keeps each read under read_s; the whole call still ends
    at total_s."""

    async def handler(
        raw: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, i: int
    ) -> None:
        await raw.read_request(reader, i)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
        for _ in range(200):
            await asyncio.sleep(0.05)
            writer.write(b"x")

    async with raw_server(handler) as raw:
        loop = asyncio.get_running_loop()
        begin = loop.time()
        with pytest.raises(TimeoutError, match="total timeout"):
            await answer(raw.pool, read_s=5, total_s=0.4)
        assert 0.35 <= loop.time() - begin < 4


# -- cancellation ------------------------------------------------------------------------------


async def test_cancel_in_flight_drops_the_connection_and_never_calls_back() -> None:
    async def handler(
        raw: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, i: int
    ) -> None:
        await raw.read_request(reader, i)
        await raw.wait_eof(reader, i)

    async with raw_server(handler) as raw:
        call, collected = start(raw.pool)
        await raw.until(lambda: bool(raw.requests))
        assert call.sent
        assert call.cancel() is True
        assert call.cancel() is False
        await raw.until(lambda: raw.client_closed == {0})
        await asyncio.sleep(0.1)
        assert collected.ends == []
        assert raw.pool.take_idle() is None


async def test_cancel_after_completion_is_false() -> None:
    async with echo_app() as (pool, _):
        call, collected = start(pool)
        assert await asyncio.wait_for(collected.ended, 5) is None
        assert (collected.heads, b"".join(collected.pieces)) == ([200], b"{}")
        assert call.cancel() is False
        assert pool.take_idle() is not None  # the connection stayed pooled
        assert collected.ends == [None]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_cancel_while_connecting_leaks_nothing() -> None:
    """A listener whose backlog is full leaves the connect pending: the request is not
    `sent`; cancelling then calls nobody back and closes the half-open socket; past
    connect_s, a pending connect is ConnectFailed."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    try:
        await asyncio.sleep(0.05)
        pool = ConnectionPool("127.0.0.1", port)
        gc.collect()
        before = _open_fds()
        call, collected = start(pool, connect_s=5)
        await asyncio.sleep(0.1)
        assert _open_fds() == before + 1  # the connecting socket
        assert not call.sent
        assert call.cancel() is True
        await asyncio.sleep(0.1)
        assert _open_fds() == before
        assert collected.ends == []
        with pytest.raises(ConnectFailed):
            await answer(pool, connect_s=0.2)
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


@pytest.mark.parametrize("turns", range(12))
async def test_cancel_at_any_point_of_the_connect_closes_what_was_opened(turns: int) -> None:
    """Cancel after 0..11 loop turns: before the connect starts, during it, just after it
    (before the request goes out) or after the request. Whatever the server accepted, the
    client closes; `on_end` never runs."""

    async def handler(
        raw: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, i: int
    ) -> None:
        await raw.wait_eof(reader, i, wait_s=3)

    async with raw_server(handler) as raw:
        call, collected = start(raw.pool)
        for _ in range(turns):
            await asyncio.sleep(0)
        assert call.cancel() is True
        await asyncio.sleep(0.1)
        assert raw.client_closed == set(range(raw.connections))
        assert collected.ends == []
        assert raw.pool.take_idle() is None


# -- concurrency -------------------------------------------------------------------------------


async def test_many_concurrent_calls_get_their_own_answers() -> None:
    """50 calls at once over one pool, twice: each gets its own body back (the app echoes
    a request id); the second wave reuses the first wave's connections."""
    async with echo_app() as (pool, ports):
        for wave in range(2):
            ids = range(wave * 100, wave * 100 + 50)
            bodies = [json.dumps({"id": i, "pad": "p" * (i % 100)}).encode() for i in ids]
            answers = await asyncio.gather(*(answer(pool, body) for body in bodies))
            assert answers == [Answer(200, body) for body in bodies]
        assert len(ports) == 100 and len(set(ports)) <= 50
        assert set(ports[50:]) <= set(ports[:50])

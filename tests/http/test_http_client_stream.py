"""The streaming view of the lean HTTP/1.1 client: the handler is handed each piece of the
decoded body as it arrives (not once the answer is whole), with the chunk framing removed.
Real servers on loopback sockets: an aiohttp app for well-formed HTTP, raw asyncio servers
for exact bytes on the wire and for writes that wait on what the client has seen."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from aiohttp import web
from aiohttp_helpers import start_app
from http_client_helpers import CHUNKED_HEAD, TIMEOUTS, Collect, chunk, within

from prfaas.http.client import ClientError, ConnectionPool, HttpCall, post

EVENTS = [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]


def start(pool: ConnectionPool, path: str = "/x", body: bytes = b"{}") -> tuple[HttpCall, Collect]:
    handler = Collect()
    return post(pool, path, body, handler, **TIMEOUTS), handler


# -- servers -----------------------------------------------------------------------------------


@pytest.fixture
async def app() -> AsyncIterator[tuple[ConnectionPool, list[int]]]:
    """A pool to an app whose `/echo` answers the request body (`Content-Length`) and `/sse`
    streams three events (chunked); the list collects the client port of every request (to
    see connection reuse)."""
    ports: list[int] = []

    async def echo(request: web.Request) -> web.Response:
        ports.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        return web.Response(body=await request.read())

    async def sse(request: web.Request) -> web.StreamResponse:
        ports.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in EVENTS:
            await resp.write(event)
            await asyncio.sleep(0.01)
        return resp

    web_app = web.Application()
    web_app.router.add_post("/echo", echo)
    web_app.router.add_post("/sse", sse)
    runner, url = await start_app(web_app)
    pool = ConnectionPool("127.0.0.1", int(url.rsplit(":", 1)[1]))
    yield pool, ports
    pool.close()
    await runner.cleanup()


Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def scripted(script: Script) -> AsyncIterator[tuple[ConnectionPool, list[int]]]:
    """A pool to a loopback server running `script` on each connection; the list grows by
    one per connection accepted."""
    accepted: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(len(accepted))
        try:
            await script(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    pool = ConnectionPool("127.0.0.1", server.sockets[0].getsockname()[1])
    try:
        async with server:
            yield pool, accepted
    finally:
        pool.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    return head + await reader.readexactly(length)


async def until_eof(reader: asyncio.StreamReader) -> None:
    """Until the client closes the connection (a reset counts as closed)."""
    with contextlib.suppress(ConnectionResetError):
        while await reader.read(65536):
            pass


# -- pieces as they arrive ---------------------------------------------------------------------


FRAMINGS = {  # head, each event as written, the end
    "chunked": (b"Transfer-Encoding: chunked\r\n", chunk, b"0\r\n\r\n"),
    "content-length": (b"Content-Length: %d\r\n" % len(b"".join(EVENTS)), bytes, b""),
    "until-close": (b"", bytes, b""),
}


@pytest.mark.parametrize("framing", FRAMINGS)
async def test_each_piece_reaches_the_handler_before_the_server_writes_the_next(
    framing: str,
) -> None:
    """The server writes an event only once the handler has seen the one before (it waits
    on the handler): the call can only complete if each piece is handed over as it
    arrives. Pieces are exactly the events, without framing, in order."""
    head, frame, end = FRAMINGS[framing]
    handler = Collect()
    waits: list[bool] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n" + head + b"\r\n")
        for event in EVENTS:
            handler.got_body.clear()
            writer.write(frame(event))
            waits.append(await within(handler.got_body.wait(), 2))
        writer.write(end)
        await writer.drain()
        if framing != "until-close":  # the client keeps the connection: wait for its close
            await until_eof(reader)

    async with scripted(script) as (pool, _):
        post(pool, "/x", b"{}", handler, **TIMEOUTS)
        assert await handler.outcome() is None
        assert waits == [True, True, True]
        assert handler.heads == [200] and handler.pieces == EVENTS


async def test_sse_stream_then_reuse(app: tuple[ConnectionPool, list[int]]) -> None:
    """A chunked SSE body from aiohttp comes as its events' bytes (no chunk framing), in
    order; read to its end, its connection carries the next call."""
    pool, ports = app
    _, handler = start(pool, "/sse")
    assert await handler.outcome() is None
    assert b"".join(handler.pieces) == b"".join(EVENTS)
    assert len(handler.pieces) >= 2  # written 10 ms apart: not handed over at the end
    _, handler = start(pool, "/echo", b"abc")
    assert await handler.outcome() is None
    assert handler.pieces == [b"abc"] and len(set(ports)) == 1


async def test_large_body_comes_in_pieces_and_the_connection_is_reused(
    app: tuple[ConnectionPool, list[int]],
) -> None:
    """A 1 MB `Content-Length` body spans many reads: several pieces, which join to the
    body; then the connection is pooled and reused."""
    pool, ports = app
    body = bytes(i % 251 for i in range(1 << 20))
    for _ in range(2):
        _, handler = start(pool, "/echo", body)
        assert await handler.outcome() is None
        assert len(handler.pieces) > 1 and b"".join(handler.pieces) == body
    assert len(ports) == 2 and len(set(ports)) == 1


async def test_cancel_mid_stream_drops_the_connection(
    app: tuple[ConnectionPool, list[int]],
) -> None:
    """A stream cancelled after its first piece hears nothing more, and its connection is
    not reused: the next call opens a new one."""
    pool, ports = app
    call, handler = start(pool, "/sse")
    await asyncio.wait_for(handler.got_body.wait(), 5)
    assert call.cancel() is True
    seen = list(handler.pieces)
    await asyncio.sleep(0.1)
    assert handler.pieces == seen and handler.ends == []
    _, handler = start(pool, "/echo", b"")
    assert await handler.outcome() is None
    assert ports[0] != ports[1]


# -- chunk framing, over the socket ------------------------------------------------------------


async def test_chunked_byte_by_byte_with_extensions_and_trailers_then_next_answer() -> None:
    """A chunked answer with extensions and trailers, written one byte at a time, decodes to
    its data; parsing stops exactly at its end: the next answer on the same connection
    (also byte by byte) is read whole and on its own."""
    chunks = b'5;ext=1\r\nhello\r\n1\r\n \r\nB;a="b"\r\nworld again\r\n0\r\nX-T: 1\r\n\r\n'
    answers = [CHUNKED_HEAD + chunks, CHUNKED_HEAD + chunk(b"NEXT") + b"0\r\n\r\n"]

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for wire in answers:
            await read_request(reader)
            for i in range(len(wire)):
                writer.write(wire[i : i + 1])
                await asyncio.sleep(0.001)
        await until_eof(reader)

    async with scripted(script) as (pool, accepted):
        for expected in (b"hello world again", b"NEXT"):
            _, handler = start(pool)
            assert await handler.outcome() is None
            assert handler.heads == [200] and b"".join(handler.pieces) == expected
        assert accepted == [0]


@pytest.mark.parametrize(
    ("chunks", "delivered"),
    [
        (b"zz\r\n", b""),  # not a hex size
        (b"2\r\nabc\r\n", b"ab"),  # more data than the size said
        (b"2\r\nab0\r\n\r\n", b"ab"),  # no CRLF after the data
        (b"2\nab\r\n0\r\n\r\n", b""),  # a bare LF after the size
    ],
)
async def test_bad_chunk_framing_is_client_error(chunks: bytes, delivered: bytes) -> None:
    """Broken chunk framing ends the call with a ClientError at the first bad byte (the
    server keeps the connection open: no timeout, no close needed); only the data framed
    correctly before it was handed over, and the client closes the connection."""
    closed = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD + chunks)
        await until_eof(reader)
        closed.set()

    async with scripted(script) as (pool, _):
        _, handler = start(pool)
        error = await handler.outcome()
        assert isinstance(error, ClientError) and "bad response" in str(error)
        assert handler.heads == [200] and b"".join(handler.pieces) == delivered
        await asyncio.wait_for(closed.wait(), 5)
        assert pool.take_idle() is None

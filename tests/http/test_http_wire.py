"""The lean HTTP/1.1 client of the generate path, against real servers on loopback sockets:
aiohttp apps for well-formed HTTP, raw asyncio servers for exact bytes on the wire."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from prfaas.http.wire import ChunkedDecoder, ConnectFailed, WireError, WirePool

TIMEOUTS = {"connect_s": 2.0, "read_s": 2.0, "total_s": 5.0}
RawHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _serve_app(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


@pytest.fixture
async def echo() -> AsyncIterator[tuple[WirePool, list[int]]]:
    """A pool to an app whose `/len` answers the body length and `/sse` streams 3 events;
    the list collects the client port of every request (to see connection reuse)."""
    ports: list[int] = []

    async def length(request: web.Request) -> web.Response:
        ports.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        return web.Response(body=str(len(await request.read())).encode())

    async def sse(request: web.Request) -> web.StreamResponse:
        ports.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            await resp.write(f"data: {i}\n\n".encode())
            await asyncio.sleep(0.01)
        return resp

    app = web.Application()
    app.router.add_post("/len", length)
    app.router.add_post("/sse", sse)
    runner, port = await _serve_app(app)
    pool = WirePool("127.0.0.1", port)
    yield pool, ports
    pool.close()
    await runner.cleanup()


async def test_content_length_body_and_connection_reuse(
    echo: tuple[WirePool, list[int]],
) -> None:
    """Bodies read to their end return the connection: three calls, one client port."""
    pool, ports = echo
    for size in (0, 5, 100_000):
        resp = await pool.post("/len", b"x" * size, **TIMEOUTS)
        assert resp.status == 200
        assert await resp.read() == str(size).encode()
    assert len(ports) == 3 and len(set(ports)) == 1


async def test_chunked_stream_lines_then_reuse(echo: tuple[WirePool, list[int]]) -> None:
    """A chunked SSE body yields its lines in order; the connection is reused afterwards."""
    pool, ports = echo
    resp = await pool.post("/sse", b"{}", **TIMEOUTS)
    lines = [line async for line in resp.lines()]
    assert lines == [b"data: 0", b"", b"data: 1", b"", b"data: 2", b""]
    resp = await pool.post("/len", b"abc", **TIMEOUTS)
    assert await resp.read() == b"3"
    assert len(set(ports)) == 1


async def test_close_mid_body_drops_the_connection(echo: tuple[WirePool, list[int]]) -> None:
    """A response closed before its end is not reused: the next call opens a new one."""
    pool, ports = echo
    resp = await pool.post("/sse", b"{}", **TIMEOUTS)
    resp.close()
    resp = await pool.post("/len", b"", **TIMEOUTS)
    assert await resp.read() == b"0"
    assert ports[0] != ports[1]


async def test_connection_refused_is_connect_failed() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConnectFailed, match=str(port)):
        await WirePool("127.0.0.1", port).post("/x", b"", **TIMEOUTS)


async def _raw_server(handler: RawHandler) -> tuple[asyncio.Server, WirePool]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, WirePool("127.0.0.1", server.sockets[0].getsockname()[1])


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.startswith(b"Content-Length")
    )
    return head + await reader.readexactly(length)


async def test_read_timeout_raises_and_closes() -> None:
    """A server that never answers: TimeoutError after the read timeout, not a hang."""

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(10)

    server, pool = await _raw_server(silent)
    async with server:
        start = asyncio.get_running_loop().time()
        with pytest.raises(TimeoutError):
            await pool.post("/x", b"{}", connect_s=1, read_s=0.2, total_s=5)
        assert asyncio.get_running_loop().time() - start < 2


async def test_stale_idle_connection_is_retried_once() -> None:
    """The keep-alive race: the server closes a pooled connection just as the next request
    goes out on it (no response byte). That request goes out again on a fresh connection
    instead of failing; a fresh connection that closes the same way is an error."""
    requests: list[bytes] = []
    connections = 0

    async def flaky(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        requests.append(await _read_request(reader))
        if connections < 3:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            if connections == 1:
                requests.append(await _read_request(reader))  # read, then hang up unanswered
        writer.close()

    server, pool = await _raw_server(flaky)
    async with server:
        for _ in range(2):
            resp = await pool.post("/x", b"{}", **TIMEOUTS)
            assert await resp.read() == b"ok"
        assert len(requests) == 3 and connections == 2
        with pytest.raises(WireError, match="before answering"):
            await pool.post("/x", b"{}", **TIMEOUTS)
    assert requests[0].startswith(b"POST /x HTTP/1.1\r\n")
    pool.close()


async def test_body_until_close_no_content_and_bad_heads() -> None:
    """No length and no chunking: the body ends with the connection; a 204 has no body;
    a garbage status line or Content-Length is a WireError."""
    replies = [
        b"HTTP/1.0 200 OK\r\n\r\nall of it",
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"SPAM\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n",
    ]

    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(replies.pop(0))
        await writer.drain()
        writer.close()

    server, pool = await _raw_server(reply)
    async with server:
        resp = await pool.post("/x", b"{}", **TIMEOUTS)
        assert await resp.read() == b"all of it"
        resp = await pool.post("/x", b"{}", **TIMEOUTS)
        assert resp.status == 204 and await resp.read() == b""
        with pytest.raises(WireError, match="status line"):
            await pool.post("/x", b"{}", **TIMEOUTS)
        with pytest.raises(WireError, match="Content-Length"):
            await pool.post("/x", b"{}", **TIMEOUTS)


async def test_interim_1xx_heads_are_skipped_and_idle_bytes_retire_a_connection() -> None:
    """A 100 Continue / 103 before the answer is not the answer; a pooled connection that
    received bytes while idle is not reused (they would be read as the next answer)."""
    connections = 0

    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await _read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstale")  # unasked
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            await _read_request(reader)
        writer.close()

    server, pool = await _raw_server(reply)
    async with server:
        resp = await pool.post("/x", b"{}", **TIMEOUTS)
        assert resp.status == 200 and await resp.read() == b"ok"
        await asyncio.sleep(0.2)  # the unasked answer lands on the idle connection
        resp = await pool.post("/x", b"{}", **TIMEOUTS)
        assert resp.status == 200 and await resp.read() == b"ok"
        assert connections == 2
    pool.close()


def test_chunked_decoder_byte_by_byte_with_extensions_and_trailers() -> None:
    """Fed one byte at a time, the decoder returns the same data and stops exactly at the
    end of the body, leaving the next response's bytes untouched."""
    wire = b"5;ext=1\r\nhello\r\n1\r\n \r\nB\r\nworld again\r\n0\r\nX-T: 1\r\n\r\nNEXT"
    decoder, raw, out = ChunkedDecoder(), bytearray(), bytearray()
    for byte in wire:
        if decoder.done:
            raw.append(byte)
            continue
        raw.append(byte)
        decoder.feed(raw, out)
    assert out == b"hello world again" and decoder.done and raw == b"NEXT"


@pytest.mark.parametrize("wire", [b"zz\r\n", b"2\r\nabc\r\n"])
def test_chunked_decoder_rejects_bad_framing(wire: bytes) -> None:
    with pytest.raises(WireError):
        ChunkedDecoder().feed(bytearray(wire), bytearray())

"""Conformance of the gateway's HTTP/1.1 server (prfaas/gateway/http_server.py), over real
sockets: raw bytes for protocol details, aiohttp's client for ordinary use."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest
from http_server_helpers import (
    CUT_TAIL,
    PIECE,
    SECRET,
    Probe,
    Served,
    ServeFactory,
    read_eof,
    read_response,
    render_error,
    request,
)

from prfaas.http.server import MAX_PIPELINED, HttpLimits, HttpServer

LIMITS = HttpLimits(max_body_bytes=64 * 1024, max_head_bytes=8 * 1024)


@pytest.fixture
async def serve() -> AsyncIterator[ServeFactory]:
    """`await serve(limits)` -> a started server with its own `Probe`; stopped at teardown."""
    started: list[Served] = []

    async def factory(limits: HttpLimits) -> Served:
        probe = Probe()
        server = HttpServer(probe.handle, render_error, limits)
        served = Served(server, probe, await server.start("127.0.0.1", 0))
        started.append(served)
        return served

    yield factory
    for served in started:
        await served.server.stop(grace_s=0.1)


@pytest.fixture
async def served(serve: ServeFactory) -> Served:
    return await serve(LIMITS)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        yield s


# -- requests ---------------------------------------------------------------------------


async def test_get_splits_query_and_lower_cases_header_names(
    served: Served, session: aiohttp.ClientSession
) -> None:
    async with session.get(
        served.url + "/echo/a%20b?x=1&y=two", headers={"X-Mixed-Case": "Value Kept"}
    ) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "application/json"
        got = await resp.json()
        assert int(resp.headers["Content-Length"]) == len(await resp.read())
    assert got["method"] == "GET"
    assert got["path"] == "/echo/a%20b"
    assert got["query"] == "x=1&y=two"
    assert got["headers"]["x-mixed-case"] == "Value Kept"
    assert all(name == name.lower() for name in got["headers"])
    assert got["body"] == ""


async def test_post_body_by_content_length(served: Served, session: aiohttp.ClientSession) -> None:
    body = bytes(range(256)) * 100  # 25.6 KB, every byte value
    async with session.post(served.url + "/echo", data=body) as resp:
        assert resp.status == 200
        got = await resp.json()
    assert got["method"] == "POST"
    assert got["headers"]["content-length"] == str(len(body))
    assert got["body"].encode("latin-1") == body


async def test_repeated_headers_are_joined(served: Served) -> None:
    reader, writer = await served.connect()
    writer.write(b"GET /echo HTTP/1.1\r\nHost: t\r\nX-A: one\r\nx-a: two\r\nX-A: three\r\n\r\n")
    got = (await read_response(reader)).json()
    assert got["headers"]["x-a"] == "one, two, three"
    writer.close()


# -- connection management ----------------------------------------------------------------


async def test_keep_alive_serves_two_requests_on_one_connection(served: Served) -> None:
    reader, writer = await served.connect()
    writer.write(request("GET", "/echo?n=1"))
    first = await read_response(reader)
    writer.write(request("POST", "/echo?n=2", body=b"second"))
    second = await read_response(reader)
    assert (first.status, second.status) == (200, 200)
    assert "connection" not in first.headers
    assert first.json()["query"] == "n=1"
    assert second.json()["body"] == "second"
    assert len(served.server.connections) == 1
    writer.close()


async def test_connection_close_closes_after_the_answer(served: Served) -> None:
    reader, writer = await served.connect()
    writer.write(request("GET", "/echo", {"Connection": "close"}))
    resp = await read_response(reader)
    assert resp.status == 200
    assert resp.headers["connection"] == "close"
    assert await read_eof(reader) == b""
    writer.close()


async def test_http10_without_keep_alive_closes(served: Served) -> None:
    reader, writer = await served.connect()
    writer.write(b"GET /echo HTTP/1.0\r\n\r\n")
    resp = await read_response(reader)
    assert resp.status == 200
    assert resp.json()["http_version"] == "1.0"
    assert resp.headers["connection"] == "close"
    assert await read_eof(reader) == b""
    writer.close()


async def test_pipelined_requests_are_answered_in_order(served: Served) -> None:
    reader, writer = await served.connect()
    writer.write(request("GET", "/slow?s=0.3&tag=first") + request("GET", "/slow?s=0&tag=second"))
    first = await read_response(reader)
    second = await read_response(reader)
    assert first.json() == {"tag": "first"}
    assert second.json() == {"tag": "second"}
    writer.close()


async def test_chunked_request_body_is_decoded(served: Served) -> None:
    reader, writer = await served.connect()
    head = request("POST", "/echo", {"Transfer-Encoding": "chunked"})
    writer.write(head + b"5\r\nhello\r\n")
    await writer.drain()
    await asyncio.sleep(0.05)  # the body arrives in two reads
    writer.write(b"6;ext=1\r\n world\r\n0\r\n\r\n")
    resp = await read_response(reader)
    assert resp.json()["body"] == "hello world"
    writer.close()


async def test_expect_100_continue_before_the_body(served: Served) -> None:
    reader, writer = await served.connect()
    writer.write(
        b"POST /echo HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n"
    )
    interim = await read_response(reader)  # before any body byte was sent
    assert interim.status == 100
    assert interim.body == b""
    writer.write(b"body")
    resp = await read_response(reader)
    assert resp.status == 200
    assert resp.json()["body"] == "body"
    writer.close()


# -- limits and malformed input -------------------------------------------------------------


async def test_declared_body_over_limit_is_413_before_the_body(served: Served) -> None:
    reader, writer = await served.connect()
    too_big = LIMITS.max_body_bytes + 1
    writer.write(f"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: {too_big}\r\n\r\n".encode())
    resp = await read_response(reader)  # no body byte was sent
    assert resp.status == 413
    assert resp.json()["error"]["code"] == 413
    assert resp.headers["connection"] == "close"
    assert await read_eof(reader) == b""
    assert served.probe.calls == []
    writer.close()


async def test_chunked_body_growing_over_limit_is_413(served: Served) -> None:
    reader, writer = await served.connect()
    writer.write(request("POST", "/echo", {"Transfer-Encoding": "chunked"}))
    piece = b"%x\r\n%s\r\n" % (30 * 1024, b"z" * 30 * 1024)
    for _ in range(3):  # 90 KiB against a 64 KiB limit; the server reads every byte sent
        writer.write(piece)
        await writer.drain()
        await asyncio.sleep(0.02)
    resp = await read_response(reader)
    assert resp.status == 413
    assert resp.json()["error"]["code"] == 413
    assert await read_eof(reader) == b""
    assert served.probe.calls == []
    writer.close()


async def test_head_over_limit_is_431(served: Served) -> None:
    reader, writer = await served.connect()
    writer.write(request("GET", "/echo", {"X-Big": "v" * LIMITS.max_head_bytes}))
    resp = await read_response(reader)
    assert resp.status == 431
    assert resp.json()["error"]["code"] == 431
    assert await read_eof(reader) == b""
    assert served.probe.calls == []
    writer.close()


async def test_malformed_request_line_is_400_and_the_server_serves_on(
    served: Served, session: aiohttp.ClientSession
) -> None:
    reader, writer = await served.connect()
    writer.write(b"GET /echo HTTP/1.1 extra\r\nHost: t\r\n\r\n")
    resp = await read_response(reader)
    assert resp.status == 400
    assert resp.headers["content-type"] == "application/json"
    assert resp.json()["error"]["code"] == 400
    assert await read_eof(reader) == b""
    writer.close()
    async with session.get(served.url + "/echo") as ok:
        assert ok.status == 200


async def test_malformed_request_pipelined_after_a_good_one_is_answered_after_it(
    served: Served,
) -> None:
    reader, writer = await served.connect()
    writer.write(request("GET", "/slow?s=0.2&tag=good") + b"NOT HTTP AT ALL\r\n\r\n")
    good = await read_response(reader)
    assert good.status == 200
    assert good.json() == {"tag": "good"}
    bad = await read_response(reader)
    assert bad.status == 400
    assert bad.json()["error"]["code"] == 400
    assert await read_eof(reader) == b""
    writer.close()


# -- responses -----------------------------------------------------------------------------


async def test_head_has_content_length_and_no_body(served: Served) -> None:
    reader, writer = await served.connect()
    writer.write(request("HEAD", "/echo"))
    head = await read_response(reader, head=True)
    assert head.status == 200
    assert int(head.headers["content-length"]) > 0
    # No body bytes follow: the next bytes on the connection are the next status line.
    writer.write(request("GET", "/echo"))
    follow = await read_response(reader)
    assert follow.status == 200
    assert follow.json()["method"] == "GET"
    writer.close()


async def test_streamed_response_is_chunked_in_order(
    served: Served, session: aiohttp.ClientSession
) -> None:
    async with session.get(served.url + "/stream?n=5") as resp:
        assert resp.status == 200
        assert resp.headers["Transfer-Encoding"] == "chunked"
        assert resp.headers["X-Stream"] == "yes"
        body = await resp.read()
    assert body == b"".join(b"piece-%d;" % i for i in range(5))
    # Raw: one chunk per write, and the connection serves on after the last chunk.
    reader, writer = await served.connect()
    writer.write(request("GET", "/stream?n=3"))
    raw = await read_response(reader)
    assert raw.chunks == [b"piece-0;", b"piece-1;", b"piece-2;"]
    writer.write(request("GET", "/echo"))
    assert (await read_response(reader)).status == 200
    writer.close()


async def test_streamed_response_to_http10_ends_with_the_connection(served: Served) -> None:
    reader, writer = await served.connect()
    writer.write(b"GET /stream?n=3 HTTP/1.0\r\n\r\n")
    resp = await read_response(reader)  # no Content-Length, not chunked: read until EOF
    assert "transfer-encoding" not in resp.headers
    assert "content-length" not in resp.headers
    assert resp.headers["connection"] == "close"
    assert resp.body == b"piece-0;piece-1;piece-2;"
    writer.close()


async def test_crlf_in_a_response_header_is_refused_with_500(served: Served) -> None:
    for target in ("/badheader", "/badheader?stream=1", "/badheader?ctype=1"):
        reader, writer = await served.connect()
        writer.write(request("GET", target))
        resp = await read_response(reader)
        assert resp.status == 500, target
        assert "set-cookie" not in resp.headers and "x-injected" not in resp.headers
        assert resp.json()["error"]["code"] == 500
        writer.close()


# -- handler lifecycle ---------------------------------------------------------------------


async def test_client_disconnect_cancels_the_handler(served: Served) -> None:
    _reader, writer = await served.connect()
    writer.write(request("GET", "/sleep?s=30"))
    await asyncio.wait_for(served.probe.sleep_started.wait(), 2)
    writer.close()
    await asyncio.wait_for(served.probe.sleep_cancelled.wait(), 1.0)
    assert not served.probe.sleep_finished.is_set()


async def test_handler_that_raises_gets_500_without_traceback(
    served: Served, session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    reader, writer = await served.connect()
    writer.write(request("GET", "/raise"))
    resp = await read_response(reader)
    assert resp.status == 500
    assert resp.json()["error"]["code"] == 500
    assert SECRET.encode() not in resp.body
    assert b"Traceback" not in resp.body and b"RuntimeError" not in resp.body
    assert SECRET in caplog.text  # logged on the server side instead
    if resp.headers.get("connection") == "close":
        assert await read_eof(reader) == b""
    else:  # the connection stays usable
        writer.write(request("GET", "/echo"))
        assert (await read_response(reader)).status == 200
    writer.close()
    async with session.get(served.url + "/echo") as ok:
        assert ok.status == 200


async def test_idle_keep_alive_connection_is_closed(serve: ServeFactory) -> None:
    served = await serve(HttpLimits(keepalive_timeout_s=0.2))
    reader, writer = await served.connect()
    writer.write(request("GET", "/echo"))
    assert (await read_response(reader)).status == 200
    writer.write(request("GET", "/echo"))  # still open right after an answer
    assert (await read_response(reader)).status == 200
    assert await read_eof(reader, within=2.0) == b""
    assert served.server.connections == set()
    writer.close()


async def test_request_whose_head_never_completes_gets_408(serve: ServeFactory) -> None:
    served = await serve(HttpLimits(request_timeout_s=0.2))
    reader, writer = await served.connect()
    writer.write(b"GET /echo HTTP/1.1\r\nHost: t\r\n")  # no blank line
    resp = await read_response(reader, within=2.0)
    assert resp.status == 408
    assert resp.json()["error"]["code"] == 408
    assert await read_eof(reader) == b""
    assert served.probe.calls == []
    writer.close()


async def test_streaming_to_a_client_that_does_not_read_blocks_in_write(
    served: Served,
) -> None:
    pieces = 128  # 32 MiB: far more than the socket buffers between the two ends hold
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # before connect
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", served.port))
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(request("GET", f"/big?pieces={pieces}"))
    probe = served.probe

    # Wait until the handler's progress stops: it is parked in write().
    last, still = -1, 0
    while still < 5:
        await asyncio.sleep(0.05)
        still = still + 1 if probe.big_written == last else 0
        last = probe.big_written
    assert probe.big_in_write
    assert 0 < probe.big_written < pieces * PIECE
    assert probe.big_max_buffer <= 2 * PIECE  # the transport buffer stays bounded
    assert not probe.big_done.is_set()

    resp = await read_response(reader, within=10)  # reading lets the handler resume
    assert len(resp.body) == pieces * PIECE
    await asyncio.wait_for(probe.big_done.wait(), 2)
    assert probe.big_max_buffer <= 2 * PIECE
    writer.close()


async def test_stop_lets_a_request_in_flight_finish(served: Served) -> None:
    reader, writer = await served.connect()
    writer.write(request("GET", "/sleep?s=0.3"))
    await asyncio.wait_for(served.probe.sleep_started.wait(), 2)
    stopping = asyncio.create_task(served.server.stop(grace_s=3.0))
    await asyncio.sleep(0.05)
    with pytest.raises(OSError):  # no longer accepting
        await served.connect()
    resp = await read_response(reader)
    assert resp.status == 200
    assert resp.json() == {"slept": 0.3}
    assert resp.headers["connection"] == "close"  # answered while stopping: do not reuse
    await asyncio.wait_for(stopping, 2)
    assert not served.probe.sleep_cancelled.is_set()
    assert await read_eof(reader) == b""  # closed once its request was answered
    writer.close()


async def test_stop_answers_a_handler_still_running_after_the_grace_with_503(
    served: Served,
) -> None:
    """A whole response not ready at the deadline: the handler is cancelled and the client
    gets the server's 503 error (not a bare close), then the connection closes."""
    reader, writer = await served.connect()
    writer.write(request("GET", "/sleep?s=30"))
    await asyncio.wait_for(served.probe.sleep_started.wait(), 2)
    await asyncio.wait_for(served.server.stop(grace_s=0.2), 2)
    assert served.probe.sleep_cancelled.is_set()
    resp = await read_response(reader)
    assert resp.status == 503
    assert resp.json()["error"]["code"] == 503
    assert "stopped before the answer" in resp.json()["error"]["message"]
    assert resp.headers["connection"] == "close"
    assert await read_eof(reader) == b""
    assert served.server.connections == set()
    with pytest.raises(OSError):
        await served.connect()
    writer.close()


async def test_stop_ends_a_stream_still_running_after_the_grace_with_its_cut_tail(
    served: Served,
) -> None:
    """A stream still going at the deadline ends with the handler's cut tail right after a
    whole piece, and a proper last chunk: the body is complete, never cut mid-piece."""
    reader, writer = await served.connect()
    writer.write(request("GET", "/stream?n=100000&delay=0.02"))
    await asyncio.sleep(0.2)  # a few pieces out
    await asyncio.wait_for(served.server.stop(grace_s=0.2), 2)
    resp = await read_response(reader)  # chunked framing checked to its last chunk
    assert resp.status == 200
    assert resp.chunks[-1] == CUT_TAIL
    pieces = resp.chunks[:-1]
    assert len(pieces) >= 5
    assert pieces == [b"piece-%d;" % i for i in range(len(pieces))]
    assert await read_eof(reader) == b""
    writer.close()


async def test_a_draining_server_answers_new_requests_on_open_connections_with_503(
    served: Served,
) -> None:
    """While a request runs out its grace: new connections are refused; a new request on
    an idle keep-alive connection gets 503 with `Connection: close` and
    `x-prfaas-not-started: 1` (its handler never runs: a proxy may send it elsewhere) and
    the connection closes; the request in flight still completes, without that header."""
    idle_r, idle_w = await served.connect()
    idle_w.write(request("GET", "/echo/before"))
    assert (await read_response(idle_r)).status == 200  # keep-alive, idle from now on
    busy_r, busy_w = await served.connect()
    busy_w.write(request("GET", "/sleep?s=0.5"))
    await asyncio.wait_for(served.probe.sleep_started.wait(), 2)
    stopping = asyncio.create_task(served.server.stop(grace_s=5.0))
    await asyncio.sleep(0.05)
    with pytest.raises(OSError):
        await served.connect()
    idle_w.write(request("GET", "/echo/during"))
    refused = await read_response(idle_r)
    assert refused.status == 503
    assert refused.headers["connection"] == "close"
    assert refused.headers["x-prfaas-not-started"] == "1"
    assert "shutting down" in refused.json()["error"]["message"]
    assert await read_eof(idle_r) == b""
    assert "/echo/during" not in served.probe.calls
    finished = await read_response(busy_r)
    assert finished.status == 200 and finished.json() == {"slept": 0.5}
    assert "x-prfaas-not-started" not in finished.headers
    await asyncio.wait_for(stopping, 2)
    assert not served.probe.sleep_cancelled.is_set()
    idle_w.close()
    busy_w.close()


async def test_cut_ends_the_drain_at_once(served: Served) -> None:
    """`cut()` (a second signal) ends the wait for running handlers: the one still running
    gets its 503 long before the grace is out."""
    reader, writer = await served.connect()
    writer.write(request("GET", "/sleep?s=30"))
    await asyncio.wait_for(served.probe.sleep_started.wait(), 2)
    stopping = asyncio.create_task(served.server.stop(grace_s=30.0))
    await asyncio.sleep(0.1)
    assert not stopping.done()
    served.server.cut()
    await asyncio.wait_for(stopping, 2)
    assert (await read_response(reader)).status == 503
    writer.close()


async def test_raise_after_starting_a_stream_before_any_write_gets_500(served: Served) -> None:
    """Nothing of the stream went out yet, so the client still gets a proper 500."""
    reader, writer = await served.connect()
    writer.write(request("GET", "/raise-after-start"))
    resp = await read_response(reader)
    assert resp.status == 500 and SECRET.encode() not in resp.body
    writer.close()


async def test_upgrade_request_is_answered_then_closed(served: Served) -> None:
    """An `Upgrade` (h2c) is ignored: plain HTTP/1.1 answer saying `Connection: close`."""
    reader, writer = await served.connect()
    upgrade = {"Connection": "Upgrade, HTTP2-Settings", "Upgrade": "h2c", "HTTP2-Settings": "AA"}
    writer.write(request("GET", "/echo", upgrade))
    resp = await read_response(reader)
    assert resp.status == 200 and resp.headers["connection"] == "close"
    assert await read_eof(reader) == b""
    writer.close()


async def test_no_100_continue_for_a_request_pipelined_behind_another(served: Served) -> None:
    """A 100 for the second request would overtake the first request's answer."""
    reader, writer = await served.connect()
    second = request("POST", "/echo", {"Expect": "100-continue", "Content-Length": "4"})
    writer.write(request("GET", "/slow?s=0.2&tag=first") + second + b"body")
    first = await read_response(reader)
    assert first.status == 200 and first.json() == {"tag": "first"}
    answer = await read_response(reader)
    assert answer.status == 200 and answer.json()["body"] == "body"
    writer.close()


async def test_pipelining_past_the_cap_pauses_reading_and_loses_nothing(served: Served) -> None:
    reader, writer = await served.connect()
    n = MAX_PIPELINED + 8
    rest = b"".join(request("GET", f"/slow?s=0&tag={i}") for i in range(1, n))
    writer.write(request("GET", "/slow?s=0.3&tag=0") + rest)
    await asyncio.sleep(0.15)  # the first handler still sleeps; the rest are queued
    (conn,) = served.server.connections
    assert conn._reading_paused and len(conn._pending) >= MAX_PIPELINED
    tags = [(await read_response(reader)).json()["tag"] for _ in range(n)]
    assert tags == [str(i) for i in range(n)]
    writer.close()


async def test_a_header_line_that_never_ends_is_431_not_buffered(served: Served) -> None:
    """llhttp reports a header only once its line ends; an endless line must still hit the
    head limit (not grow in memory until the request timeout)."""
    reader, writer = await served.connect()
    writer.write(b"GET /echo HTTP/1.1\r\nHost: t\r\nX-Endless: ")
    head = b""
    for _ in range(64):  # 4 KiB at a time, never a line end; the limit here is 8 KiB
        writer.write(b"a" * 4096)
        await writer.drain()
        with contextlib.suppress(TimeoutError):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 0.02)
            break  # answered: stop sending (the server hangs up next)
    assert head.startswith(b"HTTP/1.1 431 ")
    writer.close()


async def test_pipelined_answers_wait_for_a_client_that_does_not_read(served: Served) -> None:
    """Whole answers honour write back-pressure: a client pipelining requests for large
    answers without reading stops getting handlers run (the write buffer stays bounded);
    once it reads, every answer arrives, in order."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.connect(("127.0.0.1", served.port))
    reader, writer = await asyncio.open_connection(sock=sock)
    n = 60
    writer.write(b"".join(request("GET", f"/bigwhole?kb=512&i={i}") for i in range(n)))
    await asyncio.sleep(0.5)
    (conn,) = served.server.connections
    assert conn.transport is not None
    assert conn.transport.get_write_buffer_size() <= 2 * 1024 * 1024
    assert len(served.probe.calls) < n  # the rest wait for the client to read
    for _ in range(n):
        resp = await read_response(reader)
        assert resp.status == 200 and len(resp.body) == 512 * 1024
    writer.close()


async def test_upgrade_request_with_a_body_is_400(served: Served) -> None:
    """llhttp would hand the body to the upgraded protocol: refuse rather than serve the
    request without it."""
    reader, writer = await served.connect()
    upgrade = {"Connection": "Upgrade", "Upgrade": "h2c"}
    writer.write(request("POST", "/echo", upgrade, body=b'{"prompt": "hello"}'))
    resp = await read_response(reader)
    assert resp.status == 400
    writer.close()


async def test_unparsable_request_target_is_400_without_an_error_log(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    reader, writer = await served.connect()
    writer.write(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
    resp = await read_response(reader)
    assert resp.status == 400
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    writer.close()


async def test_http10_keep_alive_is_acknowledged_and_kept(served: Served) -> None:
    reader, writer = await served.connect()
    for _ in range(2):
        writer.write(request("GET", "/echo", {"Connection": "keep-alive"}, version="1.0"))
        resp = await read_response(reader)
        assert resp.status == 200 and resp.headers["connection"] == "keep-alive"
    writer.close()


async def test_client_still_uploading_gets_the_413_not_a_reset(served: Served) -> None:
    """The body goes on arriving after the 413: the server half-closes and drops it, so the
    client finishes sending and then reads the answer (an outright close would reset)."""
    reader, writer = await served.connect()
    piece, pieces = b"x" * (256 * 1024), 64  # 16 MiB against a 64 KiB limit
    writer.write(request("POST", "/echo", {"Content-Length": str(len(piece) * pieces)}))
    for _ in range(pieces):
        writer.write(piece)
        await writer.drain()  # all of it accepted: nothing was reset
    resp = await read_response(reader)
    assert resp.status == 413
    assert await read_eof(reader) == b""
    writer.close()


@pytest.mark.parametrize(
    "head",
    [b"GET /echo HTTP/1.1\r\n\r\n", b"GET /echo HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"],
    ids=["no-host", "two-hosts"],
)
async def test_http11_needs_exactly_one_host(served: Served, head: bytes) -> None:
    """RFC 9112 3.2: an HTTP/1.1 request without a Host header, or with two, is a 400 (the
    handler never runs); HTTP/1.0 may omit it."""
    reader, writer = await served.connect()
    writer.write(head)
    resp = await read_response(reader)
    assert resp.status == 400 and "Host" in resp.json()["error"]["message"]
    assert await read_eof(reader) == b""
    writer.close()
    assert served.probe.calls == []
    reader, writer = await served.connect()
    writer.write(b"GET /echo HTTP/1.0\r\n\r\n")
    assert (await read_response(reader)).status == 200
    writer.close()

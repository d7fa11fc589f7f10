"""Helpers for test_http_server.py: a probe handler for `HttpServer` and a raw HTTP/1.1
response reader that checks framing byte by byte."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from prfaas.http.messages import Exchange, HttpRequest, HttpResponse
from prfaas.http.server import HttpLimits, HttpServer


def render_error(status: int, message: str, path: str = "") -> HttpResponse:
    """The test server's `error_response`: `{"error": {"message", "code"}}` JSON."""
    body = json.dumps({"error": {"message": message, "code": status}}).encode()
    return HttpResponse(status=status, body=body)


PIECE = 256 * 1024
"""Bytes per write of the /big route."""

CUT_TAIL = b"cut-by-the-server;"
"""The /stream route's last words when the server ends it (a drain's deadline)."""

SECRET = "secret-detail-in-the-exception"
"""The message of /raise's exception: must never reach the client."""


@dataclass
class Probe:
    """The test handler: routes by path, and records what its handlers saw."""

    calls: list[str] = field(default_factory=list)
    sleep_started: asyncio.Event = field(default_factory=asyncio.Event)
    sleep_cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    sleep_finished: asyncio.Event = field(default_factory=asyncio.Event)
    big_written: int = 0
    """Bytes of body the /big handler has handed to `write` and seen return."""
    big_in_write: bool = False
    big_max_buffer: int = 0
    """The largest transport write-buffer size seen after a /big write returned."""
    big_done: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: HttpRequest, exchange: Exchange) -> HttpResponse | None:
        self.calls.append(request.path)
        args = {k: v[0] for k, v in parse_qs(request.query).items()}
        if request.path.startswith("/echo"):
            return _json(
                {
                    "method": request.method,
                    "path": request.path,
                    "query": request.query,
                    "headers": dict(request.headers),
                    "body": request.body.decode("latin-1"),
                    "http_version": request.http_version,
                }
            )
        if request.path == "/slow":
            await asyncio.sleep(float(args["s"]))
            return _json({"tag": args["tag"]})
        if request.path == "/stream":  # its cut tail is `CUT_TAIL`
            headers = {"X-Stream": "yes"}
            stream = exchange.start_stream(200, headers, "text/plain", cut_tail=CUT_TAIL)
            for i in range(int(args["n"])):
                await stream.write(b"piece-%d;" % i)
                await asyncio.sleep(float(args.get("delay", 0.01)))
            await stream.end()
            return None
        if request.path == "/sleep":
            self.sleep_started.set()
            try:
                await asyncio.sleep(float(args["s"]))
            except asyncio.CancelledError:
                self.sleep_cancelled.set()
                raise
            self.sleep_finished.set()
            return _json({"slept": float(args["s"])})
        if request.path == "/raise":
            raise RuntimeError(SECRET)
        if request.path == "/raise-after-start":  # a stream begun, nothing written yet
            exchange.start_stream(200, {}, "text/plain")
            raise RuntimeError(SECRET)
        if request.path == "/badheader":
            headers = {"X-Injected": "a\r\nSet-Cookie: evil=1"}
            if "stream" in args:
                stream = exchange.start_stream(200, headers)
                await stream.write(b"never")
                await stream.end()
                return None
            if "ctype" in args:
                return HttpResponse(body=b"{}", content_type="text/plain\r\nSet-Cookie: evil=1")
            return HttpResponse(body=b"{}", headers=headers)
        if request.path == "/bigwhole":  # a whole (not streamed) answer of `kb` KiB
            return HttpResponse(body=b"w" * (1024 * int(args["kb"])))
        if request.path == "/big":
            await self._big(exchange, int(args["pieces"]))
            return None
        return render_error(404, "no such route")

    async def _big(self, exchange: Exchange, pieces: int) -> None:
        stream = exchange.start_stream(200, {}, "application/octet-stream")
        transport = exchange.conn.transport
        assert transport is not None
        data = b"x" * PIECE
        for _ in range(pieces):
            self.big_in_write = True
            await stream.write(data)
            self.big_in_write = False
            self.big_written += len(data)
            self.big_max_buffer = max(self.big_max_buffer, transport.get_write_buffer_size())
        await stream.end()
        self.big_done.set()


def _json(obj: object) -> HttpResponse:
    return HttpResponse(body=json.dumps(obj).encode())


@dataclass
class RawResponse:
    """One response as read off the wire. Header names lower case, repeats joined."""

    status: int
    headers: dict[str, str]
    body: bytes
    chunks: list[bytes]
    """The chunk payloads when the body was chunked (empty otherwise)."""

    def json(self) -> dict[str, Any]:
        obj = json.loads(self.body)
        assert isinstance(obj, dict)
        return obj


async def read_response(
    reader: asyncio.StreamReader, *, head: bool = False, within: float = 5.0
) -> RawResponse:
    """Read one response; the body by Content-Length, chunked framing, or until EOF.

    `head`: the request was HEAD (no body whatever the headers say). Raises EOFError when
    the connection closes before a status line."""
    return await asyncio.wait_for(_read_response(reader, head), within)


async def _read_response(reader: asyncio.StreamReader, head: bool) -> RawResponse:
    line = await reader.readline()
    if not line:
        raise EOFError("connection closed before a response")
    assert line.endswith(b"\r\n"), line
    version, status, _reason = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
    assert version == "HTTP/1.1", line
    headers: dict[str, str] = {}
    while (line := await reader.readline()) != b"\r\n":
        assert line.endswith(b"\r\n"), line
        name, value = line.decode("latin-1").rstrip("\r\n").split(":", 1)
        key = name.strip().lower()
        value = value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    code = int(status)
    chunks: list[bytes] = []
    if head or code < 200 or code in (204, 304):
        body = b""
    elif headers.get("transfer-encoding") == "chunked":
        while True:
            size = int((await reader.readline()).rstrip(b"\r\n"), 16)
            data = await reader.readexactly(size + 2)
            assert data.endswith(b"\r\n")
            if size == 0:
                break
            chunks.append(data[:-2])
        body = b"".join(chunks)
    elif "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    else:
        body = await reader.read()
    return RawResponse(code, headers, body, chunks)


async def read_eof(reader: asyncio.StreamReader, within: float = 2.0) -> bytes:
    """What arrives before the server closes the connection (fails after `within` seconds)."""
    try:
        return await asyncio.wait_for(reader.read(), within)
    except ConnectionResetError:
        return b""


def request(
    method: str,
    target: str,
    headers: dict[str, str] | None = None,
    body: bytes = b"",
    version: str = "1.1",
) -> bytes:
    """A request's bytes; `Host` always, `Content-Length` when there is a body."""
    lines = [f"{method} {target} HTTP/{version}", "Host: test"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body and not any(k.lower() == "transfer-encoding" for k in headers or {}):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


@dataclass
class Served:
    """A started test server and its probe."""

    server: HttpServer
    probe: Probe
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)


ServeFactory = Callable[[HttpLimits], Awaitable[Served]]

"""HTTP/1.1 messages as the gateway's server (`server.py`) handles them: a request, a whole
response, and the wire bytes of a response to one request (`Exchange`: whole, or streamed
with chunked encoding and write back-pressure; `HEAD` without a body). The connection
(parsing, pipelining, keep-alive, drain) is the server's."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus
from typing import Protocol


class Connection(Protocol):
    """Where a response's bytes go: the server's connection to one client."""

    def send(self, data: bytes) -> None: ...

    async def drain(self) -> None:
        """Wait while the client reads slower than we write."""


class HttpRequest:
    """One complete request. Header names are lower case; repeated headers are joined
    with ", ". Read-only by convention (a plain slotted class: built once per request on
    the hot path, where a frozen dataclass's `__init__` costs several times more)."""

    __slots__ = ("_headers", "_raw_headers", "body", "http_version", "method", "path", "query")

    def __init__(
        self,
        method: str,
        path: str,
        query: str,
        headers: Mapping[str, str],
        body: bytes,
        http_version: str = "1.1",
    ) -> None:
        self.method, self.path, self.query = method, path, query
        self.body, self.http_version = body, http_version
        self._headers: Mapping[str, str] | None = headers
        self._raw_headers: list[tuple[bytes, bytes]] = []

    @classmethod
    def from_wire(
        cls,
        method: str,
        path: str,
        query: str,
        raw_headers: list[tuple[bytes, bytes]],
        body: bytes,
        http_version: str,
    ) -> HttpRequest:
        """A request as the parser saw it: headers decoded on first use."""
        request = cls(method, path, query, {}, body, http_version)
        request._headers, request._raw_headers = None, raw_headers
        return request

    @property
    def headers(self) -> Mapping[str, str]:
        """The headers, decoded (latin-1) on first use. Values without the whitespace
        around them (RFC 9110 5.5; llhttp drops only the leading whitespace)."""
        if self._headers is None:
            headers: dict[str, str] = {}
            for name, value in self._raw_headers:
                key, text = name.decode("latin-1").lower(), value.decode("latin-1").strip(" \t")
                headers[key] = f"{headers[key]}, {text}" if key in headers else text
            self._headers = headers
        return self._headers

    def __repr__(self) -> str:
        return f"HttpRequest({self.method} {self.path}?{self.query} HTTP/{self.http_version})"


@dataclass
class HttpResponse:
    """A whole response. `Content-Length`, `Date` and `Connection` are the server's."""

    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: Mapping[str, str] = field(default_factory=dict)


_REASONS = {s.value: s.phrase for s in HTTPStatus}
_REASONS[499] = "Client Closed Request"
_FORBIDDEN_HEADERS = frozenset(("content-length", "transfer-encoding", "connection", "date"))


class _DateCache:
    """The `Date` header value, formatted at most once a second."""

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def get(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second, self._value = now, formatdate(now, usegmt=True).encode()
        return self._value


_DATE = _DateCache()


def _head(status: int, content_type: str | None, headers: Mapping[str, str]) -> list[bytes]:
    """Status line and headers (each line with its CRLF), without the framing headers."""
    lines = [
        b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, "Unknown").encode()),
        b"Date: " + _DATE.get() + b"\r\n",
    ]
    if content_type is not None:
        if "\r" in content_type or "\n" in content_type:
            raise ValueError("the content type contains a line break")
        lines.append(b"Content-Type: " + content_type.encode("latin-1") + b"\r\n")
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} contains a line break")
        if name.lower() in _FORBIDDEN_HEADERS:
            raise ValueError(f"header {name!r} is set by the server")
        lines.append(f"{name}: {value}\r\n".encode("latin-1"))
    return lines


COALESCE_BYTES = 64 * 1024
"""Pieces a turn of the loop holds back to send together at most (a larger one goes out at
once, so that a client reading slower than we write holds the writer back)."""


class StreamWriter(Protocol):
    """Where a streamed body's pieces go (`ResponseStream`, or a stand-in that keeps them)."""

    async def write(self, data: bytes) -> None: ...

    async def end(self) -> None: ...


class StreamTarget(Protocol):
    """What a handler starts a streamed body on (`Exchange`, or a stand-in that keeps it:
    a streamed background response's event log)."""

    def start_stream(
        self,
        status: int,
        headers: Mapping[str, str],
        content_type: str | None = None,
        *,
        cut_tail: bytes = b"",
    ) -> StreamWriter: ...


class ResponseStream:
    """A response body sent piece by piece (chunked, or until close for HTTP/1.0). The pieces
    written in one turn of the event loop (a relay handing on the several events one read
    from an engine brought) go out in one send at the end of that turn."""

    def __init__(self, exchange: Exchange, head: bytes, cut_tail: bytes = b"") -> None:
        self._exchange = exchange
        self._head: bytes | None = head  # sent with the first piece (one write)
        self._chunked = exchange.request.http_version != "1.0"
        self._no_body = exchange.request.method == "HEAD"
        self._cut_tail = cut_tail
        self._unsent: list[bytes] = []  # pieces written in this turn of the loop
        self._unsent_bytes = 0
        self.ended = False

    async def write(self, data: bytes) -> None:
        """Send one piece (with the others written in this turn of the loop); waits while
        the client reads slower than we write.

        Raises:
            ConnectionResetError: the client has gone away.
        """
        if self.ended:
            raise RuntimeError("write after end()")
        if not data and self._head is None:
            return
        out = self._take_head()
        if data and not self._no_body:
            out += b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data
        if not self._unsent:
            asyncio.get_running_loop().call_soon(self._send_unsent)
        self._unsent.append(out)
        self._unsent_bytes += len(out)
        if self._unsent_bytes >= COALESCE_BYTES:  # large: out now, so back-pressure holds
            self._send_unsent()
        await self._exchange.conn.drain()

    def _send_unsent(self) -> None:
        """Send the pieces written since the last send, in one write (a client that left
        is seen by the writer's next `write`)."""
        if self._unsent:
            with contextlib.suppress(ConnectionError):
                self._exchange.conn.send(self._take_unsent())

    def _take_unsent(self) -> bytes:
        out = b"".join(self._unsent)
        self._unsent.clear()
        self._unsent_bytes = 0
        return out

    async def end(self) -> None:
        """Finish the body (the last chunk); the connection then serves its next request."""
        if self.ended:
            return
        self.ended = True
        out = self._take_unsent() + self._take_head()
        if self._chunked and not self._no_body:
            out += b"0\r\n\r\n"
        if out:
            self._exchange.conn.send(out)

    def cut(self) -> None:
        """End the body early for the server (its handler was cancelled by a drain's
        deadline): the stream's `cut_tail`, then the body's end. Each `write` is one whole
        piece, so the tail follows a complete one."""
        if self.ended:
            return
        self.ended = True
        out = self._take_unsent() + self._take_head()
        if self._cut_tail and not self._no_body:
            tail = self._cut_tail
            out += b"%x\r\n%s\r\n" % (len(tail), tail) if self._chunked else tail
        if self._chunked and not self._no_body:
            out += b"0\r\n\r\n"
        self._exchange.conn.send(out)

    @property
    def started(self) -> bool:
        """Whether any byte of the response (its head) has gone out."""
        return self._head is None

    def _take_head(self) -> bytes:
        head, self._head = self._head, None
        return head or b""


class Exchange:
    """One request's side of the connection: where a handler starts a streamed response."""

    def __init__(self, conn: Connection, request: HttpRequest, keep_alive: bool) -> None:
        self.conn = conn
        self.request = request
        self.keep_alive = keep_alive
        self.stream: ResponseStream | None = None

    def start_stream(
        self,
        status: int,
        headers: Mapping[str, str],
        content_type: str | None = None,
        *,
        cut_tail: bytes = b"",
    ) -> ResponseStream:
        """Begin a streamed response (its head goes out with the first write). `cut_tail`:
        what the server writes last if it must end the stream before the handler does (a
        drain's deadline), so the client learns why the body stopped."""
        if self.stream is not None:
            raise RuntimeError("the response has already started")
        lines = _head(status, content_type, headers)
        if self.request.http_version == "1.0":
            self.keep_alive = False  # an HTTP/1.0 body ends with the connection
        else:
            lines.append(b"Transfer-Encoding: chunked\r\n")
        if not self.keep_alive:
            lines.append(b"Connection: close\r\n")
        lines.append(b"\r\n")
        self.stream = ResponseStream(self, b"".join(lines), cut_tail)
        return self.stream

    def whole(self, resp: HttpResponse) -> bytes:
        """The bytes of a whole response to this request."""
        lines = _head(resp.status, resp.content_type, resp.headers)
        lines.append(b"Content-Length: %d\r\n" % len(resp.body))
        if not self.keep_alive:
            lines.append(b"Connection: close\r\n")
        elif self.request.http_version == "1.0":
            lines.append(b"Connection: keep-alive\r\n")  # HTTP/1.0 closes unless told
        lines.append(b"\r\n")
        if self.request.method != "HEAD":
            lines.append(resp.body)
        return b"".join(lines)

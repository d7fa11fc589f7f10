"""Fuzzing the request parsing of the gateway's HTTP/1.1 server (prfaas/http/server.py) with
hypothesis, over real loopback sockets: malformed Content-Length and chunk sizes, requests
split into reads at every byte boundary, duplicate and conflicting framing headers, and
request-smuggling shapes. Every bad request must get one clean 4xx (501 for a transfer
coding we cannot decode) with the OpenAI JSON error body, then the connection closes: never
a hang, a 500, a logged error, or a request smuggled through to the handler."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import pytest
from http_server_helpers import RawResponse, read_eof, read_response
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from prfaas.gateway.api.app import server_error
from prfaas.http.messages import Exchange, HttpRequest, HttpResponse
from prfaas.http.server import HttpLimits, HttpServer

LIMITS = HttpLimits(max_body_bytes=64 * 1024, max_head_bytes=8 * 1024, request_timeout_s=5.0)
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: t\r\n\r\n"
"""Sent right after every bad request: the handler must never see it."""
T = TypeVar("T")


@dataclass
class Fuzzed:
    """A server started for one example, and what its handler and logger saw."""

    port: int
    calls: list[str] = field(default_factory=list)

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)

    async def echo(self, request: HttpRequest, exchange: Exchange) -> HttpResponse:
        self.calls.append(request.path)
        echoed = {
            "method": request.method,
            "path": request.path,
            "query": request.query,
            "headers": dict(request.headers),
            "body": request.body.decode("latin-1"),
        }
        return HttpResponse(body=json.dumps(echoed).encode())


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _logged_warnings() -> Iterator[list[logging.LogRecord]]:
    handler = _Records()
    logger = logging.getLogger("prfaas.http.server")
    logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)


def run(scenario: Callable[[Fuzzed], Awaitable[T]]) -> T:
    """Run `scenario` against a fresh server with the gateway's error renderer; fails if the
    server logged a warning or an error (a callback that crashed, a handler that raised)."""

    async def main() -> T:
        with _logged_warnings() as logged:
            fuzzed = Fuzzed(0)
            server = HttpServer(fuzzed.echo, server_error, LIMITS)
            fuzzed.port = await server.start("127.0.0.1", 0)
            try:
                result = await scenario(fuzzed)
            finally:
                await server.stop(grace_s=0.1)
        assert [r.getMessage() for r in logged] == []
        return result

    return asyncio.run(main())


def assert_error(resp: RawResponse, status: int) -> None:
    """`status` with the OpenAI error object and `Connection: close`."""
    assert resp.status == status, resp.body
    assert resp.headers["content-type"] == "application/json"
    assert resp.headers["connection"] == "close"
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]


async def refused(fuzzed: Fuzzed, data: bytes) -> RawResponse:
    """Send `data` then a request to /smuggled in one write; the single answer, after
    which the server must close without having served anything."""
    reader, writer = await fuzzed.connect()
    writer.write(data + SMUGGLED)
    try:
        resp = await read_response(reader)
        assert await read_eof(reader) == b""
    finally:
        writer.close()
    assert fuzzed.calls == []
    return resp


def post(headers: list[tuple[str, str]], body: bytes, version: str = "1.1") -> bytes:
    head = f"POST /echo HTTP/{version}\r\nHost: t\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers)
    return (head + "\r\n").encode("latin-1") + body


# -- Content-Length --------------------------------------------------------------------------

BAD_LENGTHS = ["-1", "0x5", "+5", "1_0", "", " ", "5 5", "5,5", "5,6", "5;", "1e1", "0x",
               "99999999999999999999999", "18446744073709551616"]  # fmt: skip
"""Not one decimal number, or past what 64 bits hold."""


@FUZZ
@given(
    st.one_of(
        st.sampled_from(BAD_LENGTHS),
        st.text("0123456789abcdefxX+-_ ,.;\t", max_size=12).filter(
            lambda v: not v.strip(" \t").isdigit()
        ),
    )
)
def test_malformed_content_length_is_400(length: str) -> None:
    """A Content-Length that is not one decimal number (OWS aside) never frames a body."""

    async def scenario(fuzzed: Fuzzed) -> None:
        assert_error(await refused(fuzzed, post([("Content-Length", length)], b"hello")), 400)

    run(scenario)


@pytest.mark.parametrize("length", [LIMITS.max_body_bytes + 1, 2**64 - 1])
def test_content_length_over_the_limit_is_413_at_once(length: int) -> None:
    async def scenario(fuzzed: Fuzzed) -> None:
        resp = await refused(fuzzed, post([("Content-Length", str(length))], b""))
        assert_error(resp, 413)

    run(scenario)


@FUZZ
@given(st.integers(0, 200), st.sampled_from(["", " ", "  ", "\t", " \t"]))
def test_a_valid_content_length_with_any_whitespace_frames_the_body(n: int, ows: str) -> None:
    """The exact body, and the bytes after it are the next request (served, not swallowed)."""
    body = bytes(range(n))

    async def scenario(fuzzed: Fuzzed) -> None:
        reader, writer = await fuzzed.connect()
        writer.write(post([("Content-Length", f"{ows}{n}{ows}")], body) + SMUGGLED)
        first, second = await read_response(reader), await read_response(reader)
        writer.close()
        assert first.json()["body"].encode("latin-1") == body
        assert second.json()["path"] == "/smuggled"  # here a legitimate second request
        assert fuzzed.calls == ["/echo", "/smuggled"]

    run(scenario)


# -- chunk sizes -------------------------------------------------------------------------

BAD_CHUNK_SIZES = ["-1", "0x5", "+5", "1_0", "", " 5", "5 ", "5\t", " ", "5,", "g", "0x",
                   "fffffffffffffffff", "10000000000000000"]  # fmt: skip
"""Not hexadecimal, or past 64 bits."""


def _chunked(size: str, data: bytes) -> bytes:
    """One chunk (`size` as sent, then `data`) and the last chunk."""
    body = f"{size}\r\n".encode() + data + b"\r\n0\r\n\r\n"
    return post([("Transfer-Encoding", "chunked")], body)


@FUZZ
@given(
    st.one_of(
        st.sampled_from(BAD_CHUNK_SIZES),
        st.text("0123456789abcdefABCDEFxX+-_ ,.\t", max_size=10).filter(
            lambda v: re.fullmatch(r"[0-9a-fA-F]+", v) is None
        ),
    )
)
def test_malformed_chunk_size_is_400(size: str) -> None:
    async def scenario(fuzzed: Fuzzed) -> None:
        assert_error(await refused(fuzzed, _chunked(size, b"hello")), 400)

    run(scenario)


@FUZZ
@given(
    st.binary(min_size=1, max_size=300),
    st.sampled_from(["%x", "%X", "%04x", "%x;ext=1", "%x;a;b=c"]),
)
def test_a_valid_chunk_size_frames_exactly_its_bytes(data: bytes, form: str) -> None:
    async def scenario(fuzzed: Fuzzed) -> None:
        reader, writer = await fuzzed.connect()
        writer.write(_chunked(form % len(data), data) + SMUGGLED)
        first, second = await read_response(reader), await read_response(reader)
        writer.close()
        assert first.json()["body"].encode("latin-1") == data
        assert second.json()["path"] == "/smuggled"

    run(scenario)


@pytest.mark.parametrize("size", [f"{LIMITS.max_body_bytes + 1:x}", "ffffffffffffffff"])
def test_a_chunk_declared_past_the_limit_is_413_once_the_limit_is_passed(size: str) -> None:
    """llhttp does not tell the size of a chunk, so the limit is applied to the bytes as
    they arrive (as for a body growing chunk by chunk); the answer does not wait for the
    request timeout."""

    async def scenario(fuzzed: Fuzzed) -> None:
        reader, writer = await fuzzed.connect()
        writer.write(post([("Transfer-Encoding", "chunked")], f"{size}\r\n".encode()))
        writer.write(b"z" * (LIMITS.max_body_bytes + 1))
        resp = await read_response(reader, within=LIMITS.request_timeout_s / 2)
        assert await read_eof(reader) == b""
        writer.close()
        assert_error(resp, 413)
        assert fuzzed.calls == []

    run(scenario)


# -- reads split anywhere -------------------------------------------------------------------

CHUNKED_BODY = b"3;x=y\r\nabc\r\n2\r\nde\r\n0\r\nX-T: 1\r\n\r\n"
PIPELINE = [
    (b"GET /echo?n=1 HTTP/1.1\r\nHost: t\r\nX-A: one\r\n\r\n", False),
    (post([("Content-Length", "5")], b"hello"), False),
    (post([("Transfer-Encoding", "chunked")], CHUNKED_BODY), False),
    (b"HEAD /echo?n=4 HTTP/1.1\r\nHost: t\r\n\r\n", True),
    (b"GET /echo?n=5 HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n", False),
]  # fmt: skip
"""Requests of every framing, sent back to back; the last one closes the connection."""
SEQUENCE = b"".join(data for data, _ in PIPELINE)


async def _answers(fuzzed: Fuzzed, cuts: list[int]) -> list[tuple[int, bytes]]:
    """SEQUENCE written in pieces cut at `cuts` (the server reads each piece on its own):
    each answer's status and body, after checking the connection then closes."""
    reader, writer = await fuzzed.connect()
    bounds = [0, *sorted(set(cuts)), len(SEQUENCE)]
    for start, end in itertools.pairwise(bounds):
        writer.write(SEQUENCE[start:end])
        await writer.drain()
        await asyncio.sleep(0.001)  # let the server read this piece alone
    answers = []
    for _, head in PIPELINE:
        resp = await read_response(reader, head=head)
        answers.append((resp.status, resp.body))
    assert await read_eof(reader) == b""
    writer.close()
    return answers


def _whole_answers() -> list[tuple[int, bytes]]:
    async def scenario(fuzzed: Fuzzed) -> list[tuple[int, bytes]]:
        answers = await _answers(fuzzed, [])
        assert fuzzed.calls == ["/echo"] * len(PIPELINE)
        return answers

    answers = run(scenario)
    assert [json.loads(body)["body"] for _, body in answers if body] == ["", "hello", "abcde", ""]
    return answers


def test_a_pipelined_sequence_split_at_every_byte_gives_the_same_answers() -> None:
    """One cut at each boundary, and every byte read on its own."""
    expected = _whole_answers()

    async def scenario(fuzzed: Fuzzed) -> None:
        for cut in range(1, len(SEQUENCE)):
            assert await _answers(fuzzed, [cut]) == expected, cut
        assert await _answers(fuzzed, list(range(1, len(SEQUENCE)))) == expected

    run(scenario)


@FUZZ
@given(st.lists(st.integers(1, len(SEQUENCE) - 1), max_size=12))
def test_a_pipelined_sequence_split_anywhere_gives_the_same_answers(cuts: list[int]) -> None:
    expected = _whole_answers()

    async def scenario(fuzzed: Fuzzed) -> None:
        assert await _answers(fuzzed, cuts) == expected

    run(scenario)


# -- framing headers ------------------------------------------------------------------------

CODINGS = ["chunked", "Chunked", "CHUNKED", "gzip", "deflate", "compress", "identity", "x-y"]


@FUZZ
@given(
    st.lists(st.sampled_from(CODINGS), min_size=1, max_size=3),
    st.booleans(),
    st.sampled_from([None, "before", "after"]),
)
def test_transfer_encoding_other_than_chunked_alone_is_refused(
    codings: list[str], split: bool, length: str | None
) -> None:
    """Only `chunked` alone frames a body: another last coding, or chunked twice, leaves
    the length unknown (400), other codings before chunked cannot be decoded (501), and a
    Content-Length beside it is a smuggling shape (400). Codings may come in one header or
    one header each."""
    body = b"5\r\nhello\r\n0\r\n\r\n"
    headers = [("Transfer-Encoding", c) for c in codings] if split else [
        ("Transfer-Encoding", ", ".join(codings))]  # fmt: skip
    if length is not None:
        cl = ("Content-Length", str(len(body)))
        headers = [cl, *headers] if length == "before" else [*headers, cl]
    names = [c.lower() for c in codings]

    async def scenario(fuzzed: Fuzzed) -> None:
        if length is None and names == ["chunked"]:
            reader, writer = await fuzzed.connect()
            writer.write(post(headers, body))
            assert (await read_response(reader)).json()["body"] == "hello"
            writer.close()
            return
        resp = await refused(fuzzed, post(headers, body))
        unknown_length = names[-1] != "chunked" or "chunked" in names[:-1]
        assert_error(resp, 400 if length is not None or unknown_length else 501)

    run(scenario)


@pytest.mark.parametrize(
    "headers",
    [
        [("Content-Length", "5"), ("Content-Length", "6")],
        [("Content-Length", "5"), ("Content-Length", "5")],
        [("Content-Length", "5, 6")],
        [("Transfer-Encoding", "chunked"), ("Transfer-Encoding", "chunked")],
        [("Transfer-Encoding", "")],
        [("Transfer-Encoding", ",")],
    ],
    ids=[
        "two-lengths",
        "same-length-twice",
        "length-list",
        "chunked-twice",
        "empty-te",
        "comma-te",
    ],
)
def test_duplicate_framing_headers_are_400(headers: list[tuple[str, str]]) -> None:
    async def scenario(fuzzed: Fuzzed) -> None:
        assert_error(await refused(fuzzed, post(headers, b"5\r\nhello\r\n0\r\n\r\n")), 400)

    run(scenario)


def test_transfer_encoding_in_http10_is_400() -> None:
    """RFC 9112 6.1: its framing is faulty, even where it would parse."""

    async def scenario(fuzzed: Fuzzed) -> None:
        data = post([("Transfer-Encoding", "chunked"), ("Connection", "keep-alive")],
                    b"5\r\nhello\r\n0\r\n\r\n", version="1.0")  # fmt: skip
        assert_error(await refused(fuzzed, data), 400)

    run(scenario)


# -- smuggling shapes ------------------------------------------------------------------------

SMUGGLING = {
    "CL.TE": b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 6\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nG",
    "TE.CL": b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n"
    b"Content-Length: 3\r\n\r\n8\r\nSMUGGLED\r\n0\r\n\r\n",
    "TE obs-fold": b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip\r\n"
    b" , chunked\r\n\r\n0\r\n\r\n",
    "TE space before colon": b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding : chunked"
    b"\r\nContent-Length: 3\r\n\r\n0\r\n\r\n",
    "TE vertical tab": b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding:\x0bchunked\r\n"
    b"\r\n0\r\n\r\n",
    "TE NUL": b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\x00\r\n\r\n0\r\n\r\n",
    "obs-fold": b"GET /echo HTTP/1.1\r\nHost: t\r\nX-A: one\r\n two\r\n\r\n",
    "header line starts with space": b"GET /echo HTTP/1.1\r\n Host: t\r\n\r\n",
    "bare LF request line": b"GET /echo HTTP/1.1\nHost: t\r\n\r\n",
    "bare LF headers": b"GET /echo HTTP/1.1\r\nHost: t\nX-A: 1\n\n",
    "bare LF after chunk size": b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked"
    b"\r\n\r\n5\nhello\r\n0\r\n\r\n",
    "bare CR in a header": b"GET /echo HTTP/1.1\r\nHost: t\rX-A: 1\r\n\r\n",
    "NUL in a header value": b"GET /echo HTTP/1.1\r\nHost: t\r\nX-A: a\x00b\r\n\r\n",
    "NUL in a header name": b"GET /echo HTTP/1.1\r\nHost: t\r\nX-\x00A: ab\r\n\r\n",
    "chunk data longer than its size": b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: "
    b"chunked\r\n\r\n3\r\nabcdef\r\n0\r\n\r\n",
}


@pytest.mark.parametrize("data", SMUGGLING.values(), ids=SMUGGLING.keys())
def test_smuggling_shapes_are_400_and_nothing_gets_through(data: bytes) -> None:
    async def scenario(fuzzed: Fuzzed) -> None:
        assert_error(await refused(fuzzed, data), 400)

    run(scenario)


TCHAR = b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
FIELD_VCHAR = bytes(range(0x21, 0x7F)) + bytes(range(0x80, 0x100))
VALUE_BYTES = FIELD_VCHAR + b" \t"
HEADER_BYTES = (
    st.binary(max_size=12)
    | st.lists(
        st.sampled_from([b"\r", b"\n", b"\x00", b"\t", b" ", b"\x7f", b":", b"a", b"\xe9"]),
        max_size=6,
    ).map(b"".join)
).filter(lambda b: b"\r\n" not in b)
"""Bytes for a header's name or value; no CRLF (that would only make other lines)."""
NAMES = st.one_of(
    st.text(TCHAR.decode(), max_size=8).map(str.encode),
    HEADER_BYTES.filter(lambda b: b":" not in b),  # a colon would end the name
).map(lambda b: b"X-" + b)
VALUES = st.one_of(
    st.binary(max_size=12).map(lambda b: bytes(VALUE_BYTES[c % len(VALUE_BYTES)] for c in b)),
    HEADER_BYTES,
)


@FUZZ
@given(NAMES, VALUES)
def test_any_bytes_in_a_header_are_served_exactly_or_refused(name: bytes, value: bytes) -> None:
    """A well-formed field (token name; value of visible bytes, spaces and tabs) is served
    with its value (outer whitespace trimmed); anything else, a CR, LF or NUL above all, is
    a 400 and nothing after it is served."""
    data = b"GET /echo HTTP/1.1\r\nHost: t\r\n" + name + b": " + value + b"\r\n\r\n"
    inner = value.strip(b" \t")
    valid = all(c in TCHAR for c in name) and all(c in VALUE_BYTES for c in inner)
    event("well-formed" if valid else "malformed")

    async def scenario(fuzzed: Fuzzed) -> None:
        if not valid:
            assert_error(await refused(fuzzed, data), 400)
            return
        reader, writer = await fuzzed.connect()
        writer.write(data)
        resp = await read_response(reader)
        writer.close()
        headers = resp.json()["headers"]
        assert headers[name.decode("latin-1").lower()] == inner.decode("latin-1")

    run(scenario)

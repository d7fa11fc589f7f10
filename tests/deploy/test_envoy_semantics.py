"""What the front door's Envoy config does when a replica fails or drains, checked against
the real Envoy binary with stand-in replicas whose failures are exact (a reset before the
response headers, a reset after them, a `/health` that turns 503).

- A connection reset before any response byte is retried once on another replica, the
  client never seeing it.
- A response that has begun (headers and a first event sent) is never retried: the client
  sees the stream cut, and no other replica ever gets that request.
- A draining replica's 503 to a request it never ran (`x-prfaas-not-started: 1`, as the
  gateway's HTTP server answers on a connection Envoy had pooled) is retried on another
  replica; any other 503 reaches the client as it was.
- A replica whose `/health` answers 503 (a gateway draining on SIGTERM) gets no new request
  once Envoy has probed it, while the stream it is serving runs to its end.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import aiohttp
import pytest
from aiohttp import web
from aiohttp_helpers import start_app
from envoy_helpers import EnvoyFront

pytestmark = pytest.mark.timeout(60)

Mode = Literal[
    "answer", "reset_before_headers", "reset_after_headers", "stream_slowly", "refuse_draining"
]
Answer = tuple[int, str, str | None]
"""A client's (status, body read until the end or the cut, x-request-id)."""


@dataclass
class StandIn:
    """A replica that answers completions in one of a few exact ways, and records the
    `x-request-id` of every completion request it received."""

    name: str
    mode: Mode
    draining: bool = False
    seen: list[str] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    """A slow stream ends (its last event and `[DONE]`) only once this is set."""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"draining": self.draining}, status=503 if self.draining else 200)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.seen.append(request.headers["x-request-id"])
        if self.mode == "answer":
            return web.json_response({"replica": self.name})
        if self.mode == "refuse_draining":  # as prfaas.http.server refuses during a drain
            error = {"error": {"code": "shutting_down", "message": "shutting down"}}
            flag = {"x-prfaas-not-started": "1"} if len(self.seen) % 2 else {}
            return web.json_response(error, status=503, headers={"Connection": "close", **flag})
        if self.mode == "reset_before_headers":
            _reset(request)
            await asyncio.sleep(60)  # cancelled with the connection
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for n in range(20 if self.mode == "stream_slowly" else 1):
            await resp.write(f"data: {self.name} {n}\n\n".encode())
            await asyncio.sleep(0.1)
        if self.mode == "stream_slowly":
            await self.release.wait()
        if self.mode == "reset_after_headers":
            _reset(request)
            await asyncio.sleep(60)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _reset(request: web.Request) -> None:
    """Drop the connection with a TCP RST (SO_LINGER 0), as a killed process's kernel may."""
    transport = request.transport
    assert transport is not None
    sock: socket.socket = transport.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


@dataclass
class Pair:
    a: StandIn
    b: StandIn
    envoy: EnvoyFront
    a_address: str
    b_address: str


@pytest.fixture
async def pair(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Pair]:
    """Stand-in A (in the mode the test names) and B (answers) behind Envoy."""
    a, b = StandIn("a", request.param), StandIn("b", "answer")
    runners, addresses = [], []
    for stand_in in (a, b):
        runner, url = await start_app(stand_in.app())
        runners.append(runner)
        addresses.append(url.removeprefix("http://"))
    envoy = EnvoyFront(tmp_path, addresses)
    envoy.start()
    try:
        async with aiohttp.ClientSession() as s:
            await envoy.wait_routable(s, addresses)
        yield Pair(a, b, envoy, *addresses)
    finally:
        envoy.stop()
        for runner in runners:
            await runner.cleanup()


async def _post(s: aiohttp.ClientSession, url: str) -> Answer:
    """One request; a cut body ends the read (marked `<cut>`), not the test."""
    async with s.post(f"{url}/v1/completions", json={"prompt": "x"}) as r:
        chunks = []
        try:
            async for chunk in r.content.iter_any():
                chunks.append(chunk)
        except aiohttp.ClientPayloadError:
            chunks.append(b"<cut>")
        return r.status, b"".join(chunks).decode(), r.headers.get("x-request-id")


async def _until_a_is_hit(pair: Pair, s: aiohttp.ClientSession) -> list[Answer]:
    """Requests one at a time until one of them reached A (Envoy's picks are random)."""
    answers: list[Answer] = []
    while not pair.a.seen:
        assert len(answers) < 50, "A never got a request"
        answers.append(await _post(s, pair.envoy.url))
    return answers


@pytest.mark.parametrize("pair", ["reset_before_headers"], indirect=True)
async def test_a_reset_before_the_response_is_retried_on_another_replica(pair: Pair) -> None:
    async with aiohttp.ClientSession() as s:
        answers = await _until_a_is_hit(pair, s)
        answers += [await _post(s, pair.envoy.url) for _ in range(5)]
        counters = await pair.envoy.counters(s)
    assert all(status == 200 and '"b"' in body for status, body, _ in answers), answers
    assert set(pair.a.seen) <= set(pair.b.seen)  # each one A dropped, B answered
    assert counters["upstream_rq_retry"] == len(pair.a.seen) >= 1
    await asyncio.sleep(0.2)  # the access log is flushed every 50 ms
    retried = {line["request_id"]: line for line in pair.envoy.access_log()}
    for request_id in pair.a.seen:
        line = retried[request_id]
        assert (line["attempts"], line["upstream_host"], line["status"]) == (2, pair.b_address, 200)


@pytest.mark.parametrize("pair", ["refuse_draining"], indirect=True)
async def test_a_503_for_a_request_never_run_is_retried_and_no_other(pair: Pair) -> None:
    """A answers its first request 503 with `x-prfaas-not-started: 1` and its second 503
    without it (two: a third 503 in a row would eject it): the first is retried once on B
    (the client gets B's answer), the second reaches the client as A sent it."""
    async with aiohttp.ClientSession() as s:
        answers = []
        while len(pair.a.seen) < 2:
            assert len(answers) < 100, "A got too few requests"
            answers.append(await _post(s, pair.envoy.url))
        counters = await pair.envoy.counters(s)
    flagged, plain = pair.a.seen
    by_id = {request_id: (status, body) for status, body, request_id in answers}
    status, body = by_id[flagged]
    assert status == 200 and '"b"' in body and flagged in pair.b.seen
    status, body = by_id[plain]
    assert status == 503 and "shutting_down" in body and plain not in pair.b.seen
    assert counters["upstream_rq_retry"] == 1


@pytest.mark.parametrize("pair", ["reset_after_headers"], indirect=True)
async def test_a_response_that_began_is_never_retried(pair: Pair) -> None:
    async with aiohttp.ClientSession() as s:
        answers = await _until_a_is_hit(pair, s)
        counters = await pair.envoy.counters(s)
    status, body, request_id = answers[-1]
    assert (status, body) == (200, "data: a 0\n\n<cut>")
    assert request_id == pair.a.seen[0] and request_id not in pair.b.seen
    assert counters.get("upstream_rq_retry", 0) == 0
    await asyncio.sleep(0.2)
    line = {line["request_id"]: line for line in pair.envoy.access_log()}[request_id]
    assert (line["attempts"], line["upstream_host"]) == (1, pair.a_address)
    assert line["details"].startswith("upstream_reset_after_response_started")


@pytest.mark.parametrize("pair", ["stream_slowly"], indirect=True)
async def test_a_draining_replica_finishes_its_stream_and_gets_no_new_request(
    pair: Pair,
) -> None:
    """A's `/health` turns 503 while it streams (held open until the test releases it):
    within Envoy's probe interval (1 s) it is out, the next requests all go to B, and its
    stream still ends with `[DONE]`."""
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as s:
        while not pair.a.seen:  # a stream in flight on A
            in_flight = loop.create_task(_post(s, pair.envoy.url))
            await asyncio.sleep(0.05)
            if not pair.a.seen:
                await in_flight
        pair.a.draining = True
        drained_at = loop.time()
        await pair.envoy.wait_host(s, pair.a_address, lambda h: not h.routable)
        assert loop.time() - drained_at < 1.5
        assert not in_flight.done()
        after = [await _post(s, pair.envoy.url) for _ in range(10)]
        pair.a.release.set()
        status, body, _ = await in_flight
    assert status == 200 and body.endswith("data: a 19\n\ndata: [DONE]\n\n")
    assert len(pair.a.seen) == 1
    assert all(status == 200 and '"b"' in body for status, body, _ in after)

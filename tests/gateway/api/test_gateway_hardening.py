"""The gateway's front door against misuse, through real sockets:

- finding 4: `/admin/*` takes an operator key, never a client's API key, and every admin
  value is checked (finite, in range) before anything changes;
- finding 8: a body too large for any prompt that fits the context is refused from its
  `Content-Length` before it is parsed, and `/health` keeps answering fast meanwhile;
- finding 9: a 502 never shows an engine's own text (bootstrap rooms); the prompt-length
  histogram counts admitted requests only, not those refused with 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp_helpers import start_app
from gateway_helpers import Engines, GatewayFactory, deployment
from metrics_helpers import Scrape

from prfaas.gateway.deployment import GatewayConfig
from prfaas.testing.null_server import NullConfig, NullServer

pytestmark = pytest.mark.timeout(60)
OK_BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
OP, CLIENT = "operator-key", "client-key"


async def _call(method: str, url: str, body: Any = None, key: str | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, url, json=body, headers=headers) as r,
    ):
        return r.status, await r.json()


async def test_admin_needs_an_operator_key_not_a_client_key(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    config = deployment(null_engines.urls, api_keys=(CLIENT,), admin_keys=(OP,))
    url, gateway = await gateway_factory(config)
    admin = f"{url}/admin/state"
    for key in (None, CLIENT, "wrong"):
        assert (await _call("POST", admin, {"threshold": 500}, key))[0] == 401
        assert (await _call("GET", admin, None, key))[0] == 401
    assert gateway.router.state.threshold == 100
    status, state = await _call("POST", admin, {"threshold": 500}, OP)
    assert status == 200 and state["threshold"] == 500
    assert (await _call("GET", admin, None, OP))[0] == 200
    assert (await _call("POST", f"{url}/v1/completions", OK_BODY, OP))[0] == 401  # not a client
    assert (await _call("POST", f"{url}/v1/completions", OK_BODY, CLIENT))[0] == 200
    with pytest.raises(ValueError, match="admin_keys: must differ from every API key"):
        GatewayConfig(api_keys=("same",), admin_keys=("same",))


async def test_without_operator_keys_admin_is_read_only(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    url, gateway = await gateway_factory(deployment(null_engines.urls))
    status, error = await _call("POST", f"{url}/admin/state", {"threshold": 500})
    assert status == 403 and error["error"]["code"] == "admin_disabled"
    assert gateway.router.state.threshold == 100
    assert (await _call("GET", f"{url}/admin/state"))[0] == 200


BAD_ADMIN = [
    {"threshold": 0},
    {"threshold": 1e308},
    {"threshold": -1},
    {"threshold": 8193},  # past the context length (8192)
    {"threshold": True},
    {"threshold": "100"},
    {"regime": "sideways"},
    {"threshold": 500, "regime": "sideways"},  # one bad value: nothing changes
    {"threshold": 500, "t": 1},
    {},
]


async def test_admin_values_are_checked_before_anything_changes(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    url, gateway = await gateway_factory(deployment(null_engines.urls, admin_keys=(OP,)))
    for body in BAD_ADMIN:
        status, error = await _call("POST", f"{url}/admin/state", body, OP)
        assert status == 400 and error["error"]["type"] == "invalid_request_error", body
        state = gateway.router.state
        assert (state.threshold, state.regime) == (100, "bandwidth_scarce"), body
    body = {"threshold": 8192, "regime": "bandwidth_abundant"}
    assert (await _call("POST", f"{url}/admin/state", body, OP))[0] == 200
    assert (gateway.router.state.threshold, gateway.router.state.regime) == (8192, body["regime"])


def _big_request(size: int) -> bytes:
    """A POST with a `size`-byte token-id body (built once: the senders only send it)."""
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {size}\r\n\r\n"
    ).encode()
    piece = b"1, " * 10_000
    body = b'{"model": "tiny", "prompt": [' + piece * (size // len(piece) + 1)
    return head + body[: size - 2] + b"]}"


def _send_big(port: int, request: bytes) -> bytes:
    """Send `request` as fast as the socket takes it; the answer's head."""
    head, body = request[:200], memoryview(request)[200:]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        with contextlib.suppress(OSError):  # refused early and closed: the answer is there
            sock.sendall(body)
        return sock.recv(4096)


def _health_latencies(port: int, stop: float) -> list[float]:
    latencies = []
    while time.monotonic() < stop:
        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            while sock.recv(4096):
                pass
        latencies.append(time.monotonic() - start)
        time.sleep(0.01)
    return latencies


async def test_huge_bodies_are_refused_unread_and_health_stays_fast(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    """Eight concurrent 16 MB token-id bodies (the configured body limit is 16 MiB, but no
    prompt that fits 8192 tokens needs that much): each gets 413 from its headers, and
    `/health` answers within 100 ms throughout (90th percentile; the machine is shared)."""
    url, _ = await gateway_factory(deployment(null_engines.urls))
    port = int(url.rsplit(":", 1)[1])
    request = _big_request(16_000_000)
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(9) as pool:  # eight senders and the prober, all at once
        stop = time.monotonic() + 1.5
        probes = loop.run_in_executor(pool, _health_latencies, port, stop)
        answers = await asyncio.gather(
            *(loop.run_in_executor(pool, _send_big, port, request) for _ in range(8))
        )
        latencies = await probes  # inside: leaving the pool waits for its threads
    assert all(a.startswith(b"HTTP/1.1 413") for a in answers), answers
    assert statistics.quantiles(latencies, n=10)[-1] < 0.1, latencies


async def test_a_502_never_shows_the_engines_text(gateway_factory: GatewayFactory) -> None:
    """Both prefills fail with an error naming their bootstrap room: the client's 502 says
    which kind of failure it was, never the engine's words."""

    async def leaky(request: web.Request) -> web.Response:
        message = "KV hand-off failed: room 6619214212345: timed out (peer 0123abcd)"
        body = {"error": {"message": message, "code": "kv_handoff_failed"}}
        return web.json_response(body, status=502)

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/generate", leaky)
    app.router.add_get("/health", ok)
    runner, bad = await start_app(app)
    slow = NullServer(NullConfig(first_token_delay_s=0.3, model="tiny"))  # waits for "KV"
    decode_runner, decode = await start_app(slow.app())
    try:
        urls = {"pd-p0": bad, "prfaas-p0": bad, "pd-d0": decode}
        url, _ = await gateway_factory(deployment(urls, retry_wait_s=0))
        for stream in (False, True):
            status, error = await _call(
                "POST", f"{url}/v1/completions", {**OK_BODY, "stream": stream}
            )
            text = str(error)
            assert status == 502 and "kv_handoff_failed" in error["error"]["message"]
            assert "6619214212345" not in text and "room" not in text and "peer" not in text
    finally:
        await runner.cleanup()
        await decode_runner.cleanup()


async def test_prompt_histogram_counts_admitted_requests_only(
    gateway_factory: GatewayFactory,
) -> None:
    slow = NullServer(NullConfig(first_token_delay_s=0.5, model="tiny"))
    runner, slow_url = await start_app(slow.app())
    try:
        urls = dict.fromkeys(("prfaas-p0", "pd-p0", "pd-d0"), slow_url)
        url, _ = await gateway_factory(deployment(urls, max_running=1, max_queued=0))
        first = asyncio.ensure_future(_call("POST", f"{url}/v1/completions", OK_BODY))
        await asyncio.sleep(0.2)
        refused = [await _call("POST", f"{url}/v1/completions", OK_BODY) for _ in range(3)]
        assert [s for s, _ in refused] == [429, 429, 429]
        assert (await first)[0] == 200
        async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
            scrape = Scrape.parse(await r.text())
        assert scrape.value("prfaas_prompt_tokens_count") == 1
        requests = {"api": "completions", "route": "none", "status": "429"}
        assert scrape.value("prfaas_requests_total", **requests) == 3
    finally:
        await runner.cleanup()

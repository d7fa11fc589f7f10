"""Loopback servers for the load-generator tests: the null server and a scripted streamer.

The scripted server picks its behaviour from the request's `model` field, so one server can
answer well, slowly, with errors, or not at all, and it records every body it receives.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp import web

from prfaas.engines.null import NullConfig, NullServer

TOKEN_DELAY_S = 0.02
FIRST_DELAY_S = 0.05


@dataclass
class Script:
    """State of the scripted server: received bodies and the concurrency it saw."""

    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0


def _chunk(text: str) -> bytes:
    return b"data: " + orjson.dumps({"choices": [{"index": 0, "text": text}]}) + b"\n\n"


SCRIPT = web.AppKey("script", Script)


async def _scripted(request: web.Request) -> web.StreamResponse:
    script = request.app[SCRIPT]
    body = await request.json()
    script.bodies.append(body)
    script.in_flight += 1
    script.max_in_flight = max(script.max_in_flight, script.in_flight)
    try:
        return await _behave(request, body)
    finally:
        script.in_flight -= 1


async def _behave(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    mode = body.get("model", "ok")
    if mode == "http500":
        err = {"error": {"message": "engine exploded", "type": "server_error", "code": 500}}
        return web.json_response(err, status=500)
    headers = {"Content-Type": "text/event-stream", "x-prfaas-route": "prfaas"}
    headers["x-prfaas-incremental-tokens"] = str(len(body.get("prompt") or []))
    resp = web.StreamResponse(headers=headers)
    await resp.prepare(request)
    if mode == "hang":
        await asyncio.sleep(30)
    await asyncio.sleep(FIRST_DELAY_S)
    n = body.get("max_tokens", 5)
    for i in range(n):  # two tokens per chunk: only `usage` can tell the true count
        if i > 0:
            await asyncio.sleep(TOKEN_DELAY_S)
        await resp.write(_chunk(f" a{i} b{i}"))
        if mode == "midstream-error" and i == 1:
            await resp.write(b'data: {"error": {"message": "decode died"}}\n\n')
            return resp
    if mode == "truncated":
        return resp
    usage = {
        "prompt_tokens": 7,
        "completion_tokens": 2 * n,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def _start(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[str, Script]]:
    """(base URL, Script) of a scripted streaming server on loopback."""
    app = web.Application()
    app[SCRIPT] = script = Script()
    app.router.add_post("/v1/completions", _scripted)
    runner, url = await _start(app)
    yield url, script
    await runner.cleanup()


@pytest.fixture
async def null_url() -> AsyncIterator[str]:
    """Base URL of an in-process null server on loopback (block size 4 for cache checks)."""
    runner, url = await _start(NullServer(NullConfig(block_size=4)).app())
    yield url
    await runner.cleanup()


@pytest.fixture
def null_process() -> Iterator[str]:
    """Base URL of `python -m prfaas.engines.null` in its own process."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "prfaas.engines.null", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on" in line, line
        yield line.split()[-1]
    finally:
        proc.terminate()
        proc.wait(timeout=10)

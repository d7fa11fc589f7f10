"""The gateway app's drain (`GatewayApp.stop`), over real sockets and slow null engines:
requests in flight finish within the drain; those still running at its deadline end with an
OpenAI error (an error event on a stream, 503 on a whole answer), never cut without one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp_helpers import start_app
from gateway_helpers import BLOCK, deployment
from http_server_helpers import read_response, request

from prfaas.gateway.api.app import GatewayApp
from prfaas.testing.null_server import NullConfig, NullServer

TOKEN_DELAY_S = 0.02


@dataclass
class Answer:
    """What one client got: the status, and a stream's `data:` payloads (a whole answer's
    JSON as its one payload)."""

    status: int
    events: list[str]

    @property
    def done(self) -> bool:
        return self.events[-1:] == ["[DONE]"]

    @property
    def error(self) -> dict[str, object] | None:
        last = json.loads(self.events[-1]) if self.events and not self.done else {}
        return last.get("error")


async def _ask(url: str, max_tokens: int, *, stream: bool, started: asyncio.Event) -> Answer:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": max_tokens, "stream": stream}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/completions", json=body) as resp,
    ):
        if not stream:
            started.set()
            return Answer(resp.status, [(await resp.read()).decode()])
        events = []
        async for line in resp.content:  # raises if the body is cut before its end
            if line.startswith(b"data: "):
                events.append(line[6:].decode().strip())
                started.set()
        return Answer(resp.status, events)


@pytest.fixture
async def slow_app() -> AsyncIterator[tuple[str, GatewayApp]]:
    """A gateway over three null engines that take `TOKEN_DELAY_S` per output token."""
    runners, urls = [], {}
    for name in ("prfaas-p0", "pd-p0", "pd-d0"):
        config = NullConfig(block_size=BLOCK, model="tiny", token_delay_s=TOKEN_DELAY_S)
        runner, urls[name] = await start_app(NullServer(config).app())
        runners.append(runner)
    app = GatewayApp(deployment(urls))
    port = await app.start("127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        await app.stop()
        for runner in runners:
            await runner.cleanup()


async def _in_flight(url: str, max_tokens: int) -> list[asyncio.Task[Answer]]:
    """Two streams and one whole request, each begun (streams: first event in)."""
    flags = [asyncio.Event() for _ in range(3)]
    tasks = [
        asyncio.create_task(_ask(url, max_tokens, stream=s, started=f))
        for s, f in zip((True, True, False), flags, strict=True)
    ]
    await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags[:2])), 5)
    await asyncio.sleep(0.2)  # the whole one is dispatched by now
    return tasks


async def test_requests_in_flight_finish_within_the_drain(
    slow_app: tuple[str, GatewayApp],
) -> None:
    """Answers that take ~0.6 s: the drain waits for them (whole, `[DONE]`), and returns as
    soon as they are done, long before its 30 s deadline."""
    url, app = slow_app
    tasks = await _in_flight(url, 30)
    loop = asyncio.get_running_loop()
    start = loop.time()
    await app.stop(drain_s=30)
    assert loop.time() - start < 5
    answers = [await t for t in tasks]
    assert [a.status for a in answers] == [200, 200, 200]
    assert answers[0].done and answers[1].done
    assert len(answers[0].events) == 31  # 30 tokens and [DONE]
    assert json.loads(answers[2].events[0])["usage"]["completion_tokens"] == 30


async def test_what_is_left_at_the_deadline_ends_with_an_openai_error(
    slow_app: tuple[str, GatewayApp],
) -> None:
    """Answers that would take ~40 s, a 0.3 s drain: each stream ends with a complete body
    whose last event is the `shutting_down` error (after the tokens it had, and no
    `[DONE]`); the whole request gets a 503 JSON error. The drain takes about its
    deadline."""
    url, app = slow_app
    tasks = await _in_flight(url, 2000)
    loop = asyncio.get_running_loop()
    start = loop.time()
    await app.stop(drain_s=0.3)
    assert loop.time() - start < 2
    streams = [await t for t in tasks[:2]]
    for answer in streams:
        assert answer.status == 200 and not answer.done
        assert answer.error is not None and answer.error["code"] == "shutting_down"
        assert answer.error["type"] == "service_unavailable"
        tokens = [json.loads(e)["choices"][0]["text"] for e in answer.events[:-1]]
        assert 1 <= len(tokens) < 2000 and tokens[0] == " t0"
    whole = await tasks[2]
    assert whole.status == 503
    assert json.loads(whole.events[0])["error"]["code"] == "shutting_down"


async def test_during_the_drain_health_and_new_requests_get_503(
    slow_app: tuple[str, GatewayApp],
) -> None:
    """On a connection opened before the drain, `/health` (200 before) and a new completion
    get 503 `shutting_down` with `Connection: close` while requests are still in flight;
    new connections are refused; the requests in flight still complete."""
    url, app = slow_app
    port = int(url.rsplit(":", 1)[1])
    health = request("GET", "/health")
    completion = request("POST", "/v1/completions", body=b'{"model": "tiny", "prompt": "hi"}')
    opened = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
    for reader, writer in opened:
        writer.write(health)
        assert (await read_response(reader)).status == 200  # kept alive
    tasks = await _in_flight(url, 100)
    draining = asyncio.create_task(app.stop(drain_s=30))
    await asyncio.sleep(0.05)
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)
    for (reader, writer), again in zip(opened, (health, completion), strict=True):
        writer.write(again)
        refused = await read_response(reader)
        assert refused.status == 503 and refused.headers["connection"] == "close"
        assert refused.json()["error"]["code"] == "shutting_down"
        writer.close()
    assert not draining.done()
    await draining
    assert [(await t).status for t in tasks] == [200, 200, 200]

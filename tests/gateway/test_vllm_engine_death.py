"""Requests on vLLM engines that die (their connection dropped, as a SIGKILLed server's is),
through a real gateway over stand-in vLLM servers (vLLM's OpenAI routes on real sockets):
a prefill that dies before the first token is retried on the other prefill and the client
gets the answer; a decode that dies mid-stream ends the client's stream at once with an
OpenAI error event and no `[DONE]` (a relayed vLLM answer cannot migrate), never waiting
for a timeout."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp_helpers import start_app
from gateway_helpers import GatewayFactory, deployment

pytestmark = pytest.mark.timeout(60)


class StandIn:
    """A vLLM server's `/v1/completions`: a prefill answers its one token, a decode streams
    `tokens` events; `die_after` events (0: before any answer) it drops the connection."""

    def __init__(self, *, die_after: int | None = None, tokens: int = 6) -> None:
        self.die_after, self.tokens = die_after, tokens
        self.calls = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", _empty)
        app.router.add_get("/metrics", _empty)
        return app

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.calls += 1
        if self.die_after == 0:
            return self._die(request)
        if not body.get("stream"):
            usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
            choice = {"index": 0, "text": "a", "finish_reason": "length"}
            return web.json_response({"id": "c", "object": "text_completion", "model": "tiny",
                                      "choices": [choice], "usage": usage})  # fmt: skip
        await asyncio.sleep(0.3)  # a decode waits for its KV
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(self.tokens):
            if i == self.die_after:
                return self._die(request)
            last = i == self.tokens - 1
            choice = {"index": 0, "text": "a", "finish_reason": "length" if last else None}
            event = {"id": "c", "object": "text_completion", "model": "tiny", "choices": [choice]}
            await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
            await asyncio.sleep(0.05)
        usage = {"prompt_tokens": 2, "completion_tokens": self.tokens, "total_tokens": 8}
        tail = {"id": "c", "object": "text_completion", "model": "tiny", "choices": [],
                "usage": usage}  # fmt: skip
        await response.write(b"data: " + orjson.dumps(tail) + b"\n\ndata: [DONE]\n\n")
        return response

    @staticmethod
    def _die(request: web.Request) -> web.StreamResponse:
        """The connection reset under the client, as a killed process leaves it."""
        assert request.transport is not None
        request.transport.abort()
        raise asyncio.CancelledError


async def _empty(_request: web.Request) -> web.Response:
    return web.Response(text="")


async def _gateway(
    factory: GatewayFactory, engines: dict[str, StandIn]
) -> tuple[str, list[web.AppRunner]]:
    runners, urls = [], {}
    for name, engine in engines.items():
        runner, urls[name] = await start_app(engine.app())
        runners.append(runner)
    config = deployment(urls, retry_wait_s=0)
    # every instance a vLLM server: the gateway relays their answers as written
    vllm = tuple(replace(i, engine="vllm") for i in config.instances)
    return (await factory(replace(config, instances=vllm)))[0], runners


async def _events(url: str, body: dict[str, object]) -> tuple[int, list[str], float]:
    loop = asyncio.get_running_loop()
    start = loop.time()
    events = []
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json=body) as r:
        async for line in r.content:
            if line.startswith(b"data: "):
                events.append(line[6:].decode().strip())
    return r.status, events, loop.time() - start


async def test_a_vllm_prefill_that_dies_before_the_first_token_is_retried_elsewhere(
    gateway_factory: GatewayFactory,
) -> None:
    engines = {"prfaas-p0": StandIn(), "pd-p0": StandIn(die_after=0), "pd-d0": StandIn()}
    url, runners = await _gateway(gateway_factory, engines)
    try:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 6, "stream": True}
        status, events, took = await _events(url, body)
        assert status == 200 and events[-1] == "[DONE]", events
        assert engines["pd-p0"].calls == 1 and engines["prfaas-p0"].calls == 1
        assert took < 5
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_a_vllm_decode_that_dies_mid_stream_ends_with_an_error_event_at_once(
    gateway_factory: GatewayFactory,
) -> None:
    engines = {"prfaas-p0": StandIn(), "pd-p0": StandIn(), "pd-d0": StandIn(die_after=2)}
    url, runners = await _gateway(gateway_factory, engines)
    try:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 6, "stream": True}
        status, events, took = await _events(url, body)
        assert status == 200 and len(events) == 3, events
        assert "[DONE]" not in events
        assert json.loads(events[-1])["error"]["code"], events
        assert took < 5
    finally:
        for runner in runners:
            await runner.cleanup()

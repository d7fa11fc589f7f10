"""The relay between the prefill and decode calls, through a real gateway and real HTTP
engines: a prefill that fails while decode still waits for its KV ends the request at once
(decode aborted), and a non-streaming client that hangs up aborts both engine calls."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp_helpers import start_app
from gateway_helpers import GatewayFactory, RecordingEngine, deployment


class Engine(RecordingEngine):
    """`/generate` waits `delay_s` (decode: for KV), then answers `status`; records each
    rid it started, saw dropped, or got an `/abort_request` for."""

    def __init__(self, delay_s: float, status: int = 200) -> None:
        super().__init__()
        self.delay_s, self.status = delay_s, status

    async def generate(self, request: web.Request) -> web.Response:
        rid = orjson.loads(await request.read())["rid"]
        self.started.append(rid)
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.dropped.append(rid)
            raise
        if self.status != 200:
            return web.json_response({"error": {"message": "KV hand-off failed"}}, status=500)
        meta = {"prompt_tokens": 2, "completion_tokens": 1, "finish_reason": {"type": "length"}}
        return web.json_response({"text": "a", "output_ids": [97], "meta_info": meta})


async def _gateway(
    factory: GatewayFactory, prefill: Engine, decode: Engine
) -> tuple[str, list[web.AppRunner]]:
    r1, prefill_url = await start_app(prefill.app())
    r2, decode_url = await start_app(decode.app())
    urls = {"prfaas-p0": prefill_url, "pd-p0": prefill_url, "pd-d0": decode_url}
    url, _ = await factory(deployment(urls, retry_wait_s=0))
    return url, [r1, r2]


async def _settle(engine: Engine, n: int) -> None:
    for _ in range(100):
        if len(engine.aborted) >= n and len(engine.dropped) >= n:
            return
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("stream", [False, True])
async def test_prefill_failure_aborts_waiting_decode(
    gateway_factory: GatewayFactory, stream: bool
) -> None:
    """Prefill fails after 0.1 s while decode would wait 30 s for KV: decode is aborted at
    once and the request retried on the other prefill (both prefills here are the same
    failing engine); when no prefill is left, the client gets a JSON 502 within a second,
    naming the engine's error code, never its text."""
    prefill, decode = Engine(0.1, status=500), Engine(30)
    url, runners = await _gateway(gateway_factory, prefill, decode)
    try:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "stream": stream}
        start = asyncio.get_running_loop().time()
        async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json=body) as r:
            reply = await r.json()
        assert asyncio.get_running_loop().time() - start < 1.0
        assert r.status == 502 and reply["error"]["code"] == "engine_error"
        assert "KV hand-off failed" not in reply["error"]["message"]
        await _settle(decode, 2)
        assert decode.started == prefill.started and len(decode.started) == 2
        assert decode.dropped == decode.started and decode.aborted == decode.started
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_non_streaming_client_disconnect_aborts_both(
    gateway_factory: GatewayFactory,
) -> None:
    """A non-streaming client that gives up before the answer: both engine calls are
    dropped and aborted for the same rid."""
    prefill, decode = Engine(30), Engine(30)
    url, runners = await _gateway(gateway_factory, prefill, decode)
    try:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
        timeout = aiohttp.ClientTimeout(total=0.3)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            with pytest.raises(TimeoutError):
                async with s.post(f"{url}/v1/completions", json=body) as r:
                    await r.read()
        await _settle(prefill, 1)
        await _settle(decode, 1)
        assert len(decode.started) == 1 and prefill.started == decode.started
        assert prefill.dropped == prefill.aborted == decode.dropped == decode.aborted
        assert decode.aborted == decode.started
    finally:
        for runner in runners:
            await runner.cleanup()

"""A client that disconnects mid-stream aborts the request on both engines.

The engines here are small real HTTP servers that stream slowly and record what happened
to each rid: the connection dropped (handler cancelled) and/or `/abort_request` arrived."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
from aiohttp import web
from aiohttp_helpers import start_app
from gateway_helpers import GatewayFactory, RecordingEngine, deployment


class SlowEngine(RecordingEngine):
    """Streams a token every 50 ms for 200 tokens; records dropped and aborted rids."""

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        rid = body["rid"]
        self.started.append(rid)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(200):
                meta = {"prompt_tokens": 2, "completion_tokens": i + 1, "finish_reason": None}
                chunk = {"text": "a" * (i + 1), "output_ids": [97] * (i + 1), "meta_info": meta}
                await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
                await asyncio.sleep(0.05)
        except (asyncio.CancelledError, ConnectionResetError):
            self.dropped.append(rid)
            raise
        return resp


async def test_client_disconnect_aborts_prefill_and_decode(gateway_factory: GatewayFactory) -> None:
    """After the client closes its stream, both engines see the connection dropped and
    an `/abort_request` for the same rid; the gateway's in-flight counts return to 0."""
    prefill, decode = SlowEngine(), SlowEngine()
    runners = []
    try:
        r1, prefill_url = await start_app(prefill.app())
        r2, decode_url = await start_app(decode.app())
        runners += [r1, r2]
        urls = {"prfaas-p0": prefill_url, "pd-p0": prefill_url, "pd-d0": decode_url}
        url, gateway = await gateway_factory(deployment(urls))
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 200, "stream": True}
        async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 200
            await r.content.readline()  # the first event arrived; now hang up
        for _ in range(100):
            if prefill.aborted and decode.aborted and prefill.dropped and decode.dropped:
                break
            await asyncio.sleep(0.05)
        assert prefill.started == decode.started and len(decode.started) == 1
        rid = decode.started[0]
        assert prefill.aborted == [rid] and decode.aborted == [rid]
        assert prefill.dropped == [rid] and decode.dropped == [rid]
        assert all(s.in_flight == 0 for s in gateway.instances)
        assert gateway.service.admission.running == 0
    finally:
        for runner in runners:
            await runner.cleanup()

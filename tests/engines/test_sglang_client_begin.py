"""`SGLangClient.begin` (the gateway's non-streaming hot path) against a real aiohttp
engine stand-in: an answer of the wrong shape fails the call instead of hanging it, and a
call that times out after it was sent is aborted on the engine, as `generate` does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from aiohttp import web

from prfaas.engines.client import EngineError, GenerateRequest, SamplingParams
from prfaas.engines.sglang_client import SGLangClient, SGLangClientConfig


class _Engine:
    """`/generate` answers per `mode`; `/abort_request` rids are recorded."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.aborted: list[str] = []
        self.abort_seen = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort_request", self.abort)
        return app

    async def generate(self, request: web.Request) -> web.Response:
        await request.read()
        if self.mode == "hang":  # until the client aborts the request
            await asyncio.wait_for(self.abort_seen.wait(), 10)
        if self.mode == "bad-shape":
            return web.json_response({"text": "a", "output_ids": ["x"], "meta_info": []})
        meta = {"prompt_tokens": 2, "completion_tokens": 1, "finish_reason": {"type": "length"}}
        return web.json_response({"text": "a", "output_ids": [97], "meta_info": meta})

    async def abort(self, request: web.Request) -> web.Response:
        self.aborted.append(orjson.loads(await request.read())["rid"])
        self.abort_seen.set()
        return web.json_response({})


@pytest.fixture
async def engine() -> AsyncIterator[tuple[_Engine, SGLangClient]]:
    stand_in = _Engine()
    runner = web.AppRunner(stand_in.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    config = SGLangClientConfig(read_timeout_s=0.3, control_timeout_s=2)
    async with aiohttp.ClientSession() as session:
        client = SGLangClient("e0", f"http://127.0.0.1:{port}", session, config)
        yield stand_in, client
        await client.close()
    await runner.cleanup()


def _request(rid: str) -> GenerateRequest:
    return GenerateRequest(rid, (1, 2, 3), SamplingParams(max_new_tokens=1), stream=False)


async def test_an_answer_of_the_wrong_shape_fails_the_call(
    engine: tuple[_Engine, SGLangClient],
) -> None:
    stand_in, client = engine
    assert (await client.begin(_request("r0")))[0].token_ids == (97,)
    stand_in.mode = "bad-shape"
    with pytest.raises(EngineError, match="bad /generate answer"):
        await asyncio.wait_for(client.begin(_request("r1")), 2)


async def test_a_call_that_times_out_is_aborted_on_the_engine(
    engine: tuple[_Engine, SGLangClient],
) -> None:
    stand_in, client = engine
    stand_in.mode = "hang"
    with pytest.raises(EngineError, match="TimeoutError"):
        await asyncio.wait_for(client.begin(_request("slow")), 5)
    for _ in range(100):
        if stand_in.aborted:
            break
        await asyncio.sleep(0.02)
    assert stand_in.aborted == ["slow"]

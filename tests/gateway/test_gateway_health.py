"""Health like a load balancer (finding 5), through a real gateway over real HTTP engines:
one slow probe makes an instance `suspect`, not dead, and costs none of its KV-index
entries (a warm prompt still routes by its cached prefix); N failed probes in a row eject
it, M good ones readmit it; its entries go only when the engine's own start id changes
(a restart emptied its cache)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import openai
import pytest
from aiohttp import web
from aiohttp_helpers import start_app
from gateway_helpers import BLOCK, Engines, GatewayFactory, deployment

from prfaas.common.tokenizer import ByteTokenizer
from prfaas.gateway.api.assembly import Gateway
from prfaas.protocol.kv_events import BlockStored
from prfaas.testing.null_server import NullConfig, NullServer

pytestmark = pytest.mark.timeout(60)
WARM = "w" * 300  # 300 tokens; the PD prefill caches the first 288 (18 blocks)


class Stallable:
    """A null engine whose `/health` can be made to hang, reporting its own start id."""

    def __init__(self) -> None:
        self.null = NullServer(NullConfig(block_size=BLOCK, model="tiny"))
        self.stall_s = 0.0
        self.start_id = "first"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/generate", self.null.generate)
        app.router.add_get("/health", self.health)
        return app

    async def health(self, request: web.Request) -> web.Response:
        if self.stall_s:
            await asyncio.sleep(self.stall_s)
        body = {"status": "ok", "role": "prefill", "start_id": self.start_id}
        return web.json_response(body)


async def _until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def _warm_entries(gateway: Gateway) -> None:
    ids = tuple(ByteTokenizer().encode(WARM)[: 18 * BLOCK])
    gateway.index.apply("pd-p0", [BlockStored(tuple(range(1, 19)), None, ids, BLOCK)])


async def _incremental(url: str) -> int:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    async with client:
        raw = await client.completions.with_raw_response.create(
            model="tiny", prompt=WARM, max_tokens=1
        )
    return int(raw.headers["x-prfaas-incremental-tokens"])


async def test_a_stall_is_suspect_not_dead_and_keeps_the_cache(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    stalled = Stallable()
    runner, stalled_url = await start_app(stalled.app())
    try:
        config = deployment(
            {**null_engines.urls, "pd-p0": stalled_url},
            health_interval_s=0.1, health_timeout_s=0.2, eject_after=4, readmit_after=2,
        )  # fmt: skip
        url, gateway = await gateway_factory(config)
        state = gateway.instances["pd-p0"]
        _warm_entries(gateway)
        assert await _incremental(url) == 12
        entries = len(gateway.index)
        # A stall of about two probes: suspect, still routed to, nothing forgotten.
        stalled.stall_s = 0.35
        await _until(lambda: state.status == "suspect")
        assert state.healthy and len(gateway.index) == entries
        stalled.stall_s = 0
        await _until(lambda: state.status == "healthy")
        assert len(gateway.index) == entries and state.ejections == 0
        assert await _incremental(url) == 12
        # A long stall: ejected after 4 failed probes, readmitted after 2 good ones, and
        # still its entries (the same engine, same start id, same cache).
        stalled.stall_s = 5.0
        await _until(lambda: state.status == "ejected")
        assert not state.healthy and len(gateway.index) == entries
        stalled.stall_s = 0
        await _until(lambda: state.status == "healthy")
        assert state.ejections == 1 and len(gateway.index) == entries
        # A restart (new start id): now the entries go.
        stalled.start_id = "second"
        await _until(lambda: len(gateway.index) == 0)
        assert state.status == "healthy" and state.start_id == "second"
        assert await _incremental(url) == 300
    finally:
        await runner.cleanup()

"""Helpers: null engines and a gateway, all real aiohttp servers on 127.0.0.1 ephemeral
ports in the test's event loop (the null server answers `/generate` instantly; it stands in
for engines only where the test is about the gateway, not about model output)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import orjson
from aiohttp import web

from prfaas.gateway.api.assembly import Gateway
from prfaas.gateway.deployment import DeploymentConfig, GatewayConfig, InstanceConfig, ModelConfig
from prfaas.testing.null_server import NullServer

BLOCK = 16


GatewayFactory = Callable[..., Awaitable[tuple[str, Gateway]]]


@dataclass
class Engines:
    """Three null engines: PrfaaS prefill, PD prefill, PD decode."""

    urls: dict[str, str]
    servers: dict[str, NullServer]


def deployment(
    urls: dict[str, str], kv_events: dict[str, str] | None = None, **gateway: Any
) -> DeploymentConfig:
    """A deployment over `urls` (ids prfaas-p0, pd-p0, pd-d0); threshold 100 by default."""
    events = kv_events or {}
    instances = (
        InstanceConfig("prfaas-p0", "prfaas", "prefill", urls["prfaas-p0"], None, 9001,
                       events.get("prfaas-p0")),
        InstanceConfig("pd-p0", "pd", "prefill", urls["pd-p0"], None, 9002, events.get("pd-p0")),
        InstanceConfig("pd-d0", "pd", "decode", urls["pd-d0"]),
    )  # fmt: skip
    gw = replace(GatewayConfig(threshold=100, health_interval_s=0.2), **gateway)
    return DeploymentConfig(ModelConfig(name="tiny", block_size=BLOCK), gw, instances)


class RecordingEngine(ABC):
    """A small real `/generate` engine for relay tests: records each rid it started, saw
    dropped (handler cancelled) and got an `/abort_request` for. Subclasses write
    `generate`."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.dropped: list[str] = []
        self.aborted: list[str] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort_request", self.abort)
        app.router.add_get("/health", _health)
        return app

    @abstractmethod
    async def generate(self, request: web.Request) -> web.StreamResponse:
        """Answer `/generate`, appending to `started` and `dropped`."""

    async def abort(self, request: web.Request) -> web.Response:
        self.aborted.append(orjson.loads(await request.read())["rid"])
        return web.json_response({})


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})

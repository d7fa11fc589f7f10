"""Fixtures for the gateway tests (helpers live in gateway_helpers.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp_helpers import start_app
from gateway_helpers import BLOCK, Engines, GatewayFactory

from prfaas.gateway.api.app import GatewayApp
from prfaas.gateway.api.assembly import Gateway
from prfaas.gateway.deployment import DeploymentConfig
from prfaas.testing.null_server import NullConfig, NullServer


@pytest.fixture
async def null_engines() -> AsyncIterator[Engines]:
    servers, runners, urls = {}, [], {}
    for name in ("prfaas-p0", "pd-p0", "pd-d0"):
        servers[name] = NullServer(NullConfig(block_size=BLOCK, model="tiny"))
        runner, urls[name] = await start_app(servers[name].app())
        runners.append(runner)
    yield Engines(urls, servers)
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def gateway_factory() -> AsyncIterator[GatewayFactory]:
    """`await factory(config)` -> (base URL, Gateway); every gateway stops at teardown."""
    apps: list[GatewayApp] = []

    async def factory(config: DeploymentConfig) -> tuple[str, Gateway]:
        app = GatewayApp(config)
        apps.append(app)
        port = await app.start("127.0.0.1", 0)
        return f"http://127.0.0.1:{port}", app.gateway

    yield factory
    for app in apps:
        await app.stop()

"""Fixtures for the load-generator tests: the scripted streamer from loadgen_helpers.py."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp_helpers import start_app
from loadgen_helpers import SCRIPT, Script, scripted_handler


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[str, Script]]:
    """(base URL, Script) of a scripted streaming server on loopback."""
    app = web.Application()
    app[SCRIPT] = script = Script()
    app.router.add_post("/v1/completions", scripted_handler)
    runner, url = await start_app(app)
    yield url, script
    await runner.cleanup()

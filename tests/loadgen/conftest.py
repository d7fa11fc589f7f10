"""Fixtures for the load-generator tests: the null server (in process and as its own
process) and the scripted streamer from loadgen_helpers.py."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import pytest
from aiohttp import web
from loadgen_helpers import SCRIPT, Script, scripted_handler, start_app

from prfaas.engines.null import NullConfig, NullServer


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[str, Script]]:
    """(base URL, Script) of a scripted streaming server on loopback."""
    app = web.Application()
    app[SCRIPT] = script = Script()
    app.router.add_post("/v1/completions", scripted_handler)
    runner, url = await start_app(app)
    yield url, script
    await runner.cleanup()


@pytest.fixture
async def null_url() -> AsyncIterator[str]:
    """Base URL of an in-process null server on loopback (block size 4 for cache checks)."""
    runner, url = await start_app(NullServer(NullConfig(block_size=4)).app())
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

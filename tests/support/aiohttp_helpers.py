"""Serving an aiohttp application on loopback for a test."""

from __future__ import annotations

from aiohttp import web


async def start_app(app: web.Application) -> tuple[web.AppRunner, str]:
    """Serve `app` on an ephemeral port; returns the runner and the base URL."""
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"

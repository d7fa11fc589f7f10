"""The emulated link: bytes arrive intact, egress is paced to the rate and delayed by the
one-way delay (lower bounds only: a slow machine can make it slower, never faster)."""

from __future__ import annotations

import asyncio
import os

from prfaas.gateway.link import LinkConfig, LinkEmulator

PAYLOAD = os.urandom(600_000)


async def _upstream() -> tuple[asyncio.Server, int, list[bytes]]:
    """Sends PAYLOAD to whoever connects; records what the client sent."""
    received: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await reader.readexactly(5))
        writer.write(PAYLOAD)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, int(server.sockets[0].getsockname()[1]), received


async def test_paced_delayed_and_intact() -> None:
    """600 kB at 2 MB/s takes >= (600k - one chunk burst) / 2M seconds; the first byte
    waits >= 2 x delay (request there, answer back); bytes arrive intact and are counted."""
    server, port, received = await _upstream()
    link = LinkEmulator(("127.0.0.1", port), LinkConfig(rate_bytes_per_s=2e6, delay_s=0.05))
    await link.start()
    loop = asyncio.get_running_loop()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        start = loop.time()
        writer.write(b"hello")
        first = await reader.readexactly(1)
        first_at = loop.time() - start
        rest = await reader.readexactly(len(PAYLOAD) - 1)
        elapsed = loop.time() - start
        writer.close()
    finally:
        await link.close()
        server.close()
    assert received == [b"hello"]
    assert first + rest == PAYLOAD
    assert first_at >= 0.1 - 0.005
    assert elapsed >= (len(PAYLOAD) - 64 * 1024) / 2e6
    assert link.egress_bytes == len(PAYLOAD)


async def test_upstream_down_closes_the_client() -> None:
    """With nothing behind the link, a client connection is closed, not left hanging."""
    link = LinkEmulator(("127.0.0.1", 1), LinkConfig(rate_bytes_per_s=1e6))
    await link.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    finally:
        await link.close()

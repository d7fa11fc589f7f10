"""Re-pacing at run time: the token bucket's new rate holds from the change on, and a
paced sender's telemetry reports the new capacity (the emulated link slowing down)."""

from __future__ import annotations

import asyncio

import pytest

from prfaas.engines.transport import KVSender, SenderConfig
from prfaas.engines.transport.pacing import TokenBucket


async def test_a_slower_rate_holds_from_the_change_on() -> None:
    """200 kB/s, then 50 kB/s: 20 kB after the change take at least ~0.4 s of loop time."""
    bucket = TokenBucket(rate=200_000, burst=5_000)
    loop = asyncio.get_running_loop()
    await bucket.acquire(5_000)
    bucket.set_rate(50_000, 1_000)
    start = loop.time()
    for _ in range(4):
        await bucket.acquire(5_000)
    assert loop.time() - start >= 0.38
    with pytest.raises(ValueError, match="rate=0"):
        bucket.set_rate(0, 1)


async def test_sender_repacing_moves_its_capacity() -> None:
    sender = KVSender(SenderConfig(host="127.0.0.1", port=0, process_rate_bytes_per_s=1e6))
    await sender.start()
    try:
        assert sender.telemetry().capacity_bytes_per_s == 1e6
        sender.set_process_rate(2.5e5)
        t = sender.telemetry()
        assert t.capacity_bytes_per_s == 2.5e5 and sender.config.process_rate_bytes_per_s == 2.5e5
    finally:
        await sender.close()
    unpaced = KVSender(SenderConfig(host="127.0.0.1", port=0))
    await unpaced.start()
    try:
        with pytest.raises(ValueError, match="not paced"):
            unpaced.set_process_rate(1e6)
    finally:
        await unpaced.close()

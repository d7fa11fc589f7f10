"""Token bucket and egress meter."""

from __future__ import annotations

import asyncio

import pytest

from prfaas.engines.transport.pacing import TokenBucket
from prfaas.engines.transport.telemetry import EgressMeter


async def test_token_bucket_never_exceeds_its_rate() -> None:
    """After the burst, 40 kB at 200 kB/s take at least ~0.2 s of loop time (lower bound:
    pacing may be slower on a busy machine, never faster)."""
    bucket = TokenBucket(rate=200_000, burst=10_000)
    loop = asyncio.get_running_loop()
    await bucket.acquire(10_000)  # drains the initial burst
    start = loop.time()
    for _ in range(8):
        await bucket.acquire(5_000)
    assert loop.time() - start >= 0.19


async def test_token_bucket_allows_requests_larger_than_the_burst() -> None:
    bucket = TokenBucket(rate=1_000_000, burst=1000)
    loop = asyncio.get_running_loop()
    start = loop.time()
    await bucket.acquire(50_000)  # goes into debt: waits ~49 ms, does not deadlock
    await bucket.acquire(1)
    assert loop.time() - start >= 0.045


def test_token_bucket_validates() -> None:
    with pytest.raises(ValueError, match="rate=0"):
        TokenBucket(rate=0, burst=1)


def test_egress_meter_sliding_window() -> None:
    """Rate counts only bytes inside the last window; total counts everything."""
    meter = EgressMeter(window_s=1.0)
    meter.add(10.0, 500)
    meter.add(10.5, 1500)
    assert meter.rate(10.9) == 2000.0
    assert meter.rate(11.2) == 1500.0
    assert meter.rate(12.0) == 0.0
    assert meter.total == 2000
    with pytest.raises(ValueError, match="window_s"):
        EgressMeter(0)

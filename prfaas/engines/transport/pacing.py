"""Token-bucket pacing on the event loop's clock."""

from __future__ import annotations

import asyncio


class TokenBucket:
    """`rate` bytes/s with a `burst`-byte bucket. `acquire(n)` sleeps until n bytes may go.

    A request larger than the bucket is allowed by going into debt, so any frame size works
    and the long-run rate still holds. Waiters are served in order (one lock).
    """

    def __init__(self, rate: float, burst: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"rate and burst must be positive, got rate={rate}, burst={burst}")
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._stamp: float | None = None
        self._lock = asyncio.Lock()
        self.charged = 0
        """Bytes taken from the bucket so far."""

    async def acquire(self, nbytes: int) -> None:
        """Wait until `nbytes` may be sent, then take them from the bucket."""
        async with self._lock:
            loop = asyncio.get_running_loop()
            self._refill(loop.time())
            self._tokens -= nbytes
            self.charged += nbytes
            if self._tokens < 0:
                try:
                    await asyncio.sleep(-self._tokens / self.rate)
                except asyncio.CancelledError:  # not sent after all: give the bytes back
                    self._tokens += nbytes
                    self.charged -= nbytes
                    raise

    def set_rate(self, rate: float, burst: float) -> None:
        """Change the rate (e.g. an emulated link slowing down); bytes already granted stay
        granted, the bucket refills at the new rate from now."""
        if rate <= 0 or burst <= 0:
            raise ValueError(f"rate and burst must be positive, got rate={rate}, burst={burst}")
        loop = asyncio.get_running_loop()
        self._refill(loop.time())
        self.rate, self.burst = rate, burst
        self._tokens = min(self._tokens, burst)

    def _refill(self, now: float) -> None:
        if self._stamp is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

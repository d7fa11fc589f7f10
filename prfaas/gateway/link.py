"""An emulated cross-datacenter link: a TCP relay in front of a prefill engine's bootstrap
port that paces the prefill->decode direction (KV egress) to a rate and delays both
directions by a one-way latency.

The embedded deployment points decode engines at the relay instead of the PrfaaS prefill's
bootstrap port, so every KV byte that crosses "clusters" really goes through a paced link,
whatever the engine's own transport settings; the relay counts those bytes, which gives
the gateway a measured egress rate and utilisation.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

CHUNK = 64 * 1024
QUEUE_CHUNKS = 64
RATE_WINDOW = 5  # samples in egress_rate()'s window


@dataclass(frozen=True)
class LinkConfig:
    """The emulated link."""

    rate_bytes_per_s: float
    """Egress capacity shared by every connection (prefill -> decode)."""
    delay_s: float = 0.0
    """One-way delay added to every chunk in both directions (does not cut throughput)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate_bytes_per_s) and self.rate_bytes_per_s > 0):
            raise ValueError(f"rate_bytes_per_s must be > 0, got {self.rate_bytes_per_s}")
        if not (math.isfinite(self.delay_s) and 0 <= self.delay_s <= 10):
            raise ValueError(f"delay_s must be in [0, 10], got {self.delay_s}")


class TokenBucket:
    """Shared pacing: `take(n)` returns once `n` bytes fit the rate (burst = one chunk)."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self._tokens = burst
        self._stamp: float | None = None
        self._lock = asyncio.Lock()

    async def take(self, n: int) -> None:
        async with self._lock:
            loop = asyncio.get_running_loop()
            now = loop.time()
            if self._stamp is not None:
                self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= n
            if self._tokens < 0:
                await asyncio.sleep(-self._tokens / self.rate)


class LinkEmulator:
    """Relays `listen port -> upstream host:port`. Start with `start()`, stop with `close()`.

    `egress_bytes` counts bytes delivered upstream -> client; `egress_rate()` is the rate
    over a sliding window, on the loop's clock.
    """

    def __init__(self, upstream: tuple[str, int], config: LinkConfig, host: str = "127.0.0.1"):
        self.upstream, self.config, self.host = upstream, config, host
        self.port = 0
        self.egress_bytes = 0
        self._bucket = TokenBucket(config.rate_bytes_per_s, CHUNK)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._samples: deque[tuple[float, int]] = deque(maxlen=RATE_WINDOW)

    async def start(self) -> int:
        """Listen on an ephemeral port; returns it."""
        self._server = await asyncio.start_server(self._accept, self.host, 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        egress = self._spawn(self._pump(up_reader, writer, paced=True))
        ingress = self._spawn(self._pump(reader, up_writer, paced=False))
        await asyncio.wait({egress, ingress}, return_when=asyncio.FIRST_COMPLETED)
        for task in (egress, ingress):
            task.cancel()
        for w in (writer, up_writer):
            w.close()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, paced: bool
    ) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)
        sender = self._spawn(self._deliver(queue, dst, paced))
        loop = asyncio.get_running_loop()
        try:
            while data := await src.read(CHUNK):
                if paced:
                    await self._bucket.take(len(data))
                await queue.put((loop.time() + self.config.delay_s, data))
            await queue.put((loop.time() + self.config.delay_s, b""))
            await sender
        finally:
            sender.cancel()

    async def _deliver(
        self, queue: asyncio.Queue[tuple[float, bytes]], dst: asyncio.StreamWriter, paced: bool
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, data = await queue.get()
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            if not data:
                with contextlib.suppress(OSError):
                    dst.write_eof()
                return
            dst.write(data)
            await dst.drain()
            if paced:
                self.egress_bytes += len(data)

    def egress_rate(self) -> float:
        """Delivered egress bytes/s over the last few calls (call it periodically)."""
        now = asyncio.get_running_loop().time()
        self._samples.append((now, self.egress_bytes))
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

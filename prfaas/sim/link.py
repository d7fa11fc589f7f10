"""A simulated network link on the loop's clock: fair sharing, one-way delay, layer-wise KV.

Fluid model. The link's capacity is shared by the transfers in flight with max-min fairness
(processor sharing): every transfer gets an equal share, except one that cannot use it.
A *layer-wise* (pipelined) transfer of S bytes whose prefill takes T seconds has its bytes
released progressively, at S/T bytes/s, from its start; once it has sent everything
released so far it can go no faster than that, and the unused share goes to the others.
So on an idle link it ends with its prefill, and on a busy one at about max(compute, link)
after it started. A non-pipelined transfer is started at the end of its prefill with every
byte released at once. The last byte arrives `delay_s` after it is sent.

Reads time only through the loop (`loop.time()`, `loop.call_at`), so it runs on the
virtual-clock loop as well as a real one.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, replace

BITS_PER_BYTE = 8
_EPS_BYTES = 1e-3  # below a milli-byte, a transfer is caught up / finished
_MIN_STEP_S = 1e-9  # never re-arm the timer at the same instant (float ulp)


@dataclass(frozen=True)
class LinkConfig:
    """One simulated link."""

    gbps: float
    """Capacity in Gbit/s (10^9 bits), shared by every transfer in flight."""
    delay_s: float = 0.0
    """One-way propagation delay added to every transfer's last byte."""
    name: str = "link"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.gbps) and self.gbps > 0):
            raise ValueError(
                f"link {self.name!r}: gbps must be a finite number > 0, got {self.gbps}"
            )
        if not (math.isfinite(self.delay_s) and self.delay_s >= 0):
            raise ValueError(f"link {self.name!r}: delay_s must be >= 0, got {self.delay_s}")

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9 / BITS_PER_BYTE


class _Flow:
    """One transfer: `total` bytes, released at `total/produce_s` bytes/s from `start`."""

    def __init__(self, total: float, start: float, produce_s: float, done: asyncio.Future[None]):
        self.total = total
        self.start = start
        self.end_produce = start + produce_s
        self.release_rate = total / produce_s if produce_s > 0 else math.inf
        self.sent = 0.0
        self.rate = 0.0
        self.done = done

    def released(self, now: float) -> float:
        if now >= self.end_produce:
            return self.total
        return self.total * (now - self.start) / (self.end_produce - self.start)

    def cap(self, now: float) -> float:
        """The most this flow can use now: its release rate once caught up, else unlimited."""
        producing = now < self.end_produce
        caught_up = self.sent >= self.released(now) - _EPS_BYTES
        return self.release_rate if producing and caught_up else math.inf

    def next_change(self, now: float) -> float:
        """Seconds until this flow's cap changes or it finishes, at its current rate."""
        if now < self.end_produce:
            dt = self.end_produce - now
            gap, gain = self.released(now) - self.sent, self.rate - self.release_rate
            if gap > _EPS_BYTES and gain > 0:
                dt = min(dt, gap / gain)  # catches up with the release front
            return dt
        return (self.total - self.sent) / self.rate if self.rate > 0 else math.inf


class SimLink:
    """A shared link. `transfer` returns a future that completes when the last byte arrives.

    Counters: `bytes_sent` (every completed transfer's bytes) and `transfers`.
    """

    def __init__(self, config: LinkConfig, loop: asyncio.AbstractEventLoop) -> None:
        self.config = config
        self._loop = loop
        self._flows: list[_Flow] = []
        self._last = loop.time()
        self._timer: asyncio.TimerHandle | None = None
        self.bytes_sent = 0.0
        self.transfers = 0

    @property
    def active(self) -> int:
        """Transfers still sending."""
        return len(self._flows)

    @property
    def bytes_moved(self) -> float:
        """Bytes sent so far, the in-flight transfers' progress included (for rates)."""
        now = self._loop.time()
        dt = now - self._last
        moving = sum(min(f.sent + f.rate * dt, f.released(now)) for f in self._flows)
        return self.bytes_sent + moving

    def set_gbps(self, gbps: float) -> None:
        """Change the capacity from now on (a link that degrades or recovers).

        Raises:
            ValueError: not a finite number > 0.
        """
        config = replace(self.config, gbps=gbps)  # validates
        self._advance()
        self.config = config
        self._reschedule()

    def transfer(self, nbytes: float, *, produce_s: float = 0.0) -> asyncio.Future[None]:
        """Start sending `nbytes`, released evenly over the next `produce_s` seconds (0: all
        available now). The future resolves when the last byte has arrived (after the
        delay); cancelling it does not stop the transfer.

        Raises:
            ValueError: negative size or production time.
        """
        if not (nbytes >= 0 and produce_s >= 0):
            raise ValueError(
                f"transfer needs nbytes >= 0 and produce_s >= 0, got {nbytes}, {produce_s}"
            )
        done: asyncio.Future[None] = self._loop.create_future()
        self._advance()
        now = self._loop.time()
        if nbytes <= _EPS_BYTES:
            self._deliver(done, now + produce_s, 0.0)
            return done
        self._flows.append(_Flow(float(nbytes), now, produce_s, done))
        self._reschedule()
        return done

    def _advance(self) -> None:
        """Move every flow forward to now at its current rate; retire finished ones."""
        now = self._loop.time()
        dt, self._last = now - self._last, now
        still: list[_Flow] = []
        for flow in self._flows:
            flow.sent = min(flow.sent + flow.rate * dt, flow.released(now))
            if flow.sent >= flow.total - _EPS_BYTES:
                self._deliver(flow.done, now, flow.total)
            else:
                still.append(flow)
        self._flows = still

    def _deliver(self, done: asyncio.Future[None], sent_at: float, nbytes: float) -> None:
        self.bytes_sent += nbytes
        self.transfers += 1
        self._loop.call_at(sent_at + self.config.delay_s, _resolve, done)

    def _allocate(self) -> None:
        """Max-min fair rates: capped flows below the fair share keep their cap."""
        now = self._loop.time()
        left, n = self.config.bytes_per_s, len(self._flows)
        for flow in sorted(self._flows, key=lambda f: f.cap(now)):
            share = left / n
            flow.rate = min(flow.cap(now), share)
            left -= flow.rate
            n -= 1

    def _reschedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._flows:
            return
        self._allocate()
        now = self._loop.time()
        dt = min(f.next_change(now) for f in self._flows)
        self._timer = self._loop.call_at(now + max(dt, _MIN_STEP_S), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._advance()
        self._reschedule()


def _resolve(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)

"""Arrival processes: when sessions start.

- `RateArrivals`: open loop at `rate` req/s with gamma inter-arrival gaps of shape
  `burstiness` (vLLM's definition: mean gap 1/rate, coefficient of variation
  1/sqrt(burstiness); burstiness 1 is Poisson, < 1 burstier, > 1 smoother).
- `TraceArrivals`: open loop at the trace's own timestamps, divided by `speedup`.
- `ClosedLoop`: `concurrency` sessions in flight, the next starting when one finishes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from prfaas.loadgen.workload import Session


@dataclass(frozen=True)
class RateArrivals:
    """Open-loop arrivals at a mean rate; the first session starts at time 0."""

    rate: float
    """Mean sessions per second; math.inf starts every session at once."""
    burstiness: float = 1.0
    """Gamma shape of the gaps: 1 Poisson, < 1 bursty, > 1 regular."""

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 req/s, got {self.rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be a finite number > 0, got {self.burstiness}")

    def describe(self) -> str:
        if math.isinf(self.rate):
            return "all at once"
        kind = "Poisson" if self.burstiness == 1.0 else f"gamma, burstiness {self.burstiness:g}"
        return f"{self.rate:g} req/s ({kind})"

    def gaps(self, rng: np.random.Generator) -> Iterator[float]:
        """Infinite inter-arrival gaps in seconds."""
        if math.isinf(self.rate):
            while True:
                yield 0.0
        scale = 1.0 / (self.rate * self.burstiness)
        while True:  # draw in chunks: one numpy call per 1024 gaps
            yield from rng.gamma(self.burstiness, scale, size=1024).tolist()

    def times(self, rng: np.random.Generator) -> Iterator[float]:
        """Arrival times: 0, then cumulative gaps."""
        t = 0.0
        for gap in self.gaps(rng):
            yield t
            t += gap


@dataclass(frozen=True)
class TraceArrivals:
    """Arrivals at the sessions' trace timestamps, compressed by `speedup`."""

    speedup: float = 1.0

    def __post_init__(self) -> None:
        if not (self.speedup > 0 and math.isfinite(self.speedup)):
            raise ValueError(f"speedup must be a finite number > 0, got {self.speedup}")

    def describe(self) -> str:
        return f"trace timestamps (x{self.speedup:g} speed)"


@dataclass(frozen=True)
class ClosedLoop:
    """A fixed number of sessions in flight."""

    concurrency: int

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")

    def describe(self) -> str:
        return f"closed loop, concurrency {self.concurrency}"


Arrivals = RateArrivals | TraceArrivals | ClosedLoop
OpenLoop = RateArrivals | TraceArrivals


def timed_sessions(
    arrivals: OpenLoop, sessions: Iterator[Session], rng: np.random.Generator
) -> Iterator[tuple[float, Session]]:
    """Pair each session with its start time (seconds from the run start), in order.

    Raises:
        ValueError: `TraceArrivals` with a session that has no timestamp.
    """
    if isinstance(arrivals, RateArrivals):
        yield from zip(arrivals.times(rng), sessions, strict=False)
        return
    for session in sessions:
        if session.timestamp_s is None:
            raise ValueError("trace-timestamp arrivals need a trace workload (mooncake:PATH)")
        yield session.timestamp_s / arrivals.speedup, session

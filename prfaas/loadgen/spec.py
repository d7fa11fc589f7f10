"""What to run (`BenchSpec`), what comes back (`RunResult`), and who runs it (`BenchRunner`).

A runner is the seam between `prfaas bench` and a target: `HttpRunner` drives a live server;
the simulator's virtual-clock runner plugs in here behind the same interface.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from prfaas.loadgen.arrivals import Arrivals
from prfaas.loadgen.records import RequestRecord
from prfaas.loadgen.workload import Workload


@dataclass(frozen=True)
class BenchSpec:
    """A reproducible run: workload, arrivals, a stopping rule, and the seed of everything."""

    workload: Workload
    arrivals: Arrivals
    num_requests: int | None = None
    """Stop after this many requests (turns) have been sent."""
    duration_s: float | None = None
    """Stop starting new requests after this many seconds (in-flight ones finish)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give a request count or a duration (or both)")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"number of requests must be >= 1, got {self.num_requests}")
        if self.duration_s is not None and not (
            self.duration_s > 0 and math.isfinite(self.duration_s)
        ):
            raise ValueError(
                f"duration must be a finite number of seconds > 0, got {self.duration_s}"
            )
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")


@dataclass(frozen=True)
class RunResult:
    """Everything a run measured."""

    target: str
    records: tuple[RequestRecord, ...]
    duration_s: float
    """From the first send to the last completion."""
    started_at: str
    """Wall-clock start (ISO 8601, UTC), for the report header only."""
    simulated: bool = False
    """True for virtual-clock runs: their numbers are simulated, never measurements."""


class Progress(Protocol):
    """Receives progress events (a live bar, or nothing)."""

    def start(self, total: int | None, duration_s: float | None) -> None:
        """The run begins; `total` requests or `duration_s` seconds, whichever is known."""
        ...

    def done(self, record: RequestRecord) -> None:
        """One request finished (ok or not)."""
        ...

    def stop(self) -> None:
        """The run ended."""
        ...


class NoProgress:
    """A `Progress` that shows nothing."""

    def start(self, total: int | None, duration_s: float | None) -> None:
        pass

    def done(self, record: RequestRecord) -> None:
        pass

    def stop(self) -> None:
        pass


class BenchRunner(Protocol):
    """Runs a spec against one target."""

    async def run(self, spec: BenchSpec, progress: Progress) -> RunResult:
        """Execute `spec`; request failures are records, not exceptions.

        Raises:
            TargetError: the target cannot be used at all (e.g. unreachable at start).
        """
        ...


class TargetError(RuntimeError):
    """A bench target that cannot be used; the message says why."""

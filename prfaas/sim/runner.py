"""Run one simulation: a workload through the real Router and simulated engines, on the
virtual clock, with the load generator's own driver, records and summary.

Stability is judged on the arrival window after a warm-up: `served_rate` counts requests
completed in [warmup, duration] and `offered_rate` requests that arrived in it; their
difference is exactly the growth of the number of requests in the system over the window,
so `served >= (1 - tolerance) * offered` means the queues did not grow.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from prfaas.loadgen.arrivals import Arrivals
from prfaas.loadgen.driver import Driver
from prfaas.loadgen.records import RequestRecord
from prfaas.loadgen.spec import BenchSpec, NoProgress, Progress
from prfaas.loadgen.workload import Workload
from prfaas.policies.profile import DeploymentProfile
from prfaas.sim.cluster import SimCluster
from prfaas.sim.deployments import Deployment, SimOptions
from prfaas.sim.measure import SimMetrics, measure
from prfaas.sim.sender import SimSender
from prfaas.sim.virtual_loop import run_virtual

DEFAULT_WARMUP_SHARE = 0.2


@dataclass(frozen=True)
class SimSpec:
    """One simulated run: a deployment under a workload and an arrival process."""

    deployment: Deployment
    workload: Workload
    arrivals: Arrivals
    duration_s: float
    """Simulated seconds of arrivals (in-flight requests then finish)."""
    num_requests: int | None = None
    seed: int = 0
    warmup_s: float | None = None
    """Start of the measurement window; None: automatic (see `settle_window`)."""

    def __post_init__(self) -> None:
        if not self.duration_s > 0:
            raise ValueError(f"simulated duration must be > 0 s, got {self.duration_s}")
        if self.warmup_s is not None and not 0 <= self.warmup_s < self.duration_s:
            raise ValueError(
                f"warmup must be in [0, duration={self.duration_s:g}) s, got {self.warmup_s}"
            )

    def settle_window(self, records: Sequence[RequestRecord]) -> tuple[float, float]:
        """The measurement window [warmup, duration]. Automatic warm-up: 20% of the duration,
        but at least twice the median request latency (the system must have filled up, or
        completions lag arrivals for a reason that is not overload), at most half of it."""
        if self.warmup_s is not None:
            return self.warmup_s, self.duration_s
        e2e = [r.e2e_s for r in records if r.e2e_s is not None]
        settle = 2 * float(np.median(e2e)) if e2e else 0.0
        start = min(max(DEFAULT_WARMUP_SHARE * self.duration_s, settle), 0.5 * self.duration_s)
        return start, self.duration_s


@dataclass(frozen=True)
class SimResult:
    """What a simulated run produced. Every number is simulated, never measured."""

    spec: SimSpec
    records: tuple[RequestRecord, ...]
    metrics: SimMetrics
    end_s: float
    """Simulated time of the last completion."""
    wall_s: float
    """Wall-clock seconds the simulation took (the only real measurement here)."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"simulated": True, "deployment": self.spec.deployment.name}
        out["policy"] = self.spec.deployment.policy
        out["workload"] = self.spec.workload.name
        out["duration_s"] = self.spec.duration_s
        out["requests"] = len(self.records)
        out.update(self.metrics.to_json())
        out["wall_s"] = self.wall_s
        return out


def simulate(
    profile: DeploymentProfile,
    spec: SimSpec,
    options: SimOptions,
    progress: Progress | None = None,
) -> SimResult:
    """Run `spec` on a fresh virtual-clock loop and measure it."""
    wall = time.perf_counter()
    bench = BenchSpec(spec.workload, spec.arrivals, spec.num_requests, spec.duration_s, spec.seed)
    records, cluster, end = run_bench(profile, spec.deployment, options, bench, progress)
    metrics = measure(spec.deployment, records, cluster, spec.settle_window(records), end)
    return SimResult(spec, tuple(records), metrics, end, time.perf_counter() - wall)


def run_bench(
    profile: DeploymentProfile,
    deployment: Deployment,
    options: SimOptions,
    bench: BenchSpec,
    progress: Progress | None = None,
) -> tuple[list[RequestRecord], SimCluster, float]:
    """Drive a load-generator spec through a simulated deployment on a fresh virtual-clock
    loop; returns the records, the cluster (for its counters) and the last completion time."""
    return run_virtual(_run(profile, deployment, options, bench, progress or NoProgress()))


async def _run(
    profile: DeploymentProfile,
    deployment: Deployment,
    options: SimOptions,
    bench: BenchSpec,
    progress: Progress,
) -> tuple[list[RequestRecord], SimCluster, float]:
    cluster = SimCluster(profile, deployment, options, bench.seed)
    driver = Driver(bench, SimSender(cluster.router, origin=0.0), progress)
    progress.start(bench.num_requests, bench.duration_s)
    try:
        records = await driver.run()
    finally:
        progress.stop()
    ends = [r.end_s for r in records if r.end_s is not None]
    return records, cluster, max(ends, default=bench.duration_s or 0.0)

"""The numbers of a simulated run: rates over the measurement window, latencies, egress,
route split, prefix hits, and each stage's throughput capacity as the simulation saw it.

`theta_*` are capacities, comparable to the model's Eq. 3-5: instances divided by the mean
time one request occupied an instance of the stage (prefill: queue head to KV sent; decode:
slot held), i.e. N / E[T] over the lengths that stage actually served.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from prfaas.loadgen.records import RequestRecord
from prfaas.sim.deployments import Deployment
from prfaas.sim.engines import StageCounters

if TYPE_CHECKING:
    from prfaas.sim.cluster import SimCluster

STABLE_TOLERANCE = 0.02  # served within 2% of offered


@dataclass(frozen=True)
class SimMetrics:
    """Simulated metrics of one run (seconds, req/s, Gbps)."""

    offered_rate: float
    served_rate: float
    stable: bool
    window_start_s: float
    """Measurement window [window_start_s, duration]: arrivals and completions counted in it."""
    completed: int
    failed: int
    ttft_mean_s: float | None
    ttft_p90_s: float | None
    tpot_mean_s: float | None
    e2e_mean_s: float | None
    egress_gbps: float
    link_gbps: float
    theta_prfaas: float | None
    theta_pd_p: float | None
    theta_pd_d: float | None
    p_offload: float
    lambda_capacity: float | None
    """min over stages of theta / (share of requests visiting the stage): the arrival rate
    at which the busiest simulated stage saturates (queueing-free stability limit)."""
    threshold_tokens: float | None
    prefix_hit_rate: float | None
    mean_incremental_tokens: float | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def measure(
    deployment: Deployment,
    records: Sequence[RequestRecord],
    cluster: SimCluster,
    window: tuple[float, float],
    end_s: float,
) -> SimMetrics:
    """Aggregate one run; latencies over the requests that arrived in `window`."""
    lo, hi = window
    span = hi - lo
    ok = [r for r in records if r.ok]
    arrived = [r for r in records if lo <= r.scheduled_s < hi]
    done = [r for r in ok if r.end_s is not None and lo <= r.end_s < hi]
    offered, served = len(arrived) / span, len(done) / span
    steady = [r for r in arrived if r.ok]
    ttft = [r.ttft_s for r in steady if r.ttft_s is not None]
    tpot = [r.tpot_s for r in steady if r.tpot_s is not None]
    e2e = [r.e2e_s for r in steady if r.e2e_s is not None]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    incremental = [r.incremental_tokens for r in ok if r.incremental_tokens is not None]
    p = sum(r.route == "prfaas" for r in ok) / len(ok) if ok else 0.0
    thetas = (
        _capacity([e.counters for e in cluster.prefills_in("prfaas")]),
        _capacity([e.counters for e in cluster.prefills_in("pd")]),
        _decode_capacity(cluster),
    )
    return SimMetrics(
        offered_rate=offered,
        served_rate=served,
        stable=served >= (1 - STABLE_TOLERANCE) * offered,
        window_start_s=lo,
        completed=len(ok),
        failed=len(records) - len(ok),
        ttft_mean_s=_mean(ttft),
        ttft_p90_s=float(np.percentile(ttft, 90)) if ttft else None,
        tpot_mean_s=_mean(tpot),
        e2e_mean_s=_mean(e2e),
        egress_gbps=cluster.egress_bytes * 8 / 1e9 / end_s if end_s > 0 else 0.0,
        link_gbps=deployment.egress_gbps,
        theta_prfaas=thetas[0],
        theta_pd_p=thetas[1],
        theta_pd_d=thetas[2],
        p_offload=p,
        lambda_capacity=_saturation(thetas, (p, 1.0 - p, 1.0)),
        threshold_tokens=deployment.threshold if deployment.policy == "prfaas" else None,
        prefix_hit_rate=sum(r.cached_tokens or 0 for r in ok) / prompt if prompt else None,
        mean_incremental_tokens=_mean([float(x) for x in incremental]),
    )


def _saturation(thetas: Sequence[float | None], shares: Sequence[float]) -> float | None:
    bounds = [t / s for t, s in zip(thetas, shares, strict=True) if t is not None and s > 0]
    return min(bounds) if bounds else None


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if values else None


def _capacity(counters: Sequence[StageCounters]) -> float | None:
    """N / mean occupancy per request (None: no such stage or it served nothing)."""
    done = sum(c.completed for c in counters)
    busy = sum(c.busy_s for c in counters)
    if not counters or done == 0 or busy <= 0:
        return None
    return len(counters) * done / busy


def _decode_capacity(cluster: SimCluster) -> float | None:
    engines = cluster.decodes()
    base = _capacity([e.counters for e in engines])
    return None if base is None else base * engines[0].batch_max

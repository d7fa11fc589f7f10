"""Conditional disaggregation: offload a long prefill only if it helps (NVIDIA Dynamo's
conditional disaggregation, Mooncake's TTFT-predicting conductor), and pull a cached prefix
across the link only if moving it beats recomputing it.

For one request the two TTFT predictions are

- PrfaaS: queue + `T_prfaas(l)` + `S_kv(l_total)` / spare egress (the decode gets the KV of
  the whole prompt, the prefix the PrfaaS instance cached included);
- local (PD prefill): queue + `T_pd(l)` (the PD cluster's RDMA hand-off is free here);

where each queue is the *predicted* backlog of the least-backlogged instance of that pool
(the seconds of prefill the gateway has dispatched there and not yet seen end, from the
profile), never the engines' current queue lengths: deciding on current load makes the
two pools oscillate in anti-phase (Mooncake). The spare egress is the measured link
capacity minus the measured egress, but at least the fair share a new transfer would get
(capacity / (transfers + 1)), since the link is shared, not first come first served.

Which objective wins: while the PD prefill pool has room, TTFT decides, so at low load a
long prompt stays local when local is faster (a slow link); once the local pool is
saturated, the throughput-optimal threshold governs, as in the paper, and the offload goes
ahead even when that request's own TTFT is predicted worse (`TTFTPrediction.offload`, which
says so). Saturated: the pool is offered at least as much work as it can do (the profile's
prefill seconds of what was dispatched there over the recent past, per second,
`LoadForecast.local_work_per_s`, over its instances: `TTFTPrediction.local_load`), or the
request would wait there at least as long as it computes, or it would wait at all while the
pool has been busy (every instance with work booked) at least `SATURATED_BUSY_SHARE` of the
recent past (`LoadForecast.local_busy_share`). The load tests read the load, not one
instant's queue: under a sustained load the local queue is often short for a moment, and a
long prompt kept local then delays every request that arrives behind it during its compute.
Offered more than it can do (a burst), a pool's queue only grows, so each second a long
prompt computes there is a second more for every request behind it until the load drops,
whatever its queue this instant; the busy share cannot read past one and lags a burst. At
half busy, the wait and busy tests roughly agree on average (one server with random arrivals
and service times, busy half the time, waits on average as long as it serves);
`prfaas/sim/SCHEDULING.md` tells what the live runs showed, and why the wait a long prompt
adds behind it is not priced below saturation (at the paper's scale it offloaded far more
onto a loaded PrfaaS cluster and doubled TTFT P90).

A prefix pull (`predict_pull`) moves `S_kv(prefix)` over the spare link to save computing
those tokens where the request runs; it pays only when the transfer is the shorter.

Pure: the gateway builds a `LoadForecast` per request (`gateway/scheduling/`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import msgspec

from prfaas.policies.tables import PiecewiseLinear

SATURATED_BUSY_SHARE = 0.5
"""A PD prefill pool busy this share of the recent past counts as saturated (see above)."""


@dataclass(frozen=True)
class PrefillCosts:
    """What a prefill costs, from the deployment profile: seconds on each cluster's
    hardware and the KV bytes it produces, against incremental tokens."""

    prfaas_prefill_s: PiecewiseLinear
    pd_prefill_s: PiecewiseLinear
    kv_bytes: PiecewiseLinear

    def prefill_s(self, cluster: str, tokens: int) -> float:
        table = self.prfaas_prefill_s if cluster == "prfaas" else self.pd_prefill_s
        return max(float(table(max(tokens, 1))), 0.0)

    def min_kv_rate(self) -> float:
        """The lowest KV production rate (Eq. 1's `Phi_kv`, bytes/s) of either cluster at
        the lengths the profile measured: a link with more spare bandwidth than this makes
        pulling some cached prefixes cheaper than recomputing them (inf: none measured)."""
        rates = [
            float(self.kv_bytes(x)) / seconds
            for table in (self.prfaas_prefill_s, self.pd_prefill_s)
            for x in table.xs
            if x >= 1 and (seconds := float(table(x))) > 0
        ]
        return min(rates, default=math.inf)


@dataclass(frozen=True)
class LinkState:
    """The cross-cluster link as last measured (bytes/s)."""

    capacity_bytes_per_s: float
    egress_bytes_per_s: float = 0.0
    active_transfers: int = 0

    def spare_bytes_per_s(self) -> float:
        """Unused capacity, floored at the fair share of one more transfer."""
        fair = self.capacity_bytes_per_s / (self.active_transfers + 1)
        return max(self.capacity_bytes_per_s - self.egress_bytes_per_s, fair)


class LoadForecast(msgspec.Struct, frozen=True):
    """What the routing policy may predict with, for one request."""

    costs: PrefillCosts
    backlog_s: Mapping[str, float]
    """Predicted seconds of prefill work queued ahead, per instance id (absent: idle)."""
    link: LinkState | None = None
    """None: no link telemetry, the transfer term is left out."""
    conditional: bool = True
    """Whether an offload past `t` is conditional on these predictions (prefix pulls are
    checked against them either way)."""
    local_busy_share: float = 0.0
    """The share of the recent past in which the PD prefill pool had no idle instance
    (the chance that a request waits there)."""
    local_work_per_s: float = 0.0
    """Predicted prefill seconds dispatched to the PD prefill pool per second, over the
    recent past: the load offered to the pool, in instances' worth."""


@dataclass(frozen=True)
class TTFTPrediction:
    """Predicted time to first token on each side, in seconds, and what the local side's
    prediction is made of (its queue and its own compute)."""

    prfaas_s: float
    local_s: float
    local_wait_s: float = 0.0
    local_compute_s: float = 0.0
    local_busy_share: float = 0.0
    """The share of the recent past in which the PD prefill pool was busy (the forecast's)."""
    local_load: float = 0.0
    """The work offered to each PD prefill instance, as a share of what it can do (the
    forecast's, per instance)."""

    @property
    def faster(self) -> bool:
        """PrfaaS is predicted to answer strictly first."""
        return self.prfaas_s < self.local_s

    @property
    def local_saturated(self) -> bool:
        """The PD prefill pool is offered at least as much as it can do, or the request
        would wait there, at least as long as it computes there or while the pool is busy
        most of the time: the pool is the bottleneck, and throughput (the threshold)
        governs."""
        if self.local_load >= 1:
            return True
        if self.local_wait_s <= 0:
            return False
        busy = self.local_busy_share >= SATURATED_BUSY_SHARE
        return busy or self.local_wait_s >= self.local_compute_s

    @property
    def offload(self) -> bool:
        """PrfaaS strictly beats local, or local is saturated (the threshold governs)."""
        return self.faster or self.local_saturated

    def describe(self) -> str:
        sign = "<" if self.faster else ">="
        text = f"predicted TTFT prfaas {self.prfaas_s:.2f}s {sign} local {self.local_s:.2f}s"
        if self.faster or not self.local_saturated:
            return text
        wait, compute = self.local_wait_s, self.local_compute_s
        if self.local_load >= 1:
            why = f"PD prefill offered {self.local_load:.0%} of what it can do"
        elif wait >= compute:
            why = f"local queue {wait:.2f}s >= its compute {compute:.2f}s"
        else:
            why = f"local queue {wait:.2f}s, pool busy {self.local_busy_share:.0%} of the time"
        return f"{text}; {why}: the threshold governs"


@dataclass(frozen=True)
class PullPrediction:
    """A prefix pull: seconds to move the prefix's KV against seconds of compute it saves."""

    tokens: int
    transfer_s: float
    recompute_s: float

    @property
    def pays(self) -> bool:
        return self.transfer_s < self.recompute_s

    def describe(self) -> str:
        sign = "<" if self.pays else ">="
        return (f"pull of {self.tokens} tokens {self.transfer_s:.2f}s {sign} recompute "
                f"{self.recompute_s:.2f}s")  # fmt: skip


def least_backlog(forecast: LoadForecast, instance_ids: Iterable[str]) -> float:
    """The smallest predicted backlog over `instance_ids` (inf for an empty pool)."""
    get = forecast.backlog_s.get
    return min((get(i, 0.0) for i in instance_ids), default=math.inf)


def transfer_s(forecast: LoadForecast, tokens: int) -> float:
    """Seconds to move the KV of `tokens` over the spare link (0: no link telemetry)."""
    if forecast.link is None or tokens <= 0:
        return 0.0
    spare = forecast.link.spare_bytes_per_s()
    return float(forecast.costs.kv_bytes(tokens)) / spare if spare > 0 else math.inf


def predict_ttft(
    forecast: LoadForecast,
    *,
    prfaas_tokens: int,
    local_tokens: int,
    shipped_tokens: int,
    prfaas_pool: Iterable[str],
    local_pool: Iterable[str],
) -> TTFTPrediction:
    """Both predictions for a request that would compute `prfaas_tokens` in PrfaaS (then
    ship the KV of `shipped_tokens` to the decode) or `local_tokens` in the PD cluster (they
    differ when the clusters cache different prefixes)."""
    costs = forecast.costs
    prfaas = (
        least_backlog(forecast, prfaas_pool)
        + costs.prefill_s("prfaas", prfaas_tokens)
        + transfer_s(forecast, shipped_tokens)
    )
    local = list(local_pool)
    wait = least_backlog(forecast, local)
    compute = costs.prefill_s("pd", local_tokens)
    load = forecast.local_work_per_s / max(len(local), 1)
    return TTFTPrediction(prfaas, wait + compute, wait, compute, forecast.local_busy_share, load)


def predict_pull(
    forecast: LoadForecast, *, cluster: str, total_tokens: int, own_prefix: int, pulled: int
) -> PullPrediction:
    """A pull of the `pulled`-token prefix into `cluster`, whose computing instance caches
    `own_prefix` of the `total_tokens` prompt: the KV of the whole pulled prefix crosses
    the link (the holder exports it whole), and saves computing `pulled - own_prefix`
    tokens there."""
    costs = forecast.costs
    saved = costs.prefill_s(cluster, total_tokens - own_prefix) - costs.prefill_s(
        cluster, total_tokens - pulled
    )  # fmt: skip
    return PullPrediction(pulled, transfer_s(forecast, pulled), max(saved, 0.0))

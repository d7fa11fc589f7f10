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

Which objective wins: at low load TTFT decides, so a long prompt stays local when local is
faster (a slow link); as the PD prefill pool fills, the wait a prompt kept local adds behind
it counts too (below), and once the pool is saturated the throughput-optimal threshold
governs, as in the paper, and the offload goes ahead even when that request's own TTFT is
predicted worse (`TTFTPrediction.offload`, which says so). Saturated: the request would wait
there at least as long as it computes, or it would wait at all while the pool has been busy
(every instance with work booked) at least `SATURATED_BUSY_SHARE` of the recent past
(`LoadForecast.local_busy_share`). The second test reads the load, not one instant's queue:
under a sustained load the local queue is often short for a moment, and a long prompt kept
local then delays every request that arrives behind it during its compute. At half, the two
tests roughly agree on average (one server with random arrivals and service times, busy half
the time, waits on average as long as it serves); `prfaas/sim/SCHEDULING.md` tells what the
live runs showed.

Between the two, a prompt that TTFT and saturation would keep local (the pool idle now, or
its wait short) is still offloaded when keeping it would add more wait to the requests
arriving behind it than the offload costs it (`TTFTPrediction.delays_others`, priced by
`delay_behind_s` on the load offered to the pool): what a request's own TTFT leaves out, and
what decides a burst's P90, since the pool serves most requests. At low load it is near
zero, so TTFT decides as before; as the offered load nears what the pool can do it grows
without bound, so the threshold governs. The offered load, not the busy share, since a burst
offers more than the pool can do while the busy share cannot read past one and lags. Only
the local pool's queue is priced: the offloaded requests are the tail already, and the
trimmer answers the link's queue.

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
    local_arrivals_per_s: float = 0.0
    """Requests dispatched to the PD prefill pool per second, over the recent past."""
    local_work_per_s: float = 0.0
    """Predicted prefill seconds dispatched to the PD prefill pool per second, over the
    recent past: the load offered to the pool, in instances' worth."""


def delay_behind_s(arrivals_per_s: float, compute_s: float, load: float) -> float:
    """The wait, summed over the requests arriving behind it, that `compute_s` more work
    adds to a first-come-first-served server offered `load` (the share of its time the
    arrivals ask for) by `arrivals_per_s` random arrivals: its M/G/1 externality. The extra
    work drains only as fast as the server would have idled, in `compute_s / (1 - load)`
    seconds, and the arrivals meanwhile wait `compute_s / 2` longer on average. Infinite
    for a server offered as much as it can do or more (the queue only grows)."""
    if arrivals_per_s <= 0 or compute_s <= 0:
        return 0.0
    if load >= 1:
        return math.inf
    return arrivals_per_s * compute_s**2 / (2 * (1 - load))


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
    local_delay_s: float = 0.0
    """The wait the local compute would add to the requests arriving behind it, summed
    (`delay_behind_s`)."""
    local_load: float = 0.0
    """The load offered to each PD prefill instance (the forecast's, per instance)."""

    @property
    def faster(self) -> bool:
        """PrfaaS is predicted to answer strictly first."""
        return self.prfaas_s < self.local_s

    @property
    def delays_others(self) -> bool:
        """PrfaaS is slower for this request, by less than the wait its local compute would
        add behind it: the offload costs less in all."""
        return not self.faster and self.prfaas_s - self.local_s < self.local_delay_s

    @property
    def local_saturated(self) -> bool:
        """The request would wait in the PD prefill pool, at least as long as it computes
        there or while the pool is busy most of the time: the pool is the bottleneck, and
        throughput (the threshold) governs."""
        if self.local_wait_s <= 0:
            return False
        busy = self.local_busy_share >= SATURATED_BUSY_SHARE
        return busy or self.local_wait_s >= self.local_compute_s

    @property
    def offload(self) -> bool:
        """PrfaaS strictly beats local, or keeping the request would delay those behind it
        by more than the offload costs it, or local is saturated (the threshold governs)."""
        return self.faster or self.local_saturated or self.delays_others

    def describe(self) -> str:
        sign = "<" if self.faster else ">="
        text = f"predicted TTFT prfaas {self.prfaas_s:.2f}s {sign} local {self.local_s:.2f}s"
        if self.faster:
            return text
        if self.local_saturated:
            wait, compute = self.local_wait_s, self.local_compute_s
            why = (f"local queue {wait:.2f}s >= its compute {compute:.2f}s"
                   if wait >= compute else
                   f"local queue {wait:.2f}s, pool busy {self.local_busy_share:.0%} of the "
                   "time")  # fmt: skip
            return f"{text}; {why}: the threshold governs"
        if self.local_delay_s > 0:
            sign = "<" if self.delays_others else ">="
            delay = self.local_delay_s
            behind = "the unbounded wait" if math.isinf(delay) else f"the {delay:.2f}s"
            text += (f"; by {self.prfaas_s - self.local_s:.2f}s {sign} {behind} its compute "
                     f"adds behind it (PD prefill load {self.local_load:.0%})")  # fmt: skip
        return text


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
    # the pool's arrivals and work spread over its instances: per instance, as one server
    n = max(len(local), 1)
    load = forecast.local_work_per_s / n
    delay = delay_behind_s(forecast.local_arrivals_per_s / n, compute, load)
    return TTFTPrediction(prfaas, wait + compute, wait, compute, forecast.local_busy_share,
                          delay, load)  # fmt: skip


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

"""Conditional disaggregation: offload a long prefill only if PrfaaS is predicted to answer
first (NVIDIA Dynamo's conditional disaggregation, Mooncake's TTFT-predicting conductor).

For one request the two predictions are

- PrfaaS: queue + `T_prfaas(l)` + `S_kv(l)` / spare egress;
- local (PD prefill): queue + `T_pd(l)` (the PD cluster's RDMA hand-off is free here);

where each queue is the *predicted* backlog of the least-backlogged instance of that pool
(the seconds of prefill the gateway has dispatched there and not yet seen end, from the
profile), never the engines' current queue lengths: deciding on current load makes the
two pools oscillate in anti-phase (Mooncake). The spare egress is the measured link
capacity minus the measured egress, but at least the fair share a new transfer would get
(capacity / (transfers + 1)), since the link is shared, not first come first served.

Pure: the gateway builds a `LoadForecast` per request (`gateway/scheduling/`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import msgspec

from prfaas.policies.tables import PiecewiseLinear


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


@dataclass(frozen=True)
class TTFTPrediction:
    """Predicted time to first token on each side, in seconds."""

    prfaas_s: float
    local_s: float

    @property
    def offload(self) -> bool:
        """PrfaaS strictly beats local."""
        return self.prfaas_s < self.local_s

    def describe(self) -> str:
        sign = "<" if self.offload else ">="
        return f"predicted TTFT prfaas {self.prfaas_s:.2f}s {sign} local {self.local_s:.2f}s"


def least_backlog(forecast: LoadForecast, instance_ids: Iterable[str]) -> float:
    """The smallest predicted backlog over `instance_ids` (inf for an empty pool)."""
    get = forecast.backlog_s.get
    return min((get(i, 0.0) for i in instance_ids), default=math.inf)


def predict_ttft(
    forecast: LoadForecast,
    *,
    prfaas_tokens: int,
    local_tokens: int,
    prfaas_pool: Iterable[str],
    local_pool: Iterable[str],
) -> TTFTPrediction:
    """Both predictions for a request that would compute `prfaas_tokens` in PrfaaS or
    `local_tokens` in the PD cluster (they differ when the clusters cache different
    prefixes)."""
    costs = forecast.costs
    transfer = 0.0
    if forecast.link is not None and prfaas_tokens > 0:
        spare = forecast.link.spare_bytes_per_s()
        kv = float(costs.kv_bytes(prfaas_tokens))
        transfer = kv / spare if spare > 0 else math.inf
    prfaas = (
        least_backlog(forecast, prfaas_pool) + costs.prefill_s("prfaas", prfaas_tokens) + transfer
    )
    local = least_backlog(forecast, local_pool) + costs.prefill_s("pd", local_tokens)
    return TTFTPrediction(prfaas, local)

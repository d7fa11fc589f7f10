"""Routing policies: a snapshot of one request and the instances in, a `RouteDecision` out.

Pure: no I/O, no clock. The gateway's Router and the simulator build the snapshot (cached
prefix per instance from the global KV index, load from engine stats, the current threshold
and bandwidth regime) and dispatch what the policy decides.

The PrfaaS rule (DESIGN.md section 2, paper 3.4.3) is applied to the *incremental* length,
never the raw prompt length:
- bandwidth-scarce: PD-prefill if `l_total - l_pd <= t`, else PrfaaS;
- bandwidth-abundant: with `l_prefix = max(l_prfaas, l_pd)`, PD-prefill if
  `l_total - l_prefix <= t`, else PrfaaS; when the longer cache sits in the other cluster,
  that prefix is transferred to the computing cluster first.

With a `LoadForecast` in the snapshot (the short-term scheduler's), a request the threshold
sends to PrfaaS goes there only if its predicted PrfaaS TTFT also beats its predicted local
TTFT, or the PD prefill pool is saturated (conditional disaggregation, `ttft_forecast.py`);
otherwise it stays in PD. And a prefix pull of the abundant regime happens only when moving
the prefix is predicted faster than recomputing it where the request runs; otherwise the
request is routed as in the scarce regime, on what each cluster caches itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from functools import cached_property
from typing import ClassVar, Literal

import msgspec

from prfaas.policies.ttft_forecast import (
    LoadForecast,
    PullPrediction,
    TTFTPrediction,
    predict_pull,
    predict_ttft,
)

Route = Literal["prfaas", "pd"]
Regime = Literal["bandwidth_scarce", "bandwidth_abundant"]
PRFAAS: Route = "prfaas"
PD: Route = "pd"
# A prefix cached on this share of the prompt makes affinity beat load (SGLang router style).
AFFINITY_SHARE = 0.5


class NoInstanceAvailable(RuntimeError):
    """No healthy instance can take the request (names the missing role and cluster)."""


# The per-request values are frozen msgspec Structs: built several times per request on the
# gateway's hot path, they cost about half as much as frozen dataclasses (no
# `object.__setattr__` per field), with the same typed, checked, immutable fields.


class InstanceView(msgspec.Struct, frozen=True):
    """One instance as the policy sees it for this request."""

    instance_id: str
    cluster: Route
    role: Literal["prefill", "decode", "both"]
    cached_tokens: int = 0
    load: int = 0
    healthy: bool = True

    def serves(self, role: str) -> bool:
        return self.healthy and (self.role == role or self.role == "both")


class RoutingSnapshot(msgspec.Struct, frozen=True, dict=True):
    """Everything a policy may look at for one request.

    A snapshot is immutable, so what the policies ask of it repeatedly (`pool`,
    `cached_in`) is computed once, on first use, and kept beside the fields (`dict=True`:
    not a field, so equality, hash and repr are unchanged). Built-in and third-party
    policies use the same accessors.
    """

    total_tokens: int
    instances: tuple[InstanceView, ...]
    threshold: float
    regime: Regime = "bandwidth_scarce"
    forecast: LoadForecast | None = None
    """Predicted load and costs (conditional disaggregation, prefix pulls); None: threshold
    only."""

    def pool(self, cluster: Route | None, role: str) -> tuple[InstanceView, ...]:
        """Healthy instances serving `role` in `cluster` (any cluster for None), in order."""
        pools = self._pools
        pool = pools.get((cluster, role))
        if pool is None:
            pool = pools[cluster, role] = tuple(
                [i for i in self.instances if i.serves(role) and cluster in (None, i.cluster)]
            )
        return pool

    def cached_in(self, cluster: Route) -> int:
        """The longest prefix any healthy instance of `cluster` caches (0 if none)."""
        return self._maxima.get(cluster, 0)

    @cached_property
    def _pools(self) -> dict[tuple[Route | None, str], tuple[InstanceView, ...]]:
        return {}

    @cached_property
    def _maxima(self) -> dict[str, int]:
        maxima: dict[str, int] = {}
        for i in self.instances:
            if i.healthy and i.cached_tokens > maxima.get(i.cluster, -1):
                maxima[i.cluster] = i.cached_tokens
        return maxima


class RouteDecision(msgspec.Struct, frozen=True):
    """Where to prefill and decode one request, and why."""

    route: Route
    prefill_instance: str
    decode_instance: str
    incremental_tokens: int
    cached_tokens: int
    prefix_transfer_from: Route | None = None
    reason: str = ""
    prefix_source: str | None = None
    """The instance of `prefix_transfer_from` holding that prefix (the longest there)."""
    prediction: TTFTPrediction | None = None
    """The TTFT predictions an offload past `t` was decided on (None: none consulted)."""
    pull: PullPrediction | None = None
    """The prefix pull the abundant regime checked (made or not; None: none in question)."""


def _affinity_key(i: InstanceView) -> tuple[int, int, str]:
    return -i.cached_tokens, i.load, i.instance_id


def _load_key(i: InstanceView) -> tuple[int, int, str]:
    return i.load, -i.cached_tokens, i.instance_id


def pick_instance(snapshot: RoutingSnapshot, cluster: Route | None, role: str) -> InstanceView:
    """The instance of `cluster` (any for None) to run `role` for this request: prefix
    affinity when one caches a large share of the prompt, else least load (ties broken by
    longer prefix, then by id for determinism).

    Raises:
        NoInstanceAvailable: no healthy instance serves `role` there.
    """
    pool = snapshot.pool(cluster, role)
    if not pool:
        where = f"the {cluster} cluster" if cluster else "any cluster"
        raise NoInstanceAvailable(f"no healthy {role} instance in {where}")
    if len(pool) == 1:
        return pool[0]
    best_cached = max(i.cached_tokens for i in pool)
    if snapshot.total_tokens and best_cached >= AFFINITY_SHARE * snapshot.total_tokens:
        return min(pool, key=_affinity_key)
    return min(pool, key=_load_key)


class BaseRoutingPolicy(ABC):
    """A routing policy. Subclasses set `name` and implement `decide`; third-party policies
    register under the entry-point group `prfaas.policies` (name -> class)."""

    name: ClassVar[str]

    @abstractmethod
    def decide(self, snapshot: RoutingSnapshot) -> RouteDecision:
        """Choose prefill and decode instances for one request. Pure; does not mutate.

        Raises:
            NoInstanceAvailable: no healthy instance for a needed role.
        """

    def decision(
        self,
        snapshot: RoutingSnapshot,
        prefill: InstanceView,
        reason: str,
        prefix_from: Route | None = None,
        prediction: TTFTPrediction | None = None,
    ) -> RouteDecision:
        """The decision to prefill on `prefill` (and pull the prefix cached in
        `prefix_from` first, if given) and decode on the PD cluster's pick; `prediction`:
        the TTFT predictions it was made on, if any."""
        decode = pick_instance(snapshot, PD, "decode")
        cached, source = prefill.cached_tokens, None
        if prefix_from is not None:
            cached = max(cached, snapshot.cached_in(prefix_from))
            holders = [i for i in snapshot.instances if i.healthy and i.cluster == prefix_from]
            source = min(holders, key=_affinity_key).instance_id
        return RouteDecision(
            prefill.cluster,
            prefill.instance_id,
            decode.instance_id,
            snapshot.total_tokens - cached,
            cached,
            prefix_from,
            reason,
            source,
            prediction,
        )


class PrfaasPolicy(BaseRoutingPolicy):
    """Threshold on the incremental length, with the two bandwidth regimes."""

    name = "prfaas"

    def decide(self, snapshot: RoutingSnapshot) -> RouteDecision:
        abundant = snapshot.regime == "bandwidth_abundant"
        decision = self._decide(snapshot, abundant)
        forecast = snapshot.forecast
        if decision.prefix_transfer_from is None or forecast is None:
            return decision
        pull = _predict_pull(snapshot, forecast, decision)
        if pull.pays:
            reason = f"{decision.reason}; {pull.describe()}"
            return msgspec.structs.replace(decision, reason=reason, pull=pull)
        local = self._decide(snapshot, abundant=False)
        reason = f"{local.reason}; no {pull.describe()}"
        return msgspec.structs.replace(local, reason=reason, pull=pull)

    def _decide(self, snapshot: RoutingSnapshot, abundant: bool) -> RouteDecision:
        """The threshold rule on the prefix each cluster caches (`abundant`: the longer of
        the two, pulled across when the other cluster holds it)."""
        l_pd = snapshot.cached_in(PD)
        prefix = max(l_pd, snapshot.cached_in(PRFAAS)) if abundant else l_pd
        uncached, t = snapshot.total_tokens - prefix, snapshot.threshold
        sign = "<=" if uncached <= t else ">"
        reason = f"{snapshot.regime}: {uncached} uncached {sign} t={t:g}"
        route: Route = PRFAAS if uncached > t else PD
        prediction = None
        if route == PRFAAS and not snapshot.pool(PRFAAS, "prefill"):
            route, reason = PD, reason + "; no healthy PrfaaS prefill, fell back to PD"
        elif route == PD and not snapshot.pool(PD, "prefill") and snapshot.pool(PRFAAS, "prefill"):
            route, reason = PRFAAS, reason + "; no healthy PD prefill, fell back to PrfaaS"
        elif (
            route == PRFAAS
            and snapshot.pool(PD, "prefill")
            and (snapshot.forecast is not None and snapshot.forecast.conditional)
        ):
            prediction = _predict(snapshot, snapshot.forecast, prefix, abundant)
            if not prediction.offload:
                route = PD
            reason += f"; {prediction.describe()}"
        prefix_from: Route | None = None
        if abundant:
            other: Route = PRFAAS if route == PD else PD
            if snapshot.cached_in(other) > snapshot.cached_in(route):
                prefix_from = other
        prefill = pick_instance(snapshot, route, "prefill")
        return self.decision(snapshot, prefill, reason, prefix_from, prediction)


def _predict(
    snapshot: RoutingSnapshot, forecast: LoadForecast, local_prefix: int, abundant: bool
) -> TTFTPrediction:
    """Both TTFT predictions of a request the threshold sends to PrfaaS: there it computes
    what the PrfaaS cluster lacks (or, `abundant`, what neither cluster caches), and the
    decode gets the KV of the whole prompt over the link."""
    total = snapshot.total_tokens
    remote = snapshot.cached_in(PRFAAS)
    if abundant:
        remote = max(remote, snapshot.cached_in(PD))
    return predict_ttft(
        forecast,
        prfaas_tokens=total - remote,
        local_tokens=total - local_prefix,
        shipped_tokens=total,
        prfaas_pool=[i.instance_id for i in snapshot.pool(PRFAAS, "prefill")],
        local_pool=[i.instance_id for i in snapshot.pool(PD, "prefill")],
    )


def _predict_pull(
    snapshot: RoutingSnapshot, forecast: LoadForecast, decision: RouteDecision
) -> PullPrediction:
    """The pull `decision` makes: the prefix its source holds, into its prefill instance."""
    own = next(i.cached_tokens for i in snapshot.instances
               if i.instance_id == decision.prefill_instance)  # fmt: skip
    return predict_pull(forecast, cluster=decision.route, total_tokens=snapshot.total_tokens,
                        own_prefix=own, pulled=decision.cached_tokens)  # fmt: skip


class HomogeneousPolicy(BaseRoutingPolicy):
    """Every prefill in the PD cluster (the homogeneous PD baseline)."""

    name = "homogeneous"

    def decide(self, snapshot: RoutingSnapshot) -> RouteDecision:
        return self.decision(snapshot, pick_instance(snapshot, PD, "prefill"), "homogeneous")


class NaivePolicy(BaseRoutingPolicy):
    """Every prefill in the PrfaaS cluster, no threshold (the naive heterogeneous baseline)."""

    name = "naive"

    def decide(self, snapshot: RoutingSnapshot) -> RouteDecision:
        return self.decision(snapshot, pick_instance(snapshot, PRFAAS, "prefill"), "naive")


class CacheAwarePolicy(BaseRoutingPolicy):
    """Longest cached prefix across every prefill instance, else least load (SGLang router)."""

    name = "cache-aware"

    def decide(self, snapshot: RoutingSnapshot) -> RouteDecision:
        return self.decision(snapshot, pick_instance(snapshot, None, "prefill"), "cache-aware")


BUILTIN_POLICIES: dict[str, type[BaseRoutingPolicy]] = {
    cls.name: cls for cls in (PrfaasPolicy, HomogeneousPolicy, NaivePolicy, CacheAwarePolicy)
}

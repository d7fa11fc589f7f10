"""The planner: exhaustive grid over threshold t and PD split N_p for the PrfaaS-PD deployment,
plus the profile's two baselines (homogeneous PD, naive heterogeneous), all with Eq. 1-8."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from prfaas.policies import throughput as tp
from prfaas.policies.distributions import Array, LengthDistribution
from prfaas.policies.profile import DeploymentProfile, HardwareProfile

DEFAULT_T_STEP = 64


@dataclass(frozen=True)
class DeploymentResult:
    """One deployment at its best configuration. None marks a stage that does not exist."""

    name: str
    lambda_max: float
    theta_prfaas: float | None
    theta_pd_p: float | None
    theta_pd_d: float
    n_prfaas: int
    n_p: int
    n_d: int
    threshold_tokens: float | None
    p_offload: float
    l_long: float | None
    l_short: float | None
    egress_gbps: float | None
    link_gbps: float | None
    bottleneck: str

    @property
    def link_utilisation(self) -> float | None:
        if self.egress_gbps is None or not self.link_gbps:
            return None
        return self.egress_gbps / self.link_gbps

    def to_json(self) -> dict[str, Any]:
        out = {k: _finite_or_none(v) for k, v in asdict(self).items() if k != "name"}
        out["link_utilisation"] = _finite_or_none(self.link_utilisation)
        return out


@dataclass(frozen=True)
class PlanGrid:
    """The searched surface, for Figure 5: rows are N_p values, columns thresholds."""

    thresholds: Array  # (T,)
    n_p: Array  # (K,)
    lambda_max: Array  # (K, T)
    prfaas_bound: Array  # (T,) Theta_prfaas / p
    pd_prefill_bound: Array  # (K, T) Theta_pd_p / (1 - p)
    decode_bound: Array  # (K,) Theta_pd_d


@dataclass(frozen=True)
class PlanReport:
    """The planner's answer: the PrfaaS-PD optimum, the baselines, and the searched grid."""

    exact_expectation: bool
    prfaas_pd: DeploymentResult
    homogeneous: DeploymentResult | None
    naive_heterogeneous: DeploymentResult | None
    grid: PlanGrid

    @property
    def ratio_vs_homogeneous(self) -> float | None:
        return _ratio(self.prfaas_pd, self.homogeneous)

    @property
    def ratio_vs_naive(self) -> float | None:
        return _ratio(self.prfaas_pd, self.naive_heterogeneous)

    def to_json(self) -> dict[str, Any]:
        main = self.prfaas_pd.to_json()
        main["ratio_vs_homogeneous"] = _finite_or_none(self.ratio_vs_homogeneous)
        main["ratio_vs_naive"] = _finite_or_none(self.ratio_vs_naive)
        return {
            "prfaas_pd": main,
            "homogeneous": self.homogeneous and self.homogeneous.to_json(),
            "naive_heterogeneous": self.naive_heterogeneous and self.naive_heterogeneous.to_json(),
            "evaluation": "exact_expectation" if self.exact_expectation else "representative",
        }


def _finite_or_none(v: Any) -> Any:
    if isinstance(v, float | np.floating) and not math.isfinite(v):
        return None
    return float(v) if isinstance(v, np.floating) else v


def _argmin(stages: dict[str, Any]) -> str:
    """The name of the stage with the lowest throughput bound."""
    return min(stages, key=stages.__getitem__)


def _ratio(a: DeploymentResult, b: DeploymentResult | None) -> float | None:
    return a.lambda_max / b.lambda_max if b is not None and b.lambda_max > 0 else None


def threshold_grid(dist: LengthDistribution, step: int = DEFAULT_T_STEP) -> Array:
    """Thresholds from the shortest to the longest length, `step` tokens apart, both ends in."""
    if step <= 0:
        raise ValueError(f"threshold step must be positive, got {step}")
    grid = np.arange(dist.lo, dist.hi, step, dtype=np.float64)
    return np.append(grid, dist.hi)


def _decode_rate(hw: HardwareProfile, n_d: Any, output_tokens: int) -> Array:
    assert hw.decode_batch_max is not None and hw.decode_step_seconds is not None
    return tp.theta_pd_decode(n_d, hw.decode_batch_max, hw.decode_step_seconds, output_tokens)


def _best(lam: Array, tiebreak: Array) -> tuple[int, ...]:
    """Index of the highest Lambda_max; among ties, the one whose prefill bounds have the most
    slack (so a flat decode-bound plateau resolves to its balanced point, Eq. 7)."""
    top = np.nanmax(lam)
    candidates = np.where(lam >= top * (1 - 1e-12), tiebreak, -np.inf)
    return tuple(int(i) for i in np.unravel_index(np.argmax(candidates), lam.shape))


@dataclass(frozen=True)
class SplitOptimum:
    """The best threshold for one fixed PD split, and the stage bounds there (req/s)."""

    n_p: int
    threshold_tokens: float
    lambda_max: float
    prefill_bound: float
    """min(Theta_prfaas / p, Theta_pd_p / (1 - p)): the prefill side's arrival-rate limit."""
    decode_bound: float
    """Theta_pd_d."""


def best_for_split(grid: PlanGrid, n_p: int) -> SplitOptimum:
    """The optimum over thresholds with N_p fixed (the planner's tie-break).

    Raises:
        ValueError: `n_p` is not a split the grid searched.
    """
    k = _split_row(grid, n_p)
    prefill = np.fmin(grid.prfaas_bound, grid.pd_prefill_bound[k])
    (j,) = _best(grid.lambda_max[k], prefill)
    return SplitOptimum(
        n_p,
        float(grid.thresholds[j]),
        float(grid.lambda_max[k, j]),
        float(prefill[j]),
        float(grid.decode_bound[k]),
    )


def robust_threshold(grid: PlanGrid, others: Sequence[PlanGrid], n_p: int) -> float:
    """The threshold for split `n_p` whose lowest Lambda_max over `grid` and `others` (the
    same deployment planned on other estimates of the workload, e.g. a standard error off)
    is highest: max-min over the estimates, ties broken as `best_for_split` breaks them.

    Why: Lambda_max(t) is lopsided where the link binds. Below the optimum every step of t
    sends more KV over the link and the rate falls steeply; above it the PD prefill takes
    a little more and the rate falls gently. A set-point planned on a noisy estimate that
    lands a little low loses much more than one that lands a little high, so this one errs
    toward the gentle side by as much as the estimate's noise says.

    Raises:
        ValueError: `n_p` is not a split every grid searched.
    """
    k = _split_row(grid, n_p)
    worst = grid.lambda_max[k].copy()
    for other in others:
        row = other.lambda_max[_split_row(other, n_p)]
        worst = np.fmin(worst, np.interp(grid.thresholds, other.thresholds, row))
    (j,) = _best(worst, np.fmin(grid.prfaas_bound, grid.pd_prefill_bound[k]))
    return float(grid.thresholds[j])


def lambda_at(grid: PlanGrid, n_p: int, threshold: float) -> float:
    """Split `n_p`'s Lambda_max at `threshold`, interpolated between the searched ones (held
    at the ends). Raises ValueError when the grid did not search the split."""
    row = grid.lambda_max[_split_row(grid, n_p)]
    return float(np.interp(threshold, grid.thresholds, row))


def _split_row(grid: PlanGrid, n_p: int) -> int:
    """The grid's row of split `n_p`. Raises ValueError when the grid did not search it."""
    rows = np.flatnonzero(grid.n_p == n_p)
    if rows.size == 0:
        raise ValueError(f"N_p = {n_p} is outside the searched splits {grid.n_p.tolist()}")
    return int(rows[0])


def plan(
    profile: DeploymentProfile, *, t_step: int = DEFAULT_T_STEP, exact: bool = False
) -> PlanReport:
    """Solve the PrfaaS-PD deployment and evaluate both baselines of `profile`."""
    grid, main = _plan_prfaas_pd(profile, t_step, exact)
    return PlanReport(
        exact,
        main,
        _plan_homogeneous(profile, exact),
        _plan_naive(profile, exact),
        grid,
    )


def _plan_prfaas_pd(
    profile: DeploymentProfile, t_step: int, exact: bool
) -> tuple[PlanGrid, DeploymentResult]:
    dist, pd, pf = profile.workload.lengths, profile.pd, profile.prfaas
    assert pf.egress_gbps is not None
    link_bps = tp.gbps_to_bytes_per_s(pf.egress_gbps)
    split = tp.split_at(dist, threshold_grid(dist, t_step))
    costs = tp.class_costs(
        dist,
        split,
        long_prefill=pf.hardware.prefill_seconds,
        short_prefill=pd.hardware.prefill_seconds,
        kv_bytes=profile.model.kv_bytes,
        exact=exact,
    )
    n_p = np.arange(1, pd.instances, dtype=np.float64)  # (K,)
    theta_p = tp.theta_prfaas(pf.instances, costs.long_prefill_s, link_bps, costs.long_kv_bytes)
    theta_pdp = tp.theta_pd_prefill(n_p[:, None], costs.short_prefill_s[None, :])  # (K, T)
    theta_pdd = _decode_rate(pd.hardware, pd.instances - n_p, profile.workload.output_tokens)
    lam = tp.lambda_max(theta_p[None, :], theta_pdp, theta_pdd[:, None], split.p[None, :])
    bound_p, bound_pdp = tp.prfaas_bound(theta_p, split.p), tp.pd_prefill_bound(theta_pdp, split.p)
    k, j = _best(lam, np.fmin(bound_p[None, :], bound_pdp))
    grid = PlanGrid(split.t, n_p, lam, bound_p, bound_pdp, theta_pdd)
    rate = float(lam[k, j])
    egress = float(
        tp.bytes_per_s_to_gbps(rate * split.p[j] * np.nan_to_num(costs.long_kv_bytes[j]))
    )
    link_bound = link_bps / costs.long_kv_bytes[j]
    compute_bound = pf.instances / costs.long_prefill_s[j]
    prfaas_stage = "prfaas_prefill" if not compute_bound > link_bound else "prfaas_link"
    stages = {prfaas_stage: bound_p[j], "pd_prefill": bound_pdp[k, j], "pd_decode": theta_pdd[k]}
    result = DeploymentResult(
        name="prfaas_pd",
        lambda_max=rate,
        theta_prfaas=float(theta_p[j]),
        theta_pd_p=float(theta_pdp[k, j]),
        theta_pd_d=float(theta_pdd[k]),
        n_prfaas=pf.instances,
        n_p=int(n_p[k]),
        n_d=int(pd.instances - n_p[k]),
        threshold_tokens=float(split.t[j]),
        p_offload=float(split.p[j]),
        l_long=float(split.l_long[j]),
        l_short=float(split.l_short[j]),
        egress_gbps=egress,
        link_gbps=pf.egress_gbps,
        bottleneck=_argmin(stages),
    )
    return grid, result


def _whole_cost(dist: LengthDistribution, hw: HardwareProfile, exact: bool) -> float:
    """Prefill seconds of a request drawn from the whole distribution (one class, no split)."""
    if exact:
        return float(tp.partial_cost(dist, hw.prefill_seconds, np.inf))
    return float(hw.prefill_seconds(dist.mean()))


def _plan_homogeneous(profile: DeploymentProfile, exact: bool) -> DeploymentResult | None:
    base = profile.homogeneous
    if base is None:
        return None
    dist = profile.workload.lengths
    n_p = np.arange(1, base.instances, dtype=np.float64)
    theta_pdp = n_p / _whole_cost(dist, base.hardware, exact)
    theta_pdd = _decode_rate(base.hardware, base.instances - n_p, profile.workload.output_tokens)
    lam = np.fmin(theta_pdp, theta_pdd)
    (k,) = _best(lam, theta_pdp)
    return DeploymentResult(
        name="homogeneous",
        lambda_max=float(lam[k]),
        theta_prfaas=None,
        theta_pd_p=float(theta_pdp[k]),
        theta_pd_d=float(theta_pdd[k]),
        n_prfaas=0,
        n_p=int(n_p[k]),
        n_d=int(base.instances - n_p[k]),
        threshold_tokens=None,
        p_offload=0.0,
        l_long=None,
        l_short=dist.mean(),
        egress_gbps=None,
        link_gbps=None,
        bottleneck="pd_prefill" if theta_pdp[k] <= theta_pdd[k] else "pd_decode",
    )


def _plan_naive(profile: DeploymentProfile, exact: bool) -> DeploymentResult | None:
    base = profile.naive
    if base is None:
        return None
    dist, link = profile.workload.lengths, profile.prfaas.egress_gbps
    assert link is not None
    mean_kv = (
        float(tp.partial_cost(dist, profile.model.kv_bytes, np.inf))
        if exact
        else float(profile.model.kv_bytes(dist.mean()))
    )
    compute = base.prefill_instances / _whole_cost(dist, base.prefill, exact)
    link_rate = tp.gbps_to_bytes_per_s(link) / mean_kv
    theta_d = float(
        _decode_rate(base.decode, base.decode_instances, profile.workload.output_tokens)
    )
    stages = {"prfaas_prefill": compute, "prfaas_link": link_rate, "pd_decode": theta_d}
    rate = min(stages.values())
    return DeploymentResult(
        name="naive_heterogeneous",
        lambda_max=rate,
        theta_prfaas=min(compute, link_rate),
        theta_pd_p=None,
        theta_pd_d=theta_d,
        n_prfaas=base.prefill_instances,
        n_p=0,
        n_d=base.decode_instances,
        threshold_tokens=None,
        p_offload=1.0,
        l_long=dist.mean(),
        l_short=None,
        egress_gbps=float(tp.bytes_per_s_to_gbps(rate * mean_kv)),
        link_gbps=link,
        bottleneck=_argmin(stages),
    )

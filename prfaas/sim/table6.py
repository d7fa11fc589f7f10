"""The paper's Table 6 three ways: as published, by the analytical model (the planner, both
costings), and by discrete-event simulation of the three deployments of a profile.

For each deployment (PrfaaS-PD at the planner's optimum, homogeneous PD, naive
heterogeneous): simulated Lambda_max by bisection, then mean and P90 TTFT at a common
arrival rate (90% of the lowest simulated Lambda_max, so every deployment is stable) and at
90% of the deployment's own simulated Lambda_max.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from prfaas.loadgen.arrivals import RateArrivals
from prfaas.loadgen.workload import Workload
from prfaas.policies.planner import DeploymentResult, PlanReport, plan
from prfaas.policies.profile import DeploymentProfile
from prfaas.sim.deployments import DeploymentName, SimOptions, deployments
from prfaas.sim.find_max import FindMaxOptions, FindMaxResult, find_max
from prfaas.sim.runner import SimResult, SimSpec, simulate

LOAD_SHARE = 0.9
# Published in the paper's Table 6 (arXiv:2604.15039); the paper computed them with its
# analytical model, not by running anything. Keys: lambda_max, ratio, ttft_mean_s, ttft_p90_s.
PAPER_TABLE6: dict[DeploymentName, dict[str, float]] = {
    "prfaas_pd": {"lambda_max": 3.24, "ratio": 1.54, "ttft_mean_s": 2.22, "ttft_p90_s": 3.51},
    "homogeneous": {"lambda_max": 2.11, "ratio": 1.00, "ttft_mean_s": 4.44, "ttft_p90_s": 9.73},
    "naive_heterogeneous": {
        "lambda_max": 2.45,
        "ratio": 1.16,
        "ttft_mean_s": 1.74,
        "ttft_p90_s": 3.51,
    },
}


@dataclass(frozen=True)
class Table6Row:
    """One deployment: model (representative and exact costing) and simulation."""

    name: DeploymentName
    model: DeploymentResult
    model_exact: DeploymentResult
    sim: FindMaxResult
    at_common: SimResult
    at_own: SimResult


@dataclass(frozen=True)
class Table6:
    """The three rows and the common rate they were compared at."""

    rows: tuple[Table6Row, ...]
    common_rate: float

    def row(self, name: DeploymentName) -> Table6Row:
        return next(r for r in self.rows if r.name == name)

    def ratio(self, name: DeploymentName, of: str = "sim") -> float:
        """Lambda_max of `name` over homogeneous's; `of`: sim (bisection), capacity (the
        simulated stage limit at 90% load), model (T(E[L])) or model_exact (E[T(L)])."""
        return _lambda(self.row(name), of) / _lambda(self.row("homogeneous"), of)

    def to_json(self) -> dict[str, Any]:
        return {
            "simulated": True,
            "common_rate": self.common_rate,
            "rows": {r.name: _row_json(self, r) for r in self.rows},
        }


def _lambda(row: Table6Row, of: str) -> float:
    if of == "sim":
        return row.sim.lambda_max
    if of == "capacity":
        return row.at_own.metrics.lambda_capacity or math.nan
    return (row.model if of == "model" else row.model_exact).lambda_max


def _row_json(table: Table6, r: Table6Row) -> dict[str, Any]:
    return {
        "paper": PAPER_TABLE6[r.name],
        "model_lambda_max": r.model.lambda_max,
        "model_exact_lambda_max": r.model_exact.lambda_max,
        "model_ratio": table.ratio(r.name, "model"),
        "model_exact_ratio": table.ratio(r.name, "model_exact"),
        "lambda_max": r.sim.lambda_max,
        "ratio": table.ratio(r.name),
        "lambda_capacity": r.at_own.metrics.lambda_capacity,
        "ratio_capacity": table.ratio(r.name, "capacity"),
        "probes": [list(p) for p in r.sim.probes],
        "at_common_rate": r.at_common.to_json(),
        "at_90pct_own": r.at_own.to_json(),
    }


@dataclass(frozen=True)
class Table6Options:
    """How long each simulated run is and how finely Lambda_max is bisected."""

    duration_s: float = 1200.0
    seed: int = 0
    rel_tol: float = 0.01

    def __post_init__(self) -> None:
        if not self.duration_s > 0:
            raise ValueError(f"duration must be > 0 simulated seconds, got {self.duration_s}")
        if not 0 < self.rel_tol < 1:
            raise ValueError(f"rel_tol must be in (0, 1), got {self.rel_tol}")


def run_table6(
    profile: DeploymentProfile, workload: Workload, options: SimOptions, t6: Table6Options
) -> Table6:
    """Simulate the profile's three deployments.

    Raises:
        ValueError: the profile lacks one of the two baselines.
    """
    if profile.homogeneous is None or profile.naive is None:
        raise ValueError(
            f"{profile.source}: --table6 needs [baselines.homogeneous] and "
            "[baselines.naive_heterogeneous]"
        )
    report = plan(profile)
    model, exact = models_by_name(report), models_by_name(plan(profile, exact=True))
    deps = deployments(profile, report, options)

    def sim(sim_plan: SimSpec) -> SimResult:
        return simulate(profile, sim_plan, options)

    def at(name: DeploymentName, rate: float) -> SimSpec:
        return SimSpec(deps[name], workload, RateArrivals(rate), t6.duration_s, seed=t6.seed)

    found = {
        name: find_max(at(name, 1.0), sim, _bounds(model[name], exact[name], t6)) for name in deps
    }
    common = LOAD_SHARE * min(f.lambda_max for f in found.values())
    rows = tuple(
        Table6Row(
            name,
            model[name],
            exact[name],
            found[name],
            sim(at(name, common)),
            sim(at(name, LOAD_SHARE * found[name].lambda_max)),
        )
        for name in deps
    )
    return Table6(rows, common)


def _bounds(model: DeploymentResult, exact: DeploymentResult, t6: Table6Options) -> FindMaxOptions:
    """Bisect from just under the exact-expectation model to just over the paper's costing."""
    return FindMaxOptions(0.85 * exact.lambda_max, 1.1 * model.lambda_max, t6.rel_tol)


def models_by_name(report: PlanReport) -> dict[str, DeploymentResult]:
    """The planner's deployments keyed like `sim_config.deployments`."""
    out: dict[str, DeploymentResult] = {"prfaas_pd": report.prfaas_pd}
    if report.homogeneous is not None:
        out["homogeneous"] = report.homogeneous
    if report.naive_heterogeneous is not None:
        out["naive_heterogeneous"] = report.naive_heterogeneous
    return out

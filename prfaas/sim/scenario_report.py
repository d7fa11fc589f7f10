"""A scenario run every way, compared per phase: JSON, terminal tables. All SIMULATED."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rich.table import Table

from prfaas.gateway.scheduling.config import SchedulerConfig
from prfaas.policies.profile import DeploymentProfile
from prfaas.sim.deployments import SimOptions
from prfaas.sim.scenario_measure import (
    SLO,
    PhaseMetrics,
    PhaseVerdict,
    metrics_by_phase,
    verdict,
)
from prfaas.sim.scenario_run import VARIANTS, Variant, VariantRun, run_variant
from prfaas.sim.scenarios import Scenario


@dataclass(frozen=True)
class ScenarioResult:
    scenario: Scenario
    runs: tuple[VariantRun, ...]
    metrics: dict[str, list[PhaseMetrics]]
    verdicts: tuple[PhaseVerdict, ...]
    """Dual-timescale against the (free-conversion) oracle, per phase; empty when a variant
    is missing."""
    scheduler: SchedulerConfig
    slo: SLO

    def to_json(self) -> dict[str, Any]:
        s = self.scenario
        return {
            "simulated": True,
            "scenario": s.name,
            "description": s.description,
            "duration_s": s.duration_s,
            "slo": {"ttft_s": self.slo.ttft_s, "tpot_s": self.slo.tpot_s},
            "scheduler": {"tick_s": self.scheduler.tick_s, "period_s": self.scheduler.period_s},
            "phases": [
                {
                    "name": p.name,
                    "start_s": p.start_s,
                    "end_s": p.end_s,
                    "conditions": vars(p.conditions),
                }
                for p in s.phases
            ],
            "variants": {
                run.variant: {
                    "requests": len(run.records),
                    "wall_s": run.wall_s,
                    "conversions": [vars(c) for c in run.conversions],
                    "phases": [m.to_json() for m in self.metrics[run.variant]],
                }
                for run in self.runs
            },
            "goals": [v.to_json() for v in self.verdicts],
            "goals_met": all(v.met for v in self.verdicts) if self.verdicts else None,
        }


def run_scenario(
    profile: DeploymentProfile,
    scenario: Scenario,
    *,
    scheduler: SchedulerConfig,
    options: SimOptions | None = None,
    variants: Sequence[Variant] = VARIANTS,
    seed: int = 0,
    slo: SLO | None = None,
    on_run: Callable[[VariantRun], None] | None = None,
) -> ScenarioResult:
    """Run `scenario` each way in `variants` and compare them."""
    slo = slo or SLO()
    runs = []
    for variant in variants:
        run = run_variant(
            profile, scenario, variant, scheduler=scheduler, options=options, seed=seed
        )
        runs.append(run)
        if on_run is not None:
            on_run(run)
    metrics = metrics_by_phase(runs, scenario.phases, slo)
    verdicts: tuple[PhaseVerdict, ...] = ()
    if {"static", "dual", "oracle"} <= metrics.keys():
        steps = [
            i > 0 and p.conditions != scenario.phases[i - 1].conditions
            for i, p in enumerate(scenario.phases)
        ]
        rows = zip(metrics["static"], metrics["dual"], metrics["oracle"], steps, strict=True)
        verdicts = tuple(verdict(s, d, o, scheduler.period_s, step=st) for s, d, o, st in rows)
    return ScenarioResult(scenario, tuple(runs), metrics, verdicts, scheduler, slo)


def _f(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def phase_table(result: ScenarioResult) -> Table:
    """One row per phase and variant."""
    s = result.scenario
    table = Table(title=f"scenario {s.name}: {s.description} (SIMULATED, not measured)")
    for column in (
        "phase",
        "variant",
        "offered",
        "served",
        "goodput",
        "TTFT mean",
        "TTFT P90",
        "lost",
        "t chg",
        "conv",
        "settle s",
        "egress>90% s",
        "t end",
        "split",
    ):
        table.add_column(column, justify="left" if column in ("phase", "variant") else "right")
    for i, phase in enumerate(s.phases):
        for variant, rows in result.metrics.items():
            m = rows[i]
            table.add_row(
                phase.name,
                variant,
                _f(m.offered_rate),
                _f(m.served_rate),
                _f(m.goodput_rate),
                _f(m.ttft_mean_s, ".1f"),
                _f(m.ttft_p90_s, ".1f"),
                str(m.rejected + m.failed),
                str(m.t_changes),
                str(m.conversions),
                f"{m.settle_s:.0f}",
                f"{m.egress_hot_s:.0f}",
                f"{m.threshold_end:.0f}",
                m.split_end,
            )
        table.add_section()
    return table


def goal_table(result: ScenarioResult) -> Table:
    """Dual-timescale against the oracle, per phase."""
    table = Table(
        title=f"scenario {result.scenario.name}: goals, dual-timescale vs oracle (SIMULATED)"
    )
    for column in (
        "phase",
        "served/oracle",
        "P90/oracle",
        "static/oracle",
        "gap closed",
        "lost",
        "settle s",
        "met",
        "missed",
    ):
        table.add_column(column)
    for v in result.verdicts:
        missed = ", ".join(k for k, ok in v.checks.items() if not ok) or "-"
        table.add_row(
            v.phase,
            _f(v.served_vs_oracle),
            _f(v.p90_vs_oracle),
            _f(v.static_vs_oracle),
            _f(v.gap_closed),
            str(v.lost),
            f"{v.settle_s:.0f}",
            "yes" if v.met else "NO",
            missed,
        )
    return table

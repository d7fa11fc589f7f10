"""Benchmark (SIMULATED): the dual-timescale scheduling goals over several seeds.

`prfaas simulate --scenario` checks the goals on one draw of arrivals and lengths (one
seed). Each scenario's hardest phase runs at 90% of the oracle's Lambda_max, and that close
to capacity a phase's P90 TTFT moves by a factor from draw to draw, so one seed's verdict
says little. This runs static, dual-timescale and the oracle on each seed and prints, per
phase, the median and range over the seeds of dual/oracle served rate and P90 TTFT, the
median and largest settling time, and on how many seeds each goal was met. Every number is
SIMULATED (the real Router and schedulers on a virtual clock, simulated engines); the
mooncake-2x trace has fixed arrivals, so only its token ids change with the seed.
Usage: python benchmarks/scheduling.py [--scenario all|NAME,...] [--seeds 0,1,2,3,4]
                                       [--json OUT]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from prfaas.gateway.scheduling.config import SchedulerConfig
from prfaas.policies.profile import load_profile
from prfaas.sim.scenario_measure import PhaseVerdict
from prfaas.sim.scenario_report import run_scenario
from prfaas.sim.scenario_run import Variant
from prfaas.sim.scenarios import SCENARIOS, build_scenario

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "prfaas/examples/paper_case_study.toml"
VARIANTS: tuple[Variant, ...] = ("static", "dual", "oracle")  # what the goal check compares


def _spread(values: Sequence[float | None], spec: str) -> str:
    """'median (min-max)' of the values that exist."""
    xs = [v for v in values if v is not None]
    if not xs:
        return "-"
    return f"{statistics.median(xs):{spec}} ({min(xs):{spec}}-{max(xs):{spec}})"


def _phase_row(name: str, phase: str, verdicts: list[PhaseVerdict]) -> dict[str, Any]:
    goals = sorted({goal for v in verdicts for goal in v.checks})
    return {
        "scenario": name,
        "phase": phase,
        "seeds": len(verdicts),
        "served_vs_oracle": [v.served_vs_oracle for v in verdicts],
        "p90_vs_oracle": [v.p90_vs_oracle for v in verdicts],
        "settle_s": [v.settle_s for v in verdicts],
        "lost": [v.lost for v in verdicts],
        "all_goals_met": sum(v.met for v in verdicts),
        "goal_met": {g: sum(v.checks.get(g, False) for v in verdicts) for g in goals},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--scenario", default="all")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--json", type=Path, metavar="OUT")
    args = parser.parse_args()
    profile = load_profile(args.config)
    names = SCENARIOS if args.scenario == "all" else tuple(args.scenario.split(","))
    seeds = [int(s) for s in args.seeds.split(",")]
    scheduler = SchedulerConfig()
    rows = []
    for name in names:
        scenario = build_scenario(name, profile)
        per_phase: dict[str, list[PhaseVerdict]] = {p.name: [] for p in scenario.phases}
        for seed in seeds:
            print(f"{name}, seed {seed} ...", file=sys.stderr, flush=True)
            result = run_scenario(
                profile, scenario, scheduler=scheduler, variants=VARIANTS, seed=seed
            )
            for v in result.verdicts:
                per_phase[v.phase].append(v)
        rows += [_phase_row(name, phase, vs) for phase, vs in per_phase.items()]
    n = len(seeds)
    print(f"dual-timescale vs oracle over {n} seeds: median (min-max) (SIMULATED)")
    print(f"{'scenario':<15}{'phase':<14}{'served/oracle':>20}{'P90/oracle':>20}"
          f"{'settle s':>16}{'lost':>6}{'all goals':>11}  P90 goal / settle goal met")  # fmt: skip
    for r in rows:
        settle = r["settle_s"]
        goals = r["goal_met"]
        p90_met = goals.get("P90 TTFT <= 1.5x oracle", 0)
        settled = goals.get("settled within 3 periods")
        print(
            f"{r['scenario']:<15}{r['phase']:<14}{_spread(r['served_vs_oracle'], '.2f'):>20}"
            f"{_spread(r['p90_vs_oracle'], '.2f'):>20}"
            f"{statistics.median(settle):>7.0f} (<={max(settle):.0f})"
            f"{sum(r['lost']):>6}{r['all_goals_met']:>7}/{n:<3}  {p90_met}/{n}"
            f" / {'-' if settled is None else f'{settled}/{n}'}"
        )
    if args.json:
        doc = {
            "benchmark": "scheduling",
            "simulated": True,
            "seeds": seeds,
            "period_s": scheduler.period_s,
            "phases": rows,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()

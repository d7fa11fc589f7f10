"""`sim:CONFIG` as a bench target: the load generator's plans run in the simulator and come
back as ordinary records, flagged simulated."""

from __future__ import annotations

from pathlib import Path

import pytest

from prfaas.loadgen.arrivals import ClosedLoop, RateArrivals
from prfaas.loadgen.spec import BenchSpec, NoProgress, TargetError
from prfaas.loadgen.stats import summarize
from prfaas.loadgen.workloads import WorkloadOptions, create_workload
from prfaas.sim.bench_target import SimBenchRunner


async def test_bench_plan_runs_in_the_simulator(case_study_path: Path) -> None:
    """40 multi-turn requests at 1 req/s: every turn completes with 256 tokens, later turns
    hit the prefix cache of their conversation, records are simulated."""
    runner = SimBenchRunner.from_target(f"sim:{case_study_path}")
    workload = create_workload("multi-turn", WorkloadOptions(turns=4, first_len=2048))
    plan = BenchSpec(workload, RateArrivals(1.0), num_requests=40, seed=3)
    result = await runner.run(plan, NoProgress())
    assert result.simulated and result.target.startswith("sim:")
    assert len(result.records) == 40
    assert all(r.ok and r.completion_tokens == 256 for r in result.records)
    later = [r for r in result.records if r.turn > 0]
    assert later and all((r.cached_tokens or 0) >= 2048 for r in later)
    summary = summarize(result.records, result.duration_s, None)
    assert summary.completed == 40 and summary.prefix_hit_rate is not None
    assert summary.ttft is not None and summary.ttft.mean > 0


async def test_closed_loop_plans_work_too(case_study_path: Path) -> None:
    """Closed-loop arrivals (the bench default) drive the simulated cluster as well."""
    runner = SimBenchRunner.from_target(f"sim:{case_study_path}")
    plan = BenchSpec(create_workload("lognormal", WorkloadOptions()), ClosedLoop(2), 6)
    result = await runner.run(plan, NoProgress())
    assert [r.ok for r in result.records] == [True] * 6


@pytest.mark.parametrize(
    ("target", "match"),
    [("http://x", "not a simulator target"), ("sim:/nonexistent.toml", "cannot read")],
)
def test_bad_sim_targets_are_clear_errors(target: str, match: str) -> None:
    """A non-sim target or an unreadable profile is a TargetError naming the problem."""
    with pytest.raises(TargetError, match=match):
        SimBenchRunner.from_target(target)

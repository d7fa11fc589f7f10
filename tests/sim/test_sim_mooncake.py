"""Replaying the Mooncake conversation trace through the simulator (simulated numbers):
the prefix hit rate comes close to the trace's own reuse, and routing follows the
incremental (uncached) length, found in the real KV index fed by simulated KV events."""

from __future__ import annotations

from pathlib import Path

import pytest

from prfaas.loadgen.arrivals import TraceArrivals
from prfaas.loadgen.workloads.mooncake import MOONCAKE_BLOCK, MooncakeWorkload
from prfaas.policies.planner import plan
from prfaas.policies.profile import load_profile
from prfaas.sim.deployments import SimOptions, deployments
from prfaas.sim.runner import SimResult, SimSpec, simulate

ENTRIES = 2000


def trace_reuse(workload: MooncakeWorkload) -> float:
    """The trace's own reuse with one unbounded block cache: a request hits its leading
    blocks whose hash ids some earlier request held as full blocks (tokens share of all)."""
    seen: set[int] = set()
    hit = total = 0
    for e in workload.entries:
        k = 0
        while k < len(e.hash_ids) and e.hash_ids[k] in seen:
            k += 1
        hit += min(k * MOONCAKE_BLOCK, e.input_length)
        total += e.input_length
        full = len(e.hash_ids) - (e.input_length % MOONCAKE_BLOCK != 0)
        seen.update(e.hash_ids[:full])
    return hit / total


@pytest.fixture(scope="module")
def replay(case_study_path: Path) -> tuple[MooncakeWorkload, SimResult]:
    trace = Path(case_study_path).parents[1] / "traces" / "mooncake_conversation.jsonl"
    full = MooncakeWorkload.from_file(trace)
    workload = MooncakeWorkload(full.path, full.entries[:ENTRIES])
    profile = load_profile(case_study_path)
    options = SimOptions(block_size=MOONCAKE_BLOCK, cache_blocks=None)
    deployment = deployments(profile, plan(profile), options)["prfaas_pd"]
    duration = workload.entries[-1].timestamp_s + 1.0
    sim_plan = SimSpec(deployment, workload, TraceArrivals(), duration)
    return workload, simulate(profile, sim_plan, options)


def test_hit_rate_is_close_to_the_traces_own_reuse(
    replay: tuple[MooncakeWorkload, SimResult],
) -> None:
    """Per-instance caches behind incremental-length routing lose little of the reuse a
    single unbounded cache would see (Mooncake reports ~40% for the whole trace)."""
    workload, result = replay
    ideal, hit = trace_reuse(workload), result.metrics.prefix_hit_rate
    print(f"trace reuse {ideal:.3f}, simulated hit rate {hit:.3f}")
    assert result.metrics.failed == 0
    assert hit is not None
    assert ideal > 0.2
    assert hit == pytest.approx(ideal, abs=0.04)


def test_routing_follows_the_incremental_length(
    replay: tuple[MooncakeWorkload, SimResult],
) -> None:
    """Long prompts whose prefix the PD cluster caches stay in PD (only the uncached tail
    counts against t); nothing at or under t goes to PrfaaS; the reported incremental
    length is the prompt minus the chosen instance's cached prefix."""
    _, result = replay
    t = result.spec.deployment.threshold
    pd = [r for r in result.records if r.route == "pd"]
    prfaas = [r for r in result.records if r.route == "prfaas"]
    assert pd and prfaas
    assert any((r.prompt_tokens or 0) > t for r in pd)
    assert all((r.prompt_tokens or 0) > t for r in prfaas)
    cached = [r for r in result.records if r.incremental_tokens != r.prompt_tokens]
    assert len(cached) > len(result.records) // 4
    for r in result.records:
        assert r.incremental_tokens is not None and r.prompt_tokens is not None
        assert 0 <= r.incremental_tokens <= r.prompt_tokens

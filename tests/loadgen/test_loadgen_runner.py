"""HttpRunner + Driver over loopback: budgets, arrival timing, concurrency, conversations."""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

import pytest
from loadgen_helpers import Script

from prfaas.common.ports import free_port
from prfaas.loadgen.arrivals import ClosedLoop, RateArrivals, TraceArrivals
from prfaas.loadgen.driver import spec_rngs
from prfaas.loadgen.spec import BenchSpec, NoProgress, RunResult, TargetError
from prfaas.loadgen.targets import HttpOptions, HttpRunner
from prfaas.loadgen.tokens import render_text
from prfaas.loadgen.workload import Workload
from prfaas.loadgen.workloads import WorkloadOptions, create_workload
from prfaas.loadgen.workloads.lengths import LogNormalLengths

SMALL = WorkloadOptions(inputs=LogNormalLengths(mu=3.5, sigma=0.5, lo=8, hi=64), output_tokens=3)


def _small(name: str = "lognormal", options: WorkloadOptions = SMALL) -> Workload:
    return create_workload(name, options)


def _turns(turns: int, first: int, turn: int) -> WorkloadOptions:
    return replace(SMALL, turns=turns, first_len=first, turn_len=turn, think_time_s=0.0)


async def _run(url: str, plan: BenchSpec, options: HttpOptions | None = None) -> RunResult:
    runner = HttpRunner(url, options or HttpOptions(model="ok"))
    return await runner.run(plan, NoProgress())


async def test_open_loop_sends_exactly_n_on_schedule(null_url: str) -> None:
    """N requests, unique ids, sent when the Poisson schedule says (median lag < 15 ms)."""
    plan = BenchSpec(_small(), RateArrivals(rate=100.0), num_requests=60, seed=1)
    result = await _run(null_url, plan)
    recs = result.records
    assert len(recs) == 60 and all(r.ok for r in recs)
    assert len({r.request_id for r in recs}) == 60
    scheduled = sorted(r.scheduled_s for r in recs)
    assert scheduled[0] == 0.0 and 0.2 < scheduled[-1] < 1.5  # ~59 gaps of 10 ms
    lags = [r.start_s - r.scheduled_s for r in recs]
    assert min(lags) > -0.005 and statistics.median(lags) < 0.015
    assert result.duration_s >= max(r.start_s for r in recs)


async def test_duration_stops_new_arrivals(null_url: str) -> None:
    plan = BenchSpec(_small(), RateArrivals(rate=80.0), duration_s=0.5, seed=2)
    recs = (await _run(null_url, plan)).records
    assert 15 < len(recs) < 80
    assert all(r.scheduled_s <= 0.5 for r in recs)


async def test_closed_loop_holds_concurrency(scripted: tuple[str, Script]) -> None:
    """Exactly C requests in flight at the server, never more."""
    url, script = scripted
    plan = BenchSpec(_small(), ClosedLoop(3), num_requests=12, seed=0)
    recs = (await _run(url, plan)).records
    assert len(recs) == 12 and all(r.ok for r in recs)
    assert script.max_in_flight == 3


async def test_server_errors_and_timeouts_are_counted_not_fatal(
    scripted: tuple[str, Script],
) -> None:
    url, _ = scripted
    plan = BenchSpec(_small(), RateArrivals(rate=200.0), num_requests=8, seed=0)
    recs = (await _run(url, plan, HttpOptions(model="http500"))).records
    assert len(recs) == 8 and not any(r.ok for r in recs)
    recs = (await _run(url, plan, HttpOptions(model="hang", timeout_s=0.2))).records
    assert [r.error for r in recs] == ["timeout after 0.2s"] * 8


async def test_multi_turn_prompt_is_history_plus_answer_plus_turn(
    scripted: tuple[str, Script],
) -> None:
    """Turn 2 of a text conversation = turn-1 prompt + answer + new tokens (completions)."""
    url, script = scripted
    workload = _small("multi-turn", _turns(2, 6, 4))
    plan = BenchSpec(workload, ClosedLoop(1), num_requests=2, seed=0)
    recs = (await _run(url, plan)).records
    assert [r.turn for r in recs] == [0, 1] and all(r.ok for r in recs)
    first, second = script.bodies
    session = next(workload.sessions(spec_rngs(0)[0]))
    answer = "".join(f" a{i} b{i}" for i in range(3))
    expected = " ".join(
        [render_text(session.turns[0].tokens), answer, render_text(session.turns[1].tokens)]
    )
    assert first["prompt"] == session.turns[0].tokens.tolist()
    assert second["prompt"] == expected


async def test_multi_turn_keeps_token_ids_with_generate(null_url: str) -> None:
    """With SGLang /generate the answer's output_ids extend the history: cache hits grow."""
    workload = _small("multi-turn", _turns(3, 16, 4))
    plan = BenchSpec(workload, ClosedLoop(1), num_requests=3, seed=0)
    recs = (await _run(null_url, plan, HttpOptions(api="generate"))).records
    prompts = [r.prompt_tokens for r in recs]
    assert prompts == [16, 16 + 3 + 4, 16 + 3 + 4 + 3 + 4]
    assert [r.cached_tokens for r in recs] == [0, 16, 20]  # block size 4: full blocks only


async def test_trace_arrivals_replay_timestamps(tmp_path: Path, null_url: str) -> None:
    lines = [
        f'{{"timestamp": {t}, "input_length": 10, "output_length": 2, "hash_ids": [{i}]}}'
        for i, t in enumerate([0, 200, 400])
    ]
    (tmp_path / "t.jsonl").write_text("\n".join(lines))
    workload = create_workload(f"mooncake:{tmp_path / 't.jsonl'}", SMALL)
    plan = BenchSpec(workload, TraceArrivals(speedup=2.0), num_requests=3)
    recs = sorted((await _run(null_url, plan)).records, key=lambda r: r.scheduled_s)
    assert [r.scheduled_s for r in recs] == [0.0, 0.1, 0.2]
    assert all(abs(r.start_s - r.scheduled_s) < 0.1 for r in recs)


async def test_same_seed_same_requests(scripted: tuple[str, Script]) -> None:
    url, script = scripted
    plan = BenchSpec(_small(), ClosedLoop(1), num_requests=5, seed=9)
    await _run(url, plan)
    await _run(url, plan)
    assert [b["prompt"] for b in script.bodies[:5]] == [b["prompt"] for b in script.bodies[5:]]


async def test_targets_rejected_clearly() -> None:
    with pytest.raises(TargetError, match="must be an http"):
        HttpRunner("localhost:8000", HttpOptions())
    port = free_port()
    plan = BenchSpec(_small(), ClosedLoop(1), num_requests=1)
    with pytest.raises(TargetError, match="cannot reach"):
        await _run(f"http://127.0.0.1:{port}", plan)


def test_plan_validation_names_values() -> None:
    with pytest.raises(ValueError, match="request count or a duration"):
        BenchSpec(_small(), ClosedLoop(1))
    with pytest.raises(ValueError, match="got -2"):
        BenchSpec(_small(), ClosedLoop(1), num_requests=-2)
    with pytest.raises(ValueError, match="unknown API 'grpc'"):
        HttpOptions(api="grpc")


async def test_closed_loop_duration_stops_new_sessions(null_url: str) -> None:
    """With a duration and no count, a closed loop sends until the deadline, then drains."""
    plan = BenchSpec(_small(), ClosedLoop(2), duration_s=0.3, seed=0)
    result = await _run(null_url, plan)
    assert len(result.records) > 10 and all(r.ok for r in result.records)
    assert all(r.scheduled_s <= 0.3 for r in result.records)
    assert result.duration_s < 1.0

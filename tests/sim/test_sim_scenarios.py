"""The scheduling scenarios: phases and rates from the planner, and the requests that
follow them (same seed, same requests; each phase's lengths, outputs and rate)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from prfaas.policies.profile import DeploymentProfile, load_profile
from prfaas.sim.scenario_workload import ScenarioWorkload
from prfaas.sim.scenarios import (
    LOAD,
    SCENARIOS,
    build_scenario,
    oracle_lambda,
    trace_conditions,
)


@pytest.fixture(scope="module")
def profile(case_study_path: Path) -> DeploymentProfile:
    return load_profile(case_study_path)


def test_bandwidth_drop_runs_at_90_percent_of_the_harder_phase(profile: DeploymentProfile) -> None:
    """10, 20, 10 minutes at 100, 10, 100 Gbps; the rate is 90% of the planner's
    Lambda_max for the 10 Gbps phase (the lower of the two)."""
    s = build_scenario("bandwidth-drop", profile)
    assert [(p.name, p.start_s, p.end_s) for p in s.phases] == [
        ("before", 0, 600), ("drop", 600, 1800), ("recovered", 1800, 2400)
    ]  # fmt: skip
    links = [p.conditions.link_gbps for p in s.phases]
    assert links == [100, 10, 100]
    slow = oracle_lambda(profile, s.phases[1].conditions)
    assert slow < oracle_lambda(profile, s.phases[0].conditions)
    assert [p.conditions.rate for p in s.phases] == pytest.approx([LOAD * slow] * 3)


@pytest.mark.parametrize(
    ("name", "field", "values"),
    [
        ("length-shift", "mu", [9.9, 10.6, 9.9]),
        ("decode-heavy", "output_tokens", [1024, 3072, 1024]),
        ("burst", "burstiness", [1.0, 0.25, 1.0]),
    ],
)
def test_each_scenario_changes_what_it_says(
    profile: DeploymentProfile, name: str, field: str, values: list[float]
) -> None:
    s = build_scenario(name, profile)
    assert [getattr(p.conditions, field) for p in s.phases] == values


def test_burst_doubles_the_rate_for_a_minute(profile: DeploymentProfile) -> None:
    s = build_scenario("burst", profile)
    before, burst, _ = s.phases
    assert burst.duration_s == 60 and burst.conditions.rate == pytest.approx(
        2 * before.conditions.rate
    )


def test_diurnal_swings_between_half_and_110_percent(profile: DeploymentProfile) -> None:
    s = build_scenario("diurnal", profile)
    top = oracle_lambda(profile, s.phases[0].conditions)
    assert s.rate_at is not None and s.duration_s == 2400
    assert s.rate_at(0) == pytest.approx(0.5 * top)
    assert s.rate_at(600) == pytest.approx(1.1 * top)
    assert s.rate_at(1200) == pytest.approx(0.5 * top)


def test_time_scale_and_unknown_names(profile: DeploymentProfile) -> None:
    assert build_scenario("decode-heavy", profile, time_scale=0.1).duration_s == pytest.approx(300)
    with pytest.raises(ValueError, match="choose one of bandwidth-drop, burst"):
        build_scenario("tsunami", profile)
    with pytest.raises(ValueError, match="time scale must be > 0"):
        build_scenario("burst", profile, time_scale=0)
    assert len(SCENARIOS) == 6


def test_mooncake_conditions_come_from_the_trace(profile: DeploymentProfile) -> None:
    """Twice the trace's rate; incremental lengths far shorter than the paper's workload
    (prefix reuse), which the oracle plans for."""
    s = build_scenario("mooncake-2x", profile)
    assert s.trace is not None and s.speedup == 2.0 and s.duration_s == 1800
    c = s.phases[0].conditions
    once = trace_conditions(s.trace, 1.0)
    assert c.rate == pytest.approx(2 * once.rate)
    assert math.log(128) < c.mu < 9.9 and c.sigma > 0 and c.link_gbps == 100


def _sessions(profile: DeploymentProfile, name: str, seed: int = 0) -> list[tuple[float, int, int]]:
    w = ScenarioWorkload(build_scenario(name, profile, time_scale=0.5))
    rng = np.random.default_rng(seed)
    return [(s.timestamp_s or 0.0, len(s.turns[0].tokens), s.turns[0].max_tokens)
            for s in w.sessions(rng)]  # fmt: skip


def test_same_seed_same_requests(profile: DeploymentProfile) -> None:
    assert _sessions(profile, "burst") == _sessions(profile, "burst")
    assert _sessions(profile, "burst") != _sessions(profile, "burst", seed=1)


def test_requests_follow_their_phase(profile: DeploymentProfile) -> None:
    """length-shift: mean ln(length) jumps by about 0.55 in the middle phase (the truncated
    log-normal's shift for mu 9.9 -> 10.6); decode-heavy: 3,072 output tokens there."""
    s = build_scenario("length-shift", profile, time_scale=0.5)
    rows = _sessions(profile, "length-shift")
    mid = [math.log(n) for t, n, _ in rows if s.phases[1].start_s <= t < s.phases[1].end_s]
    edge = [math.log(n) for t, n, _ in rows if t < s.phases[0].end_s]
    assert np.mean(mid) - np.mean(edge) == pytest.approx(0.55, abs=0.1)
    heavy = build_scenario("decode-heavy", profile, time_scale=0.5).phases[1]
    outs = {o for t, _, o in _sessions(profile, "decode-heavy") if heavy.start_s <= t < heavy.end_s}
    assert outs == {3072}


def test_arrival_rates_follow_the_phases(profile: DeploymentProfile) -> None:
    """Counts per phase within 4 standard deviations of rate x duration (Poisson; the burst
    is gamma with CV 2, so its count is noisier)."""
    for name in ("burst", "diurnal"):
        s = build_scenario(name, profile, time_scale=0.5)
        times = np.array([t for t, _, _ in _sessions(profile, name)])
        for p in s.phases:
            if s.rate_at is not None:
                grid = np.linspace(p.start_s, p.end_s, 2001)
                expected = float(np.mean([s.rate_at(x) for x in grid])) * p.duration_s
            else:
                expected = p.conditions.rate * p.duration_s
            seen = int(np.sum((times >= p.start_s) & (times < p.end_s)))
            cv = 1 / math.sqrt(p.conditions.burstiness)
            assert abs(seen - expected) <= 4 * cv * math.sqrt(expected) + 2, (name, p.name)

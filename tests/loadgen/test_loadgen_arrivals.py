"""Arrival processes match their distributions (KS tests with fixed seeds)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from prfaas.loadgen.arrivals import ClosedLoop, RateArrivals, TraceArrivals, timed_sessions
from prfaas.loadgen.driver import spec_rngs
from prfaas.loadgen.workload import Session, Turn


def _gaps(arrivals: RateArrivals, n: int, seed: int = 1) -> np.ndarray:
    return np.array(list(itertools.islice(arrivals.gaps(np.random.default_rng(seed)), n)))


def test_poisson_gaps_are_exponential() -> None:
    gaps = _gaps(RateArrivals(rate=40.0), 5000)
    assert stats.kstest(gaps, "expon", args=(0, 1 / 40)).pvalue > 0.01
    assert gaps.mean() == pytest.approx(1 / 40, rel=0.05)
    assert stats.kstest(gaps, "expon", args=(0, 1 / 50)).pvalue < 1e-6  # test has power


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_gaps_follow_vllm_burstiness(burstiness: float) -> None:
    """Gaps ~ Gamma(shape=k, scale=1/(rate*k)): mean 1/rate, CV^2 = 1/k."""
    gaps = _gaps(RateArrivals(rate=10.0, burstiness=burstiness), 6000)
    scale = 1 / (10.0 * burstiness)
    assert stats.kstest(gaps, "gamma", args=(burstiness, 0, scale)).pvalue > 0.01
    assert gaps.mean() == pytest.approx(0.1, rel=0.06)
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1 / burstiness, rel=0.15)
    assert stats.kstest(gaps, "expon", args=(0, 0.1)).pvalue < 1e-6


def test_arrival_times_start_at_zero_and_accumulate() -> None:
    arrivals = RateArrivals(rate=5.0)
    times = list(itertools.islice(arrivals.times(np.random.default_rng(2)), 4))
    gaps = _gaps(arrivals, 3, seed=2)
    assert times[0] == 0.0
    assert np.allclose(np.diff(times), gaps)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert set(_gaps(RateArrivals(rate=math.inf), 10)) == {0.0}


def test_seed_makes_arrivals_reproducible_and_independent_of_workload() -> None:
    a = list(itertools.islice(RateArrivals(3.0).times(spec_rngs(5)[1]), 50))
    b = list(itertools.islice(RateArrivals(3.0).times(spec_rngs(5)[1]), 50))
    c = list(itertools.islice(RateArrivals(3.0).times(spec_rngs(6)[1]), 50))
    assert a == b != c


def _session(sid: int, ts: float | None) -> Session:
    return Session(sid, (Turn(np.array([1, 2]), 1),), timestamp_s=ts)


def test_trace_arrivals_divide_timestamps_by_speedup() -> None:
    sessions = iter([_session(0, 0.0), _session(1, 3.0), _session(2, 10.0)])
    timed = list(timed_sessions(TraceArrivals(speedup=2.0), sessions, np.random.default_rng()))
    assert [t for t, _ in timed] == [0.0, 1.5, 5.0]
    with pytest.raises(ValueError, match="need a trace workload"):
        list(timed_sessions(TraceArrivals(), iter([_session(0, None)]), np.random.default_rng()))


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: RateArrivals(rate=0), "rate must be > 0 req/s, got 0"),
        (lambda: RateArrivals(rate=1, burstiness=-1), "burstiness must be .* got -1"),
        (lambda: TraceArrivals(speedup=0), "speedup must be .* got 0"),
        (lambda: ClosedLoop(0), "concurrency must be >= 1, got 0"),
    ],
)
def test_bad_arrival_parameters_are_named(make: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        make()  # type: ignore[operator]

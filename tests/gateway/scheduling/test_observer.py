"""The scheduling observer's period samples: which answers a period after a wake counts."""

from __future__ import annotations

import math

import pytest

from prfaas.gateway.router import RouteEvent
from prfaas.gateway.scheduling.observer import BUSY_SMOOTHING_S, SchedulingObserver
from prfaas.policies.routing import RouteDecision
from prfaas.policies.tables import PiecewiseLinear
from prfaas.policies.ttft_forecast import PrefillCosts


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


DECISION = RouteDecision("pd", "p0", "d0", 1_000, 0)


def test_answers_since_keeps_only_requests_first_dispatched_after_the_wake() -> None:
    """A 600-token answer begun before a wake at 10 s and finished after it, beside a
    100-token answer begun after it: the period counts both, the post-wake view only the
    second. A retry (second dispatch of the same request after the wake) keeps its first
    dispatch time, so its long answer stays out too."""
    clock = Clock()
    observer = SchedulingObserver(None, clock=clock)
    observer.dispatched("old", DECISION, "old")
    observer.dispatched("retried", DECISION, "retried")
    clock.now = 12.0
    observer.dispatched("new", DECISION, "new")
    observer.dispatched("retried-1", DECISION, "retried")  # its retry, after the wake
    clock.now = 15.0
    for rid, tokens in (("old", 600), ("new", 100), ("retried", 600)):
        observer.finished(RouteEvent(rid, DECISION, 1_000, tokens))
    samples = observer.take_samples()
    assert sorted(samples.outputs) == [100, 600, 600]
    assert samples.answers_since(10.0) == [100]
    assert sorted(samples.answers_since(0.0)) == [100, 600, 600]


def test_a_failed_request_leaves_no_answer_and_no_arrival() -> None:
    """A request that ended in an error is no answer: neither list keeps it, and the next
    request of the same id starts a fresh first-dispatch time."""
    clock = Clock()
    observer = SchedulingObserver(None, clock=clock)
    observer.dispatched("a", DECISION, "a")
    observer.finished(RouteEvent("a", DECISION, 1_000, 0, error="engine down"))
    clock.now = 20.0
    observer.dispatched("a", DECISION, "a")
    observer.finished(RouteEvent("a", DECISION, 1_000, 50))
    samples = observer.take_samples()
    assert samples.outputs == [50]
    assert samples.arrivals == [20.0]


def test_the_pd_pool_busy_share_follows_the_ticks_and_reaches_the_forecast() -> None:
    """Ticks a second apart: the first only starts the clock; then a minute of a busy pool
    brings the share to 1 - e^-3 (time constant 20 s), and 20 s idle take it down by e^-1.
    The forecast each request is routed on carries it."""
    clock = Clock()
    line = PiecewiseLinear((0.0, 1000.0), (0.0, 1.0))
    observer = SchedulingObserver(PrefillCosts(line, line, line), clock=clock)
    observer.local_pool_sampled(5.0)
    assert observer.local_busy_share == 0.0
    for _ in range(60):
        clock.now += 1.0
        observer.local_pool_sampled(2.0)
    busy = 1 - math.exp(-60 / BUSY_SMOOTHING_S)
    assert observer.local_busy_share == pytest.approx(busy)
    for _ in range(20):
        clock.now += 1.0
        observer.local_pool_sampled(0.0)
    assert observer.local_busy_share == pytest.approx(busy * math.exp(-1))
    forecast = observer.forecast()
    assert forecast is not None and forecast.local_busy_share == observer.local_busy_share


def test_the_pd_pools_offered_work_follows_its_dispatches() -> None:
    """A 1,000-token prompt (1 s of PD prefill) dispatched to the PD pool every second for
    200 s reads about 1 s of work per second (each counts 1/20 at once and fades by e in 20
    s); an offload does not count; 20 s with none take it down by e. The forecast carries
    it."""
    clock = Clock()
    line = PiecewiseLinear((0.0, 1000.0), (0.0, 1.0))
    observer = SchedulingObserver(PrefillCosts(line, line, line), clock=clock)
    offload = RouteDecision("prfaas", "pf0", "d0", 1_000, 0)
    assert observer.local_work.read(clock.now) == 0.0
    for i in range(200):
        clock.now = float(i)
        observer.dispatched(f"r{i}", DECISION, f"r{i}")
        observer.dispatched(f"o{i}", offload, f"o{i}")
    steady = (1 / BUSY_SMOOTHING_S) / (1 - math.exp(-1 / BUSY_SMOOTHING_S))  # 1.025
    assert observer.local_work.read(clock.now) == pytest.approx(steady, rel=1e-3)
    clock.now += BUSY_SMOOTHING_S
    forecast = observer.forecast()
    assert forecast is not None
    assert forecast.local_work_per_s == pytest.approx(steady * math.exp(-1), rel=1e-3)

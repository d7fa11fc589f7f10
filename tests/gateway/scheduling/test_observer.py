"""The scheduling observer's period samples: which answers a period after a wake counts."""

from __future__ import annotations

from prfaas.gateway.router import RouteEvent
from prfaas.gateway.scheduling.observer import SchedulingObserver
from prfaas.policies.routing import RouteDecision


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

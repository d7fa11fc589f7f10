"""`ActivityRecorder` on a hand-moved clock: bounded logs, the `since` cursor hands each
record out once, rates from cumulative counts, percentiles over the sliding window only, the
role split of healthy instances, decisions in order."""

from __future__ import annotations

from typing import Any

import pytest

from prfaas.gateway.api.activity import ActivityLimits, ActivityRecorder, FinishedRequest
from prfaas.gateway.api.window_stats import percentiles, rates


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _state(healthy_decode: bool = True, threshold: float = 512.0) -> dict[str, Any]:
    def inst(i: str, role: str, healthy: bool = True) -> dict[str, Any]:
        return {"id": i, "role": role, "healthy": healthy, "in_flight": 0, "queued": 0}

    return {
        "threshold": threshold,
        "regime": "bandwidth_scarce",
        "clusters": {
            "prfaas": [inst("prfaas-p0", "prefill")],
            "pd": [inst("pd-p0", "prefill"), inst("pd-d0", "decode", healthy_decode)],
        },
        "queue": {"running": 2, "waiting": 1},
        "link": {"egress_bytes_per_s": 1e6, "capacity_bytes_per_s": 2e6, "rtt_s": 0.005},
    }


def _done(at: float, route: str = "pd", ttft: float = 0.1, status: int = 200) -> FinishedRequest:
    return FinishedRequest(at, route, status, 100, ttft, 0.01, ttft + 0.5)


def _recorder(clock: Clock, state: dict[str, Any] | None = None, **limits: Any) -> ActivityRecorder:
    current = state or _state()
    return ActivityRecorder(lambda: current, ActivityLimits(**limits), clock)


def test_since_cursor_hands_each_record_out_once() -> None:
    """A snapshot returns what finished after `since`; passing its `now` back as `since`
    returns only what came later, in time order."""
    clock = Clock()
    rec = _recorder(clock)
    rec.finished(_done(999.0))
    rec.finished(_done(1000.0, "prfaas"))
    first = rec.snapshot()
    assert [r["route"] for r in first["requests"]] == ["pd", "prfaas"]
    assert first["now"] == 1000.0
    clock.now = 1001.0
    rec.finished(_done(1000.5))
    rec.decision("threshold", "by hand", 512.0, 600.0)
    rec.sample()
    second = rec.snapshot(since=first["now"])
    assert [r["at"] for r in second["requests"]] == [1000.5]
    assert [p["at"] for p in second["timeline"]] == [1001.0]
    assert [(d["kind"], d["before"], d["after"]) for d in second["decisions"]] == [
        ("threshold", 512.0, 600.0)
    ]
    assert rec.snapshot(since=second["now"])["requests"] == []
    assert first["run_id"] == second["run_id"]


def test_logs_are_bounded_and_totals_count_everything() -> None:
    """The ring keeps the newest `requests` entries and a snapshot sends at most
    `sent_requests`; the per-route totals and error count cover every request."""
    clock = Clock()
    rec = _recorder(clock, requests=5, sent_requests=3, timeline=2, decisions=2)
    for i in range(8):
        rec.finished(_done(990.0 + i, "prfaas" if i % 2 else "pd", status=200 if i else 429))
    for _ in range(3):
        rec.sample()
        rec.decision("regime", "r", "a", "b")
    snap = rec.snapshot()
    assert [r["at"] for r in snap["requests"]] == [995.0, 996.0, 997.0]
    assert len(rec.requests) == 5
    assert (len(snap["timeline"]), len(snap["decisions"])) == (2, 2)
    assert snap["totals"] == {"pd": 4, "prfaas": 4}
    assert snap["errors"] == 1


def test_rates_come_from_cumulative_counts_between_samples() -> None:
    """Requests per second by route: the count added between two samples over the time
    between them (the first sample has no rate), beside the cumulative counts."""
    clock = Clock()
    rec = _recorder(clock)
    rec.sample()
    for _ in range(6):
        rec.finished(_done(clock.now, "prfaas"))
    rec.finished(_done(clock.now, "pd"))
    clock.now += 2.0
    rec.sample()
    rec.finished(_done(clock.now, "none", status=400))
    clock.now += 0.5
    rec.sample()
    assert [p["requests_per_s"] for p in rec.timeline] == [
        {},
        {"prfaas": 3.0, "pd": 0.5},
        {"prfaas": 0.0, "pd": 0.0, "none": 2.0},
    ]
    assert [p["totals"] for p in rec.timeline] == [
        {},
        {"prfaas": 6, "pd": 1},
        {"prfaas": 6, "pd": 1, "none": 1},
    ]


def test_percentiles_cover_the_sliding_window_only() -> None:
    """Requests older than `window_s` leave the percentiles; None values (no TTFT: refused
    before routing) are not counted."""
    clock = Clock()
    rec = _recorder(clock, window_s=10.0)
    rec.finished(_done(985.0, ttft=9.0))  # outside the window
    for i in range(1, 101):
        rec.finished(_done(990.0 + i * 0.05, ttft=i / 1000))
    rec.finished(FinishedRequest(999.9, "none", 400, None, None, None, None))
    latency = rec.snapshot()["latency"]
    assert latency["requests"] == 101
    assert latency["ttft_s"]["count"] == 100
    assert latency["ttft_s"]["p50"] == pytest.approx(0.0505)
    assert latency["ttft_s"]["p99"] == pytest.approx(0.09901)
    assert percentiles([None]) == {"p50": None, "p90": None, "p99": None, "count": 0}


def test_sample_reads_roles_link_and_queue_from_the_state() -> None:
    """A timeline point counts healthy instances per cluster and role, and copies t,
    regime, egress, capacity, RTT and queue depths."""
    clock = Clock()
    state = _state(healthy_decode=False, threshold=2048.0)
    rec = _recorder(clock, state)
    rec.sample()
    point = rec.timeline[-1]
    assert point["roles"] == {"prfaas": {"prefill": 1}, "pd": {"prefill": 1}}
    assert (point["threshold"], point["regime"]) == (2048.0, "bandwidth_scarce")
    assert (point["egress_bytes_per_s"], point["capacity_bytes_per_s"]) == (1e6, 2e6)
    assert (point["rtt_s"], point["retransmission_rate"]) == (0.005, None)
    assert (point["queue_running"], point["queue_waiting"]) == (2, 1)


def test_rates_helper_counts_new_keys_from_zero() -> None:
    assert rates(None, (1.0, {"pd": 3})) == {}
    assert rates((1.0, {"pd": 3}), (1.0, {"pd": 4})) == {}
    assert rates((1.0, {"pd": 3}), (3.0, {"pd": 5, "prfaas": 1})) == {"pd": 1.0, "prfaas": 0.5}


@pytest.mark.parametrize(
    "limits", [{"requests": 0}, {"window_s": 0.0}, {"sample_interval_s": -1.0}]
)
def test_limits_are_validated(limits: dict[str, Any]) -> None:
    """A bad limit is refused, naming the field and the value."""
    ((name, value),) = limits.items()
    with pytest.raises(ValueError, match=f"{name} must be .*{value!r}"):
        ActivityLimits(**limits)

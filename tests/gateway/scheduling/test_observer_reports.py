"""Replicas' shared samples: what one gateway's observer reports, and what another's makes of
it (the leader's period covers both gateways' traffic; queues add up)."""

from __future__ import annotations

from prfaas.gateway.router import RouteEvent
from prfaas.gateway.scheduling.observer import BUSY_SMOOTHING_S, SchedulingObserver
from prfaas.policies.backlog import merged_backlogs
from prfaas.policies.routing import RouteDecision
from prfaas.policies.tables import PiecewiseLinear
from prfaas.policies.ttft_forecast import PrefillCosts
from prfaas.protocol.replica_report import ReplicaReport


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _decision(tokens: int, instance: str = "p0") -> RouteDecision:
    return RouteDecision("pd", instance, "d0", tokens, 0)


def _costs() -> PrefillCosts:
    one_s_per_1k = PiecewiseLinear((0.0, 100_000.0), (0.0, 100.0))
    return PrefillCosts(
        prfaas_prefill_s=one_s_per_1k, pd_prefill_s=one_s_per_1k, kv_bytes=one_s_per_1k
    )


def test_a_report_holds_what_happened_since_the_previous_one() -> None:
    """The first report starts the outbox (the samples before it were this gateway's
    period's, not news for the others); the next holds the lengths, answers (with how long
    ago their requests arrived), decode starts, the PD prefill work sent since the first
    report (not the 0.5 s before it), decoding requests and booked backlog."""
    clock = Clock(100.0)
    a = SchedulingObserver(_costs(), clock=clock)
    a.dispatched("before", _decision(500), "before")
    first = a.report("a", 1, wall_now=1_000.0)
    assert first.incremental == () and first.seq == 1
    a.dispatched("r1", _decision(2_000), "r1")
    a.dispatched("r2", _decision(3_000), "r2")
    clock.now = 101.0
    a.first_token("r1")
    a.first_token("r2")
    clock.now = 103.0
    a.finished(RouteEvent("r1", _decision(2_000), 2_000, 40))
    clock.now = 104.0
    second = ReplicaReport.decode(a.report("a", 2, wall_now=1_004.0).encode())
    assert second.incremental == (2_000, 3_000)
    assert second.outputs == (40,) and second.arrived_ago == (4.0,)
    assert second.decode_starts == 2 and second.decoding == 1
    assert second.backlog["p0"] > 0 and second.at == 1_004.0
    assert second.local_work_s == 5.0  # 2 s + 3 s of PD prefill
    assert a.report("a", 3, wall_now=1_005.0).incremental == ()


def test_merging_a_report_adds_its_samples_and_its_load() -> None:
    """The other gateway's lengths and answers join this period's samples (arrivals moved to
    this gateway's clock), its PD prefill work to the pool's offered load, its decoding
    requests and its backlog add to this one's, and are dropped when it leaves."""
    clock = Clock(50.0)
    b = SchedulingObserver(_costs(), clock=clock)
    b.dispatched("own", _decision(1_000), "own")  # 1 s of predicted prefill on p0
    report = ReplicaReport(
        replica="a", seq=7, at=0.0, incremental=(2_000, 3_000), outputs=(40,),
        arrived_ago=(4.0,), decode_starts=2, decoding=3, backlog={"p0": 2.5, "p1": 1.0},
        local_work_s=5.0,
    )  # fmt: skip
    b.merge(report, age_s=0.5)
    # the PD pool's offered work: its own 1 s and the report's 5 s
    assert abs(b.local_work.read(clock.now) - 6 / BUSY_SMOOTHING_S) < 1e-9
    samples = b.peek_samples()
    assert samples.incremental == [1_000, 2_000, 3_000]
    assert samples.outputs == [40] and samples.arrivals == [50.0 - 0.5 - 4.0]
    assert samples.decode_starts == 2 and b.decoding_now == 3
    assert b.lengths_routed == 3 and list(b.recent_lengths) == [1_000, 2_000, 3_000]
    backlogs = b.backlogs(clock.now)
    assert abs(backlogs["p0"] - (1.0 + 2.0)) < 1e-9 and abs(backlogs["p1"] - 0.5) < 1e-9
    assert b.pool_backlog(["p0", "p1"]) == backlogs["p1"]
    assert b.replicas_heard == ("a",)
    b.forget("a")
    assert b.decoding_now == 0 and b.backlogs(clock.now) == {"p0": 1.0}


def test_merged_backlogs_age_each_report() -> None:
    """A reported backlog shrinks by its age (one second of work per second) and never goes
    negative; an instance only another gateway booked appears too."""
    merged = merged_backlogs({"p0": 1.0}, [({"p0": 2.0, "p1": 0.5}, 1.0), ({"p0": 3.0}, -1.0)])
    assert merged == {"p0": 1.0 + 1.0 + 3.0}

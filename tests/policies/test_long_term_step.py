"""The long-term scheduler's pure steps: what woke a period, the step tests of a tick, a
period's plan, and the deferred move (no loop, no clock: every time comes in)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from prfaas.policies.distributions import TruncatedLogNormal
from prfaas.policies.length_cusum import LengthCusum
from prfaas.policies.long_term_step import (
    LongTermConfig,
    LongTermMemory,
    Now,
    PeriodInput,
    PeriodSample,
    StepConfig,
    Wake,
    capacity_stepped,
    conversion_ended,
    conversion_started,
    deferred_step,
    long_term_step,
    period_wake,
    watch,
)
from prfaas.policies.profile import DeploymentProfile, load_profile
from prfaas.policies.rebalance import (
    Conversion,
    Member,
    Pools,
    RebalanceConfig,
    RebalanceState,
)
from prfaas.policies.schedule_state import ScheduleState
from prfaas.policies.workload_estimate import EstimateConfig, Moments, WorkloadEstimate

CONFIG = LongTermConfig(60.0, RebalanceConfig(), EstimateConfig(), StepConfig())
GBIT = 1e9 / 8


@pytest.fixture(scope="module")
def profile(case_study_path: Path) -> DeploymentProfile:
    return load_profile(case_study_path)


def _estimate(mu: float = 9.9, n: float = 200) -> WorkloadEstimate:
    m, s = TruncatedLogNormal(mu, 1.0, 128, 131072).log_moments()
    lengths = Moments(n, n * m, n * (s * s + m * m))
    return WorkloadEstimate(2.0, lengths, 1024 * n, n, 100 * GBIT, 3, samples=n)


def _pools(n_p: int = 3, n_d: int = 5) -> Pools:
    return Pools(
        4,
        tuple(Member(f"pd-p{i}", i) for i in range(n_p)),
        tuple(Member(f"pd-d{i}", n_d - i) for i in range(n_d)),
    )


def _sample(started: float = 0.0) -> PeriodSample:
    return PeriodSample(started, (), (), (), 0, None, None)


def _now(at: float, lengths: tuple[int, ...] = (), routed: int = 0) -> Now:
    return Now(at, 0, lengths, 100, routed, 100 * GBIT)


def test_what_woke_a_period_is_one_value() -> None:
    """A workload step counted for `step_ticks` ticks, or a CUSUM alarm, names the wake;
    otherwise an early wake is the link's, a late one the timer's."""
    m = LongTermMemory()
    assert period_wake(CONFIG, m, woken=False) is Wake.TIMER
    assert period_wake(CONFIG, m, woken=True) is Wake.LINK
    assert period_wake(CONFIG, replace(m, answer_ticks=5), woken=True) is Wake.ANSWERS
    assert period_wake(CONFIG, replace(m, length_ticks=5), woken=True) is Wake.LENGTHS
    alarm = LengthCusum(up=25.0, up_n=40)
    both = replace(m, answer_ticks=5, cusum=alarm)
    assert period_wake(CONFIG, both, woken=True) is Wake.ANSWERS_AND_LENGTHS
    assert Wake.LINK.woken_by == ["link"] and Wake.TIMER.woken_by == []
    assert Wake.ANSWERS_AND_LENGTHS.woken_by == ["answers", "lengths"]
    assert Wake.LENGTHS.measured and not Wake.FIRST_LOOK.measured


def test_a_link_step_is_a_quarter_of_the_capacity_seen() -> None:
    seen = replace(LongTermMemory(), capacity_seen=100.0)
    assert not capacity_stepped(CONFIG, seen, 80.0)
    assert capacity_stepped(CONFIG, seen, 74.0)
    assert not capacity_stepped(CONFIG, LongTermMemory(), 10.0)  # no period yet


def test_a_step_of_length_counts_ticks_and_leaves_the_input_alone(
    profile: DeploymentProfile,
) -> None:
    """100 lengths far above the estimate's: the CUSUM sounds on the first tick, the mean of
    the 100 lies more than 0.4 from the estimate's on every tick (counted); the memory
    passed in is never changed."""
    memory = replace(LongTermMemory(), estimate=_estimate())
    long = tuple([80_000] * 100)
    stepped = []
    for tick in range(5):
        watched = watch(CONFIG, profile, memory, _sample(), _now(tick, long, 100))
        assert watched.memory is not memory
        memory = watched.memory
        stepped.append(watched.workload_stepped)
    assert stepped == [True] * 5
    assert memory.length_ticks == 5 and memory.cusum.alarm == 100
    assert LongTermMemory().cusum == LengthCusum()


def test_the_answer_step_test_needs_enough_requests_decoding_to_read(
    profile: DeploymentProfile,
) -> None:
    """Answers of 1,024 tokens at 2 req/s decode 51 requests at once (25 ms a step): none
    decoding for five ticks is a step down. At 0.05 req/s, 1.3 decode on average and a
    tick reading none says nothing: no step, however long it lasts (it read as answers of
    no tokens, and woke a period every five ticks)."""
    samples = PeriodSample(0.0, (), (1024,) * 30, (1.0,) * 30, 30, 0.0, 100 * GBIT)

    def stepped(rate: float) -> list[bool]:
        memory = replace(LongTermMemory(), estimate=replace(_estimate(), rate=rate),
                         answers_seen=100)  # fmt: skip
        seen = []
        for tick in range(6):
            watched = watch(CONFIG, profile, memory, samples, _now(10.0 + tick))
            memory = watched.memory
            seen.append(watched.workload_stepped)
        return seen

    assert stepped(2.0) == [False] * 4 + [True] * 2
    assert stepped(0.05) == [False] * 6


def test_a_timer_period_keeps_its_estimate_and_a_first_look_keeps_nothing(
    profile: DeploymentProfile,
) -> None:
    lengths = tuple(int(20_000 * (1 + i % 7) / 4) for i in range(60))
    samples = PeriodSample(0.0, lengths, (1024,) * 30, (1.0,) * 30, 30, 4.0, 100 * GBIT)
    schedule = ScheduleState(threshold=19_456, set_point=19_456)

    def period(wake: Wake) -> PeriodInput:
        return PeriodInput(wake, samples, _now(60.0), schedule, _pools())

    look = long_term_step(CONFIG, profile, LongTermMemory(), period(Wake.FIRST_LOOK))
    assert look.memory == LongTermMemory()
    plan = long_term_step(CONFIG, profile, LongTermMemory(), period(Wake.TIMER))
    assert plan.memory.estimate is not None and plan.memory.last is plan.decision
    assert plan.memory.answers_seen == 30 and plan.memory.capacity_seen == 100 * GBIT
    assert plan.inputs()["woken_by"] == [] and plan.after_wake == ()
    assert plan.decision.figures is not None


def test_a_deferred_move_waits_for_time_then_takes_the_least_loaded(
    profile: DeploymentProfile,
) -> None:
    move = Conversion("pd-d0", "decode", "prefill", 25_000.0)
    memory = replace(LongTermMemory(), deferred=move, deferred_split=(3, 5))
    memory = conversion_started(memory, move, now=100.0)
    assert deferred_step(CONFIG, memory, _pools(), 120.0) is None  # one is draining
    memory = conversion_ended(CONFIG, memory, 130.0, drain_s=5.0, ok=True)
    assert memory.rebalance.cooldown_until == 160.0
    assert deferred_step(CONFIG, memory, _pools(), 159.0) is None  # the cooldown
    # a period since the last conversion began (100 + 60) has passed at 160
    plan = deferred_step(CONFIG, memory, _pools(), 160.0)
    assert plan is not None and plan.conversion is not None
    assert plan.conversion.instance_id == "pd-d4" and plan.memory.deferred is None
    dropped = deferred_step(CONFIG, memory, _pools(4, 4), 160.0)
    assert dropped is not None and dropped.conversion is None
    assert dropped.reason == "deferred decode -> prefill dropped: 3P/5D is now 4P/4D"
    failed = conversion_ended(CONFIG, memory, 130.0, drain_s=0.0, ok=False)
    assert failed.deferred is None and failed.rebalance == RebalanceState(cooldown_until=160.0)

"""The long-term scheduler as pure steps: a tick's step tests, a period's estimate and
decision, and the deferred move. The loop (`gateway/scheduling/long_term.py`) gathers the
inputs, calls these, and applies the plans through the `ScheduleBoard`; see
`prfaas/sim/SCHEDULING.md` for why each rule and number is what it is.

Every tick, `watch` runs the step tests on what the requests are doing now:
- answer length: the requests decoding now imply (Little's law at the decode stage)
  answers `StepConfig.output_step` times longer or shorter than the estimate's, for
  `step_ticks` ticks in a row. Longer answers show in finished requests only a whole answer
  later; the count decoding shows them as soon as they outlive the old answers;
- incremental length: the mean ln L of the last lengths routed lies `length_step` from the
  estimate's for `step_ticks` ticks in a row, or Page's CUSUM of ln L against the
  estimate's mean sounds (`length_cusum.py`; it keeps its evidence across periods);
- the link: the measured capacity moved by more than `capacity_step` since the last period.
Any of them wakes a period at once (`Wake`). A woken period takes what the test saw
unblended, and the next regular period only what came after the wake; a move either wants
needs no confirmation (`rebalance.Evidence`).

A move the rebalancer deferred (refused only by a drain or the cooldown) is made by
`deferred_step` on the tick the cooldown ends, if a period has passed since the last
conversion began and the split is still the one it was decided on.

No I/O, no clock reads: the time comes in with each input.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from prfaas.common.toml_tables import check
from prfaas.policies.length_cusum import LengthCusum
from prfaas.policies.profile import DeploymentProfile
from prfaas.policies.rebalance import (
    Conversion,
    Evidence,
    Pools,
    RebalanceConfig,
    RebalanceDecision,
    RebalanceState,
    rebalance,
)
from prfaas.policies.schedule_state import ScheduleState
from prfaas.policies.workload_estimate import (
    EstimateConfig,
    Moments,
    PeriodObservation,
    WorkloadEstimate,
    update_estimate,
)


@dataclass(frozen=True)
class StepConfig:
    """The step tests that wake a long-term period early (the `[scheduler.steps]` table)."""

    capacity_step: float = 0.25
    """A relative change of the measured link capacity since the last period that is a step
    (and a period's capacity is then the latest measurement, not the period's mean)."""
    output_step: float = 1.5
    """The requests decoding now imply answers this many times longer (or shorter) than the
    estimate's: a step of answer length."""
    length_step: float = 0.4
    """The last lengths routed have a mean ln L this far from the estimate's: a step of
    incremental length. Their mean has a standard error of about 0.09 (sigma of ln L about
    0.9, 100 lengths): 0.4 is over four of those, and under the 0.59 by which the
    length-shift scenario moves the sample mean."""
    step_ticks: int = 5
    """A step of answer or incremental length must be seen for this many ticks in a row."""
    min_decoding: float = 4.0
    """Requests decoding at once, by Little's law on the estimate, below which the
    answer-length test is not run: a count of a few, read once a tick, is too noisy to
    show a step (a light load decoding 0.2 on average reads 0 on most ticks)."""

    def __post_init__(self) -> None:
        check(self.capacity_step > 0, "capacity_step", self.capacity_step, "must be > 0")
        check(self.output_step > 1, "output_step", self.output_step, "must be > 1")
        check(self.length_step > 0, "length_step", self.length_step, "must be > 0")
        check(self.step_ticks >= 1, "step_ticks", self.step_ticks, "must be >= 1")
        check(self.min_decoding >= 0, "min_decoding", self.min_decoding, "must be >= 0")


@dataclass(frozen=True)
class LongTermConfig:
    """What the pure steps need of the `[scheduler]` table."""

    period_s: float
    rebalance: RebalanceConfig
    estimate: EstimateConfig
    steps: StepConfig

    @property
    def estimating(self) -> EstimateConfig:
        """The estimate's settings, its rate window at most half a period (short periods, as
        in tests, still learn the rate)."""
        window = min(self.estimate.rate_window_s, self.period_s / 2)
        return replace(self.estimate, rate_window_s=window)


class Wake(enum.Enum):
    """What started a period."""

    TIMER = "timer"
    """The period's time was up."""
    FIRST_LOOK = "first look"
    """Enough requests to estimate on, before the first period ends: the set-point may move,
    nothing else is kept."""
    LINK = "link"
    """A step of the measured link."""
    ANSWERS = "answers"
    """A step of answer length."""
    LENGTHS = "lengths"
    """A step of incremental length."""
    ANSWERS_AND_LENGTHS = "answers and lengths"
    """Both steps at once."""

    @property
    def answers(self) -> bool:
        return self in (Wake.ANSWERS, Wake.ANSWERS_AND_LENGTHS)

    @property
    def lengths(self) -> bool:
        return self in (Wake.LENGTHS, Wake.ANSWERS_AND_LENGTHS)

    @property
    def measured(self) -> bool:
        """Woken by a measured step (link, answers or lengths)."""
        return self not in (Wake.TIMER, Wake.FIRST_LOOK)

    @property
    def woken_by(self) -> list[str]:
        """The steps that woke it, as the decision log names them."""
        if self is Wake.LINK:
            return ["link"]
        return [n for n, on in (("answers", self.answers), ("lengths", self.lengths)) if on]


@dataclass(frozen=True)
class PeriodSample:
    """What the requests did in the period (the observer's samples, merged)."""

    started: float
    incremental: tuple[int, ...]
    """The incremental lengths routed."""
    outputs: tuple[int, ...]
    """The answers (tokens) of the requests that finished."""
    arrivals: tuple[float, ...]
    """When each of `outputs`' requests was first dispatched."""
    decode_starts: int
    """First tokens: the decode stage's arrivals."""
    mean_decoding: float | None
    """Requests decoding, the mean over the period's ticks (None: no tick yet)."""
    mean_capacity: float | None
    """The link capacity measured, the mean over the period's ticks (bytes/s)."""

    def answers_since(self, at: float) -> tuple[int, ...]:
        """The answers of the requests first dispatched at or after `at`."""
        return tuple(n for n, t in zip(self.outputs, self.arrivals, strict=True) if t >= at)


@dataclass(frozen=True)
class Now:
    """What the requests and the link show at this instant."""

    at: float
    decoding: int
    """Requests decoding now (first token out, not finished)."""
    recent_lengths: tuple[int, ...]
    """The last incremental lengths routed, whatever the period (oldest first)."""
    recent_capacity: int
    """How many `recent_lengths` holds when full."""
    lengths_routed: int
    """Incremental lengths routed in all (which of `recent_lengths` are new)."""
    capacity: float | None
    """The latest measured link capacity (bytes/s; None: not measured)."""


@dataclass(frozen=True)
class LongTermMemory:
    """What the long-term steps carry from one call to the next."""

    rebalance: RebalanceState = field(default_factory=RebalanceState)
    estimate: WorkloadEstimate | None = None
    last: RebalanceDecision | None = None
    """The last period's decision."""
    capacity_seen: float | None = None
    """The link capacity the last period planned with."""
    answer_ticks: int = 0
    """Ticks in a row whose requests decoding implied a step of answer length."""
    length_ticks: int = 0
    """Ticks in a row whose recent lengths were a step."""
    cusum: LengthCusum = field(default_factory=LengthCusum)
    """Of ln L against the estimate's mean (never mutated: each step copies it)."""
    lengths_read: int = 0
    """`Now.lengths_routed` when the CUSUM last read the lengths."""
    answers_seen: int = 0
    """Finished requests the periods have seen."""
    lengths_restart: bool = False
    """The last period was woken by a step of length."""
    answers_since: float | None = None
    """When the last period woken by answers ran."""
    deferred: Conversion | None = None
    """The last period's move, waiting for the cooldown."""
    deferred_split: tuple[int, int] = (0, 0)
    """The (prefill, decode) split it was decided on."""
    last_start: float = -math.inf
    """When the last conversion began."""


@dataclass(frozen=True)
class PeriodInput:
    """One period's inputs."""

    wake: Wake
    samples: PeriodSample
    now: Now
    schedule: ScheduleState
    pools: Pools
    """The PD cluster as the rebalancer plans with it (a conversion under way counted in its
    new role)."""


@dataclass(frozen=True)
class LongTermPlan:
    """One period's outcome, for the loop to apply."""

    memory: LongTermMemory
    decision: RebalanceDecision
    """The set-point, the conversion or deferral, the figures."""
    wake: Wake
    after_wake: tuple[str, ...]
    """What the period took unblended because a wake came before it ("answers",
    "lengths")."""
    forget_recent_lengths: bool
    """The CUSUM sounded: the mean-of-recent test waits for lengths from after the wake."""

    def inputs(self) -> dict[str, object]:
        """The decision's inputs, as the board logs them."""
        figures = self.decision.figures
        return {
            "outcome": self.decision.outcome,
            "woken_by": self.wake.woken_by,
            "after_wake": list(self.after_wake),
            **({} if figures is None else figures.to_json()),
        }


def clamped(profile: DeploymentProfile, incremental: Iterable[int]) -> list[int]:
    """Incremental lengths clamped into the profile's range (the fit's support)."""
    lengths = profile.workload.lengths
    lo, hi = round(lengths.lo), round(lengths.hi)
    return [min(max(n, lo), hi) for n in incremental]


def little_inverse(profile: DeploymentProfile, output: float, rate: float) -> float | None:
    """Requests decoding at once that answers of `output` tokens at `rate` arrivals per
    second make (Little's law; None without a decode step)."""
    step = profile.pd.hardware.decode_step_seconds
    return None if step is None else output * rate * step


def little(profile: DeploymentProfile, decoding: float, rate: float) -> float | None:
    """Answer length (tokens) that `decoding` requests in flight imply at `rate` arrivals per
    second, by Little's law at the decode stage (None without a decode step or a rate)."""
    step = profile.pd.hardware.decode_step_seconds
    if step is None or rate <= 0:
        return None
    return decoding / (rate * step)


# ---- every tick ----------------------------------------------------------------------


@dataclass(frozen=True)
class Watched:
    """A tick's step tests: the memory they leave, and whether a step was seen."""

    memory: LongTermMemory
    workload_stepped: bool


def watch(
    config: LongTermConfig,
    profile: DeploymentProfile,
    memory: LongTermMemory,
    samples: PeriodSample,
    now: Now,
) -> Watched:
    """Both workload step tests of one tick (each counts its ticks in a row): whether the
    answers or the incremental lengths have stepped. `samples`: the period so far."""
    memory, answers = _answers_stepped(config, profile, memory, samples, now)
    memory, lengths = _lengths_stepped(config, profile, memory, now)
    return Watched(memory, answers or lengths)


def capacity_stepped(
    config: LongTermConfig, memory: LongTermMemory, capacity: float | None
) -> bool:
    """The measured link moved by more than `capacity_step` since the last period."""
    seen = memory.capacity_seen
    if capacity is None or seen is None:
        return False
    return abs(capacity - seen) > config.steps.capacity_step * seen


def period_wake(config: LongTermConfig, memory: LongTermMemory, *, woken: bool) -> Wake:
    """What started a period: `woken` (early, by a step) or the timer. A workload step
    counted for `step_ticks` ticks (or a CUSUM alarm) names it; else an early wake was the
    link's."""
    ticks = config.steps.step_ticks
    answers = memory.answer_ticks >= ticks
    lengths = memory.length_ticks >= ticks or memory.cusum.alarm > 0
    if answers and lengths:
        return Wake.ANSWERS_AND_LENGTHS
    if answers:
        return Wake.ANSWERS
    if lengths:
        return Wake.LENGTHS
    return Wake.LINK if woken else Wake.TIMER


def _answers_stepped(
    config: LongTermConfig,
    profile: DeploymentProfile,
    memory: LongTermMemory,
    samples: PeriodSample,
    now: Now,
) -> tuple[LongTermMemory, bool]:
    """Whether the requests decoding now have implied answers at least `output_step` times
    longer, or shorter, than the estimate's for `step_ticks` ticks in a row; not tested
    where the estimate makes fewer than `min_decoding` requests decode at once.

    Little's law on the estimate's arrival rate and on this period's first tokens (it waits
    for `min_samples` of them), whichever makes the step smaller: the estimate lags a burst,
    and a burst or a prefill backlog reaches the decodes late. It also waits for
    `min_samples` finished requests: until the first answers end, the occupancy is still
    filling up and the estimate made from it is too short (a warm-up, not a step)."""
    estimate = memory.estimate
    output = None if estimate is None else estimate.output_tokens
    enough = config.estimate.min_samples
    if estimate is None or output is None or memory.answers_seen < enough:
        return memory, False
    expected = little_inverse(profile, output, estimate.rate)
    if expected is None or expected < config.steps.min_decoding:
        return replace(memory, answer_ticks=0), False
    if samples.decode_starts < enough:
        return replace(memory, answer_ticks=0), False
    duration = max(now.at - samples.started, 1e-9)
    rates = (estimate.rate, samples.decode_starts / duration)
    longest = little(profile, now.decoding, min(rates))
    shortest = little(profile, now.decoding, max(rates))
    if longest is None or shortest is None:
        return memory, False
    step = config.steps.output_step
    step_seen = shortest >= step * output or longest <= output / step
    ticks = memory.answer_ticks + 1 if step_seen else 0
    return replace(memory, answer_ticks=ticks), ticks >= config.steps.step_ticks


def _lengths_stepped(
    config: LongTermConfig, profile: DeploymentProfile, memory: LongTermMemory, now: Now
) -> tuple[LongTermMemory, bool]:
    """Whether the incremental lengths have stepped: the mean ln L of the recent lengths has
    lain at least `length_step` above or below the estimate's for `step_ticks` ticks in a
    row (a large step, at once), or the CUSUM has sounded (a step that the periods have half
    blended into the estimate before the first test saw it still sounds it)."""
    memory = _read_lengths(profile, memory, now)
    estimate, recent = memory.estimate, now.recent_lengths
    if estimate is None or estimate.lengths.n <= 0 or len(recent) < now.recent_capacity:
        return replace(memory, length_ticks=0), False
    mean = Moments.of(clamped(profile, recent)).mu
    step_seen = abs(mean - estimate.lengths.mu) >= config.steps.length_step
    ticks = memory.length_ticks + 1 if step_seen else 0
    memory = replace(memory, length_ticks=ticks)
    return memory, ticks >= config.steps.step_ticks or memory.cusum.alarm > 0


def _read_lengths(profile: DeploymentProfile, memory: LongTermMemory, now: Now) -> LongTermMemory:
    """The CUSUM with the lengths routed since the last tick added."""
    new = min(now.lengths_routed - memory.lengths_read, len(now.recent_lengths))
    estimate, cusum = memory.estimate, replace(memory.cusum)
    if estimate is None or estimate.lengths.n <= 0:
        cusum.reset()
    else:
        lengths = now.recent_lengths[-new:] if new > 0 else ()
        cusum.add(clamped(profile, lengths), estimate.lengths.mu)
    return replace(memory, cusum=cusum, lengths_read=now.lengths_routed)


# ---- every period --------------------------------------------------------------------


def long_term_step(
    config: LongTermConfig,
    profile: DeploymentProfile,
    memory: LongTermMemory,
    period: PeriodInput,
) -> LongTermPlan:
    """Estimate the workload and decide (see the module docstring). A first look decides on
    the samples so far and keeps nothing: the samples, the estimate and the confirmation
    streaks stay with the first real period."""
    wake, samples, now = period.wake, period.samples, period.now
    first_look = wake is Wake.FIRST_LOOK
    capacity = _period_capacity(config, samples.mean_capacity, now.capacity)
    observation = _observation(profile, memory, samples, now.at, capacity)
    estimate = update_estimate(config.estimating, memory.estimate, observation)
    estimate, after_wake = _unblended(config, profile, memory, period, estimate, observation)
    decision = rebalance(
        config.rebalance,
        _spaced(config, memory.rebalance, memory.last_start, now.at),
        profile,
        estimate,
        period.pools,
        now=now.at,
        set_point=period.schedule.set_point,
        min_samples=config.estimate.min_samples,
        evidence=Evidence(
            link_step=wake.measured,
            workload_step=wake.answers or wake.lengths or bool(after_wake),
            lengths_measured=wake.answers or wake.lengths or "lengths" in after_wake,
            first_look=first_look,
        ),
    )
    forget = wake.lengths and memory.cusum.alarm > 0
    if first_look:
        return LongTermPlan(memory, decision, wake, after_wake, forget)
    kept = replace(
        memory,
        rebalance=decision.state,
        estimate=estimate,
        last=decision,
        capacity_seen=capacity,
        answer_ticks=0,  # a new period: its own samples decide
        length_ticks=0,
        cusum=LengthCusum() if wake.lengths else memory.cusum,  # the step is taken
        answers_seen=memory.answers_seen + len(samples.outputs),
        lengths_restart=wake.lengths,
        answers_since=now.at if wake.answers else None,
        deferred=decision.deferred,
        deferred_split=(len(period.pools.prefill), len(period.pools.decode)),
    )
    return LongTermPlan(kept, decision, wake, after_wake, forget)


def _observation(
    profile: DeploymentProfile,
    memory: LongTermMemory,
    samples: PeriodSample,
    now: float,
    capacity: float | None,
) -> PeriodObservation:
    """The period's observation; after an answer wake only the answers of the requests that
    came after it (a long answer begun before a step down ends after it)."""
    duration = max(now - samples.started, 1e-9)
    occupancy = None
    if samples.mean_decoding is not None:
        occupancy = little(profile, samples.mean_decoding, samples.decode_starts / duration)
    since = memory.answers_since
    outputs = samples.outputs if since is None else samples.answers_since(since)
    lengths = clamped(profile, samples.incremental)
    return PeriodObservation.of(
        duration, lengths, list(outputs), capacity, occupancy_output=occupancy
    )


def _unblended(
    config: LongTermConfig,
    profile: DeploymentProfile,
    memory: LongTermMemory,
    period: PeriodInput,
    estimate: WorkloadEstimate,
    observation: PeriodObservation,
) -> tuple[WorkloadEstimate, tuple[str, ...]]:
    """The estimate with what a step measured taken unblended (a measurement of the new
    regime, not one more noisy sample of the old), and what the period after a wake took
    unblended."""
    wake, now = period.wake, period.now
    after_wake: list[str] = []
    stepped_output = None  # the answers decoding now, at the long-run arrival rate
    if wake.answers and memory.estimate is not None:
        stepped_output = little(profile, now.decoding, memory.estimate.rate)
    if stepped_output is not None and stepped_output >= 1:
        estimate = replace(estimate, output_sum=stepped_output, output_n=1.0)
    elif memory.answers_since is not None and observation.finished > 0:
        estimate = replace(
            estimate, output_sum=observation.output_tokens, output_n=observation.finished
        )
        after_wake.append("answers")  # only those of requests that came after the wake
    if wake.lengths:  # the last lengths routed, not blended with older periods
        recent = Moments.of(clamped(profile, _step_lengths(config, memory, now)))
        estimate = replace(estimate, lengths=recent, samples=recent.n)
    elif memory.lengths_restart and observation.lengths.n >= config.estimate.min_samples:
        estimate = replace(estimate, lengths=observation.lengths, samples=observation.lengths.n)
        after_wake.append("lengths")  # all of them after the step
    return estimate, tuple(after_wake)


def _step_lengths(config: LongTermConfig, memory: LongTermMemory, now: Now) -> Sequence[int]:
    """The lengths a length wake measures: the recent ones, or after a CUSUM alarm those
    since its sum last stood at zero (the step's start; at least `min_samples`)."""
    lengths = now.recent_lengths
    alarm = memory.cusum.alarm
    if alarm > 0:
        lengths = lengths[-max(alarm, int(config.estimate.min_samples)) :]
    return lengths


def _period_capacity(
    config: LongTermConfig, mean: float | None, latest: float | None
) -> float | None:
    """The period's mean measured capacity, or the latest measurement when the link stepped
    during the period (the mean would blend two different links)."""
    if mean is None or latest is None:
        return latest if mean is None else mean
    return latest if abs(latest - mean) > config.steps.capacity_step * mean else mean


def _spaced(
    config: LongTermConfig, state: RebalanceState, last_start: float, now: float
) -> RebalanceState:
    """`state` with a period since the last conversion began counted as cooldown too (at
    most one conversion per period, whatever woke the period or deferred a move)."""
    spaced = last_start + config.period_s
    if spaced <= max(state.cooldown_until, now):
        return state
    return replace(state, cooldown_until=spaced)


# ---- the deferred move and the conversions' life -------------------------------------


@dataclass(frozen=True)
class DeferredPlan:
    """What becomes of a deferred move on this tick."""

    memory: LongTermMemory
    reason: str
    conversion: Conversion | None
    """The move to start now (None: dropped, the split changed)."""


def deferred_step(
    config: LongTermConfig, memory: LongTermMemory, pools: Pools, now: float
) -> DeferredPlan | None:
    """The deferred move, once no conversion is draining, its cooldown is over and a period
    has passed since the last began (None: nothing to do yet). It goes to the least loaded
    member of the losing pool as it is now, and is dropped if the split is no longer the one
    it was decided on (an instance failed, left or came: decide anew)."""
    move, state = memory.deferred, memory.rebalance
    if move is None or state.converting is not None:  # one is draining
        return None
    if now < _spaced(config, state, memory.last_start, now).cooldown_until:
        return None
    memory = replace(memory, deferred=None)
    split = (len(pools.prefill), len(pools.decode))
    move_text = f"{move.from_role} -> {move.to_role}"
    if split != memory.deferred_split:
        (p0, d0), (p1, d1) = memory.deferred_split, split
        return DeferredPlan(
            memory, f"deferred {move_text} dropped: {p0}P/{d0}D is now {p1}P/{d1}D", None
        )
    losing = pools.decode if move.from_role == "decode" else pools.prefill
    chosen = min(losing, key=lambda m: (m.load, m.instance_id))
    conversion = replace(move, instance_id=chosen.instance_id)
    return DeferredPlan(
        memory, f"deferred {move_text}: converting {chosen.instance_id}", conversion
    )


def conversion_started(
    memory: LongTermMemory, conversion: Conversion, now: float
) -> LongTermMemory:
    """A conversion began at `now`."""
    state = memory.rebalance.started(conversion.instance_id)
    return replace(memory, rebalance=state, last_start=now)


def conversion_ended(
    config: LongTermConfig, memory: LongTermMemory, now: float, drain_s: float, *, ok: bool
) -> LongTermMemory:
    """A conversion ended at `now` after draining `drain_s` seconds; a failed one drops the
    deferred move (decided on a split that did not come to be)."""
    state = memory.rebalance.finished(config.rebalance, now, drain_s)
    return replace(memory, rebalance=state, deferred=memory.deferred if ok else None)

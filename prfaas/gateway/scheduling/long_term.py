"""The long-term loop (every period, about a minute): estimate the workload, re-solve the
set-point, and convert one PD-cluster instance when the rebalancer says so.

A step in the measured link capacity (more than 25%) starts a period at once rather than at
the period's end: a measurement needs no sampling window to be believed. So does a step in
output length: when the requests decoding now imply (Little's law) answers at least 1.5x
longer or shorter than the estimate's, for 5 ticks in a row. Longer answers show in
finished requests only a whole answer later, and in the period's mean occupancy diluted by
the time before the step; the count of requests decoding shows them as soon as they outlive
the old answers (and shorter ones as soon as the long ones have ended). That period takes
the output length from the count now, unblended (and the next regular period only the
answers of the requests that came after it, a long answer begun before a step down ending
after it; until one of those has finished, as after a step up, that period's occupancy by
Little's law stands for them, as in any period). And so does a step in incremental length:
when the last 100 lengths routed have a mean ln L at least 0.4 from the estimate's, for 5
ticks in a row (that period takes its lengths from those 100, unblended, and the next
regular period only its own: the 100 still held lengths from before the step, and blending
would keep them for periods), or when a CUSUM of ln L against the estimate's mean sounds
(it keeps its evidence across periods, which catches a step that regular periods had half
blended in before the first test saw it; that period takes the lengths since the step
began). A move either step wants needs no confirmation.

A move that the rebalancer refused only because a conversion was draining or cooling
down (`deferred`) is made on the tick that the cooldown ends, if a period has passed since
the last conversion began (at most one per period) and no later period decided otherwise.
Waiting for the next period instead cost up to a period for every instance of a
several-instance step. A period during a drain plans with the split the conversion makes
(`pools(planned=True)`).

The slow loop owns the set-point: when the re-solved `t` moves beyond the dead band, `t` is
reset to it (the fast loop then trims around the new value). A conversion runs in the
background (its drain may outlast a period); when it is done the instance's new role and
the set-point re-solved for the new split are applied together.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from prfaas.gateway.instances import InstanceManager
from prfaas.gateway.scheduling.config import SchedulerConfig
from prfaas.gateway.scheduling.decisions import ScheduleBoard
from prfaas.gateway.scheduling.observer import PeriodSamples, SchedulingObserver
from prfaas.gateway.scheduling.roles import ConversionResult, RoleConverter
from prfaas.gateway.scheduling.short_term import ShortTermLoop
from prfaas.policies.length_cusum import LengthCusum
from prfaas.policies.profile import DeploymentProfile
from prfaas.policies.rebalance import (
    Conversion,
    Member,
    Pools,
    RebalanceDecision,
    RebalanceState,
    rebalance,
)
from prfaas.policies.schedule_state import InstanceRole
from prfaas.policies.workload_estimate import (
    Moments,
    PeriodObservation,
    WorkloadEstimate,
    update_estimate,
)

logger = logging.getLogger(__name__)
CAPACITY_STEP = 0.25  # a relative change of measured link capacity that is a step
OUTPUT_STEP = 1.5  # decoding now implies answers this many times the estimate: a step
LENGTH_STEP = 0.4
"""The recent incremental lengths' mean ln L this far from the estimate's: a step. Their
mean has a standard error of about 0.09 (sigma of ln L about 0.9, 100 lengths): 0.4 is over
four of those, and under the 0.59 by which the length-shift scenario moves the sample mean."""
STEP_TICKS = 5  # a step of the workload must be seen for this many ticks in a row


class LongTermLoop:
    """One `period` per `period_s`."""

    def __init__(
        self,
        config: SchedulerConfig,
        profile: DeploymentProfile,
        board: ScheduleBoard,
        observer: SchedulingObserver,
        instances: InstanceManager,
        short: ShortTermLoop,
        converter: RoleConverter,
    ) -> None:
        self._config = config
        self._profile = profile
        self._board = board
        self._observer = observer
        self._instances = instances
        self._short = short
        self._converter = converter
        self.state = RebalanceState()
        self.estimate: WorkloadEstimate | None = None
        self.last: RebalanceDecision | None = None
        self._conversion: asyncio.Task[None] | None = None
        self.conversions: list[ConversionResult] = []
        self.capacity_seen: float | None = None
        """The link capacity the last period planned with."""
        self._step_ticks = 0  # ticks in a row whose occupancy implied a step of answer length
        self._length_ticks = 0  # ticks in a row whose recent lengths were a step
        self._cusum = LengthCusum()  # of ln L against the estimate's mean
        self._lengths_read = 0  # `observer.lengths_routed` when the CUSUM last read them
        window = min(config.estimate.rate_window_s, config.period_s / 2)
        self._estimating = replace(config.estimate, rate_window_s=window)
        """The estimate's settings, its rate window at most half a period (short periods,
        as in tests, still learn the rate)."""
        self._answers_seen = 0  # finished requests the periods have seen
        self._lengths_restart = False  # the last period was woken by a step of length
        self._answers_since: float | None = None  # when the last period woken by answers ran
        self._deferred: Conversion | None = None  # the last period's move, waiting for time
        self._deferred_split = (0, 0)  # the (prefill, decode) split it was decided on
        self._last_start = -math.inf  # when the last conversion began
        self._moving: Conversion | None = None  # the conversion under way

    def period(self, *, stepped: bool = False, first_look: bool = False) -> RebalanceDecision:
        """Estimate, decide, and start what was decided (`stepped`: woken early by a step of
        the measured link). `first_look`: an early look at the first requests, before the
        first period ends; it only moves the set-point when the re-solved `t` is far off
        (`urgent_set_point`), and keeps nothing else: the samples, the estimate and the
        confirmation streaks stay with the first real period."""
        observer = self._observer
        samples = observer.peek_samples() if first_look else observer.take_samples()
        now = observer.now()
        capacity = self._period_capacity(samples.mean_capacity())
        if not first_look:
            self.capacity_seen = capacity
        clamped = self._clamped(samples.incremental)
        duration = max(now - samples.started, 1e-9)
        occupancy = self._occupancy_output(samples, duration)
        since = self._answers_since
        outputs = samples.outputs if since is None else samples.answers_since(since)
        obs = PeriodObservation.of(duration, clamped, outputs, capacity, occupancy_output=occupancy)
        stepped_output = None  # the answers decoding now, at the long-run arrival rate
        output_step = not first_look and self._step_ticks >= STEP_TICKS
        alarm = self._cusum.alarm
        length_step = not first_look and (self._length_ticks >= STEP_TICKS or alarm > 0)
        if output_step and self.estimate is not None:
            stepped_output = self._little(observer.decoding_now, self.estimate.rate)
        estimate = update_estimate(self._estimating, self.estimate, obs)
        if stepped_output is not None:  # a step, not a sample: taken unblended
            estimate = replace(estimate, output_sum=stepped_output, output_n=1.0)
        fresh = []  # what this period, the first after a wake, takes unblended
        if stepped_output is None and since is not None and obs.finished > 0:
            estimate = replace(estimate, output_sum=obs.output_tokens, output_n=obs.finished)
            fresh.append("answers")  # only those of requests that came after the wake
        if length_step:  # likewise: the last lengths routed, not blended with older periods
            lengths = list(observer.recent_lengths)
            if alarm > 0:  # those since the CUSUM last stood at zero (the step's start)
                lengths = lengths[-max(alarm, int(self._config.estimate.min_samples)) :]
            recent = Moments.of(self._clamped(lengths))
            self._cusum.reset()  # the step is taken
            if alarm > 0:  # the first test waits for 100 lengths that all came after it
                observer.recent_lengths.clear()
            estimate = replace(estimate, lengths=recent, samples=recent.n)
        elif self._lengths_restart and obs.lengths.n >= self._config.estimate.min_samples:
            estimate = replace(estimate, lengths=obs.lengths, samples=obs.lengths.n)
            fresh.append("lengths")  # all of them after the step
        if not first_look:
            self._step_ticks = self._length_ticks = 0  # a new period: its own samples decide
            self._lengths_restart = length_step
            self._answers_since = now if output_step else None
        board = self._board
        pools = self.pools(planned=True)
        decision = rebalance(
            self._config.rebalance,
            self._spaced(self.state, now),
            self._profile,
            estimate,
            pools,
            now=now,
            set_point=board.state.set_point,
            min_samples=self._config.estimate.min_samples,
            stepped=stepped,
            workload_stepped=output_step or length_step or bool(fresh),
            set_point_only=first_look,
            step_measured=output_step or length_step or "lengths" in fresh,
        )
        if first_look:
            if decision.set_point != board.state.set_point:
                inputs = {"outcome": "first look", **(decision.numbers or {})}
                self._set_point(decision.set_point, decision.planned_utilisation, inputs)
                self._short.planned(decision.planned_utilisation)
            return decision
        self.estimate = estimate
        self._answers_seen += len(samples.outputs)
        self.state, self.last = decision.state, decision
        self._deferred = decision.deferred
        self._deferred_split = (len(pools.prefill), len(pools.decode))
        counters = board.counters
        if counters is not None:
            counters.rebalance.labels(decision.outcome).inc()
        woken = [n for n, on in (("answers", output_step), ("lengths", length_step)) if on]
        if stepped and not woken:
            woken = ["link"]
        inputs = {
            "outcome": decision.outcome,
            "woken_by": woken,
            "after_wake": fresh,
            **(decision.numbers or {}),
        }
        if decision.outcome in ("refused", "convert", "pending"):
            board.note("long-term", "rebalance", decision.reason, inputs)
        self._set_point(decision.set_point, decision.planned_utilisation, inputs)
        self._short.planned(decision.planned_utilisation)
        if decision.conversion is not None:
            self._start(decision.conversion, inputs)
        return decision

    def _clamped(self, incremental: Iterable[int]) -> list[int]:
        """Incremental lengths clamped into the profile's range (the fit's support)."""
        lengths = self._profile.workload.lengths
        lo, hi = round(lengths.lo), round(lengths.hi)
        return [min(max(n, lo), hi) for n in incremental]

    def _occupancy_output(self, samples: PeriodSamples, duration: float) -> float | None:
        """Output length by Little's law at the decode stage: the period's mean requests
        decoding over their arrival rate (first tokens) x decode step. The gateway's arrival
        rate would not do: a burst, or a prefill backlog, reaches the decodes later."""
        decoding = samples.mean_decoding()
        if decoding is None:
            return None
        return self._little(decoding, samples.decode_starts / duration)

    def _little(self, decoding: float, rate: float) -> float | None:
        """Answer length (tokens) that `decoding` requests in flight imply at `rate`."""
        step = self._profile.pd.hardware.decode_step_seconds
        if step is None or rate <= 0:
            return None
        return decoding / (rate * step)

    def workload_stepped(self) -> bool:
        """Called every tick: whether the answers or the incremental lengths have stepped
        (the scheduler then runs a period at once). Both tests run every tick (each counts
        its ticks in a row)."""
        answers, lengths = self._output_stepped(), self._length_stepped()
        return answers or lengths

    def _length_stepped(self) -> bool:
        """Whether the incremental lengths have stepped: the mean ln L of the last
        `RECENT_LENGTHS` has lain at least `LENGTH_STEP` above or below the estimate's for
        `STEP_TICKS` ticks in a row (a large step, at once), or the CUSUM of ln L against
        the estimate's mean has sounded (`LengthCusum`, Page's test: it keeps its evidence across
        periods, so a step that the periods have half blended into the estimate before the
        first test saw it still sounds it)."""
        estimate, recent = self.estimate, self._observer.recent_lengths
        self._read_lengths()
        if estimate is None or estimate.lengths.n <= 0 or len(recent) < (recent.maxlen or 0):
            self._length_ticks = 0
            return False
        mean = Moments.of(self._clamped(recent)).mu
        step_seen = abs(mean - estimate.lengths.mu) >= LENGTH_STEP
        self._length_ticks = self._length_ticks + 1 if step_seen else 0
        return self._length_ticks >= STEP_TICKS or self._cusum.alarm > 0

    def _read_lengths(self) -> None:
        """Add the lengths routed since the last tick to the CUSUM."""
        observer, estimate = self._observer, self.estimate
        new = min(observer.lengths_routed - self._lengths_read, len(observer.recent_lengths))
        self._lengths_read = observer.lengths_routed
        if estimate is None or estimate.lengths.n <= 0:
            self._cusum.reset()
            return
        lengths = list(observer.recent_lengths)[-new:] if new > 0 else []
        self._cusum.add(self._clamped(lengths), estimate.lengths.mu)

    def _output_stepped(self) -> bool:
        """Whether the requests decoding now have implied answers at least `OUTPUT_STEP`
        times longer, or shorter, than the estimate's for `STEP_TICKS` ticks in a row.

        Little's law on the estimate's arrival rate and on this period's decode arrivals
        (first tokens; it waits for `min_samples` of them), whichever makes the step
        smaller: the estimate lags a burst, and a burst or a prefill backlog reaches the
        decodes late. It also waits for `min_samples` finished requests: until the first
        answers end, the occupancy is still filling up and the estimate made from it is too
        short (a warm-up, not a step)."""
        estimate = self.estimate
        output = None if estimate is None else estimate.output_tokens
        samples = self._observer.peek_samples()
        enough = self._config.estimate.min_samples
        if estimate is None or output is None or self._answers_seen < enough:
            return False
        if samples.decode_starts < enough:
            self._step_ticks = 0
            return False
        duration = max(self._observer.now() - samples.started, 1e-9)
        rates = (estimate.rate, samples.decode_starts / duration)
        decoding = self._observer.decoding_now
        longest, shortest = self._little(decoding, min(rates)), self._little(decoding, max(rates))
        if longest is None or shortest is None:
            return False
        step_seen = shortest >= OUTPUT_STEP * output or longest <= output / OUTPUT_STEP
        self._step_ticks = self._step_ticks + 1 if step_seen else 0
        return self._step_ticks >= STEP_TICKS

    def _period_capacity(self, mean: float | None) -> float | None:
        """The period's mean measured capacity, or the latest measurement when the link
        stepped during the period (the mean would blend two different links)."""
        link = self._observer.link
        latest = None if link is None else link.capacity_bytes_per_s
        if mean is None or latest is None:
            return latest if mean is None else mean
        return latest if abs(latest - mean) > CAPACITY_STEP * mean else mean

    def capacity_stepped(self) -> bool:
        """The measured link moved by more than `CAPACITY_STEP` since the last period: the
        scheduler then runs a period at once (a measured step needs no sampling window)."""
        link, seen = self._observer.link, self.capacity_seen
        if link is None or seen is None:
            return False
        return abs(link.capacity_bytes_per_s - seen) > CAPACITY_STEP * seen

    def pools(self, *, planned: bool = False) -> Pools:
        """The PD cluster as it is now: healthy, not draining (a "both" instance is neither).
        `planned`: as the rebalancer plans with it, the instance being converted counted in
        its new role (a period during the drain decides on the split the conversion makes;
        without it, it saw one instance short and wanted the move under way once more)."""
        live = [s for s in self._instances if s.healthy and not s.draining]
        pd = [s for s in live if s.cluster == "pd"]
        prefill = [Member(s.instance_id, s.in_flight) for s in pd if s.role == "prefill"]
        decode = [Member(s.instance_id, s.in_flight) for s in pd if s.role == "decode"]
        moving = self._moving
        if planned and moving is not None:
            prefill = [m for m in prefill if m.instance_id != moving.instance_id]
            decode = [m for m in decode if m.instance_id != moving.instance_id]
            (prefill if moving.to_role == "prefill" else decode).append(Member(moving.instance_id))
        return Pools(
            n_prfaas=sum(s.cluster == "prfaas" and s.role != "decode" for s in live),
            prefill=tuple(prefill),
            decode=tuple(decode),
        )

    def _set_point(self, solved: float, planned: float | None, inputs: dict[str, Any]) -> None:
        board = self._board
        set_point = self._config.clamp(solved)
        if self._short.pinned or set_point == board.state.set_point:
            return
        before = board.state.set_point
        board.change(
            "long-term",
            "set_point",
            f"re-solved t {before:.0f} -> {set_point:.0f}",
            inputs,
            threshold=set_point,
            set_point=set_point,
        )
        self._short.reset_set_point(set_point, planned)

    @property
    def deferred(self) -> Conversion | None:
        """The move waiting for the cooldown to end, if any."""
        return self._deferred

    def make_deferred(self) -> None:
        """Called every tick: make the move the last period deferred, once no conversion
        is draining, its cooldown is over and a period has passed since it began. The move
        goes to the least loaded member of the losing pool as it is now, and is dropped if
        that pool is down to one instance."""
        move, now = self._deferred, self._observer.now()
        if move is None or self.state.converting is not None:  # one is draining
            return
        if now < self._spaced(self.state, now).cooldown_until:
            return
        self._deferred = None
        pools = self.pools()
        losing = pools.decode if move.from_role == "decode" else pools.prefill
        last = self.last
        inputs = {"outcome": "convert", "deferred": True, **((last and last.numbers) or {})}
        split = (len(pools.prefill), len(pools.decode))
        if split != self._deferred_split:  # an instance failed, left or came: decide anew
            (p0, d0), (p1, d1) = self._deferred_split, split
            move_text = f"{move.from_role} -> {move.to_role}"
            why = f"deferred {move_text} dropped: {p0}P/{d0}D is now {p1}P/{d1}D"
            self._board.note("long-term", "rebalance", why, {**inputs, "outcome": "refused"})
            return
        chosen = min(losing, key=lambda m: (m.load, m.instance_id))
        why = f"deferred {move.from_role} -> {move.to_role}: converting {chosen.instance_id}"
        self._board.note("long-term", "rebalance", why, inputs)
        self._start(replace(move, instance_id=chosen.instance_id), inputs)

    def _spaced(self, state: RebalanceState, now: float) -> RebalanceState:
        """`state` with a period since the last conversion began counted as cooldown too
        (at most one conversion per period, whatever woke the period or deferred a move)."""
        spaced = self._last_start + self._config.period_s
        if spaced <= max(state.cooldown_until, now):
            return state
        return replace(state, cooldown_until=spaced)

    def _start(self, conversion: Conversion, inputs: dict[str, Any]) -> None:
        self._last_start = self._observer.now()
        self._moving = conversion
        self.state = self.state.started(conversion.instance_id)
        task = asyncio.get_running_loop().create_task(self._convert(conversion, inputs))
        self._conversion = task

    async def _convert(self, conversion: Conversion, inputs: dict[str, Any]) -> None:
        try:
            result = await self._converter.convert(conversion.instance_id, conversion.to_role)
        except Exception as exc:  # e.g. the instance left the registry meanwhile
            logger.exception("conversion of %s failed", conversion.instance_id)
            now = self._observer.now()
            result = ConversionResult(
                conversion.instance_id, conversion.to_role, False, now, 0.0, repr(exc)
            )
        self.conversions.append(result)
        self._moving = None
        board = self._board
        now = self._observer.now()
        self.state = self.state.finished(self._config.rebalance, now, result.drain_s)
        self._observer.ledger.forget(conversion.instance_id)
        if board.counters is not None:
            board.counters.conversions.labels(
                conversion.to_role, "ok" if result.ok else "failed"
            ).inc()
        facts = {**inputs, "instance": conversion.instance_id, "drain_s": result.drain_s}
        roles = self._roles()
        if not result.ok:
            self._deferred = None  # decided on a split that did not come to be
            board.change(
                "long-term",
                "role",
                f"conversion of {conversion.instance_id} to "
                f"{conversion.to_role} failed: {result.error}",
                facts,
                roles=roles,
            )
            return
        why = f"{conversion.instance_id} {conversion.from_role} -> {conversion.to_role}"
        set_point = self._config.clamp(conversion.set_point)
        keep = self._short.pinned
        board.change(
            "long-term",
            "role",
            why,
            facts,
            roles=roles,
            threshold=None if keep else set_point,
            set_point=None if keep else set_point,
        )
        if not keep:
            self._short.reset_set_point(set_point, conversion.planned_utilisation)

    def _roles(self) -> dict[str, InstanceRole]:
        return {s.instance_id: s.role for s in self._instances if s.cluster == "pd"}

    @property
    def converting(self) -> bool:
        return self._conversion is not None and not self._conversion.done()

    async def stop(self) -> None:
        """Cancel a conversion in progress (the engine finishes its own switch)."""
        task, self._conversion = self._conversion, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

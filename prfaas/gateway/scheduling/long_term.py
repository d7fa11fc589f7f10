"""The long-term loop (every period, about a minute, or at once when a step wakes it): it
gathers the period's inputs, calls the pure steps of `prfaas.policies.long_term_step`
(estimate, step tests, rebalance, deferred move), and applies their plans through the
`ScheduleBoard`.

The slow loop owns the set-point: when the re-solved `t` moves, `t` is reset to it (the fast
loop then trims around the new value), unless the move rests on the blended estimate alone
and the trimmer keeps `t` where it measured a congested side
(`threshold_trim.set_point_moved`). A conversion runs in the background (its drain may
outlast a period); when it is done the instance's new role and the set-point re-solved for
the new split are applied together. A period during a drain plans with the split the
conversion makes (`pools(planned=True)`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from prfaas.gateway.instances import InstanceManager
from prfaas.gateway.scheduling.config import SchedulerConfig
from prfaas.gateway.scheduling.decisions import ScheduleBoard
from prfaas.gateway.scheduling.observer import PeriodSamples, SchedulingObserver
from prfaas.gateway.scheduling.roles import ConversionResult, RoleConverter
from prfaas.gateway.scheduling.short_term import ShortTermLoop
from prfaas.policies import long_term_step as core
from prfaas.policies.long_term_step import LongTermMemory, Now, PeriodInput, PeriodSample, Wake
from prfaas.policies.profile import DeploymentProfile
from prfaas.policies.rebalance import (
    Conversion,
    Member,
    Pools,
    RebalanceDecision,
    RebalanceState,
)
from prfaas.policies.schedule_state import InstanceRole
from prfaas.policies.workload_estimate import WorkloadEstimate

logger = logging.getLogger(__name__)


class LongTermLoop:
    """One `period` per `period_s` (the scheduler's task calls it), the step tests every
    tick (`workload_stepped`, `capacity_stepped`, `make_deferred`)."""

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
        self._core = config.long_term_config()
        self._profile = profile
        self._board = board
        self._observer = observer
        self._instances = instances
        self._short = short
        self._converter = converter
        self.memory = LongTermMemory()
        """What the pure steps carry from one call to the next."""
        self._conversion: asyncio.Task[None] | None = None
        self.conversions: list[ConversionResult] = []
        self._moving: Conversion | None = None  # the conversion under way
        self.on_fenced: Callable[[], None] | None = None
        """Called when an engine refuses a conversion because a newer leader exists."""

    @property
    def state(self) -> RebalanceState:
        return self.memory.rebalance

    @property
    def estimate(self) -> WorkloadEstimate | None:
        return self.memory.estimate

    @property
    def last(self) -> RebalanceDecision | None:
        """The last period's decision."""
        return self.memory.last

    @property
    def capacity_seen(self) -> float | None:
        """The link capacity the last period planned with."""
        return self.memory.capacity_seen

    @property
    def deferred(self) -> Conversion | None:
        """The move waiting for the cooldown to end, if any."""
        return self.memory.deferred

    def _now(self) -> Now:
        observer = self._observer
        recent = observer.recent_lengths
        link = observer.link
        return Now(
            at=observer.now(),
            decoding=observer.decoding_now,
            recent_lengths=tuple(recent),
            recent_capacity=recent.maxlen or 0,
            lengths_routed=observer.lengths_routed,
            capacity=None if link is None else link.capacity_bytes_per_s,
        )

    def period(self, *, stepped: bool = False, first_look: bool = False) -> RebalanceDecision:
        """Estimate, decide, and start what was decided (`stepped`: woken early by a step).
        `first_look`: an early look at the first requests, before the first period ends; it
        only moves the set-point when the re-solved `t` is far off, and keeps nothing else."""
        observer = self._observer
        samples = observer.peek_samples() if first_look else observer.take_samples()
        if first_look:
            wake = Wake.FIRST_LOOK
        else:
            wake = core.period_wake(self._core, self.memory, woken=stepped)
        period = PeriodInput(
            wake, _sample(samples), self._now(), self._board.state, self.pools(planned=True)
        )
        plan = core.long_term_step(self._core, self._profile, self.memory, period)
        if plan.forget_recent_lengths:
            observer.recent_lengths.clear()
        decision = plan.decision
        if first_look:
            if decision.set_point != self._board.state.set_point:
                inputs = {"outcome": "first look", **_figures(decision)}
                self._set_point(decision.set_point, decision.planned_utilisation, inputs)
                self._short.planned(decision.planned_utilisation)
            return decision
        self.memory = plan.memory
        self._apply(decision, plan.inputs())
        return decision

    def _apply(self, decision: RebalanceDecision, inputs: dict[str, Any]) -> None:
        """Count, log, and apply a period's decision through the board."""
        board = self._board
        if board.counters is not None:
            board.counters.rebalance.labels(decision.outcome).inc()
        if decision.outcome in ("refused", "convert", "pending"):
            board.note("long-term", "rebalance", decision.reason, inputs)
        self._set_point(decision.set_point, decision.planned_utilisation, inputs,
                        drifted=decision.set_point_drifted)  # fmt: skip
        self._short.planned(decision.planned_utilisation)
        if decision.conversion is not None:
            self._start(decision.conversion, inputs)

    def workload_stepped(self) -> bool:
        """Called every tick: whether the answers or the incremental lengths have stepped
        (the scheduler then runs a period at once). Both tests run every tick."""
        samples = _sample(self._observer.peek_samples())
        watched = core.watch(self._core, self._profile, self.memory, samples, self._now())
        self.memory = watched.memory
        return watched.workload_stepped

    def capacity_stepped(self) -> bool:
        """The measured link moved by more than `capacity_step` since the last period: the
        scheduler then runs a period at once (a measured step needs no sampling window)."""
        return core.capacity_stepped(self._core, self.memory, self._now().capacity)

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

    def _set_point(
        self,
        solved: float,
        planned: float | None,
        inputs: dict[str, Any],
        *,
        drifted: bool = False,
    ) -> None:
        """Move the set-point to `solved` (clamped); `t` goes with it unless the trimmer
        keeps it (`drifted`: see `ShortTermLoop.reset_set_point`)."""
        board = self._board
        set_point = self._config.clamp(solved)
        if self._short.pinned or set_point == board.state.set_point:
            return
        before = board.state.set_point
        threshold = self._short.reset_set_point(set_point, planned, drifted=drifted)
        kept = "" if threshold == set_point else f"; t kept at {threshold:.0f} by the trimmer"
        board.change(
            "long-term",
            "set_point",
            f"re-solved t {before:.0f} -> {set_point:.0f}{kept}",
            inputs,
            threshold=threshold,
            set_point=set_point,
        )

    def make_deferred(self) -> None:
        """Called every tick: make the move the last period deferred once its time has come
        (`long_term_step.deferred_step`), or drop it if the split changed."""
        now = self._observer.now()
        plan = core.deferred_step(self._core, self.memory, self.pools(), now)
        if plan is None:
            return
        self.memory = plan.memory
        inputs = {"outcome": "convert", "deferred": True, **_figures(self.memory.last)}
        if plan.conversion is None:
            self._board.note(
                "long-term", "rebalance", plan.reason, {**inputs, "outcome": "refused"}
            )
            return
        self._board.note("long-term", "rebalance", plan.reason, inputs)
        self._start(plan.conversion, inputs)

    def _start(self, conversion: Conversion, inputs: dict[str, Any]) -> None:
        self.memory = core.conversion_started(self.memory, conversion, self._observer.now())
        self._moving = conversion
        task = asyncio.get_running_loop().create_task(self._convert(conversion, inputs))
        self._conversion = task

    async def _convert(self, conversion: Conversion, inputs: dict[str, Any]) -> None:
        try:
            result = await self._converter.convert(
                conversion.instance_id, conversion.to_role, epoch=self._board.leader_epoch
            )
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
        self.memory = core.conversion_ended(
            self._core, self.memory, now, result.drain_s, ok=result.ok
        )
        self._observer.ledger.forget(conversion.instance_id)
        if board.counters is not None:
            board.counters.conversions.labels(
                conversion.to_role, "ok" if result.ok else "failed"
            ).inc()
        facts = {**inputs, "instance": conversion.instance_id, "drain_s": result.drain_s}
        roles = self._roles()
        if result.fenced:  # another gateway leads: say so, change nothing
            board.note("long-term", "fenced", result.error or "fenced", facts)
            if self.on_fenced is not None:
                self.on_fenced()
            return
        if not result.ok:
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


def _figures(decision: RebalanceDecision | None) -> dict[str, Any]:
    """A decision's figures as the board logs them."""
    figures = None if decision is None else decision.figures
    return {} if figures is None else figures.to_json()


def _sample(samples: PeriodSamples) -> PeriodSample:
    """The observer's samples as the pure steps read them."""
    return PeriodSample(
        started=samples.started,
        incremental=tuple(samples.incremental),
        outputs=tuple(samples.outputs),
        arrivals=tuple(samples.arrivals),
        decode_starts=samples.decode_starts,
        mean_decoding=samples.mean_decoding(),
        mean_capacity=samples.mean_capacity(),
    )

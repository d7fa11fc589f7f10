"""`Scheduler`: both loops, their request-path hook and their decision board, for one gateway.

Built with the gateway (when the deployment has a `[scheduler]` table or `prfaas serve`
supplies a measured profile), started and stopped with it. `attach_link` gives it the link
telemetry once that is set up; `pin` is the operator's override from `POST /admin/state`.

Among several gateway replicas (`prfaas.coordination`) only the leader decides: `lead`
announces its epoch to the engines (fencing) and hands both loops the state it followed;
`follow` stops deciding at once (a conversion the engine is draining for ends there, fenced
if a newer leader has announced itself).
A follower still measures (its request path needs the link and the backlog) and ends each
period by dropping its samples; the leader's decisions reach it through `board.apply`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from prfaas.engine_clients.base import BaseEngineClient
from prfaas.gateway.instances import InstanceManager
from prfaas.gateway.router import Router
from prfaas.gateway.scheduling.config import SchedulerConfig
from prfaas.gateway.scheduling.decisions import ScheduleBoard, SchedulerCounters
from prfaas.gateway.scheduling.long_term import LongTermLoop
from prfaas.gateway.scheduling.observer import SchedulingObserver
from prfaas.gateway.scheduling.roles import RoleConverter
from prfaas.gateway.scheduling.short_term import LinkReader, ShortTermLoop
from prfaas.policies.profile import DeploymentProfile
from prfaas.policies.routing import Regime
from prfaas.policies.schedule_state import ScheduleState
from prfaas.policies.ttft_forecast import PrefillCosts

logger = logging.getLogger(__name__)


def prefill_costs(profile: DeploymentProfile) -> PrefillCosts:
    """The profile's prefill tables and KV bytes, for the TTFT predictions."""
    return PrefillCosts(
        prfaas_prefill_s=profile.prfaas.hardware.prefill_seconds,
        pd_prefill_s=profile.pd.hardware.prefill_seconds,
        kv_bytes=profile.model.kv_bytes,
    )


def next_period_end(end: float, now: float, period_s: float, *, woken: bool) -> float:
    """When the long-term period that starts `now` ends: a period after the one that just
    ended (`end`), so that periods keep their length whatever the decision took (timed from
    the end of each decision, each live period ran its decision's time longer, about 10 ms,
    and the lag added up); a period from now when a step woke this one early, or when the
    last one overran its own period."""
    following = end + period_s
    return now + period_s if woken or following <= now else following


class Scheduler:
    """Owns the loops' tasks. Build inside the running loop."""

    def __init__(
        self,
        config: SchedulerConfig,
        profile: DeploymentProfile,
        router: Router,
        instances: InstanceManager,
        counters: SchedulerCounters | None = None,
    ) -> None:
        self.config = config
        self.observer = SchedulingObserver(prefill_costs(profile), conditional=config.conditional)
        t, regime = router.state.threshold, router.state.regime
        roles = {s.instance_id: s.role for s in instances if s.cluster == "pd"}
        initial = ScheduleState(
            threshold=t, set_point=t, regime=regime, roles=tuple(sorted(roles.items()))
        )
        self.board = ScheduleBoard(initial, router.state, instances, self.observer.now, counters)
        self.short = ShortTermLoop(config, self.board, self.observer, instances)
        converter = RoleConverter(instances, drain_timeout_s=config.drain_timeout_s)
        self.long = LongTermLoop(
            config, profile, self.board, self.observer, instances, self.short, converter
        )
        self._instances = instances
        self._tasks: list[asyncio.Task[None]] = []
        self._wake_long = asyncio.Event()
        self._looked = False  # the early first look ran
        self.leading = True
        """Whether this gateway decides (a gateway alone always does)."""
        router.observer = self.observer

    def attach_link(self, reader: LinkReader) -> None:
        """Measure the link through `reader` from the next tick on."""
        self.short.read_link = reader

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._ticks()))
        if self.config.long_term:
            self._tasks.append(loop.create_task(self._periods()))

    async def lead(self, epoch: int, *, fence_timeout_s: float = 2.0) -> None:
        """Become the leader of `epoch`: announce it to every PD engine (a fence: an older
        leader's conversions are refused from now on; an engine that does not answer within
        `fence_timeout_s` is logged and fenced by this leader's first conversion of it),
        then decide from the state this gateway followed."""
        pd = [s for s in self._instances if s.cluster == "pd"]
        answers = await asyncio.gather(
            *(_fence(s.client, epoch, fence_timeout_s) for s in pd), return_exceptions=True
        )
        for s, answer in zip(pd, answers, strict=True):
            if isinstance(answer, BaseException):
                logger.warning(
                    "could not announce epoch %d to %s: %s", epoch, s.instance_id, answer
                )
        self.board.leader_epoch = epoch
        self.short.follow(self.board.state)
        self._looked = False
        self.leading = True
        # a version of this leader's own (same decisions), so every follower sees who leads
        self.board.change("leader", "lead", f"leading at epoch {epoch}", {"epoch": epoch})

    def follow(self, leader: str | None) -> None:
        """Stop deciding (the lease is lost, or another gateway leads). A conversion already
        sent to an engine is left to it: the engine switches only if no newer leader has
        announced itself (`prfaas.engines.role_fence`), and this gateway records what it did."""
        was = self.leading
        self.leading = False
        if was:
            self.board.note("leader", "follow", f"following {leader}", {"leader": leader})

    def _tick(self) -> None:
        """The short-term step (measurement only when its loop is off, or when another
        gateway leads), and the long-term loop's deferred move and its early wake on a step
        of the link, the output length or the incremental length."""
        if not self.leading:
            self.short.measure()
            return
        if self.config.short_term:
            self.short.tick()
        else:
            self.short.measure()
        if self.config.long_term:
            self.long.make_deferred()
        workload = self.config.long_term and self.long.workload_stepped()  # counts every tick
        if self.config.long_term and (self.long.capacity_stepped() or workload):
            self._wake_long.set()
        elif self.config.long_term and self._first_look():
            _guarded(functools.partial(self.long.period, first_look=True))

    def _first_look(self) -> bool:
        """Whether to take the first look now (`LongTermLoop.period(first_look=True)`): once,
        as soon as enough requests were seen to estimate the workload, before the first
        period ends (the deployment's profile is only a prior; a plan made for another
        workload should not run for a whole period)."""
        if self._looked or self.long.estimate is not None:
            return False
        self._looked = self.observer.num_samples >= self.config.estimate.min_samples
        return self._looked

    async def _ticks(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)
            _guarded(self._tick)

    async def _periods(self) -> None:
        loop = asyncio.get_running_loop()
        period_s = self.config.period_s
        end = loop.time() + period_s
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(end):
                    await self._wake_long.wait()
            stepped = self._wake_long.is_set()
            self._wake_long.clear()
            end = next_period_end(end, loop.time(), period_s, woken=stepped)
            if not self.leading:
                self.observer.take_samples()  # the leader estimates from its own copy
                continue
            _guarded(functools.partial(self.long.period, stepped=stepped))

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.long.stop()

    def pin(self, *, threshold: float | None, regime: Regime | None) -> None:
        """The operator sets `t` and/or the regime: both loops stop moving them (conversions
        go on) until `release`."""
        self.short.pinned = True
        inputs = {"threshold": threshold, "regime": regime}
        self.board.change(
            "operator",
            "pin",
            "set by POST /admin/state",
            inputs,
            threshold=threshold,
            set_point=threshold,
            regime=regime,
        )

    def release(self) -> None:
        """Hand `t` and the regime back to the loops, which start again from what the
        operator set (the trimmer's memory from before the pin is stale)."""
        self.short.pinned = False
        self.short.follow(self.board.state)
        self.board.note("operator", "release", "scheduler back in control", {})

    def to_json(self) -> dict[str, Any]:
        """The `scheduler` part of `/admin/state`."""
        long, estimate = self.long, self.long.estimate
        last, deferred = long.last, long.deferred
        return {
            **self.board.to_json(),
            "pinned": self.short.pinned,
            "loops": {
                "short_term": self.config.short_term,
                "long_term": self.config.long_term,
                "tick_s": self.config.tick_s,
                "period_s": self.config.period_s,
            },
            "short_term": {**self.short.last, "trim": _trim_json(self.short)},
            "long_term": {
                "estimate": None if estimate is None else estimate.to_json(),
                "last": None
                if last is None
                else {
                    "outcome": last.outcome,
                    "reason": last.reason,
                    **({} if last.figures is None else last.figures.to_json()),
                },
                "converting": long.state.converting,
                "cooldown_until": long.state.cooldown_until,
                "deferred": None
                if deferred is None
                else f"{deferred.from_role} -> {deferred.to_role}",
            },
        }

    def gauges(self) -> list[GaugeMetricFamily]:
        """Sampled at every scrape: set-point, regime, epoch, pool sizes, predicted backlog."""
        state = self.board.state
        pools = self.long.pools()
        draining = sum(s.draining for s in self._instances)
        role = GaugeMetricFamily(
            "prfaas_pd_instances", "PD-cluster instances by role.", labels=["role"]
        )
        role.add_metric(["prefill"], len(pools.prefill))
        role.add_metric(["decode"], len(pools.decode))
        role.add_metric(["draining"], draining)
        backlog = GaugeMetricFamily(
            "prfaas_predicted_backlog_seconds",
            "Predicted prefill queue per instance.",
            labels=["instance"],
        )
        backlogs = self.observer.backlogs(self.observer.now())
        for s in self._instances:
            if s.role != "decode":
                backlog.add_metric([s.instance_id], backlogs.get(s.instance_id, 0.0))
        return [
            GaugeMetricFamily(
                "prfaas_threshold_set_point_tokens", "Long-term set-point of t.", state.set_point
            ),
            GaugeMetricFamily(
                "prfaas_regime_abundant",
                "1 in the bandwidth-abundant regime.",
                1.0 if state.regime == "bandwidth_abundant" else 0.0,
            ),
            GaugeMetricFamily("prfaas_schedule_epoch", "Version of the schedule.", state.epoch),
            role,
            backlog,
        ]


async def _fence(client: BaseEngineClient, epoch: int, timeout_s: float) -> int:
    async with asyncio.timeout(timeout_s):
        return await client.fence(epoch)


def _guarded(step: Callable[[], object]) -> None:
    try:
        step()
    except Exception:  # a bad step must not stop its loop
        logger.exception("scheduler step %r failed", step)


def _trim_json(short: ShortTermLoop) -> dict[str, Any]:
    t = short.trim
    return {"threshold": t.threshold, "set_point": t.set_point, "congested_at": t.congested_at,
            "pd_congested_at": t.pd_congested_at}  # fmt: skip

"""Run one scenario one way, on the virtual clock, through the real Router.

Variants:
- `static`: the planner's optimum for the starting conditions, never changed;
- `dual`: the same start, then the real dual-timescale `Scheduler` (gateway/scheduling/),
  measuring the simulated link and requests;
- `oracle`: re-planned with the true conditions the moment a phase starts, its conversions
  free (instances switch at once, their old work finishing beside the new);
- `oracle-drain`: the same decisions, but every conversion drains first.

Every variant sees the same requests at the same instants (same seed). SIMULATED numbers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, replace
from typing import Literal

from prfaas.engine_clients.base import Role
from prfaas.gateway.scheduling.config import SchedulerConfig
from prfaas.gateway.scheduling.decisions import ScheduleBoard
from prfaas.gateway.scheduling.roles import ConversionResult, RoleConverter
from prfaas.gateway.scheduling.scheduler import Scheduler
from prfaas.loadgen.arrivals import TraceArrivals
from prfaas.loadgen.driver import Driver
from prfaas.loadgen.records import RequestRecord
from prfaas.loadgen.spec import BenchSpec, NoProgress
from prfaas.loadgen.workload import Workload
from prfaas.loadgen.workloads.mooncake import MooncakeWorkload
from prfaas.policies.planner import plan
from prfaas.policies.profile import DeploymentProfile
from prfaas.policies.routing import Regime
from prfaas.policies.schedule_state import InstanceRole, ScheduleState
from prfaas.policies.ttft_forecast import LinkState
from prfaas.sim.cluster import SimCluster
from prfaas.sim.deployments import Deployment, SimOptions, deployments
from prfaas.sim.scenario_workload import ScenarioWorkload
from prfaas.sim.scenarios import Phase, Scenario, conditioned
from prfaas.sim.sender import SimSender
from prfaas.sim.virtual_loop import run_virtual

Variant = Literal["static", "dual", "oracle", "oracle-drain"]
VARIANTS: tuple[Variant, ...] = ("static", "dual", "oracle", "oracle-drain")
SAMPLE_S = 5.0
ABUNDANT_HEADROOM = 3.0  # the oracle's regime: abundant when the link is 3x the planned egress
BITS = 8


@dataclass(frozen=True)
class Sample:
    """The deployment at one instant (the timeline plotted and measured)."""

    at: float
    threshold: float
    regime: Regime
    n_prefill: int
    n_decode: int
    n_draining: int
    egress_gbps: float
    """Mean egress over the last sample interval."""
    link_gbps: float


@dataclass(frozen=True)
class ControlEvent:
    """A change the controller made: threshold, set_point, regime or role."""

    at: float
    kind: str
    value: float | str


@dataclass(frozen=True)
class VariantRun:
    variant: Variant
    records: tuple[RequestRecord, ...]
    timeline: tuple[Sample, ...]
    events: tuple[ControlEvent, ...]
    conversions: tuple[ConversionResult, ...]
    wall_s: float
    """Wall-clock seconds the run took (the only real measurement)."""


def static_deployment(profile: DeploymentProfile, options: SimOptions) -> Deployment:
    """The planner's optimum for the profile's own (starting) conditions, exact costing."""
    return deployments(profile, plan(profile, exact=True), options)["prfaas_pd"]


def run_variant(
    profile: DeploymentProfile,
    scenario: Scenario,
    variant: Variant,
    *,
    scheduler: SchedulerConfig,
    options: SimOptions | None = None,
    seed: int = 0,
) -> VariantRun:
    """Run `scenario` one way on a fresh virtual-clock loop."""
    wall = time.perf_counter()
    run = run_virtual(_run(profile, scenario, variant, scheduler, options or SimOptions(), seed))
    return replace(run, wall_s=time.perf_counter() - wall)


def scenario_workload(scenario: Scenario, profile: DeploymentProfile) -> Workload:
    if scenario.trace is not None:
        return MooncakeWorkload.from_file(scenario.trace)
    lengths = profile.workload.lengths
    return ScenarioWorkload(scenario, round(lengths.lo), round(lengths.hi))


async def _run(
    profile: DeploymentProfile,
    scenario: Scenario,
    variant: Variant,
    scheduler_config: SchedulerConfig,
    options: SimOptions,
    seed: int,
) -> VariantRun:
    deployment = static_deployment(profile, options)
    cluster = SimCluster(profile, deployment, options, seed, drain=variant != "oracle")
    recorder = _Recorder(cluster)
    conversions: list[ConversionResult] = []
    tasks = [asyncio.create_task(_link_changes(cluster, scenario)), recorder.start()]
    scheduler = None
    if variant == "dual":
        scheduler = Scheduler(scheduler_config, profile, cluster.router, cluster.instances)
        scheduler.attach_link(SimLinkMeter(cluster).read)
        recorder.start_from(scheduler.board.state)
        scheduler.board.listeners.append(recorder.state_changed)
        scheduler.start()
    elif variant in ("oracle", "oracle-drain"):
        oracle = _Oracle(profile, scenario, cluster, conversions, scheduler_config)
        recorder.start_from(oracle.board.state)
        oracle.board.listeners.append(recorder.state_changed)
        tasks.append(asyncio.create_task(oracle.run()))
    bench = BenchSpec(
        scenario_workload(scenario, profile),
        TraceArrivals(scenario.speedup),
        None,
        scenario.duration_s,
        seed,
    )
    driver = Driver(bench, SimSender(cluster.router, origin=0.0), NoProgress())
    try:
        records = await driver.run()
    finally:
        if scheduler is not None:
            await scheduler.stop()
            conversions.extend(scheduler.long.conversions)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return VariantRun(
        variant,
        tuple(records),
        tuple(recorder.timeline),
        tuple(recorder.events),
        tuple(conversions),
        0.0,
    )


async def _link_changes(cluster: SimCluster, scenario: Scenario) -> None:
    """Set the cross-cluster link of each phase at its start."""
    loop = asyncio.get_running_loop()
    for phase in scenario.phases:
        await asyncio.sleep(max(phase.start_s - loop.time(), 0.0))
        set_link(cluster, phase.conditions.link_gbps)


def set_link(cluster: SimCluster, gbps: float) -> None:
    """Both directions of the cross-cluster link at `gbps` (split evenly when partitioned)."""
    share = gbps / len(cluster.egress)
    for link in cluster.egress:
        if link.config.gbps != share:
            link.set_gbps(share)
    if cluster.ingress.config.gbps != gbps:
        cluster.ingress.set_gbps(gbps)


class SimLinkMeter:
    """The simulated link as the gateway's telemetry would report it: capacity, mean egress
    since the previous reading, transfers in flight."""

    def __init__(self, cluster: SimCluster) -> None:
        self._cluster = cluster
        self._loop = asyncio.get_running_loop()
        self._last = (self._loop.time(), self._moved())
        self._rate = 0.0

    def _moved(self) -> float:
        return sum(link.bytes_moved for link in self._cluster.egress)

    def read(self) -> LinkState:
        now, moved = self._loop.time(), self._moved()
        then, before = self._last
        if now > then:
            self._rate = (moved - before) / (now - then)
            self._last = (now, moved)
        links = self._cluster.egress
        return LinkState(
            capacity_bytes_per_s=sum(link.config.bytes_per_s for link in links),
            egress_bytes_per_s=self._rate,
            active_transfers=sum(link.active for link in links),
        )


class _Recorder:
    """Samples the deployment every `SAMPLE_S` and keeps every control change."""

    def __init__(self, cluster: SimCluster) -> None:
        self._cluster = cluster
        self._meter = SimLinkMeter(cluster)
        self.timeline: list[Sample] = []
        self.events: list[ControlEvent] = []
        self._state: ScheduleState | None = None

    def start(self) -> asyncio.Task[None]:
        return asyncio.create_task(self._sample_forever())

    async def _sample_forever(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(SAMPLE_S)

    def sample(self) -> None:
        c = self._cluster
        link = self._meter.read()
        pd = [s for s in c.instances if s.cluster == "pd"]
        self.timeline.append(
            Sample(
                at=asyncio.get_running_loop().time(),
                threshold=c.router.state.threshold,
                regime=c.router.state.regime,
                n_prefill=sum(s.role == "prefill" and not s.draining for s in pd),
                n_decode=sum(s.role == "decode" and not s.draining for s in pd),
                n_draining=sum(s.draining for s in pd),
                egress_gbps=link.egress_bytes_per_s * BITS / 1e9,
                link_gbps=link.capacity_bytes_per_s * BITS / 1e9,
            )
        )

    def event(self, kind: str, value: float | str) -> None:
        self.events.append(ControlEvent(asyncio.get_running_loop().time(), kind, value))

    def start_from(self, state: ScheduleState) -> None:
        """The schedule before any decision (its fields are not changes)."""
        self._state = state

    def state_changed(self, new: ScheduleState) -> None:
        """A dual-timescale decision (the board's listener)."""
        old, self._state = self._state, new
        if old is None or new.threshold != old.threshold:
            self.event("threshold", new.threshold)
        if old is None or new.set_point != old.set_point:
            self.event("set_point", new.set_point)
        if old is None or new.regime != old.regime:
            self.event("regime", new.regime)
        if old is None or new.roles != old.roles:
            self.event("role", ",".join(f"{i}={r}" for i, r in new.roles))


class _Oracle:
    """Re-plans with each phase's true conditions at its start: `t`, regime, and the split
    (all conversions at once, through the same drain-then-switch path as the schedulers).
    Its decisions apply through a `ScheduleBoard`, as the schedulers' do; it moves `t`, not
    the set-point (it has no trimmer to trim around one)."""

    def __init__(
        self,
        profile: DeploymentProfile,
        scenario: Scenario,
        cluster: SimCluster,
        conversions: list[ConversionResult],
        config: SchedulerConfig,
    ) -> None:
        self._profile, self._scenario, self._cluster = profile, scenario, cluster
        self._conversions = conversions
        self._converter = RoleConverter(cluster.instances, drain_timeout_s=config.drain_timeout_s)
        routing = cluster.router.state
        initial = ScheduleState(
            threshold=routing.threshold,
            set_point=routing.threshold,
            regime=routing.regime,
            roles=_pd_roles(cluster),
        )
        loop = asyncio.get_running_loop()
        self.board = ScheduleBoard(initial, routing, cluster.instances, loop.time)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for phase in self._scenario.phases:
            await asyncio.sleep(max(phase.start_s - loop.time(), 0.0))
            await self._replan(phase)

    async def _replan(self, phase: Phase) -> None:
        best = plan(conditioned(self._profile, phase.conditions), exact=True).prfaas_pd
        state = self.board.state
        threshold = best.threshold_tokens
        assert threshold is not None
        link = phase.conditions.link_gbps
        abundant = best.egress_gbps is not None and link >= ABUNDANT_HEADROOM * best.egress_gbps
        regime: Regime = "bandwidth_abundant" if abundant else "bandwidth_scarce"
        if state.threshold != threshold or state.regime != regime:
            inputs = {"phase": phase.name, "t_best": threshold, "n_p": best.n_p}
            self.board.change(
                "oracle",
                "threshold",
                f"phase {phase.name}",
                inputs,
                threshold=threshold,
                regime=regime,
            )
        await self._resplit(best.n_p, phase.name)

    async def _resplit(self, n_p: int, phase: str) -> None:
        pd = [s for s in self._cluster.instances if s.cluster == "pd"]

        def least_busy(role: Role) -> list[str]:
            pool = sorted(
                (s for s in pd if s.role == role), key=lambda s: (s.in_flight, s.instance_id)
            )
            return [s.instance_id for s in pool]

        prefill, decode = least_busy("prefill"), least_busy("decode")
        moves: list[tuple[str, Role]] = [
            (i, "prefill") for i in decode[: max(n_p - len(prefill), 0)]
        ]
        moves += [(i, "decode") for i in prefill[: max(len(prefill) - n_p, 0)]]
        results = await asyncio.gather(*(self._converter.convert(i, r) for i, r in moves))
        self._conversions.extend(results)
        if results:
            moved = ", ".join(f"{r.instance_id} -> {r.to_role}" for r in results)
            facts = {"phase": phase, "n_p": n_p}
            self.board.change("oracle", "role", moved, facts, roles=dict(_pd_roles(self._cluster)))


def _pd_roles(cluster: SimCluster) -> tuple[tuple[str, InstanceRole], ...]:
    """Every PD-cluster instance's role as the registry holds it, sorted."""
    return tuple(sorted((s.instance_id, s.role) for s in cluster.instances if s.cluster == "pd"))

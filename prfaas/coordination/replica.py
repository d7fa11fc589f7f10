"""`Coordinator`: one gateway replica's part in a deployment of several, over etcd.

Every replica routes on its own (its KV index from the engines' events, its health checks,
its admission queue). What they share, under the deployment's key prefix:

- `leader`: the election key (`election.Election`). The leader runs both schedulers; its
  epoch (the key's create revision) stamps its `ScheduleState`s and fences its conversions.
- `schedule`: the leader's latest `ScheduleState` with the wall-clock time it was published.
  The leader writes it only while it still holds the election key (one transaction), every
  replica watches it and applies it through `ScheduleBoard.apply` (never a stale version).
- `replicas/<id>`: each replica's `ReplicaReport` every `publish_s`, bound to its own lease
  (a dead replica's report expires). Every replica adds the others' reports to its observer:
  the leader estimates the whole traffic, and every replica predicts prefill queues from it.

When etcd cannot be reached, a replica keeps routing with the last state it applied, says so
(`/admin/state`, `prfaas_coordination_store_up`), and nobody converts: a leader that cannot
renew its lease steps down by its deadline. When etcd is back, an election runs again and the
new leader decides from its next period on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from prfaas.coordination.config import CoordinationConfig
from prfaas.coordination.election import Election, Leadership
from prfaas.coordination.etcd import EtcdClient, EtcdError
from prfaas.gateway.scheduling.scheduler import Scheduler
from prfaas.policies.schedule_state import ScheduleState
from prfaas.protocol.replica_report import ReplicaReport

logger = logging.getLogger(__name__)


class Published(msgspec.Struct, frozen=True, kw_only=True):
    """The `schedule` key's value: a leader's state and when it was published."""

    leader: str
    at: float
    """The leader's wall clock (Unix seconds) when it published."""
    state: ScheduleState


class CoordinationMetrics:
    """Elections, lease losses, the store's reachability and the followers' apply lag."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.elections = Counter(
            "prfaas_leader_elections", "Times this replica became the leader.", registry=registry
        )
        self.losses = Counter(
            "prfaas_leader_losses",
            "Times this replica stopped leading (lease lost, store down, fenced, or stopped).",
            registry=registry,
        )
        self.leading = Gauge(
            "prfaas_coordination_leader", "1 while this replica leads.", registry=registry
        )
        self.store_up = Gauge(
            "prfaas_coordination_store_up",
            "1 while etcd answers this replica (0: routing on the last applied state).",
            registry=registry,
        )
        self.apply_lag = Histogram(
            "prfaas_schedule_apply_lag_seconds",
            "From the leader's publish to this follower's apply of a ScheduleState.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=registry,
        )
        self.reports_missed = Counter(
            "prfaas_replica_reports_missed",
            "Other replicas' reports this replica never saw (gaps in their sequence).",
            registry=registry,
        )


class Coordinator:
    """Owns this replica's election and the tasks that publish and watch the shared keys.
    Build inside the running loop; `start` after the scheduler, `stop` before it."""

    def __init__(
        self,
        config: CoordinationConfig,
        replica_id: str,
        scheduler: Scheduler,
        metrics: CoordinationMetrics,
        *,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.replica_id = replica_id
        self._scheduler = scheduler
        self._metrics = metrics
        self._wall = wall_clock
        self._client = EtcdClient(config.endpoints)
        prefix = config.prefix
        self._leader_key = f"{prefix}/leader"
        self._schedule_key = f"{prefix}/schedule"
        self._reports_prefix = f"{prefix}/replicas/"
        self._election = Election(
            self._client,
            key=self._leader_key,
            replica_id=replica_id,
            ttl_s=config.lease_ttl_s,
            on_change=self._leadership_changed,
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._rejoin: asyncio.Task[None] | None = None  # a resignation and a new campaign
        self._stopped = False
        self._changed = asyncio.Event()  # leadership changed: the transition task acts
        self._outgoing: ScheduleState | None = None  # the leader's latest state to publish
        self._publish = asyncio.Event()
        self._seq = 0
        self._seen: dict[str, int] = {}  # other replicas' last report seq
        self.store_up = True
        self.last_applied: dict[str, Any] | None = None
        """The last leader state applied here: its versions, leader and publish-to-apply lag."""
        scheduler.board.listeners.append(self._state_changed)
        scheduler.long.on_fenced = self._fenced
        scheduler.leading = False  # until this replica wins an election
        metrics.store_up.set(1)

    @property
    def leadership(self) -> Leadership:
        return self._election.leadership

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._election.start()
        for job in (self._transitions, self._publish_states, self._watch_states,
                    self._publish_reports, self._watch_reports):  # fmt: skip
            self._tasks.append(loop.create_task(_forever(job, self._store_down)))

    async def stop(self) -> None:
        """Stop publishing and watching; a leader resigns (another leads at once). Final:
        nothing after it (a conversion still running that comes back fenced) campaigns
        again."""
        self._stopped = True
        self._scheduler.long.on_fenced = None
        tasks, self._tasks = self._tasks, []
        if self._rejoin is not None:
            tasks.append(self._rejoin)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._scheduler.leading:
            self._scheduler.follow(None)
            self._metrics.losses.inc()
            self._metrics.leading.set(0)
        await self._election.stop()
        with contextlib.suppress(EtcdError):
            await self._client.delete(self._reports_prefix + self.replica_id)
        await self._client.close()

    # -- leadership --------------------------------------------------------------------

    def _leadership_changed(self, leadership: Leadership) -> None:
        self._set_store(leadership.store_up)
        self._changed.set()

    async def _transitions(self) -> None:
        """Lead or follow as the election says, one transition at a time."""
        while True:  # acts on the election as it is first (also after a restart), then waits
            self._changed.clear()
            now = self._election.leadership
            scheduler = self._scheduler
            if now.role == "leader" and not scheduler.leading:
                await scheduler.lead(now.epoch)
                self._metrics.elections.inc()
                self._metrics.leading.set(1)
            elif now.role != "leader" and scheduler.leading:
                scheduler.follow(now.leader)
                self._metrics.losses.inc()
                self._metrics.leading.set(0)
            await self._changed.wait()

    def _fenced(self) -> None:
        """An engine refused this leader's conversion: a newer leader exists. Stop at once."""
        logger.warning("replica %s: a conversion was fenced; stepping down", self.replica_id)
        self._step_down()

    def _step_down(self) -> None:
        if self._scheduler.leading:
            self._scheduler.follow(None)
            self._metrics.losses.inc()
            self._metrics.leading.set(0)
        self._resign()

    def _resign(self) -> None:
        """Give up this replica's lease (if it still holds one) and campaign again as a
        follower: a leader told by an engine or by etcd that it no longer leads."""
        if self._stopped or (self._rejoin is not None and not self._rejoin.done()):
            return

        async def rejoin() -> None:
            await self._election.stop()
            self._election.start()

        self._rejoin = asyncio.get_running_loop().create_task(rejoin())

    # -- the schedule ------------------------------------------------------------------

    def _state_changed(self, state: ScheduleState) -> None:
        if self._scheduler.leading:
            self._outgoing = state
            self._publish.set()

    async def _publish_states(self) -> None:
        """Publish the leader's latest state, only while it holds the election key."""
        while True:
            await self._publish.wait()
            self._publish.clear()
            state = self._outgoing
            if state is None or not self._scheduler.leading:
                continue
            value = Published(leader=self.replica_id, at=self._wall(), state=state)
            try:
                held = await self._client.put_if_value(
                    self._leader_key,
                    self.replica_id.encode(),
                    self._schedule_key,
                    msgspec.json.encode(value),
                )
            except EtcdError:
                self._publish.set()  # publish the latest once the store answers again
                raise
            self._set_store(True)
            if not held:  # another replica holds the key: stop deciding now
                self._step_down()

    async def _watch_states(self) -> None:
        """Apply every newer leader state (the current one first)."""
        current, revision = await self._client.get_with_revision(self._schedule_key)
        self._set_store(True)
        if current is not None:  # a catch-up: the state's age is no publish-to-apply lag
            self._apply(current.value, lag=False)
        async for event in self._client.watch(self._schedule_key, start_revision=revision + 1):
            self._set_store(True)
            if event.kind == "put":
                self._apply(event.kv.value)

    def _apply(self, raw: bytes, *, lag: bool = True) -> None:
        try:
            published = msgspec.json.decode(raw, type=Published)
        except msgspec.MsgspecError:
            logger.warning("ignoring an unreadable %s value", self._schedule_key)
            return
        if published.leader == self.replica_id or self._scheduler.leading:
            return
        if self._scheduler.board.apply(published.state):
            took = max(self._wall() - published.at, 0.0)
            if lag:
                self._metrics.apply_lag.observe(took)
            state = published.state
            self.last_applied = {
                "leader": published.leader,
                "leader_epoch": state.leader_epoch,
                "epoch": state.epoch,
                "lag_s": took if lag else None,
            }

    # -- the replicas' reports -----------------------------------------------------------

    async def _publish_reports(self) -> None:
        """Every `publish_s`: this replica's report, under a lease of its own."""
        lease = 0
        ttl = math.ceil(self.config.lease_ttl_s)
        observer = self._scheduler.observer
        while True:
            if lease == 0 or await self._client.keepalive(lease) <= 0:
                lease = await self._client.grant(ttl)
            self._seq += 1
            report = observer.report(self.replica_id, self._seq, self._wall())
            await self._client.put(
                self._reports_prefix + self.replica_id, report.encode(), lease=lease
            )
            self._set_store(True)
            await asyncio.sleep(self.config.publish_s)

    async def _watch_reports(self) -> None:
        """Add every other replica's report to this replica's observer."""
        observer = self._scheduler.observer
        _, revision = await self._client.get_prefix(self._reports_prefix)
        async for event in self._client.watch(
            self._reports_prefix, prefix=True, start_revision=revision + 1
        ):
            replica = event.kv.key.removeprefix(self._reports_prefix)
            if replica == self.replica_id:
                continue
            if event.kind == "delete":
                observer.forget(replica)
                self._seen.pop(replica, None)
                continue
            try:
                report = ReplicaReport.decode(event.kv.value)
            except msgspec.MsgspecError:
                logger.warning("ignoring an unreadable report from %s", replica)
                continue
            last = self._seen.get(replica)
            if last is not None and report.seq > last + 1:
                self._metrics.reports_missed.inc(report.seq - last - 1)
            self._seen[replica] = report.seq
            observer.merge(report, self._wall() - report.at)

    # -- the store ---------------------------------------------------------------------

    def _store_down(self, exc: EtcdError) -> None:
        if self.store_up:
            logger.warning("replica %s: etcd unreachable (%s); routing on the last state",
                           self.replica_id, exc)  # fmt: skip
        self._set_store(False)

    def _set_store(self, up: bool) -> None:
        self.store_up = up
        self._metrics.store_up.set(1 if up else 0)

    def to_json(self) -> dict[str, Any]:
        """The `coordination` part of `/admin/state`."""
        leadership = self._election.leadership
        return {
            "replica": self.replica_id,
            "role": "leader" if self._scheduler.leading else "follower",
            "epoch": leadership.epoch,
            "leader": leadership.leader,
            "store_up": self.store_up,
            "etcd": list(self.config.endpoints),
            "prefix": self.config.prefix,
            "last_applied": self.last_applied,
            "replicas_heard": list(self._scheduler.observer.replicas_heard),
        }


async def _forever(
    job: Callable[[], Awaitable[None]], on_store_error: Callable[[EtcdError], None]
) -> None:
    """Run `job` again after a store failure (a pause first), or after any other error
    (logged): a background task of the coordinator never ends by itself."""
    while True:
        try:
            await job()
        except EtcdError as exc:
            on_store_error(exc)
        except Exception:
            logger.exception("coordination task %s failed", getattr(job, "__name__", job))
        await asyncio.sleep(RETRY_S)


RETRY_S = 0.5
"""Pause before a coordination task starts again after a failure."""

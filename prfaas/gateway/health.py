"""Health and load polling with outlier detection, as a load balancer does it (Envoy's
outlier detection, SGLang's router): every interval each instance's `/health` is probed,
then the added pollers run (e.g. the link's egress telemetry, `link.EgressMonitor`).

- A failed probe makes a healthy instance `suspect`: a short stall (one slow answer, a
  busy CPU) is not a death, so it is still routed to and keeps its KV-index entries.
- `eject_after` failed probes in a row, or one refused connection (nothing listens: the
  process is gone), eject it: no new requests, and its running calls are aborted so the
  Router retries or migrates them.
- `readmit_after` good probes in a row readmit an ejected instance.
- Its KV-index entries are dropped only when the engine's own start identity changes (it
  restarted with an empty cache), never because a poll was missed.
- Role and draining come from the engine's own report, so a role switch made on the engine
  (by the scheduler's `RoleConverter` or by hand) is seen at the next probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from prfaas.engine_clients.base import BaseEngineClient, EngineError, EngineReport, Role
from prfaas.engine_clients.sglang import SGLangClient
from prfaas.engine_clients.vllm import VLLMClient
from prfaas.gateway.instances import InstanceManager, InstanceState

logger = logging.getLogger(__name__)


class Poller(Protocol):
    """Something polled on the health cadence and closed when polling stops."""

    async def poll(self) -> None: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class HealthPolicy:
    """When an instance is ejected and readmitted."""

    interval_s: float = 1.0
    """Time between probe rounds."""
    eject_after: int = 3
    """Failed probes in a row that eject an instance (a refused connection ejects at once)."""
    readmit_after: int = 2
    """Good probes in a row that readmit an ejected instance."""

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
        for name in ("eject_after", "readmit_after"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class HealthMonitor:
    """Owns the polling task. `on_restart(instance_id)` runs when an instance reports a new
    start identity (its cache is gone)."""

    def __init__(
        self,
        instances: InstanceManager,
        policy: HealthPolicy,
        on_restart: Callable[[str], None] | None = None,
    ) -> None:
        self._instances = instances
        self.policy = policy
        self._on_restart = on_restart
        self._task: asyncio.Task[None] | None = None
        self._pollers: list[Poller] = []
        self.polls = 0

    def add_poller(self, poller: Poller) -> None:
        """Poll `poller` after every round of health checks; `stop()` closes it."""
        self._pollers.append(poller)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.policy.interval_s)

    async def poll_once(self) -> None:
        """Check every instance once (mutates health, role and queue depth), the added
        pollers alongside: a slow poller (telemetry of a stalled engine) must not stretch
        the probe cadence that outlier detection counts on."""
        probes = [self.refresh(s) for s in self._instances]
        await asyncio.gather(*probes, *(self._poll(p) for p in self._pollers))
        self.polls += 1

    async def _poll(self, poller: Poller) -> None:
        try:
            await poller.poll()
        except Exception:  # a telemetry failure must never stop health checks
            logger.exception("poller %r failed", poller)

    async def refresh(self, state: InstanceState) -> None:
        """Probe one instance now and apply its report."""
        client = state.client
        if isinstance(client, SGLangClient):
            report = await client.probe()
        elif isinstance(client, VLLMClient):  # vLLM's /health says alive or not, no more
            report = EngineReport(alive=await client.health(), prefix_pull=client.prefix_pull)
        else:
            return
        if report.alive:
            await self._answered(state, client, report)
        else:
            self._failed(state, report)

    async def _answered(
        self, state: InstanceState, client: BaseEngineClient, report: EngineReport
    ) -> None:
        if report.start_id is not None:
            if state.start_id is not None and report.start_id != state.start_id:
                logger.warning("instance %s restarted; dropping its KV-index entries",
                               state.instance_id)  # fmt: skip
                if self._on_restart is not None:
                    self._on_restart(state.instance_id)
            state.start_id = report.start_id
        if report.role is not None and report.role != state.role:
            await self._role_changed(state, client, report.role)
        state.draining = report.draining
        state.prefix_pull = report.prefix_pull
        state.failures = 0
        if state.status == "ejected":
            state.successes += 1
            if state.successes < self.policy.readmit_after:
                return
            state.readmissions += 1
            logger.warning("instance %s readmitted", state.instance_id)
        elif state.status == "suspect":
            logger.info("instance %s answers again", state.instance_id)
        state.status = "healthy"
        with contextlib.suppress(EngineError):
            state.queued = (await client.stats()).waiting

    async def _role_changed(
        self, state: InstanceState, client: BaseEngineClient, role: Role
    ) -> None:
        logger.warning("instance %s reports role %s (was %s)", state.instance_id, role, state.role)
        if role != "decode" and state.bootstrap_port is None:
            try:  # a former decode: learn where it serves KV before routing prefills to it
                info = await client.info()
            except EngineError:
                return  # keep the old role until it tells us its bootstrap address
            state.bootstrap_host = info.bootstrap_host or state.bootstrap_host
            state.bootstrap_port = info.bootstrap_port
            if state.bootstrap_port is None:
                return
        state.role = role

    def _failed(self, state: InstanceState, report: EngineReport) -> None:
        state.successes = 0
        state.failures += 1
        if state.status == "ejected":
            return
        first = self.polls == 0  # down at start: not a stall
        if report.refused or first or state.failures >= self.policy.eject_after:
            why = "connection refused" if report.refused else f"{state.failures} failed probes"
            state.eject(why)
        elif state.status == "healthy":
            logger.warning("instance %s is suspect (a probe failed)", state.instance_id)
            state.status = "suspect"

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for poller in self._pollers:
            await poller.close()

"""Health and load polling: every interval, ask each instance for `/health` and its load,
then run the added pollers (e.g. the link's egress telemetry, `link.EgressMonitor`).

An instance that stops answering is marked unhealthy (the policies skip it) and its KV-index
entries are dropped, since a restarted engine comes back with an empty cache; it is marked
healthy again as soon as it answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Protocol

from prfaas.engines.client import EngineError
from prfaas.engines.sglang_client import SGLangClient
from prfaas.engines.vllm_client import VLLMClient
from prfaas.gateway.instances import InstanceManager, InstanceState

logger = logging.getLogger(__name__)


class Poller(Protocol):
    """Something polled on the health cadence and closed when polling stops."""

    async def poll(self) -> None: ...

    async def close(self) -> None: ...


class HealthMonitor:
    """Owns the polling task. `on_down(instance_id)` runs when an instance goes unhealthy."""

    def __init__(
        self,
        instances: InstanceManager,
        interval_s: float,
        on_down: Callable[[str], None] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._instances = instances
        self._interval_s = interval_s
        self._on_down = on_down
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
            await asyncio.sleep(self._interval_s)

    async def poll_once(self) -> None:
        """Check every instance once (mutates health and queue depth)."""
        await asyncio.gather(*(self._poll(s) for s in self._instances))
        for poller in self._pollers:
            try:
                await poller.poll()
            except Exception:  # a telemetry failure must never stop health checks
                logger.exception("poller %r failed", poller)
        self.polls += 1

    async def _poll(self, state: InstanceState) -> None:
        client = state.client
        if not isinstance(client, SGLangClient | VLLMClient):
            return
        alive = await client.health()
        if state.healthy and not alive:
            logger.warning("instance %s is down", state.instance_id)
            if self._on_down is not None:
                self._on_down(state.instance_id)
        elif alive and not state.healthy:
            logger.info("instance %s is back", state.instance_id)
        state.healthy = alive
        if alive:
            with contextlib.suppress(EngineError):
                state.queued = (await client.stats()).waiting

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for poller in self._pollers:
            await poller.close()

"""Supervision of the engines `prfaas serve` launched: one that dies is started again.

Each engine has a watcher task. When its process exits without being asked to, the
watcher logs it, waits a backoff (doubling from `backoff_s` up to `max_backoff_s`, reset
once an engine stayed up `stable_s`), and starts it with the same spec on the same ports
(so the gateway's addresses and its KV-event subscription stay valid); if those ports are
taken, on fresh ones, and the gateway is pointed at them (`Gateway.relocate`). A restart
budget (`budget` restarts per `window_s`) stops a crash loop: past it the engine stays down
(the gateway keeps it ejected) and an error is logged. The gateway learns of the restart
from the engine's new start id and drops its KV-index entries. `/metrics` counts restarts
(`prfaas_engine_restarts_total`) and shows whether each engine runs (`prfaas_engine_up`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from prfaas.gateway.api.assembly import Gateway
from prfaas.serve.processes import EngineProcess, free_port, start_engine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    """How dead engines are started again."""

    backoff_s: float = 0.5
    """Wait before the first restart."""
    max_backoff_s: float = 10.0
    """Longest wait between restarts of a crash-looping engine."""
    stable_s: float = 60.0
    """An engine up this long is healthy again: its next restart waits `backoff_s`."""
    budget: int = 10
    """Restarts allowed per engine within `window_s`; past it the engine stays down."""
    window_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("backoff_s", "max_backoff_s", "stable_s", "window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.budget < 0:
            raise ValueError(f"budget must be >= 0, got {self.budget}")


class Supervisor:
    """Owns the launched engines from start-up to shutdown; `engines` always holds the
    current process of each."""

    def __init__(
        self,
        engines: Mapping[str, EngineProcess],
        log_dir: Path,
        env: Mapping[str, str] | None = None,
        policy: RestartPolicy | None = None,
    ) -> None:
        self.engines = dict(engines)
        self._log_dir = log_dir
        self._env = dict(env or {})
        self.policy = policy or RestartPolicy()
        self.restarts = dict.fromkeys(self.engines, 0)
        self._recent: dict[str, deque[float]] = {n: deque() for n in self.engines}
        self._gateway: Gateway | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False

    def start(self) -> None:
        """Watch every engine (call once, on the running loop)."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._watch(name)) for name in self.engines]

    async def attach(self, gateway: Gateway) -> None:
        """A `serve_gateway(setup=...)` hook: relocate instances on the gateway and export
        the restart metrics."""
        self._gateway = gateway
        gateway.metrics.add_gauges(self.metrics)

    def metrics(self) -> list[Metric]:
        restarts = CounterMetricFamily(
            "prfaas_engine_restarts", "Launched engines started again after they died.",
            labels=["instance"],
        )  # fmt: skip
        up = GaugeMetricFamily(
            "prfaas_engine_up", "1 while a launched engine's process runs.", labels=["instance"]
        )
        for name, engine in self.engines.items():
            restarts.add_metric([name], self.restarts[name])
            up.add_metric([name], 1.0 if engine.process.returncode is None else 0.0)
        return [restarts, up]

    async def _watch(self, name: str) -> None:
        loop = asyncio.get_running_loop()
        backoff = self.policy.backoff_s
        while True:
            engine = self.engines[name]
            started = loop.time()
            code = await engine.process.wait()
            if self._stopping:
                return
            if loop.time() - started >= self.policy.stable_s:
                backoff = self.policy.backoff_s
            if not self._allowed(name, loop.time()):
                logger.error("engine %s exited (code %s) and used its restart budget (%d in "
                             "%g s); it stays down", name, code, self.policy.budget,
                             self.policy.window_s)  # fmt: skip
                return
            logger.warning("engine %s exited with code %s; restarting in %.1f s (log %s)",
                           name, code, backoff, engine.log)  # fmt: skip
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.policy.max_backoff_s)
            restarted = await self._restart(name, engine)
            if restarted is not None:
                self.engines[name] = restarted
                self.restarts[name] += 1
                logger.warning("engine %s is back: %s", name, restarted.url)

    def _allowed(self, name: str, now: float) -> bool:
        recent = self._recent[name]
        while recent and recent[0] <= now - self.policy.window_s:
            recent.popleft()
        if len(recent) >= self.policy.budget:
            return False
        recent.append(now)
        return True

    async def _restart(self, name: str, old: EngineProcess) -> EngineProcess | None:
        """The engine again on its old ports, else on fresh ones (the gateway follows)."""
        await old.stop()  # reap the dead process and its output reader
        log_name = f"{name}.{self.restarts[name] + 1}"
        same = replace(old.spec, port=old.port, bootstrap_port=old.bootstrap_port)
        try:
            return await start_engine(same, self._log_dir, env=self._env, log_name=log_name)
        except RuntimeError as exc:
            logger.warning("engine %s could not start on its old ports: %s", name, exc)
        replay = None if old.spec.kv_replay_port is None else free_port()
        fresh = replace(
            old.spec, port=0, bootstrap_port=0, kv_events_port=free_port(), kv_replay_port=replay
        )
        try:
            new = await start_engine(fresh, self._log_dir, env=self._env, log_name=log_name)
        except RuntimeError as exc:
            logger.error("engine %s did not restart: %s", name, exc)
            return None
        if self._gateway is not None:
            await self._gateway.relocate(
                name, new.url, new.bootstrap_port, new.kv_events, new.kv_events_replay
            )
        return new

    async def stop(self) -> None:
        """Stop watching, then stop every engine (SIGTERM, then SIGKILL)."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(*(e.stop() for e in self.engines.values()))

"""Supervision of the engines `prfaas serve` launched (reference engines and vLLM servers):
one that dies, or stops answering, is started again.

Each engine has a watcher task. When its process exits without being asked to, the watcher
kills what is left of its process group (a vLLM server's EngineCore), has the gateway eject
it at once (its calls aborted, so the Router retries or migrates them, and nothing routed to
it while it restarts: a restarting server may accept connections long before it answers
them), logs it, waits a backoff (doubling from `backoff_s` up to `max_backoff_s`, reset once
an engine stayed up `stable_s`), and starts it with the same spec on the same ports; if
those ports are taken, on fresh ones. It starts in the role the gateway holds for it, so a
conversion (by the long-term scheduler or an operator) outlives a restart. A restart
budget (`budget` restarts per `window_s`) stops a crash loop: past it the engine stays down
(the gateway keeps it ejected) and an error is logged. `/metrics` counts restarts
(`prfaas_engine_restarts_total`) and shows whether each engine runs (`prfaas_engine_up`).

After every restart the gateway is told where the engine is now (`Gateway.relocate`, the
same addresses or new ones): a new client, the KV-event subscription joined afresh and the
old start's index entries dropped (a vLLM server reports no start id of its own; a
reference engine's new start id says the same again).

An engine that stops answering without exiting (SIGSTOPped, wedged) is ejected by the
gateway's health checks; if it is still ejected and failing its probes
`unresponsive_s` after (`[gateway] unresponsive_restart_s`), the watcher SIGKILLs its whole
process group, logs it, counts it (`prfaas_engine_unresponsive_kills_total`), and it is
restarted like any engine that died (backoff, budget).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from prfaas.common.ports import free_port
from prfaas.gateway.api.assembly import Gateway
from prfaas.gateway.deployment import GatewayConfig
from prfaas.gateway.instances import InstanceState
from prfaas.serve.processes import (
    EngineProcess,
    EngineSpec,
    kill_group,
    start_engine,
)

logger = logging.getLogger(__name__)
Starter = Callable[[EngineSpec, str], Awaitable[EngineProcess]]
"""Starts an engine again: (the spec with the ports to use, 0 for fresh ones; its log's
name) -> the started engine.

Raises:
    RuntimeError: it did not start."""


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
    unresponsive_s: float = 30.0
    """An engine the gateway ejected that still fails its probes this long after (and
    after its start) is killed and restarted; 0 never kills one."""
    check_s: float = 1.0
    """How often the watchers look at the gateway's view of their engines."""

    def __post_init__(self) -> None:
        for name in ("backoff_s", "max_backoff_s", "stable_s", "window_s", "check_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.budget < 0:
            raise ValueError(f"budget must be >= 0, got {self.budget}")
        if self.unresponsive_s < 0:
            raise ValueError(f"unresponsive_s must be >= 0, got {self.unresponsive_s}")


def restart_policy(gateway: GatewayConfig) -> RestartPolicy:
    """The restart policy with the deployment's grace for unresponsive engines."""
    return RestartPolicy(unresponsive_s=gateway.unresponsive_restart_s)


class Supervisor:
    """Owns the launched engines from start-up to shutdown; `engines` always holds the
    current process of each."""

    def __init__(
        self,
        engines: Mapping[str, EngineProcess],
        log_dir: Path,
        env: Mapping[str, str] | None = None,
        policy: RestartPolicy | None = None,
        starters: Mapping[str, Starter] | None = None,
    ) -> None:
        """`starters`: how an engine is started again, by name (default: a reference engine
        with `env` added to its environment)."""
        self.engines = dict(engines)
        self._log_dir = log_dir
        self._env = dict(env or {})
        self.policy = policy or RestartPolicy()
        self._starters = dict(starters or {})
        self.restarts = dict.fromkeys(self.engines, 0)
        self.unresponsive_kills = dict.fromkeys(self.engines, 0)
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
        kills = CounterMetricFamily(
            "prfaas_engine_unresponsive_kills",
            "Launched engines killed (and restarted) for not answering after their ejection.",
            labels=["instance"],
        )
        up = GaugeMetricFamily(
            "prfaas_engine_up", "1 while a launched engine's process runs.", labels=["instance"]
        )
        for name, engine in self.engines.items():
            restarts.add_metric([name], self.restarts[name])
            kills.add_metric([name], self.unresponsive_kills[name])
            up.add_metric([name], 1.0 if engine.process.returncode is None else 0.0)
        return [restarts, kills, up]

    async def _watch(self, name: str) -> None:
        loop = asyncio.get_running_loop()
        backoff = self.policy.backoff_s
        while True:
            engine = self.engines[name]
            started = loop.time()
            code = await self._ended(name, engine)
            if self._stopping:
                return
            kill_group(engine.process)  # what it left behind (vLLM's EngineCore)
            if (state := self._instance(name)) is not None:  # not routed to until it is back
                state.eject(f"its process exited (code {code})")
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

    async def _ended(self, name: str, engine: EngineProcess) -> int:
        """Wait until the engine's process exits, or kill it (its whole process group) once
        it is unresponsive (`_unresponsive`); its exit code."""
        exited = asyncio.ensure_future(engine.process.wait())
        stuck = asyncio.ensure_future(self._unresponsive(name))
        try:
            await asyncio.wait({exited, stuck}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stuck.cancel()
            if not exited.done():
                exited.cancel()
        if exited.done() and not exited.cancelled():
            return exited.result()
        self.unresponsive_kills[name] += 1
        logger.error("engine %s (pid %d) is ejected and has not answered for %g s: killing "
                     "its process tree to restart it", name, engine.process.pid,
                     self.policy.unresponsive_s)  # fmt: skip
        kill_group(engine.process)
        return await engine.process.wait()

    async def _unresponsive(self, name: str) -> None:
        """Return once the gateway has had the engine ejected, failing every probe, for
        `unresponsive_s` (never without a gateway or with `unresponsive_s` 0)."""
        loop = asyncio.get_running_loop()
        grace = self.policy.unresponsive_s
        since: float | None = None
        while True:
            await asyncio.sleep(self.policy.check_s)
            state = None if grace == 0 else self._instance(name)
            if state is None or state.status != "ejected" or state.failures == 0:
                since = None
                continue
            since = loop.time() if since is None else since
            if loop.time() - since >= grace:
                return

    def _instance(self, name: str) -> InstanceState | None:
        """The gateway's view of the engine (None before the gateway is up)."""
        if self._gateway is None:
            return None
        try:
            return self._gateway.instances[name]
        except KeyError:
            return None

    def _allowed(self, name: str, now: float) -> bool:
        recent = self._recent[name]
        while recent and recent[0] <= now - self.policy.window_s:
            recent.popleft()
        if len(recent) >= self.policy.budget:
            return False
        recent.append(now)
        return True

    async def _restart(self, name: str, old: EngineProcess) -> EngineProcess | None:
        """The engine again, in the role the gateway holds for it, on its old ports, else on
        fresh ones; the gateway follows it either way (a new client, its KV events joined
        afresh, the old start's entries dropped)."""
        await old.stop()  # reap the dead process and its output reader
        log_name = f"{name}.{self.restarts[name] + 1}"
        state = self._instance(name)
        spec = old.spec if state is None else replace(old.spec, role=state.role)
        same = replace(spec, port=old.port, bootstrap_port=old.bootstrap_port)
        start = self._starters.get(name, self._start_reference)
        try:
            new = await start(same, log_name)
        except RuntimeError as exc:
            logger.warning("engine %s could not start on its old ports: %s", name, exc)
            events = None if spec.kv_events_port is None else free_port()
            replay = None if spec.kv_replay_port is None else free_port()
            fresh = replace(spec, port=0, bootstrap_port=0, kv_events_port=events,
                            kv_replay_port=replay)  # fmt: skip
            try:
                new = await start(fresh, log_name)
            except RuntimeError as exc:
                logger.error("engine %s did not restart: %s", name, exc)
                return None
        if self._gateway is not None:
            await self._gateway.relocate(
                name, new.url, new.bootstrap_port, new.kv_events, new.kv_events_replay
            )
        return new

    async def _start_reference(self, spec: EngineSpec, log_name: str) -> EngineProcess:
        return await start_engine(spec, self._log_dir, env=self._env, log_name=log_name)

    async def stop(self) -> None:
        """Stop watching, then stop every engine (SIGTERM, then SIGKILL)."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(*(e.stop() for e in self.engines.values()))

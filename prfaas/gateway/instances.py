"""The instance registry: every engine instance the gateway can dispatch to, with its
cluster, role, health and in-flight load.

Health is a small state machine, driven by the health monitor's probes (`gateway/health.py`)
and by the Router when a call cannot even connect: `healthy` -> `suspect` (a probe failed:
a stall, still routed to) -> `ejected` (N probes in a row failed, or the connection was
refused: not routed to, its calls aborted so the Router retries or migrates them) ->
`healthy` again after M good probes. Role, draining and start identity come from the
engine's own reports.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from prfaas.engine_clients.base import BaseEngineClient, EngineCall, EngineError, Role
from prfaas.policies.routing import InstanceView, Route

logger = logging.getLogger(__name__)
Status = Literal["healthy", "suspect", "ejected"]


@dataclass(eq=False)
class InstanceState:
    """One registered instance. `bootstrap_host/port` are set for prefill-capable instances
    (and for any engine that reports them, so a role switch to prefill can use them)."""

    instance_id: str
    cluster: Route
    role: Role
    client: BaseEngineClient
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    status: Status = "healthy"
    draining: bool = False
    """A role switch drains it: no new requests until it reports otherwise."""
    start_id: str | None = None
    """The engine's own start identity (None until reported, or if it has none)."""
    failures: int = 0
    """Failed probes in a row."""
    successes: int = 0
    """Good probes in a row while ejected."""
    ejections: int = 0
    readmissions: int = 0
    """Times it came back from an ejection (confirmed by good probes)."""
    in_flight: int = 0
    queued: int = 0  # waiting requests the engine last reported
    prefix_pull: bool = False
    """The engine exports and pulls cached prefixes (its health report says so)."""
    calls: set[EngineCall] = field(default_factory=set)
    """Calls running on it now (aborted if it is ejected)."""

    @property
    def healthy(self) -> bool:
        """Routable: not ejected and not draining for a role switch."""
        return self.status != "ejected" and not self.draining

    def eject(self, reason: str) -> None:
        """Stop routing to it and abort its running calls (the Router retries or migrates
        them elsewhere); the health monitor readmits it after enough good probes."""
        if self.status == "ejected":
            return
        logger.warning("instance %s ejected: %s", self.instance_id, reason)
        self.status, self.successes = "ejected", 0
        self.ejections += 1
        error = EngineError(f"{self.instance_id}: ejected ({reason})", retryable=True,
                            code="engine_ejected")  # fmt: skip
        for call in list(self.calls):
            call.abort(error)


class InstanceManager:
    """Owns the instance table; the Router reads it, health checks and stats polls update it."""

    def __init__(self) -> None:
        self._instances: dict[str, InstanceState] = {}

    def add(self, state: InstanceState) -> None:
        if state.instance_id in self._instances:
            raise ValueError(f"instance {state.instance_id!r} is already registered")
        self._instances[state.instance_id] = state

    def remove(self, instance_id: str) -> InstanceState:
        return self._instances.pop(instance_id)

    def __getitem__(self, instance_id: str) -> InstanceState:
        return self._instances[instance_id]

    def __contains__(self, instance_id: object) -> bool:
        return instance_id in self._instances

    def __iter__(self) -> Iterator[InstanceState]:
        return iter(list(self._instances.values()))

    def __len__(self) -> int:
        return len(self._instances)

    def views(
        self, cached: Mapping[str, int], exclude: Collection[str] = ()
    ) -> tuple[InstanceView, ...]:
        """Policy views of every instance, with this request's cached prefix per instance;
        instances in `exclude` (they failed this request already) are shown unhealthy."""
        get = cached.get
        return tuple(
            [
                InstanceView(
                    s.instance_id,
                    s.cluster,
                    s.role,
                    get(s.instance_id, 0),
                    s.in_flight + s.queued,
                    s.healthy and s.instance_id not in exclude,
                )
                for s in self._instances.values()
            ]
        )

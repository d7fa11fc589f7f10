"""The instance registry: every engine instance the gateway can dispatch to, with its
cluster, role, health and in-flight load."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from prfaas.engines.client import BaseEngineClient, Role
from prfaas.policies.routing import InstanceView, Route


@dataclass
class InstanceState:
    """One registered instance. `bootstrap_host/port` are set for prefill-capable instances."""

    instance_id: str
    cluster: Route
    role: Role
    client: BaseEngineClient
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    healthy: bool = True
    draining: bool = False
    """Being converted to another role: routed nothing new (`gateway/scheduling/roles.py`)."""
    in_flight: int = 0
    queued: int = 0  # waiting requests the engine last reported


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

    def __iter__(self) -> Iterator[InstanceState]:
        return iter(list(self._instances.values()))

    def __len__(self) -> int:
        return len(self._instances)

    def views(self, cached: Mapping[str, int]) -> tuple[InstanceView, ...]:
        """Policy views of every instance, with this request's cached prefix per instance."""
        get = cached.get
        return tuple(
            [
                InstanceView(
                    s.instance_id,
                    s.cluster,
                    s.role,
                    get(s.instance_id, 0),
                    s.in_flight + s.queued,
                    s.healthy and not s.draining,
                )
                for s in self._instances.values()
            ]
        )

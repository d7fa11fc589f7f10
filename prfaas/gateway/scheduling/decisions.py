"""The one place the schedulers' decisions take effect, become visible, and are published.

`ScheduleBoard` holds the current `ScheduleState` and applies each new version to the Router
(`t`, regime) and to the instance registry (roles). Every change and every refusal is one
structured JSON log line on the `prfaas.scheduler` logger with its inputs, a Prometheus
count, an entry in the recent decisions `/admin/state` shows (the last few per loop and
kind, so the fast loop's trims or the slow loop's refusals never push a conversion out),
and a call to each listener (the coordinator's publisher to the other gateways, the
dashboard's decision list, the simulator's timeline).
A follower gateway calls `apply` with a leader's state; only newer versions are applied
(`ScheduleState.newer_than`), and its listeners see them too. A leader stamps its
versions with `leader_epoch`.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Counter

from prfaas.gateway.instances import InstanceManager
from prfaas.gateway.router import RoutingState
from prfaas.policies.routing import Regime
from prfaas.policies.schedule_state import InstanceRole, ScheduleState

logger = logging.getLogger("prfaas.scheduler")
RECENT = 16  # decisions kept per (loop, kind) for /admin/state


@dataclass(frozen=True)
class Decision:
    """One logged decision."""

    at: float
    loop: str
    """short-term | long-term | operator | leader | oracle (the simulator's)."""
    kind: str
    """threshold | set_point | regime | role | rebalance."""
    reason: str
    epoch: int
    inputs: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class SchedulerCounters:
    """The schedulers' Prometheus counters, in a gateway's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.changes = Counter(
            "prfaas_schedule_changes",  # exported as prfaas_schedule_changes_total
            "Changes of the schedule (threshold, set-point, regime, roles) by loop and kind.",
            ("loop", "kind"),
            registry=registry,
        )
        self.rebalance = Counter(
            "prfaas_rebalance_periods",
            "Long-term periods by outcome (hold, pending, refused, convert, skipped); a move"
            " refused only by the cooldown and made when it ends counts as refused here and"
            " once in prfaas_role_conversions.",
            ("outcome",),
            registry=registry,
        )
        self.conversions = Counter(
            "prfaas_role_conversions",
            "Role conversions by target role and result (ok, failed).",
            ("to_role", "result"),
            registry=registry,
        )


class ScheduleBoard:
    """Owns the current `ScheduleState` (see the module docstring)."""

    def __init__(
        self,
        state: ScheduleState,
        routing: RoutingState,
        instances: InstanceManager,
        clock: Callable[[], float],
        counters: SchedulerCounters | None = None,
    ) -> None:
        self._state = state
        self._routing = routing
        self._instances = instances
        self._clock = clock
        self.counters = counters
        self._recent: dict[tuple[str, str], collections.deque[Decision]] = {}
        self.listeners: list[Callable[[ScheduleState], None]] = []
        self.leader_epoch = state.leader_epoch
        """The epoch this gateway's changes carry (set when it becomes leader)."""
        self._apply_local(state)

    @property
    def state(self) -> ScheduleState:
        return self._state

    def change(
        self,
        loop: str,
        kind: str,
        reason: str,
        inputs: Mapping[str, Any],
        *,
        threshold: float | None = None,
        set_point: float | None = None,
        regime: Regime | None = None,
        roles: Mapping[str, InstanceRole] | None = None,
    ) -> ScheduleState:
        """Make, apply, log and publish the next version."""
        new = self._state.changed(
            f"{loop}: {reason}",
            threshold=threshold,
            set_point=set_point,
            regime=regime,
            roles=roles,
            leader_epoch=self.leader_epoch,
        )
        self._state = new
        self._apply_local(new)
        self.note(loop, kind, reason, {**inputs, "state": _brief(new)})
        if self.counters is not None:
            self.counters.changes.labels(loop, kind).inc()
        for listener in self.listeners:
            listener(new)
        return new

    def note(self, loop: str, kind: str, reason: str, inputs: Mapping[str, Any]) -> None:
        """Log a decision that changes nothing by itself (a refusal, a conversion's start)."""
        decision = Decision(self._clock(), loop, kind, reason, self._state.epoch, dict(inputs))
        key = (loop, kind)
        self._recent.setdefault(key, collections.deque(maxlen=RECENT)).append(decision)
        logger.info(orjson.dumps(decision.to_json(), option=orjson.OPT_NON_STR_KEYS).decode())

    def apply(self, state: ScheduleState) -> bool:
        """Apply a leader's state if it is newer than ours; True when applied."""
        if not state.newer_than(self._state):
            return False
        self._state = state
        self._apply_local(state)
        self.note("leader", "apply", state.cause, {"state": _brief(state)})
        for listener in self.listeners:  # e.g. a follower's dashboard shows the leader's moves
            listener(state)
        return True

    @property
    def recent(self) -> list[Decision]:
        """The last decisions of every loop and kind (up to `RECENT` each), oldest first."""
        return sorted((d for q in self._recent.values() for d in q), key=lambda d: d.at)

    def _apply_local(self, state: ScheduleState) -> None:
        self._routing.threshold = state.threshold
        self._routing.regime = state.regime
        for instance_id, role in state.roles:
            try:
                self._instances[instance_id].role = role
            except KeyError:
                continue  # an instance this gateway does not know (yet)

    def to_json(self) -> dict[str, Any]:
        return {
            **_brief(self._state),
            "cause": self._state.cause,
            "recent": [d.to_json() for d in self.recent],
        }


def _brief(state: ScheduleState) -> dict[str, Any]:
    return {
        "leader_epoch": state.leader_epoch,
        "epoch": state.epoch,
        "threshold": state.threshold,
        "set_point": state.set_point,
        "regime": state.regime,
        "roles": dict(state.roles),
    }

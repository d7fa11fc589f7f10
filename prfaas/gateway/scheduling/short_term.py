"""The short-term loop (every tick, about a second): measure the link and the predicted
prefill queues, trim `t` around the set-point, choose the bandwidth regime."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from prfaas.gateway.instances import InstanceManager
from prfaas.gateway.scheduling.config import SchedulerConfig
from prfaas.gateway.scheduling.decisions import ScheduleBoard
from prfaas.gateway.scheduling.observer import SchedulingObserver
from prfaas.policies.regime_choice import LinkReading, RegimeState, choose_regime
from prfaas.policies.routing import Route
from prfaas.policies.schedule_state import ScheduleState
from prfaas.policies.threshold_trim import TrimObservation, TrimState, set_point_moved, trim
from prfaas.policies.ttft_forecast import LinkState

LinkReader = Callable[[], LinkState | None]
"""The latest link measurement (None: no telemetry yet)."""


def no_link() -> LinkState | None:
    return None


def prefill_pool(instances: InstanceManager, cluster: Route) -> list[str]:
    """Instances of `cluster` that take prefills now (healthy, not draining)."""
    return [
        s.instance_id
        for s in instances
        if s.cluster == cluster and s.role != "decode" and s.healthy and not s.draining
    ]


class ShortTermLoop:
    """One `tick` per `tick_s`; `pinned` (operator override) stops it moving `t` or the regime."""

    def __init__(
        self,
        config: SchedulerConfig,
        board: ScheduleBoard,
        observer: SchedulingObserver,
        instances: InstanceManager,
    ) -> None:
        self._config = config
        self._board = board
        self._observer = observer
        self._instances = instances
        state = board.state
        self.trim = TrimState(state.threshold, state.set_point)
        self.regime = RegimeState(state.regime)
        self.read_link: LinkReader = no_link
        self.pinned = False
        self.last: dict[str, Any] = {}

    def follow(self, state: ScheduleState) -> None:
        """Start again from `state` (a leader's, applied while another gateway decided)."""
        self.trim = TrimState(state.threshold, state.set_point)
        self.regime = RegimeState(state.regime)

    def reset_set_point(
        self, set_point: float, planned: float | None, *, drifted: bool = False
    ) -> float:
        """The long-term loop re-solved the set-point: trim around the new one (`planned`:
        the link utilisation the plan expects there; `drifted`: moved on the blended
        estimate alone, see `threshold_trim.set_point_moved`). Returns `t` now."""
        self._synced()
        self.trim = set_point_moved(self._config.trim, self.trim, set_point, planned,
                                    drifted=drifted, now=self._observer.now())  # fmt: skip
        return self.trim.threshold

    def planned(self, utilisation: float | None) -> None:
        """The plan's expected link utilisation at the current set-point (every period)."""
        self.trim = replace(self.trim, planned_utilisation=utilisation)

    def measure(self) -> tuple[LinkState | None, float]:
        """What every tick measures, deciding or not (a follower's requests are routed on
        it too): the link, and whether the PD prefill pool is busy. Returns the link and
        the PD prefill pool's least predicted backlog."""
        link = self.read_link()
        self._observer.measured(link)
        pd_backlog = self._observer.pool_backlog(prefill_pool(self._instances, "pd"))
        self._observer.local_pool_sampled(pd_backlog)
        return link, pd_backlog

    def tick(self) -> None:
        """Measure, decide, and apply what changed."""
        link, pd_backlog = self.measure()
        util = _utilisation(link)
        obs = TrimObservation(
            now=self._observer.now(),
            egress_utilisation=util,
            prfaas_backlog_s=self._observer.pool_backlog(prefill_pool(self._instances, "prfaas")),
            pd_backlog_s=pd_backlog,
            capacity_bytes_per_s=None if link is None else link.capacity_bytes_per_s,
            pd_busy_share=self._observer.local_busy_share,
        )
        reading = self._reading(link, util)
        inputs = {
            "egress_utilisation": util,
            "prfaas_backlog_s": obs.prfaas_backlog_s,
            "pd_backlog_s": obs.pd_backlog_s,
            "pd_busy_share": obs.pd_busy_share,
            "capacity_bytes_per_s": obs.capacity_bytes_per_s,
            "spare_bytes_per_s": reading.spare_bytes_per_s,
            "kv_rate_bytes_per_s": reading.kv_rate_bytes_per_s,
        }
        self.last = inputs
        if self.pinned:
            return
        self._trim(obs, inputs)
        self._choose_regime(reading, inputs)

    def _reading(self, link: LinkState | None, util: float | None) -> LinkReading:
        """The link as the regime chooser reads it: with the profile, whether its spare
        bandwidth beats the KV production rate (pulls pay)."""
        costs = self._observer.costs
        if link is None or util is None or costs is None:
            return LinkReading(util)
        return LinkReading(util, link.spare_bytes_per_s(), costs.min_kv_rate())

    def _synced(self) -> None:
        """Trim around the board's set-point if the operator or a leader moved it."""
        set_point = self._board.state.set_point
        if self.trim.set_point != set_point:
            self.trim = self.trim.with_set_point(set_point)

    def _trim(self, obs: TrimObservation, inputs: dict[str, Any]) -> None:
        board = self._board
        self._synced()
        decision = trim(self._config.trim, self.trim, obs)
        self.trim = decision.state
        if decision.changed:
            before = board.state.threshold
            board.change(
                "short-term",
                "threshold",
                decision.reason,
                {**inputs, "from": before, "to": decision.state.threshold},
                threshold=decision.state.threshold,
            )

    def _choose_regime(self, reading: LinkReading, inputs: dict[str, Any]) -> None:
        decision = choose_regime(self._config.regime, self.regime, reading)
        self.regime = decision.state
        if decision.changed:
            self._board.change(
                "short-term", "regime", decision.reason, inputs, regime=decision.state.regime
            )


def _utilisation(link: LinkState | None) -> float | None:
    if link is None or not link.capacity_bytes_per_s > 0:
        return None
    return link.egress_bytes_per_s / link.capacity_bytes_per_s

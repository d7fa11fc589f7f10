"""The schedulers' decisions as one small value: what several gateways must agree on.

`ScheduleState` holds the threshold `t` the Router applies now, the set-point it is trimmed
around (owned by the long-term rebalancer), the bandwidth regime, and the role of every
PD-cluster instance. A leader publishes it (JSON bytes, through etcd: `prfaas.coordination`) and
every gateway applies it; `(leader_epoch, epoch)` orders versions, so a stale copy, or one
from a leader that has since been replaced, is never applied over a newer one. Pure value:
no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import msgspec

from prfaas.policies.routing import Regime

InstanceRole = Literal["prefill", "decode", "both"]


class ScheduleState(msgspec.Struct, frozen=True, kw_only=True):
    """One version of the schedulers' decisions."""

    leader_epoch: int = 0
    """The epoch of the leader that made this version (the etcd revision that elected it;
    0 for a gateway that runs alone). A newer leader's versions win whatever their `epoch`."""
    epoch: int = 0
    """Incremented by every change; a gateway applies a state only if it is newer."""
    threshold: float
    """Incremental-length threshold `t` in tokens, as the Router applies it now."""
    set_point: float
    """The long-term loop's re-solved `t`; the short-term loop trims `threshold` around it."""
    regime: Regime = "bandwidth_scarce"
    roles: tuple[tuple[str, InstanceRole], ...] = ()
    """(instance id, role) of every instance whose role the rebalancer manages, sorted."""
    cause: str = ""
    """Which loop made the last change and why (one line)."""

    def changed(
        self,
        cause: str,
        *,
        threshold: float | None = None,
        set_point: float | None = None,
        regime: Regime | None = None,
        roles: Mapping[str, InstanceRole] | None = None,
        leader_epoch: int | None = None,
    ) -> ScheduleState:
        """The next version with the given fields replaced (epoch + 1), made by the leader of
        `leader_epoch` (None: the same leader)."""
        return msgspec.structs.replace(
            self,
            leader_epoch=self.leader_epoch if leader_epoch is None else leader_epoch,
            epoch=self.epoch + 1,
            threshold=self.threshold if threshold is None else float(threshold),
            set_point=self.set_point if set_point is None else float(set_point),
            regime=self.regime if regime is None else regime,
            roles=self.roles if roles is None else tuple(sorted(roles.items())),
            cause=cause,
        )

    def role_map(self) -> dict[str, InstanceRole]:
        return dict(self.roles)

    def encode(self) -> bytes:
        """JSON bytes to publish."""
        return msgspec.json.encode(self)

    @classmethod
    def decode(cls, data: bytes | str) -> ScheduleState:
        """Parse a published state.

        Raises:
            msgspec.ValidationError: a field is missing or has the wrong type.
        """
        return msgspec.json.decode(data, type=cls)

    def newer_than(self, other: ScheduleState | None) -> bool:
        """Made by a newer leader, or a later version of the same leader's."""
        if other is None:
            return True
        return (self.leader_epoch, self.epoch) > (other.leader_epoch, other.epoch)

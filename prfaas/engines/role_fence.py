"""Fencing of role conversions: an engine takes a conversion only from the newest leader.

Each gateway leader has an epoch (the etcd revision that elected it; `prfaas.coordination`).
A conversion carries its leader's epoch, and a new leader announces its epoch to every
engine before it decides anything. The engine keeps the highest epoch it has seen and refuses
a conversion from an older one, both when the call arrives and when its drain ends (a newer
leader may have announced itself meanwhile), so a leader that was paused past its lease and
wakes up believing it still leads cannot convert anything. Epoch 0 is a gateway that runs
alone; it is refused only once a coordinated leader has announced itself.

The fence lives in the engine process: a restarted engine starts again at 0 (its new leader's
next conversion or announcement raises it). Epochs are one etcd cluster's revisions: an etcd
rebuilt without its data starts again at 1, so engines that saw the old cluster's leaders
refuse every conversion (409 `fenced`, logged by the leader) until they restart. Pure value,
no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


class Fenced(Exception):
    """A conversion from an older leader's epoch."""

    def __init__(self, epoch: int, floor: int) -> None:
        super().__init__(
            f"role conversion from leader epoch {epoch} refused: a leader of epoch {floor} "
            "has announced itself"
        )
        self.epoch = epoch
        self.floor = floor


@dataclass
class RoleFence:
    """The highest leader epoch an engine has seen. Mutated by `announce` and `admit`."""

    floor: int = 0

    def announce(self, epoch: int) -> int:
        """A leader of `epoch` announces itself; the floor after it."""
        self.floor = max(self.floor, epoch)
        return self.floor

    def admit(self, epoch: int) -> None:
        """Check a conversion of `epoch` (at its start and before its switch), raising the
        floor to it.

        Raises:
            Fenced: `epoch` is older than a leader already seen.
        """
        if epoch < self.floor:
            raise Fenced(epoch, self.floor)
        self.floor = epoch

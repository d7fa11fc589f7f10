"""Decode side: `KVReceiver` (connections to prefill senders) and `Transfer`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import NamedTuple

from prfaas.engines.transport.config import ReceiverConfig
from prfaas.engines.transport.frames import Kind
from prfaas.engines.transport.payload import LayerArrays


class LayerItem(NamedTuple):
    """One received layer: unpacks as `(layer, kind, arrays)`; `arrays.blocks` is the range."""

    layer: int
    kind: Kind
    arrays: LayerArrays


@dataclass(frozen=True)
class TransferResult:
    """A complete, verified transfer: layers in the order sent, and aux payloads by name."""

    room: int
    layers: tuple[LayerItem, ...]
    aux: dict[str, bytes]
    nbytes: int


class Transfer:
    """One room being fetched. Iterate it for layers as they arrive, or await `complete()`."""

    room: int

    def __aiter__(self) -> AsyncIterator[LayerItem]:
        """Layers in the order the prefill side sent them, each as soon as it is verified.

        Raises (from iteration):
            TransferError: timeout, abort, corruption, or unrecoverable connection loss.
        """
        raise NotImplementedError

    async def complete(self) -> TransferResult:
        """Wait for every layer and aux message and END; includes layers already iterated.

        Raises:
            TransferError: as for iteration.
        """
        raise NotImplementedError

    def aux(self, name: str) -> bytes | None:
        """An aux payload received so far (None if not yet)."""
        raise NotImplementedError

    def cancel(self, reason: str = "cancelled by decode") -> None:
        """Give up: the prefill side's `wait()` raises; iteration raises TransferError."""
        raise NotImplementedError


class KVReceiver:
    """One per decode engine process: one connection pool per prefill sender address."""

    def __init__(self, config: ReceiverConfig | None = None) -> None:
        self.config = config or ReceiverConfig()

    async def fetch(
        self, bootstrap_host: str, bootstrap_port: int, room: int, *, timeout_s: float = 60.0
    ) -> Transfer:
        """Register for `room` at the sender and return its handle at once.

        The sender may not be up yet (either start order works): connecting is retried in
        the background. The whole transfer must complete within `timeout_s`, else it fails
        with TransferError on both sides.

        Raises:
            ValueError: bad room or timeout, or the room is already being fetched.
        """
        raise NotImplementedError

    async def close(self) -> None:
        """Fail open transfers and close all connections; idempotent."""
        raise NotImplementedError

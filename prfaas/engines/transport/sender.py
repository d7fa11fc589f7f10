"""Prefill side: `KVSender` (bootstrap listener, peers, rooms) and `SendHandle`."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from prfaas.engines.transport.config import SenderConfig
from prfaas.engines.transport.frames import Kind
from prfaas.engines.transport.telemetry import TransportTelemetry


class SendHandle:
    """One transfer (room) on the prefill side. Every method but `wait` is thread-safe and
    returns immediately; the event loop that started the sender owns the sockets."""

    room: int

    def send_layer(
        self,
        layer: int,
        kind: Kind,
        arrays: Mapping[str, np.ndarray],
        *,
        blocks: tuple[int, int] | None = None,
    ) -> None:
        """Queue one layer's arrays (FULL_KV, LINEAR_STATE or SWA_KV) for sending.

        The arrays are referenced, not copied (non-contiguous ones are made contiguous):
        do not modify them until `wait()` returns. `blocks` is the [start, end) block-index
        range a FULL_KV message covers. Layers arrive at the decode side in the order sent.

        Raises:
            ValueError: bad kind, duplicate layer, unsendable array, or after finish/abort.
        """
        raise NotImplementedError

    def send_aux(self, name: str, payload: bytes) -> None:
        """Queue named bytes (first token, JSON metadata); ordered with the layers."""
        raise NotImplementedError

    def finish(self) -> None:
        """No more messages; queue END. In non-pipelined mode this releases everything."""
        raise NotImplementedError

    def abort(self, reason: str) -> None:
        """Give up the transfer: the decode side's fetch raises TransferError(reason)."""
        raise NotImplementedError

    async def wait(self) -> None:
        """Return once the decode side confirmed delivery (all checksums verified).

        Raises:
            TransferError: aborted, timed out, peer lost, or the decode side reported an error.
        """
        raise NotImplementedError


class KVSender:
    """One per prefill engine process: owns the bootstrap listener and the peer connections."""

    def __init__(self, config: SenderConfig | None = None) -> None:
        self.config = config or SenderConfig()

    async def start(self) -> None:
        """Bind the bootstrap listener (config.host, config.port)."""
        raise NotImplementedError

    @property
    def bootstrap_port(self) -> int:
        """The listening port (after `start`)."""
        raise NotImplementedError

    def open(self, room: int) -> SendHandle:
        """Start a transfer for `room` (a u64); thread-safe; the peer may register later.

        Raises:
            ValueError: room out of range or already open.
        """
        raise NotImplementedError

    def telemetry(self) -> TransportTelemetry:
        """A snapshot of egress rate, utilisation and per-connection TCP_INFO samples."""
        raise NotImplementedError

    async def close(self) -> None:
        """Fail open transfers, close connections and the listener; idempotent."""
        raise NotImplementedError

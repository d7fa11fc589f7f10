"""The hand-off interface over the cross-DC KV transport (`prfaas.engines.transport`).

A thin adapter over the engine-neutral page mover (`prfaas.engines.kv_pages`): its
`PageStream` numbers the pieces of a layer sent in several block ranges (prefill pieces) and
`model_layer` folds them back on receipt. Transport errors surface as `HandoffError`.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from prfaas.engines.kv_pages import PageStream, model_layer
from prfaas.engines.reference.handoff.base import (
    FULL_KV,
    LINEAR_STATE,
    HandoffError,
    Received,
    ReceivedLayer,
)
from prfaas.engines.transport import (
    Kind,
    KVReceiver,
    KVSender,
    ReceiverConfig,
    SenderConfig,
    SendHandle,
    TransferError,
)

_KINDS = {FULL_KV: Kind.FULL_KV, LINEAR_STATE: Kind.LINEAR_STATE}
_NAMES = {v: k for k, v in _KINDS.items()}


class TransportOutbox:
    """`Outbox` over one transport `SendHandle`."""

    def __init__(self, handle: SendHandle) -> None:
        self._handle = handle
        self._stream = PageStream(handle)

    def send_layer(
        self,
        layer: int,
        kind: str,
        arrays: Mapping[str, np.ndarray],
        *,
        blocks: tuple[int, int] | None = None,
    ) -> None:
        self._stream.send_arrays(layer, _KINDS[kind], arrays, blocks=blocks)

    def send_aux(self, name: str, payload: bytes) -> None:
        self._handle.send_aux(name, payload)

    def finish(self) -> None:
        self._handle.finish()

    def abort(self, reason: str) -> None:
        self._handle.abort(reason)

    async def wait(self) -> None:
        try:
            await self._handle.wait()
        except TransferError as exc:
            raise HandoffError(str(exc)) from exc


class TransportSender:
    """`HandoffSender` over a `KVSender` (the engine's bootstrap endpoint)."""

    def __init__(self, config: SenderConfig) -> None:
        self._sender = KVSender(config)

    async def start(self) -> None:
        await self._sender.start()

    @property
    def bootstrap_port(self) -> int:
        return self._sender.bootstrap_port

    @property
    def transport(self) -> KVSender:
        """The underlying sender (telemetry)."""
        return self._sender

    def open(self, room: int) -> TransportOutbox:
        return TransportOutbox(self._sender.open(room))

    async def close(self) -> None:
        await self._sender.close()


class TransportReceiver:
    """`HandoffReceiver` over a `KVReceiver`."""

    def __init__(self, config: ReceiverConfig | None = None) -> None:
        self._receiver = KVReceiver(config)

    async def fetch(self, host: str, port: int, room: int, *, timeout_s: float) -> Received:
        try:
            transfer = await self._receiver.fetch(host, port, room, timeout_s=timeout_s)
            result = await transfer.complete()
        except (TransferError, ValueError) as exc:
            raise HandoffError(str(exc)) from exc
        layers = tuple(
            ReceivedLayer(
                model_layer(item.layer),
                _NAMES[item.kind],
                dict(item.arrays),
                item.arrays.blocks,
            )
            for item in result.layers
        )
        return Received(layers, dict(result.aux))

    async def close(self) -> None:
        await self._receiver.close()

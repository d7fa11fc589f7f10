"""The hand-off interface over the cross-DC KV transport (`prfaas.engines.transport`).

A thin adapter over the engine-neutral page mover (`prfaas.engines.kv_pages`): its
`PageStream` numbers the pieces of a layer sent in several block ranges (prefill pieces) and
`model_layer` folds them back on receipt. Transport errors surface as `HandoffError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import numpy as np

from prfaas.engines.kv_pages import HostCopy, PageStream, SendQueue, model_layer
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
    ProcessSender,
    ReceiverConfig,
    SenderConfig,
    SendHandle,
    TransferError,
)

_KINDS = {FULL_KV: Kind.FULL_KV, LINEAR_STATE: Kind.LINEAR_STATE}
_NAMES = {v: k for k, v in _KINDS.items()}


class TransportOutbox:
    """`Outbox` over one transport `SendHandle` (through the sender's `SendQueue`, if any)."""

    def __init__(self, handle: SendHandle, queue: SendQueue | None) -> None:
        self._handle = handle
        self._stream = PageStream(handle, queue)

    def send_layer(
        self,
        layer: int,
        kind: str,
        arrays: Mapping[str, np.ndarray],
        *,
        blocks: tuple[int, int] | None = None,
    ) -> None:
        self._stream.send_arrays(layer, _KINDS[kind], arrays, blocks=blocks)

    def send_copy(
        self, layer: int, kind: str, copy: HostCopy, *, blocks: tuple[int, int] | None = None
    ) -> None:
        self._stream.send_copy(layer, _KINDS[kind], copy, blocks=blocks)

    def send_meta(self, meta: Mapping[str, Any]) -> None:
        self._stream.send_meta(meta)

    def finish(self) -> None:
        self._stream.finish()

    def abort(self, reason: str) -> None:
        self._stream.abort(reason)

    async def wait(self) -> None:
        try:
            await self._handle.wait()
        except TransferError as exc:
            raise HandoffError(str(exc)) from exc


class TransportSender:
    """`HandoffSender` over a `KVSender` (the engine's bootstrap endpoint). With `queued`
    (an engine whose copies to the host complete later, on a GPU), messages go to the
    transport from a `SendQueue` this sender starts and stops, each once its copy is done,
    so the forward pass never waits for a copy. With `process` the transport runs in a
    process of its own (`ProcessSender`)."""

    def __init__(
        self, config: SenderConfig, *, queued: bool = False, process: bool = False
    ) -> None:
        self._sender = ProcessSender(config) if process else KVSender(config)
        self._queued = queued
        self._queue: SendQueue | None = None

    async def start(self) -> None:
        await self._sender.start()
        if self._queued:
            self._queue = SendQueue()

    @property
    def bootstrap_port(self) -> int:
        return self._sender.bootstrap_port

    @property
    def transport(self) -> KVSender | ProcessSender:
        """The underlying sender (telemetry)."""
        return self._sender

    def open(self, room: int) -> TransportOutbox:
        return TransportOutbox(self._sender.open(room), self._queue)

    async def close(self) -> None:
        if self._queue is not None:
            queue, self._queue = self._queue, None
            await asyncio.to_thread(queue.close)
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

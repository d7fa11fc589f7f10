"""Prefill side: `PageStream` turns one request's pages and state slots into transport messages.

It wraps any `LayerSink` (the transport's `SendHandle` is one) and numbers the pieces of a
layer sent more than once (see `wire.py`). Thread-safe like the sink: call it from inside the
forward pass, right after a layer wrote its KV. Without a queue each message goes to the
sink at once (the pool's copy is waited for); with a `SendQueue` (device pools) messages go
from the queue's thread, in order, each once its copy has finished.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from prfaas.engines.kv_pages.host_copy import HostCopy
from prfaas.engines.kv_pages.pool import PagePool
from prfaas.engines.kv_pages.send_queue import SendQueue
from prfaas.engines.kv_pages.wire import META, encode_meta, wire_layer
from prfaas.engines.transport import Kind


class LayerSink(Protocol):
    """Where messages go: `prfaas.engines.transport.SendHandle` implements it."""

    def send_layer(
        self,
        layer: int,
        kind: Kind,
        arrays: Mapping[str, np.ndarray],
        *,
        blocks: tuple[int, int] | None = None,
    ) -> None: ...

    def send_aux(self, name: str, payload: bytes) -> None: ...

    def finish(self) -> None: ...

    def abort(self, reason: str) -> None: ...


class PageStream:
    """One request's outgoing pages, states and meta over a `LayerSink`."""

    def __init__(self, sink: LayerSink, queue: SendQueue | None = None) -> None:
        self.sink = sink
        self.queue = queue
        self._parts: dict[int, int] = {}
        self._lock = threading.Lock()

    def send_pages(
        self, pool: PagePool, layer: int, block_ids: Sequence[int], first_page: int
    ) -> None:
        """Ship `layer`'s pages `block_ids`, the request's logical pages `first_page ..`.

        The pages are copied first, so the engine may overwrite them at once.
        """
        if block_ids:
            blocks = (first_page, first_page + len(block_ids))
            self.send_copy(layer, Kind.FULL_KV, pool.gather(layer, block_ids), blocks=blocks)

    def send_state(self, pool: PagePool, layer: int, slot: int) -> None:
        """Ship `layer`'s final state from `slot` (a copy)."""
        self.send_copy(layer, Kind.LINEAR_STATE, pool.read_state(layer, slot))

    def send_arrays(
        self,
        layer: int,
        kind: Kind,
        arrays: Mapping[str, np.ndarray],
        *,
        blocks: tuple[int, int] | None = None,
    ) -> None:
        """Ship arrays already in wire form (see `wire.py`); do not modify them afterwards."""
        self.send_copy(layer, kind, HostCopy(arrays), blocks=blocks)

    def send_copy(
        self, layer: int, kind: Kind, copy: HostCopy, *, blocks: tuple[int, int] | None = None
    ) -> None:
        """Ship a pool's copy once it has finished (see `send_arrays`)."""
        with self._lock:
            part = self._parts.get(layer, 0)
            self._parts[layer] = part + 1
        wire = wire_layer(layer, part)
        self._run(copy, lambda: self.sink.send_layer(wire, kind, copy.arrays(), blocks=blocks))

    def send_aux(self, name: str, payload: bytes) -> None:
        """Named engine-specific bytes (e.g. SGLang's metadata buffers), in send order."""
        if name == META:
            raise ValueError(f"aux name {META!r} is reserved for send_meta")
        self._run(None, lambda: self.sink.send_aux(name, payload))

    def send_meta(self, meta: Mapping[str, Any]) -> None:
        """The request's metadata (send it last, before `finish`)."""
        payload = encode_meta(meta)
        self._run(None, lambda: self.sink.send_aux(META, payload))

    def finish(self) -> None:
        """No more messages."""
        self._run(None, self.sink.finish)

    def abort(self, reason: str) -> None:
        """Give up; the decode side's transfer fails with `reason`."""
        self._run(None, lambda: self.sink.abort(reason))

    def _run(self, copy: HostCopy | None, send: Callable[[], None]) -> None:
        if self.queue is None:
            send()
        else:
            self.queue.put(copy, send)

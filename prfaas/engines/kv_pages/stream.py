"""Prefill side: `PageStream` turns one request's pages and state slots into transport messages.

It wraps any `LayerSink` (the transport's `SendHandle` is one) and numbers the pieces of a
layer sent more than once (see `wire.py`). Thread-safe like the sink: call it from inside the
forward pass, right after a layer wrote its KV.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from prfaas.engines.kv_pages.pool import PagePool
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

    def __init__(self, sink: LayerSink) -> None:
        self.sink = sink
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
            self.send_arrays(layer, Kind.FULL_KV, pool.gather(layer, block_ids), blocks=blocks)

    def send_state(self, pool: PagePool, layer: int, slot: int) -> None:
        """Ship `layer`'s final state from `slot` (a copy)."""
        self.send_arrays(layer, Kind.LINEAR_STATE, pool.read_state(layer, slot))

    def send_arrays(
        self,
        layer: int,
        kind: Kind,
        arrays: Mapping[str, np.ndarray],
        *,
        blocks: tuple[int, int] | None = None,
    ) -> None:
        """Ship arrays already in wire form (see `wire.py`); do not modify them afterwards."""
        with self._lock:
            part = self._parts.get(layer, 0)
            self._parts[layer] = part + 1
        self.sink.send_layer(wire_layer(layer, part), kind, arrays, blocks=blocks)

    def send_aux(self, name: str, payload: bytes) -> None:
        """Named engine-specific bytes (e.g. SGLang's metadata buffers), in send order."""
        if name == META:
            raise ValueError(f"aux name {META!r} is reserved for send_meta")
        self.sink.send_aux(name, payload)

    def send_meta(self, meta: Mapping[str, Any]) -> None:
        """The request's metadata (send it last, before `finish`)."""
        self.sink.send_aux(META, encode_meta(meta))

    def finish(self) -> None:
        """No more messages."""
        self.sink.finish()

    def abort(self, reason: str) -> None:
        """Give up; the decode side's transfer fails with `reason`."""
        self.sink.abort(reason)

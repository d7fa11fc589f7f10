"""Prefill side: what each room has handed to the transport, and when.

A `PrefillRoom` is one request's outgoing transfer: a `PageStream` over the room's
`SendHandle` (through the worker's `SendQueue`, so sends leave from the queue's thread, in
order, each once its device-to-host copy finished), per full-attention layer how many
logical pages were handed over, and per Mamba layer whether its final state was. Pages come
from the per-layer forward hook (right after layer k wrote its KV) and from SGLang's
`send()` after each chunk (whatever the hook did not already ship, e.g. a cached prefix);
`take` makes every layer's pages go out once, in order, whoever asks first. States leave
once (`take_state`): from the hook during the last chunk's forward, else with the last
`send()`.

`RoomTimeline` keeps the prefill-side timestamps of a room (when each message was queued by
the forward or by `send()`, when it reached the transport, when the last chunk's `send()`
came) for the log line the end-to-end check reads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from prfaas.engines.kv_pages import LayerSink, PageStream, SendQueue, model_layer
from prfaas.engines.transport import Kind


@dataclass
class RoomTimeline:
    """Prefill-side timestamps of one room (`time.perf_counter()` seconds)."""

    queued: list[tuple[int, float]] = field(default_factory=list)
    """(model layer, when its copy was enqueued) per layer message, in order."""
    sent: list[tuple[int, float, int]] = field(default_factory=list)
    """(model layer, when the transport got it, bytes) per layer message, in order."""
    last_send: float | None = None
    """When SGLang's `send()` of the last chunk came (its forward had ended)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def note_queued(self, layer: int) -> None:
        with self._lock:
            self.queued.append((layer, time.perf_counter()))

    def note_sent(self, layer: int, nbytes: int) -> None:
        with self._lock:
            self.sent.append((layer, time.perf_counter(), nbytes))

    def summary(self) -> str:
        """One log line's fields: times in ms after the first message was queued; the share
        of layer bytes handed to the transport before the last chunk's `send()`."""
        with self._lock:
            queued, sent, last = list(self.queued), list(self.sent), self.last_send
        if not queued:
            return "messages=0"
        t0 = queued[0][1]
        total = sum(n for _, _, n in sent)
        early = sum(n for _, t, n in sent if last is not None and t <= last)
        share = early / total if total else 0.0
        last_ms = "-" if last is None else f"{(last - t0) * 1e3:.2f}"
        pairs = " ".join(
            f"{layer}:{(q - t0) * 1e3:.2f}:{(s - t0) * 1e3:.2f}"
            for (layer, q), (_, s, _) in zip(queued, sent, strict=False)
        )
        return (
            f"messages={len(sent)} layer_bytes={total} last_send_ms={last_ms} "
            f"sent_before_last_send={share:.3f} layer_ms=[{pairs}]"
        )


class _TimedSink:
    """Passes every message on to `sink`, noting when each layer message reached it."""

    def __init__(self, sink: LayerSink, timeline: RoomTimeline) -> None:
        self.sink = sink
        self.timeline = timeline

    def send_layer(
        self,
        layer: int,
        kind: Kind,
        arrays: Mapping[str, np.ndarray],
        *,
        blocks: tuple[int, int] | None = None,
    ) -> None:
        self.timeline.note_sent(model_layer(layer), sum(a.nbytes for a in arrays.values()))
        self.sink.send_layer(layer, kind, arrays, blocks=blocks)

    def send_aux(self, name: str, payload: bytes) -> None:
        self.sink.send_aux(name, payload)

    def finish(self) -> None:
        self.sink.finish()

    def abort(self, reason: str) -> None:
        self.sink.abort(reason)


class PrefillRoom:
    """One request's transfer on the prefill side (created when the decode's metadata came)."""

    def __init__(
        self,
        room: int,
        sink: LayerSink,
        *,
        base_tokens: int,
        num_pages: int,
        page_layers: Collection[int],
        queue: SendQueue | None = None,
    ) -> None:
        self.room = room
        self.sink = sink
        self.timeline = RoomTimeline()
        self.stream = PageStream(_TimedSink(sink, self.timeline), queue)
        self.base_tokens = base_tokens
        """Tokens the decode already holds (its prefix cache): logical page 0 starts here."""
        self.num_pages = num_pages
        """Pages the decode allocated for the rest."""
        self.tokens = 0
        """Tokens SGLang's `send()` calls covered so far."""
        self.state_slot: int | None = None
        """The Mamba slot the hook read states from (checked against the last `send()`'s)."""
        self.deferred: list[tuple[int, int, np.ndarray]] = []
        """Send-after mode: (first logical page, end, physical ids) of each `send()` so far."""
        self._sent = dict.fromkeys(page_layers, 0)
        self._states: set[int] = set()  # the layers whose state was handed over
        self._lock = threading.Lock()

    @property
    def shipped(self) -> int:
        """Logical pages handed over for every layer (the minimum over layers)."""
        with self._lock:
            return min(self._sent.values(), default=0)

    def take(self, layer: int, first: int, end: int) -> int | None:
        """Claim `layer`'s logical pages up to `end` for shipping; returns the first page not
        yet shipped (at least `first`), or None if there is nothing new.

        Raises:
            ValueError: pages before `first` were never shipped (a gap) or `end` exceeds
                what the decode allocated.
        """
        if end > self.num_pages:
            raise ValueError(f"room {self.room}: page {end} past the decode's {self.num_pages}")
        with self._lock:
            start = self._sent[layer]
            if start >= end:
                return None
            if start < first:
                raise ValueError(f"room {self.room} layer {layer}: pages {start}..{first} missing")
            self._sent[layer] = end
            return start

    def take_state(self, layer: int) -> bool:
        """Claim `layer`'s final state for shipping: True the first time only."""
        with self._lock:
            if layer in self._states:
                return False
            self._states.add(layer)
            return True

    def states_shipped(self) -> bool:
        """Whether some state already left (from the hook)."""
        with self._lock:
            return bool(self._states)

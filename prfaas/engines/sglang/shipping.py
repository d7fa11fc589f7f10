"""Prefill side: what each room has handed to the transport, and the thread that hands it.

A `PrefillRoom` is one request's outgoing transfer: a `PageStream` over the room's
`SendHandle`, and per full-attention layer how many logical pages were handed over. Pages
come from two places, the per-layer forward hook (right after layer k wrote its KV) and
SGLang's `send()` after each chunk (whatever the hook did not already ship, e.g. a cached
prefix); `take` makes every layer's pages go out once, in order, whoever asks first.

The `Shipper` runs the reads and hand-overs in submission order. On CPU it runs them inline
(the caller's tensors are final). On CUDA the caller records an event on its stream (after
layer k's kernels) and returns at once; a worker thread waits for the event on a side
stream, copies the pages to pinned host memory there and hands them to the transport, so
the forward never waits for a copy.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Collection
from typing import Any

import torch

from prfaas.engines.kv_pages import LayerSink, PageStream

logger = logging.getLogger(__name__)


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
    ) -> None:
        self.room = room
        self.sink = sink
        self.stream = PageStream(sink)
        self.base_tokens = base_tokens
        """Tokens the decode already holds (its prefix cache): logical page 0 starts here."""
        self.num_pages = num_pages
        """Pages the decode allocated for the rest."""
        self.tokens = 0
        """Tokens SGLang's `send()` calls covered so far."""
        self._sent = dict.fromkeys(page_layers, 0)
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


class Shipper:
    """Runs hand-over work in submission order: inline on CPU, on a worker thread after the
    submitter's CUDA event on CUDA (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._queue: queue.SimpleQueue[tuple[Any, Callable[[], None]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if self.cuda:
            self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            self._thread = threading.Thread(target=self._work, name="prfaas-shipper", daemon=True)
            self._thread.start()

    def submit(self, work: Callable[[], None]) -> None:
        """Run `work` once everything the current stream queued so far has run."""
        if not self.cuda:
            _run(work)
            return
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        self._queue.put((event, work))

    def _work(self) -> None:
        with torch.cuda.stream(self._stream):
            while (item := self._queue.get()) is not None:
                event, work = item
                self._stream.wait_event(event)
                _run(work)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=10.0)


def _run(work: Callable[[], None]) -> None:
    try:
        work()
    except Exception:  # a room's failure must not stop the others' hand-overs
        logger.exception("prfaas: handing KV to the transport failed")

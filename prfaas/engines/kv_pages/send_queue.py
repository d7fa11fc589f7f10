"""`SendQueue`: hands a prefill's messages to the transport from its own thread, in the order
they were queued, each once the copy it carries has finished, so the thread running the
forward pass enqueues a layer's device-to-host copy and goes on (the forward never waits
for a copy, only for host memory when the `HostBudget` is spent).

One queue per engine worker serves every request's `PageStream`: one FIFO keeps each
request's messages in order. A callback that raises is logged and the queue goes on (the
transport fails that request's transfer; the forward pass is never interrupted).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from prfaas.engines.kv_pages.host_copy import HostCopy

logger = logging.getLogger(__name__)


class SendQueue:
    """A thread that runs queued sends in order, each after its copy is ready."""

    def __init__(self, name: str = "prfaas-kv-send") -> None:
        self._items: queue.SimpleQueue[tuple[HostCopy | None, Callable[[], None]] | None] = (
            queue.SimpleQueue()
        )
        self._idle = threading.Condition()
        self._pending = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, copy: HostCopy | None, send: Callable[[], None]) -> None:
        """Run `send` on the queue's thread once `copy` (if any) is ready and everything
        queued before it has run."""
        with self._idle:
            self._pending += 1
        self._items.put((copy, send))

    def flush(self) -> None:
        """Wait until everything queued so far has run."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        self._items.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._items.get()) is not None:
            copy, send = item
            try:
                if copy is not None:
                    copy.arrays()  # waits for the copy
                send()
            except Exception:  # one request's failure must not stop the others
                logger.exception("a queued KV send failed")
            finally:
                del item, copy, send  # the bytes count against the budget while referenced
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

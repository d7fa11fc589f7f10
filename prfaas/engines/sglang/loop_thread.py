"""`LoopThread`: an asyncio event loop on a daemon thread, for the transport inside SGLang.

SGLang's scheduler and its KV managers run plain threads (the scheduler loop, ZMQ listener
threads); our transport (`KVSender`, `KVReceiver`) runs on asyncio. Each KV manager owns
one `LoopThread`: the transport objects are created and driven on it, and the SGLang-side
threads talk to it only through `run` (wait for a coroutine's result) and `submit` (fire a
coroutine, get a `concurrent.futures.Future`). `SendHandle.send_layer` is thread-safe by
itself and needs neither. `close` runs a last coroutine (the transport's close), stops the
loop and joins the thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """An event loop running on its own daemon thread until `close`."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        self.loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule `coro` on the loop from any thread; returns at once."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        """Run `coro` on the loop and wait for its result (never call it from the loop).

        Raises:
            TimeoutError: no result within `timeout_s`; whatever `coro` raised otherwise.
        """
        return self.submit(coro).result(timeout_s)

    def close(self, last: Coroutine[Any, Any, None] | None = None) -> None:
        """Run `last` (if given), stop the loop and join the thread; idempotent."""
        if not self._thread.is_alive():
            if last is not None:
                last.close()
            return
        if last is not None:
            with contextlib.suppress(TimeoutError, concurrent.futures.TimeoutError):
                self.run(last, timeout_s=10.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10.0)

"""The KV sender and receiver of one vLLM worker, on an event loop in a thread of their own
(vLLM's worker is synchronous; the transport is asyncio)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from prfaas.engines.transport import (
    KVReceiver,
    KVSender,
    ProcessSender,
    ReceiverConfig,
    SenderConfig,
)

_T = TypeVar("_T")


class TransportThread:
    """Owns a loop thread with a started `KVSender` (the bootstrap listener; with `process`,
    a `ProcessSender`) and a `KVReceiver`; `call`/`submit` run work on that loop from the
    worker's thread."""

    def __init__(
        self, sender: SenderConfig, receiver: ReceiverConfig, *, process: bool = False
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="prfaas-kv", daemon=True)
        self._thread.start()
        self.sender = ProcessSender(sender) if process else KVSender(sender)
        self.receiver = KVReceiver(receiver)
        self.submit(self.sender.start()).result(timeout=30)  # a sender process's: 25 s

    def submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        """Run `coro` on the transport loop."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn: Callable[[], _T]) -> _T:
        """Run `fn` on the transport loop and return its result (blocks briefly)."""

        async def run() -> _T:
            return fn()

        return self.submit(run()).result(timeout=30)

    def soon(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the transport loop, without waiting."""
        self.loop.call_soon_threadsafe(fn)

    def close(self) -> None:
        """Close the receiver and the sender (open transfers fail), then stop the loop."""

        async def shut() -> None:
            await self.receiver.close()
            await self.sender.close()

        try:  # a sender process waits 5 s for its child, then kills it
            self.submit(shut()).result(timeout=15)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)

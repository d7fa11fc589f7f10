"""KV-event subscriber glue: one ZMQ SUB per engine feeding the global KV index.

A lost stretch of events (sequence gap: slow join, high-water-mark drop, reconnect) or a
publisher restart (sequence going backwards) makes that instance's index entries stale, so
they are dropped before the new batch is applied: the index may under-report a cache after
that, never over-report one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from prfaas.gateway.kv_index import KVIndexManager
from prfaas.protocol.kv_events import KVEventSubscriber, ReceivedBatch
from prfaas.protocol.kv_events.vllm_events import VLLMEventDecoder

logger = logging.getLogger(__name__)


class KVEventFeed:
    """Owns the subscriber tasks; `start` once, `stop` cancels and awaits them."""

    def __init__(
        self,
        index: KVIndexManager,
        endpoints: dict[str, str],
        on_resync: Callable[[str, str], None] | None = None,
        vllm: frozenset[str] = frozenset(),
    ) -> None:
        """`vllm`: the instances whose publisher speaks vLLM's event format."""
        self._index = index
        self._endpoints = dict(endpoints)
        self._vllm = vllm
        self._on_resync = on_resync
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.batches = 0

    def start(self) -> None:
        for instance_id, endpoint in self._endpoints.items():
            self._subscribe(instance_id, endpoint)

    def _subscribe(self, instance_id: str, endpoint: str) -> None:
        if instance_id in self._vllm:
            subscriber = KVEventSubscriber(endpoint, decode=VLLMEventDecoder().decode_frames)
        else:
            subscriber = KVEventSubscriber(endpoint)
        task = asyncio.get_running_loop().create_task(self._run(instance_id, subscriber))
        self._tasks[instance_id] = task

    def restarted(self, instance_id: str) -> None:
        """The instance's engine restarted (a new start id): drop its entries and subscribe
        afresh, so the new publisher is joined at once instead of after the old socket's
        reconnect backoff (events it publishes before a subscriber joins are lost)."""
        endpoint = self._endpoints.get(instance_id)
        if endpoint is None or instance_id not in self._tasks:
            self.resync(instance_id, "restart")
        else:
            self.resubscribe(instance_id, endpoint)

    def resubscribe(self, instance_id: str, endpoint: str) -> None:
        """Follow an instance's publisher to a new endpoint (its engine restarted on another
        port); its entries are dropped first, since a restarted engine's cache is empty."""
        old = self._tasks.pop(instance_id, None)
        if old is not None:
            old.cancel()
        self.resync(instance_id, "restart")
        self._endpoints[instance_id] = endpoint
        self._subscribe(instance_id, endpoint)

    async def _run(self, instance_id: str, subscriber: KVEventSubscriber) -> None:
        try:
            while True:
                self.apply(instance_id, await subscriber.recv())
        finally:
            subscriber.close()

    def apply(self, instance_id: str, received: ReceivedBatch) -> None:
        """Apply one received batch, resynchronising first after a gap or a restart."""
        if received.restarted or received.missed:
            reason = "restart" if received.restarted else "gap"
            logger.info("%s: KV events %s (seq %d); clearing", instance_id, reason, received.seq)
            self.resync(instance_id, reason)
        self._index.apply(instance_id, received.batch.events)
        self.batches += 1

    def resync(self, instance_id: str, reason: str) -> None:
        """Drop an instance's entries (also used when its engine reports a restart)."""
        self._index.clear_instance(instance_id)
        if self._on_resync is not None:
            self._on_resync(instance_id, reason)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

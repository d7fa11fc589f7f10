"""KV-event subscriber glue: one ZMQ SUB per engine feeding the global KV index.

Each subscription first catches up (`KVEventSubscriber.sync`) where the instance has a
replay endpoint: a snapshot of what the engine caches now from a publisher that serves one
(reference engines), else, best effort, what a vLLM or SGLang publisher's bounded replay
buffer still holds. So a gateway started beside running engines, or resubscribing to an
engine that restarted, knows their caches before their next event. `synced` lets the
gateway wait for those catch-ups (bounded) before it routes.

A lost stretch of events (sequence gap: slow join, high-water-mark drop, reconnect) or a
publisher restart (sequence going backwards) makes that instance's index entries stale, so
they are dropped before the new batch is applied (or replaced by a fresh snapshot where the
publisher serves one): the index may under-report a cache after that, never over-report one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from prfaas.gateway.kv_index import FLUSH_BLOCKS, KVIndexManager
from prfaas.protocol.kv_events import (
    KVEventBatch,
    KVEventDecodeError,
    KVEventSubscriber,
    ReceivedBatch,
    StatesStored,
    decode_frames,
    event_slices,
)
from prfaas.protocol.kv_events.vllm_events import VLLMEventDecoder

logger = logging.getLogger(__name__)

# The index hashes token ids as uint32 (`IdArray`, or their msgpack bytes where msgspec
# decodes the batch): decoding them made a Python int of each, most of what reading an
# event cost.
_decode_packed = functools.partial(decode_frames, packed_ids=True)

Decode = Callable[[Sequence[bytes]], tuple[str, int, KVEventBatch[Any]]]


def _either_layout(maps_first: bool) -> Decode:
    """One publisher's frames decoded in either event layout: tagged maps (vLLM's, SGLang's
    since 0.5.23) or positional arrays (PrfaaS's, SGLang's before), the engine kind's first.
    Why both: a layout is an engine version's choice, and a batch read in the other one is
    rejected whole."""
    maps = VLLMEventDecoder(packed_ids=True).decode_frames  # (stateful: one per publisher)
    first, second = (maps, _decode_packed) if maps_first else (_decode_packed, maps)

    def decode(frames: Sequence[bytes]) -> tuple[str, int, KVEventBatch[Any]]:
        try:
            return first(frames)
        except KVEventDecodeError as error:
            try:
                return second(frames)
            except KVEventDecodeError:
                raise error from None

    return decode


class KVEventFeed:
    """Owns the subscriber tasks; `start` once, `stop` cancels and awaits them."""

    def __init__(
        self,
        index: KVIndexManager,
        endpoints: Mapping[str, str],
        on_resync: Callable[[str, str], None] | None = None,
        map_events: frozenset[str] = frozenset(),
        replay: Mapping[str, str] | None = None,
        sync_timeout_s: float = 5.0,
    ) -> None:
        """`map_events`: the instances whose publisher writes tagged-map events (vLLM's
        format, which SGLang 0.5.23 writes too: `deployment.MAP_EVENTS`), decoded in that
        layout first, the other one second (`_either_layout`). `replay`: the
        instances' replay endpoints (catch-up and gap filling); `sync_timeout_s` bounds each
        request to one."""
        self._index = index
        self._endpoints = dict(endpoints)
        self._replay = dict(replay or {})
        self._map_events = map_events
        self._on_resync = on_resync
        self._sync_timeout_s = sync_timeout_s
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._synced: dict[str, asyncio.Event] = {}
        self._generation: dict[str, int] = {}  # resyncs per instance: a slice's staleness
        self.batches = 0

    def start(self) -> None:
        for instance_id, endpoint in self._endpoints.items():
            self._subscribe(instance_id, endpoint)

    async def synced(self, timeout_s: float) -> list[str]:
        """Wait until every subscription has caught up (or given up: no answer, no replay
        endpoint), at most `timeout_s`; returns the instances still catching up then (their
        catch-up goes on and applies when it comes)."""
        waits = {i: asyncio.ensure_future(e.wait()) for i, e in self._synced.items()}
        if waits:
            await asyncio.wait(waits.values(), timeout=timeout_s)
        late = [i for i, w in waits.items() if not w.done()]
        for wait in waits.values():
            wait.cancel()
        return late

    def _subscribe(self, instance_id: str, endpoint: str) -> None:
        map_events = instance_id in self._map_events
        decode = _either_layout(maps_first=map_events)
        subscriber = KVEventSubscriber(
            endpoint,
            replay_endpoint=self._replay.get(instance_id),
            replay_timeout_s=self._sync_timeout_s,
            decode=decode,
        )
        synced = self._synced[instance_id] = asyncio.Event()
        task = asyncio.get_running_loop().create_task(self._run(instance_id, subscriber, synced))
        self._tasks[instance_id] = task

    def restarted(self, instance_id: str) -> None:
        """The instance's engine restarted (a new start id): drop its entries and subscribe
        afresh, so the new publisher is joined at once instead of after the old socket's
        reconnect backoff, and its snapshot (what it cached before we joined) is loaded."""
        endpoint = self._endpoints.get(instance_id)
        if endpoint is None or instance_id not in self._tasks:
            self.resync(instance_id, "restart")
        else:
            self.resubscribe(instance_id, endpoint, self._replay.get(instance_id))

    def resubscribe(self, instance_id: str, endpoint: str, replay: str | None = None) -> None:
        """Follow an instance's publisher to a new endpoint (its engine restarted on another
        port; `replay`: its replay endpoint now); its entries are dropped first, then
        rebuilt from its snapshot where it serves one."""
        old = self._tasks.pop(instance_id, None)
        if old is not None:
            old.cancel()
        self.resync(instance_id, "restart")
        self._endpoints[instance_id] = endpoint
        if replay is not None:
            self._replay[instance_id] = replay
        else:
            self._replay.pop(instance_id, None)
        self._subscribe(instance_id, endpoint)

    async def _run(
        self, instance_id: str, subscriber: KVEventSubscriber, synced: asyncio.Event
    ) -> None:
        try:
            for received in await subscriber.sync():
                await self._apply_in_slices(instance_id, received)
            synced.set()
            while True:
                await self._apply_in_slices(instance_id, await subscriber.recv())
        finally:
            synced.set()
            subscriber.close()

    async def _apply_in_slices(self, instance_id: str, received: ReceivedBatch) -> None:
        """`apply`, a long batch (a snapshot's: hundreds of chains) in slices of about the
        index's flush size, the loop free between them: a routing decision waits for one
        slice, not for the batch. The batch's kept states go in last, as one batch's do;
        until then an empty `StatesStored` marks the instance hybrid with nothing kept (it
        under-reports meanwhile, never over-reports). A resync between slices drops the
        rest."""
        pieces = event_slices(received.batch.events, FLUSH_BLOCKS)
        states = tuple(e for e in received.batch.events if isinstance(e, StatesStored))
        if len(pieces) > 1 and states:
            rest = [e for e in received.batch.events if not isinstance(e, StatesStored)]
            pieces = event_slices(rest, FLUSH_BLOCKS)
            pieces[0] = (StatesStored(()), *pieces[0])
            pieces[-1] = (*pieces[-1], *states)
        first = msgspec.structs.replace(received.batch, events=pieces[0] if pieces else ())
        self.apply(instance_id, dataclasses.replace(received, batch=first))
        generation = self._generation.get(instance_id, 0)
        for piece in pieces[1:]:
            await asyncio.sleep(0)
            if self._generation.get(instance_id, 0) != generation:
                return
            self._index.apply(instance_id, piece)

    def apply(self, instance_id: str, received: ReceivedBatch) -> None:
        """Apply one received batch, resynchronising first after a gap or a restart; a
        snapshot replaces what the instance had."""
        if received.restarted or received.missed:
            reason = "restart" if received.restarted else "gap"
            logger.info("%s: KV events %s (seq %d); clearing", instance_id, reason, received.seq)
            self.resync(instance_id, reason)
        elif received.snapshot:
            self._index.clear_instance(instance_id)
        self._index.apply(instance_id, received.batch.events)
        self.batches += 1

    def resync(self, instance_id: str, reason: str) -> None:
        """Drop an instance's entries (also used when its engine reports a restart)."""
        self._generation[instance_id] = self._generation.get(instance_id, 0) + 1
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

"""KV-event glue over real ZMQ sockets: events reach the index; a sequence gap, a publisher
restart or an instance going down drops that instance's entries (never over-report)."""

from __future__ import annotations

import asyncio

from prfaas.gateway.kv_feed import KVEventFeed
from prfaas.gateway.kv_index import KVIndexManager
from prfaas.protocol.kv_events import (
    AllBlocksCleared,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    ReceivedBatch,
)

BS = 4


def _stored(first_hash: int, tokens: list[int]) -> BlockStored:
    n = len(tokens) // BS
    return BlockStored(tuple(range(first_hash, first_hash + n)), None, tuple(tokens), BS)


def _batch(seq: int, *events: object, missed: int = 0, restarted: bool = False) -> ReceivedBatch:
    return ReceivedBatch("", seq, KVEventBatch(0.0, tuple(events)), missed, restarted)  # type: ignore[arg-type]


def test_gap_and_restart_resync_the_instance() -> None:
    """A batch after a gap or a restart first clears the instance, then applies; other
    instances are untouched; each resync is reported with its reason."""
    index = KVIndexManager(block_size=BS)
    resyncs: list[tuple[str, str]] = []
    feed = KVEventFeed(index, {}, lambda i, why: resyncs.append((i, why)))
    feed.apply("a", _batch(0, _stored(1, list(range(8)))))
    feed.apply("b", _batch(0, _stored(1, list(range(8)))))
    assert len(index) == 4
    feed.apply("a", _batch(5, _stored(10, [9] * 4), missed=4))
    assert len(index) == 3  # a: only the new block; b: both
    feed.apply("a", _batch(0, AllBlocksCleared(), restarted=True))
    assert len(index) == 2
    assert resyncs == [("a", "gap"), ("a", "restart")]


async def test_events_over_zmq_reach_the_index() -> None:
    """A real publisher's BlockStored arrives through the feed's subscriber task."""
    index = KVIndexManager(block_size=BS)
    with KVEventPublisher("tcp://127.0.0.1:*") as pub:
        feed = KVEventFeed(index, {"pd-p0": pub.endpoint})
        feed.start()
        try:
            for _ in range(200):  # the subscriber joins asynchronously
                pub.publish([_stored(1, list(range(12)))])
                await asyncio.sleep(0.02)
                if len(index):
                    break
        finally:
            await feed.stop()
    assert len(index) == 3
    assert index.instances() == ["pd-p0"]

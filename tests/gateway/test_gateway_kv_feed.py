"""KV-event glue over real ZMQ sockets: events reach the index; a sequence gap, a publisher
restart or an instance going down drops that instance's entries (never over-report); a
feed that joins running engines, or follows a restarted one, first loads what they cache
(their snapshots), and waiting for that is bounded; long batches go in in slices."""

from __future__ import annotations

import asyncio

import msgspec
import zmq

from prfaas.common.hashing import hash_blocks
from prfaas.gateway.kv_feed import KVEventFeed
from prfaas.gateway.kv_index import KVIndexManager
from prfaas.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    KVEventPublisher,
    ReceivedBatch,
    StatesStored,
    event_slices,
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


async def _publish_until_applied(index: KVIndexManager, map_events: frozenset[str]) -> None:
    """A real publisher's BlockStored, sent until the feed's subscriber task applies it
    (the subscriber joins asynchronously) to instance "pd-p0"."""
    with KVEventPublisher("tcp://127.0.0.1:*") as pub:
        feed = KVEventFeed(index, {"pd-p0": pub.endpoint}, map_events=map_events)
        feed.start()
        try:
            for _ in range(200):
                pub.publish([_stored(1, list(range(12)))])
                await asyncio.sleep(0.02)
                if len(index):
                    break
        finally:
            await feed.stop()


async def test_events_over_zmq_reach_the_index() -> None:
    """A real publisher's BlockStored arrives through the feed's subscriber task."""
    index = KVIndexManager(block_size=BS)
    await _publish_until_applied(index, frozenset())
    assert len(index) == 3
    assert index.instances() == ["pd-p0"]


async def test_a_feed_reads_either_event_layout_from_any_engine() -> None:
    """An instance whose engine kind publishes tagged maps (vLLM, SGLang 0.5.23) sending
    positional batches (PrfaaS's, SGLang's earlier layout): read in the other layout, not
    rejected."""
    index = KVIndexManager(block_size=BS)
    await _publish_until_applied(index, frozenset({"pd-p0"}))
    assert len(index) == 3


async def test_a_store_keyed_by_what_the_index_does_not_read_is_rejected_and_counted() -> None:
    """A vLLM publisher's batch over a real socket: its store under a LoRA adapter is
    rejected (the router cannot know a request's adapter), counted where the gateway's
    state and metrics show it, and the plain store beside it reaches the index."""
    index = KVIndexManager(block_size=BS)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    feed = KVEventFeed(index, {"pd-p0": f"tcp://127.0.0.1:{port}"}, map_events=frozenset({"pd-p0"}))
    keyed = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
             "token_ids": [1, 2, 3, 4], "block_size": BS, "lora_id": None, "medium": "GPU",
             "lora_name": "adapter"}  # fmt: skip
    plain = {**keyed, "block_hashes": [2], "token_ids": [5, 6, 7, 8], "lora_name": None}
    payload = msgspec.msgpack.encode([0.0, [keyed, plain], None])
    feed.start()
    try:
        for seq in range(200):
            pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
            await asyncio.sleep(0.02)
            if len(index):
                break
    finally:
        await feed.stop()
        pub.close()
        ctx.term()
    assert _prefix(index, [5, 6, 7, 8]) == {"pd-p0": 4}
    assert _prefix(index, [1, 2, 3, 4]) == {"pd-p0": 0}
    assert index.rejected_events == feed.batches >= 1  # (each applied batch's LoRA store)


def _replaying() -> KVEventPublisher:
    return KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")


def _replay_of(pub: KVEventPublisher) -> dict[str, str]:
    assert pub.replay_endpoint is not None
    return {"pd-p0": pub.replay_endpoint}


def _prefix(index: KVIndexManager, tokens: list[int]) -> dict[str, int]:
    return index.longest_prefix(hash_blocks(tokens, BS))


async def test_a_feed_started_beside_a_running_engine_loads_its_cache_first() -> None:
    """Blocks published before the feed exists are in the index as soon as `synced`
    returns (the publisher's snapshot), without waiting for another event; events after it
    still apply on top."""
    index = KVIndexManager(block_size=BS)
    with _replaying() as pub:
        pub.publish([_stored(1, list(range(8)))])
        pub.publish([_stored(3, [7] * 4)])
        feed = KVEventFeed(index, {"pd-p0": pub.endpoint}, replay=_replay_of(pub))
        feed.start()
        try:
            assert await feed.synced(5.0) == []
            assert len(index) == 3
            assert _prefix(index, [*range(8), 99]) == {"pd-p0": 8}
            for _ in range(200):  # the next live event (the SUB socket joins asynchronously)
                pub.publish([_stored(10, list(range(8, 12)))])
                await asyncio.sleep(0.02)
                if len(index) == 4:
                    break
        finally:
            await feed.stop()
    assert len(index) == 4


async def test_resubscribing_to_a_restarted_engine_loads_its_new_cache() -> None:
    """The engine restarted at new endpoints and cached a prompt before the gateway heard
    of it: `resubscribe` drops the old engine's entries and loads the new one's snapshot."""
    index = KVIndexManager(block_size=BS)
    with _replaying() as old, _replaying() as new:
        old.publish([_stored(1, list(range(8)))])
        feed = KVEventFeed(index, {"pd-p0": old.endpoint}, replay=_replay_of(old))
        feed.start()
        try:
            await feed.synced(5.0)
            assert _prefix(index, [*range(8), 99]) == {"pd-p0": 8}
            new.publish([_stored(1, [5] * 12)])
            feed.resubscribe("pd-p0", new.endpoint, new.replay_endpoint)
            assert await feed.synced(5.0) == []
            assert _prefix(index, [*range(8), 99]) == {"pd-p0": 0}
            assert _prefix(index, [5] * 13) == {"pd-p0": 12}
        finally:
            await feed.stop()


async def test_waiting_for_a_silent_engine_is_bounded() -> None:
    """An engine whose replay endpoint never answers: `synced` gives up after its timeout
    and names it; the live events still reach the index."""
    index = KVIndexManager(block_size=BS)
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("tcp://127.0.0.1:*")
    try:
        with KVEventPublisher("tcp://127.0.0.1:*") as pub:
            replay = {"pd-p0": silent.getsockopt_string(zmq.LAST_ENDPOINT)}
            feed = KVEventFeed(index, {"pd-p0": pub.endpoint}, replay=replay, sync_timeout_s=0.5)
            feed.start()
            try:
                start = asyncio.get_running_loop().time()
                assert await feed.synced(0.3) == ["pd-p0"]
                assert (
                    asyncio.get_running_loop().time() - start < 1.0
                )  # bounded (a loaded loop lags)
                for _ in range(300):
                    pub.publish([_stored(1, list(range(8)))])
                    await asyncio.sleep(0.02)
                    if len(index):
                        break
            finally:
                await feed.stop()
        assert len(index) == 2
    finally:
        silent.close()
        ctx.term()


def test_a_long_batch_is_applied_in_slices_of_about_the_flush_size() -> None:
    """A snapshot's batch of many chains is cut, in order, into runs of about `blocks`
    stored blocks (the feed yields to the loop between them); other events ride along."""
    events: list[KVEvent] = [BlockStored((i, i + 1000), None, (1, 2, 3, 4), 2) for i in range(10)]
    events.insert(3, BlockRemoved((7,)))
    pieces = event_slices(events, 6)
    assert [e for piece in pieces for e in piece] == events
    assert [sum(len(e.block_hashes) for e in p if isinstance(e, BlockStored)) for p in pieces] == [
        6,
        6,
        6,
        2,
    ]
    assert event_slices([], 6) == []


async def test_a_hybrid_snapshot_in_slices_never_over_reports_between_them() -> None:
    """A hybrid engine's snapshot (chains first, kept states last) applied in slices: a
    lookup between slices reports nothing past a kept state, and after the last slice the
    cut is the one the states give."""
    index = KVIndexManager(block_size=BS)
    feed = KVEventFeed(index, {})
    tokens = list(range(BS * 600))
    chain = [
        BlockStored(
            tuple(range(i, i + 60)), i - 1 if i else None, tuple(tokens[BS * i : BS * (i + 60)]), BS
        )
        for i in range(0, 600, 60)
    ]
    events: tuple[KVEvent, ...] = (*chain, StatesStored((9,)))  # kept after the tenth block
    received = ReceivedBatch(
        "", 0, KVEventBatch(0.0, events), missed=0, restarted=False, snapshot=True
    )
    task = asyncio.create_task(feed._apply_in_slices("h", received))
    prompt = hash_blocks(tokens, BS)
    seen = []
    while not task.done():
        seen.append(index.longest_prefix(prompt).get("h", 0))
        await asyncio.sleep(0)
    await task
    assert all(tokens_ in (0, BS * 10) for tokens_ in seen), seen
    assert index.longest_prefix(prompt) == {"h": BS * 10}

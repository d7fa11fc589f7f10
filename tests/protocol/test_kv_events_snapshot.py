"""Snapshots of a publisher's cache (the replay endpoint's PrfaaS extension): the mirror
rebuilds exactly what the events built, and a late subscriber catches up from it over real
sockets, in order with the live stream."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator, Sequence

import pytest

from prfaas.common.hashing import hash_blocks
from prfaas.engines.reference.cache.block_pool import BlockPool, BlockPoolConfig
from prfaas.gateway.kv_index import KVIndexManager
from prfaas.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventPublisher,
    KVEventSubscriber,
    ReceivedBatch,
    StatesRemoved,
    StatesStored,
)
from prfaas.protocol.kv_events.cache_mirror import CacheMirror

BS = 4


def _prompts(seed: int, n: int) -> list[list[int]]:
    """Prompts sharing prefixes (a few roots, branching), so chains fork and overlap."""
    rng = random.Random(seed)
    roots = [[rng.randrange(50) for _ in range(BS * 3)] for _ in range(3)]
    return [
        rng.choice(roots)[: BS * rng.randint(1, 3)] + [rng.randrange(50) for _ in range(BS * 4)]
        for _ in range(n)
    ]


def _pool_events(seed: int) -> Iterator[list[KVEvent]]:
    """What a real reference block pool publishes while it runs random prompts: stores,
    evictions (a small pool), now and then a flush. One list per engine step."""
    rng = random.Random(seed)
    pool = BlockPool(BlockPoolConfig(num_blocks=24, block_size=BS, num_state_slots=4))
    for i, prompt in enumerate(_prompts(seed, 60)):
        match = pool.match_prefix(hash_blocks(prompt[:-1], BS))
        pool.allocate(f"r{i}", len(prompt), match)
        pool.cache_full_blocks(f"r{i}", prompt)
        pool.free(f"r{i}")
        if rng.random() < 0.05:
            pool.clear()
        yield pool.take_events()


def _same_view(a: KVIndexManager, b: KVIndexManager, probes: Sequence[list[int]]) -> None:
    assert len(a) == len(b)
    for prompt in probes:
        hashes = hash_blocks(prompt, BS)
        assert a.longest_prefix(hashes) == b.longest_prefix(hashes), prompt


@pytest.mark.parametrize("seed", range(5))
def test_a_snapshot_rebuilds_what_the_events_built(seed: int) -> None:
    """Invariant: after any prefix of a real pool's event stream, an index loaded from the
    mirror's snapshot sees every prompt exactly as an index fed the whole stream does."""
    live = KVIndexManager(block_size=BS)
    mirror = CacheMirror()
    probes = _prompts(seed + 100, 40)
    for step, events in enumerate(_pool_events(seed)):
        live.apply("e", events)
        mirror.apply(events)
        if step % 7 == 0:
            loaded = KVIndexManager(block_size=BS)
            loaded.apply("e", mirror.snapshot(max_blocks_per_event=2))
            _same_view(live, loaded, probes)
    assert len(mirror) == len(live) > 0


def test_kept_states_travel_in_the_snapshot() -> None:
    """A hybrid engine's states: kept, removed, dropped with their block, forgotten by a
    flush (the engine still hybrid: what it stores next is not reusable until it reports
    states); the snapshot gives an index the same reusable prefixes the live stream gave,
    an empty `StatesStored` standing for "hybrid, nothing reusable"."""
    tokens = list(range(12))
    chain = BlockStored((1, 2, 3), None, tuple(tokens), BS)
    other = BlockStored((7,), None, (40, 41, 42, 43), BS)
    prompt = hash_blocks([*tokens, 99], BS)
    steps: list[tuple[list[KVEvent], int]] = [  # events, then the prompt's reusable tokens
        ([chain, other], 12),  # no states reported: every cached block counts
        ([StatesStored((2,))], 8),  # hybrid now: reusable up to the block with states
        ([StatesStored((3,)), StatesRemoved((2,))], 12),
        ([BlockRemoved((3,))], 0),  # its states left with it; block 2 has none
        ([AllBlocksCleared(), BlockStored((1,), None, tuple(tokens[:4]), BS)], 0),
        ([StatesStored((1,))], 4),
    ]
    live = KVIndexManager(block_size=BS)
    mirror = CacheMirror()
    for events, reusable in steps:
        live.apply("e", events)
        mirror.apply(events)
        loaded = KVIndexManager(block_size=BS)
        loaded.apply("e", mirror.snapshot())
        assert live.longest_prefix(prompt) == loaded.longest_prefix(prompt) == {"e": reusable}
    mirror.apply([StatesRemoved((1,))])
    assert mirror.snapshot()[-1] == StatesStored(())  # hybrid, nothing kept


def _stored(first: int, n: int) -> BlockStored:
    return BlockStored(tuple(range(first, first + n)), None, tuple(range(n * BS)), BS)


@pytest.fixture
def publisher() -> Iterator[KVEventPublisher]:
    pub = KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    yield pub
    pub.close()


async def _live(sub: KVEventSubscriber, pub: KVEventPublisher, first: int) -> ReceivedBatch:
    """The next live batch, publishing one-block batches (hashes from `first` up) until
    one arrives (the SUB socket joins asynchronously)."""
    async with asyncio.timeout(10):
        while True:
            pub.publish([_stored(first, 1)])
            first += 1
            try:
                async with asyncio.timeout(0.1):
                    return await sub.recv()
            except TimeoutError:
                continue


async def test_a_late_subscriber_loads_the_snapshot_then_follows_live(
    publisher: KVEventPublisher,
) -> None:
    """Five batches published before the subscriber exists (no replay buffer could be
    trusted to hold them all in general): `sync` returns one snapshot batch as of the
    publisher's sequence number, whose blocks an index loads; the next live batches follow
    it gaplessly (any the slow-joining SUB lost are replayed), none applied twice."""
    for i in range(5):
        publisher.publish([_stored(10 * i, 2)])
    sub = KVEventSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint)
    try:
        loaded = await sub.sync()
        assert len(loaded) == 1 and loaded[0].snapshot
        assert loaded[0].seq == 4 and (loaded[0].missed, loaded[0].restarted) == (0, False)
        stored = [e for e in loaded[0].batch.events if isinstance(e, BlockStored)]
        assert sorted(h for e in stored for h in e.block_hashes) == sorted(
            h for i in range(5) for h in (10 * i, 10 * i + 1)
        )
        nxt = await _live(sub, publisher, 1000)
        assert (nxt.seq, nxt.missed, nxt.snapshot) == (5, 0, False)
        assert sub.num_missed == 0
    finally:
        sub.close()


async def test_a_large_snapshot_travels_in_batches_of_a_few_hundred_blocks(
    publisher: KVEventPublisher,
) -> None:
    """A snapshot of 40 chains of 64 blocks goes out in wire batches of about
    `SNAPSHOT_BLOCKS_PER_BATCH` blocks (chains whole), each decoded on its own by the
    subscriber (the loop free between them), which returns them as one snapshot batch."""
    import zmq
    import zmq.asyncio

    from prfaas.protocol.kv_events import END_SEQ, SNAPSHOT_SEQ, decode_batch
    from prfaas.protocol.kv_events.publisher import SNAPSHOT_BLOCKS_PER_BATCH

    for i in range(40):
        publisher.publish([_stored(1000 * i, 64)])
    assert publisher.replay_endpoint is not None
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(publisher.replay_endpoint)
        await sock.send_multipart([b"", SNAPSHOT_SEQ])
        sizes = []
        async with asyncio.timeout(10):
            while (frames := await sock.recv_multipart())[1] != END_SEQ:
                if frames[1] != SNAPSHOT_SEQ:
                    events = decode_batch(frames[2]).events
                    sizes.append(sum(len(e.block_hashes) for e in events))
    finally:
        sock.close(linger=0)
        ctx.term()
    assert sum(sizes) == 40 * 64 and len(sizes) == 40 * 64 // SNAPSHOT_BLOCKS_PER_BATCH
    assert max(sizes) < SNAPSHOT_BLOCKS_PER_BATCH + 64
    sub = KVEventSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint)
    try:
        (loaded,) = await sub.sync()
        assert loaded.snapshot and len(loaded.batch.events) == 40
    finally:
        sub.close()


async def test_batches_queued_before_the_snapshot_are_skipped(
    publisher: KVEventPublisher,
) -> None:
    """A subscriber whose SUB socket already queued batches the snapshot then covers skips
    them: the first batch `recv` returns is the first one after the snapshot."""
    sub = KVEventSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint)
    try:
        await asyncio.sleep(0.5)  # the SUB socket has joined: every batch is queued now
        for i in range(3):
            publisher.publish([_stored(100 + i, 1)])
        await asyncio.sleep(0.2)
        (snapshot,) = await sub.sync()
        assert snapshot.seq == 2
        publisher.publish([_stored(500, 1)])
        async with asyncio.timeout(5):
            nxt = await sub.recv()
        assert (nxt.seq, nxt.missed) == (3, 0)
        assert nxt.batch.events == (_stored(500, 1),)
        assert sub.num_stale == 3
    finally:
        sub.close()


def _hashes(got: ReceivedBatch) -> set[int]:
    return {h for e in got.batch.events if isinstance(e, BlockStored) for h in e.block_hashes}


async def test_a_restarted_publisher_is_read_from_its_snapshot() -> None:
    """The publisher restarts on the same endpoints (a new engine process): the first live
    batch from it goes back in sequence, and the subscriber answers with the new
    publisher's snapshot, what it cached before the subscriber noticed included."""
    first = KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    endpoint, replay = first.endpoint, first.replay_endpoint
    assert replay is not None
    for i in range(4):
        first.publish([_stored(10 * i, 1)])
    sub = KVEventSubscriber(endpoint, replay_endpoint=replay, reconnect_ivl_ms=20)
    try:
        await sub.sync()
        await _live(sub, first, 100)
        first.close()
        second = KVEventPublisher(endpoint, replay_endpoint=replay)
        try:
            second.publish([_stored(900, 2)])  # before any subscriber is back
            got = await _live(sub, second, 2000)
            while not got.restarted and _hashes(got) < set(range(100, 2000)):
                got = await _live(sub, second, 3000)  # a late live batch of the first one's
            assert got.snapshot and got.restarted
            hashes = _hashes(got)
            assert {900, 901} <= hashes and not hashes & {0, 10, 20, 30, 100}
        finally:
            second.close()
    finally:
        sub.close()

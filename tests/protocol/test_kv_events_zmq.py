"""KV events over real ZMQ PUB/SUB sockets on tcp://127.0.0.1 (ephemeral ports)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
import zmq

from prfaas.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    KVEventSubscriber,
    ReceivedBatch,
    encode_frames,
)

STORED = BlockStored((11, 12), None, (1, 2, 3, 4), 2)
PROBE = (BlockRemoved((0,)),)


@pytest.fixture
def publisher() -> Iterator[KVEventPublisher]:
    pub = KVEventPublisher("tcp://127.0.0.1:*", topic="kv", clock=lambda: 42.0)
    yield pub
    pub.close()


@pytest.fixture
def raw_pub() -> Iterator[tuple[zmq.Socket[bytes], str]]:
    """A bare PUB socket to send hand-made frames (sequence gaps, garbage)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    yield sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)
    sock.close()
    ctx.term()


async def _subscriber(endpoint: str, topic: str = "kv") -> KVEventSubscriber:
    return KVEventSubscriber(endpoint, topic=topic, reconnect_ivl_ms=20)


async def _join(send_probe: object, sub: KVEventSubscriber) -> ReceivedBatch:
    """Send probes until the subscriber sees one (ZMQ's slow-joiner window)."""
    assert callable(send_probe)
    async with asyncio.timeout(10):
        while True:
            send_probe()
            try:
                async with asyncio.timeout(0.05):
                    return await sub.recv()
            except TimeoutError:
                continue


@pytest.fixture
async def sub_for(publisher: KVEventPublisher) -> AsyncIterator[KVEventSubscriber]:
    sub = await _subscriber(publisher.endpoint)
    yield sub
    sub.close()


async def test_publisher_binds_ephemeral_port(publisher: KVEventPublisher) -> None:
    """A wildcard port is resolved to the real bound tcp endpoint."""
    assert publisher.endpoint.startswith("tcp://127.0.0.1:")
    assert int(publisher.endpoint.rsplit(":", 1)[1]) > 0


async def test_batches_arrive_in_order_with_sequence_numbers(
    publisher: KVEventPublisher, sub_for: KVEventSubscriber
) -> None:
    """Published batches arrive decoded, in order, with consecutive seqs and no gap."""
    first = await _join(lambda: publisher.publish(PROBE), sub_for)
    assert first.missed == first.seq  # probes sent before the subscription took are lost
    events = [(STORED,), (BlockRemoved((11, 12)),), (AllBlocksCleared(),)]
    seqs = [publisher.publish(e) for e in events]
    got = [await sub_for.recv() for _ in events]
    while got[0].batch.events == PROBE:  # probes still in flight when we joined
        got = [*got[1:], await sub_for.recv()]
    assert [g.seq for g in got] == seqs
    assert [g.batch for g in got] == [KVEventBatch(42.0, e, 0) for e in events]
    assert all(g.topic == "kv" and g.missed == 0 and not g.restarted for g in got)


async def test_empty_publish_sends_nothing(publisher: KVEventPublisher) -> None:
    """Publishing no events sends no batch and consumes no sequence number."""
    assert publisher.publish([]) is None
    assert publisher.next_seq == 0


async def test_gaps_and_restarts_are_detected(raw_pub: tuple[zmq.Socket[bytes], str]) -> None:
    """A jump in seq reports the missed count; a seq going back reports a restart."""
    sock, endpoint = raw_pub
    sub = await _subscriber(endpoint, topic="")
    try:
        batch = KVEventBatch(1.0, PROBE)
        await _join(lambda: sock.send_multipart(encode_frames("", 0, batch)), sub)
        for seq in (1, 5, 2):
            sock.send_multipart(encode_frames("", seq, batch))
        got = [await sub.recv() for _ in range(3)]
        while got[0].seq == 0:
            got = [*got[1:], await sub.recv()]
        assert [(g.seq, g.missed, g.restarted) for g in got] == [
            (1, 0, False),
            (5, 3, False),
            (2, 2, True),
        ]
    finally:
        sub.close()


async def test_malformed_messages_are_skipped(raw_pub: tuple[zmq.Socket[bytes], str]) -> None:
    """Garbage frames are counted and skipped; the next good batch still arrives."""
    sock, endpoint = raw_pub
    sub = await _subscriber(endpoint, topic="")
    try:
        good = KVEventBatch(1.0, PROBE)
        await _join(lambda: sock.send_multipart(encode_frames("", 0, good)), sub)
        sock.send_multipart([b"", b"\x00" * 8, b"\xc1"])
        sock.send_multipart([b"only one frame"])
        sock.send_multipart(encode_frames("", 99, KVEventBatch(2.0, (STORED,))))
        async with asyncio.timeout(5):
            got = await sub.recv()
            while got.seq == 0:
                got = await sub.recv()
        assert got.seq == 99 and got.batch.events == (STORED,)
        assert sub.num_decode_errors == 2
    finally:
        sub.close()


async def test_subscriber_reconnects_to_a_restarted_publisher() -> None:
    """After the publisher dies and rebinds the same port, events flow again (restart seen)."""
    first = KVEventPublisher("tcp://127.0.0.1:*")
    endpoint = first.endpoint
    sub = await _subscriber(endpoint, topic="")
    try:
        await _join(lambda: first.publish(PROBE), sub)
        for _ in range(500):  # push the old incarnation's seq well past the new one's
            first.publish(PROBE)
        async with asyncio.timeout(5):
            while (await sub.recv()).seq != first.next_seq - 1:
                pass
        first.close()
        await asyncio.sleep(0.1)
        second = KVEventPublisher(endpoint)
        try:
            got = await _join(lambda: second.publish((STORED,)), sub)
            while got.batch.events != (STORED,):
                got = await sub.recv()
            assert got.restarted
        finally:
            second.close()
    finally:
        sub.close()


def test_bad_endpoint_is_a_clear_error() -> None:
    """Binding to a malformed endpoint raises ValueError naming it."""
    with pytest.raises(ValueError, match="not-an-endpoint"):
        KVEventPublisher("not-an-endpoint")


async def test_closed_endpoints_refuse_use_clearly() -> None:
    """After close (idempotent), publish and recv raise RuntimeError, not a ZMQ error."""
    pub = KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    sub = KVEventSubscriber(pub.endpoint)
    for closeable in (pub, sub, pub, sub):
        closeable.close()
    with pytest.raises(RuntimeError, match="publisher is closed"):
        pub.publish(PROBE)
    with pytest.raises(RuntimeError, match="subscriber is closed"):
        await sub.recv()

"""SGLang's KV event replay endpoint, and gap filling in the subscriber, over real sockets."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import zmq
import zmq.asyncio

from prfaas.protocol.kv_events import (
    END_SEQ,
    BlockRemoved,
    KVEventBatch,
    KVEventPublisher,
    KVEventSubscriber,
    ReceivedBatch,
    decode_batch,
    encode_frames,
)


def events(i: int) -> tuple[BlockRemoved]:
    return (BlockRemoved((i,)),)


def batch(i: int) -> KVEventBatch:
    return KVEventBatch(7.0, events(i), 0)


@pytest.fixture
def replaying() -> Iterator[KVEventPublisher]:
    """A publisher with replay on, that has published batches 0..4."""
    pub = KVEventPublisher(
        "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", buffer_steps=4,
        clock=lambda: 7.0,
    )  # fmt: skip
    for i in range(5):
        pub.publish(events(i))
    yield pub
    pub.close()


async def _ask(endpoint: str, frames: list[bytes]) -> list[list[bytes]]:
    """Send one request on a DEALER socket; collect replies up to the end marker."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    replies: list[list[bytes]] = []
    try:
        await sock.send_multipart(frames)
        async with asyncio.timeout(5):
            while not replies or replies[-1][1] != END_SEQ:
                replies.append(await sock.recv_multipart())
    finally:
        sock.close()
        ctx.term()
    return replies


async def test_replay_serves_buffered_batches_from_a_sequence(
    replaying: KVEventPublisher,
) -> None:
    """A request for seq >= 2 gets batches 2, 3, 4 as [b"", seq, payload], then END_SEQ."""
    assert replaying.replay_endpoint is not None
    replies = await _ask(replaying.replay_endpoint, [b"", (2).to_bytes(8, "big")])
    assert [r[1] for r in replies] == [i.to_bytes(8, "big") for i in (2, 3, 4)] + [END_SEQ]
    assert [decode_batch(r[2]) for r in replies[:-1]] == [batch(i) for i in (2, 3, 4)]
    assert replies[-1] == [b"", END_SEQ, b""]


async def test_replay_buffer_keeps_only_the_last_steps(replaying: KVEventPublisher) -> None:
    """With buffer_steps=4, batch 0 is gone; a malformed request is ignored, not fatal."""
    assert replaying.replay_endpoint is not None
    ctx = zmq.Context()
    bad = ctx.socket(zmq.DEALER)
    bad.setsockopt(zmq.LINGER, 0)
    bad.connect(replaying.replay_endpoint)
    bad.send_multipart([b"", b"short"])
    replies = await _ask(replaying.replay_endpoint, [b"", (0).to_bytes(8, "big")])
    bad.close()
    ctx.term()
    assert [int.from_bytes(r[1], "big") for r in replies[:-1]] == [1, 2, 3, 4]


async def _drain(sub: KVEventSubscriber) -> list[ReceivedBatch]:
    got: list[ReceivedBatch] = []
    while True:
        try:
            async with asyncio.timeout(0.2):
                got.append(await sub.recv())
        except TimeoutError:
            return got


async def test_subscriber_fills_a_gap_from_the_replay_endpoint(
    replaying: KVEventPublisher,
) -> None:
    """Batches lost on the PUB path are fetched by replay and delivered in order, gapless.

    The live stream comes from a bare PUB socket that skips seqs 1 and 2; the replay comes
    from the real publisher's buffer, which holds them.
    """
    ctx = zmq.Context()
    live = ctx.socket(zmq.PUB)
    live.setsockopt(zmq.LINGER, 0)
    live.bind("tcp://127.0.0.1:*")
    sub = KVEventSubscriber(
        live.getsockopt_string(zmq.LAST_ENDPOINT), replay_endpoint=replaying.replay_endpoint
    )
    try:
        async with asyncio.timeout(10):
            while not await _drain(sub):  # slow joiner: resend seq 0 until it lands
                live.send_multipart(encode_frames("", 0, batch(0)))
        live.send_multipart(encode_frames("", 3, batch(3)))
        async with asyncio.timeout(5):
            got = [await sub.recv() for _ in range(3)]
        assert [(g.seq, g.batch, g.missed) for g in got] == [(i, batch(i), 0) for i in (1, 2, 3)]
        assert sub.num_replayed == 2 and sub.num_missed == 0
    finally:
        sub.close()
        live.close()
        ctx.term()


async def test_unanswered_replay_reports_the_gap() -> None:
    """With no replay server answering, the batch still arrives, flagged with what was lost."""
    ctx = zmq.Context()
    live = ctx.socket(zmq.PUB)
    live.setsockopt(zmq.LINGER, 0)
    live.bind("tcp://127.0.0.1:*")
    dead = ctx.socket(zmq.ROUTER)
    dead.bind("tcp://127.0.0.1:*")
    silent = dead.getsockopt_string(zmq.LAST_ENDPOINT)  # bound, never answers
    sub = KVEventSubscriber(
        live.getsockopt_string(zmq.LAST_ENDPOINT), replay_endpoint=silent, replay_timeout_s=0.2
    )
    try:
        async with asyncio.timeout(10):
            got = await _drain(sub)
            while not got:
                live.send_multipart(encode_frames("", 0, batch(0)))
                got = await _drain(sub)
        live.send_multipart(encode_frames("", 4, batch(4)))
        async with asyncio.timeout(5):
            late = await sub.recv()
        assert (late.seq, late.missed, late.restarted) == (4, 3, False)
        assert sub.num_replayed == 0
    finally:
        sub.close()
        dead.close()
        live.close()
        ctx.term()


def test_bad_replay_endpoint_is_a_clear_error() -> None:
    """A replay endpoint that cannot bind raises ValueError naming it; nothing leaks."""
    with pytest.raises(ValueError, match="nowhere"):
        KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="nowhere")
    with pytest.raises(ValueError, match="buffer_steps"):
        KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", buffer_steps=0)

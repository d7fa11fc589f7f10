"""Bounded memory: the sender's in-flight window and the receiver's buffer; pacing,
added delay and telemetry on a real connection."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from transport_helpers import assert_same, eventually, make_pair, tls_configs

from prfaas.engines.transport import Kind, KVReceiver, ReceiverConfig, SenderConfig

pytestmark = pytest.mark.timeout(60)
MIB = 2**20


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
async def test_slow_consumer_stalls_the_sender_within_bounds(tls: bool, tmp_path: Path) -> None:
    """A decode side that does not consume: the receiver stops reading at its buffer limit,
    the sender stops at its window, the rest stays queued (no buffer grows); once the
    consumer reads, everything arrives exact. The same inside TLS (its layer pauses the
    socket once its own bounded buffer fills)."""
    window, limit, layer_bytes = 1 * MIB, 1 * MIB, 256 * 1024
    serve, trust = tls_configs(tmp_path) if tls else (None, None)
    pair = await make_pair(
        SenderConfig(window_bytes=window, chunk_bytes=65536, tls=serve),
        ReceiverConfig(max_buffered_bytes=limit, tls=trust),
    )
    rng = np.random.default_rng(0)
    layers = [rng.integers(0, 255, layer_bytes, dtype=np.uint8) for _ in range(40)]  # 10 MiB
    try:
        handle = pair.sender.open(1)
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 1, timeout_s=30)
        for i, data in enumerate(layers):
            handle.send_layer(i, Kind.FULL_KV, {"kv": data})
        handle.finish()
        peer_in_flight, link_buffered = [], []
        await eventually(lambda: bool(pair.sender._peers))
        peer = next(iter(pair.sender._peers.values()))
        link = next(iter(pair.receiver._links.values()))
        for _ in range(40):  # 0.4 s of a stalled consumer
            await asyncio.sleep(0.01)
            peer_in_flight.append(peer.in_flight_bytes)
            link_buffered.append(link._buffered)
        assert max(peer_in_flight) <= window
        # reading stops once past the limit; what may still land: the message that crossed
        # it plus out-of-order ones completed behind it (bounded by the sender's window)
        assert max(link_buffered) <= limit + layer_bytes + window
        assert peer.queued_frames > 0  # the producer's data waits at the sender, unsent
        assert pair.sender.telemetry().bytes_total < 4 * MIB
        got = [item async for item in transfer]
        await handle.wait()
        assert [item.layer for item in got] == list(range(40))
        for item, data in zip(got, layers, strict=True):
            assert_same({"kv": data}, item.arrays)
        assert link._buffered == 0 and peer.in_flight_bytes == 0
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def test_cancel_after_completion_releases_the_buffer() -> None:
    """A consumer that walks away from a completed transfer frees the receiver's buffer."""
    pair = await make_pair()
    try:
        handle = pair.sender.open(9)
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 9, timeout_s=10)
        handle.send_layer(0, Kind.FULL_KV, {"x": np.zeros(100_000, np.uint8)})
        handle.finish()
        await handle.wait()
        link = next(iter(pair.receiver._links.values()))
        assert link._buffered == 100_000
        transfer.cancel()
        assert link._buffered == 0 and (await transfer.complete()).layers == ()
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def test_window_bounds_in_flight_on_a_paced_link() -> None:
    """Paced at 4 MB/s with a 128 KiB window: in-flight never exceeds the window."""
    pair = await make_pair(
        SenderConfig(window_bytes=131072, chunk_bytes=16384, rate_bytes_per_s=4e6)
    )
    try:
        handle = pair.sender.open(2)
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 2, timeout_s=30)
        data = np.arange(300_000, dtype=np.int32)  # 1.2 MB
        handle.send_layer(0, Kind.FULL_KV, {"x": data})
        handle.finish()
        task = asyncio.create_task(transfer.complete())
        await eventually(lambda: bool(pair.sender._peers))
        peer = next(iter(pair.sender._peers.values()))
        samples = []
        while not task.done():
            samples.append(peer.in_flight_bytes)
            await asyncio.sleep(0.005)
        assert_same({"x": data}, (await task).layers[0].arrays)
        assert max(samples) <= 131072 and max(samples) > 0
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def test_pacing_rate_and_telemetry() -> None:
    """2 MB at 5 MB/s per peer takes >= ~0.4 s (never faster than the rate); telemetry
    reports the bytes, egress rate near the cap, utilisation of the capacity, RTT
    from TCP_INFO and no retransmissions on loopback."""
    rate = 5e6
    pair = await make_pair(
        SenderConfig(rate_bytes_per_s=rate, capacity_bytes_per_s=rate, chunk_bytes=65536)
    )
    loop = asyncio.get_running_loop()
    try:
        handle = pair.sender.open(3)
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 3, timeout_s=30)
        await transfer_ready(pair)
        start = loop.time()
        handle.send_layer(0, Kind.FULL_KV, {"x": np.zeros(2_000_000, np.uint8)})
        handle.finish()
        await transfer.complete()
        elapsed = loop.time() - start
        telemetry = pair.sender.telemetry()
        assert elapsed >= 0.37  # (2 MB - one burst) / 5 MB/s
        assert telemetry.bytes_total >= 2_000_000
        assert telemetry.capacity_bytes_per_s == rate
        assert telemetry.utilisation is not None and 0.1 < telemetry.utilisation <= 1.1
        assert telemetry.egress_bytes_per_s <= rate * 1.1
        assert telemetry.rtt_s is not None and telemetry.rtt_s > 0
        assert telemetry.retransmission_rate == 0.0 and telemetry.resent_bytes == 0
        assert len(telemetry.connections) == 4
        assert sum(c.bytes_sent for c in telemetry.connections) == telemetry.bytes_total
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def transfer_ready(pair: object) -> None:
    """Wait until the peer's connections are up, so timing excludes the handshake."""
    peers = pair.sender._peers  # type: ignore[attr-defined]
    await eventually(lambda: any(len(p.connections) == 4 for p in peers.values()))


async def test_added_delay_shifts_but_does_not_serialise() -> None:
    """delay_s=0.2: a transfer takes >= 0.2 s, but 10 pipelined layers still take about
    one delay, not ten (the delay is latency, not a rate limit)."""
    pair = await make_pair(SenderConfig(delay_s=0.2))
    loop = asyncio.get_running_loop()
    try:
        handle = pair.sender.open(4)
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 4, timeout_s=30)
        await transfer_ready(pair)
        start = loop.time()
        for layer in range(10):
            handle.send_layer(layer, Kind.LINEAR_STATE, {"s": np.ones(1000)})
        handle.finish()
        await transfer.complete()
        elapsed = loop.time() - start
        assert 0.2 <= elapsed < 1.5
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def test_process_rate_caps_all_peers_together() -> None:
    """Two decode peers share one process-wide 5 MB/s cap: 2 MB in total take >= ~0.37 s,
    and per-peer telemetry adds up."""
    pair = await make_pair(SenderConfig(process_rate_bytes_per_s=5e6, chunk_bytes=65536))
    second = KVReceiver()
    loop = asyncio.get_running_loop()
    try:
        handles = [pair.sender.open(room) for room in (1, 2)]
        transfers = [
            await receiver.fetch("127.0.0.1", pair.port, room, timeout_s=30)
            for receiver, room in ((pair.receiver, 1), (second, 2))
        ]
        await eventually(lambda: sum(len(p.connections) for p in pair.sender._peers.values()) == 8)
        start = loop.time()
        for handle in handles:
            handle.send_layer(0, Kind.FULL_KV, {"x": np.ones(1_000_000, np.uint8)})
            handle.finish()
        await asyncio.gather(*(t.complete() for t in transfers))
        assert loop.time() - start >= 0.37
        telemetry = pair.sender.telemetry()
        assert telemetry.peers == 2 and telemetry.capacity_bytes_per_s == 5e6
        assert len({c.peer for c in telemetry.connections}) == 2
    finally:
        await second.close()
        await pair.receiver.close()
        await pair.sender.close()

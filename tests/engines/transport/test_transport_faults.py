"""Faults: dropped connections, corruption, truncation, garbage, timeouts, aborts.

Each test uses real sockets; a frame-aware proxy between the two sides injects the damage.
The invariant everywhere: a transfer either delivers bit-exact data or raises
TransferError on both sides within its timeout; other transfers are not affected.
"""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest
from transport_helpers import (
    FrameProxy,
    Mutation,
    Pair,
    assert_same,
    eventually,
    make_pair,
    random_arrays,
)

from prfaas.engines.transport import (
    Kind,
    KVReceiver,
    LayerItem,
    ReceiverConfig,
    SenderConfig,
    SendHandle,
    TransferError,
)
from prfaas.engines.transport.frames import LAYER_KINDS, Header

pytestmark = pytest.mark.timeout(60)

PACED = SenderConfig(chunk_bytes=16384, window_bytes=131072, rate_bytes_per_s=8e6)


def _layers(seed: int, n: int = 6) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [random_arrays(rng, scale=60) for _ in range(n)]


def _send_all(handle: SendHandle, layers: list[dict[str, np.ndarray]]) -> None:
    for layer, arrays in enumerate(layers):
        handle.send_layer(layer, Kind.LINEAR_STATE, arrays)
    handle.finish()


def _check(result_layers: tuple[LayerItem, ...], layers: list[dict[str, np.ndarray]]) -> None:
    assert len(result_layers) == len(layers)
    for item, arrays in zip(result_layers, layers, strict=True):
        assert_same(arrays, item.arrays)


@pytest.mark.parametrize("side", ["sender", "receiver"])
async def test_connection_killed_mid_transfer_is_replaced_and_resent(side: str) -> None:
    """One (sender side) or every (receiver side) connection is reset mid-transfer: the
    receiver reconnects, the sender re-sends what was not acknowledged, data is exact."""
    pair = await make_pair(PACED)
    layers = _layers(1)
    try:
        handle = pair.sender.open(1)
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 1, timeout_s=30)
        _send_all(handle, layers)
        await eventually(lambda: transfer.nbytes > 200_000)
        peer = next(iter(pair.sender._peers.values()))
        link = next(iter(pair.receiver._links.values()))
        # kill at a moment some frames are in flight (so something must be re-sent)
        await eventually(lambda: bool(peer._unacked), timeout_s=10)
        if side == "sender":
            busy = next(iter(peer._unacked.values())).conn
            busy.writer.transport.abort()
        else:
            for conn in list(link.conns.values()):
                assert conn.transport is not None
                conn.transport.abort()
        result = await transfer.complete()
        await handle.wait()
        _check(result.layers, layers)
        assert transfer.failed is None and peer.resent_bytes > 0
        await eventually(lambda: len(peer.connections) == 4 and len(link.conns) == 4)
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def _proxied(mutate: Mutation) -> tuple[Pair, FrameProxy, int]:
    pair = await make_pair(PACED, ReceiverConfig(connect_timeout_s=2.0))
    proxy = FrameProxy(pair.port, mutate)
    return pair, proxy, await proxy.start()


def _one_shot(kind_of_damage: str, room: int, min_msg: int = 1) -> tuple[Mutation, list[Header]]:
    """A mutation that damages the first matching data frame of `room` once."""
    fired: list[Header] = []

    def mutate(header: Header, raw: bytes) -> tuple[bytes, bool]:
        hit = header.kind in LAYER_KINDS and header.room == room and header.msg >= min_msg
        if fired or not hit or header.length < 1000:
            return raw, False
        fired.append(header)
        if kind_of_damage == "corrupt":
            data = bytearray(raw)
            data[-100] ^= 0x01
            return bytes(data), False
        if kind_of_damage == "truncate":
            return raw[: 64 + header.length // 2], True
        return np.random.default_rng(0).bytes(len(raw)), False  # garbage

    return mutate, fired


async def test_corrupted_byte_fails_that_room_only_and_hands_over_nothing_bad() -> None:
    """One flipped payload bit in room 1's 3rd layer: room 1 fails on both sides with a
    checksum error and never yields that layer; room 2 on the same connections is exact."""
    mutate, fired = _one_shot("corrupt", room=1, min_msg=2)
    pair, proxy, port = await _proxied(mutate)
    layers1, layers2 = _layers(2), _layers(3)
    try:
        h1, h2 = pair.sender.open(1), pair.sender.open(2)
        t1 = await pair.receiver.fetch("127.0.0.1", port, 1, timeout_s=30)
        t2 = await pair.receiver.fetch("127.0.0.1", port, 2, timeout_s=30)
        _send_all(h1, layers1)
        _send_all(h2, layers2)
        seen = []
        with pytest.raises(TransferError, match="checksum mismatch in message 2"):
            async for item in t1:
                seen.append(item.layer)
        assert seen in ([], [0], [0, 1])  # only layers before the damage, never layer 2
        with pytest.raises(TransferError, match="decode side failed the transfer: checksum"):
            await h1.wait()
        _check((await t2.complete()).layers, layers2)
        await h2.wait()
        assert len(fired) == 1
    finally:
        await pair.receiver.close()
        await pair.sender.close()
        await proxy.close()


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
async def test_truncated_or_garbage_frame_drops_the_connection_and_recovers(damage: str) -> None:
    """A frame cut short (then EOF) or replaced by garbage kills only its connection; the
    receiver reconnects and the sender re-sends: the transfer is still bit-exact."""
    mutate, fired = _one_shot(damage, room=5)
    pair, proxy, port = await _proxied(mutate)
    layers = _layers(4)
    try:
        handle = pair.sender.open(5)
        transfer = await pair.receiver.fetch("127.0.0.1", port, 5, timeout_s=30)
        _send_all(handle, layers)
        _check((await transfer.complete()).layers, layers)
        await handle.wait()
        assert len(fired) == 1 and proxy.connections > 4  # a connection was replaced
    finally:
        await pair.receiver.close()
        await pair.sender.close()
        await proxy.close()


async def test_garbage_on_the_bootstrap_port_is_dropped() -> None:
    """Non-protocol clients (HTTP, bad HELLO) are disconnected; transfers go on."""
    pair = await make_pair()
    try:
        for junk in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(64), bytes(64)):
            reader, writer = await asyncio.open_connection("127.0.0.1", pair.port)
            writer.write(junk)
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the sender
            writer.close()
        handle = pair.sender.open(3)
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 3, timeout_s=10)
        _send_all(handle, _layers(5, n=2))
        _check((await transfer.complete()).layers, _layers(5, n=2))
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def test_prefill_room_nobody_fetches_times_out() -> None:
    """Never-arriving decode peer: the sender's wait() fails after register_timeout_s."""
    pair = await make_pair(SenderConfig(register_timeout_s=0.3))
    try:
        handle = pair.sender.open(8)
        handle.send_layer(0, Kind.FULL_KV, {"k": np.zeros(4)})
        with pytest.raises(TransferError, match="room 8: no decode peer registered within"):
            await handle.wait()
        assert pair.sender.telemetry().active_transfers == 0
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def test_decode_room_never_opened_fails_on_the_decode_side() -> None:
    """Unknown room at the prefill side: the parked registration expires with a reason."""
    pair = await make_pair(SenderConfig(register_timeout_s=0.3))
    try:
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 9, timeout_s=20)
        with pytest.raises(TransferError, match="room 9: room was not opened on the prefill"):
            await transfer.complete()
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def test_unreachable_sender_times_out_with_the_cause() -> None:
    receiver = KVReceiver()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connection refused
        try:
            transfer = await receiver.fetch("127.0.0.1", port, 1, timeout_s=0.5)
            with pytest.raises(TransferError, match=r"timed out after 0.5 s.*Connection"):
                await transfer.complete()
        finally:
            await receiver.close()


async def test_transfer_that_never_finishes_fails_on_both_sides() -> None:
    pair = await make_pair()
    try:
        handle = pair.sender.open(4)
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 4, timeout_s=0.5)
        handle.send_layer(0, Kind.FULL_KV, {"k": np.zeros(4)})  # ... and never finish()
        with pytest.raises(TransferError, match=r"timed out after 0\.5 s with 1 messages"):
            await transfer.complete()
        with pytest.raises(TransferError, match="decode side failed the transfer: timed out"):
            await handle.wait()
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def test_abort_and_cancel_propagate() -> None:
    """Prefill abort -> decode raises with the reason; decode cancel -> prefill raises."""
    pair = await make_pair()
    try:
        h1, h2 = pair.sender.open(1), pair.sender.open(2)
        t1 = await pair.receiver.fetch("127.0.0.1", pair.port, 1, timeout_s=10)
        t2 = await pair.receiver.fetch("127.0.0.1", pair.port, 2, timeout_s=10)
        h1.send_layer(0, Kind.FULL_KV, {"k": np.zeros(4)})
        h1.abort("out of KV memory")
        with pytest.raises(TransferError, match="aborted by prefill: out of KV memory"):
            await t1.complete()
        with pytest.raises(TransferError, match="aborted by prefill"):
            await h1.wait()
        t2.cancel("decode instance draining")
        with pytest.raises(TransferError, match="decode instance draining"):
            await h2.wait()
        h2.send_layer(0, Kind.FULL_KV, {"k": np.zeros(4)})  # late sends are dropped quietly
        with pytest.raises(TransferError, match="draining"):
            await t2.complete()
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def test_sender_crash_fails_the_receiver_cleanly() -> None:
    """The prefill process vanishes (listener and connections gone, no ABORT sent): the
    decode side fails after connect_timeout_s instead of hanging."""
    pair = await make_pair(PACED, ReceiverConfig(connect_timeout_s=0.5))
    try:
        handle = pair.sender.open(6)
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 6, timeout_s=30)
        _send_all(handle, _layers(6))
        await eventually(lambda: transfer.nbytes > 0)
        for server in pair.sender._servers:
            server.close()
        for peer in pair.sender._peers.values():
            for conn in list(peer.connections.values()):
                conn.writer.transport.abort()
        with pytest.raises(TransferError, match=r"lost the connections to sender .* could not"):
            await transfer.complete()
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def test_receiver_gone_fails_the_sender_cleanly() -> None:
    """The decode process closes mid-transfer: the sender's wait() raises, no hang."""
    pair = await make_pair(
        SenderConfig(peer_timeout_s=0.5, chunk_bytes=16384, rate_bytes_per_s=4e6)
    )
    try:
        handle = pair.sender.open(7)
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 7, timeout_s=30)
        _send_all(handle, _layers(7))
        await eventually(lambda: transfer.nbytes > 0)
        await pair.receiver.close()
        with pytest.raises(TransferError, match=r"receiver closed|decode peer lost"):
            await handle.wait()
        await eventually(lambda: pair.sender.telemetry().peers == 0)
    finally:
        await pair.sender.close()

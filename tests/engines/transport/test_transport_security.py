"""The bootstrap port against an attacker and a bad day: the handshake's HMAC keeps a client
without the key out of every slot, and each table an outsider can grow stays bounded
(parked rooms, queued control frames, handshakes, idle connections); reconnects re-send at
most the lost window and never charge the pacing bucket twice. Real sockets throughout."""

from __future__ import annotations

import asyncio
import secrets

import numpy as np
import pytest
from transport_helpers import assert_same, eventually, make_pair, random_arrays

from prfaas.engines.transport import Kind, KVSender, ReceiverConfig, SenderConfig, TransferError
from prfaas.engines.transport.frames import make_frame
from prfaas.engines.transport.handshake import Hello, auth_frame, check_welcome
from prfaas.engines.transport.wire import json_frame, read_frame, write_frame

pytestmark = pytest.mark.timeout(60)

KEY = b"k" * 32
PACED = SenderConfig(
    chunk_bytes=16384, window_bytes=131072, process_rate_bytes_per_s=4e6, auth_key=KEY
)


def _layers(seed: int, n: int = 6) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [random_arrays(rng, scale=60) for _ in range(n)]


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def _closed_by_peer(reader: asyncio.StreamReader, within_s: float) -> bool:
    """Whether the other side closes the connection within `within_s` (frames are read
    and dropped meanwhile)."""
    try:
        async with asyncio.timeout(within_s):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return False
    except ConnectionError:
        return True
    return True


async def _authenticated(port: int, key: bytes, peer: str) -> asyncio.StreamWriter:
    """A raw client that completes the handshake for slot 0 with `key`."""
    reader, writer = await _connect(port)
    hello = Hello(peer, 0, secrets.token_hex(16))
    write_frame(writer, hello.frame())
    settings = check_welcome(hello, key, *await read_frame(reader, 1 << 20))
    write_frame(writer, auth_frame(hello, key, settings["nonce"]))
    await writer.drain()
    return writer


async def test_a_hello_naming_a_live_peer_cannot_take_its_slot() -> None:
    """Finding 1: a client that learned the decode peer's id (it was on `/transfer_stats`)
    HELLOs as that peer on every slot, again and again, during a paced transfer. Without the
    key its AUTH fails and it is cut off: no slot is replaced, nothing is re-sent, the
    transfer is exact."""
    pair = await make_pair(PACED, ReceiverConfig(auth_key=KEY))
    layers = _layers(1)
    try:
        handle = pair.sender.open(1)
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 1, timeout_s=30)
        for i, arrays in enumerate(layers):
            handle.send_layer(i, Kind.LINEAR_STATE, arrays)
        handle.finish()
        await eventually(lambda: len(pair.sender.telemetry().connections) == 4)
        peer = pair.sender.telemetry().connections[0].peer
        refused = 0
        while not transfer.finished:
            for index in range(4):
                reader, writer = await _connect(pair.port)
                fake = {"peer": peer, "index": index, "nonce": secrets.token_hex(16)}
                write_frame(writer, json_frame(Kind.HELLO, 0, fake))
                write_frame(writer, json_frame(Kind.AUTH, 0, {"proof": "0" * 64}))
                write_frame(writer, make_frame(Kind.CANCEL, 1, [b"hijacked"]))
                refused += await _closed_by_peer(reader, 2.0)
                writer.close()
        result = await transfer.complete()
        await handle.wait()
        for item, arrays in zip(result.layers, layers, strict=True):
            assert_same(arrays, item.arrays)
        telemetry = pair.sender.telemetry()
        assert refused >= 4 and telemetry.handshake_failures >= refused
        assert telemetry.resent_bytes == 0 and telemetry.peers == 1
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def test_a_receiver_without_the_key_gets_nothing() -> None:
    """A decode side holding another key never completes a handshake: its fetch fails at
    its timeout naming the mismatch, and the prefill's room is not bound to it."""
    pair = await make_pair(SenderConfig(auth_key=KEY, register_timeout_s=1.0),
                           ReceiverConfig(auth_key=b"x" * 32))  # fmt: skip
    try:
        handle = pair.sender.open(2)
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 2, timeout_s=1.0)
        with pytest.raises(TransferError, match="WELCOME proof does not match"):
            await transfer.complete()
        with pytest.raises(TransferError, match="no decode peer registered"):
            await handle.wait()
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def test_register_floods_and_unread_replies_stay_bounded() -> None:
    """Finding 2: a peer (even one holding the key) that REGISTERs thousands of rooms
    nobody opens and never reads the replies: at most `max_parked_rooms` are parked, the
    rest are refused, and its queue of control frames never passes `max_control_frames`."""
    config = SenderConfig(auth_key=KEY, max_parked_rooms=100, max_control_frames=50)
    sender = KVSender(config)
    await sender.start()
    try:
        writer = await _authenticated(sender.bootstrap_port, KEY, "flood")
        writer.transport.pause_reading()  # type: ignore[attr-defined]  # never read replies
        for room in range(1, 20_001):
            write_frame(writer, make_frame(Kind.REGISTER, room, []))
        await writer.drain()
        await eventually(lambda: sender.telemetry().parked_refused == 19_900, timeout_s=20)
        telemetry = sender.telemetry()
        assert telemetry.parked_rooms == 100
        peer = sender._peers["flood"]
        assert len(peer._control) <= 50
        writer.close()
    finally:
        await sender.close()


async def test_a_silent_connection_is_closed() -> None:
    """Finding 2: a connection that sends HELLO and then nothing is closed after the
    handshake timeout; an authenticated one that stays idle with no room is closed after
    the idle timeout; an unauthenticated REGISTER parks nothing."""
    config = SenderConfig(auth_key=KEY, handshake_timeout_s=0.3, idle_timeout_s=0.4)
    sender = KVSender(config)
    await sender.start()
    try:
        reader, writer = await _connect(sender.bootstrap_port)
        hello = Hello("p" * 32, 0, secrets.token_hex(16))
        write_frame(writer, hello.frame())
        write_frame(writer, make_frame(Kind.REGISTER, 7, []))  # before any AUTH
        assert await _closed_by_peer(reader, 2.0)
        writer.close()
        assert sender.telemetry().parked_rooms == 0
        authed = await _authenticated(sender.bootstrap_port, KEY, "idle")
        await eventually(lambda: sender.telemetry().peers == 1)
        await eventually(lambda: not sender.telemetry().connections, timeout_s=3)
        authed.close()
    finally:
        await sender.close()


async def test_a_handshake_flood_does_not_keep_a_real_peer_out() -> None:
    """Hundreds of connections that never finish a handshake: the oldest are cut past
    `max_handshakes`, so the real decode peer still gets in and its transfer is exact."""
    config = SenderConfig(auth_key=KEY, max_handshakes=16, handshake_timeout_s=2.0)
    pair = await make_pair(config, ReceiverConfig(auth_key=KEY))
    idle = [await _connect(pair.port) for _ in range(200)]
    layers = _layers(3, n=3)
    try:
        handle = pair.sender.open(3)
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 3, timeout_s=20)
        for i, arrays in enumerate(layers):
            handle.send_layer(i, Kind.LINEAR_STATE, arrays)
        handle.finish()
        result = await transfer.complete()
        for item, arrays in zip(result.layers, layers, strict=True):
            assert_same(arrays, item.arrays)
        assert pair.sender.telemetry().handshake_failures >= 200 - 16
    finally:
        for _, writer in idle:
            writer.close()
        await pair.receiver.close()
        await pair.sender.close()


async def test_a_reconnect_storm_charges_each_frame_once() -> None:
    """Every connection of the real peer is reset five times during a paced transfer: each
    reset re-sends at most the unacknowledged window, the re-sends are not charged to the
    token bucket again, and the data is exact."""
    pair = await make_pair(PACED, ReceiverConfig(auth_key=KEY))
    layers = _layers(4)
    try:
        handle = pair.sender.open(4)
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 4, timeout_s=40)
        for i, arrays in enumerate(layers):
            handle.send_layer(i, Kind.LINEAR_STATE, arrays)
        handle.finish()
        link = next(iter(pair.receiver._links.values()))
        resets = 0
        while resets < 5 and not transfer.finished:
            await eventually(lambda: len(link.conns) == 4 or transfer.finished, timeout_s=10)
            await asyncio.sleep(0.05)
            for conn in list(link.conns.values()):
                assert conn.transport is not None
                conn.transport.abort()
            resets += 1
        result = await transfer.complete()
        await handle.wait()
        for item, arrays in zip(result.layers, layers, strict=True):
            assert_same(arrays, item.arrays)
        telemetry = pair.sender.telemetry()
        assert resets >= 3 and telemetry.resent_bytes > 0
        assert telemetry.resent_bytes <= resets * PACED.window_bytes
        assert telemetry.paced_bytes == result.nbytes  # every payload byte charged once
    finally:
        await pair.receiver.close()
        await pair.sender.close()

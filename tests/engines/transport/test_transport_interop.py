"""A minimal independent sender built from PROTOCOL.md's frames talks to the real receiver:
the authenticated handshake (with and without a key), an unknown room, a bad message, and
a good transfer on one connection."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import secrets
from collections.abc import Awaitable, Callable

import orjson
import pytest

from prfaas.engines.transport import Kind, KVReceiver, ReceiverConfig, TransferError
from prfaas.engines.transport.frames import Frame, make_frame, split_message
from prfaas.engines.transport.payload import encode_named
from prfaas.engines.transport.wire import parse_ack, parse_json, read_frame, write_frame

pytestmark = pytest.mark.timeout(30)
Script = Callable[[asyncio.StreamWriter], Awaitable[None]]


def _proof(key: bytes, *parts: str) -> str:
    """PROTOCOL.md's handshake proof: HMAC-SHA256 over the parts joined by `|`."""
    return hmac.new(key, "|".join(parts).encode(), hashlib.sha256).hexdigest()


class FakeSender:
    """Accepts connections, runs the handshake (HELLO, WELCOME(connections=1) with its proof,
    AUTH checked) with `key`, then runs `script`; records every frame the receiver sends
    after the handshake (kind, room, payload)."""

    def __init__(self, script: Script, key: bytes = b"") -> None:
        self.script, self.key = script, key
        self.seen: list[tuple[Kind, int, bytes]] = []
        self.registered = asyncio.Event()
        self.authenticated = False

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # a connection handler that ends quietly when the test tears the loop down
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await self._handle(reader, writer)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        header, payload = await read_frame(reader, 1 << 20)
        hello = parse_json(header, payload)
        assert header.kind is Kind.HELLO and hello["index"] == 0 and len(hello["nonce"]) == 32
        rn, sn, peer = hello["nonce"], secrets.token_hex(16), hello["peer"]
        proof = _proof(self.key, "prfaas-kv S", rn, sn, peer, "0")
        welcome = {"connections": 1, "nonce": sn, "proof": proof}
        write_frame(writer, make_frame(Kind.WELCOME, 0, [orjson.dumps(welcome)]))
        try:
            header, payload = await read_frame(reader, 1 << 20)
        except asyncio.IncompleteReadError:  # the receiver refused our proof
            writer.close()
            return
        assert header.kind is Kind.AUTH
        expected = _proof(self.key, "prfaas-kv R", sn, rn, peer, "0")
        self.authenticated = parse_json(header, payload)["proof"] == expected
        if not self.authenticated:
            writer.close()
            return
        reading = asyncio.create_task(self._read(reader))
        await self.registered.wait()
        await self.script(writer)
        await asyncio.sleep(0.3)  # let the receiver answer
        reading.cancel()
        writer.close()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                header, payload = await read_frame(reader, 1 << 20)
                self.seen.append((header.kind, header.room, payload))
                if header.kind is Kind.REGISTER:
                    self.registered.set()


def _message(
    kind: Kind, room: int, msg: int, desc: dict[str, object], data: bytes = b""
) -> list[Frame]:
    return split_message(kind, room, msg, 0xFFFFFFFF, encode_named(desc, data), 4096)


async def _serve(fake: FakeSender) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_independent_sender_unknown_room_and_a_good_transfer() -> None:
    async def script(writer: asyncio.StreamWriter) -> None:
        for frame in _message(Kind.AUX, 777, 0, {"name": "stray"}, b"x"):  # nobody fetches 777
            write_frame(writer, frame)
        for frame in _message(Kind.AUX, 1, 0, {"name": "first_token"}, b"\x2a"):
            write_frame(writer, frame)
        for frame in _message(Kind.END, 1, 1, {"messages": 2}):
            write_frame(writer, frame)

    fake = FakeSender(script)
    server, port = await _serve(fake)
    receiver = KVReceiver()
    try:
        transfer = await receiver.fetch("127.0.0.1", port, 1, timeout_s=10)
        result = await transfer.complete()
        assert result.aux == {"first_token": b"\x2a"} and result.layers == ()
        await asyncio.sleep(0.2)
        kinds = [(kind, room) for kind, room, _ in fake.seen]
        assert (Kind.DONE, 1) in kinds
        cancels = [payload for kind, room, payload in fake.seen if kind is Kind.CANCEL]
        assert cancels == [b"unknown room on the decode side"]
        acked = [key for kind, _, p in fake.seen if kind is Kind.ACK for key in parse_ack(p)]
        assert sorted(acked) == [(1, 0, 0), (1, 1, 0), (777, 0, 0)]
    finally:
        await receiver.close()
        server.close()


async def test_independent_sender_wrong_end_count_fails_the_room() -> None:
    """END announcing 5 messages as message 0: the room fails, CANCEL names the cause."""

    async def script(writer: asyncio.StreamWriter) -> None:
        for frame in _message(Kind.END, 3, 0, {"messages": 5}):
            write_frame(writer, frame)

    fake = FakeSender(script)
    server, port = await _serve(fake)
    receiver = KVReceiver()
    try:
        transfer = await receiver.fetch("127.0.0.1", port, 3, timeout_s=10)
        with pytest.raises(TransferError, match="END announces 5 messages but is message 1"):
            await transfer.complete()
        await asyncio.sleep(0.2)
        assert any(k is Kind.CANCEL and room == 3 for k, room, _ in fake.seen)
    finally:
        await receiver.close()
        server.close()


async def test_independent_sender_handshake_with_a_key() -> None:
    """With a shared key the receiver's AUTH matches PROTOCOL.md's formula; with another
    key the receiver refuses the sender's WELCOME and never registers the room."""

    async def script(writer: asyncio.StreamWriter) -> None:
        for frame in _message(Kind.END, 4, 0, {"messages": 1}):
            write_frame(writer, frame)

    fake = FakeSender(script, key=b"k" * 32)
    server, port = await _serve(fake)
    receiver = KVReceiver(ReceiverConfig(auth_key=b"k" * 32))
    try:
        transfer = await receiver.fetch("127.0.0.1", port, 4, timeout_s=10)
        assert (await transfer.complete()).layers == ()
        assert fake.authenticated
    finally:
        await receiver.close()
    stranger = KVReceiver(ReceiverConfig(auth_key=b"x" * 32, connect_timeout_s=0.5))
    fake.registered.clear()
    try:
        transfer = await stranger.fetch("127.0.0.1", port, 5, timeout_s=1.0)
        with pytest.raises(TransferError, match="WELCOME proof does not match"):
            await transfer.complete()
        assert not fake.registered.is_set()
    finally:
        await stranger.close()
        server.close()

"""Receiver reassembly without sockets: frames of many messages in random order, with
duplicates, are released exactly once, in send order, bit-exact; damage fails the room."""

from __future__ import annotations

import numpy as np
import pytest
from transport_helpers import assert_same, layer_kind, random_arrays

from prfaas.engines.transport import Kind, TransferError
from prfaas.engines.transport.frames import NO_LAYER, Frame, split_message, unpack_header
from prfaas.engines.transport.payload import encode_arrays, encode_named
from prfaas.engines.transport.receiver_transfer import Transfer
from prfaas.engines.transport.wire import verify


class Owner:
    """A TransferOwner that records what the transfer tells its connection pool."""

    max_message_bytes = 1 << 30

    def __init__(self) -> None:
        self.done: list[int] = []
        self.cancelled: list[str] = []
        self.buffered = 0

    def send_done(self, room: int) -> None:
        self.done.append(room)

    def send_cancel(self, room: int, reason: str) -> None:
        self.cancelled.append(reason)

    def forget(self, room: int) -> None:
        pass

    def buffer_changed(self, delta: int) -> None:
        self.buffered += delta

    def describe(self) -> str:
        return "test"


def _frames(
    rng: np.random.Generator, room: int, chunk: int
) -> tuple[list[Frame], list[dict[str, np.ndarray]]]:
    layers = [
        random_arrays(rng, scale=int(rng.integers(1, 30))) for _ in range(int(rng.integers(1, 8)))
    ]
    frames: list[Frame] = []
    msg = 0
    for layer, arrays in enumerate(layers):
        pieces = encode_arrays(arrays, (layer, layer + 1))
        frames += split_message(layer_kind(layer), room, msg, layer, pieces, chunk)
        msg += 1
    frames += split_message(Kind.AUX, room, msg, NO_LAYER, encode_named({"name": "t"}, b"7"), chunk)
    frames += split_message(
        Kind.END, room, msg + 1, NO_LAYER, encode_named({"messages": msg + 2}), chunk
    )
    return frames, layers


def _feed(transfer: Transfer, frame: Frame, corrupt: bool = False) -> None:
    """What ReceiverLink does with one arriving frame."""
    header = unpack_header(frame.header, 1 << 30)
    payload = bytearray(b"".join(bytes(p) for p in frame.pieces))
    if corrupt:
        payload[len(payload) // 2] ^= 0x40
    slot = transfer.slot(header)
    if slot is not None:
        slot[:] = payload
    if transfer.needs(header):
        transfer.frame_done(header, verify(header, bytes(payload)))


@pytest.mark.parametrize("seed", range(40))
async def test_random_arrival_order_with_duplicates(seed: int) -> None:
    rng = np.random.default_rng(seed)
    frames, layers = _frames(rng, room=seed, chunk=int(rng.choice([64, 500, 4096, 1 << 20])))
    order = list(rng.permutation(len(frames)))
    order += list(rng.choice(len(frames), size=len(frames) // 3))  # re-sent duplicates
    owner = Owner()
    transfer = Transfer(seed, owner, timeout_s=30)
    for i in order:
        _feed(transfer, frames[int(i)])
    result = await transfer.complete()
    assert [item.layer for item in result.layers] == list(range(len(layers)))
    for item, arrays in zip(result.layers, layers, strict=True):
        assert item.kind is layer_kind(item.layer) and item.arrays.blocks == (
            item.layer,
            item.layer + 1,
        )
        assert_same(arrays, item.arrays)
    assert result.aux == {"t": b"7"} and owner.done == [seed] and owner.cancelled == []
    assert owner.buffered == 0


@pytest.mark.parametrize("seed", range(10))
async def test_one_damaged_frame_fails_the_room_and_releases_nothing_after(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    frames, _ = _frames(rng, room=1, chunk=512)
    bad = int(rng.integers(len(frames)))
    owner = Owner()
    transfer = Transfer(1, owner, timeout_s=30)
    taken = []
    for i, frame in enumerate(frames):
        _feed(transfer, frame, corrupt=i == bad)
        if transfer.failed is None:
            taken += list(transfer._items)  # what a consumer could have taken so far
    with pytest.raises(TransferError, match="checksum mismatch"):
        await transfer.complete()
    assert owner.done == [] and len(owner.cancelled) == 1 and owner.buffered == 0
    bad_msg = unpack_header(frames[bad].header, 1 << 30).msg
    assert all(item.layer < bad_msg for item in taken)

"""Frame layout of the KV transport wire protocol (see PROTOCOL.md for the byte table).

Every frame is a 64-byte little-endian header followed by `length` payload bytes. The
header names the transfer (`room`), the message ordinal within it (`msg`), the model
`layer`, which part of the message this is (`part` of `parts`, at byte `offset` of a
`total`-byte message, so a receiver can place it without copying), and the xxh3-64 of the
payload; its own last 4 bytes check the first 60, so garbage never passes as a frame.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from prfaas.engines.transport.errors import ProtocolError

MAGIC = b"PKV1"
VERSION = 1
HEADER = struct.Struct("<4sBBHQIIIIQQIQI")
HEADER_SIZE = HEADER.size  # 64
CHECKED = HEADER_SIZE - 4
NO_LAYER = 0xFFFFFFFF


class Kind(enum.IntEnum):
    """Frame kinds. 1-15 control, 16+ transfer data (see PROTOCOL.md)."""

    HELLO = 1  # receiver -> sender, first frame of every connection
    WELCOME = 2  # sender -> receiver, answer to HELLO
    REGISTER = 3  # receiver -> sender: fetch this room over this peer's connections
    ACK = 4  # receiver -> sender: these (room, msg, part) frames arrived
    DONE = 5  # receiver -> sender: room delivered and verified
    CANCEL = 6  # receiver -> sender: room failed or given up (payload: reason)
    AUTH = 7  # receiver -> sender: the handshake's proof (answer to WELCOME)
    FULL_KV = 16  # full-attention KV of a layer (a block range of pages)
    LINEAR_STATE = 17  # linear-attention conv/recurrent state of a layer
    SWA_KV = 18  # sliding-window attention KV of a layer
    AUX = 19  # named bytes: first token, metadata
    END = 20  # last message of a transfer: total message count
    ABORT = 21  # sender gave up the room (payload: reason)


LAYER_KINDS = frozenset({Kind.FULL_KV, Kind.LINEAR_STATE, Kind.SWA_KV})


@dataclass(frozen=True, slots=True)
class Header:
    """A decoded, validated frame header."""

    kind: Kind
    room: int
    msg: int
    layer: int
    part: int
    parts: int
    offset: int
    total: int
    length: int
    checksum: int


def _head_check(head: bytes) -> int:
    return xxhash.xxh3_64_intdigest(head) & 0xFFFFFFFF


def checksum(pieces: Sequence[bytes | memoryview]) -> int:
    """xxh3-64 of the concatenation of `pieces`."""
    h = xxhash.xxh3_64()
    for piece in pieces:
        h.update(piece)
    return h.intdigest()


def pack_header(
    kind: Kind,
    room: int,
    msg: int,
    layer: int,
    part: tuple[int, int],
    span: tuple[int, int, int],
    sum64: int,
) -> bytes:
    """Encode a header: `part` is (part, parts), `span` is (offset, total, length)."""
    head = HEADER.pack(MAGIC, VERSION, kind, 0, room, msg, layer, *part, *span, sum64, 0)
    return head[:CHECKED] + _head_check(head[:CHECKED]).to_bytes(4, "little")


def unpack_header(data: bytes | bytearray, max_length: int) -> Header:
    """Decode and validate a 64-byte header.

    Raises:
        ProtocolError: bad magic, version, header check, kind, part numbering or length.
    """
    fields = HEADER.unpack(data)
    magic, version, kind, _flags, room, msg, layer, part, parts = fields[:9]
    offset, total, length, sum64, check = fields[9:]
    if magic != MAGIC:
        tls = magic[:2] == b"\x16\x03"  # a TLS handshake record (ClientHello)
        hint = " (a TLS handshake: the peer uses transport TLS, this end does not)" if tls else ""
        raise ProtocolError(f"bad magic {magic!r}, expected {MAGIC!r}{hint}")
    if check != _head_check(bytes(data[:CHECKED])):
        raise ProtocolError("header check mismatch (corrupted or garbage header)")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version}, expected {VERSION}")
    try:
        kind_ = Kind(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None
    if parts == 0 or part >= parts:
        raise ProtocolError(f"bad part {part} of {parts}")
    if length > max_length:
        raise ProtocolError(f"frame length {length} exceeds the limit {max_length}")
    if offset + length > total:
        raise ProtocolError(
            f"frame bytes {offset}..{offset + length} overrun the message ({total})"
        )
    return Header(kind_, room, msg, layer, part, parts, offset, total, length, sum64)


@dataclass(slots=True)
class Frame:
    """An outgoing frame: packed header plus payload pieces (views, not copies)."""

    kind: Kind
    room: int
    msg: int
    part: int
    header: bytes
    pieces: list[bytes | memoryview]
    length: int

    @property
    def key(self) -> tuple[int, int, int]:
        """(room, msg, part): unique per frame of a transfer; what ACK names."""
        return (self.room, self.msg, self.part)


def make_frame(
    kind: Kind, room: int, pieces: list[bytes | memoryview], *, msg: int = 0, layer: int = NO_LAYER
) -> Frame:
    """A single-part frame (control frames, small messages)."""
    length = sum(len(p) for p in pieces)
    header = pack_header(kind, room, msg, layer, (0, 1), (0, length, length), checksum(pieces))
    return Frame(kind, room, msg, 0, header, pieces, length)


def split_message(
    kind: Kind,
    room: int,
    msg: int,
    layer: int,
    pieces: Sequence[bytes | memoryview],
    chunk_bytes: int,
) -> list[Frame]:
    """Split one message (the concatenation of `pieces`) into frames of <= chunk_bytes."""
    chunks: list[list[bytes | memoryview]] = [[]]
    room_left = chunk_bytes
    for piece in pieces:
        view = memoryview(piece).cast("B")
        while len(view):
            if room_left == 0:
                chunks.append([])
                room_left = chunk_bytes
            take = view[:room_left]
            chunks[-1].append(take)
            room_left -= len(take)
            view = view[len(take) :]
    total = sum(memoryview(p).nbytes for p in pieces)
    frames = []
    offset = 0
    for part, chunk in enumerate(chunks):
        length = sum(len(p) for p in chunk)
        span = (offset, total, length)
        header = pack_header(kind, room, msg, layer, (part, len(chunks)), span, checksum(chunk))
        frames.append(Frame(kind, room, msg, part, header, chunk, length))
        offset += length
    return frames

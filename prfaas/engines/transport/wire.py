"""Reading and writing frames on asyncio streams, and the control-frame payloads."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import orjson

from prfaas.engines.transport.errors import ProtocolError
from prfaas.engines.transport.frames import (
    HEADER_SIZE,
    Frame,
    Header,
    Kind,
    checksum,
    make_frame,
    unpack_header,
)

ACK_ENTRY = struct.Struct("<QII")  # room, msg, part
CONTROL_MAX = 1 << 20


async def read_frame(reader: asyncio.StreamReader, max_length: int) -> tuple[Header, bytes]:
    """Read one frame (checksum NOT verified: a bad payload fails only its room).

    Raises:
        asyncio.IncompleteReadError: the stream ended mid-frame (truncation) or before one.
        ProtocolError: the header is invalid (garbage, bad length).
    """
    header = unpack_header(await reader.readexactly(HEADER_SIZE), max_length)
    payload = await reader.readexactly(header.length) if header.length else b""
    return header, payload


def write_frame(writer: asyncio.StreamWriter, frame: Frame) -> int:
    """Queue a frame on the transport; returns the bytes written (header included)."""
    writer.write(frame.header)
    for piece in frame.pieces:
        writer.write(piece)
    return HEADER_SIZE + frame.length


def json_frame(kind: Kind, room: int, body: dict[str, Any]) -> Frame:
    """A control frame with a JSON object payload."""
    return make_frame(kind, room, [orjson.dumps(body)])


def parse_json(header: Header, payload: bytes) -> dict[str, Any]:
    """The JSON object payload of a control frame; ProtocolError if malformed."""
    if header.length > CONTROL_MAX:
        raise ProtocolError(f"control frame {header.kind.name} of {header.length} bytes")
    try:
        body = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"{header.kind.name} payload is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"{header.kind.name} payload is not a JSON object")
    return body


def ack_frame(keys: list[tuple[int, int, int]]) -> Frame:
    """ACK naming the (room, msg, part) of received frames."""
    return make_frame(Kind.ACK, 0, [b"".join(ACK_ENTRY.pack(*key) for key in keys)])


def parse_ack(payload: bytes) -> list[tuple[int, int, int]]:
    """Keys of an ACK payload; ProtocolError if its size is not a multiple of 16."""
    if len(payload) % ACK_ENTRY.size:
        raise ProtocolError(f"ACK payload of {len(payload)} bytes is not a multiple of 16")
    return [ACK_ENTRY.unpack_from(payload, i) for i in range(0, len(payload), ACK_ENTRY.size)]


def reason_frame(kind: Kind, room: int, reason: str) -> Frame:
    """CANCEL / ABORT carrying a UTF-8 reason."""
    return make_frame(kind, room, [reason.encode("utf-8", "replace")[:4096]])


def verify(header: Header, payload: bytes | memoryview) -> bool:
    """Whether the payload matches the header's xxh3-64."""
    return checksum([payload]) == header.checksum

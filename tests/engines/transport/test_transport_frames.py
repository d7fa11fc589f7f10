"""Frame headers, message splitting, array payloads and config validation (no sockets)."""

from __future__ import annotations

import numpy as np
import pytest
from transport_helpers import SPECS, assert_same, random_arrays

from prfaas.engines.transport import Kind, ProtocolError, ReceiverConfig, SenderConfig
from prfaas.engines.transport.frames import (
    HEADER_SIZE,
    checksum,
    make_frame,
    pack_header,
    split_message,
    unpack_header,
)
from prfaas.engines.transport.payload import decode_arrays, encode_arrays, split_body


def _join(frame_pieces: list[bytes | memoryview]) -> bytes:
    return b"".join(bytes(p) for p in frame_pieces)


def test_header_round_trip_is_exact() -> None:
    """Every field survives pack/unpack, and the header is 64 bytes."""
    head = pack_header(Kind.FULL_KV, 2**64 - 1, 7, 41, (2, 5), (100, 500, 100), 0xDEADBEEF)
    assert len(head) == HEADER_SIZE == 64
    h = unpack_header(head, 1000)
    assert (h.kind, h.room, h.msg, h.layer, h.part, h.parts) == (
        Kind.FULL_KV,
        2**64 - 1,
        7,
        41,
        2,
        5,
    )
    assert (h.offset, h.total, h.length, h.checksum) == (100, 500, 100, 0xDEADBEEF)


@pytest.mark.parametrize("position", range(HEADER_SIZE))
def test_any_flipped_header_byte_is_rejected(position: int) -> None:
    """Garbage never passes as a header: a single flipped bit anywhere is a ProtocolError."""
    head = bytearray(pack_header(Kind.AUX, 3, 0, 0, (0, 1), (0, 10, 10), 1))
    head[position] ^= 0x10
    with pytest.raises(ProtocolError):
        unpack_header(bytes(head), 1000)


def test_header_limits() -> None:
    """Oversized frames, bad part numbers and overrunning spans are rejected with a reason."""
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        unpack_header(pack_header(Kind.AUX, 1, 0, 0, (0, 1), (0, 5000, 5000), 0), 4096)
    with pytest.raises(ProtocolError, match="bad part"):
        unpack_header(pack_header(Kind.AUX, 1, 0, 0, (3, 3), (0, 10, 10), 0), 4096)
    with pytest.raises(ProtocolError, match="overrun"):
        unpack_header(pack_header(Kind.AUX, 1, 0, 0, (0, 1), (8, 10, 10), 0), 4096)
    with pytest.raises(ProtocolError, match="magic"):
        unpack_header(b"GET / HTTP/1.1\r\n" + bytes(48), 4096)


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
def test_split_message_covers_the_message_exactly(chunk: int) -> None:
    """Parts are contiguous, in order, at most `chunk` bytes, with per-part checksums."""
    pieces: list[bytes | memoryview] = [b"abc", memoryview(bytes(range(200))), b"", b"xyz" * 50]
    whole = _join(pieces)
    frames = split_message(Kind.LINEAR_STATE, 9, 3, 12, pieces, chunk)
    assert len(frames) == -(-len(whole) // chunk)
    offset = 0
    for i, frame in enumerate(frames):
        h = unpack_header(frame.header, 1 << 20)
        data = _join(frame.pieces)
        assert (h.part, h.parts, h.offset, h.total) == (i, len(frames), offset, len(whole))
        assert len(data) == h.length <= chunk and checksum([data]) == h.checksum
        assert data == whole[offset : offset + h.length]
        offset += h.length
    assert offset == len(whole)


def test_control_frame_with_empty_payload() -> None:
    frame = make_frame(Kind.REGISTER, 77, [])
    h = unpack_header(frame.header, 10)
    assert (h.kind, h.room, h.length, h.total) == (Kind.REGISTER, 77, 0, 0)


def test_arrays_round_trip_bit_exact_for_every_dtype() -> None:
    """Encode/decode keeps names, order, dtypes, shapes, bytes and the block range."""
    arrays = random_arrays(np.random.default_rng(0), scale=3)
    body = np.frombuffer(_join(encode_arrays(arrays, (2, 9))), dtype=np.uint8).copy()
    decoded = decode_arrays(*split_body(body.data))
    assert_same(arrays, decoded)
    assert decoded.blocks == (2, 9)
    assert all(a.flags.writeable for a in decoded.values())
    # every array starts at a multiple of 64 bytes from the body start (aligned arrays)
    starts = [a.__array_interface__["data"][0] - body.ctypes.data for a in decoded.values()]
    assert all(start % 64 == 0 for start in starts)
    assert len(decoded) == len(SPECS)


def test_non_contiguous_and_big_endian_arrays() -> None:
    """Strided views are sent as their logical contents; byte order is kept."""
    base = np.arange(60, dtype=np.float32).reshape(6, 10)
    arrays = {"t": base.T, "s": base[::2, 1::3], "be": np.arange(5, dtype=">i4")}
    decoded = decode_arrays(*split_body(_join(encode_arrays(arrays, None))))
    assert_same({k: np.ascontiguousarray(v) for k, v in arrays.items()}, decoded)
    assert decoded["be"].dtype.str == ">i4" and decoded.blocks is None


def test_unsendable_arrays_are_rejected() -> None:
    with pytest.raises(ValueError, match="dtype"):
        encode_arrays({"o": np.array([object()])}, None)
    with pytest.raises(ValueError, match="not a numpy array"):
        encode_arrays({"l": [1, 2]}, None)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="blocks"):
        encode_arrays({}, (5, 2))


def test_malformed_bodies_are_value_errors() -> None:
    """A body whose descriptor disagrees with its data never decodes."""
    desc, body, offset = split_body(_join(encode_arrays({"x": np.zeros(4, np.int32)}, None)))
    with pytest.raises(ValueError, match="overruns"):
        decode_arrays(desc, body[:-1], offset)
    with pytest.raises(ValueError, match="trailing"):
        decode_arrays(desc, memoryview(bytes(body) + b"\0"), offset)
    with pytest.raises(ValueError, match="length prefix"):
        split_body(b"\1")
    with pytest.raises(ValueError, match="exceeds the body"):
        split_body(b"\xff\0\0\0{}")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"connections": 0}, "connections must be in 1..64, got 0"),
        ({"chunk_bytes": 100}, "chunk_bytes must be in"),
        ({"window_bytes": 8192, "chunk_bytes": 16384}, "window_bytes (8192)"),
        ({"rate_bytes_per_s": -1.0}, "rate_bytes_per_s must be a positive finite number, got -1.0"),
        ({"delay_s": float("nan")}, "delay_s must be in [0, 10], got nan"),
        ({"port": 70000}, "port must be in 0..65535, got 70000"),
        ({"register_timeout_s": 0}, "register_timeout_s must be a positive"),
    ],
)
def test_sender_config_errors_name_the_bad_value(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as info:
        SenderConfig(**kwargs)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_receiver_config_errors() -> None:
    with pytest.raises(ValueError, match="max_buffered_bytes must be >= 1048576, got 10"):
        ReceiverConfig(max_buffered_bytes=10)
    with pytest.raises(ValueError, match="connect_timeout_s"):
        ReceiverConfig(connect_timeout_s=-1)
    assert SenderConfig(process_rate_bytes_per_s=5e6).capacity == 5e6

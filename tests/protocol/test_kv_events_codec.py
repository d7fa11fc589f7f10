"""KV event codec: SGLang's msgpack layout, byte for byte, and strict typed decoding."""

from __future__ import annotations

import msgspec
import pytest

from prfaas.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventDecodeError,
    decode_batch,
    decode_frames,
    encode_batch,
    encode_frames,
)

STORED = BlockStored((1, 2), None, (7, 8, 9, 10), 2)
BATCH = KVEventBatch(1.5, (STORED, BlockRemoved((3,)), AllBlocksCleared()))

# The payload of BATCH written out by hand from the msgpack spec, as msgspec encodes
# SGLang's structs (array_like: every field, in order; tag=True: class name first).
HAND_BUILT = (
    b"\x93"  # batch: array of 3 [ts, events, attn_dp_rank]
    b"\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00"  # ts 1.5 as float64
    b"\x93"  # 3 events
    b"\x96\xabBlockStored"  # [tag, hashes, parent, tokens, block_size, lora_id]
    b"\x92\x01\x02\xc0\x94\x07\x08\x09\x0a\x02\xc0"
    b"\x92\xacBlockRemoved\x91\x03"  # [tag, hashes]
    b"\x91\xb0AllBlocksCleared"  # [tag]
    b"\xc0"  # attn_dp_rank nil
)


def test_encoding_matches_hand_built_sglang_payload() -> None:
    """encode_batch produces exactly the bytes SGLang's msgspec encoder emits."""
    assert encode_batch(BATCH) == HAND_BUILT


def test_hand_built_payload_decodes() -> None:
    """A payload laid out as SGLang builds it decodes to the same events."""
    assert decode_batch(HAND_BUILT) == BATCH


def test_dp_rank_is_the_third_batch_field() -> None:
    """attn_dp_rank is written after the events; lora_id after block_size, nil included."""
    batch = KVEventBatch(2.0, (BlockStored((5,), 4, (1, 2), 2, 9), BlockRemoved((5,))), 3)
    wire = msgspec.msgpack.decode(encode_batch(batch))
    assert wire == [2.0, [["BlockStored", [5], 4, [1, 2], 2, 9], ["BlockRemoved", [5]]], 3]
    assert decode_batch(encode_batch(batch)) == batch


def test_full_width_hashes_round_trip() -> None:
    """Unsigned 64-bit (ours) and negative signed 64-bit (other engines') hashes survive."""
    batch = KVEventBatch(0.25, (BlockStored((2**64 - 1, -(2**63)), 2**63, (0,), 1),))
    assert decode_batch(encode_batch(batch)) == batch


def test_sglang_two_field_batch_decodes() -> None:
    """Older SGLang batches [ts, events] (no attn_dp_rank) decode with rank None."""
    payload = msgspec.msgpack.encode([1.0, [["AllBlocksCleared"]]])
    assert decode_batch(payload) == KVEventBatch(1.0, (AllBlocksCleared(),))


def test_integer_ts_decodes_as_float() -> None:
    """A publisher that stamps an integer time still decodes; ts comes out a float."""
    decoded = decode_batch(msgspec.msgpack.encode([7, []]))
    assert decoded == KVEventBatch(7.0, ()) and type(decoded.ts) is float


def test_unknown_trailing_fields_are_ignored() -> None:
    """A newer publisher's extra trailing fields (vLLM's array-form `medium`, ...) are
    skipped, in events and in the batch."""
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [["BlockStored", [1], None, [4, 5], 2, None, "GPU"], ["BlockRemoved", [1], "GPU"]],
            0,
            "more",
        ]
    )
    expected = (BlockStored((1,), None, (4, 5), 2), BlockRemoved((1,)))
    assert decode_batch(payload) == KVEventBatch(1.0, expected, 0)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # reserved byte: not msgpack
        msgspec.msgpack.encode({"ts": 1.0}),
        msgspec.msgpack.encode([1.0]),
        msgspec.msgpack.encode(["x", []]),
        msgspec.msgpack.encode([1.0, [["Nope", [1]]]]),
        msgspec.msgpack.encode([1.0, [[1, 2]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1]]]]),  # missing block_size
        msgspec.msgpack.encode([1.0, [["BlockStored", ["a"], None, [1], 1, None]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], "p", [1], 1, None]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1], 0, None]]]),
        msgspec.msgpack.encode([1.0, [["BlockRemoved"]]]),
        msgspec.msgpack.encode([1.0, [], "rank"]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [-1], 1, None]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [2**32], 1, None]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1.0], 1, None]]]),
        msgspec.msgpack.encode([1.0, [["BlockRemoved", [True]]]]),
        msgspec.msgpack.encode([1.0, [{"type": "AllBlocksCleared"}]]),  # map-form event
    ],
)
def test_malformed_payloads_raise_decode_error(payload: bytes) -> None:
    """Every malformed payload raises KVEventDecodeError, never another exception."""
    with pytest.raises(KVEventDecodeError):
        decode_batch(payload)


def test_decode_error_names_the_bad_field() -> None:
    """The error says which value is wrong, as a path into the payload."""
    payload = msgspec.msgpack.encode([1.0, [["AllBlocksCleared"], ["BlockRemoved", [1, "x"]]]])
    with pytest.raises(
        KVEventDecodeError, match=r"Expected `int`, got `str` - at `\$\[1\]\[1\]\[1\]\[1\]`"
    ):
        decode_batch(payload)


def test_frames_carry_topic_and_big_endian_sequence() -> None:
    """Frames are [topic, 8-byte big-endian seq, payload] and decode back."""
    frames = encode_frames("kv", 258, BATCH)
    assert frames[:2] == [b"kv", b"\x00\x00\x00\x00\x00\x00\x01\x02"]
    assert frames[2] == HAND_BUILT
    assert decode_frames(frames) == ("kv", 258, BATCH)


@pytest.mark.parametrize(
    "frames",
    [[b"", b"\x00" * 8], [b"", b"\x00" * 7, HAND_BUILT], [b"\xff", b"\x00" * 8, HAND_BUILT]],
)
def test_malformed_frames_raise_decode_error(frames: list[bytes]) -> None:
    """Wrong frame count, short sequence frame or a non-UTF-8 topic is rejected."""
    with pytest.raises(KVEventDecodeError):
        decode_frames(frames)

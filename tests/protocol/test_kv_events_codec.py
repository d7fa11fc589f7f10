"""KV event codec: SGLang's msgpack layout, byte for byte, and strict decoding."""

from __future__ import annotations

import msgpack
import pytest

from prfaas.common.kv_events import (
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


def test_dp_rank_and_medium_are_trailing_fields() -> None:
    """attn_dp_rank is the batch's third field; medium is appended only when set."""
    batch = KVEventBatch(
        2.0, (BlockStored((5,), 4, (1, 2), 2, 9, "GPU"), BlockRemoved((5,), "GPU")), 3
    )
    wire = msgpack.unpackb(encode_batch(batch))
    assert wire == [
        2.0,
        [["BlockStored", [5], 4, [1, 2], 2, 9, "GPU"], ["BlockRemoved", [5], "GPU"]],
        3,
    ]
    assert decode_batch(encode_batch(batch)) == batch


def test_full_width_hashes_round_trip() -> None:
    """Unsigned 64-bit (ours) and negative signed 64-bit (other engines') hashes survive."""
    batch = KVEventBatch(0.25, (BlockStored((2**64 - 1, -(2**63)), 2**63, (0,), 1),))
    assert decode_batch(encode_batch(batch)) == batch


def test_vllm_map_form_events_decode() -> None:
    """Events encoded as maps with a "type" tag (vLLM's form) decode too."""
    payload = msgpack.packb(
        [
            3.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [1],
                    "parent_block_hash": None,
                    "token_ids": [4, 5],
                    "block_size": 2,
                    "lora_id": None,
                    "medium": "GPU",
                },
                {"type": "BlockRemoved", "block_hashes": [1]},
                {"type": "AllBlocksCleared"},
            ],
        ]
    )
    expected = (
        BlockStored((1,), None, (4, 5), 2, None, "GPU"),
        BlockRemoved((1,)),
        AllBlocksCleared(),
    )
    assert decode_batch(payload).events == expected


def test_sglang_two_field_batch_decodes() -> None:
    """Older SGLang batches [ts, events] (no attn_dp_rank) decode with rank None."""
    assert decode_batch(msgpack.packb([1.0, [["AllBlocksCleared"]]])) == KVEventBatch(
        1.0, (AllBlocksCleared(),)
    )


def test_unknown_trailing_fields_are_ignored() -> None:
    """A newer publisher's extra trailing fields do not break decoding."""
    payload = msgpack.packb([1.0, [["BlockRemoved", [1], None, "extra"]], 0, "more"])
    assert decode_batch(payload) == KVEventBatch(1.0, (BlockRemoved((1,)),), 0)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # reserved byte: not msgpack
        msgpack.packb({"ts": 1.0}),
        msgpack.packb([1.0]),
        msgpack.packb(["x", []]),
        msgpack.packb([1.0, [["Nope", [1]]]]),
        msgpack.packb([1.0, [[1, 2]]]),
        msgpack.packb([1.0, [["BlockStored", [1], None, [1]]]]),  # missing block_size
        msgpack.packb([1.0, [["BlockStored", ["a"], None, [1], 1, None]]]),
        msgpack.packb([1.0, [["BlockStored", [1], "p", [1], 1, None]]]),
        msgpack.packb([1.0, [["BlockStored", [1], None, [1], 0, None]]]),
        msgpack.packb([1.0, [["BlockRemoved"]]]),
        msgpack.packb([1.0, [], "rank"]),
    ],
)
def test_malformed_payloads_raise_decode_error(payload: bytes) -> None:
    """Every malformed payload raises KVEventDecodeError, never another exception."""
    with pytest.raises(KVEventDecodeError):
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

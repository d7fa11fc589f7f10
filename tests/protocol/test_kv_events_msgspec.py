"""Byte compatibility with SGLang's msgspec structs before 0.5.23 (declared as its
kv_events.py declared them; 0.5.23 writes tagged maps, read by `vllm_events.py`).

Our events are msgspec structs too; these tests hold them to SGLang's declarations: equal
bytes both ways, and each side decodes the other's payloads to the same content.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventDecodeError,
    decode_batch,
    encode_batch,
)


class SgEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[misc, call-arg]
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class SgKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):  # type: ignore[misc, call-arg]
    pass


class SgBlockStored(SgKVCacheEvent, tag="BlockStored"):  # type: ignore[misc, call-arg]
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class SgBlockRemoved(SgKVCacheEvent, tag="BlockRemoved"):  # type: ignore[misc, call-arg]
    block_hashes: list[int]


class SgAllBlocksCleared(SgKVCacheEvent, tag="AllBlocksCleared"):  # type: ignore[misc, call-arg]
    pass


class SgKVEventBatch(SgEventBatch):  # type: ignore[misc]
    events: list[SgBlockStored | SgBlockRemoved | SgAllBlocksCleared]


class SgOldKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[misc, call-arg]
    """SGLang's batch before it carried attn_dp_rank."""

    ts: float
    events: list[SgBlockStored | SgBlockRemoved | SgAllBlocksCleared]


def _sglang_batch(rank: int | None) -> Any:
    return SgKVEventBatch(
        ts=1700000000.125,
        events=[
            SgBlockStored([2**64 - 5, 17], None, list(range(128)), 64, None),
            SgBlockStored([300], 17, [70000] * 64, 64, 3),
            SgBlockRemoved([2**64 - 5, 17, 300]),
            SgAllBlocksCleared(),
        ],
        attn_dp_rank=rank,
    )


def _our_batch(rank: int | None) -> KVEventBatch:
    return KVEventBatch(
        1700000000.125,
        (
            BlockStored((2**64 - 5, 17), None, tuple(range(128)), 64),
            BlockStored((300,), 17, (70000,) * 64, 64, 3),
            BlockRemoved((2**64 - 5, 17, 300)),
            AllBlocksCleared(),
        ),
        rank,
    )


@pytest.mark.parametrize("rank", [None, 0, 5])
def test_our_bytes_equal_sglang_msgspec_bytes(rank: int | None) -> None:
    """encode_batch and SGLang's msgspec encoder produce identical payloads."""
    assert encode_batch(_our_batch(rank)) == msgspec.msgpack.encode(_sglang_batch(rank))


@pytest.mark.parametrize("rank", [None, 2])
def test_sglang_payload_decodes_and_ours_decodes_in_sglang(rank: int | None) -> None:
    """Each side decodes the other's payload to the same content."""
    assert decode_batch(msgspec.msgpack.encode(_sglang_batch(rank))) == _our_batch(rank)
    decoded = msgspec.msgpack.decode(encode_batch(_our_batch(rank)), type=SgKVEventBatch)
    assert decoded == _sglang_batch(rank)


hashes = st.lists(st.integers(-(2**63), 2**64 - 1), max_size=4)
stored = st.builds(
    lambda h, p, t, bs, lora: (
        BlockStored(tuple(h), p, tuple(t), bs, lora),
        SgBlockStored(h, p, t, bs, lora),
    ),
    hashes,
    st.none() | st.integers(-(2**63), 2**64 - 1),
    st.lists(st.integers(0, 2**32 - 1), max_size=8),
    st.integers(1, 2**16),
    st.none() | st.integers(0, 2**31),
)
removed = st.builds(lambda h: (BlockRemoved(tuple(h)), SgBlockRemoved(h)), hashes)
cleared = st.just((AllBlocksCleared(), SgAllBlocksCleared()))


@settings(max_examples=300, deadline=None)
@given(
    ts=st.floats(allow_nan=False),
    pairs=st.lists(stored | removed | cleared, max_size=6),
    rank=st.none() | st.integers(0, 1024),
)
def test_random_batches_match_msgspec_byte_for_byte(
    ts: float, pairs: list[tuple[Any, Any]], rank: int | None
) -> None:
    """For any batch: our bytes equal SGLang's, SGLang decodes ours to its batch, we decode
    SGLang's to ours, and ours round-trips."""
    ours = KVEventBatch(ts, tuple(p[0] for p in pairs), rank)
    theirs = SgKVEventBatch(ts=ts, events=[p[1] for p in pairs], attn_dp_rank=rank)
    assert encode_batch(ours) == msgspec.msgpack.encode(theirs)
    assert msgspec.msgpack.decode(encode_batch(ours), type=SgKVEventBatch) == theirs
    assert decode_batch(msgspec.msgpack.encode(theirs)) == ours
    assert decode_batch(encode_batch(ours)) == ours


@settings(max_examples=100, deadline=None)
@given(ts=st.floats(allow_nan=False), pairs=st.lists(stored | removed | cleared, max_size=6))
def test_old_sglang_batches_decode_with_rank_none(ts: float, pairs: list[tuple[Any, Any]]) -> None:
    """SGLang's older two-field batches decode, attn_dp_rank None."""
    theirs = SgOldKVEventBatch(ts=ts, events=[p[1] for p in pairs])
    expected = KVEventBatch(ts, tuple(p[0] for p in pairs), None)
    assert decode_batch(msgspec.msgpack.encode(theirs)) == expected


@pytest.mark.parametrize("token", [-1, 2**32])
def test_sglang_token_ids_outside_uint32_are_rejected(token: int) -> None:
    """SGLang's `list[int]` takes any int; ours rejects what the index cannot hash."""
    theirs = SgKVEventBatch(ts=1.0, events=[SgBlockStored([1], None, [token], 1, None)])
    with pytest.raises(KVEventDecodeError, match=re.escape("at `$[1][0][3][0]`")):
        decode_batch(msgspec.msgpack.encode(theirs))


@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=64)
    | st.builds(
        msgspec.msgpack.encode,
        st.recursive(
            st.none()
            | st.booleans()
            | st.integers(-(2**63), 2**64 - 1)
            | st.floats()
            | st.sampled_from(("BlockStored", "BlockRemoved", "AllBlocksCleared")),
            lambda inner: st.lists(inner, max_size=4),
            max_leaves=12,
        ),
    )
)
def test_any_payload_decodes_or_raises_decode_error(payload: bytes) -> None:
    """Arbitrary bytes and arbitrary msgpack arrays never raise anything but
    KVEventDecodeError (the subscriber counts those and drops the message)."""
    try:
        batch = decode_batch(payload)
    except KVEventDecodeError:
        return
    assert encode_batch(decode_batch(encode_batch(batch))) == encode_batch(batch)  # NaN-safe

"""Byte compatibility with SGLang's own msgspec structs (declared as in SGLang's kv_events.py).

Needs `msgspec` (SGLang's serializer), a test-only dependency.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas.common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
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
    """For any batch, our bytes equal msgspec's and decode back to the same batch."""
    ours = KVEventBatch(ts, tuple(p[0] for p in pairs), rank)
    theirs = SgKVEventBatch(ts=ts, events=[p[1] for p in pairs], attn_dp_rank=rank)
    assert encode_batch(ours) == msgspec.msgpack.encode(theirs)
    assert decode_batch(encode_batch(ours)) == ours

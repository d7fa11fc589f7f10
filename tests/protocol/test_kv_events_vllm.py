"""vLLM's KV event batches (map-form events, bytes hashes, one event per KV-cache group)
decoded into ours and applied to the global KV index, which re-hashes the token ids."""

from __future__ import annotations

import msgspec
import pytest

from prfaas.common.hashing import hash_blocks
from prfaas.gateway.kv_index import KVIndexManager
from prfaas.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    StatesRemoved,
    StatesStored,
)
from prfaas.protocol.kv_events.events import KVEventDecodeError
from prfaas.protocol.kv_events.vllm_events import VLLMEventDecoder

BS = 4


def stored(hashes: list[bytes], tokens: list[int], group: int, kind: str) -> dict[str, object]:
    """A `BlockStored` as vLLM 0.32 writes it (msgspec map, `type` tag, extra keys)."""
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": "GPU",
            "lora_name": None, "group_idx": group, "kv_cache_spec_kind": kind}  # fmt: skip


def batch(*events: dict[str, object]) -> bytes:
    return msgspec.msgpack.encode([1.5, list(events), None])


def test_full_attention_blocks_and_mamba_states_reach_the_index() -> None:
    """As vLLM 0.32 reports a hybrid model (measured with the tiny Qwen3-Next): the request
    that first computes a prefix stores its full-attention blocks and Mamba events without
    hashes (no states kept at a block end), so the index counts nothing reusable yet; a
    later Mamba store naming the second block makes both blocks reusable; that state's
    removal takes it back. A sliding-window group's events are dropped."""
    tokens = list(range(8))
    hashes = [b"\x01" * 32, b"\x02" * 32]
    ints = tuple(int.from_bytes(h[-8:], "big") for h in hashes)
    decoder = VLLMEventDecoder()
    got = decoder.decode_batch(batch(stored([], tokens, 0, "mamba"),
                                     stored(hashes, tokens, 1, "sliding_window"),
                                     stored(hashes, tokens, 3, "full_attention")))  # fmt: skip
    assert got.ts == 1.5
    assert got.events == (StatesStored(()), BlockStored(ints, None, tuple(tokens), BS))
    index = KVIndexManager(block_size=BS)
    index.apply("d0", got.events)
    prompt = hash_blocks([*tokens, 99, 98, 97, 96], BS)
    assert index.longest_prefix(prompt) == {"d0": 0}
    kept = decoder.decode_batch(batch(stored(hashes[1:], tokens[4:], 0, "mamba"))).events
    assert kept == (StatesStored(ints[1:]),)
    index.apply("d0", kept)
    assert index.longest_prefix(prompt) == {"d0": 8}
    removed = {"type": "BlockRemoved", "block_hashes": [hashes[1]], "medium": "GPU"}
    dropped = decoder.decode_batch(batch({**removed, "group_idx": 0})).events
    assert dropped == (StatesRemoved(ints[1:]),)
    index.apply("d0", dropped)
    assert index.longest_prefix(prompt) == {"d0": 0}
    assert decoder.decode_batch(batch({**removed, "group_idx": 1})).events == ()
    assert decoder.decode_batch(batch({**removed, "group_idx": 3})).events == (
        BlockRemoved(ints[1:]),
    )
    cleared = decoder.decode_batch(batch({"type": "AllBlocksCleared"})).events
    assert cleared == (AllBlocksCleared(),)
    assert isinstance(decoder.decode_batch(batch(removed)).events[0], BlockRemoved)


def test_malformed_batches_are_decode_errors() -> None:
    with pytest.raises(KVEventDecodeError, match="bad map-form KV event batch"):
        VLLMEventDecoder().decode_batch(msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]))
    with pytest.raises(KVEventDecodeError, match="3 frames"):
        VLLMEventDecoder().decode_frames([b"", b"\x00"])

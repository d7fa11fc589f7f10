"""vLLM's KV event batches (map-form events, bytes hashes, one event per KV-cache group)
decoded into ours and applied to the global KV index, which re-hashes the token ids."""

from __future__ import annotations

import msgspec
import pytest

from prfaas.common.hashing import hash_blocks
from prfaas.gateway.kv_index import KVIndexManager
from prfaas.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
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


def test_full_attention_events_reach_the_index_and_other_groups_do_not() -> None:
    """Stores of the full-attention group become our `BlockStored` (hashes as ints); the
    same blocks reported by a Mamba group, and that group's removals, are dropped."""
    tokens = list(range(8))
    hashes = [b"\x01" * 32, b"\x02" * 32]
    decoder = VLLMEventDecoder()
    got = decoder.decode_batch(batch(stored(hashes, tokens, 0, "mamba"),
                                     stored(hashes, tokens, 3, "full_attention")))  # fmt: skip
    assert got.ts == 1.5
    assert got.events == (
        BlockStored((int.from_bytes(b"\x01" * 8, "big"), int.from_bytes(b"\x02" * 8, "big")),
                    None, tuple(tokens), BS),
    )  # fmt: skip
    index = KVIndexManager(block_size=BS)
    index.apply("d0", got.events)
    assert index.longest_prefix(hash_blocks([*tokens, 99, 98, 97, 96], BS)) == {"d0": 8}
    removed = {"type": "BlockRemoved", "block_hashes": [hashes[1]], "medium": "GPU"}
    assert decoder.decode_batch(batch({**removed, "group_idx": 0})).events == ()
    index.apply("d0", decoder.decode_batch(batch({**removed, "group_idx": 3})).events)
    assert index.longest_prefix(hash_blocks(tokens, BS)) == {"d0": 4}
    cleared = decoder.decode_batch(batch({"type": "AllBlocksCleared"})).events
    assert cleared == (AllBlocksCleared(),)
    assert isinstance(decoder.decode_batch(batch(removed)).events[0], BlockRemoved)


def test_malformed_batches_are_decode_errors() -> None:
    with pytest.raises(KVEventDecodeError, match="bad vLLM KV event batch"):
        VLLMEventDecoder().decode_batch(msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]))
    with pytest.raises(KVEventDecodeError, match="3 frames"):
        VLLMEventDecoder().decode_frames([b"", b"\x00"])

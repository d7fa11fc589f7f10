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
    SaltedBlockStored,
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


def _keyed(parent: bytes | None, extra_keys: object, **fields: object) -> dict[str, object]:
    """vLLM 0.32's full-attention store of one block with these extra keys (its untagged
    per-block list: a LoRA name, `(mm_identifier, offset)` pairs, the salt, embeddings'
    digests)."""
    event = stored([b"\x07" * 32], [1, 2, 3, 4], 0, "full_attention")
    return {**event, "parent_block_hash": parent, "extra_keys": extra_keys, **fields}


@pytest.mark.parametrize("packed", [False, True])
def test_a_salted_store_is_read_with_its_salt_and_other_keys_are_rejected(
    packed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM publishes a request's `cache_salt` as the only extra key of its chain's first
    block (the blocks after it chain to that one); SGLang 0.5.23 as `cache_salt` on every
    store. Both become `SaltedBlockStored`s at a chain's start, and an empty salt none
    (SGLang salts nothing with one). A LoRA adapter's blocks and a multimodal input's are
    keyed by what a request does not name to the router: `UnreadBlockStored`s, which the
    index rejects (counted, logged once per instance)."""
    decoder = VLLMEventDecoder(packed_ids=packed)
    h = int.from_bytes(b"\x07" * 8, "big")

    def one(event: dict[str, object]) -> list[object]:
        got = decoder.decode_batch(batch(event)).events
        return [(type(e).__name__, getattr(e, "cache_salt", None)) for e in got]

    assert one(_keyed(None, [["tenant"]])) == [("SaltedBlockStored", "tenant")]
    assert one(_keyed(None, [None, None])) == [("BlockStored", None)]
    assert one(_keyed(b"\x01" * 32, [None])) == [("BlockStored", None)]  # a continuation
    assert one(_keyed(None, None, cache_salt="tenant")) == [("SaltedBlockStored", "tenant")]
    assert one(_keyed(b"\x01" * 32, None, cache_salt="t")) == [("SaltedBlockStored", "t")]
    assert one(_keyed(None, None, cache_salt="")) == [("BlockStored", None)]
    unread = ("UnreadBlockStored", None)
    dropped = [
        _keyed(None, [["adapter", "tenant"]], lora_name="adapter"),
        _keyed(None, [[["image-digest", 0]]]),  # an image in the first block
        _keyed(b"\x01" * 32, [["tenant"]]),  # a salt after the chain's start: not vLLM's
        _keyed(None, [["a", "b"]]),
        {**stored([b"\x07" * 32], [1, 2, 3, 4], 0, "full_attention"), "lora_id": 3},
    ]
    for event in dropped:
        assert one(event) == [unread]
    index = KVIndexManager(block_size=BS)
    index.apply("d0", decoder.decode_batch(batch(*dropped)).events)
    assert len(index) == 0 and index.rejected_events == len(dropped)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "keyed by more than its tokens" in errors[0], errors
    salted = decoder.decode_batch(batch(_keyed(None, [["tenant"]]))).events[0]
    assert isinstance(salted, SaltedBlockStored) and salted.block_hashes == (h,)


@pytest.mark.parametrize("packed", [False, True])
def test_only_the_device_caches_events_reach_the_index(packed: bool) -> None:
    """A host or storage tier's events (vLLM's offloading connectors publish their stores
    without the blocks' extra keys; SGLang's `CPU_PINNED`, `DISK`, `EXTERNAL`) are dropped:
    a salted block offloaded to the CPU would otherwise be credited unsalted, and a host
    copy's removal would take back the block the device still holds."""
    decoder = VLLMEventDecoder(packed_ids=packed)
    h = int.from_bytes(b"\x07" * 8, "big")
    gpu = _keyed(None, None)
    got = decoder.decode_batch(batch(
        gpu, {**gpu, "medium": None},
        {**gpu, "medium": "CPU"}, {**gpu, "medium": "CPU_PINNED"},
        {"type": "BlockRemoved", "block_hashes": [b"\x07" * 32], "medium": "CPU"},
        {"type": "BlockRemoved", "block_hashes": [b"\x07" * 32], "medium": "DISK"},
        {"type": "BlockRemoved", "block_hashes": [b"\x07" * 32], "medium": "GPU"},
    )).events  # fmt: skip
    stored_event = BlockStored((h,), None, (1, 2, 3, 4), BS)
    assert [type(e).__name__ for e in got] == ["BlockStored", "BlockStored", "BlockRemoved"]
    if not packed:
        assert got[:2] == (stored_event, stored_event)
    assert got[2] == BlockRemoved((h,))


@pytest.mark.parametrize("packed", [False, True])
def test_a_key_or_tier_in_a_form_not_foreseen_drops_its_store_not_the_batch(
    packed: bool,
) -> None:
    """The fields that key a block or name its tier are read as any value: one in another
    form (a number, a map) drops its own store (it cannot be credited safely), and the
    rest of the batch, a removal included, still applies."""
    decoder = VLLMEventDecoder(packed_ids=packed)
    h = int.from_bytes(b"\x07" * 8, "big")
    odd = [
        _keyed(None, None, cache_salt=7),
        _keyed(None, None, lora_name={"name": "a"}),
        _keyed(None, "tenant"),
        _keyed(None, [[["tenant"]]]),
        _keyed(None, None, medium=3),
    ]
    removal = {"type": "BlockRemoved", "block_hashes": [b"\x07" * 32], "medium": "GPU"}
    got = decoder.decode_batch(batch(*odd, removal)).events
    assert [type(e).__name__ for e in got] == ["UnreadBlockStored"] * 4 + ["BlockRemoved"]
    assert got[-1] == BlockRemoved((h,))  # (the other tier's store is dropped)


def test_mla_and_sink_attention_groups_describe_the_prefix(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM 0.32 labels a latent-attention group `mla_attention` (DeepSeek's, Kimi
    Linear's) and one with sink tokens `sink_full_attention`: both cache the whole prefix,
    so their stores reach the index as full attention's do; a sliding window's group does
    not (logged once)."""
    caplog.set_level("INFO", logger="prfaas.protocol.kv_events.vllm_events")
    tokens = [1, 2, 3, 4]
    decoder = VLLMEventDecoder()
    kinds = ("mla_attention", "sink_full_attention", "sliding_window", "sliding_window")
    groups = (0, 1, 2, 2)
    events = [stored([bytes([i + 1]) * 32], tokens, group, kind)
              for i, (group, kind) in enumerate(zip(groups, kinds, strict=True))]  # fmt: skip
    got = decoder.decode_batch(batch(*events))
    assert [e.block_hashes[0] & 0xFF for e in got.events] == [1, 2]
    index = KVIndexManager(block_size=BS)
    index.apply("d0", got.events[:1])
    assert index.longest_prefix(hash_blocks(tokens, BS)) == {"d0": 4}
    infos = [r.getMessage() for r in caplog.records if "caches no whole prefix" in r.getMessage()]
    assert len(infos) == 1 and "sliding_window" in infos[0], infos

"""`_scan.c`'s reader of vLLM's layout (SGLang 0.5.23 writes it too: events as maps tagged
by "type"), held to msgspec as the positional reader is (`test_kv_events_scan.py`): on the
batches vLLM's and SGLang's publishers write, with their extra keys in any order, it reads
what msgspec decodes, the ids as an `IdArray`; on anything else it answers None."""

from __future__ import annotations

import struct
from typing import Any

import kv_event_content
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas.common.hashing import hash_blocks
from prfaas.gateway.kv_index import KVIndexManager
from prfaas.protocol.kv_events import events as kv_events
from prfaas.protocol.kv_events import vllm_events
from prfaas.protocol.kv_events.vllm_events import VEventBatch, VLLMEventDecoder

try:
    from prfaas.protocol.kv_events._scan import scan_map_batch
except ImportError:  # every test here then fails: the project's setup builds it
    scan_map_batch = None  # type: ignore[assignment]


def scan(payload: bytes) -> VEventBatch[Any] | None:
    batch = scan_map_batch(payload, vllm_events._SCANNED_CLASSES)
    assert batch is None or isinstance(batch, VEventBatch)
    return batch


def msgspec_decode(payload: bytes) -> VEventBatch[Any]:
    return vllm_events._DECODERS[True].decode(payload)


def content(batch: VEventBatch[Any]) -> list[Any]:
    return kv_event_content.content(batch.ts, batch.events, batch.data_parallel_rank)


def test_the_map_scan_is_what_decoding_packed_ids_runs() -> None:
    assert scan_map_batch is not None, "prfaas.protocol.kv_events._scan is not built"
    assert kv_events.scan_map_batch is scan_map_batch
    assert VLLMEventDecoder(packed_ids=True)._scan is scan_map_batch
    assert VLLMEventDecoder()._scan is None  # decoded ids: msgspec


ints = st.integers(-(2**63), 2**64 - 1)
hash_values = ints | st.binary(max_size=40)
extra_keys = {  # what vLLM 0.32 and SGLang 0.5.23 write beside the fields read here
    "medium": st.none() | st.sampled_from(("GPU", "CPU_PINNED")),
    "lora_name": st.none() | st.text(max_size=8),
    "extra_keys": st.none() | st.lists(st.none(), max_size=3),  # (a block keyed: below)
    "cache_salt": st.none() | st.text(max_size=8),
    "session_id": st.text(max_size=8),
}
keyed_blocks = st.lists(  # vLLM's extra keys with a key: a salt, a LoRA name, an image's
    st.none() | st.lists(st.text(max_size=4) | st.lists(ints, max_size=2), max_size=2),
    min_size=1,
    max_size=3,
).filter(lambda keys: any(k is not None for k in keys))
stored = st.fixed_dictionaries(
    {
        "block_hashes": st.lists(hash_values, max_size=5),
        "parent_block_hash": st.none() | hash_values,
        "token_ids": st.lists(st.integers(0, 2**32 - 1), max_size=40),
        "block_size": st.integers(1, 2**63 - 1),
    },
    optional={
        "lora_id": st.none() | ints,
        "group_idx": st.none() | ints,
        "kv_cache_spec_kind": st.none() | st.sampled_from(("full_attention", "mamba", "é")),
        **extra_keys,
    },
).map(lambda d: ("BlockStored", d))
removed = st.fixed_dictionaries(
    {"block_hashes": st.lists(hash_values, max_size=5)},
    optional={
        "group_idx": st.none() | ints,
        "medium": extra_keys["medium"],
        "token_ids": st.lists(ints, max_size=3),  # another kind's field: skipped
        "block_size": st.text(max_size=3),
    },
).map(lambda d: ("BlockRemoved", d))
cleared = st.fixed_dictionaries(
    {}, optional={"medium": extra_keys["medium"], "block_hashes": st.lists(ints, max_size=2)}
).map(lambda d: ("AllBlocksCleared", d))


@st.composite
def batches(draw: st.DrawFn) -> bytes:
    """A batch as a publisher writes it: each event's "type" first, its keys in any order."""
    events = []
    for kind, fields in draw(st.lists(stored | removed | cleared, max_size=5)):
        keys = draw(st.permutations(list(fields)))
        events.append({"type": kind, **{k: fields[k] for k in keys}})
    tail = draw(st.sampled_from(((), (None,), (3,))))
    return msgspec.msgpack.encode([draw(st.floats(allow_nan=False)), events, *tail])


@settings(max_examples=300, deadline=None)
@given(batches())
def test_every_batch_the_engines_write_is_scanned_as_msgspec_decodes_it(payload: bytes) -> None:
    scanned = scan(payload)
    assert scanned is not None
    assert content(scanned) == content(msgspec_decode(payload))
    for ours in scanned.events:
        if isinstance(ours, vllm_events.VBlockStored):
            assert isinstance(ours.token_ids, memoryview) and ours.token_ids.format == "I"


@settings(max_examples=200, deadline=None)
@given(keyed_blocks)
def test_a_store_keyed_by_more_than_its_tokens_is_left_to_msgspec(keys: list[Any]) -> None:
    """Extra keys with a key in them are read by msgspec (the decoder decides what they
    mean: `stored_salt`); no key (None, or only Nones, as vLLM writes unkeyed blocks) is
    read here."""
    fields = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
              "token_ids": [5], "block_size": 1}  # fmt: skip
    payload = msgspec.msgpack.encode([1.0, [{**fields, "extra_keys": keys}]])
    assert scan(payload) is None
    got = msgspec_decode(payload).events[0]
    assert isinstance(got, vllm_events.VBlockStored)
    assert got.extra_keys == keys
    for plain in (None, [None] * len(keys)):
        scanned = scan(msgspec.msgpack.encode([1.0, [{**fields, "extra_keys": plain}]]))
        assert scanned is not None
        assert scanned.events[0].extra_keys == plain


@settings(max_examples=500, deadline=None)
@given(batches(), st.data())
def test_a_damaged_batch_is_scanned_as_msgspec_decodes_it_or_left_to_msgspec(
    payload: bytes, data: st.DataObject
) -> None:
    damaged = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(damaged)))
        change = data.draw(st.sampled_from(("set", "cut", "add")))
        if change == "set" and at < len(damaged):
            damaged[at] = data.draw(st.integers(0, 255))
        elif change == "cut":
            del damaged[at:]
        else:
            damaged[at:at] = data.draw(st.binary(min_size=1, max_size=3))
    scanned = scan(bytes(damaged))
    try:
        expected = msgspec_decode(bytes(damaged))
    except msgspec.DecodeError:
        assert scanned is None
        return
    if scanned is not None:
        assert content(scanned) == content(expected)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=80))
def test_any_bytes_are_scanned_as_msgspec_decodes_them_or_left_to_it(payload: bytes) -> None:
    scanned = scan(payload)
    if scanned is not None:
        assert content(scanned) == content(msgspec_decode(payload))


def test_what_the_scan_does_not_read_is_left_to_msgspec() -> None:
    """The tag after another key, a key twice, a required field missing, a hash that is a
    string, an invalid UTF-8 spec kind: msgspec decodes or rejects them."""
    fields = {"block_hashes": [1], "parent_block_hash": None, "token_ids": [5], "block_size": 1}
    tag_later = msgspec.msgpack.encode([1.0, [{**fields, "type": "BlockStored"}]])
    twice = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [1]}]])
    twice = twice.replace(b"\x82", b"\x83", 1) + b"\xacblock_hashes\x90"  # the key again
    missing = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1]}]])
    text_hash = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"]}]])
    bad_utf8 = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockStored", **fields, "kv_cache_spec_kind": "é"}]]
    ).replace("é".encode(), b"\xff\xfe")
    not_text_key = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": []}]])
    not_text_key = not_text_key.replace(b"\x82", b"\x83", 1) + b"\x07\xc0"  # 7: nil
    for payload in (tag_later, twice, missing, text_hash, bad_utf8, not_text_key):
        assert scan(payload) is None
    assert content(msgspec_decode(tag_later))[1][0][0] == "VBlockStored"  # msgspec reads it
    for payload in (missing, text_hash, bad_utf8):
        with pytest.raises(msgspec.DecodeError):
            msgspec_decode(payload)


def test_long_headers_are_read_as_msgspec_reads_them() -> None:
    """A map 16 event with a str 16 tag and str 8 keys, a bin 16 hash, a map 32 event."""
    removed = (
        b"\xde\x00\x02"  # map 16 of 2 pairs
        + b"\xa4type\xda\x00\x0cBlockRemoved"  # str 16 tag
        + b"\xd9\x0cblock_hashes\x91\xc5\x00\x02\x01\x02"  # str 8 key, bin 16 hash
    )
    cleared = b"\xdf\x00\x00\x00\x01\xa4type\xb0AllBlocksCleared"  # map 32
    payload = b"\x92\xcb" + struct.pack(">d", 2.0) + b"\x92" + removed + cleared
    scanned = scan(payload)
    assert scanned is not None
    assert content(scanned) == content(msgspec_decode(payload))
    assert content(scanned)[1] == [
        ("VBlockRemoved", (b"\x01\x02",), None, None),
        ("VAllBlocksCleared",),
    ]


def test_a_value_nested_past_msgspecs_depth_is_a_decode_error() -> None:
    """Left to msgspec, which runs out of recursion: a `KVEventDecodeError` (the subscriber
    drops the batch), not a `RecursionError` that would end the instance's feed."""
    deep = b"\x91" * 100_000 + b"\xc0"  # [[[...[None]...]]]
    ts = b"\x92\xcb" + struct.pack(">d", 1.0) + b"\x91"  # [1.0, [event]]
    positional = ts + b"\x93\xacBlockRemoved\x91\x01" + deep
    maps = ts + b"\x83\xa4type\xacBlockRemoved\xacblock_hashes\x90\xa1x" + deep
    with pytest.raises(kv_events.KVEventDecodeError):
        kv_events.decode_batch(positional, packed_ids=True)
    with pytest.raises(kv_events.KVEventDecodeError):
        VLLMEventDecoder(packed_ids=True).decode_batch(maps)


def test_the_decoder_gives_the_same_events_and_the_index_the_same_answers_either_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's hybrid batch (full attention, Mamba states, a sliding window dropped) through
    the scan and through msgspec: the same events (ids aside) and index answers."""
    tokens = list(range(8))
    hashes = [b"\x01" * 32, b"\x02" * 32]

    def stored_event(hashes: list[bytes], group: int, kind: str) -> dict[str, object]:
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                "token_ids": tokens, "block_size": 4, "lora_id": None, "medium": "GPU",
                "lora_name": None, "group_idx": group, "kv_cache_spec_kind": kind}  # fmt: skip

    events = [
        stored_event(hashes[1:], 0, "mamba"),
        stored_event(hashes, 1, "sliding_window"),
        stored_event(hashes, 3, "full_attention"),
    ]
    payload = msgspec.msgpack.encode([1.5, events, None])
    answers = []
    for scanning in (True, False):
        decoder = VLLMEventDecoder(packed_ids=True)
        if not scanning:
            monkeypatch.setattr(decoder, "_scan", None)
        batch = decoder.decode_batch(payload)
        ids = batch.events[1].token_ids  # type: ignore[union-attr]
        assert isinstance(ids, memoryview if scanning else msgspec.Raw)
        index = KVIndexManager(block_size=4)
        index.apply("d0", batch.events)
        answers.append((len(batch.events), index.longest_prefix(hash_blocks(tokens, 4))))
    assert answers == [(2, {"d0": 8}), (2, {"d0": 8})]

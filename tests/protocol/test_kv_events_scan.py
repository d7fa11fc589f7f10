"""`_scan.c`, the C reader of KV event batches for the KV index, held to msgspec: on every
batch msgspec writes (token ids in uint32) it reads the same fields msgspec decodes, the
ids as an `IdArray` where msgspec leaves them packed, hashing alike; on anything else it
answers None (msgspec then decodes it or names what is wrong), never something else."""

from __future__ import annotations

import struct
import sys
import weakref
from typing import Any

import kv_event_content
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas.common import hashing
from prfaas.common.hashing import hash_blocks, unpack_ids
from prfaas.gateway.kv_index import KVIndexManager
from prfaas.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventDecodeError,
    StatesRemoved,
    StatesStored,
    decode_batch,
    encode_batch,
)
from prfaas.protocol.kv_events import events as kv_events

try:
    from prfaas.protocol.kv_events._scan import scan_batch
except ImportError:  # every test here then fails: the project's setup builds it
    scan_batch = None  # type: ignore[assignment]


def test_the_scan_is_what_decoding_packed_ids_runs() -> None:
    assert scan_batch is not None, "prfaas.protocol.kv_events._scan is not built"
    assert kv_events.scan_batch is scan_batch


def scan(payload: bytes) -> KVEventBatch[Any] | None:
    """The batch the scan reads, built as `decode_batch` builds it (None: not read)."""
    batch = scan_batch(payload, kv_events._SCANNED_CLASSES)
    assert batch is None or isinstance(batch, KVEventBatch)
    return batch


def msgspec_decode(payload: bytes) -> KVEventBatch[Any]:
    """What `decode_batch(payload, packed_ids=True)` decodes with msgspec alone."""
    return kv_events._DECODERS[True].decode(payload)


def content(batch: KVEventBatch[Any]) -> list[Any]:
    return kv_event_content.content(batch.ts, batch.events, batch.attn_dp_rank)


ints = st.integers(-(2**63), 2**64 - 1)
ids = st.lists(st.integers(0, 2**32 - 1), max_size=40).map(tuple)
hashes = st.lists(ints, max_size=5).map(tuple)
events = st.one_of(
    st.builds(
        BlockStored,
        hashes,
        st.none() | ints,
        ids,
        st.integers(1, 2**63 - 1),
        st.none() | ints,
    ),
    st.builds(BlockRemoved, hashes),
    st.just(AllBlocksCleared()),
    st.builds(StatesStored, hashes),
    st.builds(StatesRemoved, hashes),
)
batches = st.builds(
    KVEventBatch,
    st.floats(allow_nan=False),
    st.lists(events, max_size=6).map(tuple),
    st.none() | ints,
)


@settings(max_examples=300, deadline=None)
@given(batches)
def test_every_batch_msgspec_writes_is_scanned_as_msgspec_decodes_it(
    batch: KVEventBatch[Any],
) -> None:
    payload = encode_batch(batch)
    assert scan(payload) is not None
    decoded = decode_batch(payload, packed_ids=True)
    assert content(decoded) == content(msgspec_decode(payload)) == content(batch)
    for ours, theirs in zip(decoded.events, msgspec_decode(payload).events, strict=True):
        if isinstance(ours, BlockStored):
            assert isinstance(ours.token_ids, memoryview) and ours.token_ids.format == "I"
            assert hashing._ids(ours.token_ids) is ours.token_ids  # read as it is
            assert isinstance(theirs.token_ids, msgspec.Raw)
            assert ours.token_ids.tobytes() == unpack_ids(theirs.token_ids)


@settings(max_examples=500, deadline=None)
@given(batches, st.data())
def test_a_damaged_batch_is_scanned_as_msgspec_decodes_it_or_left_to_msgspec(
    batch: KVEventBatch[Any], data: st.DataObject
) -> None:
    """Bytes changed, cut off or added anywhere: the scan answers None, or what msgspec
    decodes (so an error is always msgspec's, naming the field)."""
    payload = bytearray(encode_batch(batch))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(payload)))
        change = data.draw(st.sampled_from(("set", "cut", "add")))
        if change == "set" and at < len(payload):
            payload[at] = data.draw(st.integers(0, 255))
        elif change == "cut":
            del payload[at:]
        else:
            payload[at:at] = data.draw(st.binary(min_size=1, max_size=3))
    damaged = bytes(payload)
    scanned = scan(damaged)
    try:
        expected = msgspec_decode(damaged)
    except msgspec.DecodeError:
        assert scanned is None
        with pytest.raises(KVEventDecodeError):
            decode_batch(damaged, packed_ids=True)
        return
    assert content(decode_batch(damaged, packed_ids=True)) == content(expected)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=80))
def test_any_bytes_are_scanned_as_msgspec_decodes_them_or_left_to_it(payload: bytes) -> None:
    scanned = scan(payload)
    if scanned is not None:
        assert content(decode_batch(payload, packed_ids=True)) == content(msgspec_decode(payload))


def test_the_forms_msgspec_reads_and_the_scan_does_not_are_left_to_msgspec() -> None:
    """An integer `ts`, token ids that are not an array of uint32 integers: msgspec decodes
    them (the scan reads only what it is sure of; the index rejects the ids when it hashes
    them)."""
    stored = ["BlockStored", [1], None, [5, 6], 2]
    payloads = [
        msgspec.msgpack.encode([3, [stored]]),  # ts an integer
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, "ids", 2]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [5, -1], 2]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [5, 2**32], 2]]]),
    ]
    for payload in payloads:
        assert scan(payload) is None
        assert decode_batch(payload, packed_ids=True) == msgspec_decode(payload)


values = st.recursive(
    st.none()
    | st.booleans()
    | ints
    | st.floats()
    | st.text(max_size=40)
    | st.binary(max_size=300)
    | st.builds(msgspec.msgpack.Ext, st.integers(0, 127), st.binary(max_size=20)),
    lambda inner: st.lists(inner, max_size=20) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(batches, st.data())
def test_fields_after_the_known_ones_are_skipped_as_msgspec_skips_them(
    batch: KVEventBatch[Any], data: st.DataObject
) -> None:
    """A newer publisher's fields (SGLang's `medium`, a `BlockStored`'s metadata), any
    msgpack values after an event's or the batch's known fields: read past, as msgspec
    reads past them."""
    raw = msgspec.msgpack.decode(encode_batch(batch))
    fields = {"BlockStored": 6, "BlockRemoved": 2, "AllBlocksCleared": 1}
    for event in raw[1]:
        known = fields.get(event[0], 2)
        event.extend([None] * (known - len(event)))  # the optional ones written out
        event.extend(data.draw(st.lists(values, max_size=3)))
    raw.extend([None] * (3 - len(raw)) + data.draw(st.lists(values, max_size=2)))
    payload = msgspec.msgpack.encode(raw)
    assert scan(payload) is not None
    assert content(decode_batch(payload, packed_ids=True)) == content(batch)
    assert content(msgspec_decode(payload)) == content(batch)


@settings(max_examples=300, deadline=None)
@given(values)
def test_any_value_after_the_known_fields_is_skipped_whole_or_left_to_msgspec(
    value: Any,
) -> None:
    """Cut anywhere inside a trailing value, the batch is left to msgspec (which rejects
    it); whole, it is skipped."""
    stored = ["BlockStored", [1], None, [5, 6], 2, None]
    payload = msgspec.msgpack.encode([1.0, [[*stored, value]]])
    assert scan(payload) is not None
    for cut in range(len(payload) - 1, max(len(payload) - 40, 0), -1):
        assert scan(payload[:cut]) is None


def test_the_longer_forms_msgspec_reads_are_scanned_alike() -> None:
    """A str 8 tag, a float 32 `ts`, array 16 and array 32 headers, longer integer forms:
    not what msgspec writes, but what it reads, to the same values."""
    stored = (
        b"\xdc\x00\x05"  # array 16 of the event's 5 fields
        + b"\xd9\x0bBlockStored"  # str 8
        + b"\xdd\x00\x00\x00\x01\xcf"
        + (2**64 - 1).to_bytes(8, "big")  # array 32, uint 64
        + b"\xd3"
        + (-(2**63)).to_bytes(8, "big", signed=True)  # parent int 64
        + b"\x92\xd1\x00\x05\xcc\x07"  # ids: int 16, uint 8
        + b"\xd2\x00\x00\x00\x02"  # block size int 32
    )
    payload = b"\x93\xca" + struct.pack(">f", 1.5) + b"\x91" + stored + b"\xd0\x03"
    assert scan(payload) is not None
    decoded = decode_batch(payload, packed_ids=True)
    assert content(decoded) == content(msgspec_decode(payload))
    assert content(decoded)[1] == [("BlockStored", (2**64 - 1,), -(2**63), (5, 7), 2, None)]


def test_without_the_scan_msgspec_decodes_every_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the extension is not built: packed ids, the same content, the same hashes."""
    batch = KVEventBatch(1.0, (BlockStored((1, 2), None, tuple(range(8)), 4),), None)
    payload = encode_batch(batch)
    scanned = decode_batch(payload, packed_ids=True)
    monkeypatch.setattr(kv_events, "scan_batch", None)
    unscanned = decode_batch(payload, packed_ids=True)
    assert isinstance(unscanned.events[0].token_ids, msgspec.Raw)  # type: ignore[union-attr]
    assert content(unscanned) == content(scanned) == content(batch)


def test_the_scan_calls_its_classes_in_order_and_lets_their_errors_through() -> None:
    """Each event's class with its fields, then the batch's; a class's exception is raised,
    not read as a payload the scan does not read; six classes or a TypeError."""
    calls: list[tuple[str, tuple[Any, ...]]] = []

    def maker(name: str) -> Any:
        def make(*args: Any) -> str:
            calls.append((name, args))
            return name

        return make

    names = ("stored", "removed", "cleared", "states stored", "states removed", "batch")
    events = (BlockStored((1,), None, (5, 6), 2), BlockRemoved((1,)), AllBlocksCleared())
    events += (StatesStored((2,)), StatesRemoved((3,)))
    payload = encode_batch(KVEventBatch(1.0, events, 7))
    assert scan_batch(payload, tuple(maker(n) for n in names)) == "batch"
    assert [name for name, _ in calls] == list(names)
    ids = calls[0][1][2]
    assert ids.format == "I" and ids.tolist() == [5, 6]
    assert calls[-1][1] == (1.0, names[:5], 7)

    def fails(*args: Any) -> None:
        raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        scan_batch(payload, (fails,) * 6)
    assert scan_batch(b"\xc0", (fails,) * 6) is None  # not a batch: no class called
    with pytest.raises(TypeError, match="tuple of the 5 events' classes"):
        scan_batch(payload, (BlockStored,))
    assert [c.__name__ for c in kv_events._SCANNED_CLASSES] == [
        "BlockStored", "BlockRemoved", "AllBlocksCleared", "StatesStored", "StatesRemoved",
        "KVEventBatch",
    ]  # fmt: skip


def test_a_scanned_batch_holds_no_reference_it_does_not_own() -> None:
    """Dropped, a batch frees its ids (the structs are not garbage-collected: a leaked
    reference would keep them); the payload's buffer is released after each scan."""
    payload = encode_batch(KVEventBatch(1.0, (BlockStored((1,), None, (5, 6), 2),), None))
    before = sys.getrefcount(payload)
    for _ in range(100):
        batch = scan(payload)
    assert sys.getrefcount(payload) == before
    assert batch is not None
    ids = weakref.ref(batch.events[0].token_ids)  # type: ignore[union-attr]
    del batch
    assert ids() is None


def test_a_bad_batch_is_named_by_msgspec() -> None:
    """A block size of 0 is not scanned; msgspec's error names its field."""
    payload = msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [5], 0]]])
    assert scan(payload) is None
    with pytest.raises(KVEventDecodeError, match=r"\$\[1\]\[0\]\[4\]"):
        decode_batch(payload, packed_ids=True)


def test_ids_in_every_integer_form_are_read_from_any_buffer() -> None:
    """Each width of the shortest forms, the longer forms an encoder may write (uint 64,
    int 8-64 of a value in range), an id in the data's last bytes."""
    ids = (0, 127, 128, 255, 256, 65_535, 65_536, 2**32 - 1)
    longer = b"\xcf" + (7).to_bytes(8, "big") + b"\xd0\x05\xd1\x01\x00\xd2\x00\x01\x00\x00"
    longer += b"\xd3" + (2**32 - 1).to_bytes(8, "big")
    for tail, expected in ((b"", ()), (longer, (7, 5, 256, 65_536, 2**32 - 1))):
        n = len(ids) + len(expected)  # a fixarray header, the items after it
        packed = bytes([0x90 | n]) + msgspec.msgpack.encode(list(ids))[1:] + tail
        payload = b"\x92\xcb" + bytes(8) + b"\x91\x95\xabBlockStored\x91\x07\xc0" + packed + b"\x01"
        for form in (payload, bytearray(payload), memoryview(payload)):
            (event,) = decode_batch(form, packed_ids=True).events  # type: ignore[arg-type]
            assert isinstance(event, BlockStored)
            assert isinstance(event.token_ids, memoryview)
            assert tuple(event.token_ids) == ids + expected


def test_the_index_holds_what_either_form_stores() -> None:
    """The same events decoded by the scan and by msgspec: both indexes answer alike."""
    tokens = tuple(range(100_000, 100_000 + 6 * 4))
    payloads = [
        encode_batch(KVEventBatch(0.0, (BlockStored((11, 12), None, tokens[:8], 4),))),
        encode_batch(KVEventBatch(0.0, (BlockStored((13,), 12, tokens[8:12], 4),))),
    ]
    answers = []
    for decode in (lambda p: decode_batch(p, packed_ids=True), msgspec_decode):
        index = KVIndexManager(block_size=4)
        for payload in payloads:
            index.apply("a", decode(payload).events)
        answers.append(index.longest_prefix(hash_blocks(tokens, 4)))
    assert answers == [{"a": 12}, {"a": 12}]  # tokens: three blocks of 4

"""`_scan.c`, the C reader of KV event batches with packed token ids, held to msgspec: on
every batch msgspec writes it reads the same fields msgspec decodes, and on anything else
it answers None (msgspec then decodes it or names what is wrong), never something else."""

from __future__ import annotations

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


def msgspec_decode(payload: bytes) -> KVEventBatch[Any]:
    """What `decode_batch(payload, packed_ids=True)` decodes with msgspec alone."""
    return kv_events._DECODERS[True].decode(payload)


ints = st.integers(-(2**63), 2**64 - 1)
hashes = st.lists(ints, max_size=5).map(tuple)
events = st.one_of(
    st.builds(
        BlockStored,
        hashes,
        st.none() | ints,
        st.lists(ints, max_size=40).map(tuple),  # packed ids take any integer
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
    assert scan_batch(payload) is not None
    decoded = decode_batch(payload, packed_ids=True)
    assert decoded == msgspec_decode(payload)
    assert encode_batch(decoded) == payload


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
    scanned = scan_batch(damaged)
    try:
        expected = msgspec_decode(damaged)
    except msgspec.DecodeError:
        assert scanned is None
        with pytest.raises(KVEventDecodeError):
            decode_batch(damaged, packed_ids=True)
        return
    assert encode_batch(decode_batch(damaged, packed_ids=True)) == encode_batch(expected)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=80))
def test_any_bytes_are_scanned_as_msgspec_decodes_them_or_left_to_it(payload: bytes) -> None:
    scanned = scan_batch(payload)
    if scanned is not None:
        assert encode_batch(decode_batch(payload, packed_ids=True)) == encode_batch(
            msgspec_decode(payload)
        )


def test_the_forms_msgspec_reads_and_the_scan_does_not_are_left_to_msgspec() -> None:
    """An integer `ts`, token ids that are not an array of integers, a trailing field:
    msgspec decodes them (the scan reads only what it is sure of)."""
    stored = ["BlockStored", [1], None, [5, 6], 2]
    payloads = [
        msgspec.msgpack.encode([3, [stored]]),  # ts an integer
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, "ids", 2]]]),
        msgspec.msgpack.encode([1.0, [[*stored, None, "newer"]]]),  # a newer field
        msgspec.msgpack.encode([1.0, [stored], 0, "newer"]),
    ]
    for payload in payloads:
        assert scan_batch(payload) is None
        assert decode_batch(payload, packed_ids=True) == msgspec_decode(payload)


def test_a_bad_batch_is_named_by_msgspec() -> None:
    """A block size of 0 is not scanned; msgspec's error names its field."""
    payload = msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [5], 0]]])
    assert scan_batch(payload) is None
    with pytest.raises(KVEventDecodeError, match=r"\$\[1\]\[0\]\[4\]"):
        decode_batch(payload, packed_ids=True)


def test_packed_ids_are_the_bytes_of_their_array_in_any_buffer() -> None:
    ids = (0, 127, 128, 65_535, 65_536, 2**32 - 1)
    batch = KVEventBatch(2.5, (BlockStored((7,), None, ids, 3),), None)
    payload = encode_batch(batch)
    for form in (payload, bytearray(payload), memoryview(payload)):
        (event,) = decode_batch(form, packed_ids=True).events  # type: ignore[arg-type]
        assert isinstance(event, BlockStored)
        assert bytes(event.token_ids) == msgspec.msgpack.encode(list(ids))

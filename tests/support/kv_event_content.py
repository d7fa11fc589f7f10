"""What a decoded KV event batch holds, comparable whatever form its token ids took: the
scan's tests hold its batches to msgspec's with it (`tests/protocol/test_kv_events_scan*`)."""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any

import msgspec


def content(ts: float, events: Iterable[msgspec.Struct], rank: int | None) -> list[Any]:
    """The batch's fields: each event's class name and fields, its token ids (msgpack
    bytes, an `IdArray`, a tuple) as a tuple of ints (msgpack bytes that do not decode, a
    damaged batch's, as those bytes); `ts` as its bits (a damaged batch's may be NaN, which
    equals nothing)."""
    rows = []
    for event in events:
        fields = list(msgspec.structs.astuple(event))
        ids = getattr(event, "token_ids", None)
        if ids is not None:
            at = event.__struct_fields__.index("token_ids")
            value = _decoded(ids) if isinstance(ids, msgspec.Raw) else ids
            many = isinstance(value, list | tuple | memoryview)  # (a damaged Raw: anything)
            fields[at] = tuple(value) if many else value
        rows.append((type(event).__name__, *fields))
    return [struct.pack("<d", ts), rows, rank]


def _decoded(raw: msgspec.Raw) -> Any:
    """msgpack bytes decoded, or, where they do not decode, the bytes themselves."""
    try:
        return msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        return ("undecodable", bytes(raw))

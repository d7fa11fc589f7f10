"""Message bodies: numpy arrays, aux bytes, END and ABORT, to and from wire pieces.

A message body is `u32 descriptor length | descriptor (JSON) | zero padding | data`. Data
starts at the first multiple of 64 bytes after the descriptor. For layer kinds the
descriptor lists each array's name, dtype (numpy `dtype.str`, e.g. "<f2", "<u2" for bf16
bits) and shape, plus the optional block range; data is the arrays' C-order bytes in the
listed order, each array starting at a multiple of 64 bytes from the start of the body
(zero padding between them), so received arrays are aligned. Encoding takes views (no copy
of contiguous arrays); decoding makes writable arrays over one buffer.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import orjson


class LayerArrays(Mapping[str, np.ndarray]):
    """A received layer's arrays by name, with the FULL_KV block range if one was sent."""

    def __init__(self, arrays: dict[str, np.ndarray], blocks: tuple[int, int] | None) -> None:
        self._arrays = arrays
        self.blocks = blocks
        """[start, end) block indices a FULL_KV message covers, or None."""

    def __getitem__(self, name: str) -> np.ndarray:
        return self._arrays[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def __repr__(self) -> str:
        shapes = {k: (v.dtype.str, v.shape) for k, v in self._arrays.items()}
        return f"LayerArrays({shapes}, blocks={self.blocks})"


ALIGN = 64


def align(offset: int) -> int:
    """`offset` rounded up to a multiple of ALIGN."""
    return -(-offset // ALIGN) * ALIGN


def _with_descriptor(desc: dict[str, Any], data: list[memoryview]) -> list[bytes | memoryview]:
    """Descriptor, then each data view at the next ALIGN boundary (zero padding between)."""
    head = orjson.dumps(desc)
    first = len(head).to_bytes(4, "little") + head
    first += bytes(align(len(first)) - len(first))
    pieces: list[bytes | memoryview] = [first]
    position = len(first)
    for view in data:
        if position != align(position):
            pieces.append(bytes(align(position) - position))
            position = align(position)
        pieces.append(view)
        position += view.nbytes
    return pieces


def encode_arrays(
    arrays: Mapping[str, np.ndarray], blocks: tuple[int, int] | None
) -> list[bytes | memoryview]:
    """Wire pieces of a layer message; raises ValueError on an unsendable array."""
    entries = []
    data: list[memoryview] = []
    for name, array in arrays.items():
        if not isinstance(array, np.ndarray):
            raise ValueError(f"array {name!r} is a {type(array).__name__}, not a numpy array")
        if array.dtype.hasobject or array.dtype.fields is not None:
            raise ValueError(f"array {name!r} has unsupported dtype {array.dtype}")
        contiguous = array if array.flags.c_contiguous else np.ascontiguousarray(array)
        entries.append({"name": name, "dtype": contiguous.dtype.str, "shape": contiguous.shape})
        data.append(contiguous.reshape(-1).view(np.uint8).data)
    if blocks is not None and not (0 <= blocks[0] <= blocks[1]):
        raise ValueError(
            f"blocks must be a [start, end) range with 0 <= start <= end, got {blocks}"
        )
    desc = {"arrays": entries, "blocks": list(blocks) if blocks is not None else None}
    return _with_descriptor(desc, data)


def encode_named(desc: dict[str, Any], payload: bytes = b"") -> list[bytes | memoryview]:
    """Wire pieces of an AUX / END / ABORT message: descriptor plus raw bytes."""
    return _with_descriptor(desc, [memoryview(payload)] if payload else [])


def split_body(body: bytes | bytearray | memoryview) -> tuple[dict[str, Any], memoryview, int]:
    """(descriptor, the body as a byte view, offset of its data); ValueError if malformed."""
    view = memoryview(body).cast("B")
    if len(view) < 4:
        raise ValueError(f"message body of {len(view)} bytes is shorter than its length prefix")
    size = int.from_bytes(bytes(view[:4]), "little")
    if align(4 + size) > len(view):
        raise ValueError(f"descriptor length {size} exceeds the body ({len(view)} bytes)")
    desc = orjson.loads(bytes(view[4 : 4 + size]))
    if not isinstance(desc, dict):
        raise ValueError("message descriptor is not a JSON object")
    return desc, view, align(4 + size)


def decode_arrays(desc: dict[str, Any], body: memoryview, offset: int) -> LayerArrays:
    """Arrays described by `desc` in `body` from `offset` on (writable if `body` is).

    Raises:
        ValueError: the arrays do not exactly fill the body, or the descriptor is malformed.
    """
    arrays: dict[str, np.ndarray] = {}
    for entry in desc["arrays"]:
        dtype = np.dtype(entry["dtype"])
        shape = tuple(int(n) for n in entry["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        offset = align(offset)
        if offset + count * dtype.itemsize > len(body):
            raise ValueError(f"array {entry['name']!r} overruns the message data")
        flat = np.frombuffer(body, dtype=dtype, count=count, offset=offset)
        arrays[str(entry["name"])] = flat.reshape(shape)
        offset += count * dtype.itemsize
    if offset != len(body):
        raise ValueError(f"message has {len(body) - offset} trailing bytes")
    blocks = desc.get("blocks")
    return LayerArrays(arrays, (int(blocks[0]), int(blocks[1])) if blocks else None)

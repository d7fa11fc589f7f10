"""`Transfer`: one room on the decode side; reassembles frames into ordered messages.

Frames of a message (split into parts, striped over connections) are collected until
complete; complete messages are released strictly in message order (the order the prefill
side sent them). Every payload was checksum-verified before it gets here; a message that
does not decode, or any failure, drops everything received so far: nothing half-verified
or after an error is ever handed over.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from prfaas.engines.transport.errors import TransferError
from prfaas.engines.transport.frames import LAYER_KINDS, Header, Kind
from prfaas.engines.transport.payload import LayerArrays, decode_arrays, split_body


class LayerItem(NamedTuple):
    """One received layer: unpacks as `(layer, kind, arrays)`; `arrays.blocks` is the range."""

    layer: int
    kind: Kind
    arrays: LayerArrays


@dataclass(frozen=True)
class TransferResult:
    """A complete, verified transfer: layers (not already taken by iteration) in the order
    sent, every aux payload by name, and the total message bytes received."""

    room: int
    layers: tuple[LayerItem, ...]
    aux: dict[str, bytes]
    nbytes: int


class TransferOwner(Protocol):
    """The connection pool a transfer lives on (called on the event loop)."""

    def send_done(self, room: int) -> None: ...
    def send_cancel(self, room: int, reason: str) -> None: ...
    def forget(self, room: int) -> None: ...
    def buffer_changed(self, delta: int) -> None: ...
    def describe(self) -> str: ...
    @property
    def max_message_bytes(self) -> int: ...


class _Partial:
    """A message being received: its final buffer, filled part by part in place."""

    __slots__ = ("body", "count", "kind", "layer", "received", "size")

    def __init__(self, header: Header) -> None:
        self.kind = header.kind
        self.layer = header.layer
        # uninitialised (the kernel writes every byte before anything reads it) and
        # 64-byte aligned, so the arrays the payload places at 64-byte offsets are too
        raw = np.empty(header.total + 63, dtype=np.uint8)
        start = -raw.ctypes.data % 64
        self.body = raw[start : start + header.total].data
        self.received = bytearray(header.parts)
        self.count = 0
        self.size = 0

    def matches(self, header: Header) -> bool:
        return (self.kind, self.layer, len(self.received), len(self.body)) == (
            header.kind,
            header.layer,
            header.parts,
            header.total,
        )


_Decoded = tuple[Kind, int, object]  # kind, layer, LayerArrays | (name, bytes) | END count


class Transfer:
    """One room being fetched. Iterate it for layers as they arrive, or await `complete()`."""

    def __init__(self, room: int, owner: TransferOwner, timeout_s: float) -> None:
        self.room = room
        self._owner = owner
        self._timeout_s = timeout_s
        self._partials: dict[int, _Partial] = {}
        self._ready: dict[int, _Decoded] = {}
        self._next = 0
        self._items: deque[LayerItem] = deque()
        self._buffered = 0
        self._aux: dict[str, bytes] = {}
        self.nbytes = 0
        self._ended = False
        self._error: TransferError | None = None
        self._event = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(timeout_s, self._timed_out)

    # -- consumer ------------------------------------------------------------------------

    async def __aiter__(self) -> AsyncIterator[LayerItem]:
        """Layers in the order the prefill side sent them, each as soon as it is verified.

        Raises (from iteration):
            TransferError: timeout, abort, corruption, or unrecoverable connection loss.
        """
        while True:
            if self._error is not None:
                raise self._error
            if self._items:
                yield self._take()
            elif self._ended:
                return
            else:
                self._event.clear()
                await self._event.wait()

    async def complete(self) -> TransferResult:
        """Wait for every message up to END; layers not already taken by iteration.

        Raises:
            TransferError: as for iteration.
        """
        layers = [item async for item in self]
        return TransferResult(self.room, tuple(layers), dict(self._aux), self.nbytes)

    def aux(self, name: str) -> bytes | None:
        """An aux payload received so far (None if not yet)."""
        return self._aux.get(name)

    @property
    def failed(self) -> TransferError | None:
        """The error, if the transfer failed."""
        return self._error

    @property
    def finished(self) -> bool:
        """Whether END was delivered (all messages verified) or the transfer failed."""
        return self._ended or self._error is not None

    def cancel(self, reason: str = "cancelled by decode") -> None:
        """Give up: the prefill side's `wait()` raises; iteration raises TransferError.

        On a transfer that already completed this just drops the layers not yet taken
        (a consumer that stops early must call it, or its layers keep the buffer full).
        """
        if self._ended:
            self._items.clear()
            self._owner.buffer_changed(-self._buffered)
            self._buffered = 0
            return
        self.fail(reason)

    def _take(self) -> LayerItem:
        item = self._items.popleft()
        size = sum(a.nbytes for a in item.arrays.values())
        self._buffered -= size
        self._owner.buffer_changed(-size)
        return item

    # -- the connection pool ---------------------------------------------------------------

    def slot(self, header: Header) -> memoryview | None:
        """Where the payload of `header` goes, or None if it is not needed (duplicate)."""
        if self.finished or header.msg < self._next or header.msg in self._ready:
            return None
        partial = self._partials.get(header.msg)
        if partial is None:
            if header.total > self._owner.max_message_bytes:
                self.fail(f"message {header.msg} of {header.total} bytes exceeds the limit")
                return None
            partial = self._partials[header.msg] = _Partial(header)
        if not partial.matches(header):
            self.fail(f"message {header.msg}: frames disagree on kind/layer/parts/size")
            return None
        if partial.received[header.part]:
            return None
        return partial.body[header.offset : header.offset + header.length]

    def needs(self, header: Header) -> bool:
        """Whether the frame's payload (already in its slot) is still wanted."""
        partial = self._partials.get(header.msg)
        return not self.finished and partial is not None and not partial.received[header.part]

    def frame_done(self, header: Header, intact: bool) -> None:
        """A frame's payload landed in its slot; `intact` is its checksum verdict."""
        if not intact:
            self.fail(
                f"checksum mismatch in message {header.msg} part {header.part} "
                f"({header.kind.name}, layer {header.layer})"
            )
            return
        partial = self._partials[header.msg]
        partial.received[header.part] = 1
        partial.count += 1
        partial.size += header.length
        if partial.count < len(partial.received):
            return
        del self._partials[header.msg]
        self._complete_message(header.msg, partial)

    def _complete_message(self, msg: int, partial: _Partial) -> None:
        if partial.size != len(partial.body):
            self.fail(f"message {msg}: parts cover {partial.size} of {len(partial.body)} bytes")
            return
        self.nbytes += partial.size
        try:
            self._ready[msg] = (partial.kind, partial.layer, _decode(partial.kind, partial.body))
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            self.fail(f"message {msg} ({partial.kind.name}) is malformed: {exc}")
            return
        while self._next in self._ready and not self.finished:
            self._deliver(self._next, *self._ready.pop(self._next))
            self._next += 1
        self._event.set()

    def _deliver(self, msg: int, kind: Kind, layer: int, value: object) -> None:
        if isinstance(value, LayerArrays):
            size = sum(a.nbytes for a in value.values())
            self._items.append(LayerItem(layer, kind, value))
            self._buffered += size
            self._owner.buffer_changed(size)
        elif isinstance(value, tuple):
            self._aux[value[0]] = value[1]
        elif value != msg + 1:
            self.fail(f"END announces {value} messages but is message {msg + 1}")
        else:
            self._ended = True
            self._timer.cancel()
            self._owner.send_done(self.room)
            self._owner.forget(self.room)

    def fail(self, reason: str, *, tell_sender: bool = True) -> None:
        """Fail the transfer, drop everything buffered, and (by default) CANCEL at the sender."""
        if self.finished:
            return
        self._error = TransferError(self.room, reason)
        self._timer.cancel()
        self._items.clear()
        self._partials.clear()
        self._ready.clear()
        self._owner.buffer_changed(-self._buffered)
        self._buffered = 0
        if tell_sender:
            self._owner.send_cancel(self.room, reason)
        self._owner.forget(self.room)
        self._event.set()

    def _timed_out(self) -> None:
        self.fail(
            f"timed out after {self._timeout_s} s with {self._next} messages delivered "
            f"({self._owner.describe()})"
        )


def _decode(kind: Kind, body: memoryview) -> object:
    desc, view, offset = split_body(body)
    if kind in LAYER_KINDS:
        return decode_arrays(desc, view, offset)
    if kind is Kind.AUX:
        return (str(desc["name"]), bytes(view[offset:]))
    if kind is Kind.END:
        return int(desc["messages"])
    raise ValueError(f"{kind.name} is not a transfer message kind")

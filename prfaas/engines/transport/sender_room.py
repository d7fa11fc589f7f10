"""`SendHandle`: one transfer (room) on the prefill side.

The public methods run on any thread: they validate and encode in the caller's thread
(errors raise there, at once) and post the message to the event loop, which owns every
piece of loop-side state below (`_accept`, `_bind`, `_fail`, ...).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from prfaas.engines.transport.errors import TransferError
from prfaas.engines.transport.frames import LAYER_KINDS, NO_LAYER, Kind, split_message
from prfaas.engines.transport.payload import encode_arrays, encode_named
from prfaas.engines.transport.sender_peer import SenderPeer
from prfaas.engines.transport.wire import reason_frame

MAX_ROOM = 2**64 - 1
MAX_LAYER = NO_LAYER - 1


def check_room(room: object) -> None:
    """Raises ValueError unless `room` is a transfer's room number (a u64)."""
    if not isinstance(room, int) or not 0 <= room <= MAX_ROOM:
        raise ValueError(f"room must be an integer in 0..2**64-1, got {room!r}")


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One numbered message of a room, encoded."""

    kind: Kind
    msg: int
    layer: int
    pieces: list[bytes | memoryview]


class SendHandle:
    """One transfer (room) on the prefill side. Every method but `wait` is thread-safe and
    returns immediately; the event loop that started the sender owns the sockets."""

    def __init__(
        self,
        room: int,
        loop: asyncio.AbstractEventLoop,
        chunk_bytes: int,
        pipelined: bool,
        on_close: Callable[[SendHandle, str | None], None],
    ) -> None:
        self.room = room
        self._loop = loop
        self._chunk_bytes = chunk_bytes
        self._pipelined = pipelined
        self._on_close = on_close
        self._lock = threading.Lock()
        self._next_msg = 0
        self._layers: set[int] = set()
        self._state = "open"  # open -> finished | aborted (caller side)
        self._done: asyncio.Future[None] = loop.create_future()
        self._done.add_done_callback(lambda f: f.cancelled() or f.exception())
        # loop-side state
        self.peer: SenderPeer | None = None
        self._pending: list[Outgoing] = []
        self._ended = False
        self.timers: list[asyncio.TimerHandle] = []

    # -- any thread ----------------------------------------------------------------------

    def send_layer(
        self,
        layer: int,
        kind: Kind,
        arrays: Mapping[str, np.ndarray],
        *,
        blocks: tuple[int, int] | None = None,
    ) -> None:
        """Queue one layer's arrays (FULL_KV, LINEAR_STATE or SWA_KV) for sending.

        The arrays are referenced, not copied (non-contiguous ones are made contiguous):
        do not modify them until `wait()` returns. `blocks` is the [start, end) block-index
        range a FULL_KV message covers. Layers arrive at the decode side in the order sent;
        each layer number at most once per room. Once the transfer has failed (see `done`,
        `wait()`) or been aborted (`abort`, from any thread: a request given up while its
        forward pass runs), further sends are dropped silently so that the forward pass,
        and every other request computed in it, is not interrupted.

        Raises:
            ValueError: bad kind or layer, duplicate layer, unsendable array, or after
                finish.
        """
        if kind not in LAYER_KINDS:
            raise ValueError(
                f"kind must be one of {sorted(k.name for k in LAYER_KINDS)}, got {kind!r}"
            )
        if not 0 <= layer <= MAX_LAYER:
            raise ValueError(f"layer must be in 0..{MAX_LAYER}, got {layer}")
        pieces = encode_arrays(arrays, blocks)
        with self._lock:
            if layer in self._layers:
                raise ValueError(f"room {self.room}: layer {layer} was already sent")
            msg = self._claim()
            self._layers.add(layer)
        if msg is not None:
            self._post(Outgoing(Kind(kind), msg, layer, pieces))

    def send_aux(self, name: str, payload: bytes) -> None:
        """Queue named bytes (first token, JSON metadata); ordered with the layers (dropped
        once aborted, as `send_layer`)."""
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise ValueError(f"aux payload must be bytes, got {type(payload).__name__}")
        pieces = encode_named({"name": str(name)}, bytes(payload))
        with self._lock:
            msg = self._claim()
        if msg is not None:
            self._post(Outgoing(Kind.AUX, msg, NO_LAYER, pieces))

    def finish(self) -> None:
        """No more messages; queue END. In non-pipelined mode this releases everything.
        Nothing once aborted."""
        with self._lock:
            msg = self._claim()
            if msg is None:
                return
            self._state = "finished"
        self._post(Outgoing(Kind.END, msg, NO_LAYER, encode_named({"messages": msg + 1})))

    def abort(self, reason: str) -> None:
        """Give up the transfer: the decode side's fetch raises TransferError(reason)."""
        with self._lock:
            if self._state == "aborted":
                return
            self._state = "aborted"
        self._loop.call_soon_threadsafe(self.fail, f"aborted by prefill: {reason}")

    def _claim(self) -> int | None:
        """The next message's number; None once aborted (the message is dropped).

        Raises:
            ValueError: after `finish`.
        """
        if self._state == "aborted":
            return None
        if self._state != "open":
            raise ValueError(f"room {self.room}: transfer already {self._state}")
        msg = self._next_msg
        self._next_msg += 1
        return msg

    def _post(self, message: Outgoing) -> None:
        self._loop.call_soon_threadsafe(self._accept, message)

    async def wait(self) -> None:
        """Return once the decode side confirmed delivery (all checksums verified).

        Raises:
            TransferError: aborted, timed out, peer lost, or the decode side reported an error.
        """
        await asyncio.shield(self._done)

    @property
    def done(self) -> bool:
        """Whether the transfer has finished (delivered or failed)."""
        return self._done.done()

    # -- event loop only -------------------------------------------------------------------

    def deliver(self, kind: Kind, msg: int, layer: int, pieces: list[bytes | memoryview]) -> None:
        """Take a message numbered and encoded elsewhere (an engine's, through its sender
        process: `process_sender.py`), as if posted here."""
        self._accept(Outgoing(kind, msg, layer, pieces))

    def _accept(self, message: Outgoing) -> None:
        if self._done.done():
            return
        self._pending.append(message)
        if message.kind is Kind.END:
            self._ended = True
        self._flush()

    def bind(self, peer: SenderPeer) -> None:
        """A decode peer registered for this room: start sending to it."""
        self.peer = peer
        self._flush()

    def _flush(self) -> None:
        if self.peer is None or not (self._pipelined or self._ended):
            return
        for message in sorted(self._pending, key=lambda m: m.msg):
            self.peer.push(
                split_message(
                    message.kind,
                    self.room,
                    message.msg,
                    message.layer,
                    message.pieces,
                    self._chunk_bytes,
                )
            )
        self._pending.clear()

    def complete(self) -> None:
        """The decode side confirmed delivery."""
        if not self._done.done():
            self._done.set_result(None)
            self._close(None)

    def fail(self, reason: str, *, tell_peer: bool = True) -> None:
        """Fail the transfer; by default tell the bound peer with an ABORT frame."""
        if self._done.done():
            return
        self._done.set_exception(TransferError(self.room, reason))
        if self.peer is not None:
            self.peer.purge(self.room)
            if tell_peer:
                self.peer.push_control(reason_frame(Kind.ABORT, self.room, reason))
        self._close(reason)

    def _close(self, reason: str | None) -> None:
        self._pending.clear()
        for timer in self.timers:
            timer.cancel()
        self._on_close(self, reason)

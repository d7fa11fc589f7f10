"""The channel between an engine and its sender process (`process_sender.py`): a byte ring
in shared memory that carries the messages' bytes, and the small commands and replies that
travel over two pipes beside it.

The ring has one writer (the engine) and one reader (the sender process). The writer places
each message's bytes contiguously at increasing absolute positions (skipping to the ring's
start where a message would not fit before its end); the reader sends from the ring itself
(or copies a message out) and publishes how far the ring is free again in its first eight
bytes. So the engine never waits for a reply to reuse space, and a message costs the engine
one copy into the ring (numpy's, which releases the GIL) and one small command: the
engine's interpreter does no socket work.
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from prfaas.engines.transport.config import SenderConfig
from prfaas.engines.transport.frames import Kind
from prfaas.engines.transport.telemetry import TransportTelemetry

HEADER = 64
"""Bytes before the ring's data: the reader's position (an int64) in the first eight."""
INLINE_BYTES = 64 * 1024
"""Messages up to this size travel inside their command, not through the ring."""
PARTS_OF_RING = 4
"""A message larger than a quarter of the ring crosses it in parts of that size, assembled
in the sender process."""


class RingClosed(Exception):
    """The ring's reader is gone: the bytes can no longer be delivered."""


class SharedRing:
    """A byte ring over a shared memory file (a `memfd`: not bounded by `/dev/shm`'s size).

    One writer process and one reader process; the writer's methods are called under its
    own lock."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self._map = mmap.mmap(fd, HEADER + size)
        self._tail = np.frombuffer(self._map, dtype=np.int64, count=1)
        self._data = np.frombuffer(self._map, dtype=np.uint8, count=size, offset=HEADER)
        self._head = 0

    @classmethod
    def create(cls, size: int) -> SharedRing:
        """A new ring of `size` bytes (its file descriptor is passed to the reader).

        Raises:
            OSError: the shared memory cannot be created.
        """
        fd = os.memfd_create("prfaas-kv-ring")  # close-on-exec: the child gets it by pass_fds
        try:
            os.ftruncate(fd, HEADER + size)
            return cls(fd, size)
        except BaseException:
            os.close(fd)
            raise

    # -- the writer ---------------------------------------------------------------------

    @property
    def part_bytes(self) -> int:
        """The largest message placed whole; larger ones cross in parts of this size."""
        return self.size // PARTS_OF_RING

    def write(
        self, pieces: Sequence[bytes | memoryview], nbytes: int, alive: Callable[[], bool]
    ) -> int:
        """Place the concatenation of `pieces` (`nbytes` in all, at most `size`), waiting
        for the reader to free room; its absolute start position.

        Raises:
            RingClosed: `alive()` turned false while waiting (the reader is gone).
        """
        start = self._head
        if start % self.size + nbytes > self.size:  # would wrap: start at the ring's start
            start += self.size - start % self.size
        end = start + nbytes
        pause = 0.0001
        while end - int(self._tail[0]) > self.size:
            if not alive():
                raise RingClosed("the sender process is gone")
            time.sleep(pause)  # releases the GIL; the reader frees room within milliseconds
            pause = min(pause * 2, 0.002)
        at = start % self.size
        for piece in pieces:
            view = np.frombuffer(piece, dtype=np.uint8)
            self._data[at : at + len(view)] = view
            at += len(view)
        self._head = end
        return start

    # -- the reader ---------------------------------------------------------------------

    def view(self, start: int, nbytes: int) -> np.ndarray:
        """The message at `start`, in place (valid until its room is given back)."""
        at = start % self.size
        return self._data[at : at + nbytes]

    def free_to(self, position: int) -> None:
        """Give the ring back to the writer up to the absolute `position` (in order)."""
        self._tail[0] = position

    def close(self) -> None:
        """Unmap the ring and close its file (no view of it may be used afterwards)."""
        del self._tail, self._data
        self._map.close()
        os.close(self.fd)


# ---- engine -> sender process ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Start:
    """The first command: the sender's configuration (its auth key never on a command
    line)."""

    config: SenderConfig
    max_held_bytes: int
    """Message bytes of rooms without a peer the sender process may hold copied out before
    it leaves further messages in the ring (the engine's writes then wait)."""


@dataclass(frozen=True, slots=True)
class Open:
    """Open `room`; `serial` names this opening (a room number may be opened again once its
    transfer ended, and a late message or end of the old one must not touch the new)."""

    room: int
    serial: int


@dataclass(frozen=True, slots=True)
class Message:
    """One numbered message of an opening, or one part of it: `nbytes` in the ring at
    `start`, or `inline`. A message in parts has one command per part, in order, each
    naming the whole message's size (`total`) and where the part lies in it (`offset`)."""

    room: int
    serial: int
    kind: Kind
    msg: int
    layer: int
    start: int
    nbytes: int
    inline: bytes | None = None
    offset: int = 0
    total: int = -1
    """The whole message's size (-1: the message is whole, `nbytes`)."""


@dataclass(frozen=True, slots=True)
class Abort:
    """Fail an opening's transfer (the decode side is told `reason`)."""

    room: int
    serial: int
    reason: str


@dataclass(frozen=True, slots=True)
class Rate:
    """Re-pace the egress."""

    bytes_per_s: float


@dataclass(frozen=True, slots=True)
class Close:
    """Fail what is open, close the sender, exit."""


Command = Start | Open | Message | Abort | Rate | Close


# ---- sender process -> engine ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Started:
    """The sender listens on `port`."""

    port: int


@dataclass(frozen=True, slots=True)
class StartFailed:
    error: str
    """The exception's type and text."""
    value_error: bool
    """A configuration the sender refused (ValueError), else an OSError."""


@dataclass(frozen=True, slots=True)
class Done:
    """An opening's transfer ended: delivered (`reason` None) or failed (or never opened)."""

    room: int
    serial: int
    reason: str | None


@dataclass(frozen=True, slots=True)
class Snapshot:
    telemetry: TransportTelemetry
    held_bytes: int
    """Message bytes copied out of the ring and not yet delivered."""
    copied_bytes: int
    """Message bytes copied out of the ring since the start (those of a room with no peer
    yet, or not pipelined); the others were sent from the ring."""


Reply = Started | StartFailed | Done | Snapshot


_LENGTH = struct.Struct("!i")


def framed(reply: Reply) -> bytes:
    """`reply` framed for the pipe: a big-endian i32 length, then the pickle (as
    `multiprocessing.connection.Connection.send` frames it)."""
    data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(data)) + data


class ReplyFrames:
    """Replies out of the bytes read from the pipe, however the reads split the frames (an
    event-loop reader must not block on a frame half written)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Reply]:
        """The replies `data` completes, in order."""
        self._buffer += data
        replies: list[Reply] = []
        at = 0
        while len(self._buffer) - at >= _LENGTH.size:
            (n,) = _LENGTH.unpack_from(self._buffer, at)
            end = at + _LENGTH.size + n
            if len(self._buffer) < end:
                break
            replies.append(pickle.loads(memoryview(self._buffer)[at + _LENGTH.size : end]))
            at = end
        del self._buffer[:at]
        return replies

"""The sender process's main: a `KVSender` on an event loop of its own, fed by an engine's
`ProcessSender` through the channel in `process_channel.py`.

    python -m prfaas.engines.transport.sender_process CMD_FD REPLY_FD RING_FD RING_BYTES \
        LISTEN_FD[,LISTEN_FD...]

It serves the bootstrap listener its engine bound (so that a process started after one died
keeps the port). It reads commands as they come and hands each message to its opening's
`SendHandle`, numbered as the engine numbered it. A message for a room whose decode peer is
connected and that sends as it goes (pipelined) is sent from the ring itself; its room in
the ring goes back once every frame of it has been let go (delivered, or the transfer
failed), in order, so one stalled peer holds the ring for every room until its transfer
fails. Any other message would wait in the ring for a peer or for the transfer's end, which
could hold the ring full while the engine waits to write the message that ends it: it is
copied out, its room given back at once; so is a message that crossed the ring in parts,
assembled here. Pipelined, what it holds copied out is bounded (`Start.max_held_bytes`):
past it, messages stay in the ring, unread, until some of it is let go, and the engine's
writer waits as it waits for its host budget with the sender in its own process; other
commands are still read. Send-after (not pipelined) holds every message until its transfer
ends, unbounded, as the in-process sender does.

Replies never block its loop: they are buffered, and a periodic snapshot is skipped while
earlier replies wait. It exits on `Close`, or when the engine's end of the command channel
closes (the engine is gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import weakref
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection

import numpy as np

from prfaas.engines.transport.errors import TransferError
from prfaas.engines.transport.process_channel import (
    Abort,
    Close,
    Command,
    Done,
    Message,
    Open,
    Rate,
    Reply,
    SharedRing,
    Snapshot,
    Start,
    Started,
    StartFailed,
    framed,
)
from prfaas.engines.transport.sender import KVSender
from prfaas.engines.transport.sender_room import SendHandle

logger = logging.getLogger(__name__)

SNAPSHOT_S = 0.25
"""How often the telemetry goes to the engine (its `/stats` reads the latest)."""
READ_BATCH = 64
"""Commands read per wake-up of the loop, so that a busy engine cannot starve the sockets."""


class SenderProcess:
    """Serves one engine's commands until `Close`, or until the engine's end of the
    channel closes."""

    def __init__(
        self,
        commands: Connection,
        reply_fd: int,
        ring: SharedRing,
        listeners: Sequence[socket.socket],
    ) -> None:
        self._commands = commands
        self._listeners = listeners
        self._reply_fd = reply_fd
        self._replies: asyncio.WriteTransport | None = None
        self._ring = ring
        self._sender: KVSender | None = None
        self._rooms: dict[int, tuple[int, SendHandle]] = {}
        """room -> (serial, handle) of its current opening."""
        self._waiters: set[asyncio.Task[None]] = set()
        self._stopped = asyncio.Event()
        self._pipelined = True
        self._held = 0
        self._copied = 0
        self._max_held = 0
        self._assembling: dict[tuple[int, int, int], np.ndarray] = {}
        """(room, serial, msg) -> the buffer of a message crossing in parts."""
        self._deferred: deque[Message] = deque()
        """Messages read while too much was held copied out, in order (left in the ring)."""
        self._spans: deque[list[int]] = deque()
        """[end, released] of each ring message in order: the ring is free up to the end of
        the released ones at its front."""

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        pipe = os.fdopen(self._reply_fd, "wb", buffering=0)
        self._replies, _ = await loop.connect_write_pipe(asyncio.Protocol, pipe)
        first = self._commands.recv()
        if not isinstance(first, Start):
            raise RuntimeError(f"expected Start, got {type(first).__name__}")
        self._sender = KVSender(first.config)
        self._max_held = first.max_held_bytes
        self._pipelined = first.config.pipelined
        try:
            await self._sender.start(self._listeners)
        except (OSError, ValueError) as exc:
            self._reply(StartFailed(f"{type(exc).__name__}: {exc}", isinstance(exc, ValueError)))
            await self._flushed()
            return
        self._reply(Started(self._sender.bootstrap_port))
        loop.add_reader(self._commands.fileno(), self._read)
        snapshots = asyncio.create_task(self._snapshots())
        try:
            await self._stopped.wait()
        finally:
            loop.remove_reader(self._commands.fileno())
            snapshots.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await snapshots
            await self._sender.close()
            for task in list(self._waiters):
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self._flushed()

    # -- commands --------------------------------------------------------------------------

    def _read(self) -> None:
        try:
            for _ in range(READ_BATCH):
                if self._stopped.is_set() or not self._commands.poll():
                    return
                self._serve(self._commands.recv())
        except (EOFError, OSError):  # the engine is gone
            self._stopped.set()

    def _serve(self, command: Command) -> None:
        assert self._sender is not None
        if isinstance(command, Message):
            if self._deferred or not self._may_take(command):
                self._deferred.append(command)  # after those before it, in order
            else:
                self._deliver(command)
        elif isinstance(command, Open):
            self._open(command)
        elif isinstance(command, Abort):
            opened = self._rooms.get(command.room)
            if opened is not None and opened[0] == command.serial:
                opened[1].fail(f"aborted by prefill: {command.reason}")
            self._drop_assembling(command.room, command.serial)
        elif isinstance(command, Rate):
            self._sender.set_process_rate(command.bytes_per_s)
        elif isinstance(command, Close):
            self._stopped.set()

    def _open(self, command: Open) -> None:
        assert self._sender is not None
        try:
            handle = self._sender.open(command.room)
        except (ValueError, RuntimeError) as exc:  # the engine's handle must still end
            self._reply(Done(command.room, command.serial, f"could not open: {exc}"))
            return
        self._rooms[command.room] = (command.serial, handle)
        task = asyncio.create_task(self._watch(command.serial, handle))
        self._waiters.add(task)
        task.add_done_callback(self._waiters.discard)

    async def _watch(self, serial: int, handle: SendHandle) -> None:
        reason = None
        try:
            await handle.wait()
        except TransferError as exc:
            reason = exc.reason
        finally:
            if self._rooms.get(handle.room) == (serial, handle):
                del self._rooms[handle.room]
            self._drop_assembling(handle.room, serial)
        self._reply(self._snapshot())  # fresh when the engine sees the end
        self._reply(Done(handle.room, serial, reason))

    # -- messages and the ring -------------------------------------------------------------

    def _deliver(self, command: Message) -> None:
        opened = self._rooms.get(command.room)
        handle = opened[1] if opened is not None and opened[0] == command.serial else None
        if command.total >= 0:
            data = self._assembled(command, handle)
        else:
            data = self._bytes(command, handle)  # always: the ring's room must come back
        if handle is not None and data is not None:
            handle.deliver(command.kind, command.msg, command.layer, [data])

    def _assembled(self, part: Message, handle: SendHandle | None) -> memoryview | None:
        """Add one part of a message crossing in parts to its buffer (held); the message once
        its last part came (None before, or when its opening is gone)."""
        key = (part.room, part.serial, part.msg)
        buffer = self._assembling.get(key)
        if buffer is None and handle is not None:
            buffer = self._assembling[key] = self._held_buffer(part.total)
        span = [part.start + part.nbytes, 0]  # parts are never inline: they are large
        self._spans.append(span)
        if buffer is not None:
            buffer[part.offset : part.offset + part.nbytes] = self._ring.view(
                part.start, part.nbytes
            )
        self._free(span)
        if part.offset + part.nbytes < part.total:
            return None
        buffer = self._assembling.pop(key, None)
        return None if buffer is None or handle is None else buffer.data

    def _may_take(self, command: Message) -> bool:
        """Whether to take `command` out of the ring now: not while too much is held copied
        out, unless it continues a message whose first part was taken (its buffer is held
        until the rest comes; the parts of a message come one after the other) or its
        opening is gone (its room in the ring is given back at once)."""
        if not self._pipelined or self._held < self._max_held:
            return True
        if (command.room, command.serial, command.msg) in self._assembling:
            return True
        opened = self._rooms.get(command.room)
        return opened is None or opened[0] != command.serial

    def _drop_assembling(self, room: int, serial: int) -> None:
        """Let go of the half-assembled messages of an opening that ended (their held bytes
        go back; a later part finds no buffer and is dropped)."""
        for key in [k for k in self._assembling if k[:2] == (room, serial)]:
            del self._assembling[key]

    def _bytes(self, command: Message, handle: SendHandle | None) -> memoryview:
        """The message's bytes: inline, in the ring (a connected pipelined room's), or copied
        out (counted as held until the last reference to them is dropped)."""
        if command.inline is not None:
            return memoryview(command.inline)
        span = [command.start + command.nbytes, 0]
        self._spans.append(span)
        view = self._ring.view(command.start, command.nbytes)
        if handle is None:  # its opening is gone: nothing to send
            self._free(span)
            return memoryview(b"")
        if handle.peer is not None and self._pipelined:
            weakref.finalize(view, self._free, span)
            return view.data  # a memoryview that keeps `view` alive
        data = self._held_buffer(command.nbytes)
        data[:] = view
        self._free(span)
        return data.data

    def _held_buffer(self, nbytes: int) -> np.ndarray:
        """A buffer for bytes copied out, counted as held until it is let go."""
        data = np.empty(nbytes, dtype=np.uint8)
        self._held += nbytes
        self._copied += nbytes
        weakref.finalize(data, self._released, nbytes)
        return data

    def _free(self, span: list[int]) -> None:
        """A ring message let go: give the ring back up to the end of the released ones at
        its front."""
        span[1] = 1
        end = None
        while self._spans and self._spans[0][1]:
            end = self._spans.popleft()[0]
        if end is not None:
            self._ring.free_to(end)

    def _released(self, nbytes: int) -> None:
        self._held -= nbytes
        if self._deferred and not self._stopped.is_set():
            with contextlib.suppress(RuntimeError):  # no loop: the process is ending
                asyncio.get_running_loop().call_soon(self._undefer)

    def _undefer(self) -> None:
        while self._deferred and self._may_take(self._deferred[0]):
            self._deliver(self._deferred.popleft())

    # -- replies ---------------------------------------------------------------------------

    async def _snapshots(self) -> None:
        while True:
            if self._replies is not None and not self._replies.get_write_buffer_size():
                self._reply(self._snapshot())  # none while earlier replies wait
            await asyncio.sleep(SNAPSHOT_S)

    def _snapshot(self) -> Snapshot:
        assert self._sender is not None
        return Snapshot(self._sender.telemetry(), self._held, self._copied)

    def _reply(self, reply: Reply) -> None:
        if self._replies is not None and not self._replies.is_closing():
            self._replies.write(framed(reply))  # buffered: never blocks the loop

    async def _flushed(self) -> None:
        """Let the buffered replies go (briefly: the engine may be gone)."""
        for _ in range(100):
            if self._replies is None or not self._replies.get_write_buffer_size():
                return
            await asyncio.sleep(0.01)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    cmd_fd, reply_fd, ring_fd, ring_bytes = (int(a) for a in argv[:4])
    listeners = [socket.socket(fileno=int(fd)) for fd in argv[4].split(",")]
    commands = Connection(cmd_fd, writable=False)
    ring = SharedRing(ring_fd, ring_bytes)
    try:
        asyncio.run(SenderProcess(commands, reply_fd, ring, listeners).run())
    except (EOFError, KeyboardInterrupt):  # the engine went before `Start`
        return 1
    finally:
        commands.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

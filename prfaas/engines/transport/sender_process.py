"""The sender process's main: a `KVSender` on an event loop of its own, fed by an engine's
`ProcessSender` through the channel in `process_channel.py`.

    python -m prfaas.engines.transport.sender_process CMD_FD REPLY_FD RING_FD RING_BYTES

It reads commands as they come and hands each message to the room's `SendHandle`, numbered
as the engine numbered it. A message for a room whose decode peer is connected and that
sends as it goes (pipelined) is sent from the ring itself; its room in the ring goes back
once every frame of it has been let go (delivered, or the transfer failed), in order. Any
other message would wait in the ring for a peer or for the transfer's end, which could hold
the ring full while the engine waits to write the message that ends it: it is copied out,
its room given back at once. What it holds copied out is bounded (`Start.max_held_bytes`):
past it, it stops reading commands, the ring fills, and the engine's writer waits, as it
waits for its host budget with the sender in its own process. It reports each room's end and, every
`SNAPSHOT_S`, its telemetry. It exits on `Close`, or when the engine's end of the command
pipe closes (the engine is gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import weakref
from collections import deque
from multiprocessing.connection import Connection

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
)
from prfaas.engines.transport.sender import KVSender
from prfaas.engines.transport.sender_room import SendHandle

logger = logging.getLogger(__name__)

SNAPSHOT_S = 0.25
"""How often the telemetry goes to the engine (its `/stats` reads the latest)."""


class SenderProcess:
    """Serves one engine's commands until `Close` or the engine's end of the pipe closes."""

    def __init__(self, commands: Connection, replies: Connection, ring: SharedRing) -> None:
        self._commands = commands
        self._replies = replies
        self._ring = ring
        self._sender: KVSender | None = None
        self._rooms: dict[int, SendHandle] = {}
        self._waiters: set[asyncio.Task[None]] = set()
        self._stopped = asyncio.Event()
        self._held = 0
        self._copied = 0
        self._max_held = 0
        self._pipelined = True
        self._spans: deque[list[int]] = deque()
        """[end, released] of each ring message in order: the ring is free up to the end of
        the released ones at its front."""
        self._reading = False

    async def run(self) -> None:
        first = self._commands.recv()
        if not isinstance(first, Start):
            raise RuntimeError(f"expected Start, got {type(first).__name__}")
        self._sender = KVSender(first.config)
        self._max_held = first.max_held_bytes
        self._pipelined = first.config.pipelined
        try:
            await self._sender.start()
        except (OSError, ValueError) as exc:
            self._reply(StartFailed(f"{type(exc).__name__}: {exc}", isinstance(exc, ValueError)))
            return
        self._reply(Started(self._sender.bootstrap_port))
        self._resume()
        snapshots = asyncio.create_task(self._snapshots())
        try:
            await self._stopped.wait()
        finally:
            self._pause()
            snapshots.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await snapshots
            await self._sender.close()
            for task in list(self._waiters):
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def _read(self) -> None:
        try:
            while not self._stopped.is_set() and self._commands.poll():
                self._serve(self._commands.recv())
                if self._held >= self._max_held:
                    self._pause()
                    return
        except (EOFError, OSError):  # the engine is gone
            self._stopped.set()

    def _pause(self) -> None:
        if self._reading:
            asyncio.get_running_loop().remove_reader(self._commands.fileno())
            self._reading = False

    def _resume(self) -> None:
        if not self._reading and not self._stopped.is_set():
            asyncio.get_running_loop().add_reader(self._commands.fileno(), self._read)
            self._reading = True

    def _bytes(self, command: Message, handle: SendHandle | None) -> memoryview:
        """The message's bytes: inline, in the ring (a connected pipelined room's), or copied
        out (counted as held until the last reference to them is dropped)."""
        if command.inline is not None:
            return memoryview(command.inline)
        span = [command.start + command.nbytes, 0]
        self._spans.append(span)
        view = self._ring.view(command.start, command.nbytes)
        if handle is not None and handle.peer is not None and self._pipelined:
            weakref.finalize(view, self._free, span)
            return view.data  # a memoryview that keeps `view` alive
        data = view.copy()
        self._free(span)
        self._held += command.nbytes
        self._copied += command.nbytes
        weakref.finalize(data, self._released, command.nbytes)
        return data.data

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
        if self._held < self._max_held and not self._stopped.is_set():
            asyncio.get_running_loop().call_soon(self._resume)

    def _serve(self, command: Command) -> None:
        assert self._sender is not None
        if isinstance(command, Message):
            handle = self._rooms.get(command.room)
            data = self._bytes(command, handle)  # always: the ring's room must come back
            if handle is not None:
                handle.deliver(command.kind, command.msg, command.layer, [data])
        elif isinstance(command, Open):
            handle = self._sender.open(command.room)
            self._rooms[command.room] = handle
            task = asyncio.create_task(self._watch(handle))
            self._waiters.add(task)
            task.add_done_callback(self._waiters.discard)
        elif isinstance(command, Abort):
            handle = self._rooms.get(command.room)
            if handle is not None:
                handle.fail(f"aborted by prefill: {command.reason}")
        elif isinstance(command, Rate):
            self._sender.set_process_rate(command.bytes_per_s)
        elif isinstance(command, Close):
            self._stopped.set()

    async def _watch(self, handle: SendHandle) -> None:
        reason = None
        try:
            await handle.wait()
        except TransferError as exc:
            reason = exc.reason
        finally:
            self._rooms.pop(handle.room, None)
        self._reply(self._snapshot())  # fresh when the engine sees the end
        self._reply(Done(handle.room, reason))

    async def _snapshots(self) -> None:
        while True:
            self._reply(self._snapshot())
            await asyncio.sleep(SNAPSHOT_S)

    def _snapshot(self) -> Snapshot:
        assert self._sender is not None
        return Snapshot(self._sender.telemetry(), self._held, self._copied)

    def _reply(self, reply: Reply) -> None:
        with contextlib.suppress(OSError):  # the engine is gone: `_read` sees it too
            self._replies.send(reply)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    cmd_fd, reply_fd, ring_fd, ring_bytes = (int(a) for a in argv)
    commands = Connection(cmd_fd, writable=False)
    replies = Connection(reply_fd, readable=False)
    ring = SharedRing(ring_fd, ring_bytes)
    try:
        asyncio.run(SenderProcess(commands, replies, ring).run())
    except (EOFError, KeyboardInterrupt):  # the engine went before `Start`
        return 1
    finally:
        commands.close()
        replies.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`ProcessSender`: a `KVSender` in a process of its own, for an engine whose forward pass
shares the interpreter with the transport.

In one process every frame the transport writes costs its event loop several GIL
hand-offs, and a thread that waits for the GIL gets it back only after the switch interval:
beside a forward pass that launches kernels the transport slows to a fraction of its rate
and slows the forward too (`benchmarks/transport_gil.py`, the README's "On one GPU"). Here
the engine's side validates, numbers and encodes each message as `SendHandle` does (it is
one), copies its bytes into a shared ring and queues one small command for a writer thread;
the sender process (`sender_process.py`) does every socket, checksum, pacing and
retransmission. The API is `KVSender`'s: `start`, `bootstrap_port`, `open`, `telemetry`,
`set_process_rate`, `close`. Nothing on the event loop waits for the child: commands are
queued, replies read as they come; only a send waits, for room in the ring.

If the sender process dies, every open transfer fails (the decode side sees its fetch fail
and the request is retried or answered with an error), a send waiting for the ring returns
(its message dropped, as after an abort) and `open` raises; it is not restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import queue
import select
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path

from prfaas.engines.transport.config import MIB, SenderConfig
from prfaas.engines.transport.process_channel import (
    INLINE_BYTES,
    Abort,
    Close,
    Command,
    Done,
    Message,
    Open,
    Rate,
    Reply,
    ReplyFrames,
    RingClosed,
    SharedRing,
    Snapshot,
    Start,
    Started,
    StartFailed,
)
from prfaas.engines.transport.sender_room import Outgoing, SendHandle, check_room
from prfaas.engines.transport.telemetry import TransportTelemetry

__all__ = ["ProcessSender"]

logger = logging.getLogger(__name__)

RING_BYTES = 256 * MIB
"""The shared ring's size: a few layers of a long prompt's KV (a message larger than a
quarter of it crosses in parts)."""
MAX_HELD_BYTES = 1 << 30
"""What the sender process may hold copied out for rooms without a peer before it leaves
messages in the ring: the ring then fills and the engine's sends wait, as they wait for the
host budget with the sender in the engine's own process."""
START_TIMEOUT_S = 25.0
"""How long the sender process may take to import and bind (within the 30 s the vLLM and
SGLang integrations give a start)."""
STOP_TIMEOUT_S = 5.0
"""How long `close` waits for the sender process to fail its transfers and exit before it
kills it (within the time the integrations give a close)."""


class _Room(SendHandle):
    """A room whose messages go to the sender process (numbered and validated here)."""

    def __init__(self, room: int, owner: ProcessSender, serial: int) -> None:
        assert owner._loop is not None
        cfg = owner.config
        super().__init__(room, owner._loop, cfg.chunk_bytes, cfg.pipelined, owner._closed)
        self._owner = owner
        self.serial = serial
        """This opening of the room (see `process_channel.Open`)."""

    def _post(self, message: Outgoing) -> None:
        self._owner._forward(self, message)

    def abort(self, reason: str) -> None:
        # queued before the room can end on the loop, so a retry's Open comes after it
        self._owner._command(Abort(self.room, self.serial, reason))
        super().abort(reason)


class _Replies(asyncio.Protocol):
    """The reply pipe's reader on the engine's loop: whole replies to `on_reply`, the pipe's
    end to `on_end` (the child exited)."""

    def __init__(self, on_reply: Callable[[Reply], None], on_end: Callable[[], None]) -> None:
        self._frames = ReplyFrames()
        self._on_reply = on_reply
        self._on_end = on_end

    def data_received(self, data: bytes) -> None:
        for reply in self._frames.feed(data):
            self._on_reply(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_end()


def _parts(pieces: Sequence[bytes | memoryview], size: int) -> Iterator[list[memoryview]]:
    """The concatenation of `pieces` in runs of `size` bytes (the last shorter), as views."""
    run: list[memoryview] = []
    room = size
    for piece in pieces:
        view = memoryview(piece).cast("B")
        while len(view):
            take = view[:room]
            run.append(take)
            room -= len(take)
            view = view[len(take) :]
            if room == 0:
                yield run
                run, room = [], size
    if run:
        yield run


def _child_env() -> dict[str, str]:
    """This environment, with the folder this `prfaas` was imported from first on
    PYTHONPATH: the child imports the same code whether or not it is installed."""
    root = str(Path(__file__).resolve().parents[3])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root if not path else os.pathsep.join((root, path))}


class ProcessSender:
    """`KVSender`'s API, its work in a child process (see the module docstring)."""

    def __init__(
        self,
        config: SenderConfig | None = None,
        *,
        ring_bytes: int = RING_BYTES,
        max_held_bytes: int = MAX_HELD_BYTES,
    ) -> None:
        self.config = config or SenderConfig()
        self._ring_bytes = ring_bytes
        self._max_held_bytes = max_held_bytes
        self.held_bytes = 0
        """What the sender process held copied out and undelivered at its latest snapshot."""
        self.copied_bytes = 0
        """What it had copied out of the ring by then (the rest it sent from the ring)."""
        self._ring: SharedRing | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._pidfd: int | None = None
        self._commands: Connection | None = None
        self._replies: asyncio.ReadTransport | None = None
        self._first: asyncio.Future[Started | StartFailed] | None = None
        self._queue: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._write = threading.Lock()  # the ring's writer, until its message is queued
        self._lock = threading.Lock()  # `_rooms`
        self._rooms: dict[int, _Room] = {}
        self._serials = itertools.count()
        self._port: int | None = None
        self._telemetry: TransportTelemetry | None = None
        self._alive = False
        self._closing = False

    async def start(self) -> None:
        """Start the sender process and bind its bootstrap listener.

        Raises:
            ValueError: a configuration the sender refuses (a TLS file that does not load).
            OSError: the address cannot be bound, or the process did not start.
        """
        self._loop = asyncio.get_running_loop()
        try:
            reply = await self._spawn()
        except BaseException:
            await self.close()
            raise
        if isinstance(reply, StartFailed):
            await self.close()
            raise (ValueError if reply.value_error else OSError)(reply.error)
        self._port = reply.port

    async def _spawn(self) -> Started | StartFailed:
        """The child started with its channel, and its first reply."""
        assert self._loop is not None
        self._ring = SharedRing.create(self._ring_bytes)
        cmd_r, cmd_w = os.pipe()
        reply_r, reply_w = os.pipe()
        self._commands = Connection(cmd_w, readable=False)
        self._first = self._loop.create_future()
        try:
            self._replies, _ = await self._loop.connect_read_pipe(
                lambda: _Replies(self._on_reply, self._gone),
                os.fdopen(reply_r, "rb", buffering=0),
            )
            self._process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "prfaas.engines.transport.sender_process",
                str(cmd_r), str(reply_w), str(self._ring.fd), str(self._ring_bytes),
                pass_fds=(cmd_r, reply_w, self._ring.fd), env=_child_env(),
                start_new_session=True,  # a terminal's Ctrl-C stops the engine, which stops it
            )  # fmt: skip
        finally:
            os.close(cmd_r)
            os.close(reply_w)
        self._pidfd = os.pidfd_open(self._process.pid)
        self._alive = True
        self._writer = threading.Thread(
            target=self._write_commands, name="prfaas-kv-commands", daemon=True
        )  # a daemon: an engine that exits without `close` is not held by it
        self._writer.start()
        self._command(Start(self.config, self._max_held_bytes))
        return await asyncio.wait_for(asyncio.shield(self._first), START_TIMEOUT_S)

    @property
    def bootstrap_port(self) -> int:
        """The listening port (after `start`)."""
        if self._port is None:
            raise RuntimeError("ProcessSender.start() has not been awaited")
        return self._port

    def set_process_rate(self, rate_bytes_per_s: float) -> None:
        """Re-pace the sender process's egress from now on (as `KVSender.set_process_rate`).

        Raises:
            ValueError: a rate <= 0, or an egress that was started unpaced.
            RuntimeError: the sender process is gone.
        """
        if self.config.process_rate_bytes_per_s is None:
            raise ValueError("this sender's egress is not paced (no process rate at start)")
        if not rate_bytes_per_s > 0:
            raise ValueError(f"rate must be > 0, got {rate_bytes_per_s}")
        if not self.is_alive():
            raise RuntimeError("the KV sender process is gone")
        self._command(Rate(rate_bytes_per_s))
        self.config = dataclasses.replace(
            self.config, process_rate_bytes_per_s=rate_bytes_per_s, capacity_bytes_per_s=None
        )

    def open(self, room: int) -> SendHandle:
        """Start a transfer for `room` (as `KVSender.open`); thread-safe.

        Raises:
            ValueError: room out of range or already open.
            RuntimeError: not started, closed, or the sender process is gone.
        """
        if self._loop is None or self._port is None:
            raise RuntimeError("ProcessSender.start() has not been awaited")
        if self._closing or not self.is_alive():
            raise RuntimeError("ProcessSender is closed or its process is gone")
        check_room(room)
        with self._lock:
            if room in self._rooms:
                raise ValueError(f"room {room} is already open")
            handle = _Room(room, self, next(self._serials))
            self._rooms[room] = handle
            self._command(Open(room, handle.serial))  # before any message of it: in order
        return handle

    def telemetry(self) -> TransportTelemetry:
        """The sender process's latest snapshot: at most `SNAPSHOT_S` old, and taken after the
        last transfer the engine saw end; empty once the process is gone."""
        if self._telemetry is not None:
            return self._telemetry
        return TransportTelemetry(
            at=self._loop.time() if self._loop is not None else 0.0,
            egress_bytes_per_s=0.0, window_s=1.0, bytes_total=0,
            capacity_bytes_per_s=self.config.capacity, utilisation=None,
            retransmission_rate=0.0, rtt_s=None, resent_bytes=0, peers=0,
            active_transfers=len(self._rooms), connections=(),
        )  # fmt: skip

    async def close(self) -> None:
        """Fail open transfers, stop the sender process; idempotent."""
        self._closing = True
        with self._lock:
            handles = list(self._rooms.values())
        for handle in handles:
            handle.fail("sender closed", tell_peer=False)
        self._command(Close())
        self._queue.put(None)  # the writer stops after it
        process = self._process
        if process is not None and process.returncode is None:
            if self._writer is None:  # it was never told to start
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
            try:  # replies are still read meanwhile: the child never waits on its pipe
                await asyncio.wait_for(process.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        self._alive = False  # a send waiting for the ring returns, then the ring can go
        if self._writer is not None:
            await asyncio.to_thread(self._writer.join)
            self._writer = None
        if self._replies is not None:
            self._replies.close()
            self._replies = None
        if self._commands is not None:
            self._commands.close()
            self._commands = None
        with self._write:  # no send is inside the ring or polling the pidfd
            ring, self._ring = self._ring, None
            if ring is not None:
                ring.close()
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
        self._gone()  # whatever is still open (opened meanwhile, or its end never came)

    # -- the engine's threads -> the sender process ------------------------------------------

    def _forward(self, handle: _Room, message: Outgoing) -> None:
        """Put one numbered message in the ring (in parts if it is large; inline if small)
        and queue its commands."""
        nbytes = sum(memoryview(p).nbytes for p in message.pieces)
        fields = (handle.room, handle.serial, message.kind, message.msg, message.layer)
        with self._write:
            ring = self._ring
            if ring is None or self._closing or not self.is_alive():
                return  # the room fails on the loop (closed, or the process's end seen)
            if nbytes <= INLINE_BYTES:
                self._command(Message(*fields, 0, nbytes, b"".join(message.pieces)))
                return
            whole = nbytes <= ring.part_bytes
            offset = 0
            try:
                for part in (
                    [list(message.pieces)] if whole else _parts(message.pieces, ring.part_bytes)
                ):
                    size = sum(memoryview(p).nbytes for p in part)
                    start = ring.write(part, size, self.is_alive)
                    total = -1 if whole else nbytes
                    self._command(Message(*fields, start, size, None, offset, total))
                    offset += size  # commands under `_write`: in ring order
            except RingClosed:
                return
            except BaseException:  # a message stopped part-way: its transfer cannot complete
                self._command(Abort(handle.room, handle.serial, "a message was not sent whole"))
                raise

    def _command(self, command: Command) -> None:
        """Queue one command for the writer thread (never blocks: the loop calls this)."""
        self._queue.put(command)

    def _write_commands(self) -> None:
        """The writer thread: the queued commands down the pipe, in order, until None."""
        while (command := self._queue.get()) is not None:
            if self._commands is None or not self._alive:
                continue
            try:
                self._commands.send(command)
            except OSError:  # the process is gone: the loop's reader sees it
                self._alive = False

    def is_alive(self) -> bool:
        """Whether the sender process runs, read on any thread (the loop's own flags may be
        late: a send waiting for the ring on the loop's thread would never see them change).
        The engine's `/health` fails once it is gone: no hand-off can succeed."""
        pidfd = self._pidfd
        if not self._alive or pidfd is None:
            return False
        poll = select.poll()  # one per call: a poll object refuses concurrent calls
        try:
            poll.register(pidfd, select.POLLIN)
            return not poll.poll(0)  # the pidfd reads ready once the process has exited
        except (OSError, ValueError):
            return False

    # -- the sender process -> the engine's loop ---------------------------------------------

    def _on_reply(self, reply: Reply) -> None:
        if isinstance(reply, Done):
            self._ended(reply)
        elif isinstance(reply, Snapshot):
            self._telemetry = reply.telemetry
            self.held_bytes, self.copied_bytes = reply.held_bytes, reply.copied_bytes
        elif self._first is not None and not self._first.done():
            self._first.set_result(reply)

    def _ended(self, done: Done) -> None:
        handle = self._rooms.get(done.room)
        if handle is None or handle.serial != done.serial:
            return  # an earlier opening of the room
        if done.reason is None:
            handle.complete()
        else:
            handle.fail(done.reason, tell_peer=False)

    def _gone(self) -> None:
        """The sender process exited: every open transfer fails."""
        self._alive = False
        self._telemetry = None
        if self._first is not None and not self._first.done():
            self._first.set_result(StartFailed("the sender process exited at start", False))
        with self._lock:
            handles = list(self._rooms.values())
        if not self._closing:
            logger.error("the KV sender process exited; %d open transfers fail", len(handles))
        for handle in handles:
            handle.fail("the KV sender process exited", tell_peer=False)

    def _closed(self, handle: SendHandle, reason: str | None) -> None:
        with self._lock:
            if self._rooms.get(handle.room) is handle:
                del self._rooms[handle.room]

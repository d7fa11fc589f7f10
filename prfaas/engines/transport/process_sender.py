"""`ProcessSender`: a `KVSender` in a process of its own, for an engine whose forward pass
shares the interpreter with the transport.

In one process every frame the transport writes costs its event loop several GIL
hand-offs, and a thread that waits for the GIL gets it back only after the switch interval:
beside a forward pass that launches kernels the transport slows to a fraction of its rate
and slows the forward too (`benchmarks/transport_gil.py`, the README's "On one GPU"). Here
the engine's side validates, numbers and encodes each message as `SendHandle` does (it is
one), copies its bytes into a shared ring and writes one small command; the sender process
(`sender_process.py`) does every socket, checksum, pacing and retransmission. The API is
`KVSender`'s: `start`, `bootstrap_port`, `open`, `telemetry`, `set_process_rate`, `close`.

If the sender process dies, every open transfer fails (the decode side sees its fetch fail
and the request is retried or answered with an error) and `open` raises; it is not restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
import threading
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
    RingClosed,
    SharedRing,
    Snapshot,
    Start,
    Started,
    StartFailed,
)
from prfaas.engines.transport.sender_room import MAX_ROOM, Outgoing, SendHandle
from prfaas.engines.transport.telemetry import TransportTelemetry

__all__ = ["ProcessSender"]

logger = logging.getLogger(__name__)

RING_BYTES = 256 * MIB
"""The shared ring's size: a few layers of a long prompt's KV (a larger message travels
inside its command, slowly)."""
MAX_HELD_BYTES = 1 << 30
"""What the sender process may hold undelivered (copied out of the ring) before it stops
reading commands: the ring then fills and the engine's sends wait, as they wait for the host
budget with the sender in the engine's own process."""
START_TIMEOUT_S = 60.0
"""How long the sender process may take to import and bind."""


class _Room(SendHandle):
    """A room whose messages go to the sender process (numbered and validated here)."""

    def __init__(self, room: int, owner: ProcessSender, loop: asyncio.AbstractEventLoop) -> None:
        cfg = owner.config
        super().__init__(room, loop, cfg.chunk_bytes, cfg.pipelined, owner._closed)
        self._owner = owner

    def _post(self, message: Outgoing) -> None:
        self._owner._forward(self.room, message)

    def abort(self, reason: str) -> None:
        super().abort(reason)
        self._owner._command(Abort(self.room, reason))


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
        self._commands: Connection | None = None
        self._replies: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._write = threading.Lock()  # the ring's writer, until its message is commanded
        self._pipe = threading.Lock()  # the command pipe's writer
        self._lock = threading.Lock()  # `_rooms`
        self._rooms: dict[int, _Room] = {}
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
        self._ring = SharedRing.create(self._ring_bytes)
        cmd_r, cmd_w = os.pipe()
        reply_r, reply_w = os.pipe()
        fds = (cmd_r, reply_w, self._ring.fd)
        try:
            self._process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "prfaas.engines.transport.sender_process",
                str(cmd_r), str(reply_w), str(self._ring.fd), str(self._ring_bytes),
                pass_fds=fds, env=_child_env(),
            )  # fmt: skip
        finally:
            os.close(cmd_r)
            os.close(reply_w)
        self._commands = Connection(cmd_w, readable=False)
        self._replies = Connection(reply_r, writable=False)
        self._alive = True
        self._command(Start(self.config, self._max_held_bytes))
        reply = await asyncio.wait_for(asyncio.to_thread(self._first_reply), START_TIMEOUT_S)
        if isinstance(reply, StartFailed):
            await self.close()
            raise (ValueError if reply.value_error else OSError)(reply.error)
        self._port = reply.port
        self._loop.add_reader(self._replies.fileno(), self._read)

    def _first_reply(self) -> Started | StartFailed:
        assert self._replies is not None
        try:
            reply = self._replies.recv()
        except EOFError:
            return StartFailed("the sender process exited at start", value_error=False)
        assert isinstance(reply, Started | StartFailed)
        return reply

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
        """
        if self.config.process_rate_bytes_per_s is None:
            raise ValueError("this sender's egress is not paced (no process rate at start)")
        if not rate_bytes_per_s > 0:
            raise ValueError(f"rate must be > 0, got {rate_bytes_per_s}")
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
        if self._closing or not self._alive:
            raise RuntimeError("ProcessSender is closed or its process is gone")
        if not isinstance(room, int) or not 0 <= room <= MAX_ROOM:
            raise ValueError(f"room must be an integer in 0..2**64-1, got {room!r}")
        handle = _Room(room, self, self._loop)
        with self._lock:
            if room in self._rooms:
                raise ValueError(f"room {room} is already open")
            self._rooms[room] = handle
        self._command(Open(room))  # before any message of the room: it is not returned yet
        return handle

    def telemetry(self) -> TransportTelemetry:
        """The sender process's latest snapshot: at most `SNAPSHOT_S` old, and taken after the
        last transfer the engine saw end."""
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
        for handle in list(self._rooms.values()):
            handle.fail("sender closed", tell_peer=False)
        self._command(Close())
        if self._loop is not None and self._replies is not None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(self._replies.fileno())
        if self._process is not None and self._process.returncode is None:
            try:
                await asyncio.wait_for(self._process.wait(), 10)
            except TimeoutError:
                self._process.kill()
                await self._process.wait()
        self._alive = False
        for conn in (self._commands, self._replies):
            if conn is not None:
                conn.close()
        self._commands = self._replies = None
        if self._ring is not None:
            ring, self._ring = self._ring, None
            with self._write:
                ring.close()

    # -- the engine's threads -> the sender process ------------------------------------------

    def _forward(self, room: int, message: Outgoing) -> None:
        """Put one numbered message in the ring (or inline) and command its sending."""
        nbytes = sum(memoryview(p).nbytes for p in message.pieces)
        with self._write:
            ring = self._ring
            if not self._alive or ring is None:
                return  # the room fails on the loop (the process's end was seen there)
            if nbytes <= INLINE_BYTES or not ring.fits(nbytes):
                inline = b"".join(message.pieces)
                command = Message(room, message.kind, message.msg, message.layer, 0, nbytes, inline)
            else:
                try:
                    start = ring.write(message.pieces, nbytes, self._is_alive)
                except RingClosed:
                    return
                command = Message(room, message.kind, message.msg, message.layer, start, nbytes)
            self._command(command)  # under `_write`: the ring's messages in their order

    def _command(self, command: Command) -> None:
        """Write one command. Not under `_write`, which a writer waiting for the ring holds:
        opening and aborting never wait for a message. A gone process is seen by the loop's
        reader."""
        with self._pipe:
            if self._commands is None or not self._alive:
                return
            try:
                self._commands.send(command)
            except OSError:
                self._alive = False

    def _is_alive(self) -> bool:
        return self._alive and self._process is not None and self._process.returncode is None

    # -- the sender process -> the engine's loop ---------------------------------------------

    def _read(self) -> None:
        assert self._replies is not None and self._loop is not None
        try:
            while self._replies.poll():
                reply = self._replies.recv()
                if isinstance(reply, Done):
                    self._ended(reply)
                elif isinstance(reply, Snapshot):
                    self._telemetry = reply.telemetry
                    self.held_bytes, self.copied_bytes = reply.held_bytes, reply.copied_bytes
        except (EOFError, OSError):
            self._loop.remove_reader(self._replies.fileno())
            self._gone()

    def _ended(self, done: Done) -> None:
        handle = self._rooms.get(done.room)
        if handle is None:
            return
        if done.reason is None:
            handle.complete()
        else:
            handle.fail(done.reason, tell_peer=False)

    def _gone(self) -> None:
        """The sender process exited: every open transfer fails."""
        self._alive = False
        if not self._closing:
            logger.error("the KV sender process exited; %d open transfers fail", len(self._rooms))
        for handle in list(self._rooms.values()):
            handle.fail("the KV sender process exited", tell_peer=False)

    def _closed(self, handle: SendHandle, reason: str | None) -> None:
        with self._lock:
            if self._rooms.get(handle.room) is handle:
                del self._rooms[handle.room]

"""`ProcessSender`: a `KVSender` in a process of its own, for an engine whose forward pass
shares the interpreter with the transport.

In one process every frame the transport writes costs its event loop several GIL
hand-offs, and a thread that waits for the GIL gets it back only after the switch interval:
beside a forward pass that launches kernels the transport slows to a fraction of its rate
and slows the forward too (`benchmarks/transport_gil.py`, the README's "On one GPU"). Here
the engine's side validates, numbers and encodes each message as `SendHandle` does (it is
one), copies its bytes into a shared ring and queues one small command for a writer thread;
the sender process (`sender_process.py`, run by `process_child.SenderChild`) does every
socket, checksum, pacing and retransmission. The API is `KVSender`'s: `start`,
`bootstrap_port`, `open`, `telemetry`, `set_process_rate`, `close`. Nothing on the event
loop waits for the child: commands are queued, replies read as they come; only a send
waits, for room in the ring.

The engine binds the bootstrap listener and passes it to the process. If the process dies,
every open transfer fails (the decode side sees its fetch fail and the request is retried
or answered with an error), a send waiting for the ring returns (its message dropped, as
after an abort), and so does every transfer opened before a new process serves on the same
listener (the port the decode side was told stays right; meanwhile its connections wait in
the listener's backlog). A process that dies soon after it started is restarted later each
time (`restart_delay`), as a crash-looping container is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence

from prfaas.engines.transport.config import MIB, SenderConfig
from prfaas.engines.transport.process_channel import (
    INLINE_BYTES,
    Abort,
    Done,
    Message,
    Open,
    Rate,
    Reply,
    RingClosed,
    Snapshot,
    StartFailed,
)
from prfaas.engines.transport.process_child import SenderChild
from prfaas.engines.transport.sender import TOMBSTONES
from prfaas.engines.transport.sender_room import Outgoing, SendHandle, check_room
from prfaas.engines.transport.telemetry import TransportTelemetry

__all__ = ["ProcessSender", "restart_delay"]

logger = logging.getLogger(__name__)

RING_BYTES = 256 * MIB
"""The shared ring's size: a few layers of a long prompt's KV (a message larger than a
quarter of it crosses in parts)."""
MAX_HELD_BYTES = 1 << 30
"""What the sender process may hold copied out for rooms without a peer before it leaves
messages in the ring: the ring then fills and the engine's sends wait, as they wait for the
host budget with the sender in the engine's own process."""
_GONE = "the KV sender process exited"
RESTART_FIRST_S = 0.5
"""The wait before restarting a sender process that died (doubled for each that died again
soon after it started, up to `RESTART_MAX_S`)."""
RESTART_MAX_S = 30.0
RESTART_RESET_S = 60.0
"""A process that ran this long before it died counts as healthy: the next wait is the
first again."""


def restart_delay(quick_deaths: int) -> float:
    """The wait before starting a sender process again after `quick_deaths` (>= 1) in a row
    died or failed to start soon after starting: exponential, capped, so a crash loop costs
    little and one crash costs half a second."""
    return min(RESTART_MAX_S, RESTART_FIRST_S * 2.0 ** (max(quick_deaths, 1) - 1))


class _Room(SendHandle):
    """A room whose messages go to the sender process it was opened with (numbered and
    validated here)."""

    def __init__(self, room: int, owner: ProcessSender, child: SenderChild, serial: int) -> None:
        assert owner._loop is not None
        cfg = owner.config
        super().__init__(room, owner._loop, cfg.chunk_bytes, cfg.pipelined, owner._closed)
        self._owner = owner
        self.child = child
        self.serial = serial
        """This opening of the room (see `process_channel.Open`)."""

    def _post(self, message: Outgoing) -> None:
        self._owner._forward(self, message)

    def abort(self, reason: str) -> None:
        # queued before the room can end on the loop, so a retry's Open comes after it
        self.child.command(Abort(self.room, self.serial, reason))
        super().abort(reason)


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
        self.restarts = 0
        """Sender processes started after the first one died."""
        self._listener: asyncio.Server | None = None  # bound here, never serving here
        self._child: SenderChild | None = None  # the current process, alive or not
        self._restarting: asyncio.Task[None] | None = None
        self._unsent: deque[tuple[int, int, float]] = deque(maxlen=TOMBSTONES)
        """(room, serial, when) of the latest transfers failed because no process ran (or
        it died): every process started within `register_timeout_s` answers their decode
        sides' REGISTER with ABORT (not a wait for that timeout), even one started after
        another that died at once."""
        self._quick_deaths = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()  # `_rooms`
        self._rooms: dict[int, _Room] = {}
        self._serials = itertools.count()
        self._port: int | None = None
        self._telemetry: TransportTelemetry | None = None
        self._closing = False

    async def start(self) -> None:
        """Bind the bootstrap listener and start the sender process on it.

        Raises:
            ValueError: a configuration the sender refuses (a TLS file that does not load).
            OSError: the address cannot be bound, or the process did not start.
        """
        self._loop = asyncio.get_running_loop()
        try:
            self._listener = await self._loop.create_server(
                asyncio.Protocol, self.config.host, self.config.port, start_serving=False
            )  # asyncio's binding (every address the host names); the process accepts
            self._port = self._listener.sockets[0].getsockname()[1]
            self._child = await self._spawn()
        except BaseException:
            await self.close()
            raise

    async def _spawn(self) -> SenderChild:
        """A sender process on the listener, once it answered that it serves.

        Raises:
            ValueError, OSError: as `start` (the process is gone then).
        """
        assert self._listener is not None
        child = await SenderChild.spawn(
            self.config,
            ring_bytes=self._ring_bytes,
            max_held_bytes=self._max_held_bytes,
            listeners=[sock.fileno() for sock in self._listener.sockets],
            on_reply=self._on_reply,
            on_end=self._ended_process,
        )
        try:
            reply = await child.started()
            if isinstance(reply, StartFailed):
                raise (ValueError if reply.value_error else OSError)(reply.error)
        except BaseException:
            await child.stop()
            raise
        return child

    @property
    def bootstrap_port(self) -> int:
        """The listening port (after `start`; the same for every sender process)."""
        if self._port is None:
            raise RuntimeError("ProcessSender.start() has not been awaited")
        return self._port

    def set_process_rate(self, rate_bytes_per_s: float) -> None:
        """Re-pace the sender process's egress from now on (as `KVSender.set_process_rate`;
        a process started later starts at this rate).

        Raises:
            ValueError: a rate <= 0, or an egress that was started unpaced.
            RuntimeError: the sender is closed.
        """
        if self.config.process_rate_bytes_per_s is None:
            raise ValueError("this sender's egress is not paced (no process rate at start)")
        if not rate_bytes_per_s > 0:
            raise ValueError(f"rate must be > 0, got {rate_bytes_per_s}")
        if self._closing:
            raise RuntimeError("ProcessSender is closed")
        self.config = dataclasses.replace(
            self.config, process_rate_bytes_per_s=rate_bytes_per_s, capacity_bytes_per_s=None
        )
        if self._child is not None:
            self._child.command(Rate(rate_bytes_per_s))

    def open(self, room: int) -> SendHandle:
        """Start a transfer for `room` (as `KVSender.open`); thread-safe. While no sender
        process runs (one died, the next has not started) the transfer fails at once: the
        request fails, not the engine that asked.

        Raises:
            ValueError: room out of range or already open.
            RuntimeError: not started, or closed.
        """
        if self._loop is None or self._port is None:
            raise RuntimeError("ProcessSender.start() has not been awaited")
        if self._closing:
            raise RuntimeError("ProcessSender is closed")
        check_room(room)
        with self._lock:
            if room in self._rooms:
                raise ValueError(f"room {room} is already open")
            child = self._child
            assert child is not None  # started
            handle = _Room(room, self, child, next(self._serials))
            if not child.is_alive():
                self._unsent.append((room, handle.serial, time.monotonic()))
                self._loop.call_soon_threadsafe(
                    functools.partial(handle.fail, _GONE, tell_peer=False)
                )
                return handle
            self._rooms[room] = handle
            child.command(Open(room, handle.serial))  # before any message of it: in order
        return handle

    def is_alive(self) -> bool:
        """Whether a sender process runs, read on any thread. The engine's `/health` fails
        while none does: no hand-off can succeed."""
        child = self._child
        return child is not None and child.is_alive()

    def telemetry(self) -> TransportTelemetry:
        """The sender process's latest snapshot: at most `SNAPSHOT_S` old, and taken after the
        last transfer the engine saw end; empty while no process runs."""
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
        """Fail open transfers, stop the sender process, close the listener; idempotent."""
        self._closing = True
        if self._restarting is not None:
            self._restarting.cancel()
            await asyncio.wait({self._restarting})  # (its own error is logged by asyncio)
        self._fail_rooms("sender closed")
        if self._child is not None:
            await self._child.stop()
        if self._listener is not None:
            self._listener.close()
        self._fail_rooms("sender closed")  # opened meanwhile, or their end never came

    # -- the engine's threads -> the sender process ------------------------------------------

    def _forward(self, handle: _Room, message: Outgoing) -> None:
        """Put one numbered message in its process's ring (in parts if it is large; inline if
        small) and queue its commands."""
        nbytes = sum(memoryview(p).nbytes for p in message.pieces)
        fields = (handle.room, handle.serial, message.kind, message.msg, message.layer)
        child = handle.child
        with child.lock:
            ring = child.ring
            if ring is None or self._closing or not child.is_alive():
                return  # the room fails on the loop (closed, or the process's end seen)
            if nbytes <= INLINE_BYTES:
                child.command(Message(*fields, 0, nbytes, b"".join(message.pieces)))
                return
            whole = nbytes <= ring.part_bytes
            offset = 0
            try:
                for part in (
                    [list(message.pieces)] if whole else _parts(message.pieces, ring.part_bytes)
                ):
                    size = sum(memoryview(p).nbytes for p in part)
                    start = ring.write(part, size, child.is_alive)
                    total = -1 if whole else nbytes
                    child.command(Message(*fields, start, size, None, offset, total))
                    offset += size  # commands under the ring's lock: in ring order
            except RingClosed:
                return
            except BaseException:  # a message stopped part-way: its transfer cannot complete
                child.command(Abort(handle.room, handle.serial, "a message was not sent whole"))
                raise

    # -- the sender process -> the engine's loop ---------------------------------------------

    def _on_reply(self, child: SenderChild, reply: Reply) -> None:
        if isinstance(reply, Done):
            self._ended(reply)  # (serials name openings across processes)
        elif isinstance(reply, Snapshot) and child is self._child:
            self._telemetry = reply.telemetry
            self.held_bytes, self.copied_bytes = reply.held_bytes, reply.copied_bytes

    def _ended(self, done: Done) -> None:
        handle = self._rooms.get(done.room)
        if handle is None or handle.serial != done.serial:
            return  # an earlier opening of the room
        if done.reason is None:
            handle.complete()
        else:
            handle.fail(done.reason, tell_peer=False)

    def _ended_process(self, child: SenderChild) -> None:
        """A sender process exited: if it was the current one, every open transfer fails and
        (unless closing) another is started."""
        if child is not self._child:
            return  # one that failed to start, or an earlier one
        self._telemetry = None
        self.held_bytes = self.copied_bytes = 0
        if self._closing:
            return
        logger.error(
            "the KV sender process exited after %.1f s; %d open transfers fail",
            child.lived_s(), len(self._rooms),
        )  # fmt: skip
        with self._lock:
            now = time.monotonic()
            self._unsent.extend((room, h.serial, now) for room, h in self._rooms.items())
        self._fail_rooms(_GONE)
        if self._restarting is None or self._restarting.done():
            assert self._loop is not None
            self._restarting = self._loop.create_task(self._restart(child))

    async def _restart(self, dead: SenderChild) -> None:
        """Start sender processes on the listener until one serves (see `restart_delay`)."""
        quick = dead.lived_s() < RESTART_RESET_S
        self._quick_deaths = self._quick_deaths + 1 if quick else 1
        while True:
            await self._let_go(dead)
            delay = restart_delay(self._quick_deaths)
            await asyncio.sleep(delay)
            try:
                child = await self._spawn()
            except (OSError, ValueError) as exc:  # (TimeoutError is an OSError)
                logger.warning("the KV sender process did not restart: %s", exc)
            except Exception:  # never give up on an engine's sender for a bug here
                logger.exception("the KV sender process did not restart")
            else:
                if self._serve_with(child, delay):
                    return
                dead = child
            self._quick_deaths += 1

    @staticmethod
    async def _let_go(child: SenderChild) -> None:
        """Stop an exited (or unwanted) process and let go of its channel; a failure to is
        logged, and the restart goes on."""
        try:
            await child.stop()
        except Exception:
            logger.exception("letting go of a KV sender process failed")

    def _serve_with(self, child: SenderChild, delay: float) -> bool:
        """Make a started process the current one: it fails the recent transfers no process
        could send (a decode side that asks for one is told at once), and paces at the rate
        set meanwhile. False if it has exited already or the sender is closing."""
        if child.ended or self._closing:  # (its end, if seen, was not the current one's)
            return False
        horizon = time.monotonic() - self.config.register_timeout_s
        with self._lock:  # an `open` either saw the process before or sees this one
            self._child = child
            while self._unsent and self._unsent[0][2] < horizon:
                self._unsent.popleft()  # its decode side has given up on a REGISTER by now
            for room, serial, _ in self._unsent:
                child.command(Open(room, serial))
                child.command(Abort(room, serial, _GONE))
        rate = self.config.process_rate_bytes_per_s
        if rate is not None:
            child.command(Rate(rate))
        self.restarts += 1
        logger.warning("the KV sender process restarted after %.1f s (port %d)", delay, self._port)
        return True

    def _fail_rooms(self, reason: str) -> None:
        with self._lock:
            handles = list(self._rooms.values())
        for handle in handles:
            handle.fail(reason, tell_peer=False)

    def _closed(self, handle: SendHandle, reason: str | None) -> None:
        with self._lock:
            if self._rooms.get(handle.room) is handle:
                del self._rooms[handle.room]

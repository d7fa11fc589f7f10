"""`SenderChild`: one sender process and the engine's end of its channel (the shared ring,
the command channel and the thread that writes it, the reply pipe read on the engine's loop,
the process's exit read from its pidfd). `ProcessSender` runs one at a time, and starts
another when one dies."""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import select
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path

from prfaas.engines.transport.config import SenderConfig
from prfaas.engines.transport.process_channel import (
    Close,
    Command,
    Reply,
    ReplyFrames,
    SharedRing,
    Start,
    Started,
    StartFailed,
)

__all__ = ["START_TIMEOUT_S", "STOP_TIMEOUT_S", "SenderChild"]

START_TIMEOUT_S = 25.0
"""How long the sender process may take to import and start serving (within the 30 s the
vLLM and SGLang integrations give a start)."""
END_GRACE_S = 1.0
"""How long after the process's exit its end waits for the reply pipe's end."""
STOP_TIMEOUT_S = 5.0
"""How long a stop waits for the sender process to fail its transfers and exit before it
kills it (within the time the integrations give a close)."""


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


def _child_env() -> dict[str, str]:
    """This environment, with the folder this `prfaas` was imported from first on
    PYTHONPATH: the child imports the same code whether or not it is installed."""
    root = str(Path(__file__).resolve().parents[3])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root if not path else os.pathsep.join((root, path))}


class SenderChild:
    """One sender process: `spawn` it, `command` it from any thread, `stop` it.

    Its replies other than the first go to `on_reply`, on the loop; `on_end` is called once,
    on the loop, when it exited: when its reply pipe ends (after the replies it wrote), or
    `END_GRACE_S` after its pidfd says so, whichever comes first (a process the engine
    forked meanwhile may hold the pipe's end open)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        ring: SharedRing,
        on_reply: Callable[[SenderChild, Reply], None],
        on_end: Callable[[SenderChild], None],
    ) -> None:
        self.ring: SharedRing | None = ring
        """The shared ring (None once released)."""
        self.lock = threading.Lock()
        """The ring's writer: held from a message's first byte until its commands are
        queued, and by `release` before the ring goes."""
        self.ended = False
        """Its end was seen (see the class docstring): the process has exited."""
        self._started_at = loop.time()
        self._ended_at: float | None = None
        self._loop = loop
        self._on_reply = on_reply
        self._on_end = on_end
        self._first: asyncio.Future[Started | StartFailed] = loop.create_future()
        self._process: asyncio.subprocess.Process | None = None
        self._pidfd: int | None = None
        self._commands: Connection | None = None
        self._command_socket: socket.socket | None = None
        self._replies: asyncio.ReadTransport | None = None
        self._queue: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._alive = False
        self._releasing: asyncio.Future[None] | None = None

    @classmethod
    async def spawn(
        cls,
        config: SenderConfig,
        *,
        ring_bytes: int,
        max_held_bytes: int,
        listeners: Sequence[int],
        on_reply: Callable[[SenderChild, Reply], None],
        on_end: Callable[[SenderChild], None],
    ) -> SenderChild:
        """Start a sender process serving on the listening sockets `listeners` (file
        descriptors, bound by the engine) and tell it to start; `started` awaits its answer.

        Raises:
            OSError: the ring, the channel or the process cannot be made (nothing is left).
        """
        loop = asyncio.get_running_loop()
        child = cls(loop, SharedRing.create(ring_bytes), on_reply, on_end)
        try:
            await child._run(config, ring_bytes, max_held_bytes, listeners)
        except BaseException:
            await child.stop()
            raise
        return child

    async def _run(
        self, config: SenderConfig, ring_bytes: int, max_held_bytes: int, listeners: Sequence[int]
    ) -> None:
        assert self.ring is not None
        # a socket pair, not a pipe: `release` shuts the engine's end down, which wakes a
        # write blocked on it even where a process forked meanwhile holds the other end
        self._command_socket, theirs = socket.socketpair()
        self._commands = Connection(os.dup(self._command_socket.fileno()), readable=False)
        cmd_r = theirs.detach()
        try:
            reply_r, reply_w = os.pipe()
        except BaseException:
            os.close(cmd_r)
            raise
        try:
            self._replies, _ = await self._loop.connect_read_pipe(
                lambda: _Replies(self._reply, self._end),
                os.fdopen(reply_r, "rb", buffering=0),
            )
            fds = (cmd_r, reply_w, self.ring.fd, *listeners)
            self._process = await asyncio.create_subprocess_exec(
                # -P: not the working folder's `prfaas` first, the one PYTHONPATH names
                sys.executable, "-P", "-m", "prfaas.engines.transport.sender_process",
                str(cmd_r), str(reply_w), str(self.ring.fd), str(ring_bytes),
                ",".join(map(str, listeners)),
                pass_fds=fds, env=_child_env(),
                start_new_session=True,  # a terminal's Ctrl-C stops the engine, which stops it
            )  # fmt: skip
        finally:
            os.close(cmd_r)
            os.close(reply_w)
        self._pidfd = os.pidfd_open(self._process.pid)
        self._loop.add_reader(self._pidfd, self._exited)
        self._alive = True
        self._writer = threading.Thread(
            target=self._write_commands, name="prfaas-kv-commands", daemon=True
        )  # a daemon: an engine that exits without `close` is not held by it
        self._writer.start()
        self.command(Start(config, max_held_bytes))

    async def started(self) -> Started | StartFailed:
        """The process's answer to `Start` (a `StartFailed` if it exited first).

        Raises:
            TimeoutError: no answer within `START_TIMEOUT_S`.
        """
        return await asyncio.wait_for(asyncio.shield(self._first), START_TIMEOUT_S)

    @property
    def process(self) -> asyncio.subprocess.Process | None:
        """The process (None if it never started)."""
        return self._process

    @property
    def pid(self) -> int | None:
        """The process's id (None if it never started)."""
        return None if self._process is None else self._process.pid

    def command(self, command: Command) -> None:
        """Queue one command for the writer thread (never blocks: the loop calls this)."""
        self._queue.put(command)

    def is_alive(self) -> bool:
        """Whether the process runs, read on any thread (the loop's own flags may be late: a
        send waiting for the ring on the loop's thread would never see them change)."""
        pidfd = self._pidfd
        if not self._alive or pidfd is None:
            return False
        poll = select.poll()  # one per call: a poll object refuses concurrent calls
        try:
            poll.register(pidfd, select.POLLIN)
            return not poll.poll(0)  # the pidfd reads ready once the process has exited
        except (OSError, ValueError):
            return False

    async def stop(self) -> None:
        """Tell the process to fail what is open and exit, kill it if it has not within
        `STOP_TIMEOUT_S` (or the stop is cancelled), then `release`; idempotent."""
        process = self._process
        try:
            if process is not None and process.returncode is None:
                self.command(Close())
                if self._writer is None:  # it was never told to start
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
                try:  # replies are still read meanwhile: the child never waits on its pipe
                    await asyncio.wait_for(process.wait(), STOP_TIMEOUT_S)
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
                    await process.wait()
        finally:
            if process is not None and process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()  # (cancelled while waiting)
            await self.release()

    async def release(self) -> None:
        """Let go of an exited process's channel: the writer thread, the command socket and
        the reply pipe, then (once no send is inside it) the ring; idempotent, and a caller
        cancelled meanwhile does not stop it half-way."""
        if self._releasing is None:
            self._releasing = asyncio.ensure_future(self._release())
        await asyncio.shield(self._releasing)

    async def _release(self) -> None:
        self._alive = False  # a send waiting for the ring returns, then the ring can go
        self._queue.put(None)  # the writer stops after what is queued
        if self._command_socket is not None:
            with contextlib.suppress(OSError):  # (never connected to a process)
                self._command_socket.shutdown(socket.SHUT_RDWR)
            self._command_socket.close()
        if self._writer is not None:
            await asyncio.to_thread(self._writer.join)
        if self._replies is not None:
            self._replies.close()
        if self._commands is not None:
            self._commands.close()
        with self.lock:  # no send is inside the ring or polling the pidfd
            ring, self.ring = self.ring, None
            if ring is not None:
                ring.close()
            pidfd, self._pidfd = self._pidfd, None
            if pidfd is not None:
                self._loop.remove_reader(pidfd)
                os.close(pidfd)
        self._end()  # if the pipe's end was never read (the process never ran)

    def _write_commands(self) -> None:
        """The writer thread: the queued commands down the channel, in order, until None."""
        while (command := self._queue.get()) is not None:
            if self._commands is None or not self._alive:
                continue
            try:
                self._commands.send(command)
            except OSError:  # the process is gone: the loop's reader sees it
                self._alive = False

    def _reply(self, reply: Reply) -> None:
        if isinstance(reply, Started | StartFailed):
            if not self._first.done():
                self._first.set_result(reply)
        else:
            self._on_reply(self, reply)

    def _exited(self) -> None:
        """The pidfd reads ready: the process exited. Its replies still in the pipe come
        first, unless the pipe's end stays open (see the class docstring)."""
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
        self._alive = False
        self._loop.call_later(END_GRACE_S, self._end)

    def lived_s(self) -> float:
        """How long the process ran (so far, if it still runs)."""
        end = self._ended_at if self._ended_at is not None else self._loop.time()
        return end - self._started_at

    def _end(self) -> None:
        if self.ended:
            return
        self.ended = True
        self._ended_at = self._loop.time()
        self._alive = False
        if not self._first.done():
            self._first.set_result(StartFailed("the sender process exited at start", False))
        self._on_end(self)

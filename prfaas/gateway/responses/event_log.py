"""The events of streamed background responses, kept so that a client can read the stream
again, from where it left off (`GET /v1/responses/{id}?stream=true&starting_after=N`), while
the response runs and after it ended, whichever replica it reaches.

A log is the response's SSE frames in the order they were sent, one frame per event, so a
frame's place in its log is its event's `sequence_number` (the engines number their events
from 0, one by one; vLLM's server resumes the same way). `MemoryEventLog` keeps the logs in
this gateway's memory (a resume reaching another replica finds none); `RedisEventLog` in the
Redis the replicas share for stored responses. Either forgets a log when the stored
responses' time to live has run out since it ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import RedisError

from prfaas.gateway.responses.store import StoreUnavailable

KEY_PREFIX = "prfaas:events:"
START = b"start"
"""Redis: a log's first element (a list cannot be empty; frames follow it)."""
END = b""
"""Redis: the element that closes a log (no event is empty)."""
POLL_S = 0.05
"""Redis: how often a reader on another replica than the writer's looks for new events."""


class LogForgotten(LookupError):
    """A log being read was forgotten before its end (expired, or past a bound)."""


class EventLog(ABC):
    """Logs of SSE frames by response id. Every method may raise `StoreUnavailable`."""

    @abstractmethod
    async def open(self, response_id: str) -> None:
        """Start `response_id`'s log, empty (its readers wait for its first frame)."""

    @abstractmethod
    async def append(self, response_id: str, frame: bytes) -> None:
        """Add one event's frame to `response_id`'s (open) log."""

    @abstractmethod
    async def end(self, response_id: str) -> None:
        """Close `response_id`'s log: its readers stop after its last frame."""

    @abstractmethod
    async def read(self, response_id: str, start: int) -> tuple[list[bytes], bool] | None:
        """The frames of `response_id`'s log from place `start` on, and whether the log has
        ended; None where no log is kept (never started, expired or forgotten)."""

    @abstractmethod
    def follow(self, response_id: str, start: int) -> AsyncIterator[bytes]:
        """The frames from place `start` on as they come, until the log ends.

        Raises:
            LogForgotten: the log is not kept (or no longer).
        """

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections (the memory log has none)."""


@dataclass
class _Log:
    frames: list[bytes] = field(default_factory=list)
    nbytes: int = 0
    expires: float = math.inf  # set when it ends
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        """Wake its readers: the event they wait on is set, a new one made for the next."""
        self.changed.set()
        self.changed = asyncio.Event()


@dataclass
class MemoryEventLog(EventLog):
    """Logs in this gateway's memory: an ended log is forgotten `ttl_s` seconds after it
    ended, and sooner, oldest ended first, while the ended logs' frames pass `max_bytes`.
    Running logs are never forgotten (each grows only as fast as its answer), and a reader
    already following a log reads it to its end even if it is forgotten meanwhile."""

    max_bytes: int
    ttl_s: float
    clock: Callable[[], float] = time.monotonic
    _logs: dict[str, _Log] = field(default_factory=dict)
    _ended: OrderedDict[str, None] = field(default_factory=OrderedDict)  # oldest end first
    _ended_bytes: int = 0

    @property
    def bytes_kept(self) -> int:
        """Bytes of frames in the logs kept (running and ended)."""
        return sum(log.nbytes for log in self._logs.values())

    async def open(self, response_id: str) -> None:
        self._logs[response_id] = _Log()

    async def append(self, response_id: str, frame: bytes) -> None:
        log = self._logs.get(response_id)
        if log is None or log.expires < math.inf:
            return  # forgotten or ended: nothing more goes in
        log.frames.append(frame)
        log.nbytes += len(frame)
        log.notify()

    async def end(self, response_id: str) -> None:
        log = self._logs.get(response_id)
        if log is None or log.expires < math.inf:
            return
        log.expires = self.clock() + self.ttl_s
        self._ended[response_id] = None
        self._ended_bytes += log.nbytes
        log.notify()
        self._evict()

    async def read(self, response_id: str, start: int) -> tuple[list[bytes], bool] | None:
        self._evict()
        log = self._logs.get(response_id)
        if log is None:
            return None
        return log.frames[start:], log.expires < math.inf

    async def follow(self, response_id: str, start: int) -> AsyncIterator[bytes]:
        self._evict()
        log = self._logs.get(response_id)
        if log is None:
            raise LogForgotten(response_id)
        while True:  # on the log itself: forgetting it later does not cut this reader off
            while start < len(log.frames):
                yield log.frames[start]
                start += 1
            if log.expires < math.inf:
                return
            await log.changed.wait()

    def _evict(self) -> None:
        """The oldest ended logs while they have expired or pass the bound."""
        now = self.clock()
        while self._ended:
            oldest = next(iter(self._ended))
            log = self._logs[oldest]
            if log.expires > now and self._ended_bytes <= self.max_bytes:
                return
            del self._ended[oldest], self._logs[oldest]
            self._ended_bytes -= log.nbytes


class RedisEventLog(EventLog):
    """Logs in Redis (`prfaas:events:ID`, a list: `START`, the frames, `END` once ended),
    kept `ttl_s` seconds after their last change. A reader on the writer's replica wakes
    as a frame is added to its log; one on another replica looks every `POLL_S` seconds."""

    def __init__(self, redis: Redis, ttl_s: float) -> None:
        self._redis = redis
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._pushed: dict[str, tuple[asyncio.Event, int]] = {}  # by log: readers' wake-up, count

    async def open(self, response_id: str) -> None:
        await self._push(response_id, START)

    async def append(self, response_id: str, frame: bytes) -> None:
        await self._push(response_id, frame)

    async def end(self, response_id: str) -> None:
        await self._push(response_id, END)

    async def _push(self, response_id: str, element: bytes) -> None:
        key = KEY_PREFIX + response_id
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.rpush(key, element)
                pipe.pexpire(key, self._ttl_ms)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(str(exc)) from exc
        waiting = self._pushed.pop(response_id, None)
        if waiting is not None:
            waiting[0].set()

    async def read(self, response_id: str, start: int) -> tuple[list[bytes], bool] | None:
        key = KEY_PREFIX + response_id
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.lrange(key, start + 1, -1)
                pipe.lindex(key, -1)
                frames, last = await pipe.execute()
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(str(exc)) from exc
        if last is None:
            return None  # no such list
        frames = [f.encode() if isinstance(f, str) else f for f in frames]
        ended = last in (END, "")
        if ended and frames and frames[-1] == END:
            frames.pop()
        return frames, ended

    async def follow(self, response_id: str, start: int) -> AsyncIterator[bytes]:
        while True:
            found = await self.read(response_id, start)
            if found is None:
                raise LogForgotten(response_id)
            frames, ended = found
            for frame in frames:
                yield frame
            start += len(frames)
            if ended:
                return
            await self._wait(response_id)

    async def _wait(self, response_id: str) -> None:
        """Until a frame is added to the log here, or `POLL_S` passes (a reader reads
        again then; it may find nothing new)."""
        event, readers = self._pushed.get(response_id, (asyncio.Event(), 0))
        self._pushed[response_id] = (event, readers + 1)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), POLL_S)
        finally:
            current = self._pushed.get(response_id)
            if current is not None and current[0] is event:
                if current[1] <= 1:
                    del self._pushed[response_id]
                else:
                    self._pushed[response_id] = (event, current[1] - 1)

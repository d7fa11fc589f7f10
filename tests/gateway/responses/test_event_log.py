"""The logs of streamed background responses: read from any place, followed as frames come
until the log ends, forgotten at the memory log's bounds (ended logs only, oldest first) and
time to live, and the same through a real Redis (a reader on another client polls); a run
that fails mid-stream ends its log with the error event."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from redis.asyncio import Redis
from redis_helpers import RedisServer

from prfaas.gateway.responses.event_log import (
    EventLog,
    LogForgotten,
    MemoryEventLog,
    RedisEventLog,
)
from prfaas.gateway.responses.service import EventSink, ResponsesService
from prfaas.gateway.responses.store import MemoryResponseStore, StoreUnavailable
from prfaas.gateway.responses.turn import ResponseTurn


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def _follow_while_written(writer: EventLog, reader: EventLog) -> None:
    await writer.open("r")
    assert await reader.read("r", 0) == ([], False)
    assert await reader.read("other", 0) is None

    async def follow() -> list[bytes]:
        return [frame async for frame in reader.follow("r", 1)]

    following = asyncio.create_task(follow())
    for n in range(3):
        await writer.append("r", b"e%d" % n)
        await asyncio.sleep(0.01)
    assert not following.done()  # the log has not ended: the reader waits
    await writer.end("r")
    assert await asyncio.wait_for(following, 2) == [b"e1", b"e2"]
    assert await reader.read("r", 0) == ([b"e0", b"e1", b"e2"], True)
    for past_the_end in (3, 4, 100):  # ended, however far past its last frame
        assert await reader.read("r", past_the_end) == ([], True)
        assert [frame async for frame in reader.follow("r", past_the_end)] == []
    with pytest.raises(LogForgotten):
        await anext(reader.follow("other", 0))


async def test_memory_log_is_followed_until_it_ends() -> None:
    log = MemoryEventLog(max_bytes=1000, ttl_s=60)
    await _follow_while_written(log, log)


async def test_memory_log_forgets_ended_logs_at_its_bounds_never_running_ones() -> None:
    """The bound counts ended logs only (oldest ended forgotten first); a reader already
    following a log reads it to its end though it is forgotten meanwhile; a log is gone
    `ttl_s` after it ended; nothing goes into an ended log."""
    clock = Clock()
    log = MemoryEventLog(max_bytes=10, ttl_s=60, clock=clock)
    for name in ("a", "b", "c"):
        await log.open(name)
        await log.append(name, b"12345")
    assert log.bytes_kept == 15  # past the bound, but every log is running
    reader = log.follow("c", 0)
    assert await anext(reader) == b"12345"
    await log.end("b")
    await log.end("a")  # ended logs: 10 bytes, within the bound
    await log.append("c", b"6789")
    await log.end("c")  # 19 ended bytes: b (the oldest ended) and a go
    assert await log.read("b", 0) is None and await log.read("a", 0) is None
    assert await log.read("c", 0) == ([b"12345", b"6789"], True)
    await log.open("d")
    await log.append("d", b"x" * 20)
    await log.end("d")  # past the bound alone: c goes first, then d itself
    assert await log.read("c", 0) is None and await log.read("d", 0) is None
    assert [frame async for frame in reader] == [b"6789"]  # the reader had c: to its end
    with pytest.raises(LogForgotten):
        await anext(log.follow("c", 0))
    await log.open("e")
    await log.end("e")
    await log.append("e", b"late")
    assert await log.read("e", 0) == ([], True)
    clock.now = 60.0
    assert await log.read("e", 0) is None  # its time to live ran out


async def test_redis_log_is_followed_from_another_client(redis: RedisServer) -> None:
    writer_redis, reader_redis = Redis.from_url(redis.url), Redis.from_url(redis.url)
    try:
        await _follow_while_written(
            RedisEventLog(writer_redis, 60), RedisEventLog(reader_redis, 60)
        )
        assert 0 < await writer_redis.pttl("prfaas:events:r") <= 60_000
    finally:
        await writer_redis.aclose()
        await reader_redis.aclose()


class _FailingLog(MemoryEventLog):
    """A log whose third append fails once, as a Redis blip would."""

    failed = False

    async def append(self, response_id: str, frame: bytes) -> None:
        if len(self._logs[response_id].frames) == 2 and not self.failed:
            self.failed = True
            raise StoreUnavailable("connection reset")
        await super().append(response_id, frame)


async def test_a_streamed_background_run_that_fails_ends_its_log_and_its_status() -> None:
    """A run that fails with something other than an API error (the log failing mid-stream)
    is recorded `failed`, and its stream ends with the `error` event at its place: no
    reader waits for ever."""
    log = _FailingLog(1 << 20, 3600)
    service = ResponsesService(MemoryResponseStore(1 << 20, 3600), events=log)
    turn = await service.turn({"model": "m", "input": "hi", "background": True, "stream": True})

    async def run(turn: ResponseTurn, sink: EventSink | None) -> bytes | None:
        assert sink is not None
        for _ in range(5):
            await sink.write(b"event: response.output_text.delta\ndata: {}\n\n")
        return None

    queued = await service.start_background(turn, "m", run)
    frames = [f async for f in await service.events(queued["id"], None)]
    assert len(frames) == 3 and frames[-1].startswith(b"event: error\n")
    assert orjson.loads(frames[-1].split(b"data: ")[1]) == {
        "type": "error", "code": "internal_error", "param": None, "sequence_number": 2,
        "message": "the gateway failed while running the response",
    }  # fmt: skip
    assert (await service.retrieve(queued["id"]))["status"] == "failed"

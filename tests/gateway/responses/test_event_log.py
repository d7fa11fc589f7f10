"""The logs of streamed background responses: read from any place, followed as frames come
until the log ends, forgotten at the memory log's bounds (ended logs only, oldest first) and
time to live, and the same through a real Redis (a reader on another client polls)."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis
from redis_helpers import RedisServer

from prfaas.gateway.responses.event_log import EventLog, MemoryEventLog, RedisEventLog


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
    assert await reader.read("r", 3) == ([], True)


async def test_memory_log_is_followed_until_it_ends() -> None:
    log = MemoryEventLog(max_bytes=1000, ttl_s=60)
    await _follow_while_written(log, log)


async def test_memory_log_forgets_ended_logs_at_its_bounds_never_running_ones() -> None:
    clock = Clock()
    log = MemoryEventLog(max_bytes=10, ttl_s=60, clock=clock)
    for name in ("a", "b", "c"):
        await log.open(name)
        await log.append(name, b"12345")
    assert log.bytes_kept == 15  # over the bound, but every log is running
    await log.end("b")  # the only ended one goes
    assert await log.read("b", 0) is None and log.bytes_kept == 10
    await log.end("a")
    assert await log.read("a", 0) == ([b"12345"], True)  # back within the bound: kept
    clock.now = 60.0
    assert await log.read("a", 0) is None  # its time to live ran out
    assert await log.read("c", 0) == ([b"12345"], False)
    await log.append("a", b"late")  # a forgotten log takes nothing
    assert await log.read("a", 0) is None and log.bytes_kept == 5


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

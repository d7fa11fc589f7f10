"""The Responses API's state: the memory store's bounds (time to live, bytes, least recently
used first), the Redis store against a real redis-server (and while it is down), a follow-up's
stateless engine body, and a turn's answer made the client's and stored before it is
relayed."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from redis_helpers import RedisServer

from prfaas.gateway.responses.conversation import (
    StoredResponse,
    as_input,
    engine_body,
    for_client,
    stored,
)
from prfaas.gateway.responses.redis_store import RedisResponseStore
from prfaas.gateway.responses.store import MemoryResponseStore, ResponseStore, StoreUnavailable
from prfaas.gateway.responses.turn import ResponseTurn

CALL = {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f",
        "arguments": "{}", "status": "completed", "async": None}  # fmt: skip
SAID = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
        "phase": None, "content": [{"type": "output_text", "text": "Hi", "annotations": [],
                                    "logprobs": None}]}  # fmt: skip


def record(n: int = 0, size: int = 10) -> StoredResponse:
    return StoredResponse({"id": f"r{n}", "pad": "x" * size}, [{"role": "user", "content": "q"}])


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_memory_store_forgets_after_its_time_to_live() -> None:
    clock = Clock()
    store = MemoryResponseStore(max_bytes=10_000, ttl_s=60, clock=clock)
    await store.put("a", record())
    clock.now = 59.9
    assert await store.get("a") == record()
    clock.now = 60.0
    assert await store.get("a") is None and len(store) == 0


async def test_memory_store_keeps_its_byte_bound_least_recently_used_first() -> None:
    size = len(record(0, 100).encode())
    store = MemoryResponseStore(max_bytes=3 * size, ttl_s=60)
    for n in range(3):
        await store.put(f"r{n}", record(n, 100))
    assert await store.get("r0") is not None  # r0 used: r1 is now the least recently used
    await store.put("r3", record(3, 100))
    assert [await store.get(f"r{n}") is not None for n in range(4)] == [True, False, True, True]
    assert store.bytes_stored == 3 * size
    await store.put("huge", record(9, 10 * size))  # larger than the whole store: not kept
    assert await store.get("huge") is None and store.bytes_stored == 3 * size
    assert await store.delete("r0") and not await store.delete("r0")
    assert store.bytes_stored == 2 * size


async def test_redis_store_round_trip_and_time_to_live(redis: RedisServer) -> None:
    store = RedisResponseStore(redis.url, ttl_s=0.3)
    try:
        await store.put("a", record())
        assert await store.get("a") == record()
        assert await store.delete("a") and await store.get("a") is None
        await store.put("b", record())
        await asyncio.sleep(0.6)
        assert await store.get("b") is None  # Redis expired it
    finally:
        await store.close()


async def test_redis_store_down_raises_store_unavailable(redis: RedisServer) -> None:
    store = RedisResponseStore(redis.url, ttl_s=60)
    try:
        await store.put("a", record())
        redis.kill()
        for call in (store.get("a"), store.put("b", record()), store.delete("a")):
            with pytest.raises(StoreUnavailable):
                await call
        redis.start()  # back on the same port: the store reconnects (the data is gone)
        assert await store.get("a") is None
    finally:
        await store.close()


def test_a_follow_up_engine_body_holds_the_whole_conversation() -> None:
    previous = StoredResponse({"id": "r1"}, [{"role": "user", "content": "q"}, as_input(CALL)])
    body = {"model": "m", "input": [{"type": "function_call_output", "call_id": "c1",
            "output": "x"}], "previous_response_id": "r1", "store": True, "background": False,
            "instructions": "new"}  # fmt: skip
    out = engine_body(body, previous)
    assert out == {"model": "m", "instructions": "new", "store": False, "input": [
        {"role": "user", "content": "q"},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": "{}",
         "status": "completed"},
        {"type": "function_call_output", "call_id": "c1", "output": "x"},
    ]}  # fmt: skip
    assert engine_body({"input": "hi"}, None) == {"input": "hi", "store": False}


def test_output_items_become_input_items_and_the_record_holds_both() -> None:
    part = {"type": "output_text", "text": "Hi", "annotations": []}
    assert as_input(SAID) == {"type": "message", "role": "assistant", "id": "msg_1",
                              "status": "completed", "content": [part]}  # fmt: skip
    kept = stored({"input": "q"}, {"id": "r1", "output": [SAID, CALL]})
    assert kept.conversation == [{"role": "user", "content": "q"}, as_input(SAID), as_input(CALL)]


def test_the_clients_response_object() -> None:
    engine = {"id": "r2", "previous_response_id": None, "store": False}
    got = for_client(engine, {"previous_response_id": "r1"})
    assert got == {"id": "r2", "previous_response_id": "r1", "store": True}
    assert for_client({"id": "r2"}, {}) == {"id": "r2"}


def _event(kind: str, **fields: Any) -> bytes:
    return orjson.dumps({"type": kind, **fields})


async def test_a_turn_stores_the_final_event_once_the_step_relaying_it_ends() -> None:
    """A memory store takes the final response right after the event-loop step that relays
    it (off the answer's critical path), before any later step could read a follow-up."""
    store = MemoryResponseStore(max_bytes=10_000, ttl_s=60)
    client = {"input": "more", "previous_response_id": "r1"}
    turn = ResponseTurn(client, {"input": [{"role": "user", "content": "q"}]}, store)
    response = {"id": "r2", "previous_response_id": None, "output": [SAID], "status": "completed"}
    created = await turn.event("response.created", _event("response.created", response={
        **response, "output": [], "status": "in_progress"}))  # fmt: skip
    assert orjson.loads(created)["response"]["previous_response_id"] == "r1"
    delta = _event("response.output_text.delta", delta="Hi")
    assert await turn.event("response.output_text.delta", delta) == delta  # as written
    assert await store.get("r2") is None
    final = await turn.event("response.completed", _event("response.completed", response=response))
    assert orjson.loads(final)["response"]["previous_response_id"] == "r1"
    assert await store.get("r2") is None  # the step relaying it has not ended
    await asyncio.sleep(0)
    kept = await store.get("r2")
    assert kept is not None and kept.response["previous_response_id"] == "r1"
    assert kept.conversation[-1] == as_input(SAID) and turn.events == 3


async def test_a_turn_that_cannot_store_still_answers_and_says_so() -> None:
    """A shared store that is down: the answer still goes out, the error is counted."""

    class Down(ResponseStore):
        async def get(self, response_id: str) -> StoredResponse | None:
            raise StoreUnavailable("down")

        async def put(self, response_id: str, record: StoredResponse) -> None:
            raise StoreUnavailable("down")

        async def delete(self, response_id: str) -> bool:
            raise StoreUnavailable("down")

    errors: list[int] = []
    turn = ResponseTurn({"input": "q"}, {"input": "q"}, Down(), lambda: errors.append(1))
    raw = orjson.dumps({"id": "r1", "output": []})
    assert await turn.whole(raw) == raw and errors == [1]

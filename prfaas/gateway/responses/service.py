"""The gateway's side of the Responses API's state: a turn's stored conversation loaded
(`turn`), background responses run and cancelled (`start_background`, `cancel`), and `GET
/v1/responses/{id}` (whole, or streamed again: `events`), `DELETE /v1/responses/{id}`, `POST
/v1/responses/{id}/cancel` answered from the store.

A background response (`background: true`, which needs `store`) is answered at once with
its `queued` object, then run by a task this service owns; its stored object moves to
`in_progress`, then to the engine's answer (`completed`, `incomplete`), or to `failed`
(the engine's error, or the gateway stopping) or `cancelled`. A cancel that reaches another
replica than the one running it marks it `cancelled` in the shared store; the running
replica reads its stored status every `cancel_poll_s` and, once it says cancelled, stops the
engine work (the request is aborted on its engines) and keeps that status.

A streamed background response (`background` and `stream`) is run the same way, its events
written to an `EventLog` as the engine sends them; the client that created it, and any that
asks `GET /v1/responses/{id}?stream=true&starting_after=N`, read that log (a client that
goes away stops only its own reading). A stream that ends without the final response event
(failed, cancelled, the gateway stopping) ends with the `error` event saying why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from functools import partial
from typing import Any

import orjson

from prfaas.gateway.responses.config import ResponsesConfig
from prfaas.gateway.responses.conversation import StoredResponse, engine_body, stored
from prfaas.gateway.responses.event_log import EventLog, LogForgotten, MemoryEventLog
from prfaas.gateway.responses.store import MemoryResponseStore, ResponseStore, StoreUnavailable
from prfaas.gateway.responses.turn import ResponseTurn
from prfaas.protocol import sse
from prfaas.protocol.errors import APIError, invalid
from prfaas.protocol.openai_responses import check_flags
from prfaas.protocol.relayed_answer import FINAL_RESPONSE_EVENTS
from prfaas.protocol.responses_answer import new_id, response_object

logger = logging.getLogger(__name__)
RUNNING = ("queued", "in_progress")
STOPPED = APIError(503, "the gateway stopped before the response was complete; create it "
                   "again", code="shutting_down")  # fmt: skip
CANCELLED = APIError(400, "the response was cancelled", code="response_cancelled")
ENGINE_FAILED = APIError(502, "the request failed on an engine", code="engine_error")
FORGOTTEN = APIError(
    410,
    "the response's events were forgotten before they were read "
    "(the event log's bound); retrieve the response whole",
    code="events_forgotten",
)
INTERNAL = APIError(500, "the gateway failed while running the response", code="internal_error")

MB = 2**20


def create_store(config: ResponsesConfig) -> ResponseStore:
    """The store `config` names (a Redis one connects on first use)."""
    if config.shared:
        from prfaas.gateway.responses.redis_store import RedisResponseStore

        return RedisResponseStore(config.store, config.ttl_s)
    return MemoryResponseStore(round(config.max_mb * MB), config.ttl_s)


def create_event_log(config: ResponsesConfig, store: ResponseStore) -> EventLog:
    """Where streamed background responses' events are kept: beside `store` (a Redis store's
    own client), else in memory (its own `max_mb` bound)."""
    if config.shared:
        from prfaas.gateway.responses.event_log import RedisEventLog
        from prfaas.gateway.responses.redis_store import RedisResponseStore

        assert isinstance(store, RedisResponseStore), "a shared config makes a Redis store"
        return RedisEventLog(store.redis, config.ttl_s)
    return MemoryEventLog(round(config.max_mb * MB), config.ttl_s)


def _error(exc: APIError) -> dict[str, Any]:
    """A response object's `error`."""
    return {"code": exc.code, "message": exc.message}


def not_found(response_id: str, param: str = "response_id") -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param=param,
                    code="response_not_found")  # fmt: skip


def unavailable(exc: StoreUnavailable) -> APIError:
    return APIError(503, f"the response store is unavailable ({exc}); retry",
                    code="store_unavailable", headers={"Retry-After": "1"})  # fmt: skip


class _CancelledElsewhere(Exception):
    """A background response's stored status says another replica cancelled it."""


class EventSink:
    """Where a streamed background response's relay writes its events: the response's log
    (the `start_stream` and `write` of an HTTP exchange, one event per write)."""

    def __init__(self, log: EventLog, response_id: str) -> None:
        self.log, self.response_id = log, response_id
        self.events = 0
        """Events written so far (the next one's `sequence_number`)."""
        self.ended_by_event = False
        """Whether the last event written ends the stream (the final response, or an
        error)."""

    def start_stream(
        self, status: int, headers: Mapping[str, str], content_type: str | None = None,
        *, cut_tail: bytes = b"",
    ) -> EventSink:  # fmt: skip
        return self

    async def write(self, data: bytes) -> None:
        if not data:
            return
        await self.log.append(self.response_id, data)
        self.events += 1  # (a cancel during the append: `_end_stream` reads where it is)
        name = data[7 : data.find(b"\n")] if data.startswith(b"event: ") else b""
        self.ended_by_event = name == b"error" or name.decode() in FINAL_RESPONSE_EVENTS

    async def end(self) -> None:
        """Nothing: the service ends the log once the response's status is recorded."""


Run = Callable[[ResponseTurn, EventSink | None], Awaitable[bytes | None]]
"""A background response's engine work: the turn (as the background response) and, for a
streamed one, where its events go; returns the whole answer (None when streamed)."""


class ResponsesService:
    """Loads, serves and forgets stored responses. `on_store_error` hears of every answer
    the store could not keep; `events` keeps streamed background responses' events
    (default: in memory, 256 MiB, a day)."""

    def __init__(
        self,
        store: ResponseStore,
        on_store_error: Callable[[], None] | None = None,
        *,
        cancel_poll_s: float = 1.0,
        events: EventLog | None = None,
    ) -> None:
        self.store = store
        self.event_log = events or MemoryEventLog(256 * MB, 86400.0)
        self._on_store_error = on_store_error
        self._cancel_poll_s = cancel_poll_s
        self._running: dict[str, asyncio.Task[None]] = {}
        self._stopping = False

    async def turn(self, body: dict[str, Any]) -> ResponseTurn:
        """A Responses request's turn: the engine's stateless body (the stored conversation
        of its `previous_response_id` first) and where its answer is kept.

        Raises:
            APIError: 400 for malformed flags, 404 for an unknown previous response, 503
                while the store cannot be reached.
        """
        check_flags(body)
        previous_id = body.get("previous_response_id")
        previous = None
        if previous_id is not None:
            previous = await self._load(previous_id, "previous_response_id")
            if previous.response.get("status") in RUNNING:
                raise invalid(f"the previous response {previous_id} is still running",
                              "previous_response_id")  # fmt: skip
        keep = body.get("store") is not False
        if body.get("background") is True and not keep:
            raise invalid("background can only be used when `store` is true", "background")
        return ResponseTurn(body, engine_body(body, previous), self.store if keep else None,
                            self._on_store_error)  # fmt: skip

    async def _load(self, response_id: str, param: str) -> StoredResponse:
        try:
            record = await self.store.get(response_id)
        except StoreUnavailable as exc:
            raise unavailable(exc) from None
        if record is None:
            raise not_found(response_id, param)
        return record

    async def retrieve(self, response_id: str) -> dict[str, Any]:
        """`GET /v1/responses/{id}`: the stored response object. Raises APIError(404|503)."""
        return (await self._load(response_id, "response_id")).response

    async def events(self, response_id: str, starting_after: int | None) -> AsyncIterator[bytes]:
        """`GET /v1/responses/{id}?stream=true`: the events of a streamed background
        response after `starting_after`, as they come, until its stream ends.

        Raises:
            APIError: 404 for an unknown response, 400 for one whose events are not kept
                (not a streamed background response, or its log forgotten), 503 while the
                store cannot be reached.
        """
        await self._load(response_id, "response_id")
        start = 0 if starting_after is None else starting_after + 1
        try:
            found = await self.event_log.read(response_id, start)
        except StoreUnavailable as exc:
            raise unavailable(exc) from None
        if found is None:
            raise invalid(f"the events of response {response_id} are not kept: only a "
                          "background response created with `stream` is streamed again",
                          "stream")  # fmt: skip
        return self.follow(response_id, start)

    async def follow(self, response_id: str, start: int) -> AsyncIterator[bytes]:
        """A streamed background response's events from place `start` on, as they come, to
        the end of its stream; the `error` event where the log cannot be read to its end."""
        try:
            async for frame in self.event_log.follow(response_id, start):
                yield frame
        except StoreUnavailable as exc:
            yield sse.error_event("responses", unavailable(exc))
        except LogForgotten:
            yield sse.error_event("responses", FORGOTTEN)

    async def delete(self, response_id: str) -> dict[str, Any]:
        """`DELETE /v1/responses/{id}`: OpenAI's deletion object. Raises APIError(404|503)."""
        try:
            deleted = await self.store.delete(response_id)
        except StoreUnavailable as exc:
            raise unavailable(exc) from None
        if not deleted:
            raise not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def cancel(self, response_id: str) -> dict[str, Any]:
        """`POST /v1/responses/{id}/cancel`: only a response still running in the background
        can be cancelled; the answer is its cancelled object. Raises APIError(400|404|503)."""
        record = await self._load(response_id, "response_id")
        if record.response.get("status") not in RUNNING:
            raise APIError(400, "Cannot cancel a synchronous response.", param="response_id")
        task = self._running.get(response_id)
        if task is not None:  # this replica runs it: stop it (it records the cancel)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return (await self._load(response_id, "response_id")).response
        return await self._mark(response_id, "cancelled")

    async def start_background(self, turn: ResponseTurn, model: str, run: Run) -> dict[str, Any]:
        """Store `turn`'s queued response and run it in the background: `run` dispatches the
        engine's body and returns its whole answer, which is stored when it ends (streamed:
        writes its events to this service's `event_log`, the final one stored as it goes by).
        Returns the queued object (the client's answer now; a streamed one's client reads
        `follow(id, 0)`).

        Raises:
            APIError: 503 when the store cannot keep the queued response.
        """
        response_id = new_id("resp")
        queued = response_object(turn.client, response_id=response_id, created=int(time.time()),
                                 model=model, status="queued", output=[], usage=None)  # fmt: skip
        queued.update(background=True, previous_response_id=turn.client.get("previous_response_id"))
        sink = None
        try:
            if turn.client.get("stream") is True:
                sink = EventSink(self.event_log, response_id)
                await self.event_log.open(response_id)
            await self.store.put(response_id, stored(turn.engine, queued))
        except StoreUnavailable as exc:
            if sink is not None:  # opened, and no one will read it: ended
                with contextlib.suppress(StoreUnavailable):
                    await self.event_log.end(response_id)
            raise unavailable(exc) from None
        task = asyncio.get_running_loop().create_task(
            self._run(response_id, turn.for_background(response_id), run, sink)
        )
        self._running[response_id] = task
        task.add_done_callback(lambda _: self._running.pop(response_id, None))
        return queued

    async def _run(
        self, response_id: str, turn: ResponseTurn, run: Run, sink: EventSink | None
    ) -> None:
        why = ENGINE_FAILED  # how a streamed run that ends without its final event ended
        try:
            await self._mark(response_id, "in_progress")
            raw = await self._watched(response_id, partial(run, turn, sink))
        except _CancelledElsewhere:
            why = CANCELLED  # its stored status says so
            return
        except asyncio.CancelledError:
            why = STOPPED if self._stopping else CANCELLED
            await self._settle(response_id, "failed" if self._stopping else "cancelled")
            raise
        except APIError as exc:
            why = exc
            await self._settle(response_id, "failed", _error(exc))
            return
        except Exception:  # a store that failed mid-stream, or a bug: recorded, never hung
            logger.exception("background response %s failed", response_id)
            why = INTERNAL
            await self._settle(response_id, "failed", _error(INTERNAL))
            return
        finally:
            await self._end_stream(sink, why)
        if sink is not None:  # streamed: the final event stored the answer
            if turn.response is None:
                await self._settle(response_id, "failed", _error(ENGINE_FAILED))
            return
        assert raw is not None, "a whole answer"
        response = {**orjson.loads(raw), "id": response_id, "background": True,
                    "previous_response_id": turn.client.get("previous_response_id")}  # fmt: skip
        current = await self._get(response_id)
        if current is not None and current.response.get("status") == "cancelled":
            return  # cancelled through another replica while the engine worked
        await turn.keep(response, at_once=True)

    async def _end_stream(self, sink: EventSink | None, why: APIError) -> None:
        """End a streamed background response's log: with `why`'s error event unless its
        last event already ended the stream (never raises). The error's `sequence_number`
        is its place in the log as read back (an append cut short by a cancel may or may
        not have landed)."""
        if sink is None:
            return
        try:
            if not sink.ended_by_event:
                found = await self.event_log.read(sink.response_id, sink.events)
                sequence = sink.events + (len(found[0]) if found else 0)
                error = sse.error_event("responses", why, sequence)
                await self.event_log.append(sink.response_id, error)
            await self.event_log.end(sink.response_id)
        except StoreUnavailable as exc:
            logger.warning("the events of response %s were not ended: %s", sink.response_id,
                           exc)  # fmt: skip

    async def _watched(
        self, response_id: str, run: Callable[[], Awaitable[bytes | None]]
    ) -> bytes | None:
        """`run()`'s answer; with a shared store, `_CancelledElsewhere` once the stored
        status says another replica cancelled it (the run is then cancelled: its engines
        abort the request)."""
        if isinstance(self.store, MemoryResponseStore):
            return await run()  # every cancel reaches this replica
        work = asyncio.ensure_future(run())
        try:
            while True:
                done, _ = await asyncio.wait({work}, timeout=self._cancel_poll_s)
                if done:
                    return work.result()
                current = await self._get(response_id)
                if current is not None and current.response.get("status") == "cancelled":
                    work.cancel()
                    await asyncio.gather(work, return_exceptions=True)
                    raise _CancelledElsewhere
        finally:
            if not work.done():  # this task was cancelled (a cancel here, or a stop)
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)

    async def _settle(self, response_id: str, status: str, error: Any = None) -> None:
        """Record how a background response ended without an answer (never raises)."""
        try:
            default = _error(STOPPED) if status == "failed" else None
            await self._mark(response_id, status, error or default)
        except APIError as exc:
            logger.warning("background response %s ended %s, unrecorded: %s", response_id,
                           status, exc.message)  # fmt: skip

    async def _get(self, response_id: str) -> StoredResponse | None:
        try:
            return await self.store.get(response_id)
        except StoreUnavailable:
            return None

    async def _mark(self, response_id: str, status: str, error: Any = None) -> dict[str, Any]:
        """Set a stored response's status (and error). Raises APIError(404|503)."""
        record = await self._load(response_id, "response_id")
        response = {**record.response, "status": status}
        if error is not None:
            response["error"] = error
        try:
            await self.store.put(response_id, StoredResponse(response, record.conversation))
        except StoreUnavailable as exc:
            raise unavailable(exc) from None
        return response

    async def close(self) -> None:
        """Stop the background responses still running (each recorded `failed`), then the
        store's connections."""
        self._stopping = True
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.store.close()

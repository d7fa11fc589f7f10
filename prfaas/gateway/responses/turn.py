"""One Responses request through the gateway: the engine's answer made the client's (the
`previous_response_id` it gave, which the engine never saw) and stored, when asked, so that a
follow-up sent the moment the answer ends finds it: in a store the replicas share, before the
client has it all (the follow-up may reach another replica); in this gateway's own memory,
right after the event-loop step that writes it (off the answer's critical path, and still
before any step that reads a follow-up, which the loop runs later, first in first out).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import orjson

from prfaas.gateway.responses.conversation import for_client, stored
from prfaas.gateway.responses.store import MemoryResponseStore, ResponseStore, StoreUnavailable
from prfaas.protocol.relayed_answer import FINAL_RESPONSE_EVENTS

logger = logging.getLogger(__name__)
RESPONSE_EVENTS = FINAL_RESPONSE_EVENTS | {"response.created", "response.in_progress",
                                           "response.queued"}  # fmt: skip
"""The events that carry the response object."""


class ResponseTurn:
    """The client's body, the body the engine got, and where the answer is stored (None:
    `store: false`). `on_store_error` hears of an answer the store could not keep (the
    client still gets it; a follow-up to it is then answered 404)."""

    def __init__(
        self,
        client: dict[str, Any],
        engine: dict[str, Any],
        store: ResponseStore | None,
        on_store_error: Callable[[], None] | None = None,
        overrides: dict[str, Any] | None = None,
    ) -> None:
        """`overrides`: fields of the response object the gateway sets (a background
        response's id and flag)."""
        self.client, self.engine, self.store = client, engine, store
        self._on_store_error = on_store_error
        self._overrides = overrides or {}
        self._patch = client.get("previous_response_id") is not None or bool(overrides)
        self.events = 0
        """Events relayed so far (the next event's `sequence_number`)."""
        self.response: dict[str, Any] | None = None
        """The final response object, once it went by."""

    def for_background(self, response_id: str) -> ResponseTurn:
        """This turn run in the background as `response_id`: the response objects its events
        carry, and the one stored at its end, have that id and `background: true`."""
        return ResponseTurn(self.client, self.engine, self.store, self._on_store_error,
                            {"id": response_id, "background": True})  # fmt: skip

    async def whole(self, raw: bytes) -> bytes:
        """A whole answer (the response object) as the client's (as written when the
        client's view is the engine's), stored (`keep`)."""
        given = orjson.loads(raw)
        response = await self._final(given)
        return raw if response is given else orjson.dumps(response)

    async def event(self, name: str | None, raw: bytes) -> bytes:
        """One streamed event as the client's; the final one stored (`keep`)."""
        self.events += 1
        if name in FINAL_RESPONSE_EVENTS:
            event = orjson.loads(raw)
            response = await self._final(event["response"])
            return raw if response is event["response"] else orjson.dumps(
                {**event, "response": response}
            )  # fmt: skip
        if self._patch and name in RESPONSE_EVENTS:
            event = orjson.loads(raw)
            return orjson.dumps({**event, "response": self._client_object(event["response"])})
        return raw

    def _client_object(self, response: dict[str, Any]) -> dict[str, Any]:
        return {**for_client(response, self.client), **self._overrides}

    async def _final(self, given: dict[str, Any]) -> dict[str, Any]:
        """The final response object as the client's (`given` itself when that changes
        nothing), stored."""
        response = self._client_object(given)
        if response == given:
            response = given
        self.response = response
        await self.keep(response)
        return response

    async def keep(self, response: dict[str, Any], *, at_once: bool = False) -> None:
        """Store `response` under its id (where this turn is stored): a memory store takes
        it when the current event-loop step ends, a shared store before this returns; with
        `at_once`, any store before this returns (a background response, whose task's end
        a cancel waits on)."""
        response_id = response.get("id")
        if self.store is None or not isinstance(response_id, str):
            return
        if isinstance(self.store, MemoryResponseStore) and not at_once:
            asyncio.get_running_loop().call_soon(self._keep_now, self.store, response_id,
                                                 response)  # fmt: skip
            return
        try:
            if self._overrides and not at_once:  # a streamed background response's end
                current = await self.store.get(response_id)
                if current is not None and current.response.get("status") == "cancelled":
                    return  # cancelled through another replica meanwhile: that stands
            await self.store.put(response_id, stored(self.engine, response))
        except StoreUnavailable as exc:
            logger.warning("response %s was answered but not stored: %s", response_id, exc)
            if self._on_store_error is not None:
                self._on_store_error()

    def _keep_now(self, store: MemoryResponseStore, response_id: str, response: Any) -> None:
        store.put_now(response_id, stored(self.engine, response))

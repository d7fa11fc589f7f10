"""The gateway's side of the Responses API's state: a turn's stored conversation loaded
(`turn`), and `GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`, `POST
/v1/responses/{id}/cancel` answered from the store.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prfaas.gateway.responses.config import ResponsesConfig
from prfaas.gateway.responses.conversation import StoredResponse, engine_body
from prfaas.gateway.responses.store import MemoryResponseStore, ResponseStore, StoreUnavailable
from prfaas.gateway.responses.turn import ResponseTurn
from prfaas.protocol.errors import APIError
from prfaas.protocol.openai_responses import check_flags

MB = 2**20


def create_store(config: ResponsesConfig) -> ResponseStore:
    """The store `config` names (a Redis one connects on first use)."""
    if config.shared:
        from prfaas.gateway.responses.redis_store import RedisResponseStore

        return RedisResponseStore(config.store, config.ttl_s)
    return MemoryResponseStore(round(config.max_mb * MB), config.ttl_s)


def not_found(response_id: str, param: str = "response_id") -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param=param,
                    code="response_not_found")  # fmt: skip


def unavailable(exc: StoreUnavailable) -> APIError:
    return APIError(503, f"the response store is unavailable ({exc}); retry",
                    code="store_unavailable", headers={"Retry-After": "1"})  # fmt: skip


class ResponsesService:
    """Loads, serves and forgets stored responses. `on_store_error` hears of every answer
    the store could not keep."""

    def __init__(
        self, store: ResponseStore, on_store_error: Callable[[], None] | None = None
    ) -> None:
        self.store = store
        self._on_store_error = on_store_error

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
        keep = body.get("store") is not False
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
        can be cancelled. Raises APIError(400|404|503)."""
        await self._load(response_id, "response_id")
        raise APIError(400, "Cannot cancel a synchronous response.", param="response_id")

    async def close(self) -> None:
        await self.store.close()

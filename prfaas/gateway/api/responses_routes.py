"""The stored-response routes of the Responses API: `GET` and `DELETE /v1/responses/{id}`,
`POST /v1/responses/{id}/cancel`, answered from the gateway's response store (engines never
store responses: the gateway hands them stateless bodies)."""

from __future__ import annotations

import orjson

from prfaas.gateway.api.assembly import Gateway
from prfaas.gateway.responses.service import ResponsesService
from prfaas.http.messages import Exchange, HttpRequest, HttpResponse
from prfaas.protocol.errors import APIError

PREFIX = "/v1/responses/"
MAX_ID_CHARS = 256


def response_path(path: str) -> tuple[str, str] | None:
    """`(response id, action)` of `/v1/responses/{id}` (action "") and
    `/v1/responses/{id}/cancel` (action "cancel"); None for any other path."""
    if not path.startswith(PREFIX):
        return None
    response_id, _, action = path[len(PREFIX) :].partition("/")
    if not response_id or action not in ("", "cancel") or len(response_id) > MAX_ID_CHARS:
        return None
    return response_id, action


def _service(gw: Gateway, request: HttpRequest) -> tuple[ResponsesService, str]:
    gw.service.check_auth(request)
    found = response_path(request.path)
    responses = gw.service.responses
    if found is None or responses is None:
        raise APIError(404, f"no route {request.method} {request.path}", code="not_found")
    return responses, found[0]


async def retrieve(gw: Gateway, request: HttpRequest, exchange: Exchange) -> HttpResponse:
    responses, response_id = _service(gw, request)
    return HttpResponse(200, orjson.dumps(await responses.retrieve(response_id)))


async def delete(gw: Gateway, request: HttpRequest, exchange: Exchange) -> HttpResponse:
    responses, response_id = _service(gw, request)
    return HttpResponse(200, orjson.dumps(await responses.delete(response_id)))


async def cancel(gw: Gateway, request: HttpRequest, exchange: Exchange) -> HttpResponse:
    responses, response_id = _service(gw, request)
    return HttpResponse(200, orjson.dumps(await responses.cancel(response_id)))

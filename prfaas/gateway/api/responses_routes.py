"""The stored-response routes of the Responses API: `GET` and `DELETE /v1/responses/{id}`,
`POST /v1/responses/{id}/cancel`, answered from the gateway's response store (engines never
store responses: the gateway hands them stateless bodies). `GET` with `stream=true` streams a
streamed background response's events again, those after `starting_after` (a sequence
number) when given, as vLLM's server does."""

from __future__ import annotations

from urllib.parse import parse_qs

import orjson

from prfaas.gateway.api.assembly import Gateway
from prfaas.gateway.api.completions import relay_events
from prfaas.gateway.responses.service import ResponsesService
from prfaas.http.messages import Exchange, HttpRequest, HttpResponse
from prfaas.protocol.errors import APIError, invalid

PREFIX = "/v1/responses/"
MAX_ID_CHARS = 256
_BOOLEANS = {"true": True, "1": True, "yes": True, "on": True,
             "false": False, "0": False, "no": False, "off": False}  # fmt: skip


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


def stream_query(query: str) -> tuple[bool, int | None]:
    """`stream` and `starting_after` of a retrieve's query string.

    Raises:
        APIError: 400 naming the parameter that is not a boolean or a sequence number.
    """
    params = parse_qs(query, keep_blank_values=True)
    stream = _BOOLEANS.get(params.get("stream", ["false"])[-1].lower())
    if stream is None:
        raise invalid("'stream' must be a boolean", "stream")
    after = params.get("starting_after", [None])[-1]
    if after is None:
        return stream, None
    if not (after.isascii() and after.isdigit()) or len(after) > 18:
        raise invalid("'starting_after' must be a sequence number (an integer >= 0)",
                      "starting_after")  # fmt: skip
    return stream, int(after)


async def retrieve(gw: Gateway, request: HttpRequest, exchange: Exchange) -> HttpResponse | None:
    responses, response_id = _service(gw, request)
    stream, starting_after = stream_query(request.query)
    if stream:
        await relay_events(exchange, await responses.events(response_id, starting_after))
        return None
    return HttpResponse(200, orjson.dumps(await responses.retrieve(response_id)))


async def delete(gw: Gateway, request: HttpRequest, exchange: Exchange) -> HttpResponse:
    responses, response_id = _service(gw, request)
    return HttpResponse(200, orjson.dumps(await responses.delete(response_id)))


async def cancel(gw: Gateway, request: HttpRequest, exchange: Exchange) -> HttpResponse:
    responses, response_id = _service(gw, request)
    return HttpResponse(200, orjson.dumps(await responses.cancel(response_id)))

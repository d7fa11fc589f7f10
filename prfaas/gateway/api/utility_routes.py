"""The routes a client of an engine server expects besides generation: `POST /tokenize`,
`POST /detokenize`, `GET /version`, `GET|POST /ping`, and Anthropic's `POST
/v1/messages/count_tokens`.

In front of vLLM engines (`forward` mode) `/tokenize`, `/detokenize`, `/version` and
`count_tokens` are the engine's own: relayed to a healthy instance (a decode first) as it
answers them. Else the gateway answers with vLLM's bodies from its own tokenizer and
rendering (the one the engines share): `{count, max_model_len, tokens, token_strs}`,
`{prompt}`, `{version}`, `{input_tokens, context_management}`.
`/ping` is the gateway's readiness, as vLLM's is its engine's: 200 with an empty body, or
503.
"""

from __future__ import annotations

from typing import Any

import orjson

import prfaas
from prfaas.common.tokenizer import chat_ids
from prfaas.engine_clients.base import EngineError
from prfaas.engine_clients.vllm import VLLMClient
from prfaas.gateway.api.assembly import Gateway
from prfaas.http.messages import Exchange, HttpRequest, HttpResponse
from prfaas.protocol import anthropic_messages
from prfaas.protocol.errors import APIError, invalid
from prfaas.protocol.openai_chat import chat_prompt
from prfaas.protocol.openai_request import load_json


async def tokenize(gw: Gateway, request: HttpRequest, exchange: Exchange) -> HttpResponse:
    gw.service.check_auth(request)
    if gw.service.mode == "forward":
        return await _relay(gw, "POST", "/tokenize", request.body)
    body = load_json(request.body)
    _model(gw, body)
    tok = gw.service.tokenizer
    if "messages" in body:
        try:
            ids = chat_ids(tok, chat_prompt(body, template=tok.chat_template))
        except ValueError as exc:
            raise invalid(str(exc), "messages") from None
    elif isinstance(body.get("prompt"), str):
        ids = tok.encode(body["prompt"])
    else:
        raise invalid("'prompt' (a string) or 'messages' is required", "prompt")
    strs = [tok.decode([i]) for i in ids] if body.get("return_token_strs") is True else None
    answer = {
        "count": len(ids),
        "max_model_len": gw.config.model.context_length,
        "tokens": ids,
        "token_strs": strs,
    }
    return HttpResponse(200, orjson.dumps(answer))


async def detokenize(gw: Gateway, request: HttpRequest, exchange: Exchange) -> HttpResponse:
    gw.service.check_auth(request)
    if gw.service.mode == "forward":
        return await _relay(gw, "POST", "/detokenize", request.body)
    body = load_json(request.body)
    _model(gw, body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        raise invalid("'tokens' must be a list of non-negative integers", "tokens")
    return HttpResponse(200, orjson.dumps({"prompt": gw.service.tokenizer.decode(tokens)}))


async def count_tokens(gw: Gateway, request: HttpRequest, exchange: Exchange) -> HttpResponse:
    gw.service.check_auth(request)
    if gw.service.mode == "forward":
        return await _relay(gw, "POST", "/v1/messages/count_tokens", request.body)
    service = gw.service
    count = anthropic_messages.count_tokens(load_json(request.body), service.limits,
                                            service.tokenizer)  # fmt: skip
    answer = {"input_tokens": count, "context_management": {"original_input_tokens": count}}
    return HttpResponse(200, orjson.dumps(answer))


async def version(gw: Gateway, request: HttpRequest, exchange: Exchange) -> HttpResponse:
    if gw.service.mode == "forward":
        return await _relay(gw, "GET", "/version", b"")
    return HttpResponse(200, orjson.dumps({"version": prfaas.__version__}))


async def ping(gw: Gateway, request: HttpRequest, exchange: Exchange) -> HttpResponse:
    ready = any(s.healthy and s.cluster == "pd" and s.role != "prefill" for s in gw.instances)
    return HttpResponse(200 if ready else 503, b"")


def _model(gw: Gateway, body: dict[str, Any]) -> None:
    model = body.get("model")
    if model is not None and model != gw.config.model.name:
        raise APIError(404, f"model {model!r} does not exist", param="model",
                       code="model_not_found")  # fmt: skip


async def _relay(gw: Gateway, method: str, path: str, body: bytes) -> HttpResponse:
    """`method path` on a healthy vLLM instance (decodes first), answered as it answers."""
    engines = sorted(
        (s for s in gw.instances if s.healthy and isinstance(s.client, VLLMClient)),
        key=lambda s: (s.role == "prefill", s.instance_id),
    )
    if not engines:
        raise APIError(503, "no healthy engine to answer", code="no_instance_available")
    client = engines[0].client
    assert isinstance(client, VLLMClient)
    try:
        status, answer = await client.relay(method, path, body)
    except EngineError as exc:
        raise APIError(502, f"the engine did not answer {path}", code="engine_error") from exc
    return HttpResponse(status, answer)

"""Anthropic Messages (`POST /v1/messages`, `/v1/messages/count_tokens`) and OpenAI Responses
(`POST /v1/responses`) on the engine, as vLLM serves them: each body becomes the chat body
vLLM makes of it (`prfaas.protocol.anthropic_messages`, `openai_responses`), which the
engine's chat path runs (tools, grammars, streaming, SGLang's `bootstrap_*` in a PD pair),
and the chat answer becomes the API's (`prfaas.protocol.anthropic_answer`,
`responses_answer`).

What the engine cannot honour is refused with a 400 naming it: a thinking budget (no
reasoning parser), fields outside the served sets, and for Responses `store: true`,
`previous_response_id` and `background` (the gateway keeps the Responses state and hands
engines stateless bodies), tool types other than functions, `include` beyond the output
text's log-probabilities and truncation other than "disabled".
"""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import Any

import orjson
from aiohttp import web

from prfaas.engines.reference.server.app_keys import INFO, SERVICE, TOKENIZER
from prfaas.engines.reference.server.openai_routes import chat_events, start_chat, whole_answer
from prfaas.engines.reference.server.streaming import open_sse
from prfaas.protocol import anthropic_answer, anthropic_messages, openai_responses
from prfaas.protocol.errors import invalid
from prfaas.protocol.generate import MAX_TOP_LOGPROBS
from prfaas.protocol.openai_request import HARMLESS_FIELDS, ModelLimits, load_json
from prfaas.protocol.responses_answer import (
    LOGPROBS_INCLUDE,
    ResponseStream,
    new_id,
    response,
)
from prfaas.protocol.sse import frame

PD_FIELDS = frozenset({"bootstrap_host", "bootstrap_port", "bootstrap_room", "prefix_pull"})
"""SGLang's disaggregation fields (and PrfaaS's prefix pull), passed to the chat path."""
MESSAGES_FIELDS = PD_FIELDS | frozenset({
    "model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature",
    "top_p", "top_k", "tools", "tool_choice", "metadata", "output_config", "thinking",
    "chat_template_kwargs",
})  # fmt: skip
"""What the engine's Messages route serves."""
RESPONSES_FIELDS = PD_FIELDS | HARMLESS_FIELDS | frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "top_k",
    "min_p", "stop", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "stop_token_ids", "ignore_eos", "skip_special_tokens", "tools",
    "tool_choice", "parallel_tool_calls", "text", "reasoning", "include", "top_logprobs",
    "stream", "truncation", "chat_template_kwargs", "background", "previous_response_id",
})  # fmt: skip
"""What the engine's Responses route reads (some values of which it refuses)."""
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "stop", "seed", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "logit_bias", "stop_token_ids",
            "ignore_eos", "skip_special_tokens", "parallel_tool_calls")  # fmt: skip
"""Responses fields the chat body takes as they are."""


def _served(body: dict[str, Any], fields: frozenset[str], path: str) -> None:
    for key in body:
        if key not in fields:
            raise invalid(f"'{key}' is not supported by this engine on {path}", key)


def _limits(request: web.Request) -> ModelLimits:
    service, info = request.app[SERVICE], request.app[INFO]
    pool = service.core.pool.config
    return ModelLimits(info.model, pool.num_blocks * pool.block_size, info.vocab_size)


async def messages(request: web.Request) -> web.StreamResponse:
    """`POST /v1/messages`."""
    body = load_json(await request.read())
    _served(body, MESSAGES_FIELDS, "/v1/messages")
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        raise invalid("a thinking budget is not supported by this engine (no reasoning "
                      "parser)", "thinking")  # fmt: skip
    tok = request.app[TOKENIZER]
    anthropic_messages.check_model(body, request.app[INFO].model)
    chat = anthropic_messages.to_chat(body, anthropic_messages.template_rules(tok))
    chat.update({k: body[k] for k in PD_FIELDS if k in body})
    answer, pieces = await start_chat(request, chat, "chat")
    if chat.get("stream") is not True:
        return web.json_response(anthropic_answer.message(await whole_answer(pieces, answer)))
    stream = anthropic_answer.MessageStream()
    response: web.StreamResponse | None = None
    async with aclosing(chat_events(pieces, answer)) as events:
        async for event in events:
            response = response or await open_sse(request)  # errors before it stay JSON
            for name, data in stream.feed(event):
                await response.write(frame("messages", orjson.dumps(data), name))
    assert response is not None, "a request ends with a finish reason"
    for name, data in stream.done():
        await response.write(frame("messages", orjson.dumps(data), name))
    return response


async def count_tokens(request: web.Request) -> web.Response:
    """`POST /v1/messages/count_tokens`: the prompt's tokens, as vLLM answers."""
    body = load_json(await request.read())
    count = anthropic_messages.count_tokens(body, _limits(request), request.app[TOKENIZER])
    return web.json_response(
        {"input_tokens": count, "context_management": {"original_input_tokens": count}}
    )


def responses_chat(body: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """The chat body the engine runs for a Responses `body`.

    Raises:
        APIError: 400 naming what the engine cannot honour.
    """
    _served(body, RESPONSES_FIELDS, "/v1/responses")
    for key, allowed in (("store", (None, False)), ("background", (None, False)),
                         ("previous_response_id", (None,)),
                         ("truncation", (None, "disabled"))):  # fmt: skip
        if body.get(key) not in allowed:
            raise invalid(f"'{key}' {body[key]!r} is not supported by this engine (the gateway "
                          "keeps the Responses state)", key)  # fmt: skip
    chat = openai_responses.to_chat(body)
    for i, tool in enumerate(body.get("tools") or ()):
        if tool.get("type") != "function":
            raise invalid(f"'tools[{i}]': {tool.get('type')} tools are not supported by this "
                          "engine (function tools are)", f"tools[{i}].type")  # fmt: skip
    chat.update({k: body[k] for k in (*SAMPLING, *PD_FIELDS) if body.get(k) is not None})
    chat["max_tokens"] = max_tokens
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise invalid("'tool_choice' must be none, auto, required or a function",
                          "tool_choice")  # fmt: skip
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        chat["tool_choice"] = choice
    chat.update(_text_format(body.get("text")))
    chat.update(_logprobs(body))
    if body.get("stream") is True:
        chat.update(stream=True, stream_options={"include_usage": True})
    return chat


def _text_format(text: Any) -> dict[str, Any]:
    """`text.format` as chat's `response_format`."""
    if text is None:
        return {}
    fmt = text.get("format") if isinstance(text, dict) else None
    extra = sorted(set(text) - {"format"}) if isinstance(text, dict) else ["text"]
    if extra:
        raise invalid(f"'text.{extra[0]}' is not supported by this engine", f"text.{extra[0]}")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in (None, "text"):
        return {}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema" and isinstance(fmt, dict):
        schema = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    raise invalid(f"'text.format.type' {kind!r} is not supported", "text.format.type")


def _logprobs(body: dict[str, Any]) -> dict[str, Any]:
    include = body.get("include") or []
    if not isinstance(include, list) or any(i != LOGPROBS_INCLUDE for i in include):
        raise invalid(f"'include' may only name {LOGPROBS_INCLUDE!r} on this engine", "include")
    top = body.get("top_logprobs")
    if top is not None and (type(top) is not int or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise invalid(f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}]",
                      "top_logprobs")  # fmt: skip
    return {"logprobs": True, "top_logprobs": top or 0} if include else {}


async def responses(request: web.Request) -> web.StreamResponse:
    """`POST /v1/responses` (stateless: the gateway keeps stored responses)."""
    body = load_json(await request.read())
    tok = request.app[TOKENIZER]
    call = openai_responses.parse_call(body, _limits(request), tok)
    chat = responses_chat(body, call.sampling.max_new_tokens)
    answer, pieces = await start_chat(request, chat, "chat")
    response_id = new_id("resp")
    if not call.stream:
        return web.json_response(response(body, await whole_answer(pieces, answer), response_id))
    stream = ResponseStream(body, response_id, int(time.time()), call.model)
    out: web.StreamResponse | None = None
    usage = None
    async with aclosing(chat_events(pieces, answer)) as events:
        async for event in events:
            if out is None:
                out = await open_sse(request)  # errors before it stay JSON errors
                for data in stream.start():
                    await out.write(frame("responses", orjson.dumps(data), data["type"]))
            if not event.get("choices"):
                usage = event.get("usage")
                continue
            for data in stream.feed(event):
                await out.write(frame("responses", orjson.dumps(data), data["type"]))
    assert out is not None, "a request ends with a finish reason"
    for data in stream.finish(usage):
        await out.write(frame("responses", orjson.dumps(data), data["type"]))
    return out


def add_agent_routes(app: web.Application) -> None:
    """Register the Messages and Responses routes on `app`."""
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_post("/v1/responses", responses)

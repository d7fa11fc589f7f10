"""The gateway's forwarded OpenAI bodies against the real sglang 0.5.23 request models: the
field lists the SGLang client refuses beyond are the ones SGLang declares, and every shape of
the conformance battery it forwards parses into SGLang's `ChatCompletionRequest` or
`CompletionRequest` with the PD fields (`bootstrap_*`) and every client field intact."""

from __future__ import annotations

import asyncio
from typing import Any

import pydantic
import pytest
from agent_battery import GREEDY_MESSAGES, GREEDY_RESPONSES, MESSAGES, RESPONSES
from openai_battery import CHAT, COMPLETIONS, GREEDY, PROMPT, USER
from sglang.srt.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from sglang.srt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesRequest,
)

from prfaas.engine_clients.sglang import (
    SGLANG_CHAT_FIELDS,
    SGLANG_COMPLETION_FIELDS,
    SGLANG_MESSAGES_FIELDS,
    SGLANG_RESPONSES_FIELDS,
    forwarded_body,
    unknown_to_sglang,
)
from prfaas.protocol.client_body import ClientBody
from prfaas.protocol.generate import Bootstrap, GenerateRequest

MODELS: dict[str, Any] = {"chat": ChatCompletionRequest, "completions": CompletionRequest}


def test_the_declared_field_lists_are_sglangs() -> None:
    assert set(ChatCompletionRequest.model_fields) == SGLANG_CHAT_FIELDS
    assert set(CompletionRequest.model_fields) == SGLANG_COMPLETION_FIELDS
    assert set(AnthropicMessagesRequest.model_fields) == SGLANG_MESSAGES_FIELDS
    assert set(ResponsesRequest.model_fields) == SGLANG_RESPONSES_FIELDS


AGENT_MODELS: dict[str, Any] = {"messages": AnthropicMessagesRequest,
                                "responses": ResponsesRequest}  # fmt: skip
AGENT_BASES = {"messages": GREEDY_MESSAGES, "responses": GREEDY_RESPONSES}
MALFORMED = ("over-context", "unknown-block", "bad-role", "no-max-tokens", "unknown-model",
             "unknown-item", "no-input")  # fmt: skip


def _agent_shapes() -> list[Any]:
    return [
        pytest.param(api, extra, id=f"{api}-{name}")
        for api, shapes in (("messages", MESSAGES), ("responses", RESPONSES))
        for name, extra in shapes.items() if name not in MALFORMED
    ]  # fmt: skip


@pytest.mark.parametrize(("api", "extra"), _agent_shapes())
def test_messages_and_responses_bodies_parse_in_sglang_with_the_pd_fields(
    api: str, extra: Any
) -> None:
    """Every well-formed Messages and Responses shape of the agent battery, forwarded with
    SGLang's PD fields, parses into sglang's own request model with `bootstrap_*` set, or
    is refused by name by the client (a field the model does not declare)."""
    body = {k: v for k, v in {**AGENT_BASES[api], **extra, "stream": True}.items()
            if v is not None}  # fmt: skip
    client_body = ClientBody(api, body)  # type: ignore[arg-type]
    unknown = unknown_to_sglang(client_body)
    if unknown is not None:
        assert unknown in body and unknown not in AGENT_MODELS[api].model_fields
        return
    request = GenerateRequest("r", (1, 2), bootstrap=Bootstrap("10.0.0.1", 8998, 42),
                              client_body=client_body)  # fmt: skip
    parsed = AGENT_MODELS[api](**asyncio.run(_body(request)))
    assert (parsed.bootstrap_host, parsed.bootstrap_port, parsed.bootstrap_room) == (
        "10.0.0.1", 8998, 42)  # fmt: skip


def _shapes() -> list[Any]:
    return [
        pytest.param(api, extra, id=f"{api}-{name}")
        for api, shapes in (("chat", CHAT), ("completions", COMPLETIONS))
        for name, extra in shapes.items()
    ]


@pytest.mark.parametrize(("api", "extra"), _shapes())
def test_forwarded_bodies_parse_in_sglang_with_every_field(api: str, extra: Any) -> None:
    base = {**GREEDY, "messages": USER} if api == "chat" else {**GREEDY, "prompt": PROMPT}
    body = {**base, **extra, "stream": True}
    openai = ClientBody(api, body)  # type: ignore[arg-type]
    unknown = unknown_to_sglang(openai)
    if unknown is not None:  # refused by name by the client: SGLang would ignore it
        assert unknown in extra and unknown not in MODELS[api].model_fields
        return
    request = GenerateRequest(
        "r", (1, 2), bootstrap=Bootstrap("10.0.0.1", 8998, 42), client_body=openai
    )
    sent = asyncio.run(_body(request))
    if extra.get("temperature") == "hot":  # SGLang's own 400 (the gateway refuses it first)
        with pytest.raises(pydantic.ValidationError, match="temperature"):
            MODELS[api](**sent)
        return
    parsed = MODELS[api](**sent)
    assert (parsed.bootstrap_host, parsed.bootstrap_port, parsed.bootstrap_room) == (
        "10.0.0.1", 8998, 42)  # fmt: skip
    for key, value in body.items():
        assert getattr(parsed, key) is not None or value is None, key
    assert parsed.stream_options is not None and parsed.stream_options.include_usage


async def _body(request: GenerateRequest) -> dict[str, Any]:
    return forwarded_body(request)

"""Agents against the embedded default (`prfaas serve`: three reference engines, a PrfaaS
prefill and a PD prefill/decode pair), which serves Anthropic Messages and OpenAI Responses
itself: the official `anthropic` and `openai` clients (create, stream, tool-use round trips,
count_tokens, `previous_response_id`, a streamed background response read again), a 10-turn
agent loop per API whose every turn from the second on routes only what it added (within one
block: the prefix hits), and the battery of shapes, whole and streamed, each working with its
effect shown in the answer, or refused with a 4xx in the API's own error body."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from agent_battery import (
    CITY,
    FUNCTION,
    GREEDY_MESSAGES,
    GREEDY_RESPONSES,
    STREAMABLE_ERRORS,
    TOOL,
    USER,
    assembled_message,
    assembled_response,
    body,
    cases,
    message_text,
    messages_loop,
    output_text,
    post,
    responses_loop,
    sse_events,
)
from serve_live_helpers import MODEL, spawn, started, stop

pytestmark = pytest.mark.timeout(900)
BLOCK = 64
"""The embedded default's page size: the KV index's block."""
SAMPLED = ("top-k-top-p", "top-p")
"""Shapes that sample (their streamed and whole answers differ)."""


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    proc = spawn("serve", "--port", "0", "--no-scheduler")
    try:
        yield started(proc)
    finally:
        stop(proc)


def test_anthropic_sdk_tool_use_round_trip_stream_and_count(url: str) -> None:
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    greedy = {"temperature": 0}
    first = client.messages.create(
        model=MODEL, max_tokens=150, tools=[TOOL], messages=USER,  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather"}, extra_body=greedy,
    )  # fmt: skip
    use = first.content[0]
    assert use.type == "tool_use" and use.name == "get_weather"
    assert use.input["city"] in CITY["properties"]["city"]["enum"]  # type: ignore[index]
    assert first.stop_reason == "tool_use"
    turns = [*USER, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                           "content": "18 C"}]}]  # fmt: skip
    with client.messages.stream(model=MODEL, max_tokens=8, tools=[TOOL], messages=turns,  # type: ignore[arg-type]
                                extra_body=greedy) as stream:  # fmt: skip
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    whole = client.messages.create(model=MODEL, max_tokens=8, tools=[TOOL], messages=turns,  # type: ignore[arg-type]
                                   extra_body=greedy)  # fmt: skip
    assert streamed == message_text(final.model_dump()) == message_text(whole.model_dump())
    count = client.messages.count_tokens(model=MODEL, tools=[TOOL], messages=turns)  # type: ignore[arg-type]
    usage = whole.usage
    assert count.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_openai_sdk_function_call_round_trip_with_previous_response_id(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    first = client.responses.create(
        model=MODEL, input=USER[0]["content"], tools=[FUNCTION], temperature=0,  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=150,
    )  # fmt: skip
    call = first.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Lyon")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}
    follow = {"model": MODEL, "previous_response_id": first.id, "temperature": 0,
              "max_output_tokens": 8, "tools": [FUNCTION], "input": [output]}  # fmt: skip
    whole = client.responses.create(**follow)
    with client.responses.stream(**follow) as stream:
        final = stream.get_final_response()
    assert whole.previous_response_id == first.id == final.previous_response_id
    assert final.output_text == whole.output_text
    assert whole.usage is not None and first.usage is not None
    assert whole.usage.input_tokens > first.usage.input_tokens  # the whole conversation
    assert client.responses.retrieve(whole.id).output_text == whole.output_text
    background = list(client.responses.create(**follow, background=True, stream=True))
    response_id = background[0].response.id
    assert background[-1].type == "response.completed"
    assert background[-1].response.output_text == whole.output_text
    again = list(client.responses.retrieve(response_id, stream=True, starting_after=2))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in background[3:]]


def _loop_poster(url: str, path: str) -> Any:
    def post_one(payload: dict[str, Any]) -> tuple[dict[str, str], Any]:
        status, headers, answer = post(url, path, payload)
        assert status == 200, answer
        return headers, answer

    return post_one


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_an_agent_loop_routes_only_what_each_turn_added(url: str, api: str) -> None:
    """Ten turns with tool calls: every turn succeeds, and from the second on the
    incremental length is at most the tokens the turn added plus one block."""
    loop = messages_loop if api == "messages" else responses_loop
    turns = loop(_loop_poster(url, f"/v1/{api}"), MODEL)
    assert len(turns) == 10 and sum(t.tool_calls > 0 for t in turns) >= 6, turns
    for before, turn in itertools.pairwise(turns):
        added = turn.prompt_tokens - before.prompt_tokens
        assert added > 0 and turn.incremental_tokens <= added + BLOCK, (before, turn)


@pytest.mark.parametrize(("api", "name", "extra", "stream"), cases())
def test_every_shape_works_or_is_refused_in_the_apis_own_error(
    url: str, api: str, name: str, extra: dict[str, Any], stream: bool
) -> None:
    base = GREEDY_MESSAGES if api == "messages" else GREEDY_RESPONSES
    status, _, answer = post(url, f"/v1/{api}", body(base, extra, stream, MODEL))
    if name in STREAMABLE_ERRORS:
        assert status == (404 if name == "unknown-model" else 400), answer
        if api == "messages":
            assert answer["type"] == "error" and answer["error"]["message"]
        else:
            assert answer["error"]["message"]
        return
    assert status == 200, answer
    if api == "messages":
        message = assembled_message(sse_events(answer)) if stream else answer
        _messages_effect(name, message)
        if not stream and name not in SAMPLED:
            again = post(url, "/v1/messages", body(base, extra, True, MODEL))[2]
            assert message_text(assembled_message(sse_events(again))) == message_text(message)
    else:
        response = assembled_response(sse_events(answer)) if stream else answer
        _responses_effect(name, response)


def _messages_effect(name: str, message: dict[str, Any]) -> None:
    """What the shape's feature shows in the answer."""
    uses = [b for b in message["content"] if b["type"] == "tool_use"]
    assert message["usage"]["output_tokens"] <= 150
    if name in ("tools-any", "tools-named"):
        assert uses and uses[0]["name"] == "get_weather" and message["stop_reason"] == "tool_use"
        assert uses[0]["input"]["city"] in ("Paris", "Lyon")
    if name == "tools-none":
        assert not uses
    if name == "output-format":
        assert json.loads(message_text(message))["answer"] in ("yes", "no")


def _responses_effect(name: str, response: dict[str, Any]) -> None:
    calls = [i for i in response["output"] if i["type"] == "function_call"]
    if name in ("tools-required", "tools-named"):
        assert calls and calls[0]["name"] == "get_weather"
        assert json.loads(calls[0]["arguments"])["city"] in ("Paris", "Lyon")
    if name == "tools-none":
        assert not calls
    if name == "json-schema":
        assert json.loads(output_text(response))["answer"] in ("yes", "no")
    if name == "json-object":  # a grammar of objects: cut short, still an object's start
        text = output_text(response)
        assert text.startswith("{")
        if response["status"] == "completed":
            assert isinstance(json.loads(text), dict)
    if name == "logprobs":
        parts = [p for i in response["output"] if i["type"] == "message" for p in i["content"]]
        logprobs = parts[0]["logprobs"]
        assert logprobs and all(len(lp["top_logprobs"]) == 2 for lp in logprobs)
    if name == "plain":
        assert response["status"] == "incomplete"  # 12 tokens of a random model
        assert response["usage"]["output_tokens"] == 12


def test_a_stop_sequence_cuts_the_answer_where_it_first_appears(url: str) -> None:
    plain = post(url, "/v1/messages", {**GREEDY_MESSAGES, "model": MODEL})[2]
    text = message_text(plain)
    stop_at = next(c for c in text[2:] if c.isprintable() and not c.isspace())
    cut = post(url, "/v1/messages", {**GREEDY_MESSAGES, "model": MODEL,
                                     "stop_sequences": [stop_at]})[2]  # fmt: skip
    assert cut["stop_reason"] == "stop_sequence" and cut["stop_sequence"] == stop_at
    assert message_text(cut) == text[: text.index(stop_at)]

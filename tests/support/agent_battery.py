"""The Anthropic Messages and OpenAI Responses request shapes the agent-API tests send: what
an agent's client uses (system prompts and instructions, tools and every `tool_choice`, tool
calls and their results, stop sequences, output limits, structured output, reasoning
options, log-probabilities) and malformed bodies, as extra fields over a greedy base body,
plus a 10-turn agent loop per API."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

USER = [{"role": "user", "content": "Tell me about the weather in Paris in spring, please."}]
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}},
    "required": ["city"],
    "additionalProperties": False,
}
"""A tool's parameters whose every value is short (enums): a forced call ends in a few
tokens even from the random tiny model."""
TOOL = {"name": "get_weather", "description": "The weather in a city.", "input_schema": CITY,
        "strict": True}  # fmt: skip
TOOL_2 = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
FUNCTION = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
            "parameters": CITY, "strict": True}  # fmt: skip
FUNCTION_2 = {"type": "function", "name": "get_time",
              "parameters": {"type": "object", "properties": {}}}  # fmt: skip
TOOL_TURNS = [
    *USER,
    {"role": "assistant", "content": [
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
    ]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                  "content": "18 C, sunny"}]},
]  # fmt: skip
CALL_ITEMS = [
    {"role": "user", "content": USER[0]["content"]},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather",
     "arguments": '{"city": "Paris"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "18 C, sunny"},
]  # fmt: skip
GREEDY_MESSAGES = {"model": "tiny", "max_tokens": 12, "temperature": 0, "messages": USER}
GREEDY_RESPONSES = {"model": "tiny", "max_output_tokens": 12, "temperature": 0,
                    "input": USER[0]["content"]}  # fmt: skip

MESSAGES: dict[str, dict[str, Any]] = {
    "plain": {},
    "system": {"system": "Answer in one word."},
    "system-blocks": {"system": [{"type": "text", "text": "Be "},
                                 {"type": "text", "text": "brief."}]},
    "text-blocks": {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]},
    "prefill": {"messages": [*USER, {"role": "assistant", "content": "In spring"}]},
    "tools-auto": {"tools": [TOOL, TOOL_2]},
    "tools-any": {"tools": [TOOL], "max_tokens": 150,
                  "tool_choice": {"type": "any", "disable_parallel_tool_use": True}},
    "tools-named": {"tools": [TOOL, TOOL_2], "max_tokens": 150,
                    "tool_choice": {"type": "tool", "name": "get_weather"}},
    "tools-none": {"tools": [TOOL], "tool_choice": {"type": "none"}},
    "tool-result-turn": {"messages": TOOL_TURNS, "tools": [TOOL]},
    "stop-sequences": {"stop_sequences": ["e", "a"]},
    "top-k-top-p": {"temperature": 1.0, "top_k": 5, "top_p": 0.9},
    "output-format": {"max_tokens": 60, "output_config": {"format": {
        "type": "json_schema", "schema": SCHEMA}}},
    "thinking-disabled": {"thinking": {"type": "disabled"}},
    "effort": {"output_config": {"effort": "low"}},
    "metadata": {"metadata": {"user_id": "u1"}},
    "over-context": {"max_tokens": 10**6},
    "unknown-block": {"messages": [{"role": "user", "content": [{"type": "bogus"}]}]},
    "bad-role": {"messages": [{"role": "robot", "content": "hi"}]},
    "no-max-tokens": {"max_tokens": None},
    "unknown-model": {"model": "nope"},
}  # fmt: skip
"""Extra fields over `GREEDY_MESSAGES` (None removes a field). A forced call that may name
any tool allows one call (greedy, the random model would repeat array items past any
budget)."""
RESPONSES: dict[str, dict[str, Any]] = {
    "plain": {},
    "instructions": {"instructions": "Answer in one word."},
    "items": {"input": [{"role": "developer", "content": "Be brief."},
                        {"type": "message", "role": "user",
                         "content": [{"type": "input_text", "text": "Hello"}]}]},
    "tools-auto": {"tools": [FUNCTION, FUNCTION_2]},
    "tools-required": {"tools": [FUNCTION], "tool_choice": "required", "max_output_tokens": 150,
                       "parallel_tool_calls": False},
    "tools-named": {"tools": [FUNCTION, FUNCTION_2], "max_output_tokens": 150,
                    "tool_choice": {"type": "function", "name": "get_weather"}},
    "tools-none": {"tools": [FUNCTION], "tool_choice": "none"},
    "function-call-turn": {"input": CALL_ITEMS, "tools": [FUNCTION]},
    "json-schema": {"max_output_tokens": 60, "text": {"format": {
        "type": "json_schema", "name": "a", "schema": SCHEMA, "strict": True}}},
    "json-object": {"max_output_tokens": 24, "text": {"format": {"type": "json_object"}}},
    "top-p": {"temperature": 1.0, "top_p": 0.9},
    "logprobs": {"include": ["message.output_text.logprobs"], "top_logprobs": 2},
    "reasoning-effort": {"reasoning": {"effort": "low"}},
    "unknown-item": {"input": [{"type": "item_reference", "id": "x"}]},
    "no-input": {"input": None},
    "unknown-model": {"model": "nope"},
}  # fmt: skip
"""Extra fields over `GREEDY_RESPONSES` (None removes a field)."""
STREAMABLE_ERRORS = ("over-context", "unknown-block", "bad-role", "no-max-tokens",
                     "unknown-model", "unknown-item", "no-input")  # fmt: skip
"""Malformed shapes (refused before any answer, streamed or not)."""


def body(base: dict[str, Any], extra: dict[str, Any], stream: bool, model: str) -> dict[str, Any]:
    merged = {**base, "model": model, **extra, "stream": stream}
    if extra.get("model") == "nope":
        merged["model"] = "nope"
    return {k: v for k, v in merged.items() if v is not None}


def cases() -> list[Any]:
    """Every shape of both APIs, whole and streamed: `(api, name, extra, stream)`."""
    out = []
    for api, shapes in (("messages", MESSAGES), ("responses", RESPONSES)):
        for name, extra in shapes.items():
            for stream in (False, True):
                mode = "stream" if stream else "whole"
                out.append(pytest.param(api, name, extra, stream, id=f"{api}-{name}-{mode}"))
    return out


@dataclass
class Turn:
    """One agent turn as the gateway answered it."""

    prompt_tokens: int
    incremental_tokens: int
    route: str
    tool_calls: int


def messages_loop(post: Callable[[dict[str, Any]], tuple[dict[str, str], Any]], model: str,
                  turns: int = 10) -> list[Turn]:  # fmt: skip
    """An Anthropic agent loop: a system prompt and a tool; two turns of three force the tool
    (the third lets the model answer), every tool use answered with its result (else a new
    user question). `post(body)` returns (headers, message)."""
    system = "You are a careful weather agent. Check every city with the tool. " * 4
    history: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris today?"}]
    out = []
    for k in range(turns):
        choice = {"type": "auto"} if k % 3 == 2 else {"type": "tool", "name": "get_weather"}
        body = {"model": model, "max_tokens": 150, "system": system, "tools": [TOOL],
                "tool_choice": choice, "messages": history, "temperature": 0}  # fmt: skip
        headers, message = post(body)
        usage = message["usage"]
        prompt = usage["input_tokens"] + (usage.get("cache_read_input_tokens") or 0) + (
            usage.get("cache_creation_input_tokens") or 0)  # fmt: skip
        uses = [b for b in message["content"] if b["type"] == "tool_use"]
        out.append(Turn(prompt, int(headers["x-prfaas-incremental-tokens"]),
                        headers["x-prfaas-route"], len(uses)))  # fmt: skip
        history.append({"role": "assistant", "content": message["content"]})
        if uses:
            history.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": b["id"], "content": f"{18 + k} C"}
                for b in uses]})  # fmt: skip
        else:
            history.append({"role": "user", "content": f"And in Lyon, day {k}?"})
    return out


def responses_loop(post: Callable[[dict[str, Any]], tuple[dict[str, str], Any]], model: str,
                   turns: int = 10) -> list[Turn]:  # fmt: skip
    """An OpenAI Responses agent loop chained with `previous_response_id` (the gateway keeps
    the conversation): instructions and a function tool; two turns of three force it, every
    call answered with a `function_call_output` (else a new user question)."""
    instructions = "You are a careful weather agent. Check every city with the tool. " * 4
    previous: str | None = None
    items: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris today?"}]
    out = []
    for k in range(turns):
        choice: Any = "auto" if k % 3 == 2 else {"type": "function", "name": "get_weather"}
        body = {"model": model, "max_output_tokens": 150, "instructions": instructions,
                "tools": [FUNCTION], "tool_choice": choice, "input": items,
                "temperature": 0}  # fmt: skip
        if previous is not None:
            body["previous_response_id"] = previous
        headers, response = post(body)
        calls = [i for i in response["output"] if i["type"] == "function_call"]
        out.append(Turn(response["usage"]["input_tokens"],
                        int(headers["x-prfaas-incremental-tokens"]), headers["x-prfaas-route"],
                        len(calls)))  # fmt: skip
        previous = response["id"]
        outputs = [{"type": "function_call_output", "call_id": c["call_id"],
                    "output": f"{18 + k} C"} for c in calls]  # fmt: skip
        items = outputs or [{"role": "user", "content": f"And in Lyon, day {k}?"}]
    return out


def post(url: str, path: str, payload: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    """POST a JSON body: status, headers, and the answer (JSON, or a stream's raw bytes)."""
    request = urllib.request.Request(url + path, json.dumps(payload).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            raw, status, headers = r.read(), r.status, dict(r.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read() or b"null")
    return status, headers, raw if payload.get("stream") else json.loads(raw)


def sse_events(raw: bytes) -> list[tuple[str | None, Any]]:
    """A stream's events as (name, data) pairs (`data: [DONE]` kept as the string)."""
    out: list[tuple[str | None, Any]] = []
    for block in raw.split(b"\n\n"):
        name, data = None, None
        for line in block.split(b"\n"):
            if line.startswith(b"event:"):
                name = line[6:].strip().decode()
            elif line.startswith(b"data:"):
                payload = line[5:].strip()
                data = payload.decode() if payload == b"[DONE]" else json.loads(payload)
        if data is not None:
            out.append((name, data))
    return out


def assembled_message(events: list[tuple[str | None, Any]]) -> dict[str, Any]:
    """The message an Anthropic client builds from a stream's events (each event's name
    checked against its type; the blocks' texts and tool inputs joined)."""
    message: dict[str, Any] = {}
    partial: dict[int, str] = {}
    for name, data in events:
        assert name == data["type"], (name, data)
        if name == "message_start":
            message = {**data["message"], "content": []}
        elif name == "content_block_start":
            assert data["index"] == len(message["content"])
            message["content"].append(dict(data["content_block"]))
        elif name == "content_block_delta":
            block, delta = message["content"][data["index"]], data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "input_json_delta":
                partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
        elif name == "message_delta":
            message.update(data["delta"], usage=data["usage"])
    for index, text in partial.items():
        try:
            message["content"][index]["input"] = json.loads(text)
        except ValueError:
            message["content"][index]["input"] = {"unparsed": text}
    assert events[-1][0] == "message_stop", "a whole stream ends with message_stop"
    return message


def assembled_response(events: list[tuple[str | None, Any]]) -> dict[str, Any]:
    """The final response of a Responses stream, checked against its events: numbered in
    order from 0, the text deltas joining to the final text."""
    numbers = [data["sequence_number"] for _, data in events]
    assert numbers == list(range(len(numbers))), numbers
    for name, data in events:
        assert name == data["type"], (name, data)
    final = events[-1][1]
    assert final["type"] == "response.completed", final["type"]
    text = "".join(d["delta"] for _, d in events if d["type"] == "response.output_text.delta")
    assert text == output_text(final["response"])
    return dict(final["response"])


def output_text(response: dict[str, Any]) -> str:
    return "".join(p.get("text", "") for item in response["output"] if item["type"] == "message"
                   for p in item["content"])  # fmt: skip


def message_text(message: dict[str, Any]) -> str:
    return "".join(b.get("text", "") for b in message["content"] if b["type"] == "text")

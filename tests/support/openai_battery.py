"""The OpenAI request shapes the conformance tests send: every feature a client of vLLM's
OpenAI server uses (tools, grammars, sampling fields, log-probabilities, several choices,
template options), as extra fields over a greedy base body."""

from __future__ import annotations

from typing import Any

import pytest

USER = [{"role": "user", "content": "Tell me about the weather in Paris in spring, please."}]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"],
        },
        "strict": True,
    },
}
TOOL_2 = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 6}},
            "required": ["zone"],
        },
        "strict": True,
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 8}},
    "required": ["answer"],
    "additionalProperties": False,
}
TURN_2 = [
    *USER,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 18}'},
]
PROMPT = "The history of the city of Lyon begins with"
GREEDY = {"model": "tiny", "max_tokens": 12, "temperature": 0}

CHAT: dict[str, dict[str, Any]] = {
    "plain": {},
    "system-developer": {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": "Answer in French."},
            *USER,
        ]
    },
    "text-parts": {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}],
            }
        ]
    },
    "tools-required": {"tools": [TOOL, TOOL_2], "tool_choice": "required", "max_tokens": 120},
    "tools-named": {
        "tools": [TOOL, TOOL_2],
        "max_tokens": 120,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
    },
    "tools-auto": {"tools": [TOOL], "tool_choice": "auto"},
    "tools-none": {"tools": [TOOL], "tool_choice": "none"},
    "tools-not-parallel": {
        "tools": [TOOL, TOOL_2],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 120,
    },
    "agent-turn-2": {"messages": TURN_2, "tools": [TOOL]},
    "json-object": {"response_format": {"type": "json_object"}, "max_tokens": 24},
    "json-schema": {
        "max_tokens": 120,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": SCHEMA, "strict": True},
        },
    },
    "choice": {"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    "regex": {"structured_outputs": {"regex": "[a-c]{3}-[0-9]{2}"}},
    "logit-bias": {"logit_bias": {"65": 100}},
    "stop-token-ids": {"stop_token_ids": [101, 32]},
    "stop": {"stop": ["e", "a"]},
    "repetition-penalty": {"repetition_penalty": 1.3},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
    "logprobs": {"logprobs": True, "top_logprobs": 3},
    "n-2": {"n": 2, "temperature": 1.0, "seed": 7},
    "seeded": {"temperature": 1.0, "seed": 11, "top_p": 0.9},
    "min-tokens": {"min_tokens": 10, "max_tokens": 10},
    "continue-final": {
        "messages": [*USER, {"role": "assistant", "content": "In spring"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    },
    "no-generation-prompt": {"add_generation_prompt": False},
    "template-kwargs": {"chat_template_kwargs": {"enable_thinking": False}},
    "return-token-ids": {"return_token_ids": True},
    "prompt-logprobs": {"prompt_logprobs": 1},
    "over-context": {"max_tokens": 5000},
    "bad-temperature": {"temperature": "hot"},
    "unknown-model": {"model": "nope"},
}
COMPLETIONS: dict[str, dict[str, Any]] = {
    "text": {},
    "token-ids": {"prompt": list(PROMPT.encode())},
    "batch": {"prompt": [PROMPT, "Once upon a time"]},
    "echo": {"echo": True},
    "suffix": {"suffix": "and so on."},
    "logprobs": {"logprobs": 2},
    "n-2": {"n": 2, "temperature": 1.0, "seed": 3},
    "json-object": {"response_format": {"type": "json_object"}, "max_tokens": 24},
    "choice": {"structured_outputs": {"choice": ["red", "green"]}},
    "logit-bias": {"logit_bias": {"101": 100}},
    "stop-token-ids": {"stop_token_ids": [32]},
    "repetition-penalty": {"repetition_penalty": 1.5},
    "prompt-logprobs": {"prompt_logprobs": 2},
    "return-token-ids": {"return_token_ids": True},
    "empty": {"prompt": ""},
}
STREAM_ONLY = {
    "usage": {"stream_options": {"include_usage": True}},
    "continuous-usage": {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
}


def merged(events: list[Any]) -> dict[str, Any]:
    """A stream's events (after `[DONE]` was checked and dropped) as one answer: per choice,
    text pieces joined and lists extended in order, other values the last given; usage the
    last one given. Where a stream splits its tokens into events depends on the engine's
    step timing, not on the answer."""
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for event in events:
        usage = event.get("usage") or usage
        for choice in event.get("choices") or ():
            _merge(choices.setdefault(choice["index"], {}), choice)
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usage}


def _merge(into: dict[str, Any], piece: dict[str, Any]) -> None:
    for key, value in piece.items():
        old = into.get(key)
        if key == "tool_calls" and isinstance(value, list):
            if not isinstance(old, list):
                old = into[key] = []
            _merge_calls(old, value)
        elif isinstance(value, str | list) and type(old) is type(value):
            into[key] = old + value
        elif isinstance(value, dict) and isinstance(old, dict):
            _merge(old, value)
        elif value is not None or key not in into:
            into[key] = value


def _merge_calls(calls: list[dict[str, Any]], fragments: list[dict[str, Any]]) -> None:
    """Streamed tool-call fragments joined per call (its `index`), as text pieces are: where
    a stream cuts a call's arguments depends on the engine's step timing too (two tokens in
    one step make one fragment)."""
    by_index = {call.get("index"): call for call in calls}
    for fragment in fragments:
        call = by_index.get(fragment.get("index"))
        if call is None:
            call = by_index[fragment.get("index")] = {}
            calls.append(call)
        _merge(call, fragment)


def battery_cases() -> list[Any]:
    """Every shape as a test case `(api, name, extra fields, streamed)`, whole and streamed
    (the stream-only shapes streamed only), named `api-name-whole|stream`."""
    cases = []
    for api, shapes in (("chat", CHAT), ("completions", COMPLETIONS)):
        for name, extra in {**shapes, **STREAM_ONLY}.items():
            for stream in (False, True):
                if name in STREAM_ONLY and not stream:
                    continue
                mode = "stream" if stream else "whole"
                cases.append(pytest.param(api, name, extra, stream, id=f"{api}-{name}-{mode}"))
    return cases

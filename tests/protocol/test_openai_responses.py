"""OpenAI Responses bodies as vLLM 0.32's chat bodies (input items to turns, tools, template
flags), their routing ids and output limit, and the 400 every malformed body gets. The same
rules are checked against a real vLLM server's `/v1/responses/render` in
tests/gateway/api/test_vllm_agent_apis.py."""

from __future__ import annotations

from typing import Any

import pytest

from prfaas.common.tokenizer import ByteTokenizer
from prfaas.protocol.errors import APIError
from prfaas.protocol.openai_request import ModelLimits, chat_body_ids
from prfaas.protocol.openai_responses import parse_call, to_chat

LIMITS = ModelLimits("tiny", 4096, 260)
CALL = {"type": "function_call", "call_id": "c1", "name": "get_weather",
        "arguments": '{"city": "Paris"}'}  # fmt: skip
SAID = {"type": "message", "role": "assistant",
        "content": [{"type": "output_text", "text": "Hello", "annotations": []},
                    {"type": "output_text", "text": "ignored"}]}  # fmt: skip


def turns(items: Any, **body: Any) -> list[dict[str, Any]]:
    return list(to_chat({"model": "tiny", "input": items, **body})["messages"])


def test_instructions_and_a_string_input() -> None:
    assert turns("Hi", instructions="Be brief.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]


def test_calls_reasoning_and_text_join_the_assistant_turn_before_them() -> None:
    """Reasoning, a message and a call become one assistant turn; each call output a tool
    turn; an assistant message's first part is its text."""
    reasoning = {"type": "reasoning", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "think"}]}  # fmt: skip
    out = {"type": "function_call_output", "call_id": "c1", "output": "18 C"}
    assert turns([{"role": "user", "content": "Weather?"}, reasoning, SAID, CALL, out]) == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "reasoning": "think", "content": "Hello", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "18 C", "tool_call_id": "c1"},
    ]  # fmt: skip


def test_a_call_after_a_tool_turn_opens_a_new_assistant_turn() -> None:
    out = {"type": "function_call_output", "call_id": "c1", "output": "x"}
    got = turns([CALL, out, {**CALL, "call_id": "c2", "namespace": "ns"}])
    assert [t["role"] for t in got] == ["assistant", "tool", "assistant"]
    assert got[2]["tool_calls"][0]["function"]["name"] == "ns__get_weather"


def test_custom_tools_and_calls_are_one_string_functions() -> None:
    items = [{"type": "custom_tool_call", "call_id": "x", "name": "shell", "input": "ls"}]
    chat = to_chat({"input": items, "tools": [{"type": "custom", "name": "shell"}]})
    assert chat["messages"][0]["tool_calls"][0]["function"]["arguments"] == '{"input": "ls"}'
    function = chat["tools"][0]["function"]
    assert function["name"] == "shell" and function["parameters"]["required"] == ["input"]


def test_function_and_namespace_tools_render_others_do_not() -> None:
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True},
             {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "g"}]},
             {"type": "web_search"}]  # fmt: skip
    functions = [t["function"] for t in to_chat({"input": "x", "tools": tools})["tools"]]
    assert functions == [
        {"name": "f", "description": None, "parameters": {"type": "object"}, "strict": True,
         "defer_loading": None},
        {"name": "ns__g", "description": None, "parameters": None, "strict": None,
         "defer_loading": None},
    ]  # fmt: skip


def test_an_incomplete_last_assistant_message_is_continued() -> None:
    said = {**SAID, "status": "incomplete"}
    chat = to_chat({"input": [{"role": "user", "content": "Hi"}, said],
                    "chat_template_kwargs": {"add_generation_prompt": True, "x": 1}})  # fmt: skip
    assert chat["continue_final_message"] is True and chat["add_generation_prompt"] is False
    assert chat["chat_template_kwargs"] == {"x": 1}  # the rule's own flags win


def test_reasoning_effort() -> None:
    assert to_chat({"input": "x", "reasoning": {"effort": "high"}})["reasoning_effort"] == "high"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": 3}, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]"),
        ({"input": [{"type": "web_search_call"}]}, "input[0]"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0]"),
        ({"input": [{**CALL, "arguments": {}}]}, "input[0].arguments"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "reasoning", "encrypted_content": "e"}]}, "input"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"input": "x", "tools": ["f"]}, "tools[0]"),
        ({"input": "x", "instructions": 3}, "instructions"),
    ],
)  # fmt: skip
def test_malformed_bodies_get_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as caught:
        to_chat({"model": "tiny", **body})
    assert caught.value.status == 400 and caught.value.param == param


def test_parse_call_limits_output_to_the_context_left() -> None:
    tok = ByteTokenizer()
    body = {"model": "tiny", "input": "Hi", "instructions": "S"}
    call = parse_call(body, LIMITS, tok)
    ids = chat_body_ids(tok, to_chat(body))
    assert list(call.input_ids) == ids and call.api == "responses"
    assert call.sampling.max_new_tokens == LIMITS.context_length - len(ids)  # none asked
    assert parse_call({**body, "max_output_tokens": 7}, LIMITS, tok).sampling.max_new_tokens == 7
    assert parse_call({"input": "Hi"}, LIMITS, tok).model == "tiny"  # no model: the served one
    for bad, status in (({"model": "nope"}, 404), ({"max_output_tokens": 0}, 400),
                        ({"stream": "yes"}, 400), ({"input": "x" * 5000}, 400)):  # fmt: skip
        with pytest.raises(APIError) as caught:
            parse_call({**body, **bad}, LIMITS, tok)
        assert caught.value.status == status

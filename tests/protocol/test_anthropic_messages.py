"""Anthropic Messages bodies as vLLM 0.32's chat bodies (the conversion rules, exactly), their
routing ids, and the 4xx every malformed body gets, naming its field. The same rules are
checked against a real vLLM server's `/v1/messages/render` in
tests/gateway/api/test_vllm_agent_apis.py."""

from __future__ import annotations

from typing import Any

import pytest

from prfaas.common.tokenizer import ByteTokenizer, Tokenizer
from prfaas.protocol.anthropic_messages import (
    TemplateRules,
    count_tokens,
    parse_call,
    template_rules,
    to_chat,
)
from prfaas.protocol.errors import APIError
from prfaas.protocol.openai_request import ModelLimits, chat_body_ids

RULES = TemplateRules(merge_inline_system=False, disabled_thinking_effort="low")
LIMITS = ModelLimits("tiny", 4096, 260)
TOOL = {"name": "get_weather", "description": "d",
        "input_schema": {"properties": {"city": {"type": "string"}}}}  # fmt: skip
BASE = {"model": "tiny", "max_tokens": 10}


def chat(body: dict[str, Any], rules: TemplateRules = RULES) -> dict[str, Any]:
    return to_chat({**BASE, **body}, rules)


def test_system_blocks_join_without_separator_and_drop_billing_headers() -> None:
    body = {"system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1"},
                       {"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            "messages": [{"role": "user", "content": "Hi"}]}  # fmt: skip
    assert chat(body)["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]


def test_inline_system_messages_stay_unless_the_template_refuses_them() -> None:
    """In place by default; joined to the first system turn when the template refuses a
    system turn after the first."""
    messages = [{"role": "user", "content": "A"}, {"role": "system", "content": "S2"},
                {"role": "user", "content": "B"}]  # fmt: skip
    body = {"system": "S1", "messages": messages}
    assert [t["role"] for t in chat(body)["messages"]] == ["system", "user", "system", "user"]
    merged = chat(body, TemplateRules(True, "low"))["messages"]
    assert merged == [{"role": "system", "content": "S1S2"}, {"role": "user", "content": "A"},
                      {"role": "user", "content": "B"}]  # fmt: skip


def test_tool_use_and_results_become_tool_calls_and_tool_turns_in_order() -> None:
    """A user's tool results become tool turns before the rest of that message; an
    assistant's tool use a call with JSON arguments, its text the content."""
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "s"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1",
             "content": [{"type": "text", "text": "18"}, {"type": "text", "text": "C"}]},
            {"type": "text", "text": "Tomorrow?"},
        ]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "x"}]},
    ]  # fmt: skip
    turns = chat({"messages": messages})["messages"]
    assert turns == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "reasoning": "hmm", "content": "Checking.", "tool_calls": [
            {"id": "t1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "18\nC"},
        {"role": "user", "content": "Tomorrow?"},
        {"role": "tool", "tool_call_id": "t2", "content": "x"},
    ]  # fmt: skip


def test_an_assistants_tool_result_is_text_and_several_text_blocks_stay_parts() -> None:
    result = [{"type": "text", "text": "r"}]
    blocks = [{"type": "text", "text": "A"},
              {"type": "tool_result", "tool_use_id": "x", "content": result}]  # fmt: skip
    messages = [{"role": "assistant", "content": blocks}]
    assert chat({"messages": messages})["messages"][0]["content"] == [
        {"type": "text", "text": "A"},
        {"type": "text", "text": f"Tool result: {result}"},
    ]


def test_tools_choice_and_sampling_map_to_chat_fields() -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": [TOOL],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stop_sequences": ["x"], "temperature": 0, "top_k": 5, "stream": True}  # fmt: skip
    out = chat(body)
    assert out["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "d", "strict": None, "defer_loading": None,
        "parameters": {"properties": {"city": {"type": "string"}}, "type": "object"},
    }}]  # fmt: skip
    assert out["tool_choice"] == "required" and out["parallel_tool_calls"] is False
    assert (out["stop"], out["temperature"], out["top_k"]) == (["x"], 0, 5)
    assert out["max_tokens"] == out["max_completion_tokens"] == 10
    assert out["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    named = chat({**body, "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat({**body, "tool_choice": None})["tool_choice"] == "auto"  # tools without one


def test_tool_additions_and_removals_resolve_the_tool_list() -> None:
    other = {"name": "get_time", "input_schema": {"type": "object"}, "defer_loading": True}
    system = {"role": "system", "content": [
        {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "get_time"}},
        {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "get_weather"}},
    ]}  # fmt: skip
    out = chat({"tools": [TOOL, other], "messages": [system, {"role": "user", "content": "Hi"}]})
    assert [t["function"]["name"] for t in out["tools"]] == ["get_time"]
    assert out["tools"][0]["function"]["defer_loading"] is None  # added: no longer deferred


def test_effort_format_and_disabled_thinking() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    schema = {"type": "object"}
    out = chat({"messages": messages, "output_config": {"effort": "high", "format": {
        "type": "json_schema", "schema": schema}}})  # fmt: skip
    assert out["reasoning_effort"] == "high"
    named = {"schema": schema, "name": "json_schema"}
    assert out["response_format"] == {"type": "json_schema", "json_schema": named}
    off = chat({"messages": messages, "thinking": {"type": "disabled"}})
    assert off["reasoning_effort"] == "low"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "bogus"}]}]},
         "messages[0].content[0].type"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
         "messages[0].content[0].text"),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "x"}}]}]},
         "messages[0].content[0]"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"tools": [{"name": "x"}]}, "tools[0].input_schema"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"tool_choice": {"type": "maybe"}}, "tool_choice.type"),
        ({"stop_sequences": "x"}, "stop_sequences"),
        ({"temperature": "hot"}, "temperature"),
        ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2000}}, "thinking.budget_tokens"),
        ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
    ],
)  # fmt: skip
def test_malformed_bodies_get_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    full = {**BASE, "messages": [{"role": "user", "content": "Hi"}], **body}
    with pytest.raises(APIError) as caught:
        to_chat(full, RULES)
    assert caught.value.status == 400 and caught.value.param == param


def test_parse_call_routes_by_the_rendered_ids_and_checks_model_and_context() -> None:
    tok = ByteTokenizer()
    body = {**BASE, "system": "S", "messages": [{"role": "user", "content": "Hi"}]}
    call = parse_call(body, LIMITS, tok)
    want = chat_body_ids(tok, to_chat(body, template_rules(tok)))
    assert list(call.input_ids) == want and call.api == "messages"
    assert call.body is not None and call.body.fields is body and call.sampling.max_new_tokens == 10
    assert count_tokens({k: v for k, v in body.items() if k != "max_tokens"}, LIMITS, tok) == len(
        want
    )
    with pytest.raises(APIError) as caught:
        parse_call({**body, "model": "nope"}, LIMITS, tok)
    assert caught.value.status == 404
    with pytest.raises(APIError) as caught:
        parse_call({**body, "max_tokens": 5000}, LIMITS, tok)
    assert caught.value.code == "context_length_exceeded"


class _StrictTemplate(ByteTokenizer):
    """A template that refuses a system turn after the first, and ignores effort."""

    chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
        "{{ raise_exception('system first') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )


class _EffortTemplate(ByteTokenizer):
    """A template that renders the effort (so "none" is a real choice)."""

    chat_template = "{{ reasoning_effort }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.mark.parametrize(
    ("tokenizer", "rules"),
    [
        (ByteTokenizer(), TemplateRules(False, "low")),
        (_StrictTemplate(), TemplateRules(True, "low")),
        (_EffortTemplate(), TemplateRules(False, "none")),
    ],
)
def test_template_rules_are_probed_as_vllm_probes_them(
    tokenizer: Tokenizer, rules: TemplateRules
) -> None:
    assert template_rules(tokenizer) == rules

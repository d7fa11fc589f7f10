"""`chat_prompt`: an OpenAI chat body as vLLM 0.32 hands it to the chat template (the rules
in `prfaas/protocol/openai_chat.py`), and the two modes' field policies of `parse_call`."""

from __future__ import annotations

from typing import Any

import pytest
from openai_battery import CHAT, COMPLETIONS, GREEDY, PROMPT, TURN_2, USER

from prfaas.common.tokenizer import ByteTokenizer, ChatPrompt, render_template
from prfaas.protocol.errors import APIError
from prfaas.protocol.openai_chat import chat_prompt
from prfaas.protocol.openai_request import (
    GENERATE_FIELDS,
    HARMLESS_FIELDS,
    ModelLimits,
    generate_gap,
    parse_call,
)

LIMITS = ModelLimits("tiny", 4096)


def test_tool_calls_get_object_arguments_and_tool_turns_keep_their_id() -> None:
    """An assistant's `content: null` is an empty string, its JSON arguments an object; a
    tool turn keeps `tool_call_id`; the client's body is not mutated."""
    body = {"messages": TURN_2}
    prompt = chat_prompt(body, template=None)
    assistant, tool = prompt.messages[1], prompt.messages[2]
    assert assistant["content"] == ""
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert TURN_2[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert (tool["tool_call_id"], tool["content"]) == ("call_1", '{"temperature_c": 18}')


@pytest.mark.parametrize("arguments", ["not json", "[1, 2]", "", None])
def test_arguments_that_are_no_json_object_become_empty(arguments: Any) -> None:
    call = {"type": "function", "function": {"name": "f", "arguments": arguments}}
    body = {"messages": [{"role": "assistant", "content": "x", "tool_calls": [call]}]}
    turn = chat_prompt(body, template=None).messages[0]
    assert turn["tool_calls"][0]["function"]["arguments"] == {}


def test_developer_turns_merge_into_one_system_turn_unless_the_template_names_them() -> None:
    body = {"messages": [{"role": "system", "content": "A"}, {"role": "user", "content": "u"},
                         {"role": "developer", "content": "B", "tools": []}]}  # fmt: skip
    merged = chat_prompt(body, template="{{ messages }}").messages
    assert [dict(m) for m in merged] == [
        {"role": "system", "content": "A\n\nB"},
        {"role": "user", "content": "u"},
    ]
    kept = chat_prompt(body, template="{% if r == 'developer' %}{% endif %}")
    assert [m["role"] for m in kept.messages] == ["system", "user", "developer"]


def test_tools_are_dumped_as_vllms_request_model_dumps_them() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    prompt = chat_prompt({"messages": USER, "tools": [tool]}, template=None)
    assert prompt.tools == [{"type": "function", "function": {
        "name": "f", "description": None, "parameters": {"type": "object"}}}]  # fmt: skip


def test_text_parts_join_with_newlines() -> None:
    body = {"messages": CHAT["text-parts"]["messages"]}
    assert chat_prompt(body, template=None).messages[0]["content"] == ("Hello\nthere")


class _Templated(ByteTokenizer):
    chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )


def test_continue_final_message_ends_inside_the_last_turn() -> None:
    """As `transformers` cuts it: right after the final message's text, no end tag and no
    generation prompt."""
    messages = [*USER, {"role": "assistant", "content": "In spring "}]
    text = render_template(_Templated(), ChatPrompt(messages, add_generation_prompt=False,
                                                    continue_final_message=True))  # fmt: skip
    assert text.endswith("<assistant>In spring")


def _body(api: str, extra: dict[str, Any]) -> dict[str, Any]:
    base = {**GREEDY, "messages": USER} if api == "chat" else {**GREEDY, "prompt": PROMPT}
    return {**base, **extra}


BATTERY = [
    pytest.param(api, extra, id=f"{api}-{name}")
    for api, shapes in (("chat", CHAT), ("completions", COMPLETIONS))
    for name, extra in shapes.items()
]


@pytest.mark.parametrize(("api", "extra"), BATTERY)
def test_generate_mode_expresses_or_forwards_every_field(api: str, extra: dict[str, Any]) -> None:
    """Reference engines and SGLang servers (`generate` mode): a body that `/generate`
    sampling expresses whole becomes those parameters, every field taken into them; any other
    travels whole to the engine's own OpenAI route (which honours or refuses it). Only what
    the gateway itself reads (model, context, the prompt) may be refused here: nothing is
    dropped."""
    body = _body(api, extra)
    try:
        call = parse_call(body, api, LIMITS, ByteTokenizer(), "generate")  # type: ignore[arg-type]
    except APIError as exc:
        assert exc.status in (400, 404)
        assert exc.param in ("model", "prompt", "messages", "temperature"), exc.message
        return
    if call.body is not None:
        assert generate_gap(body) is not None and call.body.fields == body
        return
    assert set(body) <= GENERATE_FIELDS | HARMLESS_FIELDS
    s = call.sampling
    assert (s.max_new_tokens, s.temperature) == (
        body.get("max_tokens", 16), float(body.get("temperature", 1.0)))  # fmt: skip
    taken = {
        "logit_bias": s.logit_bias, "stop_token_ids": s.stop_token_ids, "stop": s.stop,
        "repetition_penalty": s.repetition_penalty != 1.0, "seed": s.seed,
        "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
        "min_tokens": s.min_new_tokens, "top_p": s.top_p != 1.0,
    }  # fmt: skip
    for key in set(extra) & set(taken):
        assert taken[key], f"{key} was dropped"


@pytest.mark.parametrize(("api", "extra"), BATTERY)
def test_forward_mode_keeps_the_body_whole(api: str, extra: dict[str, Any]) -> None:
    """vLLM engines (`forward` mode): the body travels as the client sent it; only what the
    gateway reads (model, context, the prompt it tokenizes) may be refused here."""
    body = _body(api, extra)
    try:
        call = parse_call(body, api, LIMITS, ByteTokenizer(), "forward")  # type: ignore[arg-type]
    except APIError as exc:
        assert exc.param in ("model", "prompt", "messages"), exc.message
        return
    assert call.body is not None and call.body.fields == body


def test_clients_may_not_set_the_disaggregation_fields() -> None:
    for key in ("kv_transfer_params", "bootstrap_room"):
        with pytest.raises(APIError) as err:
            parse_call({**_body("chat", {}), key: {}}, "chat", LIMITS, ByteTokenizer(), "forward")
        assert (err.value.status, err.value.param) == (400, key)


def test_completions_logprobs_zero_is_the_chosen_tokens_own_and_is_forwarded() -> None:
    """`logprobs: 0` asks for the chosen token's log-probability (not for none): `/generate`
    cannot give it, so the body goes whole to the engine."""
    body = {**_body("completions", {}), "logprobs": 0}
    call = parse_call(body, "completions", LIMITS, ByteTokenizer(), "generate")
    assert generate_gap(body) == "logprobs" and call.body is not None
    chat = {**_body("chat", {}), "logprobs": False, "top_logprobs": 0}
    assert generate_gap(chat) is None

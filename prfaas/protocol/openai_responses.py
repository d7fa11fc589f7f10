"""OpenAI Responses bodies (`POST /v1/responses`): checked, and turned into the chat body vLLM
0.32 renders them as (`entrypoints/openai/responses/utils.py`, `construct_input_messages`,
and `ResponsesRequest.build_chat_params`), so that the gateway's routing ids equal the
engine's prompt ids, and so that the reference engine answers them through its chat path.

The rule, as vLLM's:
- `instructions` is the first turn, a system one; a string `input` a user turn.
- Input items in order: a message item (a `role`) is a chat turn as it is, except an
  assistant's, whose text (its first content part's) joins the assistant turn before it
  when that one has no content yet; a `function_call` (or `custom_tool_call`) joins the
  assistant turn before it as a tool call (else opens one); a `reasoning` item gives the
  assistant turn before it its reasoning (else opens one); a `function_call_output` (or
  `custom_tool_call_output`) is a tool turn. Any other item is refused.
- Function tools become chat function tools (a namespace's as `NAMESPACE__NAME`, a custom
  tool as a one-string-argument function `input`); other tool types are not rendered.
- A last input item that is an assistant message or a reasoning item `in_progress` or
  `incomplete` is continued (`continue_final_message`) instead of answered.
- `reasoning.effort` becomes `reasoning_effort`; `chat_template_kwargs` pass on.

`previous_response_id` is the gateway's (`prfaas.gateway.response_store`): before this
conversion the gateway replaces it with the stored conversation, so what is rendered here is
always the whole prompt. Every rejection is an `APIError` naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from prfaas.common.tokenizer import Tokenizer
from prfaas.protocol.client_body import ClientBody
from prfaas.protocol.errors import APIError, invalid
from prfaas.protocol.generate import SamplingParams
from prfaas.protocol.openai_request import (
    CompletionCall,
    ModelLimits,
    chat_body_ids,
    check_context,
    typed,
)

CUSTOM_TOOL_INPUT = "input"
"""The one argument of the function a custom tool is shown as."""
CUSTOM_TOOL_PARAMETERS = {
    "type": "object",
    "properties": {
        CUSTOM_TOOL_INPUT: {
            "type": "string",
            "description": "The freeform text payload for this tool.",
        }
    },
    "required": [CUSTOM_TOOL_INPUT],
    "additionalProperties": False,
}
NAMESPACE_SEPARATOR = "__"
TOOL_CALLS = ("function_call", "custom_tool_call")
TOOL_OUTPUTS = ("function_call_output", "custom_tool_call_output")
CONTINUED = ("in_progress", "incomplete")
RESERVED_KWARGS = ("add_generation_prompt", "continue_final_message")
"""Template kwargs the Responses rule sets itself (a request's own are overridden)."""


def parse_call(body: dict[str, Any], limits: ModelLimits, tokenizer: Tokenizer) -> CompletionCall:
    """A Responses body (the gateway's stored conversation already in its input) as the
    request the Router dispatches: its prompt ids rendered as the engine renders them, its
    output limit (the context's remainder without `max_output_tokens`, which vLLM clamps to
    it); the body travels whole.

    Raises:
        APIError: 400 naming a malformed field or a prompt that leaves no room for output,
            404 for a model that is not served.
    """
    model = check_model(body, limits.name)
    check_flags(body)
    ids = chat_body_ids(tokenizer, to_chat(body))
    check_context(len(ids), 1, limits)
    room = limits.context_length - len(ids)
    limit = min(max_output_tokens(body) or room, room)
    sampling = SamplingParams(max_new_tokens=limit)
    stream = body.get("stream") is True
    return CompletionCall("responses", model, tuple(ids), sampling, stream, False,
                          ClientBody("responses", body))  # fmt: skip


def check_model(body: dict[str, Any], served: str) -> str:
    """The body's model: the served one (vLLM's Responses route serves a body without one).

    Raises:
        APIError: 400 for a model that is not a string, 404 for another model.
    """
    model = body.get("model", served)
    if not isinstance(model, str) or not model:
        raise invalid("'model' must be a string", "model")
    if model != served:
        raise APIError(404, f"model {model!r} does not exist", param="model",
                       code="model_not_found")  # fmt: skip
    return model


def max_output_tokens(body: dict[str, Any]) -> int | None:
    value = body.get("max_output_tokens")
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise invalid("'max_output_tokens' must be a positive integer", "max_output_tokens")
    return value


def check_flags(body: dict[str, Any]) -> None:
    """The booleans and ids the gateway reads: `stream`, `store`, `background`,
    `previous_response_id`."""
    for key in ("stream", "store", "background"):
        typed(body, key, (bool,), "a boolean")
    previous = typed(body, "previous_response_id", (str,), "a string")
    if previous is not None and not previous:
        raise invalid("'previous_response_id' must not be empty", "previous_response_id")


def input_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The input as a list of items (a string input is one user message).

    Raises:
        APIError: 400 without an input, or for one that is neither a string nor items.
    """
    value = body.get("input")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise invalid("'input' is required: a string or a list of input items", "input")
    return value


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body vLLM renders a Responses body as (its `model`, turns, tools and
    template options). Checks every field it reads.

    Raises:
        APIError: 400 naming the first malformed field.
    """
    turns: list[dict[str, Any]] = []
    instructions = typed(body, "instructions", (str,), "a string")
    if instructions:
        turns.append({"role": "system", "content": instructions})
    items = input_items(body)
    if isinstance(body.get("input"), str):
        turns.extend(items)
    else:
        for i, item in enumerate(items):
            turn = _turn(item, i, turns[-1] if turns else None)
            if turn is not None:
                turns.append(turn)
    last = items[-1] if items and not isinstance(body.get("input"), str) else {}
    continued = (
        last.get("type", "message") in ("message", "reasoning") and last.get("status") in CONTINUED
    )
    kwargs = dict(typed(body, "chat_template_kwargs", (dict,), "an object") or {})
    for key in RESERVED_KWARGS:
        kwargs.pop(key, None)
    chat: dict[str, Any] = {
        "model": body.get("model"),
        "messages": turns,
        "add_generation_prompt": not continued,
        "continue_final_message": continued,
        "chat_template_kwargs": kwargs,
    }
    reasoning = typed(body, "reasoning", (dict,), "an object")
    if reasoning and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    tools = _tools(body)
    if tools:
        chat["tools"] = tools
    return chat


def _turn(item: dict[str, Any], i: int, prev: dict[str, Any] | None) -> dict[str, Any] | None:
    """Item `i` as a new chat turn, or None when it joined `prev` (an assistant turn)."""
    assistant = prev if prev is not None and prev.get("role") == "assistant" else None
    kind = item.get("type")
    where = f"input[{i}]"
    if kind in TOOL_CALLS:
        call = _tool_call(item, where)
        if assistant is not None:
            assistant.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        text = _reasoning(item, where)
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = text
            return None
        return {"role": "assistant", "reasoning": text}
    if kind in TOOL_OUTPUTS:
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            raise invalid(f"'{where}.call_id' is required and must be a string",
                          f"{where}.call_id")  # fmt: skip
        return {"role": "tool", "content": item.get("output"), "tool_call_id": call_id}
    role = item.get("role")
    if kind not in (None, "message") or not isinstance(role, str):
        raise invalid(f"Unsupported input item type: {kind}", where)
    if role == "assistant":
        said = _assistant_text(item.get("content"), where)
        if said is not None:
            if assistant is not None and assistant.get("content") is None:
                assistant["content"] = said
                return None
            return {"role": "assistant", "content": said}
    return dict(item)


def _tool_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name = item.get("call_id"), item.get("name")
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise invalid(f"'{where}' needs a string 'call_id' and 'name'", where)
    if item["type"] == "custom_tool_call":
        payload = item.get("input") or ""
        arguments = json.dumps({CUSTOM_TOOL_INPUT: payload}, ensure_ascii=False)
    else:
        given = item.get("arguments")
        if not isinstance(given, str):
            raise invalid(f"'{where}.arguments' must be a string", f"{where}.arguments")
        arguments = given
        namespace = item.get("namespace")
        if namespace:
            name = f"{namespace}{NAMESPACE_SEPARATOR}{name}"
    return {"id": call_id, "function": {"name": name, "arguments": arguments},
            "type": "function"}  # fmt: skip


def _reasoning(item: dict[str, Any], where: str) -> str:
    if item.get("encrypted_content"):
        raise invalid("Encrypted content is not supported.", "input")
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list) and parts:
            first = parts[0]
            if not isinstance(first, dict) or not isinstance(first.get("text"), str):
                raise invalid(f"'{where}.{key}' parts need a string 'text'", f"{where}.{key}")
            return str(first["text"])
    return ""


def _assistant_text(content: Any, where: str) -> str | None:
    """An assistant message item's text: the string, or its first part's text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        first = content[0]
        if not isinstance(first, dict):
            raise invalid(f"'{where}.content' parts must be objects", f"{where}.content")
        text = first.get("text")
        return text if isinstance(text, str) else None
    return None


def _tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The function tools the model is shown, as chat function tools."""
    tools = typed(body, "tools", (list,), "a list of tools") or []
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise invalid(f"'tools[{i}]' must be an object with a string 'type'", f"tools[{i}]")
        kind = tool["type"]
        if kind == "function":
            out.append(_function(tool, f"tools[{i}]"))
        elif kind == "custom":
            name = _name(tool, f"tools[{i}]")
            out.append(_function({"name": name, "description": tool.get("description"),
                                  "parameters": CUSTOM_TOOL_PARAMETERS}, ""))  # fmt: skip
        elif kind == "namespace":
            namespace = _name(tool, f"tools[{i}]")
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise invalid(f"'tools[{i}].tools' must be a list", f"tools[{i}].tools")
            for j, t in enumerate(inner):
                if isinstance(t, dict) and t.get("type") == "function":
                    named = {**t, "name": f"{namespace}{NAMESPACE_SEPARATOR}{t.get('name')}"}
                    out.append(_function(named, f"tools[{i}].tools[{j}]"))
    return out


def _name(tool: dict[str, Any], where: str) -> str:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(f"'{where}.name' is required and must be a string", f"{where}.name")
    return name


def _function(tool: dict[str, Any], where: str) -> dict[str, Any]:
    """A Responses function tool as a chat function tool (vLLM's function definition)."""
    if where:
        _name(tool, where)
    parameters = tool.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise invalid(f"'{where}.parameters' must be an object", f"{where}.parameters")
    function = {"name": tool["name"], "description": tool.get("description"),
                "parameters": parameters, "strict": tool.get("strict"),
                "defer_loading": tool.get("defer_loading")}  # fmt: skip
    return {"type": "function", "function": function}

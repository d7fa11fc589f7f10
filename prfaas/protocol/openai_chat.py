"""An OpenAI chat body as its chat template sees it, by vLLM 0.32's rules (so the gateway's
routing ids equal the engine's own prompt ids; `renderers/chat_utils.py` and `hf.py` there):
text parts joined by newlines; an assistant's `tool_calls` with their `arguments` parsed into
objects (`{}` where they are not a JSON object); a tool message's `tool_call_id`; a message's
`name`; `developer` messages, for a template that does not name that role, as `system` ones,
all system messages then merged into the first; the `tools` as vLLM's models dump them;
`add_generation_prompt`, `continue_final_message`, `documents`, `reasoning_effort` and
`chat_template_kwargs` (the request's own fields winning).
"""

from __future__ import annotations

import copy
from typing import Any

import orjson

from prfaas.common.tokenizer import ChatPrompt
from prfaas.protocol.errors import invalid

TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
"""Text part types, and the key that holds each one's text."""
SKIPPED_EMPTY = ("text", "refusal")
"""Part types skipped when their text is missing (vLLM logs and skips them)."""
KEPT_KEYS = ("tool_calls", "tool_call_id", "name", "reasoning", "reasoning_content")
"""Message keys a template may read besides role and content (vLLM passes them on)."""


def chat_prompt(body: dict[str, Any], *, template: str | None) -> ChatPrompt:
    """The template's inputs of a chat body, for the chat `template` (None: the built-in).

    Raises:
        APIError: 400 naming the first field that is malformed.
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", "messages")
    turns = [_message(m, i) for i, m in enumerate(messages)]
    developer = ("'developer'", '"developer"')
    if any(t["role"] == "developer" for t in turns) and not any(
        name in (template or "") for name in developer
    ):
        turns = _merged_system(turns)
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict)
                                                                   for t in tools)):  # fmt: skip
        raise invalid("'tools' must be a list of objects", "tools")
    given = body.get("chat_template_kwargs") or {}
    if not isinstance(given, dict):
        raise invalid("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    kwargs = dict(given)
    effort = body.get("reasoning_effort")
    if effort is not None:
        kwargs["reasoning_effort"] = effort
        kwargs.setdefault("enable_thinking", effort != "none")
    if body.get("documents") is not None:
        kwargs["documents"] = body["documents"]
    return ChatPrompt(
        turns,
        tools=[_tool(t) for t in tools] if tools else None,
        add_generation_prompt=_flag(body, "add_generation_prompt", True),
        continue_final_message=_flag(body, "continue_final_message", False),
        template_kwargs=kwargs,
    )


def _merged_system(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Developer turns as system ones, every system turn merged into one at the start (two
    newlines between them), when that moves anything."""
    turns = [
        {k: v for k, v in {**t, "role": "system"}.items() if k != "tools"}
        if t["role"] == "developer" else t
        for t in turns
    ]  # fmt: skip
    systems = [i for i, t in enumerate(turns) if t["role"] == "system"]
    if not systems or systems == [0]:
        return turns
    texts = [turns[i]["content"] for i in systems if turns[i]["content"]]
    rest = [t for t in turns if t["role"] != "system"]
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as vLLM's request model dumps it for the template (absent description and
    parameters as null; strict and deferred loading only where set)."""
    given = tool.get("function")
    function = given if isinstance(given, dict) else {}
    defer = tool.get("defer_loading")
    out = {
        "name": function.get("name"),
        "description": function.get("description"),
        "parameters": function.get("parameters"),
    }
    if function.get("strict") is not None:
        out["strict"] = function["strict"]
    if function.get("defer_loading", defer) is not None:
        out["defer_loading"] = function.get("defer_loading", defer)
    dumped: dict[str, Any] = {"type": tool.get("type", "function"), "function": out}
    if defer is not None:
        dumped["defer_loading"] = defer
    return dumped


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"'{key}' must be a boolean", key)
    return value


def _message(m: Any, i: int) -> dict[str, Any]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise invalid(f"'messages[{i}]' must be an object with a string 'role'", "messages")
    role = m["role"]
    turn: dict[str, Any] = {"role": role, "content": _content(m.get("content"), i)}
    for key in KEPT_KEYS:
        if m.get(key) is None:
            continue
        if key == "tool_calls" and role == "assistant":
            calls = _tool_calls(m[key], i)
            if calls:
                turn[key] = calls
        elif key in ("reasoning", "reasoning_content") and role == "assistant":
            turn["reasoning"] = turn["reasoning_content"] = m[key]
        elif (key == "tool_call_id" and role == "tool") or (key == "name" and
                                                             isinstance(m[key], str)):  # fmt: skip
            turn[key] = m[key]
    if role == "developer":
        turn["tools"] = m.get("tools")
    return turn


def _content(value: Any, i: int) -> str:
    """A message's content as one string: vLLM's "string" content format (the texts of its
    text parts joined by newlines; a text or refusal part without one is skipped)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        texts = [p.get(TEXT_PARTS.get(p.get("type"), "")) for p in value]
        kept = [t for t, p in zip(texts, value, strict=True)
                if t is not None or p.get("type") not in SKIPPED_EMPTY]  # fmt: skip
        if all(isinstance(t, str) for t in kept):
            return "\n".join(str(t) for t in kept)
    raise invalid(f"'messages[{i}].content' must be a string or a list of text parts", "messages")


def _tool_calls(value: Any, i: int) -> list[Any]:
    """An assistant's tool calls as templates expect them: `arguments` as objects."""
    if not isinstance(value, list):
        raise invalid(f"'messages[{i}].tool_calls' must be a list", "messages")
    calls = copy.deepcopy(value)
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise invalid(f"'messages[{i}].tool_calls' entries need a 'function' object",
                          "messages")  # fmt: skip
        function["arguments"] = _arguments(function.get("arguments"))
    return calls


def _arguments(value: Any) -> Any:
    """Tool-call arguments as an object: parsed from JSON text, `{}` where they are empty
    or not an object (vLLM keeps such a turn rather than fail every later one)."""
    if isinstance(value, str) and value:
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            return {}
    return value if isinstance(value, dict) else {}

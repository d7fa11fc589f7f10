"""Anthropic Messages bodies (`POST /v1/messages`, `/v1/messages/count_tokens`): checked, and
turned into the chat body vLLM 0.32 turns them into (`entrypoints/anthropic/serving.py`,
`to_chat_completion_request`), so that the gateway's routing ids equal the engine's prompt
ids, and so that the reference engine answers them through its own chat path.

The rule, as vLLM's:
- `system` (a string, or its text blocks joined with no separator, Claude Code's
  `x-anthropic-billing-header` blocks left out) is the first turn, a system one. Inline
  system messages stay where they are, unless the chat template refuses a system turn after
  the first (`TemplateRules.merge_inline_system`): then their text joins the first.
- A message's text blocks become its content (one block: a string; several: text parts,
  which the chat rule joins with newlines); `thinking` blocks its `reasoning`; `tool_use`
  blocks its `tool_calls` (arguments as JSON); a user's `tool_result` blocks each a `tool`
  turn *before* the rest of that message (text parts joined with newlines), an assistant's
  a text part `Tool result: ...`; a user message left with no content is dropped.
- `tools` become function tools (`input_schema` as the parameters, `type: object` added
  where absent), after the `tool_addition` / `tool_removal` blocks of system messages;
  `tool_choice` auto / any / tool / none becomes auto / required / the named function /
  none (auto when tools come without one), `disable_parallel_tool_use` the inverse of
  `parallel_tool_calls`.
- `output_config.effort` becomes `reasoning_effort`, and `thinking: {type: disabled}` the
  effort the template renders as no thinking (`TemplateRules.disabled_thinking_effort`);
  `output_config.format` a JSON-schema `response_format`; `stop_sequences` `stop`.

Images (and tool references inside tool results) are refused: the gateway renders text
prompts only. Every rejection is an `APIError` naming the field (a 400, or a 404 for a model
that is not served), which Anthropic's routes answer in Anthropic's error body.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, cast

from prfaas.common.tokenizer import ChatPrompt, Tokenizer, chat_ids, render_template
from prfaas.protocol.client_body import ClientBody
from prfaas.protocol.errors import APIError, invalid
from prfaas.protocol.generate import SamplingParams
from prfaas.protocol.openai_chat import chat_prompt
from prfaas.protocol.openai_request import (
    CompletionCall,
    ModelLimits,
    chat_body_ids,
    check_context,
    typed,
)

BLOCK_TYPES = frozenset({
    "text", "image", "tool_use", "tool_result", "tool_reference", "thinking",
    "redacted_thinking", "tool_addition", "tool_removal",
})  # fmt: skip
ROLES = ("user", "assistant", "system")
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
"""Anthropic's `tool_choice.type` as chat's `tool_choice` (`tool` names a function)."""
EFFORTS = ("low", "medium", "high", "xhigh", "max")
THINKING = ("enabled", "disabled", "adaptive")
BILLING_HEADER = "x-anthropic-billing-header"
MIN_THINKING_BUDGET = 1024


@dataclass(frozen=True)
class TemplateRules:
    """What a chat template decides about Anthropic bodies (probed as vLLM probes it)."""

    merge_inline_system: bool
    """The template refuses a system turn after the first: inline system messages join
    the first system turn."""
    disabled_thinking_effort: str
    """The `reasoning_effort` that `thinking: {type: disabled}` becomes: "none", or "low"
    when the template ignores "none" (renders it as some effort)."""


def template_rules(tokenizer: Tokenizer) -> TemplateRules:
    """`tokenizer`'s chat template's rules (probed once per tokenizer and template)."""
    return _probed(cast(Hashable, tokenizer), tokenizer.chat_template)


@lru_cache(maxsize=8)
def _probed(key: Hashable, template: str | None) -> TemplateRules:
    """Render [system, user, system, user] (a template that raises needs the merge), and a
    one-turn chat at effort "none" against each effort (one alike: "none" is ignored).
    `key` is the tokenizer."""
    tokenizer = cast(Tokenizer, key)
    turns = [{"role": r, "content": "t"} for r in ("system", "user", "system", "user")]
    try:
        render_template(tokenizer, ChatPrompt(turns, add_generation_prompt=False))
        merge = False
    except ValueError:
        merge = True

    def effort_ids(effort: str) -> list[int] | None:
        body = {"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": effort}
        try:
            return chat_ids(tokenizer, chat_prompt(body, template=template))
        except (ValueError, APIError):
            return None

    none = effort_ids("none")
    ignored = none is None or any(effort_ids(e) == none for e in EFFORTS)
    return TemplateRules(merge, "low" if ignored else "none")


def check_model(body: dict[str, Any], served: str) -> str:
    """The body's model, which must be the served one.

    Raises:
        APIError: 400 without a model, 404 for another model.
    """
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required and must be a string", "model", "missing_model")
    if model != served:
        raise APIError(404, f"model {model!r} does not exist", param="model",
                       code="model_not_found")  # fmt: skip
    return model


def max_tokens(body: dict[str, Any]) -> int:
    """`max_tokens`, required and positive."""
    value = body.get("max_tokens")
    if type(value) is not int:
        raise invalid("'max_tokens' is required and must be an integer", "max_tokens")
    if value < 1:
        raise invalid(f"'max_tokens' must be >= 1, got {value}", "max_tokens")
    return value


def parse_call(body: dict[str, Any], limits: ModelLimits, tokenizer: Tokenizer) -> CompletionCall:
    """A Messages body as the request the Router dispatches: its prompt ids rendered as the
    engine renders them, its output limit; the body travels whole.

    Raises:
        APIError: 400 naming a malformed field or a prompt over the context, 404 for a
            model that is not served.
    """
    model = check_model(body, limits.name)
    chat = to_chat(body, template_rules(tokenizer))
    ids = chat_body_ids(tokenizer, chat)
    check_context(len(ids), chat["max_tokens"], limits)
    sampling = SamplingParams(max_new_tokens=chat["max_tokens"])
    return CompletionCall("messages", model, tuple(ids), sampling, chat.get("stream") is True,
                          False, ClientBody("messages", body))  # fmt: skip


def count_tokens(body: dict[str, Any], limits: ModelLimits, tokenizer: Tokenizer) -> int:
    """The prompt tokens of a count_tokens body (`/v1/messages/count_tokens`).

    Raises:
        APIError: as `parse_call`.
    """
    check_model(body, limits.name)
    return len(chat_body_ids(tokenizer, to_chat(body, template_rules(tokenizer), count=True)))


def to_chat(body: dict[str, Any], rules: TemplateRules, *, count: bool = False) -> dict[str, Any]:
    """The chat body vLLM makes of a Messages body (`count`: of a count_tokens body, which
    has no sampling, no output limit and no stream). Checks every field it reads.

    Raises:
        APIError: 400 naming the first malformed field.
    """
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise invalid("'messages' is required and must be a list", "messages")
    checked = [_message(m, i) for i, m in enumerate(messages)]
    turns: list[dict[str, Any]] = []
    system = _system(body.get("system"), checked, rules.merge_inline_system)
    if system:
        turns.append({"role": "system", "content": system})
    for i, (role, content) in enumerate(checked):
        _convert(role, content, i, turns, rules.merge_inline_system)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": turns}
    if not count:
        chat.update(_sampling(body))
    kwargs = typed(body, "chat_template_kwargs", (dict,), "an object")
    if kwargs is not None:
        chat["chat_template_kwargs"] = kwargs
    _output_config(body, chat)
    _thinking(body, chat, rules, None if count else chat["max_tokens"])
    _tools(body, checked, chat)
    return chat


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    limit = max_tokens(body)
    out: dict[str, Any] = {"max_tokens": limit, "max_completion_tokens": limit}
    stops = typed(body, "stop_sequences", (list,), "a list of strings")
    if stops is not None:
        if not all(isinstance(s, str) for s in stops):
            raise invalid("'stop_sequences' must be a list of strings", "stop_sequences")
        out["stop"] = stops
    for key in ("temperature", "top_p"):
        value = typed(body, key, (int, float), "a number")
        if value is not None:
            out[key] = value
    top_k = typed(body, "top_k", (int,), "an integer")
    if top_k is not None:
        out["top_k"] = top_k
    stream = typed(body, "stream", (bool,), "a boolean")
    if stream:
        out["stream"] = True
        out["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return out


def _message(m: Any, i: int) -> tuple[str, str | list[dict[str, Any]]]:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise invalid(f"'{where}' must be an object with role user, assistant or system",
                      "messages")  # fmt: skip
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return role, content
    blocks = _blocks(content, f"{where}.content")
    if role != "system":
        _no_tool_changes(blocks, f"{where}.content")
    return role, blocks


def _blocks(value: Any, where: str) -> list[dict[str, Any]]:
    """Content blocks: objects with a known `type` (checked field by field where read)."""
    if not isinstance(value, list):
        raise invalid(f"'{where}' must be a string or a list of content blocks", where)
    for j, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") not in BLOCK_TYPES:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise invalid(f"'{where}[{j}]' has an unknown block type {kind!r}: expected one "
                          f"of {sorted(BLOCK_TYPES)}", f"{where}[{j}].type")  # fmt: skip
        for key, kind in (("text", str), ("thinking", str), ("name", str), ("id", str),
                          ("tool_use_id", str), ("input", dict)):  # fmt: skip
            if block.get(key) is not None and not isinstance(block[key], kind):
                raise invalid(f"'{where}[{j}].{key}' must be a {kind.__name__}",
                              f"{where}[{j}].{key}")  # fmt: skip
        if block["type"] == "image":
            raise invalid(f"'{where}[{j}]': image blocks are not supported (this deployment "
                          "serves text prompts)", f"{where}[{j}]")  # fmt: skip
        if block["type"] in ("tool_addition", "tool_removal") and not isinstance(
            block.get("tool"), dict
        ):
            raise invalid(f"'{where}[{j}].tool' is required for {block['type']} blocks",
                          f"{where}[{j}].tool")  # fmt: skip
    return value


def _no_tool_changes(blocks: list[dict[str, Any]], where: str) -> None:
    for j, block in enumerate(blocks):
        if block["type"] in ("tool_addition", "tool_removal"):
            raise invalid(f"'{where}[{j}]': {block['type']} blocks are only allowed in "
                          'messages with role "system"', f"{where}[{j}]")  # fmt: skip


def _system_text(content: str | list[dict[str, Any]]) -> str | None:
    """A system turn's text, billing headers left out (None when nothing is left)."""
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    parts = [b["text"] for b in content if b["type"] == "text" and b.get("text")
             and not b["text"].startswith(BILLING_HEADER)]  # fmt: skip
    return "".join(parts) if parts else None


def _system(value: Any, checked: list[tuple[str, Any]], merge: bool) -> str:
    parts: list[str] = []
    if isinstance(value, str):
        parts.append(value)
    elif value is not None:
        blocks = _blocks(value, "system")
        _no_tool_changes(blocks, "system")
        text = _system_text(blocks)
        if text:
            parts.append(text)
    for role, content in checked if merge else ():
        text = _system_text(content) if role == "system" else None
        if text:
            parts.append(text)
    return "".join(parts)


def _convert(
    role: str, content: str | list[dict[str, Any]], i: int, turns: list[dict[str, Any]],
    merge: bool,
) -> None:  # fmt: skip
    """Append message `i`'s turns (its tool results first, for a user's)."""
    if role == "system":
        text = None if merge else _system_text(content)
        if text:
            turns.append({"role": "system", "content": text})
        return
    turn: dict[str, Any] = {"role": role}
    if isinstance(content, str):
        turn["content"] = content
    else:
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for j, block in enumerate(content):
            _block(block, role, f"messages[{i}].content[{j}]", parts, calls, reasoning, turns)
        if reasoning:
            turn["reasoning"] = "".join(reasoning)
        if calls:
            turn["tool_calls"] = calls
        if parts:
            single = len(parts) == 1 and parts[0]["type"] == "text"
            turn["content"] = parts[0]["text"] if single else parts
    if not (role == "user" and "content" not in turn):
        turns.append(turn)


def _block(
    block: dict[str, Any], role: str, where: str, parts: list[dict[str, Any]],
    calls: list[dict[str, Any]], reasoning: list[str], turns: list[dict[str, Any]],
) -> None:  # fmt: skip
    kind = block["type"]
    if kind == "text" and block.get("text"):
        parts.append({"type": "text", "text": block["text"]})
    elif kind == "thinking" and block.get("thinking") is not None:
        reasoning.append(block["thinking"])
    elif kind == "tool_use":
        function = {"name": block.get("name") or "", "arguments": json.dumps(block.get("input")
                                                                             or {})}  # fmt: skip
        calls.append({"id": block.get("id") or "call_0", "type": "function",
                      "function": function})  # fmt: skip
    elif kind == "tool_result" and role == "user":
        turns.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "",
                      "content": _tool_result_text(block.get("content"), where)})  # fmt: skip
    elif kind == "tool_result":
        content = block.get("content")
        parts.append({"type": "text", "text": f"Tool result: {content if content else ''}"})


def _tool_result_text(content: Any, where: str) -> str:
    """A user's tool result as a tool turn's text (its text items joined by newlines)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise invalid(f"'{where}.content' must be a string or a list", f"{where}.content")
    texts = []
    for k, item in enumerate(content):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "text":
            texts.append(str(item.get("text", "")))
        elif kind in ("image", "tool_reference"):
            raise invalid(f"'{where}.content[{k}]': {kind} items in tool results are not "
                          "supported", f"{where}.content[{k}]")  # fmt: skip
    return "\n".join(texts)


def _output_config(body: dict[str, Any], chat: dict[str, Any]) -> None:
    config = typed(body, "output_config", (dict,), "an object")
    if not config:
        return
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type", "json_schema") != "json_schema":
            raise invalid("'output_config.format' must be a json_schema format",
                          "output_config.format")  # fmt: skip
        schema = fmt.get("schema")
        if schema is not None:
            if not isinstance(schema, dict):
                raise invalid("'output_config.format.schema' must be an object",
                              "output_config.format.schema")  # fmt: skip
            chat["response_format"] = {
                "type": "json_schema",
                "json_schema": {"schema": schema, "name": "json_schema"},
            }
    effort = config.get("effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise invalid(f"'output_config.effort' must be one of {list(EFFORTS)}",
                          "output_config.effort")  # fmt: skip
        chat["reasoning_effort"] = effort


def _thinking(
    body: dict[str, Any], chat: dict[str, Any], rules: TemplateRules, limit: int | None
) -> None:
    thinking = typed(body, "thinking", (dict,), "an object")
    if thinking is None:
        return
    kind = thinking.get("type")
    if kind not in THINKING:
        raise invalid(f"'thinking.type' must be one of {list(THINKING)}", "thinking.type")
    if kind == "disabled":
        chat["reasoning_effort"] = rules.disabled_thinking_effort
    elif kind == "enabled":
        budget = thinking.get("budget_tokens")
        if type(budget) is not int or budget < MIN_THINKING_BUDGET:
            raise invalid(f"'thinking.budget_tokens' must be an integer >= "
                          f"{MIN_THINKING_BUDGET}", "thinking.budget_tokens")  # fmt: skip
        if limit is not None and budget >= limit:
            raise invalid("thinking.budget_tokens must be less than max_tokens",
                          "thinking.budget_tokens")  # fmt: skip


def _tools(body: dict[str, Any], checked: list[tuple[str, Any]], chat: dict[str, Any]) -> None:
    choice = typed(body, "tool_choice", (dict,), "an object")
    if choice is not None:
        kind = choice.get("type")
        parallel = choice.get("disable_parallel_tool_use")
        if parallel is not None and not isinstance(parallel, bool):
            raise invalid("'tool_choice.disable_parallel_tool_use' must be a boolean",
                          "tool_choice.disable_parallel_tool_use")  # fmt: skip
        chat["parallel_tool_calls"] = not parallel
        if kind == "tool":
            name = choice.get("name")
            if not isinstance(name, str) or not name:
                raise invalid("tool_choice.name is required when type is 'tool'",
                              "tool_choice.name")  # fmt: skip
            chat["tool_choice"] = {"type": "function", "function": {"name": name}}
        elif kind in TOOL_CHOICES:
            chat["tool_choice"] = TOOL_CHOICES[kind]
        else:
            raise invalid("'tool_choice.type' must be auto, any, tool or none",
                          "tool_choice.type")  # fmt: skip
    tools = _resolved_tools(body, checked)
    if tools is None:
        return
    chat["tools"] = [_function(t) for t in tools]
    chat.setdefault("tool_choice", "auto")


def _tool(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise invalid(f"'{where}' must be an object with a string 'name'", where)
    schema = value.get("input_schema")
    if not isinstance(schema, dict):
        raise invalid(f"'{where}.input_schema' is required and must be an object",
                      f"{where}.input_schema")  # fmt: skip
    return value


def _resolved_tools(
    body: dict[str, Any], checked: list[tuple[str, Any]]
) -> list[dict[str, Any]] | None:
    """`tools` after the system messages' tool additions and removals."""
    given = typed(body, "tools", (list,), "a list of tools")
    tools = None if given is None else [_tool(t, f"tools[{i}]") for i, t in enumerate(given)]
    changes = [b for _, content in checked if not isinstance(content, str) for b in content
               if b["type"] in ("tool_addition", "tool_removal")]  # fmt: skip
    if not changes:
        return tools
    by_name = {t["name"]: t for t in tools or ()}
    removed: set[str] = set()
    for block in changes:
        change = block["tool"]
        if change.get("type") == "tool_definition":
            definition = _tool(change.get("definition"), "tool_addition.tool.definition")
            name = definition["name"]
            by_name[name] = definition
        else:
            name = change.get("name")
            if name not in by_name:
                raise invalid(f"{block['type']} references tool {name!r}, which is not "
                              "declared in tools", "messages")  # fmt: skip
            if block["type"] == "tool_addition":
                by_name[name] = {**by_name[name], "defer_loading": None}
        (removed.add if block["type"] == "tool_removal" else removed.discard)(name)
    return [t for name, t in by_name.items() if name not in removed]


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic tool as vLLM's chat function tool."""
    schema = tool["input_schema"]
    if "type" not in schema:
        schema = {**schema, "type": "object"}
    return {"type": "function", "function": {
        "name": tool["name"], "description": tool.get("description"), "parameters": schema,
        "strict": tool.get("strict"), "defer_loading": tool.get("defer_loading"),
    }}  # fmt: skip

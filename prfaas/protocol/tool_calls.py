"""Model output as OpenAI tool calls, whole and streamed, by vLLM 0.32's rules.

The reference engine answers chat requests with `tools` itself, so it must turn text into
`tool_calls` exactly as a vLLM server would: `tool_choice` auto parses Hermes
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (vLLM's `hermes` tool
parser), `required` reads a JSON array of `{"name", "parameters"}` objects, and a named
choice takes the whole output as that function's arguments (vLLM's JSON-schema paths).

Streaming emits each Hermes call whole once its `</tool_call>` closes, so for any split of
the output the streamed content and calls equal the whole parse's (ids aside). The one
exception: a malformed call after a call was already emitted (the whole parse then makes
the entire output content; the stream cannot take back its call, so it drops the rest).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

START, END = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    """A call id as vLLM 0.32's `make_tool_call_id` makes it (16 random hex digits)."""
    return f"chatcmpl-tool-{secrets.token_hex(8)}"


@dataclass(frozen=True)
class ToolCall:
    """One function call: its name and its arguments as a JSON string."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_json(self, index: int | None = None) -> dict[str, Any]:
        """The OpenAI `tool_calls` entry; with `index`, a streamed delta's entry."""
        head: dict[str, Any] = {} if index is None else {"index": index}
        function = {"name": self.name, "arguments": self.arguments}
        return {**head, "id": self.id, "type": "function", "function": function}


def _hermes_call(body: str) -> ToolCall | None:
    """The call one `<tool_call>` block holds, or None where vLLM's parser would fail."""
    try:
        obj = json.loads(body)
        name, arguments = obj["name"], obj["arguments"]
    except (ValueError, TypeError, KeyError, RecursionError):
        return None
    if not isinstance(name, str):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """Content and calls of a whole Hermes output (`tool_choice` auto).

    Content is the text before the first `<tool_call>` (None when blank and there are
    calls); text between and after calls is dropped; a last block may lack its
    `</tool_call>`. Any block that is not a valid call makes the whole text content.
    """
    first = text.find(START)
    if first < 0:
        return text, []
    calls: list[ToolCall] = []
    pos = first
    while (start := text.find(START, pos)) >= 0:
        end = text.find(END, start + len(START))
        call = _hermes_call(text[start + len(START) : end if end >= 0 else len(text)])
        if call is None:
            return text, []
        calls.append(call)
        if end < 0:
            break
        pos = end + len(END)
    content = text[:first]
    return (content if content.strip() else None), calls


def required_calls(text: str) -> list[ToolCall]:
    """The calls of a `tool_choice: "required"` output, `[{"name", "parameters"}, ...]`;
    none at all when it is not such an array (vLLM validates it as `list[FunctionDefinition]`:
    a string name, an object or null for parameters and a string or null for description;
    the grammar's schema admits no other keys, so `strict` and `defer_loading` are not read).
    """
    try:
        items = json.loads(text)
    except (ValueError, RecursionError):
        return []
    if not isinstance(items, list):
        return []
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        params, description = item.get("parameters"), item.get("description")
        if not isinstance(params, dict | None) or not isinstance(description, str | None):
            return []
        calls.append(ToolCall(item["name"], json.dumps(params, ensure_ascii=False)))
    return calls


def named_call(name: str, text: str) -> ToolCall | None:
    """The call of a named `tool_choice`: the output verbatim as its arguments; None when
    the output is blank."""
    return ToolCall(name, text) if text.strip() else None


def tool_finish_reason(
    reason: str, mode: Literal["none", "auto", "required", "named"], *, called: bool, stream: bool
) -> str:
    """vLLM's finish reason: "tool_calls" for auto calls (streamed: only on "stop") and for
    required on "stop" (streamed: only when calls were sent); else the engine's own."""
    if stream:
        return "tool_calls" if called and mode != "named" and reason == "stop" else reason
    tool_calls = (mode == "auto" and called) or (mode == "required" and reason == "stop")
    return "tool_calls" if tool_calls else reason


def _overlap(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with."""
    return next((k for k in range(len(tag) - 1, 0, -1) if text.endswith(tag[:k])), 0)


class HermesStream:
    """Hermes output to chat `delta` objects as it arrives (`tool_choice` auto).

    Content streams as it comes, holding back a tail that may begin `<tool_call>` and a
    blank preamble (None in the whole parse when calls follow); each call is emitted whole
    when its block closes. An unclosed last block is parsed at `finish`, as the whole parse
    does; if it (or any block) is malformed before any call was emitted, all the output
    becomes content.
    """

    def __init__(self) -> None:
        self._text = ""
        self._sent = 0
        self._pos = -1
        self._calls = 0
        self._phase: Literal["text", "calls", "content", "done"] = "text"

    @property
    def called(self) -> bool:
        """Whether a tool call was emitted (finish reason "tool_calls" on "stop")."""
        return self._calls > 0

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """The deltas to send after `delta` of output."""
        self._text += delta
        return self._advance(final=False)

    def finish(self) -> list[dict[str, Any]]:
        """The deltas to send at the end of output: what was held back."""
        out = self._advance(final=True)
        self._phase = "done"
        return out

    def _content(self, upto: int, final: bool) -> list[dict[str, Any]]:
        if upto <= self._sent or (not final and not self._text[:upto].strip()):
            return []
        piece, self._sent = self._text[self._sent : upto], upto
        return [{"content": piece}]

    def _advance(self, final: bool) -> list[dict[str, Any]]:
        text, out = self._text, []
        if self._phase == "text":
            self._pos = text.find(START)
            if self._pos < 0:
                return self._content(len(text) - (0 if final else _overlap(text, START)), final)
            self._phase = "calls"
            out = self._content(self._pos, final=False)
        calls: list[dict[str, Any]] = []
        while self._phase == "calls" and (start := text.find(START, self._pos)) >= 0:
            end = text.find(END, start + len(START))
            if end < 0 and not final:
                break
            call = _hermes_call(text[start + len(START) : end if end >= 0 else len(text)])
            if call is None:
                self._phase = "done" if self._calls else "content"
                break
            calls.append(call.to_json(self._calls))
            self._calls += 1
            self._pos = end + len(END) if end >= 0 else len(text)
        if self._phase == "content":
            out += self._content(len(text), final=True)
        return out + ([{"tool_calls": calls}] if calls else [])


class ForcedStream:
    """Streaming for `tool_choice` required (`name` None) or named: the output is buffered
    and its calls emitted by `finish`, as `required_calls` or `named_call` read it."""

    def __init__(self, name: str | None) -> None:
        self._name, self._text, self.called = name, "", False

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """Nothing to send yet: the output is buffered."""
        self._text += delta
        return []

    def finish(self) -> list[dict[str, Any]]:
        """The calls, as one delta (nothing when the output holds none)."""
        if self._name is None:
            calls = required_calls(self._text)
        else:
            calls = [c for c in [named_call(self._name, self._text)] if c is not None]
        self.called = bool(calls)
        return [{"tool_calls": [c.to_json(i) for i, c in enumerate(calls)]}] if calls else []

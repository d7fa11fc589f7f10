"""Chat completion answers as Anthropic Messages answers, whole and streamed, as vLLM 0.32
converts them (`entrypoints/anthropic/serving.py`: `messages_full_converter`,
`message_stream_converter`): the reference engine answers `/v1/messages` by running the
chat body `anthropic_messages.to_chat` makes and converting its answer here.

- The message: a `thinking` block for reasoning, a `text` block for content, a `tool_use`
  block per tool call (its arguments parsed); one empty text block when there is nothing.
- `stop_reason`: `max_tokens` on length; `tool_use` once tool calls are complete (or when
  a call was made and no stop string matched); `stop_sequence` (with the string) when a stop
  string matched; else `end_turn`.
- `usage`: `input_tokens` is the prompt less what the prefix cache supplied
  (`cache_read_input_tokens`).
- Streamed: `message_start`, then per block `content_block_start`, its deltas
  (`text_delta`, `input_json_delta`, `thinking_delta`), `content_block_stop`; then
  `message_delta` with the stop reason and usage, and `message_stop`. Each event is a
  `(name, data)` pair.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

Event = tuple[str, dict[str, Any]]


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    """A chat `usage` as Anthropic's."""
    if not chat_usage:
        return {"input_tokens": 0, "output_tokens": 0}
    out: dict[str, Any] = {"output_tokens": chat_usage.get("completion_tokens") or 0}
    prompt = chat_usage.get("prompt_tokens") or 0
    details = chat_usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if cached is not None:
        prompt -= cached
        out["cache_read_input_tokens"] = cached
    return {"input_tokens": max(0, prompt), **out}


def stop_reason(
    finish: str | None, matched: int | str | None, *, tool_used: bool, tool_complete: bool
) -> tuple[str | None, str | None]:
    """`(stop_reason, stop_sequence)` of a chat finish reason and the stop that matched."""
    if finish == "length":
        return "max_tokens", None
    if finish not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    if finish == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def message(chat: dict[str, Any]) -> dict[str, Any]:
    """A whole chat completion as the Anthropic message."""
    choice = chat["choices"][0]
    said = choice.get("message") or {}
    calls = said.get("tool_calls") or []
    complete = bool(calls) and all(_is_json(c["function"]["arguments"]) for c in calls)
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"),
                                   tool_used=bool(calls), tool_complete=complete)  # fmt: skip
    content: list[dict[str, Any]] = []
    if said.get("reasoning"):
        content.append({"type": "thinking", "thinking": said["reasoning"],
                        "signature": uuid.uuid4().hex})  # fmt: skip
    if said.get("content"):
        content.append({"type": "text", "text": said["content"]})
    for call in calls:
        function = call["function"]
        content.append({"type": "tool_use", "id": call["id"], "name": function["name"],
                        "input": _input(function["arguments"])})  # fmt: skip
    out: dict[str, Any] = {
        "id": chat["id"], "type": "message", "role": "assistant",
        "content": content or [{"type": "text", "text": ""}], "model": chat["model"],
        "stop_reason": reason,
    }  # fmt: skip
    if sequence is not None:
        out["stop_sequence"] = sequence
    out["usage"] = usage(chat.get("usage"))
    return out


def _input(arguments: str) -> Any:
    """A call's arguments as its `input`: `{}` while they are not (yet) JSON, as for a call
    the output limit cut short."""
    try:
        return json.loads(arguments)
    except ValueError:
        return {}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@dataclass
class MessageStream:
    """Streamed chat events (`feed`, each a chat completion chunk; `done` for the end) as
    Anthropic events. The chat stream must carry usage (the final chunk without choices)."""

    started: bool = False
    index: int = 0
    """The next content block's index."""
    block: str | None = None
    """The open block's type."""
    tool_id: str | None = None
    finish: str | None = None
    matched: int | str | None = None
    tool_used: bool = False
    last_arguments: list[str] = field(default_factory=list)
    ids: dict[int, str] = field(default_factory=dict)
    """Tool call index -> its id."""

    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        if not self.started:
            self.started = True
            start = {"id": chunk["id"], "type": "message", "role": "assistant", "content": [],
                     "model": chunk["model"], "stop_reason": None, "stop_sequence": None,
                     "usage": usage(chunk.get("usage"))}  # fmt: skip
            events.append(("message_start", {"type": "message_start", "message": start}))
        choices = chunk.get("choices") or []
        if not choices:  # the usage chunk: the answer is over
            events += self._stop()
            reason, sequence = stop_reason(
                self.finish or "stop", self.matched, tool_used=self.tool_used,
                tool_complete=self.tool_used and _is_json("".join(self.last_arguments)),
            )  # fmt: skip
            end = {"stop_reason": reason, "stop_sequence": sequence}
            events.append(("message_delta", {"type": "message_delta", "delta": end,
                                             "usage": usage(chunk.get("usage"))}))  # fmt: skip
            return events
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self.finish, self.matched = choice["finish_reason"], choice.get("stop_reason")
        delta = choice.get("delta") or {}
        if delta.get("reasoning"):
            events += self._open("thinking", {"type": "thinking", "thinking": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning"]}))
        if delta.get("content"):
            events += self._open("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or ():
            events += self._tool_call(call)
        return events

    def done(self) -> list[Event]:
        """The end of the chat stream (its `[DONE]`)."""
        return [*self._stop(), ("message_stop", {"type": "message_stop"})]

    def _tool_call(self, call: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        function = call.get("function") or {}
        call_id = call.get("id")
        if call_id is not None:
            self.ids[call.get("index", 0)] = call_id
            if self.tool_id != call_id and function.get("name") is not None:
                events += self._stop()
                self.tool_used, self.last_arguments = True, []
                block = {"type": "tool_use", "id": call_id, "name": function["name"], "input": {}}
                events += self._open("tool_use", block, tool_id=call_id)
        else:
            call_id = self.ids.get(call.get("index", 0))
        arguments = function.get("arguments")
        if arguments and call_id is not None and self.tool_id == call_id:
            self.last_arguments.append(arguments)
            events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    def _open(self, kind: str, block: dict[str, Any], tool_id: str | None = None) -> list[Event]:
        if self.block == kind and kind != "tool_use":
            return []
        events = self._stop()
        self.block, self.tool_id = kind, tool_id
        start = {"type": "content_block_start", "content_block": block, "index": self.index}
        events.append(("content_block_start", start))
        return events

    def _delta(self, delta: dict[str, Any]) -> Event:
        return ("content_block_delta", {"type": "content_block_delta", "delta": delta,
                                        "index": self.index})  # fmt: skip

    def _stop(self) -> list[Event]:
        if self.block is None:
            return []
        events: list[Event] = []
        if self.block == "thinking":
            signature = {"type": "signature_delta", "signature": uuid.uuid4().hex}
            events.append(self._delta(signature))
        events.append(("content_block_stop", {"type": "content_block_stop",
                                              "index": self.index}))  # fmt: skip
        self.block, self.tool_id = None, None
        self.index += 1
        return events

"""Chat completion answers as OpenAI Responses answers, whole and streamed, in the shapes
vLLM 0.32 writes (`entrypoints/openai/responses/`: `build_response_output_items`, the
simple streaming event processor): the reference engine answers `/v1/responses` by running
the chat body `openai_responses.to_chat` makes and converting its answer here.

- Output items: a `message` with one `output_text` part (its log-probabilities when
  asked), then one `function_call` item per tool call.
- Status `incomplete` (`incomplete_details.reason` `max_output_tokens`) when the output
  hit its limit, else `completed`; usage in the Responses shape (`input_tokens` includes
  the cached ones).
- Streamed: `response.created`, `response.in_progress`; per item `output_item.added`,
  for text `content_part.added`, `output_text.delta`s, `output_text.done`,
  `content_part.done`, for a call `function_call_arguments.delta` and `.done`; then
  `output_item.done`; last `response.completed`. Every event has its `sequence_number`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

ECHOED = ("instructions", "max_output_tokens", "max_tool_calls", "metadata", "reasoning",
          "text", "top_logprobs", "user")  # fmt: skip
"""Request fields the response object repeats (null when absent)."""
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


def response_object(
    request: dict[str, Any], *, response_id: str, created: int, model: str, status: str,
    output: list[dict[str, Any]], usage: dict[str, Any] | None,
) -> dict[str, Any]:  # fmt: skip
    """The response object of `request` (the client's Responses body)."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    out: dict[str, Any] = {
        "id": response_id, "created_at": created, "error": None,
        "incomplete_details": incomplete, "model": model, "object": "response",
        "output": output, "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "temperature": request.get("temperature", 1.0),
        "tool_choice": request.get("tool_choice", "auto"), "tools": request.get("tools", []),
        "top_p": request.get("top_p", 1.0), "background": False,
        "previous_response_id": None, "service_tier": request.get("service_tier", "auto"),
        "status": status, "truncation": request.get("truncation", "disabled"), "usage": usage,
    }  # fmt: skip
    out.update({key: request.get(key) for key in ECHOED})
    return out


def logprobs_asked(request: dict[str, Any]) -> bool:
    """Whether the output text's log-probabilities were asked for (`include`)."""
    return LOGPROBS_INCLUDE in (request.get("include") or ())


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """A chat `usage` as the Responses one."""
    if not chat_usage:
        return None
    prompt = chat_usage.get("prompt_tokens") or 0
    completion = chat_usage.get("completion_tokens") or 0
    details = chat_usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached or 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}  # fmt: skip


def status_of(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


def _text_part(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def _message_item(
    item_id: str, text: str, logprobs: list[Any] | None, status: str
) -> dict[str, Any]:
    content = [_text_part(text, logprobs)] if status == "completed" else []
    return {"id": item_id, "content": content, "role": "assistant", "status": status,
            "type": "message"}  # fmt: skip


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {"arguments": arguments, "call_id": call_id, "name": name, "type": "function_call",
            "id": item_id, "status": status}  # fmt: skip


def output_items(choice: dict[str, Any], logprobs_too: bool) -> list[dict[str, Any]]:
    """A whole chat choice's output items (`logprobs_too`: the text's log-probabilities)."""
    said = choice.get("message") or {}
    items: list[dict[str, Any]] = []
    if said.get("content"):
        logprobs = (choice.get("logprobs") or {}).get("content") if logprobs_too else None
        items.append(_message_item(new_id("msg"), said["content"], logprobs, "completed"))
    for call in said.get("tool_calls") or ():
        function = call["function"]
        items.append(_call_item(new_id("fc"), call["id"], function["name"],
                                function["arguments"], "completed"))  # fmt: skip
    return items


def response(request: dict[str, Any], chat: dict[str, Any], response_id: str) -> dict[str, Any]:
    """A whole chat completion as the response to `request`."""
    choice = chat["choices"][0]
    return response_object(
        request, response_id=response_id, created=chat["created"], model=chat["model"],
        status=status_of(choice.get("finish_reason")),
        output=output_items(choice, logprobs_asked(request)),
        usage=usage(chat.get("usage")),
    )  # fmt: skip


@dataclass
class ResponseStream:
    """Streamed chat events as Responses events: `start` first, `feed` each chat chunk, then
    `finish` with the usage (the chat stream's last chunk)."""

    request: dict[str, Any]
    response_id: str
    created: int
    model: str
    sequence: int = 0
    items: list[dict[str, Any]] = field(default_factory=list)
    open: dict[str, Any] | None = None
    """The item being streamed."""
    text: str = ""
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {**fields, "sequence_number": self.sequence, "type": kind}
        self.sequence += 1
        return event

    def _object(self, status: str, usage_: dict[str, Any] | None) -> dict[str, Any]:
        return response_object(self.request, response_id=self.response_id, created=self.created,
                               model=self.model, status=status, output=list(self.items),
                               usage=usage_)  # fmt: skip

    def start(self) -> list[dict[str, Any]]:
        initial = self._object("in_progress", None)
        return [self._event("response.created", response=initial),
                self._event("response.in_progress", response=initial)]  # fmt: skip

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or ():
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.open is None or self.open["type"] != "message":
                    events += self._close()
                    events += self._open_message()
                logprobs = (choice.get("logprobs") or {}).get("content") or []
                self.text += delta["content"]
                self.logprobs += logprobs
                assert self.open is not None
                events.append(self._event(
                    "response.output_text.delta", content_index=0, delta=delta["content"],
                    item_id=self.open["id"], logprobs=logprobs, output_index=len(self.items),
                ))  # fmt: skip
            for call in delta.get("tool_calls") or ():
                events += self._close()
                events += self._call(call)
        return events

    def finish(self, chat_usage: dict[str, Any] | None) -> list[dict[str, Any]]:
        events = self._close()
        final = self._object(status_of(self.finish_reason), usage(chat_usage))
        return [*events, self._event("response.completed", response=final)]

    def _open_message(self) -> list[dict[str, Any]]:
        self.open = _message_item(new_id("msg"), "", None, "in_progress")
        self.text, self.logprobs = "", []
        index = len(self.items)
        return [
            self._event("response.output_item.added", item=self.open, output_index=index),
            self._event("response.content_part.added", content_index=0, item_id=self.open["id"],
                        output_index=index, part=_text_part("", [])),
        ]  # fmt: skip

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        function = call.get("function") or {}
        arguments = function.get("arguments") or ""
        item = _call_item(new_id("fc"), call.get("id") or new_id("call"), function.get("name", ""),
                          "", "in_progress")  # fmt: skip
        index = len(self.items)
        events = [self._event("response.output_item.added", item=item, output_index=index)]
        if arguments:
            events.append(self._event("response.function_call_arguments.delta", delta=arguments,
                                      item_id=item["id"], output_index=index))  # fmt: skip
        done = {**item, "arguments": arguments, "status": "completed"}
        events.append(self._event(
            "response.function_call_arguments.done", arguments=arguments, item_id=item["id"],
            output_index=index, name=item["name"],
        ))  # fmt: skip
        events.append(self._event("response.output_item.done", item=done, output_index=index))
        self.items.append(done)
        return events

    def _close(self) -> list[dict[str, Any]]:
        """End the message being streamed (a call is ended as soon as it is sent)."""
        item, self.open = self.open, None
        if item is None:
            return []
        index, item_id = len(self.items), item["id"]
        logprobs = self.logprobs if logprobs_asked(self.request) else None
        done = _message_item(item_id, self.text, logprobs, "completed")
        self.items.append(done)
        return [
            self._event("response.output_text.done", content_index=0, item_id=item_id,
                        logprobs=self.logprobs, output_index=index, text=self.text),
            self._event("response.content_part.done", content_index=0, item_id=item_id,
                        output_index=index, part=_text_part(self.text, logprobs)),
            self._event("response.output_item.done", item=done, output_index=index),
        ]  # fmt: skip

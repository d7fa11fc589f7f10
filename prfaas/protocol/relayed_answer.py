"""What the gateway reads from an engine's own answer, for each API, as it relays it: token
counts (for metrics and the schedulers), the finish, an error the engine wrote into a 200
answer, and the name an event-stream API gives each event. Pure functions over one decoded
event (or a whole answer's body).

- OpenAI completions and chat: `usage` (`prompt_tokens`, `completion_tokens`,
  `prompt_tokens_details.cached_tokens`), the last choice's `finish_reason`; an error
  object, or a choice finished with "error" (vLLM's failed KV load).
- Anthropic Messages: `usage` on the whole message, on `message_start`'s message and on
  `message_delta` (`input_tokens` there excludes what the cache supplied: the prompt is
  `input_tokens + cache_read_input_tokens + cache_creation_input_tokens`), `stop_reason`;
  an `error` event.
- OpenAI Responses: the response's `usage` (`input_tokens`, which includes
  `input_tokens_details.cached_tokens`, and `output_tokens`) on the whole response and on
  `response.completed` / `response.incomplete` / `response.failed`, its `status`; an `error`
  event or a failed response.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prfaas.protocol.client_body import EVENT_STREAMS, Api

FINAL_RESPONSE_EVENTS = frozenset({"response.completed", "response.incomplete",
                                   "response.failed"})  # fmt: skip
"""The Responses events that carry the final response object."""
READ_EVENTS: dict[Api, frozenset[str]] = {
    "messages": frozenset({"message_start", "message_delta", "error"}),
    "responses": FINAL_RESPONSE_EVENTS | {"error"},
}
"""The named events whose data the gateway reads (usage, the finish, an error); any other
event of these streams is relayed unread, counted by its name."""


def must_read(api: Api, name: str | None) -> bool:
    """Whether a streamed event named `name` (None: the stream names no events) must be
    decoded for its counts, finish or error."""
    return name is None or api not in EVENT_STREAMS or name in READ_EVENTS[api]


@dataclass(frozen=True)
class Usage:
    """Token counts an answer reported (None: not in this event)."""

    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int = 0


def _int(value: Any) -> int:
    return value if type(value) is int else 0


def usage(api: Api, event: dict[str, Any]) -> Usage | None:
    """The counts in `event` (a stream event or a whole answer), or None."""
    if api == "messages":
        found = event.get("usage")
        message = event.get("message")
        if found is None and isinstance(message, dict):
            found = message.get("usage")
        if not isinstance(found, dict):
            return None
        cached = _int(found.get("cache_read_input_tokens"))
        created = _int(found.get("cache_creation_input_tokens"))
        prompt = _int(found.get("input_tokens")) + cached + created
        return Usage(prompt, _int(found.get("output_tokens")), cached)
    if api == "responses":
        response = event.get("response", event)
        found = response.get("usage") if isinstance(response, dict) else None
        if not isinstance(found, dict):
            return None
        details = found.get("input_tokens_details")
        cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else 0
        return Usage(_int(found.get("input_tokens")), _int(found.get("output_tokens")), cached)
    found = event.get("usage")
    if not isinstance(found, dict):
        return None
    details = found.get("prompt_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else 0
    given = found.get("prompt_tokens")
    return Usage(given if type(given) is int else None, _int(found.get("completion_tokens")),
                 cached)  # fmt: skip


def output_event(api: Api, event: dict[str, Any]) -> bool:
    """Whether a streamed `event` carries output (about one token; the counts until the
    final usage come from these)."""
    if api in EVENT_STREAMS:
        kind = event.get("type")
        return isinstance(kind, str) and output_name(api, kind)
    return bool(event.get("choices"))


def output_name(api: Api, name: str) -> bool:
    """Whether the event `name` of a Messages or Responses stream carries output."""
    return name == "content_block_delta" if api == "messages" else name.endswith(".delta")


def finish(api: Api, event: dict[str, Any]) -> str | None:
    """How the answer ended, where `event` says (a finish reason, stop reason or status)."""
    if api == "messages":
        delta = event.get("delta")
        reason = delta.get("stop_reason") if isinstance(delta, dict) else None
        return reason or event.get("stop_reason")
    if api == "responses":
        response = event.get("response", event)
        status = response.get("status") if isinstance(response, dict) else None
        return status if status in ("completed", "incomplete", "failed") else None
    choices = event.get("choices")
    last = choices[-1] if isinstance(choices, list) and choices else {}
    return last.get("finish_reason") if isinstance(last, dict) else None


def error(api: Api, event: dict[str, Any]) -> str | None:
    """The error an engine wrote into its answer (None: no error)."""
    kind = event.get("type")
    if api in EVENT_STREAMS and kind == "error":
        inner = event.get("error", event)
        return str(inner.get("message", inner) if isinstance(inner, dict) else inner)
    if api == "responses":
        response = event.get("response", event)
        if isinstance(response, dict) and response.get("status") == "failed":
            failure = response.get("error")
            return str(failure.get("message", failure) if isinstance(failure, dict) else
                       "the response failed")  # fmt: skip
        return None
    if api == "messages":
        return None
    if "error" in event or event.get("object") == "error":
        inner = event.get("error", event)
        return str(inner.get("message", inner) if isinstance(inner, dict) else inner)
    for choice in event.get("choices") or ():
        if isinstance(choice, dict) and choice.get("finish_reason") == "error":
            return "the request failed in the engine (KV load?)"
    return None


def event_name(api: Api, event: dict[str, Any]) -> str | None:
    """The SSE event name of a streamed event (its `type`, for the APIs that name events)."""
    kind = event.get("type")
    return kind if api in EVENT_STREAMS and isinstance(kind, str) else None

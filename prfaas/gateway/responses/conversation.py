"""A stored response's conversation, and the stateless body an engine gets for a turn (pure).

The gateway keeps the Responses API's state itself (`store`, `previous_response_id`), so a
follow-up works whichever replica and engine it reaches, and its prompt counts whole for
routing: the engine always gets a stateless body whose `input` is the whole conversation
(the stored one, then the turn's own input), with `store: false` and without
`previous_response_id` or `background` (the gateway runs background responses itself). As
OpenAI's API does, a previous response's `instructions` do not carry over; its input items
and its output items (messages, function calls, reasoning) do, the output items as the input
items that say the same (so a follow-up that answers a function call renders the call
before its output).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from prfaas.protocol.openai_responses import input_items

GATEWAY_FIELDS = ("previous_response_id", "store", "background")
INPUT_KEYS: dict[str, tuple[str, ...]] = {
    "function_call": ("id", "call_id", "name", "arguments", "status", "namespace"),
    "custom_tool_call": ("id", "call_id", "name", "input"),
    "reasoning": ("id", "summary", "content", "encrypted_content", "status"),
}
"""What an output item of each kind keeps as an input item (messages are rebuilt)."""
"""What the gateway reads from a Responses body and never hands an engine as given."""


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: the answer as the client got it, and the conversation a
    follow-up continues (every input item so far, then this response's output items)."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]

    def encode(self) -> bytes:
        return orjson.dumps({"response": self.response, "conversation": self.conversation})

    @classmethod
    def decode(cls, raw: bytes) -> StoredResponse:
        data = orjson.loads(raw)
        return cls(data["response"], data["conversation"])


def engine_body(body: dict[str, Any], previous: StoredResponse | None) -> dict[str, Any]:
    """The stateless body an engine gets for the client's `body`: the previous response's
    conversation before the input, never stored on the engine."""
    out = {k: v for k, v in body.items() if k not in GATEWAY_FIELDS}
    if previous is not None:
        out["input"] = [*previous.conversation, *input_items(body)]
    out["store"] = False
    return out


def stored(engine_request: dict[str, Any], response: dict[str, Any]) -> StoredResponse:
    """What to store of `response`, the answer to `engine_request` (an engine body)."""
    output = response.get("output")
    items = [as_input(item) for item in output if isinstance(item, dict)] if isinstance(
        output, list
    ) else []  # fmt: skip
    return StoredResponse(response, [*input_items(engine_request), *items])


def as_input(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as the input item that says the same (its id and status kept; fields
    only an output item has, such as a text's log-probabilities, left out)."""
    kind = item.get("type")
    if kind == "message":
        parts = [_input_part(p) for p in item.get("content") or () if isinstance(p, dict)]
        return {"type": "message", "role": item.get("role", "assistant"), "id": item.get("id"),
                "status": item.get("status") or "completed", "content": parts}  # fmt: skip
    keys = INPUT_KEYS.get(kind) if isinstance(kind, str) else None
    if keys is None:
        return item
    return {"type": kind, **{k: item[k] for k in keys if item.get(k) is not None}}


def _input_part(part: dict[str, Any]) -> dict[str, Any]:
    if part.get("type") == "refusal":
        return {"type": "refusal", "refusal": part.get("refusal", "")}
    return {"type": "output_text", "text": part.get("text", ""), "annotations": []}


def for_client(response: dict[str, Any], client: dict[str, Any]) -> dict[str, Any]:
    """The engine's response object as the client's: its `previous_response_id` the one the
    client gave (the engine never saw it), and `store` as asked where the object has one."""
    out = dict(response)
    if "previous_response_id" in out or client.get("previous_response_id") is not None:
        out["previous_response_id"] = client.get("previous_response_id")
    if "store" in out:
        out["store"] = client.get("store", True) is not False
    return out

"""Server-sent events as each API writes them: OpenAI completions and chat send `data:` lines
and end with `data: [DONE]`; Anthropic Messages and OpenAI Responses name every event
(`event: TYPE` before its `data:`) and end with their own last event (`message_stop`,
`response.completed`), no `[DONE]`. An error after the stream began is an event in the
API's own shape, and (for completions and chat) no `[DONE]`, so that a client never takes a
cut-off answer for a whole one.
"""

from __future__ import annotations

import orjson

from prfaas.protocol.client_body import EVENT_STREAMS, Api
from prfaas.protocol.errors import APIError

DONE = b"data: [DONE]\n\n"


def frame(api: Api, data: bytes, event: str | None = None) -> bytes:
    """One event: its `data` (JSON bytes), named `event` where the API names events."""
    if api in EVENT_STREAMS and event:
        return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"
    return b"data: " + data + b"\n\n"


def end(api: Api) -> bytes:
    """What follows the last event of a stream that ended well."""
    return b"" if api in EVENT_STREAMS else DONE


def error_event(api: Api, exc: APIError, sequence_number: int | None = None) -> bytes:
    """A stream's error event: Anthropic's `error` event, the Responses `error` event (with
    the next `sequence_number` where the relay knows it), or an OpenAI error object."""
    if api == "messages":
        return frame(api, orjson.dumps(exc.body("anthropic")), "error")
    if api == "responses":
        body: dict[str, object] = {"type": "error", "code": exc.code, "message": exc.message,
                                   "param": exc.param}  # fmt: skip
        if sequence_number is not None:
            body["sequence_number"] = sequence_number
        return frame(api, orjson.dumps(body), "error")
    return frame(api, exc.encode())

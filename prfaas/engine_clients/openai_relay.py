"""A call of an engine's own API route (OpenAI completions and chat, Anthropic Messages,
OpenAI Responses) whose answer is relayed to the client as the engine wrote it (vLLM servers,
SGLang servers and the reference engine alike): each SSE event, or the whole body, becomes a
`GenerateChunk` whose `raw` is those bytes (and `event` the event's name, for the APIs that
name them), with the counts read from the answer (`prfaas.protocol.relayed_answer`) for the
gateway's accounting. An engine's own refusal (a 4xx but 429) keeps its status and body for
the client, who sent what it refused.
"""

from __future__ import annotations

from typing import Any

import orjson

from prfaas.engine_clients.base import AnsweredCall, EngineError, call_failure
from prfaas.http.client import HttpCall
from prfaas.protocol import relayed_answer
from prfaas.protocol.client_body import EVENT_STREAMS, Api
from prfaas.protocol.generate import GenerateChunk, GenerateRequest


def with_usage(body: dict[str, Any], api: Api) -> dict[str, Any]:
    """A streamed completions or chat body that asks for its usage (the gateway counts
    tokens from it; the usage event a client did not ask for is not relayed). A client that
    did not ask for it gets no continuous usage either, as the engine would answer it alone.
    Messages and Responses streams always end with their usage."""
    if body.get("stream") is True and api not in EVENT_STREAMS:
        options = body.get("stream_options")
        given = options if isinstance(options, dict) else {}
        extra = {} if given.get("include_usage") is True else {"continuous_usage_stats": False}
        body["stream_options"] = {**given, "include_usage": True, **extra}
    return body


def usage_asked(request: GenerateRequest) -> bool:
    """Whether the client asked for a streamed completions or chat answer's usage itself."""
    options = request.client_body.fields.get("stream_options") if request.client_body else None
    return isinstance(options, dict) and options.get("include_usage") is True


class OpenAICall(AnsweredCall):
    """One call of an engine's OpenAI API. With `relay`, its answer is the client's (kept as
    written); otherwise subclasses read it as token chunks (`_event`)."""

    http: HttpCall

    def __init__(
        self, name: str, path: str, stream: bool, prompt_tokens: int, *, relay: bool,
        usage_asked: bool = False, api: Api = "completions",
    ) -> None:  # fmt: skip
        super().__init__(stream)
        self.name, self.prompt_tokens, self.relay = name, prompt_tokens, relay
        self._path, self._usage_asked, self.api = path, usage_asked, api
        self._completion = 0
        self._event_name: str | None = None  # the current SSE event's `event:` line

    def on_end(self, error: BaseException | None) -> None:
        if self.ended.done():
            return
        if error is not None:
            self.finish(call_failure(self.name, self._path, error))
        elif self.status != 200:
            self.finish(self._refusal())
        else:
            try:
                if self.stream and self._body:
                    self._line(bytes(self._body))
                elif not self.stream:
                    self._answer(bytes(self._body))
            except (EngineError, orjson.JSONDecodeError) as exc:
                self.finish(exc if isinstance(exc, EngineError) else EngineError(str(exc)))
                return
            self.finish()

    def _refusal(self) -> EngineError:
        """A non-200 answer as an error: busy (429, 503) may go elsewhere; the engine's own
        refusal of a forwarded body (any other 4xx) keeps its status and body."""
        name, status = self.name, self.status
        detail = bytes(self._body[:300]).decode(errors="replace")
        message = f"{name}: {self._path} answered {status}: {detail}"
        if status in (429, 503):
            return EngineError(message, status=503, retryable=True, code="engine_busy")
        if self.relay and 400 <= status < 500:
            return EngineError(message, status=status, rejected=True, code="engine_refused",
                               answer=bytes(self._body))  # fmt: skip
        return EngineError(message)

    def _line(self, line: bytes) -> None:
        """One SSE line; raises EngineError for an error event (ends the HTTP call). An
        event a Messages or Responses stream names, and whose data the gateway need not
        read (`relayed_answer.must_read`), is relayed without decoding it."""
        if line.startswith(b"event:"):
            self._event_name = line[6:].strip().decode(errors="replace")
            return
        payload = line[5:].strip() if line.startswith(b"data:") else b""
        if not payload or payload == b"[DONE]":
            return
        name, self._event_name = self._event_name, None
        if not self.relay:
            self._event(orjson.loads(payload))
        elif relayed_answer.must_read(self.api, name):
            self._relayed(payload, orjson.loads(payload))
        else:
            assert name is not None
            self._completion += relayed_answer.output_name(self.api, name)
            self.push(GenerateChunk((), "", self.prompt_tokens, self._completion, 0, None,
                                    payload, name))  # fmt: skip

    def _answer(self, raw: bytes) -> None:
        """A whole answer: as written (relay), or token chunks."""
        answer = orjson.loads(raw)
        if self.relay:
            self._relayed(raw, answer)
        else:
            self._event(answer)

    def _check(self, event: Any) -> None:
        if not isinstance(event, dict):
            raise EngineError(f"{self.name}: an answer that is not a JSON object")
        failure = relayed_answer.error(self.api, event)
        if failure is not None:
            raise EngineError(f"{self.name}: {failure}")

    def _relayed(self, raw: bytes, event: Any) -> None:
        """One event of a forwarded request, kept as written; its usage (when it carries
        one) gives the counts. The usage event the client did not ask for is not relayed."""
        self._check(event)
        api = self.api
        found = relayed_answer.usage(api, event)
        if found is not None:
            self._completion = found.completion_tokens or self._completion
            self.prompt_tokens = found.prompt_tokens or self.prompt_tokens
            cached = found.cached_tokens
        else:
            cached = 0
            self._completion += relayed_answer.output_event(api, event)  # about one token each
        hidden = (self.stream and api not in EVENT_STREAMS and not event.get("choices")
                  and not self._usage_asked)  # fmt: skip
        self.push(GenerateChunk((), "", self.prompt_tokens, self._completion, cached,
                                relayed_answer.finish(api, event), b"" if hidden else raw,
                                relayed_answer.event_name(api, event)))  # fmt: skip

    def _event(self, event: dict[str, Any]) -> None:
        """A token-path answer (not relayed): subclasses that send one read it."""
        raise EngineError(f"{self.name}: an answer this call cannot read")

    def _stop(self) -> None:
        self.http.cancel()  # an OpenAI server aborts a request whose connection closes

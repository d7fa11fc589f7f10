"""The reference engine's OpenAI answers (whole and streamed) from its sequences' output:
`n` choices, log-probabilities, tool calls (Hermes `<tool_call>` parsing for `auto`, the
required array or the named tool's arguments otherwise) and usage, in the shapes vLLM's
OpenAI server writes.

A `Sequence` gathers one choice's output as token events arrive; `Answer` turns sequences
into the whole body or into streamed events (a choice's tool-call parser holds back text
that may open a call, so a streamed delta is never retracted).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prfaas.engines.reference.server.streaming import output_text
from prfaas.engines.reference.step.request import TokenEvent
from prfaas.engines.reference.step.sampling import TokenLogprob
from prfaas.protocol.openai_engine_call import EngineOpenAICall
from prfaas.protocol.tool_calls import (
    ForcedStream,
    HermesStream,
    named_call,
    parse_hermes,
    required_calls,
    tool_finish_reason,
)

Decode = Callable[[list[int]], str]


@dataclass
class Delta:
    """What one token event added to a choice: its text and the tokens' log-probabilities."""

    text: str
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str | None


@dataclass
class Sequence:
    """One choice's output so far."""

    index: int
    ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    matched: int | str | None = None
    """What stopped it (a stop string, a token id), as the engine's finish reason says."""
    cached_tokens: int = 0

    def add(self, event: TokenEvent, decode: Decode, stops: tuple[str, ...] = ()) -> Delta:
        """Take `event`; returns the text it made visible (`stops`: the request's stop
        strings, whose possible beginnings are held back until the end)."""
        self.ids.extend(event.token_ids)
        self.logprobs.extend(event.logprobs)
        self.cached_tokens = event.cached_tokens or self.cached_tokens
        reason = event.finish_reason
        text = output_text(decode, self.ids, reason, stops)
        delta, self.text = text[len(self.text) :], text
        if reason is not None:
            self.finish_reason = str(reason.get("type"))
            matched = reason.get("matched")
            self.matched = matched if isinstance(matched, int | str) else None
        return Delta(delta, event.logprobs, self.finish_reason)


@dataclass
class Answer:
    """Builds the response bodies of one request."""

    request: EngineOpenAICall
    rid: str
    created: int
    token_text: Decode
    """The text of a token, as log-probabilities name it."""
    sequences: list[Sequence] = field(default_factory=list)
    _parsers: dict[int, HermesStream | ForcedStream] = field(default_factory=dict)
    _started: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.sequences = [Sequence(i) for i in range(self.request.n)]

    @property
    def chat(self) -> bool:
        return self.request.call.api == "chat"

    def _head(self, chunk: bool) -> dict[str, Any]:
        if self.chat:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created,
                "model": self.request.call.model}  # fmt: skip

    def usage(self) -> dict[str, Any]:
        prompt = len(self.request.call.input_ids)
        completion = sum(len(s.ids) for s in self.sequences)
        cached = max((s.cached_tokens for s in self.sequences), default=0)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip

    # -- whole --------------------------------------------------------------------------

    def whole(self) -> dict[str, Any]:
        """The non-streaming response."""
        choices = [self._choice(s) for s in self.sequences]
        return {**self._head(False), "choices": choices, "usage": self.usage()}

    def _choice(self, seq: Sequence) -> dict[str, Any]:
        logprobs = self._logprobs(seq.logprobs, 0) if self._wants_logprobs else None
        choice: dict[str, Any] = {"index": seq.index}
        finish = seq.finish_reason
        if self.chat:
            content, calls = self._calls(seq.text)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            if finish is not None and self.request.tool_mode != "none":
                finish = tool_finish_reason(finish, self.request.tool_mode, called=bool(calls),
                                            stream=False)  # fmt: skip
            choice["message"] = message
        else:
            choice["text"] = seq.text
        return {**choice, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": self._stop_reason(seq)}  # fmt: skip

    def _stop_reason(self, seq: Sequence) -> int | str | None:
        """vLLM's `stop_reason`: the stop string or stop token id that ended the sequence
        (None at the end of sequence, a completed grammar or the length limit)."""
        matched = seq.matched
        if isinstance(matched, int) and matched not in self.request.sampling.stop_token_ids:
            return None
        return matched

    def _calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A chat choice's content and tool calls."""
        req = self.request
        if req.tool_mode == "auto":
            content, calls = parse_hermes(text)
        elif req.tool_mode == "required":
            content, calls = "", required_calls(text)
        elif req.tool_mode == "named":
            assert req.tool_name is not None
            named = named_call(req.tool_name, text)
            content, calls = "", [] if named is None else [named]
        else:
            return text, []
        if not req.parallel_tool_calls:
            calls = calls[:1]
        return content, [c.to_json() for c in calls]

    # -- streamed -----------------------------------------------------------------------

    def event(self, index: int, delta: Delta) -> dict[str, Any] | None:
        """The streamed event for a choice's delta (None when it shows nothing yet)."""
        seq = self.sequences[index]
        choice: dict[str, Any] = {"index": index}
        finish = delta.finish_reason
        if self.chat:
            body: dict[str, Any] = {}
            for piece in self._chat_delta(index, delta.text, finish is not None):
                if "content" in piece:
                    body["content"] = body.get("content", "") + piece["content"]
                if "tool_calls" in piece:
                    body.setdefault("tool_calls", []).extend(piece["tool_calls"])
            if finish is not None and self.request.tool_mode != "none":
                finish = tool_finish_reason(finish, self.request.tool_mode,
                                            called=self._called(index), stream=True)  # fmt: skip
            if index not in self._started:
                self._started.add(index)
                body = {"role": "assistant", "content": body.get("content", ""), **body}
            elif not body and finish is None and not delta.logprobs:
                return None
            choice["delta"] = body
        else:
            choice["text"] = delta.text
        lp = None
        if self._wants_logprobs:
            earlier = seq.logprobs[: len(seq.logprobs) - len(delta.logprobs)]
            offset = sum(len(self.token_text([e.token])) for e in earlier)
            lp = self._logprobs(list(delta.logprobs), offset)
        choice.update(logprobs=lp, finish_reason=finish)
        if finish is not None:
            choice["stop_reason"] = self._stop_reason(seq)
        return {**self._head(True), "choices": [choice]}

    def _chat_delta(self, index: int, text: str, final: bool) -> list[dict[str, Any]]:
        req = self.request
        if req.tool_mode == "none":
            return [{"content": text}] if text else []
        parser = self._parsers.get(index)
        if parser is None:
            auto = req.tool_mode == "auto"
            parser = self._parsers[index] = HermesStream() if auto else ForcedStream(req.tool_name)
        out = parser.feed(text) if text else []
        out = out + parser.finish() if final else out
        if req.parallel_tool_calls:
            return out
        return [_first_call_only(piece) for piece in out]

    def _called(self, index: int) -> bool:
        parser = self._parsers.get(index)
        return parser is not None and parser.called

    def usage_event(self) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": self.usage()}

    # -- log-probabilities --------------------------------------------------------------

    @property
    def _wants_logprobs(self) -> bool:
        return self.request.sampling.top_logprobs is not None

    def _logprobs(self, items: list[TokenLogprob], offset: int) -> dict[str, Any]:
        """Chat's `{"content": [...]}` or the completions' parallel lists (`offset`: where
        the first item's text starts in the choice's text)."""
        text = self.token_text
        if self.chat:
            return {"content": [
                {**_entry(text([lp.token]), lp.logprob),
                 "top_logprobs": [_entry(text([t]), v) for t, v in lp.top]}
                for lp in items
            ]}  # fmt: skip
        offsets, at = [], offset
        for lp in items:
            offsets.append(at)
            at += len(text([lp.token]))
        return {
            "text_offset": offsets,
            "token_logprobs": [lp.logprob for lp in items],
            "tokens": [text([lp.token]) for lp in items],
            "top_logprobs": [  # the chosen token always among them, as vLLM writes it
                {text([lp.token]): lp.logprob, **{text([t]): v for t, v in lp.top}} for lp in items
            ],
        }


def _first_call_only(piece: dict[str, Any]) -> dict[str, Any]:
    """A streamed delta with only the first tool call (`parallel_tool_calls` false)."""
    calls = piece.get("tool_calls")
    if calls is None:
        return piece
    return {**piece, "tool_calls": [c for c in calls if c.get("index") == 0]}


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

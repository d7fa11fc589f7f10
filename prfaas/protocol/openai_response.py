"""OpenAI response bodies (whole and streamed) built from the engine's output chunks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prfaas.protocol.generate import GenerateChunk
from prfaas.protocol.openai_request import CompletionCall


@dataclass
class Accumulator:
    """Collects a request's output; the last chunk's counts are the engine's totals."""

    call: CompletionCall
    rid: str
    created: int
    index_cached_tokens: int = 0
    text: list[str] = field(default_factory=list)
    last: GenerateChunk | None = None
    sent_role: bool = False

    def add(self, chunk: GenerateChunk) -> None:
        self.text.append(chunk.text)
        self.last = chunk

    @property
    def finish_reason(self) -> str | None:
        return self.last.finish_reason if self.last else None

    def usage(self) -> dict[str, Any]:
        """`usage`; cached tokens are the engine's count, else the KV index's estimate."""
        prompt = len(self.call.input_ids)
        completion = self.last.completion_tokens if self.last else 0
        cached = self.last.cached_tokens if self.last and self.last.cached_tokens else 0
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached or self.index_cached_tokens},
        }

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.call.model}

    def final(self) -> dict[str, Any]:
        """The non-streaming response."""
        text = "".join(self.text)
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish_reason, "logprobs": None}
        if self.call.api == "chat":
            choice["message"] = {"role": "assistant", "content": text}
            obj = "chat.completion"
        else:
            choice["text"] = text
            obj = "text_completion"
        return {**self._head(obj), "choices": [choice], "usage": self.usage()}

    def chunk(self, chunk: GenerateChunk) -> dict[str, Any]:
        """The streamed event for one engine chunk (call `add` first)."""
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": chunk.finish_reason,
            "logprobs": None,
        }
        if self.call.api == "chat":
            delta: dict[str, Any] = {"content": chunk.text}
            if not self.sent_role:
                delta = {"role": "assistant", **delta}
                self.sent_role = True
            choice["delta"] = delta
            obj = "chat.completion.chunk"
        else:
            choice["text"] = chunk.text
            obj = "text_completion"
        return {**self._head(obj), "choices": [choice]}

    def usage_chunk(self) -> dict[str, Any]:
        """The last streamed event when `stream_options.include_usage` is set."""
        obj = "chat.completion.chunk" if self.call.api == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage()}

"""The three streaming APIs the client speaks: request bodies and stream-chunk parsing.

- `completions`: OpenAI `/v1/completions`, prompt as token ids when all we have are ids.
- `chat`: OpenAI `/v1/chat/completions`, prompt as text messages.
- `generate`: SGLang's native `/generate`, `input_ids`; its stream chunks carry the
  cumulative `text` and `meta_info` (`prompt_tokens`, `completion_tokens`, `cached_tokens`).

Token counts come from the server (`usage` or `meta_info`), never from counting chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from prfaas.loadgen.conversation import Conversation

ApiName = Literal["completions", "chat", "generate"]


@dataclass
class StreamState:
    """What one response stream has told us so far (mutated by `StreamApi.consume`)."""

    text: list[str] = field(default_factory=list)
    output_ids: list[int] | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None


class StreamApi(Protocol):
    """One wire API."""

    name: ApiName
    path: str

    def body(self, conv: Conversation, max_tokens: int, rid: str, model: str) -> dict[str, Any]:
        """The JSON request body (streaming, ignore_eos, greedy)."""
        ...

    def consume(self, chunk: dict[str, Any], state: StreamState) -> bool:
        """Fold one stream chunk into `state`; True if it carried new output tokens."""
        ...


def _usage(usage: Any, state: StreamState) -> None:
    if not isinstance(usage, dict):
        return
    state.prompt_tokens = usage.get("prompt_tokens", state.prompt_tokens)
    state.completion_tokens = usage.get("completion_tokens", state.completion_tokens)
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        state.cached_tokens = details["cached_tokens"]


def _error(chunk: dict[str, Any]) -> str | None:
    err = chunk.get("error")
    if err is None:
        return None
    return str(err.get("message", err)) if isinstance(err, dict) else str(err)


def _openai_body(max_tokens: int, model: str) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }


class CompletionsApi:
    """OpenAI `/v1/completions`."""

    name: ApiName = "completions"
    path = "/v1/completions"

    def body(self, conv: Conversation, max_tokens: int, rid: str, model: str) -> dict[str, Any]:
        ids = conv.token_ids()
        return {**_openai_body(max_tokens, model), "prompt": conv.text() if ids is None else ids}

    def consume(self, chunk: dict[str, Any], state: StreamState) -> bool:
        state.error = _error(chunk) or state.error
        _usage(chunk.get("usage"), state)
        new = False
        for choice in chunk.get("choices") or ():
            text = choice.get("text") or ""
            state.text.append(text)
            # an empty text mid-stream is still a token (e.g. half of a UTF-8 character)
            new = new or bool(text) or choice.get("finish_reason") is None
        return new


class ChatApi:
    """OpenAI `/v1/chat/completions`."""

    name: ApiName = "chat"
    path = "/v1/chat/completions"

    def body(self, conv: Conversation, max_tokens: int, rid: str, model: str) -> dict[str, Any]:
        return {**_openai_body(max_tokens, model), "messages": conv.chat_messages()}

    def consume(self, chunk: dict[str, Any], state: StreamState) -> bool:
        state.error = _error(chunk) or state.error
        _usage(chunk.get("usage"), state)
        new = False
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            text = delta.get("content") or ""
            state.text.append(text)
            # an empty content mid-stream is still a token, unless it is the role preamble
            empty_token = "content" in delta and "role" not in delta
            new = new or bool(text or delta.get("reasoning_content"))
            new = new or (empty_token and choice.get("finish_reason") is None)
        return new


class GenerateApi:
    """SGLang `/generate` (cumulative text and output_ids, SGLang's default streaming)."""

    name: ApiName = "generate"
    path = "/generate"

    def body(self, conv: Conversation, max_tokens: int, rid: str, model: str) -> dict[str, Any]:
        ids = conv.token_ids()
        prompt = {"text": conv.text()} if ids is None else {"input_ids": ids}
        params = {"max_new_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
        return {**prompt, "sampling_params": params, "stream": True, "rid": rid}

    def consume(self, chunk: dict[str, Any], state: StreamState) -> bool:
        state.error = _error(chunk) or state.error
        meta = chunk.get("meta_info") or {}
        before = state.completion_tokens or 0
        state.prompt_tokens = meta.get("prompt_tokens", state.prompt_tokens)
        state.completion_tokens = meta.get("completion_tokens", state.completion_tokens)
        state.cached_tokens = meta.get("cached_tokens", state.cached_tokens)
        if isinstance(chunk.get("text"), str):
            state.text = [chunk["text"]]
        if isinstance(chunk.get("output_ids"), list):
            state.output_ids = chunk["output_ids"]
        return (state.completion_tokens or 0) > before


def create_api(name: str) -> StreamApi:
    """The API adapter called `name`.

    Raises:
        ValueError: unknown name.
    """
    apis: dict[str, type[CompletionsApi | ChatApi | GenerateApi]] = {
        "completions": CompletionsApi,
        "chat": ChatApi,
        "generate": GenerateApi,
    }
    if name not in apis:
        raise ValueError(f"unknown API {name!r}; choose one of {', '.join(apis)}")
    return apis[name]()

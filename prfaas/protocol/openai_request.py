"""Parse and validate OpenAI `/v1/completions` and `/v1/chat/completions` bodies: the one
parser of the gateway, the reference engine's own OpenAI route and the null server.

Every rejection is an `APIError` (400 with the offending `param`, 404 for an unknown model),
raised before anything is dispatched, so bad input never reaches an engine. Fields that
would change the output but are not supported (`n > 1`, `echo`, `logprobs`, penalties,
`best_of`) are rejected; fields that do not (`user`, `metadata`, ...) are ignored, as
OpenAI-compatible servers do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from prfaas.common.tokenizer import ChatMessage, Tokenizer, chat_ids
from prfaas.protocol.errors import APIError, invalid
from prfaas.protocol.generate import SamplingParams

Api = Literal["completions", "chat"]
MAX_STOP = 4
DEFAULT_MAX_TOKENS = 16
BODY_BYTES_PER_TOKEN = 32
"""Generous JSON bytes per prompt token of a real body: a token id takes at most 12 with
its separator, a text token a few UTF-8 bytes (6 per byte when escaped as `\\u00XX`)."""
BODY_OVERHEAD_BYTES = 1024 * 1024
"""Room for everything around the prompt (chat roles, stop strings, options)."""


@dataclass(frozen=True)
class ModelLimits:
    """The served model's name and the limits requests are checked against."""

    name: str
    context_length: int
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("model name must not be empty")
        if self.context_length < 2:
            raise ValueError(f"context_length must be >= 2, got {self.context_length}")


@dataclass(frozen=True)
class CompletionCall:
    """A validated, tokenized request, ready for the Router."""

    api: Api
    model: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams
    stream: bool
    include_usage: bool


def max_body_bytes(limits: ModelLimits) -> int:
    """The largest request body whose prompt could still fit the context: anything larger
    is refused from its `Content-Length` (413), before a byte of it is parsed."""
    return limits.context_length * BODY_BYTES_PER_TOKEN + BODY_OVERHEAD_BYTES


def load_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object. Raises APIError(400) for anything else."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise invalid(f"body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid(f"body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def _typed(body: dict[str, Any], key: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise invalid(f"'{key}' must be {what}, got {orjson.dumps(value).decode()[:80]}", key)
    return value


def _number(body: dict[str, Any], key: str, lo: float, hi: float, default: float) -> float:
    value = _typed(body, key, (int, float), "a number")
    if value is None:
        return default
    if not (math.isfinite(value) and lo <= value <= hi):
        raise invalid(f"'{key}' must be in [{lo:g}, {hi:g}], got {value}", key)
    return float(value)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("'stop' must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP:
        raise invalid(f"'stop' takes at most {MAX_STOP} sequences, got {len(stops)}", "stop")
    return tuple(stops)


def _max_tokens(body: dict[str, Any]) -> int:
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = _typed(body, key, (int,), "an integer")
    if value is None:
        return DEFAULT_MAX_TOKENS
    if value < 1:
        raise invalid(f"'{key}' must be >= 1, got {value}", key)
    return int(value)


def _unsupported(body: dict[str, Any]) -> None:
    n = _typed(body, "n", (int,), "an integer")
    if n not in (None, 1):
        raise invalid(f"only n=1 is supported, got {n}", "n")
    best_of = _typed(body, "best_of", (int,), "an integer")
    if best_of not in (None, 1):
        raise invalid(f"only best_of=1 is supported, got {best_of}", "best_of")
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise invalid(f"'{key}' is not supported (must be 0)", key)
    for key in ("echo", "logprobs", "top_logprobs"):
        if body.get(key) not in (None, False, 0):
            raise invalid(f"'{key}' is not supported", key)


def parse_sampling(body: dict[str, Any]) -> SamplingParams:
    """Sampling parameters from an OpenAI body (extensions: `top_k`, `min_p`,
    `ignore_eos`)."""
    _unsupported(body)
    top_k = _typed(body, "top_k", (int,), "an integer")
    if top_k is not None and (top_k == 0 or top_k < -1):
        raise invalid(f"'top_k' must be -1 or >= 1, got {top_k}", "top_k")
    top_p = _number(body, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0:
        raise invalid("'top_p' must be > 0, got 0", "top_p")
    seed = _typed(body, "seed", (int,), "an integer")
    return SamplingParams(
        max_new_tokens=_max_tokens(body),
        temperature=_number(body, "temperature", 0.0, 2.0, 1.0),
        top_p=top_p,
        top_k=-1 if top_k is None else top_k,
        min_p=_number(body, "min_p", 0.0, 1.0, 0.0),
        stop=_stop(body),
        ignore_eos=bool(_typed(body, "ignore_eos", (bool,), "a boolean")),
        seed=seed,
    )


def _prompt_ids(body: dict[str, Any], tokenizer: Tokenizer, vocab: int | None) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        bad = [t for t in prompt if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise invalid(f"'prompt' token id {bad[0]} is outside the vocabulary", "prompt")
        return list(prompt)
    raise invalid("'prompt' must be a string, a list of token ids, or a list of one", "prompt")


def _content(value: Any, i: int) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = [p.get("text") for p in value if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) == len(value) and all(isinstance(p, str) for p in parts):
            return "".join(str(p) for p in parts)
    raise invalid(f"'messages[{i}].content' must be a string or a list of text parts", "messages")


def _messages(body: dict[str, Any]) -> list[ChatMessage]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid(f"'messages[{i}]' must be an object with a string 'role'", "messages")
        out.append(ChatMessage(m["role"], _content(m.get("content"), i)))
    return out


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = bool(_typed(body, "stream", (bool,), "a boolean"))
    options = _typed(body, "stream_options", (dict,), "an object") or {}
    usage = _typed(options, "include_usage", (bool,), "a boolean")
    return stream, bool(usage)


def parse_call(
    body: dict[str, Any], api: Api, limits: ModelLimits, tokenizer: Tokenizer
) -> CompletionCall:
    """Validate and tokenize a request body.

    Raises:
        APIError: 400 for a missing or wrong-typed field, invalid sampling values or a
            prompt over the context; 404 for a model that is not served.
    """
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required and must be a string", "model", "missing_model")
    if model != limits.name:
        raise APIError(
            404, f"model {model!r} does not exist", param="model", code="model_not_found"
        )
    sampling = parse_sampling(body)
    stream, usage = _stream(body)
    if api == "chat":
        ids = _tokenize_chat(tokenizer, _messages(body))
    else:
        ids = _prompt_ids(body, tokenizer, limits.vocab_size)
    check_context(len(ids), sampling.max_new_tokens, limits)
    return CompletionCall(api, model, tuple(ids), sampling, stream, usage)


def _tokenize_chat(tokenizer: Tokenizer, messages: list[ChatMessage]) -> list[int]:
    try:
        return chat_ids(tokenizer, messages)
    except ValueError as exc:
        raise invalid(str(exc), "messages") from None


def check_context(prompt_tokens: int, max_new_tokens: int, limits: ModelLimits) -> None:
    """Raises APIError(400) for an empty prompt or one that does not fit the context."""
    if prompt_tokens == 0:
        raise invalid("the prompt is empty", "prompt", "empty_prompt")
    if prompt_tokens + max_new_tokens > limits.context_length:
        raise invalid(
            f"this model's maximum context length is {limits.context_length} tokens; the "
            f"request has {prompt_tokens} prompt tokens and max_tokens {max_new_tokens}",
            "prompt",
            "context_length_exceeded",
        )

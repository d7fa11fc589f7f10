"""Parse and validate OpenAI `/v1/completions` and `/v1/chat/completions` bodies: the one
parser of the gateway, the reference engine's own OpenAI route and the null server.

Two modes, by who answers the request (`OpenAIMode`):
- `forward` (vLLM engines): the engine's own OpenAI server answers, so the client's body
  travels whole (`ClientBody`). Only what the gateway itself reads is checked here (model,
  stream options, max tokens, the prompt or messages it tokenizes to route, the context);
  every other field is the engine's to honour or refuse.
- `generate` (reference engines and SGLang servers, which serve both SGLang's `/generate`
  and their own OpenAI routes): a request that `/generate` sampling expresses whole
  (`generate_gap` finds nothing) becomes `/generate` sampling parameters and the gateway
  renders the answer (so a failed decode's stream can migrate exactly); any other request
  (tools, grammars, log-probabilities, `n`, ...) is forwarded whole, as in `forward` mode,
  and the engine's own OpenAI route answers or refuses it, naming the field.

Every rejection is an `APIError` (400 with the offending `param`, 404 for an unknown model),
raised before anything is dispatched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from prfaas.common.tokenizer import Tokenizer, chat_ids
from prfaas.protocol.client_body import Api, ClientBody
from prfaas.protocol.errors import APIError, invalid
from prfaas.protocol.generate import SamplingParams, logit_bias
from prfaas.protocol.openai_chat import chat_prompt

__all__ = [
    "Api", "CompletionCall", "ModelLimits", "OpenAIMode", "chat_body_ids", "check_context",
    "generate_gap",
    "load_json", "parse_call", "parse_sampling", "typed",
]  # fmt: skip
OpenAIMode = Literal["forward", "generate"]
GENERATE_FIELDS = frozenset({
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "min_p", "stop", "seed", "stream", "stream_options", "ignore_eos", "n",
    "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
    "stop_token_ids", "min_tokens", "echo", "logprobs", "top_logprobs",
})  # fmt: skip
"""What the `generate` mode turns into `/generate` sampling (or checks is a no-op)."""
HARMLESS_FIELDS = frozenset({"user", "metadata", "store", "service_tier"})
"""Fields that cannot change an answer: accepted in either mode, as OpenAI servers do."""
GATEWAY_FIELDS = frozenset({"kv_transfer_params", "bootstrap_host", "bootstrap_port",
                            "bootstrap_room", "prefix_pull"})  # fmt: skip
"""The disaggregation fields the gateway writes itself: never taken from a client."""
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
    """The routing ids: the prompt exactly as the engine tokenizes it."""
    sampling: SamplingParams
    """`generate` mode: what the engine samples with. `forward` mode: only the max tokens
    (the engine reads the body)."""
    stream: bool
    include_usage: bool
    body: ClientBody | None = None
    """`forward` mode: the client's body, for the engine's own OpenAI server."""


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


def typed(body: dict[str, Any], key: str, kinds: tuple[type, ...], what: str) -> Any:
    """`body[key]`: None when absent, else one of `kinds` (a boolean only where `bool` is
    one of them). Raises APIError(400) naming `key` for anything else."""
    value = body.get(key)
    if value is None:
        return None
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise invalid(f"'{key}' must be {what}, got {orjson.dumps(value).decode()[:80]}", key)
    return value


def _number(body: dict[str, Any], key: str, lo: float, hi: float, default: float) -> float:
    value = typed(body, key, (int, float), "a number")
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
    value = typed(body, key, (int,), "an integer")
    if value is None:
        return DEFAULT_MAX_TOKENS
    if value < 1:
        raise invalid(f"'{key}' must be >= 1, got {value}", key)
    return int(value)


def generate_gap(body: dict[str, Any]) -> str | None:
    """The first field of `body` that `/generate` sampling cannot express (None when every
    field maps onto it): a field outside `GENERATE_FIELDS`, several sequences, log-
    probabilities, an echo, stream options beyond usage, or a chat turn beyond text."""
    for key in body:
        if key not in GENERATE_FIELDS and key not in HARMLESS_FIELDS:
            return key
    for key in ("n", "best_of"):
        if body.get(key) not in (None, 1):
            return key
    if body.get("echo") not in (None, False):
        return "echo"
    logprobs = body.get("logprobs")
    if logprobs is not None and logprobs is not False:  # completions' 0: the chosen token's
        return "logprobs"
    if body.get("top_logprobs") not in (None, 0):
        return "top_logprobs"
    options = body.get("stream_options")
    if isinstance(options, dict) and set(options) - {"include_usage"}:
        return "stream_options"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):
        return "prompt"  # a batch
    messages = body.get("messages")
    for m in messages if isinstance(messages, list) else ():
        if not isinstance(m, dict) or set(m) - {"role", "content"} or m.get("content") is None:
            return "messages"
    return None


def parse_sampling(body: dict[str, Any]) -> SamplingParams:
    """Sampling parameters from an OpenAI body (extensions: `top_k`, `min_p`,
    `ignore_eos`, `repetition_penalty`, `stop_token_ids`, `min_tokens`)."""
    top_k = typed(body, "top_k", (int,), "an integer")
    if top_k is not None and (top_k == 0 or top_k < -1):
        raise invalid(f"'top_k' must be -1 or >= 1, got {top_k}", "top_k")
    top_p = _number(body, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0:
        raise invalid("'top_p' must be > 0, got 0", "top_p")
    seed = typed(body, "seed", (int,), "an integer")
    return SamplingParams(
        max_new_tokens=_max_tokens(body),
        temperature=_number(body, "temperature", 0.0, 2.0, 1.0),
        top_p=top_p,
        top_k=-1 if top_k is None else top_k,
        min_p=_number(body, "min_p", 0.0, 1.0, 0.0),
        stop=_stop(body),
        ignore_eos=bool(typed(body, "ignore_eos", (bool,), "a boolean")),
        seed=seed,
        stop_token_ids=_token_ids(body, "stop_token_ids"),
        min_new_tokens=typed(body, "min_tokens", (int,), "an integer") or 0,
        repetition_penalty=_number(body, "repetition_penalty", 1e-6, 1e6, 1.0),
        frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0, 0.0),
        presence_penalty=_number(body, "presence_penalty", -2.0, 2.0, 0.0),
        logit_bias=() if body.get("logit_bias") is None else logit_bias(body["logit_bias"]),
    )


def _token_ids(body: dict[str, Any], key: str) -> tuple[int, ...]:
    value = body.get(key)
    if value is None:
        return ()
    if not (isinstance(value, list) and all(type(t) is int and t >= 0 for t in value)):
        raise invalid(f"'{key}' must be a list of token ids", key)
    return tuple(value)


def _prompt_ids(
    body: dict[str, Any], tokenizer: Tokenizer, vocab: int | None, *, batch: bool
) -> list[int]:
    """The prompt's ids; with `batch` (the `forward` mode), a list of several prompts routes
    by its first (the engine runs them all), and a text prompt gets the tokenizer's special
    tokens unless `add_special_tokens` is false, as vLLM tokenizes it."""
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and len(prompt) > 1
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if several and not batch:
            raise invalid("a batch of prompts is not supported by this deployment's engines",
                          "prompt")  # fmt: skip
        prompt = prompt[0]  # a batch (of one, or routed by its first)
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, batch and body.get("add_special_tokens") is not False)
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        bad = [t for t in prompt if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise invalid(f"'prompt' token id {bad[0]} is outside the vocabulary", "prompt")
        return list(prompt)
    raise invalid("'prompt' must be a string, a list of token ids, or a list of one", "prompt")


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = bool(typed(body, "stream", (bool,), "a boolean"))
    options = typed(body, "stream_options", (dict,), "an object") or {}
    usage = typed(options, "include_usage", (bool,), "a boolean")
    return stream, bool(usage)


def parse_call(
    body: dict[str, Any],
    api: Api,
    limits: ModelLimits,
    tokenizer: Tokenizer,
    mode: OpenAIMode = "generate",
    *,
    pd_fields: bool = False,
) -> CompletionCall:
    """Validate and tokenize a request body (the module docstring says what each mode
    checks). The disaggregation fields (`GATEWAY_FIELDS`) are refused unless `pd_fields`
    (the null server, which answers a PD router's requests as if alone).

    Raises:
        APIError: 400 for a missing or wrong-typed field, invalid sampling values, a field
            the mode cannot honour or a prompt over the context; 404 for a model that is
            not served.
    """
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required and must be a string", "model", "missing_model")
    if model != limits.name:
        raise APIError(
            404, f"model {model!r} does not exist", param="model", code="model_not_found"
        )
    given = GATEWAY_FIELDS & body.keys()
    for key in () if pd_fields else sorted(given):
        raise invalid(f"'{key}' is written by the gateway: it is not accepted here", key)
    forward = mode == "forward" or generate_gap({k: v for k, v in body.items()
                                                 if k not in given}) is not None  # fmt: skip
    sampling = SamplingParams(max_new_tokens=_max_tokens(body)) if forward else parse_sampling(body)
    stream, usage = _stream(body)
    if api == "chat":
        ids = chat_body_ids(tokenizer, body)
    else:
        ids = _prompt_ids(body, tokenizer, limits.vocab_size, batch=forward)
    # vLLM's default max tokens is whatever the context leaves: one must fit
    asked = body.get("max_completion_tokens", body.get("max_tokens")) is not None
    check_context(len(ids), sampling.max_new_tokens if asked or not forward else 1, limits)
    forwarded = ClientBody(api, body) if forward else None
    return CompletionCall(api, model, tuple(ids), sampling, stream, usage, forwarded)


def chat_body_ids(tokenizer: Tokenizer, body: dict[str, Any]) -> list[int]:
    """The prompt ids of a chat body (the engine's rendering). Raises APIError(400)."""
    prompt = chat_prompt(body, template=tokenizer.chat_template)
    try:
        return chat_ids(tokenizer, prompt)
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

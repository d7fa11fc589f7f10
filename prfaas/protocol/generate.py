"""SGLang's `/generate` wire format, both ends: the request body (with `sampling_params` and
the PD `bootstrap_*` fields) and the answer object (`text`, `output_ids`, `meta_info`).

The gateway encodes requests (`GenerateRequest.body`) and parses answers (`parse_answer`); the
reference engine and the null server parse requests (`parse_request`) and build answers
(`answer`). Every rejection is an `InvalidRequest` (HTTP 400) naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import Any

import orjson

from prfaas.protocol.client_body import ClientBody
from prfaas.protocol.errors import InvalidRequest

DEFAULT_MAX_NEW_TOKENS = 128
MAX_ROOM = 2**64 - 1
REQUEST_FIELDS = frozenset({
    "text", "input_ids", "sampling_params", "stream", "rid", "bootstrap_host",
    "bootstrap_port", "bootstrap_room", "return_logprob", "data_parallel_rank", "prefix_pull",
})  # fmt: skip
MAX_TOP_LOGPROBS = 20
"""The most alternatives a token's log-probabilities list (vLLM's default `max_logprobs`)."""
MAX_LOGIT_BIAS = 100.0
GREEDY_TEMPERATURE = 1e-5
"""Below this temperature sampling is argmax (vLLM's epsilon: dividing by less overflows)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick output tokens (SGLang's `sampling_params`). `temperature == 0` is
    greedy; `seed` makes sampling reproducible per request regardless of batching.

    The logit processors act in OpenAI's and vLLM's sense, greedy or not: `logit_bias` adds
    to a token's logit; `min_new_tokens` keeps EOS and `stop_token_ids` from being picked
    before that many tokens; `repetition_penalty` divides (positive) or multiplies
    (negative) the logit of every token seen in the prompt or output; `frequency_penalty`
    and `presence_penalty` subtract per occurrence and once, over the output.
    `top_logprobs` is request-level in SGLang's wire format (`return_logprob`,
    `top_logprobs_num`): None for none, else each output token's log-probability under the
    model (before any processor) with that many alternatives.
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    min_new_tokens: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    top_logprobs: int | None = None

    def __post_init__(self) -> None:
        _check(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "must be >= 1")
        _check(math.isfinite(self.temperature) and self.temperature >= 0,
               "temperature", self.temperature, "must be a finite number >= 0")  # fmt: skip
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", self.top_k, "must be -1 or >= 1")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        _check(all(s for s in self.stop), "stop", list(self.stop), "must not contain ''")
        _check(0 <= self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
               self.min_new_tokens, "must be in [0, max_new_tokens]")  # fmt: skip
        _check(math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
               "repetition_penalty", self.repetition_penalty, "must be > 0")  # fmt: skip
        for key in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, key)
            _check(math.isfinite(value) and -2 <= value <= 2, key, value, "must be in [-2, 2]")
        bias_ok = all(t >= 0 and math.isfinite(b) and abs(b) <= MAX_LOGIT_BIAS
                      for t, b in self.logit_bias)  # fmt: skip
        bias_rule = f"must map token ids to biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
        _check(bias_ok, "logit_bias", dict(self.logit_bias), bias_rule)
        top = self.top_logprobs
        _check(top is None or 0 <= top <= MAX_TOP_LOGPROBS, "top_logprobs", top,
               f"must be in [0, {MAX_TOP_LOGPROBS}]")  # fmt: skip

    @property
    def greedy(self) -> bool:
        """Argmax: temperature below `GREEDY_TEMPERATURE` (as vLLM reads it), or top-k 1."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def penalised(self) -> bool:
        """Whether the output so far changes the next token's logits."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)  # fmt: skip

    @property
    def resumable(self) -> bool:
        """Whether another engine, given the prompt plus the output so far as its prompt,
        continues exactly as this one would: not when penalties count the output apart
        from the prompt, nor when a seeded draw depends on the output's position."""
        output_only = self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
        return not output_only and (self.greedy or self.seed is None)

    @classmethod
    def from_json(cls, raw: Any) -> SamplingParams:
        """Parse SGLang's `sampling_params` object; unknown keys and bad types are errors.

        Raises:
            InvalidRequest: naming the offending key and value.
        """
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise InvalidRequest(f"sampling_params must be an object, got {raw!r}")
        raw = dict(raw)
        if "sampling_seed" in raw:  # SGLang's name for the seed
            if raw.get("seed") is not None:
                raise InvalidRequest("give either seed or sampling_seed, not both")
            raw["seed"] = raw.pop("sampling_seed")
        raw.pop("no_stop_trim", None)  # accepted for SGLang compatibility; text is trimmed
        unknown = sorted(set(raw) - _FIELDS)
        if unknown:
            raise InvalidRequest(f"unknown sampling_params field(s): {', '.join(unknown)}")
        return cls(**{k: _coerce(k, v) for k, v in raw.items() if v is not None})

    def continued(self, produced: int) -> SamplingParams:
        """These parameters for the rest of a request that has produced `produced` tokens
        (a migrated request, whose output so far is in its prompt)."""
        left = max(self.max_new_tokens - produced, 1)
        least = min(max(self.min_new_tokens - produced, 0), left)
        return replace(self, max_new_tokens=left, min_new_tokens=least)

    def to_json(self) -> dict[str, object]:
        """SGLang's `sampling_params` object (what `from_json` reads back)."""
        body: dict[str, object] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }
        if self.min_p:
            body["min_p"] = self.min_p
        if self.stop:
            body["stop"] = list(self.stop)
        if self.stop_token_ids:
            body["stop_token_ids"] = list(self.stop_token_ids)
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.seed is not None:
            body["sampling_seed"] = self.seed
        if not self.skip_special_tokens:
            body["skip_special_tokens"] = False
        if self.min_new_tokens:
            body["min_new_tokens"] = self.min_new_tokens
        for key in ("repetition_penalty", "frequency_penalty", "presence_penalty"):
            if getattr(self, key) != _DEFAULTS[key]:
                body[key] = getattr(self, key)
        if self.logit_bias:
            body["logit_bias"] = {str(t): b for t, b in self.logit_bias}
        return body


_FIELDS = frozenset(f.name for f in fields(SamplingParams)) - {"top_logprobs"}
_DEFAULTS = {f.name: f.default for f in fields(SamplingParams)}
_INTS = {"max_new_tokens", "top_k", "seed", "min_new_tokens"}
_FLOATS = {"temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
           "presence_penalty"}  # fmt: skip
_BOOLS = {"ignore_eos", "skip_special_tokens"}


def _coerce(key: str, value: Any) -> Any:
    if key in _BOOLS:
        _check(isinstance(value, bool), key, value, "must be a boolean")
    elif key in _INTS:
        _check(isinstance(value, int) and not isinstance(value, bool), key, value,
               "must be an integer")  # fmt: skip
    elif key in _FLOATS:
        _check(isinstance(value, int | float) and not isinstance(value, bool), key, value,
               "must be a number")  # fmt: skip
        return float(value)
    elif key == "stop":
        items = [value] if isinstance(value, str) else value
        _check(isinstance(items, list) and all(isinstance(s, str) for s in items), key, value,
               "must be a string or a list of strings")  # fmt: skip
        return tuple(items)
    elif key == "stop_token_ids":
        _check(isinstance(value, list) and all(type(t) is int for t in value), key, value,
               "must be a list of integers")  # fmt: skip
        return tuple(value)
    elif key == "logit_bias":
        return logit_bias(value, key)
    return value


def logit_bias(value: Any, key: str = "logit_bias") -> tuple[tuple[int, float], ...]:
    """An OpenAI / SGLang `logit_bias` object (token id as a string -> bias) as sorted
    pairs. Raises InvalidRequest naming `key` for anything else."""
    ok = isinstance(value, Mapping) and all(
        isinstance(t, str) and t.isdigit() and type(b) in (int, float) for t, b in value.items()
    )
    _check(ok, key, value, "must map token ids (as strings) to numbers")
    return tuple(sorted((int(t), float(b)) for t, b in value.items()))


def _check(ok: bool, key: str, value: Any, rule: str) -> None:
    if not ok:
        raise InvalidRequest(f"sampling_params.{key} {rule}, got {value!r}", key)


@dataclass(frozen=True)
class Bootstrap:
    """SGLang's PD fields: where the decode instance fetches the prefill's KV (the prefill's
    bootstrap address) and the room that names this request's transfer."""

    host: str
    port: int
    room: int


@dataclass(frozen=True)
class GenerateRequest:
    """One request to an engine: a `/generate` call, or, with `client_body`, the client's
    body for the engine's own API route (the engine client renders its engine's body
    from it). In SGLang's PD protocol the same request (one bootstrap room) goes to the
    prefill and the decode instance at once. `input_ids` are the routing ids either way."""

    rid: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = True
    bootstrap: Bootstrap | None = None
    prefix_pull: Bootstrap | None = None
    """PrfaaS extension, for engines that say `prefix_pull` in `/server_info`: before the
    prefill, fetch the prompt's cached prefix from this room, which the engine at that
    bootstrap address fills (`POST /kv/export`)."""
    prefix_tokens: int = 0
    """With `prefix_pull`: the prefix's length as the gateway's KV index has it at the source
    (vLLM engines allocate blocks for it before the transfer begins; reference engines take
    whatever arrives). Not part of `/generate` bodies."""
    client_body: ClientBody | None = None
    """The client's body, when the engine's own API route answers it."""

    @cached_property
    def body(self) -> bytes:
        """The JSON body, encoded on first use (the prefill and the decode call of a request
        send the same one)."""
        body: dict[str, Any] = {
            "rid": self.rid,
            "input_ids": self.input_ids,  # a tuple: orjson writes it as an array, no copy
            "sampling_params": self.sampling.to_json(),
            "stream": self.stream,
            **self.pd_fields(),
        }
        return orjson.dumps(body)

    def pd_fields(self) -> dict[str, Any]:
        """SGLang's PD fields (`bootstrap_*`) and PrfaaS's `prefix_pull`, where set, as the
        keys of a `/generate` or an OpenAI body."""
        fields: dict[str, Any] = {}
        if self.bootstrap is not None:
            boot = self.bootstrap
            fields.update(bootstrap_host=boot.host, bootstrap_port=boot.port,
                          bootstrap_room=boot.room)  # fmt: skip
        if self.prefix_pull is not None:
            pull = self.prefix_pull
            fields["prefix_pull"] = {"host": pull.host, "port": pull.port, "room": pull.room}
        return fields


def parse_request(
    body: Any, encode: Callable[[str], list[int]], new_rid: Callable[[], str]
) -> GenerateRequest:
    """Validate a decoded `/generate` body; `text` is tokenized with `encode`, a missing
    `rid` drawn from `new_rid`.

    Raises:
        InvalidRequest: unknown fields, wrong types, missing or duplicate prompt.
    """
    if not isinstance(body, Mapping):
        raise InvalidRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - REQUEST_FIELDS)
    if unknown:
        raise InvalidRequest(f"unknown field(s): {', '.join(unknown)}")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise InvalidRequest("exactly one of text and input_ids is required")
    if text is not None and not isinstance(text, str):
        raise InvalidRequest("text must be a string (batched requests are not supported)", "text")
    if ids is not None and not (isinstance(ids, list) and all(type(t) is int for t in ids)):
        raise InvalidRequest("input_ids must be a list of integers", "input_ids")
    if body.get("return_logprob"):
        raise InvalidRequest("return_logprob is not supported", "return_logprob")
    stream, rid = body.get("stream", False), body.get("rid")
    if not isinstance(stream, bool):
        raise InvalidRequest(f"stream must be a boolean, got {stream!r}", "stream")
    if rid is not None and not isinstance(rid, str):
        raise InvalidRequest(f"rid must be a string, got {rid!r}", "rid")
    sampling = SamplingParams.from_json(body.get("sampling_params"))
    prompt = tuple(ids) if ids is not None else tuple(encode(text or ""))
    bootstrap, prefix_pull = _bootstrap(body), pd_prefix_pull(body)
    return GenerateRequest(rid or new_rid(), prompt, sampling, stream, bootstrap, prefix_pull)


_PD = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def pd_prefix_pull(body: Mapping[str, Any]) -> Bootstrap | None:
    """A request body's `prefix_pull` (`{"host", "port", "room"}`), or None.

    Raises:
        InvalidRequest: any other shape.
    """
    pull = body.get("prefix_pull")
    if pull is None:
        return None
    if not (isinstance(pull, Mapping) and set(pull) == set(_PULL)):
        raise InvalidRequest('prefix_pull must be {"host", "port", "room"}', "prefix_pull")
    return _bootstrap(pull, _PULL, "prefix_pull.")


def pd_bootstrap(body: Mapping[str, Any]) -> Bootstrap | None:
    """SGLang's PD fields of a request body (`bootstrap_host`, `bootstrap_port`,
    `bootstrap_room`: all three or none) as a `Bootstrap`.

    Raises:
        InvalidRequest: some but not all of them, or a malformed one.
    """
    return _bootstrap(body)


_PULL = ("host", "port", "room")


def _bootstrap(
    body: Mapping[str, Any], names: tuple[str, str, str] = _PD, label: str = ""
) -> Bootstrap | None:
    """A transport address and room (the PD fields by default), all three or none."""
    host, port, room = (body.get(k) for k in names)
    if host is None and port is None and room is None:
        return None
    h, p, r = (label + name for name in names)
    if not isinstance(host, str) or not host:
        raise InvalidRequest(f"{h} must be a non-empty string, got {host!r}")
    if type(port) is not int or not 0 < port < 65536:
        raise InvalidRequest(f"{p} must be an integer in 1..65535, got {port!r}")
    if type(room) is not int or not 0 <= room <= MAX_ROOM:
        raise InvalidRequest(f"{r} must be an integer in 0..2^64-1, got {room!r}")
    return Bootstrap(host, port, room)


@dataclass(frozen=True)
class GenerateChunk:
    """A piece of output: new token ids and text since the previous chunk.

    `finish_reason` is set on the last chunk ("stop", "length", "abort").
    Token counts are the engine's own (`meta_info`, or an OpenAI answer's `usage`),
    cumulative.
    """

    token_ids: tuple[int, ...]
    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    finish_reason: str | None = None
    raw: bytes | None = None
    """An engine's own API answer (a whole JSON body, or one SSE event's data), relayed to
    the client as written; empty for an event only the gateway's accounting asked for (not
    relayed)."""
    event: str | None = None
    """The SSE event name of a relayed event, for the APIs whose streams name their events
    (Anthropic Messages, OpenAI Responses)."""


def answer(
    *, rid: str, text: str, output_ids: list[int], finish_reason: dict[str, object] | None,
    prompt_tokens: int, cached_tokens: int, e2e_latency: float,
) -> dict[str, Any]:  # fmt: skip
    """SGLang's `/generate` answer object (also each stream chunk, cumulative)."""
    return {
        "text": text,
        "output_ids": output_ids,
        "meta_info": {
            "id": rid,
            "finish_reason": finish_reason,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(output_ids),
            "cached_tokens": cached_tokens,
            "e2e_latency": e2e_latency,
        },
    }


class AnswerError(ValueError):
    """An answer object that is not SGLang's shape, or that reports an engine error."""


def parse_answer(obj: Any) -> GenerateChunk:
    """One `/generate` answer object (whole, or a cumulative stream chunk) as a chunk with
    all of its text and ids.

    Raises:
        AnswerError: not an object, an `error` object, or fields of the wrong type.
    """
    if not isinstance(obj, dict):
        raise AnswerError(f"an answer must be a JSON object, got {str(obj)[:80]}")
    if "error" in obj:
        raise AnswerError(f"engine reported an error: {str(obj['error'])[:300]}")
    meta = obj.get("meta_info")
    meta = {} if meta is None else meta
    if not isinstance(meta, dict):
        raise AnswerError(f"meta_info must be an object, got {str(meta)[:80]}")
    try:
        ids = tuple(map(int, obj.get("output_ids") or ()))
        finish = meta.get("finish_reason")
        reason = finish.get("type") if isinstance(finish, dict) else finish
        return GenerateChunk(
            ids,
            str(obj.get("text") or ""),
            int(meta.get("prompt_tokens") or 0),
            int(meta.get("completion_tokens") or len(ids)),
            int(meta.get("cached_tokens") or 0),
            str(reason) if reason is not None else None,
        )
    except (TypeError, ValueError, AttributeError) as exc:
        raise AnswerError(f"malformed answer object: {exc}") from None

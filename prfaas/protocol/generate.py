"""Parsing and validation of SGLang's `/generate` body, and its JSON / stream output."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prfaas.engines.reference.server.service import Bootstrap
from prfaas.engines.reference.step.sampling import InvalidRequest, SamplingParams

GENERATE_FIELDS = frozenset({
    "text", "input_ids", "sampling_params", "stream", "rid", "bootstrap_host",
    "bootstrap_port", "bootstrap_room", "return_logprob", "data_parallel_rank",
})  # fmt: skip
MAX_ROOM = 2**64 - 1


@dataclass(frozen=True)
class GenerateInput:
    """A validated `/generate` request (text is tokenized by the caller)."""

    text: str | None
    input_ids: list[int] | None
    params: SamplingParams
    stream: bool
    rid: str | None
    bootstrap: Bootstrap | None


def parse_generate(body: Any) -> GenerateInput:
    """Validate a decoded JSON body.

    Raises:
        InvalidRequest: unknown fields, wrong types, missing or duplicate prompt.
    """
    if not isinstance(body, Mapping):
        raise InvalidRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - GENERATE_FIELDS)
    if unknown:
        raise InvalidRequest(f"unknown field(s): {', '.join(unknown)}")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise InvalidRequest("exactly one of text and input_ids is required")
    if text is not None and not isinstance(text, str):
        raise InvalidRequest("text must be a string (batched requests are not supported)")
    if ids is not None and not (isinstance(ids, list) and all(type(t) is int for t in ids)):
        raise InvalidRequest("input_ids must be a list of integers")
    if body.get("return_logprob"):
        raise InvalidRequest("return_logprob is not supported")
    stream, rid = body.get("stream", False), body.get("rid")
    if not isinstance(stream, bool):
        raise InvalidRequest(f"stream must be a boolean, got {stream!r}")
    if rid is not None and not isinstance(rid, str):
        raise InvalidRequest(f"rid must be a string, got {rid!r}")
    params = SamplingParams.from_json(body.get("sampling_params"))
    return GenerateInput(text, ids, params, stream, rid, parse_bootstrap(body))


def parse_bootstrap(body: Mapping[str, Any]) -> Bootstrap | None:
    """The PD fields, all three or none.

    Raises:
        InvalidRequest: partial or mistyped fields.
    """
    host, port, room = (body.get(k) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room"))
    if host is None and port is None and room is None:
        return None
    if not isinstance(host, str) or not host:
        raise InvalidRequest(f"bootstrap_host must be a non-empty string, got {host!r}")
    if type(port) is not int or not 0 < port < 65536:
        raise InvalidRequest(f"bootstrap_port must be an integer in 1..65535, got {port!r}")
    if type(room) is not int or not 0 <= room <= MAX_ROOM:
        raise InvalidRequest(f"bootstrap_room must be an integer in 0..2^64-1, got {room!r}")
    return Bootstrap(host, port, room)


def generate_json(
    *, rid: str, text: str, output_ids: list[int], finish_reason: dict[str, object] | None,
    prompt_tokens: int, cached_tokens: int, e2e_latency: float,
) -> dict[str, Any]:  # fmt: skip
    """SGLang's `/generate` result object (also each stream chunk, cumulative)."""
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

"""Sampling parameters (SGLang's `sampling_params`) and token selection from logits."""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

DEFAULT_MAX_NEW_TOKENS = 128


class InvalidRequest(ValueError):
    """A request field has a bad value; the message names it (becomes an HTTP 400)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick output tokens. `temperature == 0` is greedy; `seed` makes sampling
    reproducible per request regardless of batching."""

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

    def __post_init__(self) -> None:
        _check(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "must be >= 1")
        _check(math.isfinite(self.temperature) and self.temperature >= 0,
               "temperature", self.temperature, "must be a finite number >= 0")  # fmt: skip
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", self.top_k, "must be -1 or >= 1")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        _check(all(s for s in self.stop), "stop", list(self.stop), "must not contain ''")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

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
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InvalidRequest(f"unknown sampling_params field(s): {', '.join(unknown)}")
        values = {k: _coerce(k, v) for k, v in raw.items() if v is not None}
        return cls(**values)


_INTS = {"max_new_tokens", "top_k", "seed"}
_FLOATS = {"temperature", "top_p", "min_p"}
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
    return value


def _check(ok: bool, key: str, value: Any, rule: str) -> None:
    if not ok:
        raise InvalidRequest(f"sampling_params.{key} {rule}, got {value!r}")


def resolve_seed(params: SamplingParams) -> int:
    """The request's sampling seed: the given one, else a fresh random one."""
    return params.seed if params.seed is not None else secrets.randbits(63)


def sample(logits: torch.Tensor, params: SamplingParams, seed: int, step: int) -> int:
    """Pick output token number `step` from float32 `logits` (vocab,) under `params`.

    Randomness comes from (seed, step) alone, so a seeded request samples the same tokens
    whether it is batched or not, and whether its first token came from a prefill engine.
    """
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_k > 0:
        kth = torch.topk(probs, min(params.top_k, probs.numel())).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = torch.cumsum(sorted_p, dim=-1) - sorted_p > params.top_p * sorted_p.sum()
        probs = probs.scatter(0, order[drop], 0.0)
    if params.min_p > 0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step) % 2**63)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))

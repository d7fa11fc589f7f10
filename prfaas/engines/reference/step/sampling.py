"""Token selection from logits under SGLang's sampling parameters (defined once, in
`prfaas.protocol.generate`): the logit processors, an optional grammar, the draw, and the
chosen token's log-probabilities.

Order, as vLLM applies them: the grammar's mask (on the logits the sampler gets), then
`logit_bias`, the minimum-tokens mask, the penalties, temperature / top-k / top-p / min-p
and the draw. Log-probabilities are taken where vLLM's default `raw_logprobs` takes them:
after the grammar's mask, before every other processor (a forbidden token's -inf reads
-9999.0, as vLLM writes it).
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from prfaas.protocol.generate import SamplingParams

LOGPROB_FLOOR = -9999.0
"""What an impossible token's log-probability reads (vLLM's clamp of -inf)."""


class NoTokenLeft(ValueError):
    """Every token is ruled out (a grammar with `min_tokens` or `stop_token_ids` over what
    it allows, say): the request cannot go on."""


class Constraint(Protocol):
    """A grammar over one sequence's output (`constraint.TokenConstraint`)."""

    def mask_(self, logits: torch.Tensor) -> None:
        """Set the logits of tokens the grammar forbids next to -inf, in place."""

    def accept(self, token: int) -> None:
        """Advance past `token`."""

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing may follow."""
        ...


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log-probability and the `top` most likely alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Choice:
    """One sampled token, with its log-probabilities when the request asked for them."""

    token: int
    logprob: TokenLogprob | None = None


def resolve_seed(params: SamplingParams) -> int:
    """The request's sampling seed: the given one, else a fresh random one."""
    return params.seed if params.seed is not None else secrets.randbits(63)


def choose(
    logits: torch.Tensor,
    params: SamplingParams,
    seed: int,
    context: tuple[Sequence[int], Sequence[int]],
    eos_token_id: int | None,
    constraint: Constraint | None = None,
) -> Choice:
    """Output token number `len(output)` from float32 `logits` (vocab,), where `context` is
    (prompt, output so far), and advance `constraint` past it.

    Raises:
        NoTokenLeft: the grammar and the processors together allow no token.
    """
    prompt, output = context
    if constraint is not None:
        logits = logits.clone()
        constraint.mask_(logits)
    raw = logits
    if params.logit_bias or params.penalised or len(output) < params.min_new_tokens:
        logits = logits.clone()
        processed(logits, params, prompt, output, eos_token_id)
    if not bool(torch.isfinite(logits).any()):
        raise NoTokenLeft("the output grammar and min_tokens / stop_token_ids leave no token")
    token = sample(logits, params, seed, len(output))
    if constraint is not None:
        constraint.accept(token)
    if params.top_logprobs is None:
        return Choice(token)
    return Choice(token, token_logprob(raw, token, params.top_logprobs))


def processed(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],
    eos_token_id: int | None,
) -> None:
    """Apply the logit processors of `params` to `logits`, in place."""
    for token, bias in params.logit_bias:
        if token < logits.numel():
            logits[token] += bias
    if len(output) < params.min_new_tokens:
        held = [*params.stop_token_ids, *([] if eos_token_id is None else [eos_token_id])]
        for token in held:
            if 0 <= token < logits.numel():
                logits[token] = float("-inf")
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(
            sorted(set(prompt) | set(output)), dtype=torch.long, device=logits.device
        )
        values = logits[seen]
        p = params.repetition_penalty
        logits[seen] = torch.where(values > 0, values / p, values * p)
    if output and (params.frequency_penalty or params.presence_penalty):
        counts = Counter(output)
        ids = torch.tensor(list(counts), dtype=torch.long, device=logits.device)
        n = torch.tensor(list(counts.values()), dtype=logits.dtype, device=logits.device)
        logits[ids] -= params.frequency_penalty * n + params.presence_penalty


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`token`'s log-probability under `logits` and the `top` most likely tokens'."""
    logprobs = torch.log_softmax(logits.float(), dim=-1).clamp(min=LOGPROB_FLOOR)
    best = torch.topk(logprobs, top) if top else None
    pairs = (
        ()
        if best is None
        else tuple((int(i), float(v)) for v, i in zip(best.values, best.indices, strict=True))
    )
    return TokenLogprob(token, float(logprobs[token]), pairs)


def sample(logits: torch.Tensor, params: SamplingParams, seed: int, step: int) -> int:
    """Pick output token number `step` from float32 `logits` (vocab,) under `params`.

    Randomness comes from (seed, step) alone, so a seeded request samples the same tokens
    whether it is batched or not, and whether its first token came from a prefill engine
    (on one kind of device: the generator is the logits' device's).
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
    gen = torch.Generator(logits.device).manual_seed((seed * 1_000_003 + step) % 2**63)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))

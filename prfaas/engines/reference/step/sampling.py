"""Token selection from logits under SGLang's sampling parameters (defined once, in
`prfaas.protocol.generate`)."""

from __future__ import annotations

import secrets

import torch

from prfaas.protocol.generate import SamplingParams


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

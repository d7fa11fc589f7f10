"""Helpers shared by the reference engine tests: the transformers reference and prompts."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel


def hf_greedy(model: PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    """Plain `transformers` greedy generation of n tokens (EOS ignored): the reference."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=model.config.pad_token_id,
    )
    return [int(t) for t in out[0, len(prompt) :]]


def random_prompt(seed: int, length: int, vocab: int = 256) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, vocab, (length,), generator=gen)]

"""Synthetic prompt tokens: random runs, hash-id blocks for trace replay, and a text rendering.

Token ids are drawn from `[TokenSpace.lowest, TokenSpace.vocab_size)`; the lower ids are left
out because most tokenizers keep their special tokens there. Text prompts (for the chat API)
are the same ids written as pseudo-words, one word per id, so equal id runs give equal text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

TokenArray = NDArray[np.int64]

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "ch", "sh")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou", "ea")
_SYLLABLES = tuple(o + v for o in _ONSETS for v in _VOWELS)  # 128 distinct syllables


@dataclass(frozen=True)
class TokenSpace:
    """Which token ids synthetic prompts use."""

    vocab_size: int = 10_000
    """Ids are < vocab_size; keep it at most the target model's vocabulary."""
    lowest: int = 100
    """Smallest id used; ids below it (often special tokens) never appear."""

    def __post_init__(self) -> None:
        if self.lowest < 0:
            raise ValueError(f"lowest token id must be >= 0, got {self.lowest}")
        if self.vocab_size <= self.lowest + 1:
            raise ValueError(
                f"vocab_size must exceed lowest + 1, got vocab_size={self.vocab_size}, "
                f"lowest={self.lowest}"
            )

    def random(self, rng: np.random.Generator, n: int) -> TokenArray:
        """`n` independent uniform token ids."""
        return rng.integers(self.lowest, self.vocab_size, size=n, dtype=np.int64)

    def block(self, hash_id: int, seed: int, size: int) -> TokenArray:
        """The `size` tokens of trace block `hash_id`: a pure function of (hash_id, seed).

        Equal hash ids give equal blocks; different ids give independent random blocks, so
        two different ids collide only with probability vocab**-size.
        """
        rng = np.random.Generator(np.random.PCG64([seed, hash_id, 0x6D6F6F6E]))
        return self.random(rng, size)


def render_text(tokens: TokenArray) -> str:
    """Token ids as space-separated pseudo-words (one word per id, distinct ids distinct)."""
    words = []
    n_syl = len(_SYLLABLES)
    for tok in tokens.tolist():
        word = _SYLLABLES[tok % n_syl]
        rest = tok // n_syl
        while rest:
            word += _SYLLABLES[rest % n_syl]
            rest //= n_syl
        words.append(word)
    return " ".join(words)

"""Byte-level tokenizer: the fallback when a checkpoint ships no `tokenizer.json`.

Ids 0-255 are the bytes of the UTF-8 text; a few special ids follow. Decoding drops special
ids and any id at or above `vocab_size`'s byte range, and replaces invalid UTF-8, so every id a
model can emit decodes to some text. The same class serves the gateway and the engines, so both
agree on token ids without loading anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

BYTE_VOCAB = 256


@dataclass(frozen=True)
class ChatMessage:
    """One chat turn: `role` (system, user, assistant, ...) and its text."""

    role: str
    content: str


class ByteTokenizer:
    """UTF-8 bytes as token ids, plus `bos`, `eos` and `pad` specials."""

    name = "byte-level"
    bos_token_id = BYTE_VOCAB
    eos_token_id = BYTE_VOCAB + 1
    pad_token_id = BYTE_VOCAB + 2
    vocab_size = BYTE_VOCAB + 4  # one spare id, reserved

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no specials added)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; specials and ids outside the byte range decode to nothing."""
        return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[ChatMessage]) -> list[int]:
        """A minimal chat format: `<|role|>\\ncontent\\n` per turn, then `<|assistant|>\\n`."""
        text = "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages) + "<|assistant|>\n"
        return [self.bos_token_id, *self.encode(text)]

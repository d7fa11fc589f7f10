"""Tokenizers the gateway can use: the byte-level one the reference engine shares, or a
model's own `tokenizer.json` (with its chat template) loaded through `transformers`.

The gateway tokenizes every prompt itself because routing needs token ids: block hashes,
cached prefixes and the incremental length are all counted in the engine's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from prfaas.common.tokenizer import ByteTokenizer, ChatMessage

BYTE_LEVEL = "byte-level"


class GatewayTokenizer(Protocol):
    """What the gateway needs from a tokenizer."""

    name: str

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens skipped."""
        ...

    def apply_chat_template(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Token ids of a chat, ending with the assistant's generation prompt."""
        ...


class HFTokenizer:
    """A checkpoint directory's `tokenizer.json` and chat template via `transformers`."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        directory = Path(path)
        if not (directory / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer directory {str(directory)!r} has no tokenizer.json")
        self._tok: Any = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        self.name = str(directory)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def apply_chat_template(self, messages: Sequence[ChatMessage]) -> list[int]:
        turns = [{"role": m.role, "content": m.content} for m in messages]
        if getattr(self._tok, "chat_template", None) is None:
            raise ValueError(f"tokenizer {self.name!r} has no chat template")
        text = self._tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        return list(self._tok.encode(text, add_special_tokens=False))


def create_tokenizer(spec: str) -> GatewayTokenizer:
    """`"byte-level"` or a directory holding `tokenizer.json`.

    Raises:
        ValueError: the directory has no `tokenizer.json`, or it cannot be loaded.
    """
    if spec == BYTE_LEVEL:
        return ByteTokenizer()
    return HFTokenizer(spec)

"""The engine's tokenizer: the checkpoint's `tokenizer.json` when present, else byte-level."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from prfaas.common.tokenizer import ByteTokenizer, ChatMessage


class EngineTokenizer(Protocol):
    """What the HTTP layer needs from a tokenizer."""

    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: Sequence[ChatMessage]) -> list[int]: ...


class JsonTokenizer:
    """A Hugging Face `tokenizer.json` through the `tokenizers` library; chat turns use the
    same minimal template as the byte tokenizer (checkpoint Jinja templates are not run)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        self.name = f"tokenizer.json ({path.parent.name})"

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def apply_chat_template(self, messages: Sequence[ChatMessage]) -> list[int]:
        text = "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages) + "<|assistant|>\n"
        return self.encode(text)


def load_tokenizer(model_dir: Path) -> EngineTokenizer:
    """`tokenizer.json` of the checkpoint if there is one, else `ByteTokenizer`."""
    path = model_dir / "tokenizer.json"
    return JsonTokenizer(path) if path.is_file() else ByteTokenizer()

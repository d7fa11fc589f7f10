"""A conversation's history and how it becomes a prompt for each API."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from prfaas.loadgen.tokens import TokenArray, render_text

Role = Literal["user", "assistant"]


@dataclass
class Conversation:
    """Messages so far; each is token ids (what we generated) or text (a server's answer).

    Mutated by `add`; one conversation belongs to one session task.
    """

    messages: list[tuple[Role, TokenArray | str]] = field(default_factory=list)

    def add(self, role: Role, content: TokenArray | str) -> None:
        """Append one message."""
        self.messages.append((role, content))

    def token_ids(self) -> TokenArray | None:
        """The whole history as one id list, or None if any part is only known as text."""
        parts = [c for _, c in self.messages]
        if any(isinstance(p, str) for p in parts):
            return None
        return np.concatenate(parts)

    def text(self) -> str:
        """The whole history as one text prompt (messages joined by a space)."""
        return " ".join(_text(c) for _, c in self.messages)

    def chat_messages(self) -> list[dict[str, str]]:
        """OpenAI chat messages."""
        return [{"role": role, "content": _text(c)} for role, c in self.messages]

    def sent_tokens(self) -> int:
        """Our own count of prompt tokens: ids, plus one per word of text parts."""
        return sum(len(c) if not isinstance(c, str) else len(c.split()) for _, c in self.messages)


def _text(content: TokenArray | str) -> str:
    return content if isinstance(content, str) else render_text(content)

"""Tokenizers: one protocol, one chat-template rule, for the gateway and the engines alike.

The gateway tokenizes every prompt itself (routing counts cached prefixes in the engine's
tokens), and an engine serving its own OpenAI route tokenizes too: both load the tokenizer
through `load_tokenizer`, so the same chat gives the same token ids by either route.

- `ByteTokenizer`: UTF-8 bytes as ids 0-255 plus a few specials, the fallback when a
  checkpoint ships no `tokenizer.json` (the reference engine's tiny presets).
- `HFTokenizer`: a checkpoint directory's `tokenizer.json` through the `tokenizers` library,
  with the chat template and special tokens of its `tokenizer_config.json` (or
  `chat_template.jinja`). No `transformers`: a gateway need not install it.

The chat-template rule (`chat_ids`): a checkpoint's own Jinja template is rendered the way
`transformers` renders it (sandboxed Jinja, `trim_blocks`/`lstrip_blocks`, the special
tokens as variables, the generation prompt on) and encoded with special tokens recognised,
adding nothing it did not render; without one, the minimal template
`<|role|>\\ncontent\\n ... <|assistant|>\\n` is encoded after the tokenizer's BOS id, if any.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

BYTE_LEVEL = "byte-level"
BYTE_VOCAB = 256


@dataclass(frozen=True)
class ChatMessage:
    """One chat turn: `role` (system, user, assistant, ...) and its text."""

    role: str
    content: str


class Tokenizer(Protocol):
    """What the gateway and the engines need from a tokenizer."""

    name: str
    bos_token_id: int | None
    eos_token_id: int | None
    chat_template: str | None
    """The checkpoint's Jinja chat template, if it has one."""

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added (special-token text is recognised
        where the tokenizer has such tokens)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens skipped."""
        ...

    def template_variables(self) -> dict[str, Any]:
        """The special tokens a chat template may use (`bos_token`, `eos_token`, ...)."""
        ...


def minimal_chat(messages: Sequence[ChatMessage]) -> str:
    """The built-in chat format for tokenizers without a template."""
    return "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages) + "<|assistant|>\n"


def chat_ids(tokenizer: Tokenizer, messages: Sequence[ChatMessage]) -> list[int]:
    """Token ids of a chat, ending with the assistant's generation prompt (the module
    docstring states the rule).

    Raises:
        ValueError: the checkpoint's template failed to render (its message says why).
    """
    if tokenizer.chat_template is None:
        head = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
        return head + tokenizer.encode(minimal_chat(messages))
    return tokenizer.encode(render_template(tokenizer, messages))


def render_template(tokenizer: Tokenizer, messages: Sequence[ChatMessage]) -> str:
    """Render `tokenizer.chat_template` for `messages` as `transformers` does."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    try:
        template = env.from_string(tokenizer.chat_template or "")
        return template.render(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=True,
            **tokenizer.template_variables(),
        )
    except TemplateError as exc:
        raise ValueError(f"the chat template of {tokenizer.name} failed: {exc}") from None


class ByteTokenizer:
    """UTF-8 bytes as token ids, plus `bos`, `eos` and `pad` specials.

    Decoding drops special ids and any id outside the byte range and replaces invalid UTF-8,
    so every id a model can emit decodes to some text.
    """

    name = BYTE_LEVEL
    bos_token_id: int | None = BYTE_VOCAB
    eos_token_id: int | None = BYTE_VOCAB + 1
    pad_token_id = BYTE_VOCAB + 2
    vocab_size = BYTE_VOCAB + 4  # one spare id, reserved
    chat_template: str | None = None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no specials added)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; specials and ids outside the byte range decode to nothing."""
        return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")

    def template_variables(self) -> dict[str, Any]:
        return {}


class HFTokenizer:
    """A checkpoint directory's `tokenizer.json`, special tokens and chat template."""

    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        path = Path(directory)
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer directory {str(path)!r} has no tokenizer.json")
        try:
            self._tok = RustTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # the library raises its own exception types
            raise ValueError(f"cannot load {path / 'tokenizer.json'}: {exc}") from None
        self.name = str(path)
        config = _read_json(path / "tokenizer_config.json")
        self._special = {
            key: _token_text(config.get(key))
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        # As transformers does at load: the config's special tokens are matched as whole
        # tokens in text (an existing vocabulary entry keeps its id).
        extra = [_token_text(t) for t in config.get("additional_special_tokens") or ()]
        specials = [t for t in (*self._special.values(), *extra) if t is not None]
        self._tok.add_special_tokens(specials)
        self.bos_token_id = self._id(self._special["bos_token"])
        self.eos_token_id = self._id(self._special["eos_token"])
        self.chat_template = _chat_template(path, config)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def template_variables(self) -> dict[str, Any]:
        return {k: v for k, v in self._special.items() if v is not None}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as `tokenizer_config.json` gives it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """`chat_template.jinja` if present, else the config's `chat_template` (a string, or a
    list of named templates of which `default` is the one used)."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """`"byte-level"`, or a checkpoint directory holding `tokenizer.json`.

    Raises:
        ValueError: the directory has no `tokenizer.json`, or it cannot be loaded.
    """
    if str(spec) == BYTE_LEVEL:
        return ByteTokenizer()
    return HFTokenizer(spec)

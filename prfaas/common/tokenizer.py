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
tokens as variables, then the tools, the generation prompt or the continued final message,
and the request's template kwargs) and encoded with special tokens recognised, adding
nothing it did not render; without one, the minimal template
`<|role|>\\ncontent\\n ... <|assistant|>\\n` (`BUILTIN_TEMPLATE`, with Hermes-style tools) is
encoded after the tokenizer's BOS id, if any.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from jinja2 import Template

BYTE_LEVEL = "byte-level"
BYTE_VOCAB = 256


@dataclass(frozen=True)
class ChatMessage:
    """One chat turn: `role` (system, user, assistant, ...) and its text."""

    role: str
    content: str


@dataclass(frozen=True, eq=False)
class ChatPrompt:
    """Everything a chat template renders: the messages as the template sees them (dicts
    with `role`, `content` and, where given, `tool_calls`, `tool_call_id`, `name`), the
    tools, and the generation options (`prfaas.protocol.openai_chat` builds it from an
    OpenAI body)."""

    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """End the prompt inside the last (assistant) message, for the model to continue it."""
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Extra template variables (`chat_template_kwargs`, e.g. `enable_thinking`)."""

    @classmethod
    def of(cls, messages: Sequence[ChatMessage]) -> ChatPrompt:
        return cls([{"role": m.role, "content": m.content} for m in messages])


class Tokenizer(Protocol):
    """What the gateway and the engines need from a tokenizer."""

    name: str
    bos_token_id: int | None
    eos_token_id: int | None
    chat_template: str | None
    """The checkpoint's Jinja chat template, if it has one."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`: the tokenizer's own special tokens (a BOS its post-processor
        adds) only with `add_special_tokens`, as vLLM's completions tokenize by default;
        special-token text is recognised where the tokenizer has such tokens."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens skipped."""
        ...

    def template_variables(self) -> dict[str, Any]:
        """The special tokens a chat template may use (`bos_token`, `eos_token`, ...)."""
        ...


BUILTIN_TEMPLATE = (
    '{% if tools %}<|system|>\n# Tools\nCall a function as <tool_call>{"name": NAME, '
    "\"arguments\": {...}}</tool_call>. Functions:{% for tool in tools %}{{ '\\n' }}"
    "{{ tool | tojson }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "<|tool|>\n<tool_response>\n{{ m['content'] }}\n</tool_response>\n"
    "{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% for call in m['tool_calls'] or [] %}<tool_call>\n{\"name\": "
    "{{ call['function']['name'] | tojson }}, \"arguments\": "
    "{{ call['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}{{ '\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""The built-in chat format for tokenizers without a template: `<|role|>\ncontent\n` per
turn and `<|assistant|>\n` to generate, with Hermes-style tools (the tools in a system
block, an assistant's calls as `<tool_call>` JSON, tool results in `<tool_response>`), which
the reference engine's tool-call parser reads back."""


def minimal_chat(messages: Sequence[ChatMessage]) -> str:
    """The built-in chat format of plain text turns (what `BUILTIN_TEMPLATE` renders)."""
    return "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages) + "<|assistant|>\n"


def chat_ids(tokenizer: Tokenizer, chat: ChatPrompt | Sequence[ChatMessage]) -> list[int]:
    """Token ids of a chat (the module docstring states the rule).

    Raises:
        ValueError: the template failed to render (its message says why).
    """
    prompt = chat if isinstance(chat, ChatPrompt) else ChatPrompt.of(chat)
    if tokenizer.chat_template is None:
        head = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
        return head + tokenizer.encode(render_template(tokenizer, prompt, BUILTIN_TEMPLATE))
    return tokenizer.encode(render_template(tokenizer, prompt))


def render_template(
    tokenizer: Tokenizer, chat: ChatPrompt | Sequence[ChatMessage], template: str | None = None
) -> str:
    """Render `template` (default: `tokenizer.chat_template`) for `chat` as `transformers`
    does."""
    from jinja2 import TemplateError

    prompt = chat if isinstance(chat, ChatPrompt) else ChatPrompt.of(chat)
    messages = [dict(m) for m in prompt.messages]
    if prompt.continue_final_message:
        messages[-1] = _tagged(messages[-1])
    variables = {**tokenizer.template_variables(), **prompt.template_kwargs}
    try:
        compiled = _compiled(template or tokenizer.chat_template or "")
        rendered = compiled.render(
            messages=messages,
            tools=None if prompt.tools is None else [dict(t) for t in prompt.tools],
            documents=variables.pop("documents", None),
            add_generation_prompt=prompt.add_generation_prompt,
            **variables,
        )
    except TemplateError as exc:
        raise ValueError(f"the chat template of {tokenizer.name} failed: {exc}") from None
    return _continued(rendered) if prompt.continue_final_message else rendered


@lru_cache(maxsize=32)
def _compiled(source: str) -> Template:
    """A chat template compiled once (compiling took milliseconds per request: more than
    the rest of a chat request's routing) in `transformers`' sandboxed environment.

    Raises:
        jinja2.TemplateError: the template does not compile.
    """
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
"""`transformers`' marker of where a continued final message ends."""


def _tagged(message: dict[str, Any]) -> dict[str, Any]:
    """The final message with `CONTINUE_TAG` after its (last) text, as `transformers` marks
    it for `continue_final_message`."""
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": content + CONTINUE_TAG}
    if isinstance(content, list):
        parts = [dict(p) for p in content]
        for part in reversed(parts):
            if "text" in part:
                part["text"] = str(part["text"]) + CONTINUE_TAG
                return {**message, "content": parts}
    raise ValueError("continue_final_message is set but the final message has no text")


def _continued(rendered: str) -> str:
    """The rendered chat cut where the tagged final message ends (its trailing spaces
    trimmed if the template trimmed the tag's)."""
    tag = CONTINUE_TAG.strip()
    if tag not in rendered:
        raise ValueError("continue_final_message is set but the final message does not appear "
                         "in the chat after applying the chat template")  # fmt: skip
    at = rendered.rindex(tag)
    if rendered[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()


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

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text` (no specials added: byte-level has no post-processor)."""
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

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

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

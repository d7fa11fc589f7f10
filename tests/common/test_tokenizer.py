"""Tokenizers: a checkpoint's own `tokenizer.json` + chat template (built here with the
`tokenizers` library, loaded the way a real checkpoint is), and the byte-level fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizer_helpers import write_byte_level_tokenizer
from tokenizers import Tokenizer, models, pre_tokenizers

from prfaas.common.tokenizer import (
    ByteTokenizer,
    ChatMessage,
    chat_ids,
    load_tokenizer,
    minimal_chat,
)

VOCAB = {"[UNK]": 0, "<s>": 1, "hello": 2, "world": 3, "user": 4, "assistant": 5, ":": 6}
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _checkpoint(root: Path, template: str | None) -> Path:
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    tok.save(str(root / "tokenizer.json"))
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "unk_token": "[UNK]",
    }
    if template is not None:
        config["chat_template"] = template
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


def test_tokenizer_json_and_chat_template(tmp_path: Path) -> None:
    """Text encodes with the checkpoint's vocabulary; chat renders its template (with the
    generation prompt and its special tokens) before encoding."""
    tok = load_tokenizer(str(_checkpoint(tmp_path, TEMPLATE)))
    assert tok.encode("hello world") == [2, 3]
    assert tok.decode([2, 3]) == "hello world"
    assert chat_ids(tok, [ChatMessage("user", "hello")]) == [1, 4, 6, 2, 5, 6]


def test_without_a_template_the_minimal_one_follows_bos(tmp_path: Path) -> None:
    """The one rule for tokenizers without a template: BOS, then the minimal format."""
    tok = load_tokenizer(str(_checkpoint(tmp_path, None)))
    assert tok.bos_token_id == 1 and tok.chat_template is None
    ids = chat_ids(tok, [ChatMessage("user", "hello")])
    assert ids == [1, *tok.encode(minimal_chat([ChatMessage("user", "hello")]))]
    byte = ByteTokenizer()
    assert chat_ids(byte, [ChatMessage("user", "hi")]) == [
        byte.bos_token_id,
        *byte.encode("<|user|>\nhi\n<|assistant|>\n"),
    ]


def test_errors_name_the_missing_file_and_the_failed_template(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        load_tokenizer(str(tmp_path))
    broken = "{{ raise_exception('roles must alternate') }}"
    tok = load_tokenizer(str(_checkpoint(tmp_path, broken)))
    with pytest.raises(ValueError, match="roles must alternate"):
        chat_ids(tok, [ChatMessage("user", "hello")])


def test_byte_level_default() -> None:
    tok = load_tokenizer("byte-level")
    assert isinstance(tok, ByteTokenizer)
    assert tok.encode("hé") == [104, 195, 169]


def test_chat_ids_equal_transformers_apply_chat_template(tmp_path: Path) -> None:
    """The gateway's rendering (tokenizers + jinja2, no transformers) gives exactly the ids
    `transformers` gives for the same checkpoint and chat."""
    from transformers import AutoTokenizer

    root = write_byte_level_tokenizer(tmp_path)
    ours = load_tokenizer(root)
    theirs = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    chats = [
        [ChatMessage("user", "héllo  wörld ")],
        [
            ChatMessage("system", "Be brief."),
            ChatMessage("user", "2+2?"),
            ChatMessage("assistant", "4"),
            ChatMessage("user", "and 3+3?"),
        ],
    ]
    for chat in chats:
        turns = [{"role": m.role, "content": m.content} for m in chat]
        expected = theirs.apply_chat_template(
            turns, tokenize=True, add_generation_prompt=True, return_dict=False
        )
        assert chat_ids(ours, chat) == list(expected)
    assert ours.eos_token_id == theirs.eos_token_id


def test_byte_tokenizer_round_trip_and_chat() -> None:
    tok = ByteTokenizer()
    text = "héllo, 世界"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([*tok.encode("a"), tok.eos_token_id, 300, *tok.encode("b")]) == "ab"
    ids = chat_ids(tok, [ChatMessage("user", "hi")])
    assert ids[0] == tok.bos_token_id and tok.decode(ids).endswith("<|assistant|>\n")
    assert max(ids) < tok.vocab_size

"""Tokenizers: a checkpoint's own `tokenizer.json` + chat template (built here with the
`tokenizers` library, loaded the way a real checkpoint is), and the byte-level fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from prfaas.common.tokenizer import ByteTokenizer, ChatMessage
from prfaas.gateway.tokenization import create_tokenizer

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
    generation prompt) before encoding."""
    tok = create_tokenizer(str(_checkpoint(tmp_path, TEMPLATE)))
    assert tok.encode("hello world") == [2, 3]
    assert tok.decode([2, 3]) == "hello world"
    chat = tok.apply_chat_template([ChatMessage("user", "hello")])
    assert chat == [1, 4, 6, 2, 5, 6]


def test_errors_for_missing_file_or_template(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        create_tokenizer(str(tmp_path))
    tok = create_tokenizer(str(_checkpoint(tmp_path, None)))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([ChatMessage("user", "hello")])


def test_byte_level_default() -> None:
    tok = create_tokenizer("byte-level")
    assert isinstance(tok, ByteTokenizer)
    assert tok.encode("hé") == [104, 195, 169]

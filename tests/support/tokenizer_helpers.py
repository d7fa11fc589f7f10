"""A checkpoint's tokenizer files, built locally (no hub): a byte-level BPE `tokenizer.json`
with ChatML specials and a `tokenizer_config.json` carrying the chat template."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

CHATML = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_byte_level_tokenizer(root: Path, template: str = CHATML) -> Path:
    """Write the files into `root`: ids 0-255 are the byte symbols, 256-258 the specials
    (so they fit a 260-id model)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    tok.save(str(root / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": template,
    }
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root

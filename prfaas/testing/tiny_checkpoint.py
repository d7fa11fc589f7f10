"""Tiny random-weight checkpoints built locally (no hub): a byte-level tokenizer and a hybrid
`Qwen3NextForCausalLM` (3:1 linear:full attention) that vLLM's CPU build serves, or its
dense twin (`--dense`).

Run it with a Python that has torch and transformers (the vLLM environment)::

    python -m prfaas.testing.tiny_checkpoint OUT_DIR [--layers N] [--dense]

Writing is atomic (a temporary directory renamed into place), so a finished `OUT_DIR` is a
complete checkpoint and a cache check is `OUT_DIR/config.json` existing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

CHATML = (
    '{% if tools %}<|im_start|>system\n# Tools\nCall a function as <tool_call>{"name": '
    'NAME, "arguments": {...}}</tool_call>. Functions:{% for tool in tools %}\n'
    "{{ tool | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] | trim }}"
    "\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}"
    '{% for call in m[\'tool_calls\'] or [] %}\n<tool_call>\n{"name": "'
    "{{ call['function']['name'] }}\", \"arguments\": "
    "{{ call['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML with Hermes-style tools (what vLLM's `hermes` tool-call parser reads): the tools
in a system turn, an assistant's calls as `<tool_call>` JSON, tool results as user turns."""
SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")

TINY_BLOCK_SIZE = 384
"""The page size (tokens) vLLM serves the tiny hybrid checkpoint with in tests, examples and
benchmarks (`--block-size`, `[model] block_size`). Left to itself vLLM picks the smallest
page that holds a Mamba state: 256 tokens where it keeps the gated-delta-net state in
bfloat16 (vLLM 0.32 here), 384 where in float32; fixed, the KV index and the tests hold
whichever it is."""

# The hybrid shape the issue measured on vLLM's CPU build: 8 layers, every 4th full
# attention, 4 experts; the CPU gated-delta-net kernel needs linear head dims of 128.
QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": 384,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 8,
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "decoder_sparse_step": 1,
    "max_position_embeddings": 8192,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
    # wider than the usual 0.02 so greedy choices are not near-ties of random logits
    "initializer_range": 0.08,
    "tie_word_embeddings": False,
    "bos_token_id": 258,
    "eos_token_id": 257,
    "pad_token_id": 258,
    "torch_dtype": "bfloat16",
}


DENSE_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "rope_theta", "initializer_range", "tie_word_embeddings", "bos_token_id", "eos_token_id",
    "pad_token_id",
})  # fmt: skip
"""The fields of `QWEN3_NEXT` its dense twin (`Qwen3Config`) keeps."""


def write_byte_level_tokenizer(root: Path, template: str = CHATML) -> Path:
    """Write `tokenizer.json` + `tokenizer_config.json` into `root`: ids 0-255 are the byte
    symbols, 256-258 the ChatML specials (so they fit a 260-id model)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(root / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": template,
    }
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


def build_qwen3_next(out: Path, seed: int = 0, layers: int = 8, dense: bool = False) -> Path:
    """Write a tiny random Qwen3-Next checkpoint (bf16 safetensors + tokenizer) of `layers`
    layers (every 4th full attention) to `out`, unless one is already there (or another
    process writes it first); `dense`: its all-full-attention twin instead (a
    `Qwen3ForCausalLM` of the same widths, dense MLPs), whose prefix cache hits at every
    block. Needs torch and transformers."""
    import torch
    import transformers

    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=out.parent))
    try:
        torch.manual_seed(seed)
        fields: dict[str, Any] = {
            k: v for k, v in QWEN3_NEXT.items() if k not in ("architectures", "model_type")
        }
        fields["num_hidden_layers"] = layers
        if dense:
            fields = {k: v for k, v in fields.items() if k in DENSE_FIELDS}
            config = transformers.Qwen3Config(**fields)
            model: Any = transformers.Qwen3ForCausalLM(config)
        else:
            model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**fields))
        model = model.to(torch.bfloat16)
        model.save_pretrained(tmp, safe_serialization=True)
        write_byte_level_tokenizer(tmp)
        try:
            os.replace(tmp, out)
        except OSError:  # another process built it first (same seed: the same checkpoint)
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="checkpoint directory (kept if complete)")
    parser.add_argument(
        "--layers",
        type=int,
        default=QWEN3_NEXT["num_hidden_layers"],
        help="model layers, every 4th full attention (default %(default)s)",
    )
    parser.add_argument("--dense", action="store_true", help="all layers full attention")
    args = parser.parse_args()
    build_qwen3_next(args.out, layers=args.layers, dense=args.dense)


if __name__ == "__main__":
    main()

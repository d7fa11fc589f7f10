"""Built-in hybrid models (tiny ones for the CPU, GPU-sized Table 3 layouts) and loading of
any local checkpoint of a supported architecture.

A preset is a `transformers` config with a 3:1 linear:full layer pattern and seeded random
weights. It is materialised once (`save_pretrained`) under the cache directory and then loaded
like any checkpoint, so presets and real checkpoints take one code path. Nothing here touches
the network: `from_pretrained` only ever sees a local directory.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from prfaas.common.tokenizer import ByteTokenizer
from prfaas.engines.reference.model import table3

SUPPORTED_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "kimi_linear")
PRESET_SEED = 1234
_PATTERN = ["linear_attention"] * 3 + ["full_attention"]
_BYTE = ByteTokenizer()
_SPECIALS: dict[str, Any] = {
    "vocab_size": _BYTE.vocab_size,
    "bos_token_id": _BYTE.bos_token_id,
    "eos_token_id": _BYTE.eos_token_id,
    "pad_token_id": _BYTE.pad_token_id,
    "tie_word_embeddings": False,
}


def _qwen3_next(layers: int) -> PretrainedConfig:
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
        linear_value_head_dim=32, num_experts=0, layer_types=_PATTERN * (layers // 4),
        max_position_embeddings=65536, **_SPECIALS,
    )  # fmt: skip


def _qwen3_5(layers: int) -> PretrainedConfig:
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
        linear_value_head_dim=32, layer_types=_PATTERN * (layers // 4),
        max_position_embeddings=65536, **_SPECIALS,
    )  # fmt: skip


def _kimi_linear(layers: int) -> PretrainedConfig:
    from transformers import KimiLinearConfig

    return KimiLinearConfig(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
        num_local_experts=4, num_experts_per_tok=2, linear_head_dim=32, linear_num_heads=4,
        layer_types=_PATTERN * (layers // 4), max_position_embeddings=65536, **_SPECIALS,
    )  # fmt: skip


PRESETS: dict[str, Callable[[], PretrainedConfig]] = {
    "qwen3-next-tiny": lambda: _qwen3_next(8),
    "qwen3-next-mini": lambda: _qwen3_next(4),
    "qwen3.5-tiny": lambda: _qwen3_5(8),
    "kimi-linear-tiny": lambda: _kimi_linear(8),
    "qwen3.5-gpu": lambda: table3.config("qwen3.5", "gpu", _SPECIALS),
    "kimi-linear-gpu": lambda: table3.config("kimi-linear", "gpu", _SPECIALS),
}
STORED_BF16 = frozenset({"qwen3.5-gpu", "kimi-linear-gpu"})
"""Presets sized for one GPU (the paper's Table 3 layouts, `table3.py`), stored in bfloat16
(about 2.6 GB each); the others are stored in float32."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a preset name (materialised under `path`) or a local path."""

    name: str
    path: Path
    preset: bool


def default_cache_dir() -> Path:
    """`$PRFAAS_MODEL_CACHE`, else `~/.cache/prfaas/models`."""
    env = os.environ.get("PRFAAS_MODEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "prfaas" / "models"


def resolve(model: str, cache_dir: Path | None = None) -> ModelSource:
    """Resolve a preset name or a local checkpoint directory.

    Raises:
        ValueError: if `model` is neither a preset nor an existing directory with config.json.
    """
    if model in PRESETS:
        return ModelSource(model, (cache_dir or default_cache_dir()) / model, preset=True)
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return ModelSource(path.name, path, preset=False)
    raise ValueError(
        f"model {model!r} is neither a preset ({', '.join(PRESETS)}) "
        "nor a local checkpoint directory containing config.json"
    )


def materialise(source: ModelSource) -> None:
    """Write a preset's seeded random weights to its path unless already there (a
    checkpoint directory is left as it is)."""
    if source.preset:
        source.path.parent.mkdir(parents=True, exist_ok=True)
        _write_preset(source.name, source.path)


def _write_preset(name: str, path: Path) -> None:
    """Write preset `name` (seeded random weights) to `path` unless already there.

    Safe against concurrent engines: each writes a private temporary directory and renames
    it into place; a loser of the race discards its identical copy.
    """
    if (path / "config.json").is_file():
        return
    with torch.random.fork_rng():  # do not disturb the caller's global RNG
        torch.manual_seed(PRESET_SEED)
        stored = torch.bfloat16 if name in STORED_BF16 else torch.float32
        model = AutoModelForCausalLM.from_config(PRESETS[name](), dtype=stored)  # type: ignore[no-untyped-call]
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    model.save_pretrained(tmp)
    try:
        tmp.rename(path)
    except OSError:
        if not (path / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def load_model(
    source: ModelSource,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """Load the model in eval mode from a local directory (materialising a preset), in
    `dtype` on `device` (default the CPU).

    Raises:
        ValueError: if the checkpoint's architecture is not a supported hybrid model.
    """
    materialise(source)
    config = AutoConfig.from_pretrained(source.path, local_files_only=True)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {config.model_type!r} in {source.path}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    model = AutoModelForCausalLM.from_pretrained(
        source.path, dtype=dtype, local_files_only=True, attn_implementation="sdpa"
    )
    if device is not None and device.type != "cpu":
        model.to(device)  # type: ignore[arg-type]
    model.eval()  # type: ignore[no-untyped-call]
    return model

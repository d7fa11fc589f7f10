"""The paper's Table 3 architectures, scaled down: random-weight `transformers` models with
the real models' per-layer attention layout, sized for one GPU (`gpu`) or for a CPU check
(`tiny`), and the KV bytes a prefill of `l` tokens leaves, as a serving engine keeps them.

| preset | like | layers | attention |
|---|---|---|---|
| `qwen3.5` | Qwen3.5-397B, Qwen3-Next | 3 GDN : 1 GQA | gated delta net, grouped-query |
| `kimi-linear` | Kimi Linear 48B | 3 KDA : 1 MLA | Kimi delta attention, multi-head latent |
| `mimo-v2-flash` | MiMo-V2-Flash 309B | 5 SWA : 1 GQA | sliding window (129), grouped-query |
| `ring-2.5` | Ring-2.5-1T (`bailing_hybrid`) | 7 linear : 1 MLA | KDA-style linear, latent |
| `dense-gqa` | Qwen3-235B, MiniMax-M2.5 | all GQA | the `qwen3.5` layers, all full |
| `dense-mla` | (twin of the MLA hybrids) | all MLA | the `kimi-linear` layers, all full |

KV bytes (`compact_kv_bytes`) follow SGLang's layouts, as the paper measured: full GQA
layers keep K and V per token (bf16), sliding-window layers at most a window of them, MLA
layers the compressed latent and the rotary key per token (`kv_lora_rank +
qk_rope_head_dim`, bf16), linear layers a fixed state per sequence (the recurrent state in
float32, the short-convolution states in bf16). A `transformers` cache holds more for MLA
(expanded keys and values); `cache_bytes` measures what it holds, for a cross-check.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from transformers import AutoConfig, PretrainedConfig

Size = Literal["gpu", "tiny"]
BF16, FP32 = 2, 4
SPECIALS = {"vocab_size": 32000, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            "tie_word_embeddings": False}  # fmt: skip


@dataclass(frozen=True)
class Dims:
    """One size's dimensions (shared by every preset)."""

    hidden: int
    layers: int
    heads: int
    head_dim: int
    intermediate: int
    vocab: int


DIMS: dict[Size, Dims] = {
    "gpu": Dims(hidden=1536, layers=48, heads=12, head_dim=128, intermediate=4608, vocab=32000),
    "tiny": Dims(hidden=64, layers=8, heads=2, head_dim=32, intermediate=128, vocab=512),
}


def _pattern(layers: int, linear: int, linear_name: str = "linear_attention") -> list[str]:
    """`linear` linear layers then one full one, repeated (the real models' ratio)."""
    group = [linear_name] * linear + ["full_attention"]
    return [group[i % len(group)] for i in range(layers)]


def _specials(d: Dims) -> dict[str, Any]:
    return {**SPECIALS, "vocab_size": d.vocab}


def _qwen3_5(d: Dims, dense: bool) -> PretrainedConfig:
    layers = ["full_attention"] * d.layers if dense else _pattern(d.layers, 3)
    return AutoConfig.for_model(
        "qwen3_5_text", hidden_size=d.hidden, intermediate_size=d.intermediate,
        num_hidden_layers=d.layers, num_attention_heads=d.heads, num_key_value_heads=2,
        head_dim=d.head_dim * 2, linear_num_key_heads=d.heads // 2,
        linear_num_value_heads=d.heads, linear_key_head_dim=d.head_dim,
        linear_value_head_dim=d.head_dim, layer_types=layers,
        max_position_embeddings=65536, **_specials(d),
    )  # fmt: skip


def _kimi_linear(d: Dims, dense: bool) -> PretrainedConfig:
    layers = ["full_attention"] * d.layers if dense else _pattern(d.layers, 3)
    return AutoConfig.for_model(
        "kimi_linear", hidden_size=d.hidden, intermediate_size=d.intermediate,
        moe_intermediate_size=d.intermediate // 4, num_hidden_layers=d.layers,
        num_attention_heads=d.heads, num_key_value_heads=d.heads, kv_lora_rank=4 * d.head_dim,
        qk_rope_head_dim=d.head_dim // 2, qk_nope_head_dim=d.head_dim, v_head_dim=d.head_dim,
        num_local_experts=4, num_experts_per_tok=2, mlp_layer_types=["dense"] * d.layers,
        linear_head_dim=d.head_dim, linear_num_heads=d.heads, layer_types=layers,
        max_position_embeddings=65536, **_specials(d),
    )  # fmt: skip


def _mimo_v2_flash(d: Dims, dense: bool) -> PretrainedConfig:
    del dense
    return AutoConfig.for_model(
        "mimo_v2_flash", hidden_size=d.hidden, intermediate_size=d.intermediate,
        moe_intermediate_size=d.intermediate // 4, num_hidden_layers=d.layers,
        num_attention_heads=d.heads * 2, num_key_value_heads=2, head_dim=d.head_dim * 3 // 2,
        v_head_dim=d.head_dim, sliding_window=129, n_routed_experts=4, num_experts_per_tok=2,
        layer_types=_pattern(d.layers, 5, "sliding_attention"),
        mlp_layer_types=["dense"] * d.layers, max_position_embeddings=65536, **_specials(d),
    )  # fmt: skip


def _ring_2_5(d: Dims, dense: bool) -> PretrainedConfig:
    del dense
    return AutoConfig.for_model(
        "bailing_hybrid", hidden_size=d.hidden, intermediate_size=d.intermediate,
        moe_intermediate_size=d.intermediate // 4, num_hidden_layers=d.layers,
        num_attention_heads=d.heads, num_key_value_heads=d.heads, head_dim=d.head_dim,
        kv_lora_rank=4 * d.head_dim, qk_rope_head_dim=d.head_dim // 2,
        qk_nope_head_dim=d.head_dim, v_head_dim=d.head_dim, num_local_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=d.layers,
        layer_group_size=8, num_mtp_layers=0, max_position_embeddings=65536, **_specials(d),
    )  # fmt: skip


@dataclass(frozen=True)
class Preset:
    """One Table 3 architecture."""

    name: str
    build: Callable[[Dims], PretrainedConfig]
    hybrid: bool
    paper: str | None
    """Its row in the paper's Table 3 (`data/paper/results.toml`), if it has one."""
    twin: str | None = None
    """The dense preset whose ratio to this one compares with the paper's."""


PRESETS: dict[str, Preset] = {
    "qwen3.5": Preset("qwen3.5", lambda d: _qwen3_5(d, False), True, "qwen3_5_397b", "dense-gqa"),
    "kimi-linear": Preset(
        "kimi-linear", lambda d: _kimi_linear(d, False), True, "kimi_linear", "dense-mla"
    ),
    "mimo-v2-flash": Preset(
        "mimo-v2-flash", lambda d: _mimo_v2_flash(d, False), True, "mimo_v2_flash", "dense-gqa"
    ),
    "ring-2.5": Preset("ring-2.5", lambda d: _ring_2_5(d, False), True, "ring_2_5_1t", "dense-mla"),
    "dense-gqa": Preset("dense-gqa", lambda d: _qwen3_5(d, True), False, "qwen3_235b"),
    "dense-mla": Preset("dense-mla", lambda d: _kimi_linear(d, True), False, None),
}


PAPER_RESULTS = Path(__file__).resolve().parents[5] / "shared/data/paper/results.toml"
"""The paper's published numbers (read-only data beside the checkout)."""


def paper_table3(path: Path = PAPER_RESULTS) -> dict[str, Any] | None:
    """The paper's Table 3 (Phi_kv in Gbit/s per model at `seq_tokens`), if `path` exists
    (a GPU machine gets the checkout without it)."""
    if not path.is_file():
        return None
    table: dict[str, Any] = tomllib.loads(path.read_text())["table3"]
    return table


def paper_ratio(name: str, tokens: int, table: Mapping[str, Any] | None) -> float | None:
    """The paper's Phi_kv of preset `name`'s real model over its dense twin's at `tokens`,
    where the table has both rows at that length."""
    preset = PRESETS[name]
    twin = PRESETS[preset.twin] if preset.twin else None
    if table is None or twin is None or preset.paper is None or twin.paper is None:
        return None
    if tokens not in table["seq_tokens"]:
        return None
    i = table["seq_tokens"].index(tokens)
    return round(float(table[preset.paper][i]) / float(table[twin.paper][i]), 4)


def config(name: str, size: Size, overrides: Mapping[str, Any] | None = None) -> PretrainedConfig:
    """Preset `name`'s config at `size`, with `overrides` set on it (an engine's tokenizer
    ids and vocabulary, say)."""
    cfg = PRESETS[name].build(DIMS[size])
    cfg.update(dict(overrides or {}))
    return cfg


def compact_kv_bytes(cfg: PretrainedConfig, tokens: int) -> int:
    """The KV (and linear state) bytes a prefill of `tokens` leaves, as SGLang keeps them."""
    return sum(layer_kv_bytes(cfg, kind, tokens) for kind in cfg.layer_types)


def layer_kv_bytes(cfg: PretrainedConfig, kind: str, tokens: int) -> int:
    """One layer's bytes after `tokens` (the module docstring has the rule)."""
    mla = getattr(cfg, "kv_lora_rank", None)
    if kind == "full_attention" and mla:
        return int(tokens * (mla + cfg.qk_rope_head_dim) * BF16)
    if kind in ("full_attention", "sliding_attention"):
        kept = tokens if kind == "full_attention" else min(tokens, cfg.sliding_window)
        v_dim = getattr(cfg, "v_head_dim", None) or cfg.head_dim
        return int(kept * cfg.num_key_value_heads * (cfg.head_dim + v_dim) * BF16)
    return _linear_state_bytes(cfg)


def _linear_state_bytes(cfg: PretrainedConfig) -> int:
    """A linear layer's state: recurrent (float32) plus short-convolution (bf16)."""
    if getattr(cfg, "linear_num_value_heads", None):  # gated delta net
        k_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        v_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        recurrent = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
        kernel = cfg.linear_conv_kernel_dim
        return int(recurrent * FP32 + (2 * k_dim + v_dim) * (kernel - 1) * BF16)
    heads, dim = cfg.linear_num_heads, cfg.linear_head_dim  # KDA: q, k, v convolutions
    kernel = int(getattr(cfg, "linear_conv_kernel_dim", None) or 4)
    return int(heads * dim * dim * FP32 + 3 * heads * dim * (kernel - 1) * BF16)


def cache_bytes(cache: Any) -> int:
    """Bytes of every tensor a `transformers` cache object holds (each storage once)."""
    import torch

    seen: set[int] = set()
    total = 0
    stack = [cache]
    visited: set[int] = set()
    while stack:
        item = stack.pop()
        if id(item) in visited:
            continue
        visited.add(id(item))
        if isinstance(item, torch.Tensor):
            key = item.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += item.untyped_storage().nbytes()
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif hasattr(item, "__dict__") and not isinstance(item, type):
            stack.extend(vars(item).values())
    return total

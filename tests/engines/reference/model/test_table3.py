"""The Table 3 presets: the real models' layer layouts, the KV-bytes rule a serving engine
keeps (checked against a `transformers` cache where the two agree), the paper's ratios."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from prfaas.engines.reference.model import table3

LAYOUTS = {  # preset -> (full-attention layers of 48 at GPU size, the other layers' type)
    "qwen3.5": (12, "linear_attention"),
    "kimi-linear": (12, "linear_attention"),
    "mimo-v2-flash": (8, "sliding_attention"),
    "ring-2.5": (6, "linear_attention"),
    "dense-gqa": (48, None),
    "dense-mla": (48, None),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gpu_layouts_follow_the_real_models(name: str) -> None:
    cfg = table3.config(name, "gpu")
    full, other = LAYOUTS[name]
    assert len(cfg.layer_types) == 48
    assert cfg.layer_types.count("full_attention") == full
    assert set(cfg.layer_types) == {"full_attention"} | ({other} if other else set())
    assert cfg.layer_types[-1] == "full_attention"  # each group ends with its full layer


def test_kv_bytes_rule() -> None:
    """GQA keeps K and V per token, MLA the latent and rotary key, sliding windows at most
    the window, linear layers a fixed state: by hand at GPU size."""
    gqa, mla = table3.config("dense-gqa", "gpu"), table3.config("dense-mla", "gpu")
    assert table3.layer_kv_bytes(gqa, "full_attention", 1000) == 1000 * 2 * (256 + 256) * 2
    assert table3.layer_kv_bytes(mla, "full_attention", 1000) == 1000 * (512 + 64) * 2
    mimo = table3.config("mimo-v2-flash", "gpu")
    window = table3.layer_kv_bytes(mimo, "sliding_attention", 10_000)
    assert window == table3.layer_kv_bytes(mimo, "sliding_attention", 129)
    assert window < table3.layer_kv_bytes(mimo, "full_attention", 10_000) / 50
    qwen = table3.config("qwen3.5", "gpu")
    state = table3.layer_kv_bytes(qwen, "linear_attention", 1)
    assert state == table3.layer_kv_bytes(qwen, "linear_attention", 100_000) > 0
    for hybrid, dense in (("qwen3.5", gqa), ("kimi-linear", mla)):
        cfg = table3.config(hybrid, "gpu")
        assert table3.compact_kv_bytes(cfg, 32768) < table3.compact_kv_bytes(dense, 32768) / 3


def test_compact_bytes_against_a_bfloat16_cache() -> None:
    """The rule against what `transformers` keeps for GQA and gated-delta layers: the same
    bytes, but for one more short-convolution column per linear layer (`transformers` keeps
    the kernel's full width, serving engines the kernel less one)."""
    cfg = table3.config("qwen3.5", "tiny")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        out = model(input_ids=torch.randint(0, cfg.vocab_size, (1, 96)), use_cache=True)
    linear = cfg.layer_types.count("linear_attention")
    conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + (
        cfg.linear_num_value_heads * cfg.linear_value_head_dim
    )
    held = table3.cache_bytes(out.past_key_values)
    assert held - table3.compact_kv_bytes(cfg, 96) == linear * conv_dim * 2


def test_paper_ratios() -> None:
    table = {"seq_tokens": [1024, 8192], "qwen3_5_397b": [4.0, 6.0], "qwen3_235b": [4.0, 24.0]}
    assert table3.paper_ratio("qwen3.5", 8192, table) == 0.25
    assert table3.paper_ratio("qwen3.5", 4096, table) is None  # not a Table 3 length
    assert table3.paper_ratio("kimi-linear", 1024, table) is None  # no dense MLA row
    assert table3.paper_ratio("qwen3.5", 1024, None) is None

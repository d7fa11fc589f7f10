"""The plugin's environment settings: defaults, parsing, and errors naming the variable;
and the prefill configurations that would bypass the layer hooks, refused from the flags
and from what SGLang resolved."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sglang.srt.server_args import ServerArgs

from prfaas.engines.sglang.settings import (
    BackendSettings,
    check_prefill_args,
    prefill_graph_backend,
)

OFF = "disabled"


def test_settings_from_the_environment() -> None:
    assert BackendSettings.from_env({}) == BackendSettings()
    got = BackendSettings.from_env(
        {"PRFAAS_SGLANG_CONNECTIONS": "8", "PRFAAS_SGLANG_TRANSFER_TIMEOUT_S": "2.5"}
    )
    assert (got.connections, got.transfer_timeout_s) == (8, 2.5)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"PRFAAS_SGLANG_CONNECTIONS": "many"},
            "PRFAAS_SGLANG_CONNECTIONS='many' is not an integer",
        ),
        ({"PRFAAS_SGLANG_CONNECTIONS": "0"}, "PRFAAS_SGLANG_CONNECTIONS must be in 1..64"),
        ({"PRFAAS_SGLANG_TRANSFER_TIMEOUT_S": "0"}, "TRANSFER_TIMEOUT_S must be positive"),
        ({"PRFAAS_SGLANG_RATE_BYTES_PER_S": "-1"}, "RATE_BYTES_PER_S must be positive"),
    ],
)
def test_bad_settings_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BackendSettings.from_env(env)


def test_only_prfaas_prefills_with_prefill_graphs_are_refused() -> None:
    class Args:
        disaggregation_mode = "prefill"
        disaggregation_transfer_backend = "prfaas"
        disable_prefill_cuda_graph = False
        disable_cuda_graph = False

    with pytest.raises(ValueError, match="--disable-prefill-cuda-graph"):
        check_prefill_args(Args())
    Args.disaggregation_transfer_backend = "mooncake"
    check_prefill_args(Args())


def test_layerwise_and_send_budget_settings() -> None:
    assert BackendSettings().layerwise and BackendSettings().send_budget_bytes == 1 << 30
    got = BackendSettings.from_env(
        {"PRFAAS_SGLANG_LAYERWISE": "false", "PRFAAS_SGLANG_SEND_BUDGET_BYTES": "65536"}
    )
    assert (got.layerwise, got.send_budget_bytes) == (False, 65536)
    assert BackendSettings.from_env({"PRFAAS_SGLANG_LAYERWISE": "1"}).layerwise
    with pytest.raises(ValueError, match="PRFAAS_SGLANG_LAYERWISE='maybe' is not a boolean"):
        BackendSettings.from_env({"PRFAAS_SGLANG_LAYERWISE": "maybe"})
    with pytest.raises(ValueError, match="SEND_BUDGET_BYTES must be positive"):
        BackendSettings.from_env({"PRFAAS_SGLANG_SEND_BUDGET_BYTES": "0"})


def _json(backend: str) -> dict[str, Any]:
    """`--cuda-graph-config '{"prefill": {"backend": ...}}'` as SGLang's parser returns it."""
    return {"prefill": {"backend": backend}}


def _unresolved(**fields: Any) -> Any:
    """A prfaas prefill's `ServerArgs` as SGLang builds it, not yet resolved (no CLI hook)."""
    return ServerArgs(
        model_path="m",
        disaggregation_mode="prefill",
        disaggregation_transfer_backend="prfaas",
        **fields,
    )


@pytest.mark.parametrize(
    ("fields", "backend"),
    [
        ({}, "breakable"),  # CUDA's default, assumed before resolution
        ({"disable_prefill_cuda_graph": True}, "disabled"),
        ({"disable_cuda_graph": True}, "disabled"),
        # SGLang's precedence: the per-phase backend wins over the off-switch, JSON over both
        ({"disable_prefill_cuda_graph": True, "cuda_graph_backend_prefill": "full"}, "full"),
        ({"cuda_graph_backend_prefill": "disabled", "cuda_graph_config": _json("full")}, "full"),
        ({"cuda_graph_backend_prefill": "full", "cuda_graph_config": _json(OFF)}, OFF),
    ],
)  # fmt: skip
def test_the_prefill_graph_backend_from_flags_follows_sglangs_precedence(
    fields: dict[str, Any], backend: str
) -> None:
    assert prefill_graph_backend(_unresolved(**fields)) == backend


def test_every_hook_bypass_is_refused_by_name_unless_sending_after_the_forward() -> None:
    off = {"disable_prefill_cuda_graph": True}
    check_prefill_args(_unresolved(**off), layerwise=True)
    for fields, name in (
        ({"cuda_graph_backend_prefill": "full"}, "backend 'full'"),
        ({**off, "enable_two_batch_overlap": True}, "--enable-two-batch-overlap"),
        ({**off, "enable_pdmux": True}, "--enable-pdmux"),
    ):
        args = _unresolved(**fields)
        with pytest.raises(ValueError, match=name) as info:
            check_prefill_args(args, layerwise=True)
        assert "PRFAAS_SGLANG_LAYERWISE=0" in str(info.value)
        check_prefill_args(args, layerwise=False)  # send-after hooks nothing


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Qwen3-Next (hybrid GDN) model folder: its config is all resolution reads."""
    root = tmp_path_factory.mktemp("tiny-qwen3-next")
    (root / "config.json").write_text(json.dumps(QWEN3_NEXT_CONFIG))
    return str(root)


def test_the_resolved_prefill_graph_is_checked_not_the_flags(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ServerArgs.resolve_once` (SGLang's own resolution, through the plugin's hook) is where
    the decision is read: a CPU prefill without `--disable-prefill-cuda-graph` resolves to
    no prefill graph and starts; an explicit breakable backend is refused there even next
    to `--disable-prefill-cuda-graph` (never through `prepare_server_args` here)."""
    common = {"device": "cpu", "disable_radix_cache": True}
    plain = ServerArgs(model_path=tiny_model, **common, **PREFILL)
    plain.resolve_once()
    assert prefill_graph_backend(plain) == "disabled"
    graphs = ServerArgs(
        model_path=tiny_model,
        disable_prefill_cuda_graph=True,
        cuda_graph_backend_prefill="breakable",
        **common,
        **PREFILL,
    )
    with pytest.raises(ValueError, match="prefill CUDA graph \\(backend 'breakable'"):
        graphs.resolve_once()
    assert prefill_graph_backend(graphs) == "breakable"  # what SGLang resolved
    monkeypatch.setenv("PRFAAS_SGLANG_LAYERWISE", "0")
    check_prefill_args(graphs)  # send-after: a prefill graph is fine


PREFILL = {"disaggregation_mode": "prefill", "disaggregation_transfer_backend": "prfaas"}
QWEN3_NEXT_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "dtype": "bfloat16",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 8,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
    + ["full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 8192,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "partial_rotary_factor": 0.25,
    "rope_parameters": {"partial_rotary_factor": 0.25, "rope_theta": 1e4, "rope_type": "default"},
    "rms_norm_eps": 1e-06,
    "hidden_act": "silu",
    "vocab_size": 384,
    "bos_token_id": 258,
    "eos_token_id": 257,
    "pad_token_id": 258,
    "tie_word_embeddings": False,
}  # fmt: skip

"""The plugin's environment settings: defaults, parsing, and errors naming the variable."""

from __future__ import annotations

import pytest

from prfaas.engines.sglang.settings import BackendSettings, check_prefill_args


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

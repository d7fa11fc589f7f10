"""Registration through SGLang's own plugin loading: the `prfaas` entry point, the CLI's
argument parser, `TransferBackend("prfaas")`, and `get_kv_class` as the prefill, decode
and disagg-service modules see it (imported before the plugin loaded, as in a scheduler
process); a prefill server without `--disable-prefill-cuda-graph` is refused."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest
from sglang.srt.disaggregation.utils import TransferBackend
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.server_args import prepare_server_args

from prfaas.engines.sglang import register
from prfaas.engines.sglang.plugin import GET_KV_CLASS, check_version

# Run in a fresh interpreter: SGLang's modules that bind get_kv_class by name are imported
# first, then SGLang's own load_plugins() runs the entry point.
SEEN_FROM_MODULES = """
import sglang.srt.disaggregation.prefill as prefill
import sglang.srt.disaggregation.decode as decode
import sglang.srt.managers.disagg_service as service
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend
from sglang.srt.plugins import load_plugins
load_plugins()
backend = TransferBackend("prfaas")
for module in (prefill, decode, service):
    print(module.__name__, module.get_kv_class(backend, KVClassType.MANAGER).__qualname__,
          module.get_kv_class(TransferBackend.FAKE, KVClassType.MANAGER).__qualname__)
"""


def test_the_entry_point_is_installed() -> None:
    """`pip install prfaas[sglang]` registers `register` in SGLang's plugin group."""
    points = importlib.metadata.entry_points(group="sglang.srt.plugins")
    assert {p.name: p.value for p in points}["prfaas"] == "prfaas.engines.sglang:register"


def test_get_kv_class_is_ours_from_prefill_decode_and_disagg_service() -> None:
    """Every module that imported `get_kv_class` by name gets ours for prfaas and SGLang's
    own for other backends."""
    done = subprocess.run(
        [sys.executable, "-c", SEEN_FROM_MODULES], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:3] == [
        f"sglang.srt.{name} PrfaasKVManager FakeKVManager"
        for name in ("disaggregation.prefill", "disaggregation.decode", "managers.disagg_service")
    ]


def test_the_cli_parser_accepts_the_backend() -> None:
    """`--disaggregation-transfer-backend prfaas` parses and resolves to our enum member."""
    args = prepare_server_args(
        ["--model-path", "m", "--disaggregation-mode", "decode",
         "--disaggregation-transfer-backend", "prfaas"]
    )  # fmt: skip
    assert TransferBackend(args.disaggregation_transfer_backend) is TransferBackend.PRFAAS
    assert TransferBackend.PRFAAS.value == "prfaas" and TransferBackend.PRFAAS in TransferBackend


def test_a_prefill_server_needs_prefill_cuda_graphs_off() -> None:
    """Forward hooks do not run on CUDA graph replay: the prefill is refused with the hint."""
    argv = ["--model-path", "m", "--disaggregation-mode", "prefill",
            "--disaggregation-transfer-backend", "prfaas"]  # fmt: skip
    with pytest.raises(ValueError, match="--disable-prefill-cuda-graph"):
        prepare_server_args(argv)
    assert prepare_server_args([*argv, "--disable-prefill-cuda-graph"]).disable_prefill_cuda_graph


def test_register_is_idempotent() -> None:
    """A second `register()` adds no member and no second hook."""
    hooks = len(HookRegistry._hooks[GET_KV_CLASS])
    register()
    assert len(HookRegistry._hooks[GET_KV_CLASS]) == hooks == 1
    assert [m.value for m in TransferBackend].count("prfaas") == 1


def test_another_sglang_version_is_refused() -> None:
    """The plugin names the version it supports and the pip line."""
    check_version("0.5.23")
    with pytest.raises(RuntimeError, match=r"sglang==0\.5\.23 only.*sglang 0\.5\.24 is installed"):
        check_version("0.5.24")

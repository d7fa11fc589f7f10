"""examples/sglang_gpu.toml (SGLang engines with the prfaas transfer backend) is a valid
deployment: a PrfaaS prefill, a PD prefill and a PD decode, KV events from each."""

from __future__ import annotations

from pathlib import Path

from prfaas.gateway.deployment import load_deployment


def test_the_sglang_example_deployment_loads(repo_root: Path) -> None:
    config = load_deployment(repo_root / "examples" / "sglang_gpu.toml")
    assert [(i.id, i.cluster, i.role) for i in config.instances] == [
        ("prfaas-p0", "prfaas", "prefill"),
        ("pd-p0", "pd", "prefill"),
        ("pd-d0", "pd", "decode"),
    ]
    assert all(i.kv_events for i in config.instances)
    assert config.model.block_size == 64 and not config.launch

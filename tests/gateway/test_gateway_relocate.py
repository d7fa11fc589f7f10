"""`Gateway.relocate`, which the supervisor calls after every engine restart: the instance
keeps its engine kind's client (a vLLM server gets a vLLM client at its new address, a vLLM
decode still has no KV sender), and its KV-index entries are dropped."""

from __future__ import annotations

import aiohttp

from prfaas.engine_clients.sglang import SGLangClient
from prfaas.engine_clients.vllm import VLLMClient
from prfaas.gateway.api.assembly import build_gateway
from prfaas.gateway.deployment import DeploymentConfig, InstanceConfig
from prfaas.protocol.kv_events import BlockStored


def _config() -> DeploymentConfig:
    return DeploymentConfig(instances=(
        InstanceConfig("p0", "prfaas", "prefill", "http://127.0.0.1:1001", bootstrap_port=2001,
                       engine="vllm"),
        InstanceConfig("d0", "pd", "decode", "http://127.0.0.1:1002", engine="vllm"),
        InstanceConfig("r0", "pd", "prefill", "http://127.0.0.1:1003", bootstrap_port=2003),
    ))  # fmt: skip


async def test_relocate_keeps_each_engine_kinds_client() -> None:
    async with aiohttp.ClientSession() as session:
        gateway = build_gateway(_config(), session)
        block = gateway.index.block_size
        gateway.index.apply("d0", [BlockStored((7,), None, tuple(range(block)), block)])
        assert len(gateway.index) == 1
        await gateway.relocate("p0", "http://127.0.0.1:1101", 2101, None)
        await gateway.relocate("d0", "http://127.0.0.1:1102", 2102, None)
        await gateway.relocate("r0", "http://127.0.0.1:1103", 2103, None)
        p0, d0, r0 = (gateway.instances[i] for i in ("p0", "d0", "r0"))
        assert isinstance(p0.client, VLLMClient) and isinstance(d0.client, VLLMClient)
        assert p0.client.base_url == "http://127.0.0.1:1101"
        assert (p0.bootstrap_port, p0.client.endpoint.bootstrap_port) == (2101, 2101)
        assert d0.client.base_url == "http://127.0.0.1:1102"
        assert (d0.bootstrap_port, d0.client.endpoint.bootstrap_port) == (None, None)
        assert isinstance(r0.client, SGLangClient) and r0.client.base_url.endswith(":1103")
        assert r0.bootstrap_port == 2103
        assert len(gateway.index) == 0  # the old start's entries are gone
        for state in gateway.instances:
            await state.client.close()

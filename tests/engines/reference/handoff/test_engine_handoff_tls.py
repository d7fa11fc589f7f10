"""The reference engine's PD hand-off over transport TLS, end to end in one process: engines
built as `prfaas engine` builds them (`build_app` with the deployment secret and TLS options,
mutual TLS on), real sockets, a throwaway CA made by the `openssl` command line."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from engine_helpers import hf_greedy, random_prompt
from transformers import PreTrainedModel

from prfaas.cli.main import main
from prfaas.common.secret import DeploymentSecret
from prfaas.engines.reference.engine_config import EngineConfig
from prfaas.engines.reference.server.main import LaunchOptions, build_app
from prfaas.engines.reference.server.service import EngineService
from prfaas.engines.transport import TlsConfig
from prfaas.testing.tls_certs import CertAuthority

SECRET = DeploymentSecret(b"s" * 32)
HEADERS = {"Authorization": f"Bearer {SECRET.control_token()}"}


@dataclass
class Engine:
    url: str
    service: EngineService


@asynccontextmanager
async def running(options: LaunchOptions) -> AsyncIterator[Engine]:
    """`build_app(options)` served on 127.0.0.1:<ephemeral>, cleaned up on exit."""
    app, service = build_app(options)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield Engine(f"http://127.0.0.1:{runner.addresses[0][1]}", service)
    finally:
        await runner.cleanup()


def options(role: str, tls: TlsConfig, cache: Path) -> LaunchOptions:
    engine = EngineConfig(role=role, block_size=16, kv_capacity_tokens=4096)
    return LaunchOptions(model="qwen3-next-tiny", port=0, cache_dir=cache, threads=1,
                         engine=engine, secret=SECRET, tls=tls)  # fmt: skip


async def pd_generate(
    session: aiohttp.ClientSession, prefill: Engine, decode: Engine, prompt: list[int], n: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same body to both engines at once, as the gateway sends it."""
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.service.sender.bootstrap_port,
        "bootstrap_room": random.randrange(2**63),
    }

    async def call(engine: Engine) -> dict[str, Any]:
        async with session.post(f"{engine.url}/generate", json=body, headers=HEADERS) as r:
            result: dict[str, Any] = await r.json()
            return result

    p, d = await asyncio.gather(call(prefill), call(decode))
    return p, d


async def test_pd_handoff_over_tls(
    tiny_model: PreTrainedModel, engine_model_cache: Path, tmp_path: Path
) -> None:
    """Prefill and decode engines with the deployment's CA, each its own certificate and
    mutual TLS: the decode's output equals plain `transformers` greedy decoding, and the
    prefill's `/transfer_stats` shows its connections are TLS 1.3. A decode that trusts
    another CA gets no KV: its `/generate` fails at once (not at its 60 s hand-off timeout)
    with a 502 naming the untrusted certificate."""
    ca, rogue = CertAuthority.create(tmp_path / "ca"), CertAuthority.create(tmp_path / "rogue")

    def tls(ca_: CertAuthority, name: str) -> TlsConfig:
        cert = ca.issue(name)
        return TlsConfig(cert.cert, cert.key, ca_.cert, verify_client=True)

    async with (
        running(options("prefill", tls(ca, "prefill"), engine_model_cache)) as pre,
        running(options("decode", tls(ca, "decode"), engine_model_cache)) as dec,
        running(options("decode", tls(rogue, "lost"), engine_model_cache)) as lost,
        aiohttp.ClientSession() as s,
    ):
        for length in (16, 50):
            prompt = random_prompt(200 + length, length)
            p, d = await pd_generate(s, pre, dec, prompt, 6)
            assert d["output_ids"] == hf_greedy(tiny_model, prompt, 6), length
            assert p["output_ids"] == d["output_ids"][:1]
        async with s.get(f"{pre.url}/transfer_stats", headers=HEADERS) as r:
            stats = await r.json()
        assert stats["connections"] and {c["tls"] for c in stats["connections"]} == {"TLSv1.3"}
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2},
                "bootstrap_host": "127.0.0.1", "bootstrap_room": 5,
                "bootstrap_port": pre.service.sender.bootstrap_port}  # fmt: skip
        async with asyncio.timeout(20):
            async with s.post(f"{lost.url}/generate", json=body, headers=HEADERS) as r:
                assert r.status == 502
                message = (await r.json())["error"]["message"]
        assert "TLS certificate is not trusted" in message


def test_tls_flags_are_checked_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`prfaas engine` exits 2 with a message naming what is wrong: TLS flags given without
    the other two files, mutual TLS without them, a certificate file that does not exist."""
    ca = CertAuthority.create(tmp_path)
    cert = ca.issue("engine")
    missing = tmp_path / "missing.pem"
    cases = [
        (["--transport-tls-cert", str(cert.cert)],
         "go together: missing --transport-tls-key, --transport-tls-ca"),
        (["--transport-tls-verify-client"], "--transport-tls-verify-client and"),
        (["--transport-tls-cert", str(missing), "--transport-tls-key", str(cert.key),
          "--transport-tls-ca", str(ca.cert)], f"certificate '{missing}' cannot be read"),
    ]  # fmt: skip
    for flags, message in cases:
        assert main(["engine", "--port", "0", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("prfaas engine: error: ") and message in err, err

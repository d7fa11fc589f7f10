"""`prfaas engine` KV-transfer flags: the prefill side's egress rate paces a real transfer
between two engine processes (a token bucket over the whole process), `/transfer_stats`
reports the transport's telemetry and settings, and `/stats` carries its key fields.

Behaviour checks with generous bounds, not a benchmark: the token bucket guarantees a
transfer of B bytes takes at least (B - burst) / rate, whatever the machine's load, so the
lower bound is strict; the upper bound only catches pacing far below the configured rate."""

from __future__ import annotations

import asyncio
import random
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from transformers import PreTrainedModel

from prfaas.cli.main import main
from prfaas.engines.reference.engine_config import TransferConfig
from prfaas.engines.reference.handoff.base import InProcessHub
from prfaas.engines.reference.model.runner import ModelRunner

RATE_MBPS = 8.0
RATE_BYTES = RATE_MBPS * 1e6 / 8
CHUNK_KIB = 64
DELAY_MS = 20.0
PROMPT_TOKENS = 640
READY = "prfaas engine ready: "


def _engine(role: str, log: Path, *extra: str) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "prfaas.cli.main", "engine", "--role", role, "--port", "0",
            "--page-size", "16", "--threads", "1", "--kv-capacity-tokens", "4096",
            *extra]  # fmt: skip
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)


def _ready(proc: subprocess.Popen[str], log: Path) -> tuple[str, int]:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    line = proc.stdout.readline() if ready else ""
    if READY not in line:
        proc.kill()
        raise RuntimeError(f"engine did not start: {line!r}\n{log.read_text()[-2000:]}")
    url = line.split(READY, 1)[1].split()[0]
    return url, int(line.rsplit("bootstrap_port=", 1)[1])


@pytest.fixture(scope="module")
def paced(
    tiny_model: PreTrainedModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """A paced prefill engine (8 Mbit/s, 20 ms, 2 connections) and a decode engine."""
    logs = tmp_path_factory.mktemp("paced-logs")
    flags = ("--egress-rate-mbps", str(RATE_MBPS), "--egress-delay-ms", str(DELAY_MS),
             "--transfer-connections", "2", "--transfer-chunk-kib", str(CHUNK_KIB))  # fmt: skip
    procs = {
        "prefill": _engine("prefill", logs / "prefill.log", *flags),
        "decode": _engine("decode", logs / "decode.log"),
    }
    try:
        yield {role: _ready(p, logs / f"{role}.log") for role, p in procs.items()}
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def _get(s: aiohttp.ClientSession, url: str) -> Any:
    async with s.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def _pd(s: aiohttp.ClientSession, engines: dict[str, Any], prompt: list[int]) -> None:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": engines["prefill"][1],
        "bootstrap_room": random.randrange(2**63),
    }

    async def call(role: str) -> None:
        async with s.post(f"{engines[role][0]}/generate", json=body) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()

    await asyncio.gather(call("prefill"), call("decode"))


async def test_egress_rate_paces_a_real_transfer(paced: dict[str, Any]) -> None:
    """The bytes the prefill engine sent for one prompt took at least (bytes - burst) / rate
    (token bucket), and not wildly longer; telemetry names the configured capacity."""
    prompt = [random.Random(7).randrange(256) for _ in range(PROMPT_TOKENS)]
    stats_url = f"{paced['prefill'][0]}/transfer_stats"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        before = await _get(s, stats_url)
        start = time.monotonic()
        await _pd(s, paced, prompt)
        elapsed = time.monotonic() - start
        after = await _get(s, stats_url)
    sent = after["bytes_total"] - before["bytes_total"]
    assert sent > 4 * CHUNK_KIB * 1024  # a real transfer, several bursts long
    floor = (sent - CHUNK_KIB * 1024) / RATE_BYTES + DELAY_MS / 1000
    assert elapsed >= floor * 0.97, (elapsed, floor, sent)
    assert elapsed <= 3 * sent / RATE_BYTES + 10, (elapsed, sent)
    assert after["capacity_bytes_per_s"] == pytest.approx(RATE_BYTES)
    assert after["egress_rate_bytes_per_s"] == pytest.approx(RATE_BYTES)
    assert after["egress_delay_s"] == pytest.approx(DELAY_MS / 1000)


async def test_transfer_stats_fields_and_stats_summary(paced: dict[str, Any]) -> None:
    """`/transfer_stats` has the telemetry fields and one TCP_INFO sample per connection of
    the decode peer; `/stats` carries the key numbers; utilisation stays within the cap."""
    prompt = [random.Random(8).randrange(256) for _ in range(160)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        await _pd(s, paced, prompt)
        t = await _get(s, f"{paced['prefill'][0]}/transfer_stats")
        stats = await _get(s, f"{paced['prefill'][0]}/stats")
        decode = await _get(s, f"{paced['decode'][0]}/transfer_stats")
    for key in ("at", "egress_bytes_per_s", "window_s", "bytes_total", "utilisation",
                "retransmission_rate", "rtt_s", "resent_bytes", "peers",
                "active_transfers"):  # fmt: skip
        assert key in t, key
    assert t["role"] == "prefill" and t["peers"] == 1 and t["connections_per_peer"] == 2
    assert len(t["connections"]) == 2 and all(c["bytes_sent"] > 0 for c in t["connections"])
    assert t["rtt_s"] is not None and t["rtt_s"] >= 0 and t["retransmission_rate"] >= 0
    assert 0 <= t["utilisation"] <= 1.5  # a one-second window over a paced sender
    assert stats["kv_egress_bytes_total"] >= t["bytes_total"] > 0
    assert stats["kv_egress_capacity_bytes_per_s"] == pytest.approx(RATE_BYTES)
    for key in ("kv_egress_bytes_per_s", "kv_egress_utilisation", "kv_transfer_rtt_s",
                "kv_retransmission_rate", "kv_transfers_active"):  # fmt: skip
        assert key in stats, key
    assert decode["bytes_total"] == 0 and decode["capacity_bytes_per_s"] is None


async def test_in_process_handoff_has_no_transfer_stats(tiny_runner: ModelRunner) -> None:
    """An engine without a transport answers `/transfer_stats` with a JSON 404."""
    from engine_harness import engine_server

    async with (
        engine_server(tiny_runner, InProcessHub()) as eng,
        aiohttp.ClientSession() as s,
        s.get(f"{eng.url}/transfer_stats") as resp,
    ):
        assert resp.status == 404
        body = await resp.json()
    assert body["error"]["code"] == "no_transport" and body["error"]["message"]


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--egress-rate-mbps", "0"), ("--egress-capacity-mbps", "-1"),
     ("--egress-delay-ms", "20000"), ("--transfer-connections", "0"), ("--gil-switch-ms", "0")],
)  # fmt: skip
def test_bad_transfer_flags_exit_2_naming_the_value(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rejected before the model loads: exit code 2 and a message naming flag and value."""
    assert main(["engine", flag, value]) == 2
    err = capsys.readouterr().err
    assert "prfaas engine: error" in err and value.lstrip("-") in err


def test_transfer_config_maps_to_a_process_wide_sender_config() -> None:
    """The egress rate is the process's pacing rate (shared by every decode peer), not a
    per-peer one; capacity defaults to it; bad values name themselves."""
    cfg = TransferConfig(3, 65536, egress_rate_bytes_per_s=1e6, egress_delay_s=0.02)
    sender = cfg.sender_config("127.0.0.1", 0)
    assert sender.process_rate_bytes_per_s == 1e6 and sender.rate_bytes_per_s is None
    assert sender.capacity == 1e6 and sender.delay_s == 0.02
    assert (sender.connections, sender.chunk_bytes) == (3, 65536)
    with pytest.raises(ValueError, match=r"chunk_bytes.*100"):
        TransferConfig(chunk_bytes=100)
    with pytest.raises(ValueError, match=r"egress_rate_bytes_per_s.*-5"):
        TransferConfig(egress_rate_bytes_per_s=-5)

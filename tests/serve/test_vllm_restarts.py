"""`VLLMRestarts`' fallbacks, each over real vLLM servers (the tiny checkpoint), none of which
loses the engine: with standbys off no standby is ever spawned and a restart is cold on the
same ports; a standby that cannot be spawned is logged and the started engine serves on; a
standby that dies unseen before `go` falls back to a cold start on the same ports; a restart
whose log cannot be moved is still the standby's, logging where it was; a standby on other
ports than a restart asks for is stopped, and the restart is cold on the asked ports; a
standby spawned before its engine was converted starts in the engine's new role. The
warm and the dead-standby paths through `prfaas serve` are in `test_serve_vllm_supervision`.
Slow: each vLLM start takes 15-30 s here."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from serve_live_helpers import get
from vllm_helpers import MODEL, VLLM_PYTHON, require_vllm, server

from prfaas.common.ports import free_port
from prfaas.engines.vllm.standby import GO, READY
from prfaas.gateway.deployment import LaunchConfig, ModelConfig
from prfaas.serve.processes import EngineProcess, EngineSpec
from prfaas.serve.vllm_engines import VLLMRestarts, cache_block_size, start_vllm
from prfaas.testing.tiny_checkpoint import TINY_BLOCK_SIZE

pytestmark = pytest.mark.timeout(900)

SERVED = "tiny"
MODEL_CONFIG = ModelConfig(SERVED, block_size=TINY_BLOCK_SIZE)


def _launch(**kw: object) -> LaunchConfig:
    fields: dict[str, object] = {"model": str(MODEL), "python": str(VLLM_PYTHON), **kw}
    return LaunchConfig("pd-d0", "pd", "decode", engine="vllm", **fields)  # type: ignore[arg-type]


async def _serves(engine: EngineProcess) -> None:
    """A greedy completion from the engine itself."""
    await asyncio.to_thread(_complete, engine.url)


def _complete(url: str) -> None:
    body = {"model": SERVED, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert json.load(reply)["usage"]["completion_tokens"] == 2


Running = list[EngineProcess | VLLMRestarts]


@pytest.fixture
async def running() -> AsyncIterator[Running]:
    """What a test starts (engines, and restarters with their standbys), stopped at its end
    whatever happened."""
    require_vllm()
    started: Running = []
    yield started
    for each in started:
        await each.stop()


async def test_standbys_off_or_unspawnable(tmp_path: Path, running: Running,
                                           caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    off = _launch(vllm_standby=False)
    first = await start_vllm(off, MODEL_CONFIG, tmp_path)
    running.append(first)
    restarts = VLLMRestarts(off, MODEL_CONFIG, tmp_path, {})
    running.append(restarts)
    await restarts.prepare(first)
    assert restarts.standby is None

    broken = VLLMRestarts(_launch(python=str(tmp_path / "no-vllm/bin/python")), MODEL_CONFIG,
                          tmp_path, {})  # fmt: skip
    running.append(broken)
    await broken.prepare(first)  # logged, never raised
    assert broken.standby is None
    assert "pd-d0: no standby (pd-d0: no vLLM environment at" in caplog.text
    await _serves(first)

    await first.stop()
    second = await restarts(first.spec, "pd-d0.1")
    running.append(second)
    assert (second.port, second.bootstrap_port) == (first.port, first.bootstrap_port)
    assert restarts.standby is None
    await _serves(second)


async def test_failed_and_mismatched_standbys_fall_back(
    tmp_path: Path, running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    launch = _launch()
    restarts = VLLMRestarts(launch, MODEL_CONFIG, tmp_path, {})
    running.append(restarts)
    first = await start_vllm(launch, MODEL_CONFIG, tmp_path)
    running.append(first)
    await restarts.prepare(first)
    doomed = restarts.standby
    assert doomed is not None

    # Dies unseen: no await between the kill and the restart, so the restart finds it
    # "alive" on the right ports, and `go` (or its wait for /health) fails.
    await first.stop()
    os.killpg(doomed.process.pid, signal.SIGKILL)
    second = await restarts(first.spec, "pd-d0.1")
    running.append(second)
    assert second.process.pid != doomed.process.pid
    assert "engine pd-d0: its standby did not start" in caplog.text  # tried, then cold
    assert (second.port, second.bootstrap_port) == (first.port, first.bootstrap_port)
    await _serves(second)

    # A log that cannot be moved: the standby serves, and goes on logging where it was.
    warm = restarts.standby
    assert warm is not None and warm.serves(second.spec)
    await second.stop()
    third = await restarts(second.spec, "no-such-dir/pd-d0.2")
    running.append(third)
    assert third.process.pid == warm.process.pid and third.log == warm.log
    await _serves(third)

    # A standby on other ports than asked: stopped; the restart is cold on the asked ports.
    stale = restarts.standby
    assert stale is not None
    await third.stop()
    moved = EngineSpec("pd-d0", "decode", str(MODEL), port=free_port(),
                       bootstrap_port=free_port())  # fmt: skip
    fourth = await restarts(moved, "pd-d0.3")
    running.append(fourth)
    assert stale.process.returncode is not None
    assert (fourth.port, fourth.bootstrap_port) == (moved.port, moved.bootstrap_port)
    await _serves(fourth)

    # A standby spawned before its engine was converted: it starts in the role asked.
    decode = restarts.standby
    assert decode is not None and decode.serves(fourth.spec)
    await fourth.stop()
    converted = dataclasses.replace(fourth.spec, role="prefill")
    fifth = await restarts(converted, "pd-d0.4")
    running.append(fifth)
    assert fifth.process.pid == decode.process.pid and fifth.spec.role == "prefill"
    assert get(f"{fifth.url}/health")["role"] == "prefill"
    await _serves(fifth)


def test_a_standby_told_an_unknown_role_exits_2(tmp_path: Path) -> None:
    """`go ROLE` with a role vLLM's role middleware would refuse: the standby exits 2 at once,
    naming it, before it starts a server (its supervisor then starts the engine afresh)."""
    require_vllm()
    spec = server("standby")  # the command line a supervisor spawns a standby with
    standby = subprocess.Popen(
        spec.command(standby=True), env=spec.env(),
        stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )  # fmt: skip
    before = []
    try:
        assert standby.stderr is not None
        for line in standby.stderr:  # until vLLM is imported
            before.append(line)
            if READY in line:
                break
        _, err = standby.communicate(f"{GO} mixed\n", timeout=60)
    finally:
        standby.kill()
        standby.wait()
    assert standby.returncode == 2 and "no role 'mixed'" in err, "".join(before) + err


async def test_an_engine_paging_in_another_block_size_does_not_start(
    tmp_path: Path, running: Running
) -> None:
    """vLLM raises a block size the hybrid model's Mamba state does not fit in; the start
    fails naming both sizes, not an index that ignores every event later."""
    with pytest.raises(RuntimeError, match=r"pages in \d+-token blocks, not the deployment's "
                       r"\[model\] block_size 64"):  # fmt: skip
        await start_vllm(_launch(vllm_standby=False), ModelConfig(SERVED, block_size=64), tmp_path)


def test_the_block_size_vllm_reports() -> None:
    line = 'vllm:cache_config_info{block_size="384",cache_dtype="auto",engine="0"} 1.0'
    assert cache_block_size(f"# HELP x\n{line}\n") == 384
    assert cache_block_size("vllm:num_requests_running 0.0\n") is None

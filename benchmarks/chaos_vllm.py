"""chaos.py's `--engines vllm` pieces: the deployment `prfaas serve` launches (vLLM servers
of the tiny checkpoint running the PrfaaS connector: a PrfaaS-cluster prefill, a PD prefill
and two PD decodes), the aggregated vLLM server (no connector) the unfailed greedy answers
come from, and the timing of an engine's comeback (death -> the supervisor's new process ->
vLLM's `/health`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from prfaas.common.ports import free_port
from prfaas.engines.vllm.launch import VLLMProcess, VLLMServer, start_servers
from prfaas.testing.launch_tables import vllm_launch
from prfaas.testing.tiny_checkpoint import TINY_BLOCK_SIZE

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("PRFAAS_VLLM_PYTHON", ROOT / ".venv-vllm/bin/python"))
VLLM_MODEL = Path(os.environ.get("PRFAAS_VLLM_MODEL", ROOT / ".cache/tiny-qwen3-next"))
UNRESPONSIVE_RESTART_S = 8.0
"""`[gateway] unresponsive_restart_s` of the benchmark's deployment (30 s by default): low
enough that the long stops exercise the kill-and-restart path."""
LONG_STOP_S = 30.0
"""Every other stop lasts this long: past ejection (3 failed probes) plus the grace."""
ENGINES = (
    ("prfaas-p0", "prfaas", "prefill"),
    ("pd-p0", "pd", "prefill"),
    ("pd-d0", "pd", "decode"),
    ("pd-d1", "pd", "decode"),
)


def deployment(model_name: str, threshold: float, python: Path, model: Path) -> str:
    """The deployment file: the tiny checkpoint on four launched vLLM engines."""
    paced = "egress_rate_mbps = 200\negress_delay_ms = 2\n"
    launches = "".join(
        vllm_launch(name, cluster, role, model, python, paced if cluster == "prfaas" else "")
        for name, cluster, role in ENGINES
    )
    return f"""
[model]
name = "{model_name}"
tokenizer = "{model}"
context_length = 4096
block_size = {TINY_BLOCK_SIZE}
vocab_size = 384

[gateway]
policy = "prfaas"
threshold = {threshold}
health_interval_s = 1.0
unresponsive_restart_s = {UNRESPONSIVE_RESTART_S}
{launches}"""


def write_deployment(model_name: str, threshold: float, python: Path, model: Path) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="prfaas-chaos-vllm-"))
    path = folder / "deploy.toml"
    path.write_text(deployment(model_name, threshold, python, model))
    return path


def start_aggregated(model_name: str, python: Path, model: Path) -> VLLMProcess:
    """One vLLM server of the same checkpoint without a connector (blocking until it answers
    `/health`): P/D greedy output equals an aggregated server's
    (tests/engines/vllm/test_vllm_short_prompts.py)."""
    server = VLLMServer(python, model, free_port(), model_name, block_size=TINY_BLOCK_SIZE)
    log_dir = Path(tempfile.mkdtemp(prefix="prfaas-chaos-aggregated-"))
    return start_servers({"aggregated": server}, log_dir, timeout_s=900)["aggregated"]


@dataclass
class Comeback:
    """After an engine's death: when the supervisor's new process appeared (from a standby
    spawned ahead of need, vLLM already imported: its EngineCore, started once the
    supervisor told it to serve) and when vLLM answered `/health` on it (seconds from the
    death; None: not seen within the limit)."""

    respawn_s: float | None = None
    health_s: float | None = None

    @property
    def start_s(self) -> float | None:
        """vLLM's own start: from the new process to `/health`."""
        if self.respawn_s is None or self.health_s is None:
            return None
        return round(self.health_s - self.respawn_s, 2)


async def watch_comeback(
    new_pid: Callable[[], int | None], engine_url: str, died: float, limit_s: float = 300.0
) -> Comeback:
    """Poll `new_pid()` (the engine's process, None or the dead one's id while none) until
    it names a new process, then the engine's `/health` until it answers 200."""
    out = Comeback()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while time.monotonic() - died < limit_s:
            if out.respawn_s is None:
                if new_pid() is not None:
                    out.respawn_s = round(time.monotonic() - died, 2)
            else:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(f"{engine_url}/health") as r:
                        if r.status == 200:
                            out.health_s = round(time.monotonic() - died, 2)
                            return out
            await asyncio.sleep(0.1)
    return out

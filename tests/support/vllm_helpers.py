"""vLLM servers for the tests: the vLLM environment (`make vllm-env`), the tiny checkpoint
(built here if missing), servers started in parallel and awaited, stopped by process group."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from prfaas.common.ports import free_port
from prfaas.engines.vllm.launch import VLLMProcess, VLLMServer, start_servers
from prfaas.testing.tiny_checkpoint import TINY_BLOCK_SIZE

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("PRFAAS_VLLM_PYTHON", ROOT / ".venv-vllm/bin/python"))
MODEL = Path(os.environ.get("PRFAAS_VLLM_MODEL", ROOT / ".cache/tiny-qwen3-next"))
DENSE_MODEL = Path(os.environ.get("PRFAAS_VLLM_DENSE_MODEL", ROOT / ".cache/tiny-qwen3-dense"))
"""The dense twin of the tiny checkpoint (`dense_model`)."""


def require_vllm() -> None:
    """Fail (never skip) when the vLLM environment is missing; build the checkpoint if
    needed (a few seconds)."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"no vLLM environment at {VLLM_PYTHON}: run `make vllm-env` (make test does)")
    if not (MODEL / "config.json").exists():
        subprocess.run(
            [str(VLLM_PYTHON), "-m", "prfaas.testing.tiny_checkpoint", str(MODEL)],
            check=True,
            cwd=ROOT,
        )


def dense_model() -> Path:
    """The tiny checkpoint's dense twin (all layers full attention), built if missing."""
    if not (DENSE_MODEL / "config.json").exists():
        subprocess.run(
            [str(VLLM_PYTHON), "-m", "prfaas.testing.tiny_checkpoint", str(DENSE_MODEL),
             "--dense"],
            check=True,
            cwd=ROOT,
        )  # fmt: skip
    return DENSE_MODEL


def server(_name: str, connector: Mapping[str, Any] | None = None, **kw: Any) -> VLLMServer:
    """A server of the tiny model (served as "tiny", paged in `TINY_BLOCK_SIZE`-token blocks)
    on fresh ports (and a fresh bootstrap port when it runs the connector)."""
    if connector is not None:
        connector = {"bootstrap_port": free_port(), **connector}
    kw.setdefault("block_size", TINY_BLOCK_SIZE)
    return VLLMServer(VLLM_PYTHON, MODEL, free_port(), "tiny", connector=connector, **kw)


def start_all(servers: Mapping[str, VLLMServer], log_dir: Path) -> dict[str, VLLMProcess]:
    """Start the servers at once; a failed start fails the test (with the log's tail)."""
    try:
        return start_servers(servers, log_dir)
    except RuntimeError as exc:
        pytest.fail(str(exc))


def stop_all(running: Mapping[str, VLLMProcess]) -> None:
    for proc in running.values():
        proc.stop()


def gauge(url: str, name: str, headers: Mapping[str, str] | None = None) -> float:
    """One of vLLM's Prometheus gauges or counters (summed over label sets); `headers`: the
    control token, for a server `prfaas serve` launched."""
    request = urllib.request.Request(f"{url}/metrics", headers=dict(headers or {}))
    with urllib.request.urlopen(request, timeout=30) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def serve_listening(proc: subprocess.Popen[str], log: Path, timeout_s: float = 600) -> str:
    """The URL of a `prfaas serve` child once it serves (its engines started), read from
    its log; fails the test if it exits or takes longer than `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"prfaas serve exited: {log.read_text()[-3000:]}")
        text = log.read_text()
        if "stops the gateway" in text:
            line = next(x for x in text.splitlines() if "gateway listening on" in x)
            return line.split("listening on ")[1].split()[0]
        time.sleep(0.5)
    pytest.fail(f"prfaas serve not ready in time: {log.read_text()[-3000:]}")


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The JSON lines a connector's `trace_path` collected."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def completion(url: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    """POST `/v1/completions` (blocking); the parsed answer."""
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as r:
        answer: dict[str, Any] = json.loads(r.read())
    return answer


def wait_until(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what}")


_GREEDY = """
import json, sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
out = []
for ids in json.load(sys.stdin)["prompts"]:
    with torch.no_grad():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=int(sys.argv[2]),
                             do_sample=False, min_new_tokens=int(sys.argv[2]))
    out.append(gen[0, len(ids):].tolist())
print(json.dumps(out))
"""


def transformers_greedy(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy ids of the checkpoint under `transformers` (the vLLM environment's): an
    engine-independent reference."""
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", _GREEDY, str(MODEL), str(max_tokens)],
        input=json.dumps({"prompts": prompts}), capture_output=True, text=True, check=True,
        timeout=600,
    )  # fmt: skip
    result: list[list[int]] = json.loads(done.stdout.splitlines()[-1])
    return result

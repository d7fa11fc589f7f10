#!/usr/bin/env python
"""Download the wheels the GPU machine lacks (CPython 3.12, manylinux x86_64) into
`.cache/gpu-wheels/` (ignored by git; the device tool carries it), and check they fit.

The machine has CUDA torch, numpy, aiohttp, uvloop, xxhash and tokenizers, and no network.
The reference engine also imports orjson, msgspec, llguidance (structured outputs), pyzmq
(KV events) and jinja2 (chat templates); the Table 3 presets need a `transformers` that
knows every architecture (`qwen3_5_text`, `kimi_linear`, `mimo_v2_flash`,
`bailing_hybrid`), which brings its pinned tokenizers, safetensors, huggingface_hub (and
the HTTP client it imports) and regex; `flash-linear-attention` + `fla-core` (+ einops) are
the linear-attention kernels (Triton). Exact versions, so every session carries the same
bytes.

    python scripts/gpu_wheels.py            # prints each wheel and the total; exit 1 if > 48 MiB
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / ".cache" / "gpu-wheels"
LIMIT_BYTES = 48 * 2**20
PINS = (
    "orjson==3.13.0", "msgspec==0.23.0", "llguidance==1.9.1", "pyzmq==27.3.0",
    "jinja2==3.1.6", "markupsafe==3.0.3",
    "transformers==5.24.0", "tokenizers==0.23.3", "safetensors==0.8.0",
    "huggingface_hub==2.4.0", "httpx2==2.16.2", "httpcore2==2.16.2", "regex==2026.11.19",
    "anyio==4.16.0", "h11==0.16.0", "sniffio==1.3.1", "idna==3.20", "truststore==0.10.5",
    "flash-linear-attention==0.6.0", "fla-core==0.6.0", "einops==0.8.1",
)  # fmt: skip
PLATFORMS = ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "any")  # fmt: skip


def download(pins: tuple[str, ...], into: Path) -> None:
    """`pip download` the exact wheels for the GPU machine's interpreter, no dependencies
    (the pins are the closure the machine lacks)."""
    into.mkdir(parents=True, exist_ok=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
           "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
           *platforms, "--dest", str(into), *pins]  # fmt: skip
    subprocess.run(cmd, check=True)


def main() -> int:
    download(PINS, WHEELS)
    wheels = sorted(WHEELS.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:7.2f} MiB  {wheel.name}")
    print(f"{total / 2**20:7.2f} MiB  total in {WHEELS} (limit {LIMIT_BYTES / 2**20:.0f} MiB)")
    return 0 if total <= LIMIT_BYTES else 1


if __name__ == "__main__":
    sys.exit(main())

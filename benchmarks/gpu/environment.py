#!/usr/bin/env python
"""What a GPU run ran on: the device, its driver, torch and CUDA, the libraries the
reference engine and the Table 3 presets use (version and where each was imported from, so
a carried wheel shows against the machine's own), and the fast kernels `transformers`
found.

    python benchmarks/gpu/environment.py --device cuda --json env.json
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

LIBRARIES = {
    "torch": "torch", "transformers": "transformers", "triton": "triton",
    "fla": "flash-linear-attention", "fla_core": "fla-core", "tokenizers": "tokenizers",
    "safetensors": "safetensors", "huggingface_hub": "huggingface_hub", "numpy": "numpy",
    "aiohttp": "aiohttp", "uvloop": "uvloop", "orjson": "orjson", "msgspec": "msgspec",
    "llguidance": "llguidance", "zmq": "pyzmq", "xxhash": "xxhash", "jinja2": "jinja2",
    "causal_conv1d": "causal-conv1d",
}  # fmt: skip
"""Import name -> distribution name."""


def library(module: str, distribution: str) -> dict[str, Any]:
    """Version and origin of one library, or why it is missing."""
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # a missing or broken library is a finding, not a crash
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    version: str | None
    try:
        version = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        version = getattr(mod, "__version__", None)
    return {"version": version, "from": str(Path(getattr(mod, "__file__", "") or "?").parent)}


def device_info(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"requested": device, "cuda_available": torch.cuda.is_available(),
                            "cuda_runtime": torch.version.cuda}  # fmt: skip
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device))
        info |= {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
            "driver": _driver(),
        }
    return info


def _driver() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    query = [smi, "--query-gpu=driver_version", "--format=csv,noheader"]
    out = subprocess.run(query, capture_output=True, text=True, timeout=20, check=False)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None


def kernels() -> dict[str, Any]:
    """The fast paths `transformers` reports for linear attention."""
    from transformers.utils import import_utils

    found = {}
    for name in ("is_flash_linear_attention_available", "is_causal_conv1d_available"):
        check = getattr(import_utils, name, None)
        found[name.removeprefix("is_").removesuffix("_available")] = (
            bool(check()) if check is not None else None
        )
    return found


def environment(device: str, carried: Path | None) -> dict[str, Any]:
    wheels = sorted(carried.glob("*.whl")) if carried is not None and carried.is_dir() else []
    report: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "device": device_info(device),
        "libraries": {m: library(m, d) for m, d in LIBRARIES.items()},
        "carried": [{"wheel": w.name, "bytes": w.stat().st_size} for w in wheels],
        "carried_bytes": sum(w.stat().st_size for w in wheels),
    }
    try:
        report["kernels"] = kernels()
    except Exception as exc:
        report["kernels"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--carried", type=Path, help="the folder of wheels brought along")
    p.add_argument("--json", type=Path)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    report = environment(args.device, args.carried)
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

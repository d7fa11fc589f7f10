"""Benchmark: how long a launched vLLM engine takes to serve again, started afresh against
started from its standby (`prfaas.engines.vllm.standby`: vLLM imported ahead of need), on
the tiny hybrid checkpoint (`make vllm-env vllm-model`).

Each round stops the engine and starts it again on its ports twice, alternating which goes
first: once cold (`vllm_engines.start_vllm`, as `vllm_standby = false` does) and once
through `vllm_engines.VLLMRestarts` after its standby has finished importing, as the
supervisor does after a death. Each start is timed from the call to `/health` answering
200. The standby the warm start spawns for the next one is stopped before the next start,
so no import runs beside a measured start.
Usage: python benchmarks/vllm_restart.py [--runs 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import orjson
from rich.console import Console
from rich.table import Table

from prfaas.gateway.deployment import LaunchConfig, ModelConfig
from prfaas.serve.processes import EngineProcess
from prfaas.serve.vllm_engines import VLLMRestarts, start_vllm
from prfaas.testing.tiny_checkpoint import TINY_BLOCK_SIZE

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("PRFAAS_VLLM_PYTHON", ROOT / ".venv-vllm/bin/python"))
VLLM_MODEL = Path(os.environ.get("PRFAAS_VLLM_MODEL", ROOT / ".cache/tiny-qwen3-next"))
SERVED = ModelConfig("model", block_size=TINY_BLOCK_SIZE)
IMPORTED = "prfaas standby: vLLM imported"
"""What a standby prints once it waits (`standby.py`)."""


async def _imported(log: Path, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while IMPORTED not in await asyncio.to_thread(log.read_text, errors="replace"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the standby did not finish its import (log {log})")
        await asyncio.sleep(0.2)


async def _timed_cold(launch: LaunchConfig, log_dir: Path, engine: EngineProcess, name: str
                      ) -> tuple[EngineProcess, float]:  # fmt: skip
    await engine.stop()
    t0 = time.monotonic()
    engine = await start_vllm(launch, SERVED, log_dir, engine.spec, name)
    return engine, time.monotonic() - t0


async def _timed_warm(restarts: VLLMRestarts, engine: EngineProcess, name: str
                      ) -> tuple[EngineProcess, float]:  # fmt: skip
    await restarts.prepare(engine)
    assert restarts.standby is not None, "no standby was spawned"
    await _imported(restarts.standby.log)
    await engine.stop()
    t0 = time.monotonic()
    engine = await restarts(engine.spec, name)
    took = time.monotonic() - t0
    await restarts.stop()  # the standby for the start after this one: not beside the next
    return engine, took


async def measure(runs: int) -> list[dict[str, float]]:
    launch = LaunchConfig(
        id="bench", cluster="pd", role="decode", engine="vllm", model=str(VLLM_MODEL),
        python=str(VLLM_PYTHON),
    )  # fmt: skip
    log_dir = Path(tempfile.mkdtemp(prefix="prfaas-vllm-restart-"))
    restarts = VLLMRestarts(launch, SERVED, log_dir, env={})
    engine = await start_vllm(launch, SERVED, log_dir)
    rows = []
    try:
        for run in range(runs):
            row: dict[str, float] = {"run": run}
            for kind in ("cold", "standby") if run % 2 == 0 else ("standby", "cold"):
                name = f"{kind}{run}"
                if kind == "cold":
                    engine, row[kind] = await _timed_cold(launch, log_dir, engine, name)
                else:
                    engine, row[kind] = await _timed_warm(restarts, engine, name)
            row["ratio"] = row["standby"] / row["cold"]
            rows.append(row)
            print(f"run {run}: cold {row['cold']:.2f} s, standby {row['standby']:.2f} s",
                  flush=True)  # fmt: skip
    finally:
        await restarts.stop()
        await engine.stop()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", dest="json_out", default=None)
    args = parser.parse_args()
    rows = asyncio.run(measure(args.runs))
    table = Table(title="vLLM engine start to /health: cold against from a standby (s)")
    for column in ("run", "cold", "standby", "standby / cold"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(str(int(row["run"])), f"{row['cold']:.2f}", f"{row['standby']:.2f}",
                      f"{row['ratio']:.2f}")  # fmt: skip
    medians = {k: statistics.median(r[k] for r in rows) for k in ("cold", "standby", "ratio")}
    table.add_row("median", f"{medians['cold']:.2f}", f"{medians['standby']:.2f}",
                  f"{medians['ratio']:.2f}")  # fmt: skip
    Console().print(table)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        out = {"runs": rows, "median": medians}
        Path(args.json_out).write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

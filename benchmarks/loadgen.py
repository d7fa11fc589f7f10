"""Benchmark: the load generator's own capacity and its overhead on TTFT.

Against the null server (`python -m prfaas.testing.null_server`, its own process; it runs no model):
1. throughput: tiny requests (8-32 prompt tokens, 2 output tokens), closed loop at
   concurrency 64 and open loop (Poisson) at 600 req/s; target >= 500 req/s sustained.
2. TTFT overhead: the server sleeps a known 20 ms before the first token. The load
   generator's TTFT is compared with a minimal raw-aiohttp client's on the same server and
   schedule, runs interleaved (loadgen, raw, loadgen, raw, ...), at 50 and 500 req/s.
Every figure is the median over --runs runs. The machine is shared and noisy: read the
side-by-side ratios and differences, not the absolute numbers.
Usage: python benchmarks/loadgen.py [--runs 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import uvloop
from rich.console import Console
from rich.table import Table

from prfaas.loadgen.arrivals import Arrivals, ClosedLoop, RateArrivals
from prfaas.loadgen.spec import BenchSpec, NoProgress
from prfaas.loadgen.targets import HttpOptions, HttpRunner
from prfaas.loadgen.workloads import WorkloadOptions, create_workload
from prfaas.loadgen.workloads.lengths import LogNormalLengths

FIRST_TOKEN_DELAY_S = 0.020
TINY = WorkloadOptions(
    inputs=LogNormalLengths(mu=math.log(16), sigma=0.3, lo=8, hi=32), output_tokens=2
)


@contextmanager
def null_server(first_token_delay: float) -> Iterator[str]:
    """Start the null server in its own process; yield its base URL."""
    cmd = [
        sys.executable,
        "-m",
        "prfaas.testing.null_server",
        "--port",
        "0",
        "--first-token-delay",
        str(first_token_delay),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield proc.stdout.readline().split()[-1]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def loadgen_run(url: str, arrivals: Arrivals, n: int, seed: int) -> dict[str, float]:
    """One load-generator run; req/s, TTFT median, and send lag behind the schedule."""
    plan = BenchSpec(create_workload("lognormal", TINY), arrivals, num_requests=n, seed=seed)
    result = await HttpRunner(url, HttpOptions(model="null")).run(plan, NoProgress())
    ok = [r for r in result.records if r.ok]
    lags = [r.start_s - r.scheduled_s for r in result.records]
    return {
        "req_per_s": len(ok) / result.duration_s,
        "failed": len(result.records) - len(ok),
        "ttft_median_ms": 1e3 * statistics.median(r.ttft_s or 0.0 for r in ok),
        "lag_p99_ms": 1e3 * float(np.percentile(lags, 99)),
    }


async def raw_run(url: str, rate: float, n: int, seed: int) -> dict[str, float]:
    """The baseline: Poisson arrivals, pre-built bodies, read to the first data line."""
    rng = np.random.default_rng(seed)
    times = np.concatenate([[0.0], np.cumsum(rng.exponential(1 / rate, n - 1))])
    bodies = [
        orjson.dumps({"model": "null", "prompt": [100] * 16, "max_tokens": 2, "stream": True})
        for _ in range(n)
    ]
    ttfts: list[float] = []

    async def one(http: aiohttp.ClientSession, body: bytes) -> None:
        start = time.perf_counter()
        async with http.post(f"{url}/v1/completions", data=body) as resp:
            async for line in resp.content:
                if line.startswith(b"data:"):
                    ttfts.append(time.perf_counter() - start)
                    break
            await resp.read()

    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        t0, tasks = loop.time(), []
        for at, body in zip(times, bodies, strict=True):
            if (delay := t0 + at - loop.time()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(http, body)))
        await asyncio.gather(*tasks)
    return {"ttft_median_ms": 1e3 * statistics.median(ttfts)}


def _median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def throughput(runs: int, n: int) -> list[dict[str, Any]]:
    rows = []
    with null_server(0.0) as url:
        for label, arrivals in (
            ("closed loop, concurrency 64", ClosedLoop(64)),
            ("open loop, Poisson 600 req/s", RateArrivals(600.0)),
        ):
            res = [uvloop.run(loadgen_run(url, arrivals, n, s)) for s in range(runs)]
            rows.append(
                {
                    "mode": label,
                    "requests": n,
                    "runs": runs,
                    "req_per_s_median": _median(res, "req_per_s"),
                    "req_per_s_runs": [r["req_per_s"] for r in res],
                    "send_lag_p99_ms_median": _median(res, "lag_p99_ms"),
                    "failed": sum(r["failed"] for r in res),
                }
            )
    return rows


def ttft_overhead(runs: int, rates: tuple[float, ...], seconds: float) -> list[dict[str, Any]]:
    rows = []
    with null_server(FIRST_TOKEN_DELAY_S) as url:
        for rate in rates:
            n = int(rate * seconds)
            ours, raw = [], []
            for s in range(runs):  # interleaved: both see the same machine noise
                ours.append(uvloop.run(loadgen_run(url, RateArrivals(rate), n, s)))
                raw.append(uvloop.run(raw_run(url, rate, n, s)))
            mine = [r["ttft_median_ms"] for r in ours]
            base = [r["ttft_median_ms"] for r in raw]
            diffs = [x - y for x, y in zip(mine, base, strict=True)]
            rows.append(
                {
                    "rate": rate,
                    "requests": n,
                    "runs": runs,
                    "server_first_token_delay_ms": FIRST_TOKEN_DELAY_S * 1e3,
                    "loadgen_ttft_median_ms_runs": mine,
                    "raw_ttft_median_ms_runs": base,
                    "overhead_ms_runs": diffs,
                    "overhead_ms_median": statistics.median(diffs),
                    "loadgen_send_lag_p99_ms_median": _median(ours, "lag_p99_ms"),
                }
            )
    return rows


def _runs(values: list[float], spec: str = ".2f") -> str:
    return " ".join(f"{v:{spec}}" for v in values)


def render(tp: list[dict[str, Any]], oh: list[dict[str, Any]]) -> None:
    console = Console(width=140)
    t = Table(title="load generator throughput vs null server (tiny requests, target >= 500)")
    for col in ("mode", "requests", "median req/s", "runs req/s", "p99 send lag ms", "failed"):
        t.add_column(col)
    for r in tp:
        t.add_row(
            r["mode"],
            str(r["requests"]),
            f"{r['req_per_s_median']:.0f}",
            " ".join(f"{x:.0f}" for x in r["req_per_s_runs"]),
            f"{r['send_lag_p99_ms_median']:.1f}",
            str(r["failed"]),
        )
    console.print(t)
    t = Table(
        title=f"TTFT: load generator vs raw aiohttp (server delay "
        f"{FIRST_TOKEN_DELAY_S * 1e3:.0f} ms): each run's median TTFT, runs paired"
    )
    cols = (
        "rate req/s",
        "requests",
        "loadgen TTFT ms",
        "raw TTFT ms",
        "overhead ms",
        "median overhead ms",
        "p99 send lag ms",
    )
    for col in cols:
        t.add_column(col)
    for r in oh:
        t.add_row(
            f"{r['rate']:.0f}",
            str(r["requests"]),
            _runs(r["loadgen_ttft_median_ms_runs"]),
            _runs(r["raw_ttft_median_ms_runs"]),
            _runs(r["overhead_ms_runs"], "+.2f"),
            f"{r['overhead_ms_median']:+.2f}",
            f"{r['loadgen_send_lag_p99_ms_median']:.1f}",
        )
    console.print(t)
    console.print(
        "Shared, noisy 2-core machine: server and client share the cores; compare side by side."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--requests", type=int, default=3000, help="per throughput run")
    parser.add_argument("--seconds", type=float, default=4.0, help="per TTFT run")
    parser.add_argument("--json", type=Path, metavar="OUT")
    args = parser.parse_args()
    tp = throughput(args.runs, args.requests)
    oh = ttft_overhead(args.runs, (50.0, 500.0), args.seconds)
    render(tp, oh)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "benchmark": "loadgen",
            "target_req_per_s": 500,
            "throughput": tp,
            "ttft_overhead": oh,
        }
        args.json.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()

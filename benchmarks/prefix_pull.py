"""Benchmark: a prefix pull between reference engines over the real KV transport, against the
simulator's model of it.

The simulator (`SimulatedPrefillEngine._fetch_prefix`) charges the pull of an n-token prefix
cached in the other cluster as S_kv(n) bytes over the link (until 2026-12-01: S_kv(n) -
S_kv(c), c the tokens the puller caches, which this benchmark showed to be short); S_kv is
the profile's KV size, which start-up profiling measures as what a PD hand-off of n tokens
sends. On one paced link, for a few n, this measures side by side (fresh random prompts:
nothing is cached anywhere before):
- S_kv(n): what the prefill's transport sent for a PD hand-off of an (n+1)-token prompt;
- the pull of that prompt's cached n-token prefix into a third engine: what the same
  transport sent (its egress counter), and how long the export took (it answers once the
  puller has it all);
then prints the pull's bytes against S_kv(n) (the simulator's charge) and against the old
charge S_kv(n) - S_kv(0), and its duration against bytes / rate. Medians of `--runs`.
Usage: python benchmarks/prefix_pull.py [--rate-mbps 100] [--lengths 512,2048,8192]
       [--runs 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from prfaas.engines.reference.engine_config import EngineConfig, TransferConfig
from prfaas.engines.reference.server.main import LaunchOptions, build_app
from prfaas.policies.tables import PiecewiseLinear

BLOCK = 64
ONE_TOKEN = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}


@contextlib.asynccontextmanager
async def engine(model: str, role: str, rate: float | None) -> AsyncIterator[Any]:
    """A reference engine (`prfaas engine`'s wiring) on real sockets; its KV transport paced
    at `rate` bytes/s."""
    config = EngineConfig(block_size=BLOCK, kv_capacity_tokens=65536, role=role)
    options = LaunchOptions(model, port=0, engine=config,
                            transfer=TransferConfig(egress_rate_bytes_per_s=rate))  # fmt: skip
    app, service = build_app(options)
    app_runner = web.AppRunner(app, access_log=None)
    await app_runner.setup()
    await web.TCPSite(app_runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{app_runner.addresses[0][1]}", service.sender.bootstrap_port
    finally:
        await app_runner.cleanup()


async def post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with s.post(url, data=orjson.dumps(body)) as resp:
        answer = await resp.json(content_type=None)
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {answer}")
        return answer


async def sent(s: aiohttp.ClientSession, url: str) -> int:
    async with s.get(f"{url}/transfer_stats") as resp:
        return int((await resp.json())["bytes_total"])


async def one_run(s: aiohttp.ClientSession, urls: dict[str, Any], n: int) -> dict[str, float]:
    """A PD hand-off of an (n+1)-token prompt, then a pull of its n-token prefix."""
    (p_url, p_port), (d_url, _), (b_url, _) = urls["prefill"], urls["decode"], urls["puller"]
    prompt = [random.randrange(1, 256) for _ in range(n + 1)]
    room = random.randrange(2**63)
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": p_port, "bootstrap_room": room}
    body = {"input_ids": prompt, "sampling_params": ONE_TOKEN, **boot}
    before = await sent(s, p_url)
    await asyncio.gather(post(s, f"{d_url}/generate", body), post(s, f"{p_url}/generate", body))
    handoff = await sent(s, p_url) - before
    room = random.randrange(2**63)
    pull = {"input_ids": prompt, "sampling_params": ONE_TOKEN,
            "prefix_pull": {"host": "127.0.0.1", "port": p_port, "room": room}}  # fmt: skip
    before = await sent(s, p_url)
    start = time.perf_counter()
    export = post(s, f"{p_url}/kv/export", {"input_ids": prompt, "room": room})
    exported, answer = await asyncio.gather(export, post(s, f"{b_url}/generate", pull))
    seconds = time.perf_counter() - start
    pulled = await sent(s, p_url) - before
    if exported["prefix_tokens"] != n or answer["meta_info"]["cached_tokens"] != n:
        raise RuntimeError(f"expected an {n}-token prefix, got {exported} / {answer['meta_info']}")
    return {"handoff_bytes": handoff, "pull_bytes": pulled, "pull_s": seconds}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    rate = args.rate_mbps * 1e6 / 8
    lengths = [int(x) for x in args.lengths.split(",")]
    async with (
        engine(args.model, "prefill", rate) as prefill,
        engine(args.model, "decode", None) as decode,
        engine(args.model, "both", None) as puller,
        aiohttp.ClientSession() as s,
    ):
        urls = {"prefill": prefill, "decode": decode, "puller": puller}
        await one_run(s, urls, BLOCK)  # warm-up
        runs = {n: [await one_run(s, urls, n) for _ in range(args.runs)] for n in lengths}
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items()}
    s_kv = PiecewiseLinear(tuple(float(n) for n in lengths),
                           tuple(med[n]["handoff_bytes"] for n in lengths))  # fmt: skip
    rows = []
    for n in lengths:
        m = med[n]
        old = float(s_kv(n)) - float(s_kv(0))  # the simulator's old charge, nothing cached
        link_s = m["pull_bytes"] / rate
        rows.append({"prefix_tokens": n, **m, "old_charge_bytes": old, "link_s": link_s,
                     "pull_vs_skv": m["pull_bytes"] / m["handoff_bytes"],
                     "pull_vs_old_charge": m["pull_bytes"] / old,
                     "pull_s_vs_link_s": m["pull_s"] / link_s})  # fmt: skip
    return {"benchmark": "prefix_pull", "model": args.model, "rate_mbps": args.rate_mbps,
            "runs": args.runs, "rows": rows}  # fmt: skip


COLUMNS = (
    ("n", "prefix_tokens", "{:,.0f}"),
    ("S_kv(n) B", "handoff_bytes", "{:,.0f}"),
    ("pull B", "pull_bytes", "{:,.0f}"),
    ("pull/S_kv", "pull_vs_skv", "{:.3f}"),
    ("old charge B", "old_charge_bytes", "{:,.0f}"),
    ("pull/old", "pull_vs_old_charge", "{:.3f}"),
    ("pull s", "pull_s", "{:.3f}"),
    ("bytes/rate s", "link_s", "{:.3f}"),
    ("pull/link", "pull_s_vs_link_s", "{:.2f}"),
)


def render(r: dict[str, Any]) -> str:
    head = (f"prefix pull over a {r['rate_mbps']:g} Mbit/s paced link, {r['model']}, "
            f"medians of {r['runs']} (measured)")  # fmt: skip
    lines = [head, "  ".join(f"{name:>12}" for name, _, _ in COLUMNS)]
    for row in r["rows"]:
        lines.append("  ".join(f"{fmt.format(row[key]):>12}" for _, key, fmt in COLUMNS))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-next-tiny")
    parser.add_argument("--rate-mbps", type=float, default=100.0)
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = asyncio.run(measure(args))
    print(render(result))
    if args.json:
        args.json.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""P/D with a real model, engine processes on one device: a prefill engine that puts each
layer's KV on the wire as it is computed (layer-wise), one that sends it all after the
prefill (send-after), a decode engine and an aggregated engine, every one a `prfaas engine`
child on `--device`, KV over the real transport on loopback, paced (`/admin/egress`) with
a 5 ms one-way delay.

Per link rate and prompt length, interleaved over `--reps` fresh prompts (each engine sees
a prompt once: no prefix hits): the client-observed TTFT of the aggregated engine, of P/D
layer-wise and of P/D send-after (the prefill and decode requests sent together, as the
gateway does; TTFT = the decode's first streamed token), the KV bytes the prefill put on the
wire, and whether the decode's greedy output equals the aggregated engine's. The targets
(issue 37): layer-wise TTFT <= 1.1 x max(prefill, transfer) with prefill = the aggregated
TTFT and transfer = bytes / rate + delay, and <= 0.7 x send-after.

    python benchmarks/gpu/pd_engines.py --device cuda --json pd.json
    python benchmarks/gpu/pd_engines.py --device cpu --model qwen3.5-tiny --lengths 128 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import transport_variant  # beside this script

from prfaas.engines.reference.model.presets import default_cache_dir, materialise, resolve
from prfaas.serve.processes import EngineProcess, EngineSpec, start_engine, stop_process

DELAY_MS = 5.0
NEW_TOKENS = 16
MODES = ("aggregated", "layerwise", "send_after")


async def start(args: argparse.Namespace, log_dir: Path) -> dict[str, EngineProcess]:
    """The four engines, started together (each loads the model onto the device)."""
    frame_kib, switch_ms, where = args.transport
    common = ("--device", args.device, "--max-prefill-tokens", str(max(args.lengths)),
              "--kv-capacity-tokens", str(2 * max(args.lengths) + 4096), "--state-slots", "16",
              "--transfer-chunk-kib", str(frame_kib),
              "--gil-switch-ms", f"{switch_ms:g}")  # fmt: skip
    paced = ("--egress-delay-ms", f"{DELAY_MS:g}",
             "--egress-rate-mbps", f"{args.rates_gbps[0] * 1000:g}",
             "--kv-sender", where)  # fmt: skip
    specs = {
        "aggregated": EngineSpec("aggregated", "both", args.model, extra_args=common),
        "layerwise": EngineSpec("layerwise", "prefill", args.model, extra_args=(*common, *paced)),
        "send_after": EngineSpec("send_after", "prefill", args.model,
                                 extra_args=(*common, *paced, "--kv-send", "after-prefill")),
        "decode": EngineSpec("decode", "decode", args.model, extra_args=common),
    }  # fmt: skip
    env = {"PRFAAS_MODEL_CACHE": str(args.model_cache)}
    started = await asyncio.gather(
        *(
            start_engine(s, log_dir, timeout_s=args.start_timeout_s, env=env)
            for s in specs.values()
        ),
        return_exceptions=True,
    )
    engines = {n: e for n, e in zip(specs, started, strict=True) if isinstance(e, EngineProcess)}
    failed = [e for e in started if isinstance(e, BaseException)]
    if failed:
        await asyncio.gather(*(stop_process(e.process) for e in engines.values()))
        raise RuntimeError(f"engines did not start: {failed[0]}")
    return engines


async def first_token(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], began: float
) -> tuple[float, list[int]]:
    """Stream `/generate`; (seconds from `began` to the first token, every output id)."""
    ttft: float | None = None
    ids: list[int] = []
    async with session.post(f"{url}/generate", json={**body, "stream": True}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            event = orjson.loads(line[5:])
            if event.get("output_ids") and ttft is None:
                ttft = time.perf_counter() - began
            ids = event.get("output_ids", ids)
    if ttft is None:
        raise RuntimeError(f"{url}: no token streamed")
    return ttft, ids


async def egress_bytes(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(f"{url}/stats") as resp:
        return int((await resp.json())["kv_egress_bytes_total"])


async def one(
    session: aiohttp.ClientSession, engines: dict[str, EngineProcess], mode: str,
    prompt: list[int],
) -> dict[str, Any]:  # fmt: skip
    """One request in `mode`: TTFT, output ids and (P/D) the KV bytes sent."""
    body: dict[str, Any] = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
    }
    if mode == "aggregated":
        ttft, ids = await first_token(session, engines["aggregated"].url, body, time.perf_counter())
        return {"ttft_s": ttft, "output_ids": ids}
    prefill = engines[mode]
    before = await egress_bytes(session, prefill.url)
    room = random.randrange(2**63)
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": room}  # fmt: skip
    began = time.perf_counter()

    async def prefill_call() -> None:
        async with session.post(f"{prefill.url}/generate", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"prefill: HTTP {resp.status}: {await resp.text()}")
            await resp.read()

    (ttft, ids), _ = await asyncio.gather(
        first_token(session, engines["decode"].url, body, began), prefill_call()
    )
    sent = await egress_bytes(session, prefill.url) - before
    return {"ttft_s": ttft, "output_ids": ids, "kv_bytes": sent}


async def set_rate(session: aiohttp.ClientSession, url: str, gbps: float) -> None:
    async with session.post(f"{url}/admin/egress", json={"rate_mbps": gbps * 1000}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}/admin/egress: HTTP {resp.status}: {await resp.text()}")


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    source = resolve(args.model, args.model_cache)
    began = time.perf_counter()
    await asyncio.to_thread(materialise, source)  # once, before the engines
    materialised_s = time.perf_counter() - began
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="prfaas-pd-") as logs:
        async with AsyncExitStack() as stack:
            began = time.perf_counter()
            engines = await start(args, Path(logs))
            started_s = time.perf_counter() - began
            for engine in engines.values():
                stack.push_async_callback(stop_process, engine.process)
            session = await stack.enter_async_context(
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.request_timeout_s))
            )
            gen = random.Random(7)
            warm = [gen.randrange(256) for _ in range(min(args.lengths))]
            for mode in MODES:  # kernels compiled, connections up
                await one(session, engines, mode, warm)
            for gbps in args.rates_gbps:
                for name in ("layerwise", "send_after"):
                    await set_rate(session, engines[name].url, gbps)
                for length in args.lengths:
                    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
                    for _ in range(args.reps):  # interleaved: noise hits every mode alike
                        prompt = [gen.randrange(256) for _ in range(length)]
                        for mode in MODES:
                            runs[mode].append(await one(session, engines, mode, prompt))
                    rows.append(summarise(gbps, length, runs))
    return {
        "device": args.device,
        "model": args.model,
        "delay_ms": DELAY_MS,
        "new_tokens": NEW_TOKENS,
        "reps": args.reps,
        "frame_kib": args.transport[0],
        "gil_switch_ms": args.transport[1],
        "sender": args.transport[2],
        "materialise_s": round(materialised_s, 1),
        "engines_start_s": round(started_s, 1),
        "rows": rows,
        "greedy_equal": all(r["greedy_equal"] for r in rows),
    }


def summarise(gbps: float, length: int, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    ttft = {m: statistics.median(r["ttft_s"] for r in runs[m]) for m in MODES}
    kv = statistics.median(r["kv_bytes"] for r in runs["layerwise"])
    transfer = kv * 8 / (gbps * 1e9) + DELAY_MS / 1e3
    equal = all(
        a["output_ids"] == b["output_ids"] == c["output_ids"]
        for a, b, c in zip(runs["aggregated"], runs["layerwise"], runs["send_after"], strict=True)
    )
    bound = max(ttft["aggregated"], transfer)
    return {
        "rate_gbps": gbps,
        "tokens": length,
        "kv_bytes": kv,
        "transfer_s": round(transfer, 5),
        **{f"ttft_{m}_s": round(ttft[m], 5) for m in MODES},
        "layerwise_over_max": round(ttft["layerwise"] / bound, 3),
        "layerwise_over_send_after": round(ttft["layerwise"] / ttft["send_after"], 3),
        "greedy_equal": equal,
        "runs_ttft_s": {m: [round(r["ttft_s"], 5) for r in runs[m]] for m in MODES},
    }


def print_table(report: dict[str, Any]) -> None:
    print(f"P/D on {report['device']} with {report['model']} ({report['delay_ms']:g} ms one way; "
          f"medians of {report['reps']})")  # fmt: skip
    print(f"{'Gbps':>5} {'tokens':>7} {'KV MB':>8} {'xfer ms':>8} {'agg ms':>8} {'layer ms':>9} "
          f"{'after ms':>9} {'lw/max':>7} {'lw/after':>8} {'equal':>6}")  # fmt: skip
    for r in report["rows"]:
        print(f"{r['rate_gbps']:5g} {r['tokens']:7} {r['kv_bytes'] / 1e6:8.2f} "
              f"{r['transfer_s'] * 1e3:8.1f} {r['ttft_aggregated_s'] * 1e3:8.1f} "
              f"{r['ttft_layerwise_s'] * 1e3:9.1f} {r['ttft_send_after_s'] * 1e3:9.1f} "
              f"{r['layerwise_over_max']:7.3f} {r['layerwise_over_send_after']:8.3f} "
              f"{r['greedy_equal']!s:>6}")  # fmt: skip
    print("targets: lw/max <= 1.1, lw/after <= 0.7, equal")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="qwen3.5-gpu", help="engine preset or checkpoint")
    p.add_argument("--model-cache", type=Path, default=default_cache_dir())
    p.add_argument("--lengths", nargs="+", type=int, default=[4096, 16384])
    p.add_argument("--rates-gbps", nargs="+", type=float, default=[10.0, 25.0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--transport", type=transport_variant.parse, metavar="KIB:MS[:process]",
                   default=transport_variant.ENGINE_DEFAULT,
                   help="the engines' KV frame size and GIL switch interval, and whether the "
                   "prefills' senders run in processes of their own (default: the engine's, "
                   "1024:5)")  # fmt: skip
    p.add_argument("--start-timeout-s", type=float, default=240.0)
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    report = asyncio.run(measure(args))
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if report["greedy_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())

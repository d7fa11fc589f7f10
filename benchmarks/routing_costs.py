"""Benchmark (live): what PrfaaS's routing rules cost a request against computing it locally,
at low load and under load.

On the embedded default (`prfaas serve`: three reference engines on this machine's CPU, the
PrfaaS prefill's KV paced to an emulated 10 Mbit/s, 5 ms link), under the PrfaaS policy (its
rules as shipped) and under `--policy homogeneous` (every prefill local: the local
alternative), one deployment after the other, the order alternating per round:

- **low load:** with the PD prefill idle, long fresh prompts (over `t`) one at a time,
  streamed; their time to first token and route. Before 2026-12-04 the embedded default
  offloaded every prompt over `t` (6K tokens: 10.1 s against 2.3 s locally, its KV crawling
  over the link). Goal: TTFT prfaas / homogeneous <= 1.1 (medians), every prompt local.
- **idle link:** `--idle-s` seconds without requests, then the bandwidth regime: an idle
  link slower than the KV production rate must stay `bandwidth_scarce` (before, 10 idle
  ticks turned it abundant, and prefix pulls then cost 4x a recompute).
- **under load:** `--clients` closed-loop clients of long fresh prompts for `--loaded-s`
  seconds: served requests per second, TTFT p50/p90, the share offloaded, and from the
  gateway's `/metrics` why each offload went (faster, or the PD prefill saturated), the
  predicted TTFT the saturated ones traded for throughput, and how often `t`, its set-point
  and the regime changed under that steady load (equal lengths, or log-normal around
  `--tokens` with `--length-sigma`: a length threshold splits equal lengths only by moving).

Numbers from this 2-core machine, where both clusters share the CPU: compare within one run.
Usage: python benchmarks/routing_costs.py [--tokens 6000] [--prompts 3] [--rounds 2]
       [--idle-s 15] [--clients 3] [--loaded-s 60] [--length-sigma 0.5] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from prfaas.testing.serve_process import start_serve, stop_serve

MODEL = "qwen3-next-tiny"
POLICIES = ("prfaas", "homogeneous")
MAX_PROMPT_TOKENS = 8000
"""The embedded model's context (8,192 tokens) less room for the answer."""


def words(n_tokens: int, rng: random.Random) -> str:
    """About `n_tokens` byte-level tokens of fresh text (the tiny model's tokenizer)."""
    text = f"{rng.random()} "
    while len(text) < n_tokens:
        text += "".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 7))) + " "
    return text[:n_tokens]


def serve(policy: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`prfaas serve` (embedded default) under `policy`; its URL once it is ready."""
    return start_serve(["--port", "0", "--policy", policy], log)


async def ttft(session: aiohttp.ClientSession, url: str, prompt: str) -> tuple[float, str]:
    """Seconds to the first streamed token, and the route the gateway chose."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": True}
    start = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        first = None
        async for line in resp.content:
            if first is None and line.startswith(b"data:") and b"[DONE]" not in line:
                first = time.perf_counter() - start
        assert first is not None, "no token streamed"
        return first, resp.headers["x-prfaas-route"]


async def measure(url: str, prompts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        await ttft(session, url, words(200, random.Random(1)))  # warm the path
        samples = [await ttft(session, url, p) for p in prompts]
        async with session.get(f"{url}/admin/state") as resp:
            threshold = (await resp.json())["threshold"]
        await asyncio.sleep(args.idle_s)  # the link idle: what regime does it read as?
        async with session.get(f"{url}/admin/state") as resp:
            state = await resp.json()
        loaded = await under_load(session, url, args)
    regimes = [d["reason"] for d in state["scheduler"]["recent"] if d["kind"] == "regime"]
    short = state["scheduler"].get("short_term", {})
    return {
        "kv_rate_mbps": _mbps(short.get("kv_rate_bytes_per_s")),
        "spare_mbps": _mbps(short.get("spare_bytes_per_s")),
        "ttft_s": [s for s, _ in samples],
        "routes": [r for _, r in samples],
        "threshold": threshold,
        "regime": state["regime"],
        "regime_changes": regimes,
        "loaded": loaded,
    }


async def under_load(
    session: aiohttp.ClientSession, url: str, args: argparse.Namespace
) -> dict[str, Any]:
    """`args.clients` closed-loop clients of fresh long prompts for `args.loaded_s` seconds:
    what they got, and the gateway's counts of its offload decisions meanwhile."""
    before = await _decisions(session, url)
    done: list[tuple[float, str]] = []
    end = time.monotonic() + args.loaded_s

    async def client(c: int) -> None:
        rng = random.Random(1000 + c)
        while time.monotonic() < end:
            done.append(await ttft(session, url, words(_length(args, rng), rng)))

    start = time.monotonic()
    await asyncio.gather(*(client(c) for c in range(args.clients)))
    elapsed = time.monotonic() - start
    after = await _decisions(session, url)
    async with session.get(f"{url}/admin/state") as resp:
        recent = (await resp.json())["scheduler"]["recent"]
    ttfts = sorted(x for x, _ in done)
    routes = [r for _, r in done]
    return {
        "served_per_s": len(done) / elapsed,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p90_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
        "offloaded": routes.count("prfaas") / len(routes),
        "decisions": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after},
        "threshold_moves": [_move(d) for d in recent if d["kind"] in ("threshold", "set_point")],
    }


def _move(decision: dict[str, Any]) -> str:
    """One of the last changes of `t` or its set-point, as `/admin/state` logged it."""
    got = decision["inputs"]
    return (f"{decision['at']:.0f} {decision['loop']}: {got.get('from', 0):.0f} -> "
            f"{got.get('to', 0):.0f} ({decision['reason']})")  # fmt: skip


def _length(args: argparse.Namespace, rng: random.Random) -> int:
    """A loaded-phase prompt's length: `--tokens`, or log-normal around it with
    `--length-sigma` (from a quarter of it up to the model's context)."""
    if not args.length_sigma:
        return int(args.tokens)
    drawn = args.tokens * math.exp(rng.gauss(0.0, args.length_sigma))
    return int(min(max(drawn, args.tokens / 4), MAX_PROMPT_TOKENS))


async def _decisions(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The gateway's offload-decision counters, the predicted TTFT traded (its sum), and
    the changes of `t`, its set-point and the regime (counts)."""
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("prfaas_offload_decisions_total{"):
            out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("prfaas_offload_ttft_traded_seconds_sum"):
            out["traded_s_sum"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("prfaas_schedule_changes_total{"):
            labels = dict(part.split("=") for part in line[line.index("{") + 1 :
                                                          line.index("}")].split(","))  # fmt: skip
            kind = labels["kind"].strip('"')
            if kind in ("threshold", "set_point", "regime"):
                key = f"{kind}_changes"
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _mbps(bytes_per_s: float | None) -> float | None:
    return None if bytes_per_s is None else bytes_per_s * 8e-6


def run(args: argparse.Namespace) -> dict[str, Any]:
    logs = Path(tempfile.mkdtemp(prefix="prfaas-routing-costs-"))
    per_round: list[dict[str, Any]] = []
    for r in range(args.rounds):
        rng = random.Random(r)
        prompts = [words(args.tokens, rng) for _ in range(args.prompts)]
        row = {}
        policies = POLICIES[:1] if args.prfaas_only else POLICIES
        for policy in policies if r % 2 == 0 else policies[::-1]:
            print(f"round {r}: {policy} ...", flush=True)
            proc, url = serve(policy, logs / f"{policy}-{r}.log")
            try:
                row[policy] = asyncio.run(measure(url, prompts, args))
            finally:
                stop_serve(proc)
        per_round.append(row)
    return report(per_round, args.tokens)


def report(per_round: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    policies = [p for p in POLICIES if p in per_round[0]]
    med = {p: statistics.median(x for row in per_round for x in row[p]["ttft_s"])
           for p in policies}  # fmt: skip
    routes = [r for row in per_round for r in row["prfaas"]["routes"]]
    regimes = [row["prfaas"]["regime"] for row in per_round]
    ratio = med["prfaas"] / med["homogeneous"] if "homogeneous" in med else None
    print(f"\n{tokens}-token fresh prompts, PD prefill idle, 10 Mbit/s emulated link "
          f"(this machine's 2 shared cores: compare within this run only)")  # fmt: skip
    print(f"{'policy':>12} {'TTFT p50 s':>11} {'routes':>30} {'t':>8} {'regime after idle':>20}")
    for p in policies:
        rows = [row[p] for row in per_round]
        shown = ",".join(r for row in rows for r in row["routes"])
        print(f"{p:>12} {med[p]:11.2f} {shown:>30} {rows[-1]['threshold']:8.0f} "
              f"{rows[-1]['regime']:>20}")  # fmt: skip
    last = per_round[-1]["prfaas"]
    spare, rate = last["spare_mbps"], last["kv_rate_mbps"]
    if spare is not None and rate is not None:
        print(f"the gateway's reading of the idle link: spare {spare:.1f} Mbit/s against a KV "
              f"production rate of {rate:.1f} Mbit/s")  # fmt: skip
    kept = f"{routes.count('pd')}/{len(routes)}"
    if ratio is not None:
        print(f"TTFT prfaas / homogeneous: {ratio:.2f} (goal <= 1.1)")
    print(f"prompts kept local: {kept}; regime after idle: {', '.join(regimes)}")
    print(f"\nunder load ({len(per_round)} rounds; medians of the rounds)")
    print(f"{'policy':>12} {'served/s':>9} {'TTFT p50':>9} {'TTFT p90':>9} {'offloaded':>10}")
    loaded = {}
    for p in policies:
        rows = [row[p]["loaded"] for row in per_round]
        keys = ("served_per_s", "ttft_p50_s", "ttft_p90_s", "offloaded")
        loaded[p] = {k: statistics.median(x[k] for x in rows) for k in keys}
        got = loaded[p]
        print(f"{p:>12} {got['served_per_s']:9.3f} {got['ttft_p50_s']:9.2f} "
              f"{got['ttft_p90_s']:9.2f} {got['offloaded']:10.0%}")  # fmt: skip
    counts = [row["prfaas"]["loaded"]["decisions"] for row in per_round]
    print("prfaas offload decisions per round: " + "; ".join(
        ", ".join(f"{k} {v:g}" for k, v in sorted(c.items())) for c in counts))  # fmt: skip
    for r, measured in enumerate(per_round):
        print(f"round {r}, the last changes of t under load:")
        for move in measured["prfaas"]["loaded"]["threshold_moves"]:
            print(f"  {move}")
    return {"tokens": tokens, "ttft_p50_s": med, "ratio": ratio, "routes": routes,
            "regimes_after_idle": regimes, "loaded": loaded, "rounds": per_round}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=6000)
    parser.add_argument("--prompts", type=int, default=3, help="at low load, per deployment")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--idle-s", type=float, default=15.0)
    parser.add_argument("--clients", type=int, default=3, help="under load")
    parser.add_argument("--loaded-s", type=float, default=60.0)
    parser.add_argument("--length-sigma", type=float, default=0.0,
                        help="under load: log-normal prompt lengths around --tokens")  # fmt: skip
    parser.add_argument("--prfaas-only", action="store_true",
                        help="skip the homogeneous baseline (to watch t alone)")  # fmt: skip
    parser.add_argument("--json", type=Path, metavar="OUT")
    args = parser.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    result = run(args)
    if args.json:
        args.json.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()

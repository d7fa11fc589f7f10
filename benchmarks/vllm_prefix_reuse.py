"""Benchmark: how much of a prompt the gateway's KV index says a vLLM instance caches, against
what vLLM then reuses (its `usage.prompt_tokens_details.cached_tokens`), on the tiny hybrid
checkpoint (`make vllm-env vllm-model`).

One vLLM server publishes its KV events (`--kv-events-config`); the gateway's own feed
(`KVEventFeed`, vLLM's format) applies them to its own index (`KVIndexManager`). For each of
a few random prefixes: one request of the prefix alone, then requests that extend it. Before
each follower the index is asked for the instance's cached prefix; the follower's answer says
what vLLM reused.

Hybrid models keep vLLM's prefix cache in Mamba "align" mode: a prefix is reusable only
where a linear-attention state was kept. The index learns where from the Mamba groups'
events (`StatesStored`); this checks that it counts what vLLM reuses.
Usage: python benchmarks/vllm_prefix_reuse.py [--prefixes 3] [--tokens 3000] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import urllib.request
from pathlib import Path

import orjson
from rich.console import Console
from rich.table import Table

from prfaas.common.hashing import iter_block_hashes
from prfaas.common.ports import free_port
from prfaas.engines.vllm.launch import VLLMServer, start_servers
from prfaas.gateway.kv_feed import KVEventFeed
from prfaas.gateway.kv_index import KVIndexManager
from prfaas.testing.tiny_checkpoint import TINY_BLOCK_SIZE

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / ".cache/tiny-qwen3-next"
BLOCK = TINY_BLOCK_SIZE  # the page vLLM serves this checkpoint with (the deployment's block_size)
FOLLOWERS = (20, 500, 500, 1000)  # tokens each follower adds to the prefix
Row = dict[str, int]


def reused(url: str, ids: list[int]) -> int:
    """Prompt tokens vLLM took from its prefix cache for `ids` (one output token)."""
    body = {"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0}
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=120) as r:
        usage = json.loads(r.read())["usage"]
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def measure(url: str, events: str, prefixes: int, tokens: int) -> list[Row]:
    """Each prefix alone, then its followers; before each, what the index says."""
    index = KVIndexManager(block_size=BLOCK)
    feed = KVEventFeed(index, {"vllm": events},
                       map_events=frozenset({"vllm"}))  # fmt: skip
    feed.start()
    rng = random.Random(5)
    rows: list[Row] = []
    try:
        await asyncio.sleep(1.0)  # the subscription joins
        for p in range(prefixes):
            prefix = [rng.randrange(256) for _ in range(tokens)]
            for n, extra in enumerate((0, *FOLLOWERS)):
                ids = prefix + [rng.randrange(256) for _ in range(extra)]
                said = index.longest_prefix(iter_block_hashes(ids, BLOCK)).get("vllm", 0)
                got = await asyncio.to_thread(reused, url, ids)
                rows.append({"prefix": p, "request": n, "tokens": len(ids),
                             "index_cached": said, "vllm_reused": got})  # fmt: skip
                await asyncio.sleep(0.5)  # its events reach the feed
    finally:
        await feed.stop()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefixes", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=3000, help="prefix length")
    parser.add_argument("--json", dest="json_out", default=None)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="vllm-reuse-"))
    events = f"ipc://{logs}/events"
    server = VLLMServer(ROOT / ".venv-vllm/bin/python", MODEL, free_port(), "tiny",
                        block_size=BLOCK, kv_events=events)  # fmt: skip
    servers = start_servers({"vllm": server}, logs)
    try:
        rows = asyncio.run(measure(servers["vllm"].url, events, args.prefixes, args.tokens))
    finally:
        servers["vllm"].stop()
    table = Table(title=f"vLLM prefix reuse vs the KV index, {args.tokens}-token prefixes")
    for col in ("prefix", "request", "prompt tokens", "index says cached", "vLLM reused"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["prefix"]), "prefix alone" if r["request"] == 0 else
                      f"follower {r['request']}", str(r["tokens"]), str(r["index_cached"]),
                      str(r["vllm_reused"]))  # fmt: skip
    Console().print(table)
    followers = [r for r in rows if r["request"] > 0]
    over = [r for r in followers if r["index_cached"] > r["vllm_reused"]]
    summary = {
        "followers": len(followers),
        "index_over_vllm": len(over),
        "first_followers_over": sum(r["request"] == 1 for r in over),
        "index_tokens": sum(r["index_cached"] for r in followers),
        "vllm_tokens": sum(r["vllm_reused"] for r in followers),
    }
    Console().print(summary)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        out = {"tokens": args.tokens, "rows": rows, **summary}
        Path(args.json_out).write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

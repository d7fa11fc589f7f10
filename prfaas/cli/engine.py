"""`prfaas engine`: run a CPU reference engine (prefill, decode or both) with an SGLang-
compatible HTTP API."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

HELP = "Run a CPU reference engine serving a hybrid-attention model."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="qwen3-next-tiny", help="preset name or local checkpoint directory"
    )
    parser.add_argument("--role", choices=("prefill", "decode", "both"), default="both")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (HTTP and bootstrap)")
    parser.add_argument("--port", type=int, default=30000, help="HTTP port (0: any free)")
    parser.add_argument(
        "--bootstrap-port", type=int, default=0, help="KV hand-off bootstrap port (0: any free)"
    )
    parser.add_argument(
        "--kv-events",
        metavar="ENDPOINT",
        help="publish KV events on this ZMQ endpoint, e.g. tcp://*:5557",
    )
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--kv-capacity-tokens", type=int, default=65536)
    parser.add_argument("--page-size", type=int, default=64, help="tokens per KV block")
    parser.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=1024,
        help="prompt tokens per engine step (long prompts interleave with decode steps)",
    )
    parser.add_argument(
        "--state-slots", type=int, default=256, help="linear-state snapshots kept for prefix reuse"
    )
    parser.add_argument("--model-cache", type=Path, help="where presets are materialised")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on shared or busy cores OpenMP spinning "
        "makes more threads much slower; raise it on a dedicated machine)",
    )


def run(args: argparse.Namespace) -> int:
    from prfaas.engines.reference.config import EngineConfig
    from prfaas.engines.reference.launch import LaunchOptions, serve

    try:
        engine = EngineConfig(
            role=args.role,
            max_batch=args.max_batch,
            kv_capacity_tokens=args.kv_capacity_tokens,
            block_size=args.page_size,
            max_prefill_tokens=args.max_prefill_tokens,
            num_state_slots=args.state_slots,
        )
        options = LaunchOptions(
            model=args.model,
            host=args.host,
            port=args.port,
            bootstrap_port=args.bootstrap_port,
            kv_events=args.kv_events,
            cache_dir=args.model_cache,
            threads=args.threads,
            engine=engine,
        )
        asyncio.run(serve(options))
    except (ValueError, OSError) as exc:
        print(f"prfaas engine: error: {exc}", file=sys.stderr)
        return 2
    return 0

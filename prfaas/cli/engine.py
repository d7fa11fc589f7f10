"""`prfaas engine`: run a reference engine (prefill, decode or both; on the CPU or a GPU) with
an SGLang-compatible HTTP API."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from prfaas.cli.extras import require_extra

if TYPE_CHECKING:
    from prfaas.engines.transport import TlsConfig

HELP = "Run a reference engine serving a hybrid-attention model (CPU or GPU)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="qwen3-next-tiny", help="preset name or local checkpoint directory"
    )
    parser.add_argument("--role", choices=("prefill", "decode", "both"), default="both")
    parser.add_argument(
        "--device",
        default="cpu",
        help="torch device of the weights, KV pool and sampling: cpu, cuda or cuda:N",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="weights and KV dtype (default: float32 on cpu, bfloat16 on a GPU)",
    )
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
    parser.add_argument(
        "--kv-events-replay",
        metavar="ENDPOINT",
        help="serve SGLang's replay of recent KV event batches, and snapshots of what is "
        "cached (a gateway started later loads them), on this ZMQ endpoint (needs --kv-events)",
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
        "--secret-file",
        type=Path,
        help="the deployment secret (hex): routes but /health then need its control token and "
        "KV transport peers must prove they hold it (default: $PRFAAS_SECRET or "
        "$PRFAAS_SECRET_FILE; none: open)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on shared or busy cores OpenMP spinning "
        "makes more threads much slower; raise it on a dedicated machine)",
    )
    _add_transfer_arguments(parser.add_argument_group("KV transfer (prefill side)"))
    _add_tls_arguments(parser.add_argument_group("KV transport TLS (links that leave the DC)"))


def _add_transfer_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--transfer-connections", type=int, default=4, help="TCP connections per decode peer"
    )
    group.add_argument(
        "--transfer-chunk-kib",
        type=int,
        default=1024,
        help="largest KV frame; also the pacing burst (use ~64 on a slow paced link)",
    )
    group.add_argument(
        "--gil-switch-ms",
        type=float,
        help="the interpreter's GIL switch interval (Python's default: 5 ms); shorter lets the "
        "KV transport's event loop take the GIL back sooner from a forward launching kernels "
        "(benchmarks/transport_gil.py)",
    )
    group.add_argument(
        "--egress-rate-mbps",
        type=float,
        help="cap this process's whole KV egress (all decode peers together) at this many "
        "Mbit/s with a token bucket: emulates a cross-DC link, or enforces an egress cap",
    )
    group.add_argument(
        "--egress-delay-ms", type=float, default=0.0, help="added one-way delay of KV frames"
    )
    group.add_argument(
        "--kv-sender",
        choices=("loop", "process"),
        default="loop",
        help="where the KV transport's sockets run: on the engine's event loop, or in a "
        "process of its own fed through a shared ring (the engine's interpreter then does no "
        "socket work beside the forward: benchmarks/transport_gil.py)",
    )
    group.add_argument(
        "--kv-send",
        choices=("layerwise", "after-prefill"),
        default="layerwise",
        help="when KV goes on the wire: as each layer is computed, or all of it once the "
        "prefill is over (the send-after baseline)",
    )
    group.add_argument(
        "--egress-capacity-mbps",
        type=float,
        help="link capacity for the utilisation in /transfer_stats (default: the egress rate)",
    )


def _add_tls_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--transport-tls-cert",
        type=Path,
        metavar="PEM",
        help="this engine's certificate: its bootstrap port serves TLS with it (and it is the "
        "client certificate of its fetches); needs --transport-tls-key and --transport-tls-ca",
    )
    group.add_argument("--transport-tls-key", type=Path, metavar="PEM", help="its private key")
    group.add_argument(
        "--transport-tls-ca",
        type=Path,
        metavar="PEM",
        help="the deployment's CA: fetches verify prefill engines' certificates against it",
    )
    group.add_argument(
        "--transport-tls-verify-client",
        action="store_true",
        help="mutual TLS: decode engines must present a certificate signed by the CA",
    )
    group.add_argument(
        "--transport-tls-server-name",
        metavar="NAME",
        help="the name prefill certificates carry (default: the bootstrap host, so an IP "
        "address needs an IP subjectAltName)",
    )


def transport_tls(args: argparse.Namespace) -> TlsConfig | None:
    """The engine's transport TLS from its flags (all three files, or none of them)."""
    from prfaas.engines.transport import TlsConfig

    files = {"--transport-tls-cert": args.transport_tls_cert,
             "--transport-tls-key": args.transport_tls_key,
             "--transport-tls-ca": args.transport_tls_ca}  # fmt: skip
    missing = [flag for flag, value in files.items() if value is None]
    if len(missing) == len(files):
        if args.transport_tls_verify_client or args.transport_tls_server_name:
            raise ValueError("--transport-tls-verify-client and --transport-tls-server-name "
                             "need --transport-tls-cert, --transport-tls-key and "
                             "--transport-tls-ca")  # fmt: skip
        return None
    if missing:
        raise ValueError(f"{', '.join(files)} go together: missing {', '.join(missing)}")
    return TlsConfig(
        cert_file=args.transport_tls_cert,
        key_file=args.transport_tls_key,
        ca_file=args.transport_tls_ca,
        verify_client=args.transport_tls_verify_client,
        server_name=args.transport_tls_server_name,
    )


def _mbps(flag: str, value: float | None) -> float | None:
    """Mbit/s -> bytes/s; a non-positive rate is an error naming the flag."""
    if value is not None and not value > 0:
        raise ValueError(f"{flag} must be > 0 Mbit/s, got {value}")
    return None if value is None else value * 1e6 / 8


def run(args: argparse.Namespace) -> int:
    require_extra("engine", "the reference engine")
    from prfaas.common.secret import DeploymentSecret
    from prfaas.engines.reference.engine_config import EngineConfig, TransferConfig
    from prfaas.engines.reference.server.main import LaunchOptions, serve

    try:
        engine = EngineConfig(
            role=args.role,
            max_batch=args.max_batch,
            kv_capacity_tokens=args.kv_capacity_tokens,
            block_size=args.page_size,
            max_prefill_tokens=args.max_prefill_tokens,
            num_state_slots=args.state_slots,
        )
        if args.gil_switch_ms is not None:
            if not 0.05 <= args.gil_switch_ms <= 100:
                raise ValueError(
                    f"--gil-switch-ms must be in [0.05, 100], got {args.gil_switch_ms}"
                )
            sys.setswitchinterval(args.gil_switch_ms / 1000)
        if not 0 <= args.egress_delay_ms <= 10_000:
            raise ValueError(f"--egress-delay-ms must be in [0, 10000], got {args.egress_delay_ms}")
        transfer = TransferConfig(
            connections=args.transfer_connections,
            chunk_bytes=args.transfer_chunk_kib * 1024,
            egress_rate_bytes_per_s=_mbps("--egress-rate-mbps", args.egress_rate_mbps),
            egress_delay_s=args.egress_delay_ms / 1000,
            capacity_bytes_per_s=_mbps("--egress-capacity-mbps", args.egress_capacity_mbps),
            layerwise=args.kv_send == "layerwise",
            sender_process=args.kv_sender == "process",
        )
        options = LaunchOptions(
            model=args.model,
            host=args.host,
            port=args.port,
            bootstrap_port=args.bootstrap_port,
            kv_events=args.kv_events,
            kv_events_replay=args.kv_events_replay,
            cache_dir=args.model_cache,
            threads=args.threads,
            device=args.device,
            dtype=args.dtype,
            engine=engine,
            transfer=transfer,
            secret=DeploymentSecret.from_env(path=args.secret_file),
            tls=transport_tls(args),
        )
        asyncio.run(serve(options))
    except (ValueError, OSError) as exc:
        print(f"prfaas engine: error: {exc}", file=sys.stderr)
        return 2
    _exit_now()
    return 0  # not reached


def _exit_now() -> None:
    """Leave at once once the engine has stopped (its sockets, ZMQ publisher and worker
    thread already closed): the interpreter's own teardown of torch and its threads takes
    seconds, and a supervisor waits for this exit before it starts a replacement."""
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

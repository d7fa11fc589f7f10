"""`prfaas serve`: the OpenAI-compatible PrfaaS gateway.

With `--config FILE`, route over the running engines the deployment file lists. Without it,
start the embedded default: reference engines for a PrfaaS cluster (1 prefill) and a PD
cluster (1 prefill + 1 decode) as child processes, the cross-DC link emulated by the PrfaaS
prefill's own KV transport (paced egress, added delay), profiled at start-up (or planned on
a recorded profile, `--profile FILE`) to choose the threshold. Either way the gateway polls
the PrfaaS prefill instances' transport telemetry (`/transfer_stats`, where an engine has
it) into `/metrics` and `/admin/state`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import socket
import sys
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from prfaas.cli.extras import require_extra

if TYPE_CHECKING:
    from prfaas.gateway.api.assembly import Gateway
    from prfaas.gateway.deployment import DeploymentConfig
    from prfaas.gateway.scheduling.config import SchedulerConfig

HELP = "Run the OpenAI-compatible PrfaaS gateway (embedded default deployment without --config)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="deployment TOML (default: embedded)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--policy", help="routing policy name (overrides the config)")
    parser.add_argument("--threshold", type=float, help="threshold t in tokens (overrides)")
    parser.add_argument("--api-key", action="append", default=None, help="accepted API key")
    parser.add_argument(
        "--admin-key",
        action="append",
        default=None,
        help="operator key for /admin/* (distinct from API keys; without one admin writes "
        "are refused)",
    )
    parser.add_argument(
        "--secret-file",
        metavar="FILE",
        help="deployment secret (hex) shared with the engines (default: $PRFAAS_SECRET, "
        "$PRFAAS_SECRET_FILE, or for launched engines a fresh one)",
    )
    parser.add_argument(
        "--link-gbps",
        type=float,
        default=None,
        help="embedded: emulated cross-DC link rate (the PrfaaS prefill's paced egress; "
        "default 0.01)",
    )
    parser.add_argument(
        "--link-delay-ms", type=float, default=None, help="embedded: one-way delay (default 5)"
    )
    parser.add_argument(
        "--pd-decodes",
        type=int,
        default=1,
        metavar="N",
        help="embedded: decode instances in the PD cluster (default 1; with 2 or more the "
        "long-term scheduler can convert one to prefill)",
    )
    parser.add_argument(
        "--no-scheduler",
        action="store_true",
        help="no dual-timescale scheduling (t, regime and PD roles move only by POST /admin/state)",
    )
    parser.add_argument(
        "--scheduler-period",
        type=float,
        metavar="S",
        help="long-term scheduling period in seconds (embedded default 30; else the config's)",
    )
    parser.add_argument(
        "--profile-out",
        metavar="FILE",
        help="embedded: write the deployment profile measured at start-up here (TOML, the "
        "`prfaas plan` / `prfaas simulate --profile` format)",
    )
    parser.add_argument(
        "--profile",
        metavar="FILE",
        help="embedded: plan and schedule on this profile (what --profile-out wrote) instead "
        "of measuring one at start-up",
    )
    parser.add_argument(
        "--replica-id",
        help="this gateway's name among the replicas of a [coordination] deployment "
        "(default: HOSTNAME:PORT)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        metavar="S",
        help="on SIGTERM/SIGINT, how long requests in flight may finish before what is left "
        "ends with an error (default: the config's drain_timeout_s, else 30)",
    )
    parser.add_argument("--log-level", default="WARNING")


def _overrides(args: argparse.Namespace) -> dict[str, object]:
    out: dict[str, object] = {}
    if args.policy is not None:
        out["policy"] = args.policy
    if args.threshold is not None:
        out["threshold"] = args.threshold
    if args.api_key:
        out["api_keys"] = tuple(args.api_key)
    if args.admin_key:
        out["admin_keys"] = tuple(args.admin_key)
    if args.secret_file is not None:
        out["secret_file"] = args.secret_file
    if args.drain_timeout is not None:
        out["drain_timeout_s"] = args.drain_timeout
    return out


def run(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        main = _embedded(args) if args.config is None else _configured(args)
    except ValueError as exc:  # ConfigError included
        print(f"prfaas serve: error: {exc}", file=sys.stderr)
        return 2
    return _run(main)


def _embedded(args: argparse.Namespace) -> Coroutine[Any, Any, int]:
    require_extra("engine", "the embedded deployment (serve without --config)")
    from prfaas.policies.registry import create_policy
    from prfaas.serve.embedded import EmbeddedOptions, serve_embedded

    options = EmbeddedOptions.from_args(args, _overrides(args))
    create_policy(options.gateway.policy)
    return serve_embedded(options, args.host, args.port)


def _configured(args: argparse.Namespace) -> Coroutine[Any, Any, int]:
    from prfaas.gateway.deployment import load_deployment
    from prfaas.policies.registry import create_policy
    from prfaas.serve.summary import print_ready

    if args.profile_out is not None:
        raise ValueError("--profile-out: only the embedded default (no --config) measures a "
                         "profile at start-up")  # fmt: skip
    if args.profile is not None:
        raise ValueError("--profile: a deployment file names its own ([scheduler] profile)")
    if args.pd_decodes != 1:
        raise ValueError("--pd-decodes: only the embedded default (no --config) starts its "
                         "engines; a deployment file lists its own")  # fmt: skip
    config = load_deployment(args.config)
    gateway = dataclasses.replace(config.gateway, **_overrides(args))  # type: ignore[arg-type]
    config = dataclasses.replace(config, gateway=gateway, scheduler=_scheduler(args, config))
    create_policy(config.gateway.policy)
    ready = functools.partial(print_ready, host=args.host)
    if config.launch:
        require_extra("engine", f"{args.config}'s [[launch]] reference engines")
        from prfaas.serve.launched import serve_launched

        return serve_launched(config, args.host, args.port, on_ready=ready)
    replica = args.replica_id or f"{socket.gethostname()}:{args.port}"
    return _served(config, args.host, args.port, ready, replica)


def _scheduler(args: argparse.Namespace, config: DeploymentConfig) -> SchedulerConfig | None:
    """The config's `[scheduler]` with the command line's overrides."""
    if args.no_scheduler or config.scheduler is None:
        return None
    if args.scheduler_period is None:
        return config.scheduler
    return dataclasses.replace(config.scheduler, period_s=args.scheduler_period)


async def _served(
    config: DeploymentConfig,
    host: str,
    port: int,
    ready: Callable[[Gateway, int], None],
    replica_id: str,
) -> int:
    from prfaas.gateway.api.assembly import egress_setup
    from prfaas.serve.run import serve_gateway

    await serve_gateway(
        config, host, port, setup=egress_setup(), on_ready=ready, replica_id=replica_id
    )
    return 0


def _run(main: Coroutine[Any, Any, int]) -> int:
    import asyncio

    from prfaas.common.event_loop import run_main

    try:
        return run_main(main)
    except asyncio.CancelledError:
        print("prfaas serve: stopped during start-up; engines stopped", file=sys.stderr)
        return 130
    except (RuntimeError, OSError) as exc:
        print(f"prfaas serve: error: {exc}", file=sys.stderr)
        return 1

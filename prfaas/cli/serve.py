"""`prfaas serve`: the OpenAI-compatible PrfaaS gateway.

With `--config FILE`, route over the running engines the deployment file lists. Without it,
start the embedded default: reference engines for a PrfaaS cluster (1 prefill) and a PD
cluster (1 prefill + 1 decode) as child processes, an emulated cross-DC link, profiled at
start-up to choose the threshold.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

HELP = "Run the OpenAI-compatible PrfaaS gateway (embedded default deployment without --config)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="deployment TOML (default: embedded)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--policy", help="routing policy name (overrides the config)")
    parser.add_argument("--threshold", type=float, help="threshold t in tokens (overrides)")
    parser.add_argument("--api-key", action="append", default=None, help="accepted API key")
    parser.add_argument(
        "--link-gbps", type=float, default=None, help="embedded: emulated link rate"
    )
    parser.add_argument("--link-delay-ms", type=float, default=None, help="embedded: one-way")
    parser.add_argument("--log-level", default="WARNING")


def _overrides(args: argparse.Namespace) -> dict[str, object]:
    out: dict[str, object] = {}
    if args.policy is not None:
        out["policy"] = args.policy
    if args.threshold is not None:
        out["threshold"] = args.threshold
    if args.api_key:
        out["api_keys"] = tuple(args.api_key)
    return out


def run(args: argparse.Namespace) -> int:
    import logging

    import uvloop

    from prfaas.gateway.config import ConfigError, load_deployment
    from prfaas.gateway.server import serve_gateway
    from prfaas.gateway.summary import print_ready

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.config is None:
        from prfaas.gateway.embedded import EmbeddedOptions, serve_embedded

        options = EmbeddedOptions.from_args(args, _overrides(args))
        return uvloop.run(serve_embedded(options, args.host, args.port))
    try:
        config = load_deployment(args.config)
        gateway = dataclasses.replace(config.gateway, **_overrides(args))  # type: ignore[arg-type]
        config = dataclasses.replace(config, gateway=gateway)
        from prfaas.policies.registry import create_policy

        create_policy(config.gateway.policy)
    except (ConfigError, ValueError) as exc:
        print(f"prfaas serve: error: {exc}", file=sys.stderr)
        return 2
    ready = functools.partial(print_ready, host=args.host)
    if config.launch:
        from prfaas.gateway.launched import serve_launched

        return uvloop.run(serve_launched(config, args.host, args.port, on_ready=ready))
    uvloop.run(serve_gateway(config, args.host, args.port, on_ready=ready))
    return 0

"""`prfaas`: dispatch to one module per subcommand.

Each subcommand module defines `HELP: str`, `add_arguments(parser)` and `run(args) -> int`,
and imports anything heavy inside `run`, so `prfaas plan` starts fast. torch, transformers
and matplotlib come only with the `engine` and `plots` extras: a command that needs one calls
`require_extra` first, and a missing extra is a one-line error with exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

from prfaas.cli.extras import MissingExtra

# name -> module; add a line here to add a subcommand.
SUBCOMMANDS: dict[str, str] = {
    "plan": "prfaas.cli.plan",
    "serve": "prfaas.cli.serve",
    "bench": "prfaas.cli.bench",
    "simulate": "prfaas.cli.simulate",
    "engine": "prfaas.cli.engine",
}


def _load(name: str) -> ModuleType:
    return importlib.import_module(SUBCOMMANDS[name])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prfaas", description="Prefill-as-a-Service for hybrid-attention LLMs."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = _load(name)
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.HELP))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = _load(args.command).run(args)
    except KeyboardInterrupt:
        return 130
    except MissingExtra as exc:
        print(f"prfaas {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())

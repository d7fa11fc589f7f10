"""Render envoy.template.yaml (beside this file) for a list of PrfaaS gateway addresses.

    python deploy/envoy/render.py 127.0.0.1:8001 127.0.0.1:8002 127.0.0.1:8003 > envoy.yaml
    envoy -c envoy.yaml

Each address is HOST:PORT ([V6]:PORT for an IPv6 literal); a host name may resolve to several
addresses (a Kubernetes headless Service: one per ready pod), each one replica. Standard
library only, so it runs from a checkout without installing anything.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from string import Template

TEMPLATE = Path(__file__).with_name("envoy.template.yaml")


@dataclass(frozen=True)
class Address:
    """A host (name or IP literal) and a TCP port."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Address:
        """`HOST:PORT` or `[V6]:PORT`.

        Raises:
            ValueError: no port, a port outside 1..65535, or an empty host (names `text`).
        """
        host, sep, port = text.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{text!r} is not HOST:PORT (a port in 1..65535)")
        return cls(host, int(port))


def render(
    gateways: Sequence[Address],
    *,
    listen: Address = Address("0.0.0.0", 8080),
    admin: Address = Address("127.0.0.1", 9901),
    access_log: str = "/dev/stdout",
) -> str:
    """The Envoy bootstrap (YAML) routing `listen` to `gateways`.

    Raises:
        ValueError: no gateway.
    """
    if not gateways:
        raise ValueError("at least one gateway address is needed")
    endpoints = [
        {"endpoint": {"address": {"socket_address": {"address": g.host, "port_value": g.port}}}}
        for g in gateways
    ]
    lines = TEMPLATE.read_text().splitlines(keepends=True)
    body = "".join(lines[next(i for i, line in enumerate(lines) if not line.startswith("#")) :])
    addresses = " ".join(f"{g.host}:{g.port}" for g in gateways)
    header = f"# Rendered by deploy/envoy/render.py for {addresses}: edit the template, not this.\n"
    return header + Template(body).substitute(
        listen_address=listen.host,
        listen_port=listen.port,
        admin_address=admin.host,
        admin_port=admin.port,
        access_log_path=access_log,
        lb_endpoints=json.dumps(endpoints),  # JSON is YAML's flow style: no indentation
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gateways", nargs="+", metavar="HOST:PORT", help="gateway replicas")
    parser.add_argument("--listen", default="0.0.0.0:8080", metavar="HOST:PORT")
    parser.add_argument(
        "--admin", default="127.0.0.1:9901", metavar="HOST:PORT", help="Envoy's admin interface"
    )
    parser.add_argument("--access-log", default="/dev/stdout", metavar="PATH")
    parser.add_argument("-o", "--output", type=Path, help="write here (default: stdout)")
    args = parser.parse_args(argv)
    try:
        text = render(
            [Address.parse(g) for g in args.gateways],
            listen=Address.parse(args.listen),
            admin=Address.parse(args.admin),
            access_log=args.access_log,
        )
    except ValueError as exc:
        parser.error(str(exc))
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

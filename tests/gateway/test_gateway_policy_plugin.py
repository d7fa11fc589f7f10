"""A third-party routing policy installed through the `prfaas.policies` entry-point group is
selectable by name in the gateway config and decides real requests."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from gateway_helpers import Engines, GatewayFactory, deployment

PLUGIN = '''
from prfaas.policies.routing import (
    BaseRoutingPolicy, RouteDecision, RoutingSnapshot, pick_instance,
)


class LongestFirst(BaseRoutingPolicy):
    """Sends prompts of an even length to PrfaaS, odd ones to PD (easy to observe)."""

    name = "parity"

    def decide(self, snapshot: RoutingSnapshot) -> RouteDecision:
        cluster = "prfaas" if snapshot.total_tokens % 2 == 0 else "pd"
        return self.decision(snapshot, pick_instance(snapshot, cluster, "prefill"), "parity")
'''


def _install(root: Path) -> None:
    """What `pip install` leaves behind: a module and its dist-info with entry points."""
    (root / "parity_policy.py").write_text(PLUGIN)
    info = root / "parity_policy-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: parity-policy\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[prfaas.policies]\nparity = parity_policy:LongestFirst\n"
    )


async def test_entry_point_policy_routes_requests(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    null_engines: Engines,
    gateway_factory: GatewayFactory,
) -> None:
    _install(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    url, gateway = await gateway_factory(deployment(null_engines.urls, policy="parity"))
    assert gateway.router.policy.name == "parity"
    routes = []
    async with aiohttp.ClientSession() as s:
        for prompt in ("ab", "abc"):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
            async with s.post(f"{url}/v1/completions", json=body) as r:
                assert r.status == 200
                routes.append(r.headers["x-prfaas-route"])
    assert routes == ["prfaas", "pd"]

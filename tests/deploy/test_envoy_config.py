"""deploy/envoy/render.py: the template rendered for a list of gateway addresses is YAML
with one upstream per address, and the real Envoy accepts it without a deprecated field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy_helpers import ENVOY_DIR, render_module, validate

GATEWAYS = ["127.0.0.1:8001", "gateway-b.example:8002", "[::1]:8003"]


def _rendered() -> dict[str, Any]:
    r = render_module()
    text = r.render([r.Address.parse(g) for g in GATEWAYS], listen=r.Address("0.0.0.0", 9000))
    config: dict[str, Any] = yaml.safe_load(text)
    return config


def test_one_upstream_per_gateway_in_order() -> None:
    (cluster,) = _rendered()["static_resources"]["clusters"]
    (locality,) = cluster["load_assignment"]["endpoints"]
    addresses = [e["endpoint"]["address"]["socket_address"] for e in locality["lb_endpoints"]]
    assert [(a["address"], a["port_value"]) for a in addresses] == [
        ("127.0.0.1", 8001), ("gateway-b.example", 8002), ("::1", 8003),
    ]  # fmt: skip


def test_the_route_streams_and_retries_only_before_the_answer() -> None:
    (listener,) = _rendered()["static_resources"]["listeners"]
    assert listener["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 9000}
    (manager,) = listener["filter_chains"][0]["filters"]
    typed = manager["typed_config"]
    assert [f["name"] for f in typed["http_filters"]] == ["envoy.filters.http.router"]
    (route,) = typed["route_config"]["virtual_hosts"][0]["routes"]
    assert route["route"]["timeout"] == "0s"
    policy = route["route"]["retry_policy"]
    assert policy["retry_on"] == "connect-failure,refused-stream,reset,retriable-headers"
    assert policy["retriable_headers"] == [
        {"name": "x-prfaas-not-started", "string_match": {"exact": "1"}}
    ]


def test_envoy_accepts_it_without_deprecated_fields(tmp_path: Path) -> None:
    r = render_module()
    config = tmp_path / "envoy.yaml"
    config.write_text(r.render([r.Address.parse(g) for g in GATEWAYS]))
    checked = validate(config)
    assert checked.returncode == 0, checked.stderr
    assert f"configuration '{config}' OK" in checked.stdout
    assert "deprecated" not in (checked.stdout + checked.stderr).lower()


def test_envoy_refuses_a_broken_config(tmp_path: Path) -> None:
    """The check above can fail: a misspelt field is refused."""
    r = render_module()
    config = tmp_path / "envoy.yaml"
    config.write_text(r.render([r.Address.parse(GATEWAYS[0])]).replace("lb_policy", "lb_polcy"))
    assert validate(config).returncode != 0


@pytest.mark.parametrize("bad", ["127.0.0.1", "host:0", "host:65536", ":8000", "host:http"])
def test_the_script_refuses_a_bad_address(bad: str) -> None:
    done = subprocess.run(
        [sys.executable, str(ENVOY_DIR / "render.py"), bad],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 2
    assert f"{bad!r} is not HOST:PORT" in done.stderr


def test_the_script_writes_the_file(tmp_path: Path) -> None:
    out = tmp_path / "envoy.yaml"
    done = subprocess.run(
        [sys.executable, str(ENVOY_DIR / "render.py"), *GATEWAYS, "--listen", "0.0.0.0:9000",
         "-o", str(out)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert yaml.safe_load(out.read_text()) == _rendered()

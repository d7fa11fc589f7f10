"""`GET /dashboard` and the data it polls, over real sockets (null engines: these tests are
about the gateway's bookkeeping, not model output): the page is self-contained and served
from the package, every finished request is booked with its route, incremental length, TTFT
and TPOT, the `since` cursor, the admin check, decisions from `POST /admin/state`, and the
role-split and regime gauges."""

from __future__ import annotations

import asyncio
import importlib.resources
import re
from collections.abc import Callable
from typing import Any

import aiohttp
import openai
from gateway_helpers import Engines, GatewayFactory, deployment
from metrics_helpers import Scrape

from prfaas.gateway.api.dashboard import PAGE_HEADERS

LONG = "x" * 300  # 300 byte-level tokens > threshold 100
STATIC = importlib.resources.files("prfaas.gateway.api") / "static"
SVG_NS = "http://www.w3.org/2000/svg"


async def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, Any, bytes]:
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers) as resp:
        return resp.status, resp.headers, await resp.read()


async def _data(
    url: str, headers: dict[str, str] | None = None, since: float | None = None
) -> dict[str, Any]:
    query = "" if since is None else f"?since={since!r}"
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{url}/admin/dashboard{query}", headers=headers) as resp,
    ):
        assert resp.status == 200, await resp.text()
        body: dict[str, Any] = await resp.json()
        return body


async def _until(check: Callable[[], Any], timeout_s: float = 5.0) -> None:
    """Wait for bookkeeping that runs just after the answer (`call_soon`)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_page_and_its_files_come_from_the_package(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    """The page, its script and its style are the package's files, with their content
    types and a CSP allowing only the gateway itself; nothing references another host."""
    url, _ = await gateway_factory(deployment(null_engines.urls))
    files = {
        "/dashboard": ("dashboard.html", "text/html"),
        "/dashboard/dashboard.js": ("dashboard.js", "text/javascript"),
        "/dashboard/dashboard.css": ("dashboard.css", "text/css"),
    }
    for path, (name, content_type) in files.items():
        status, headers, body = await _get(f"{url}{path}")
        assert status == 200
        assert headers["Content-Type"].startswith(content_type)
        assert headers["Content-Security-Policy"] == PAGE_HEADERS["Content-Security-Policy"]
        assert body == (STATIC / name).read_bytes()
        outside = set(re.findall(rb"(?:https?:)?//[\w.-]+\.[a-z]{2,}[^\s\"')]*", body))
        assert outside <= {SVG_NS.encode()}, outside
    html = (STATIC / "dashboard.html").read_text()
    assert 'src="dashboard/dashboard.js"' in html and 'href="dashboard/dashboard.css"' in html


async def test_finished_requests_are_booked_for_the_page(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    """A whole pd request and a streamed prfaas request appear with their route,
    incremental length, TTFT and E2E; TPOT only for the streamed one (also in /metrics);
    totals and window percentiles count both; the cursor then returns only newer ones."""
    url, gateway = await gateway_factory(deployment(null_engines.urls))
    first = await _data(url)
    assert first["requests"] == [] and first["totals"] == {}
    assert len(first["timeline"]) == 1  # sampled when the gateway started
    assert first["state"] == gateway.admin_state()
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    await client.completions.create(model="tiny", prompt="hi", max_tokens=3)
    stream = await client.completions.create(model="tiny", prompt=LONG, max_tokens=5, stream=True)
    assert len([c async for c in stream]) == 5

    async def booked() -> bool:
        return sum(gateway.activity.totals.values()) == 2

    await _until(booked)
    data = await _data(url, since=first["now"])
    pd, prfaas = data["requests"]
    assert (pd["route"], pd["status"], pd["incremental_tokens"]) == ("pd", 200, 2)
    assert (prfaas["route"], prfaas["incremental_tokens"]) == ("prfaas", 300)
    assert pd["tpot_s"] is None and prfaas["tpot_s"] > 0
    for r in (pd, prfaas):
        assert 0 < r["ttft_s"] <= r["e2e_s"] and first["now"] < r["at"] <= data["now"]
    assert data["totals"] == {"pd": 1, "prfaas": 1} and data["errors"] == 0
    assert data["latency"]["ttft_s"]["count"] == 2 and data["latency"]["tpot_s"]["count"] == 1
    assert (await _data(url, since=data["now"]))["requests"] == []
    _, _, text = await _get(f"{url}/metrics")
    scrape = Scrape.parse(text.decode())
    assert scrape.value("prfaas_tpot_seconds_count", route="prfaas") == 1
    assert scrape.labels("prfaas_tpot_seconds_count") == [{"route": "prfaas"}]


async def test_refused_requests_count_as_errors_without_a_route(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    """A request refused before routing is booked under route `none` with no incremental
    length or latency."""
    url, gateway = await gateway_factory(deployment(null_engines.urls))
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{url}/v1/completions", data=b"{not json") as resp,
    ):
        assert resp.status == 400

    async def booked() -> bool:
        return gateway.activity.errors == 1

    await _until(booked)
    (refused,) = (await _data(url))["requests"]
    assert (refused["route"], refused["status"]) == ("none", 400)
    assert refused["incremental_tokens"] is refused["ttft_s"] is refused["e2e_s"] is None


async def test_data_route_takes_the_admin_check(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    """With operator keys configured the data needs one (401 without, and a client's API
    key is not one); the page itself holds no data and loads without (it then asks for the
    key)."""
    config = deployment(null_engines.urls, api_keys=("client",), admin_keys=("sesame",))
    url, _ = await gateway_factory(config)
    assert (await _get(f"{url}/admin/dashboard"))[0] == 401
    assert (await _get(f"{url}/admin/dashboard", {"Authorization": "Bearer client"}))[0] == 401
    status, _, body = await _get(f"{url}/admin/dashboard", {"Authorization": "Bearer sesame"})
    assert status == 200 and b'"run_id"' in body
    assert (await _get(f"{url}/dashboard"))[0] == 200


async def test_bad_cursor_is_refused(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    url, _ = await gateway_factory(deployment(null_engines.urls))
    for bad in ("abc", "nan", "inf"):
        status, _, body = await _get(f"{url}/admin/dashboard?since={bad}")
        assert status == 400 and b"'since' must be a finite number" in body


async def test_hand_set_threshold_and_regime_are_decisions(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    """`POST /admin/state` records each change with before, after and reason; the regime
    gauge follows; the role-split gauge counts healthy instances per cluster and role."""
    url, _ = await gateway_factory(deployment(null_engines.urls, admin_keys=("op",)))
    async with aiohttp.ClientSession() as s:
        body = {"threshold": 250, "regime": "bandwidth_abundant"}
        op = {"Authorization": "Bearer op"}
        async with s.post(f"{url}/admin/state", json=body, headers=op) as resp:
            assert resp.status == 200
    decisions = (await _data(url, op))["decisions"]
    assert [(d["kind"], d["before"], d["after"], d["source"]) for d in decisions] == [
        ("threshold", 100.0, 250.0, "operator"),
        ("regime", "bandwidth_scarce", "bandwidth_abundant", "operator"),
    ]
    assert all(d["reason"] == "set by hand (POST /admin/state)" for d in decisions)
    _, _, text = await _get(f"{url}/metrics")
    scrape = Scrape.parse(text.decode())
    assert scrape.value("prfaas_bandwidth_regime", regime="bandwidth_abundant") == 1
    assert scrape.value("prfaas_bandwidth_regime", regime="bandwidth_scarce") == 0
    counts = {
        (s["cluster"], s["role"]): scrape.value("prfaas_instances", **s)
        for s in scrape.labels("prfaas_instances")
    }
    assert counts == {
        ("prfaas", "prefill"): 1, ("prfaas", "decode"): 0, ("prfaas", "both"): 0,
        ("pd", "prefill"): 1, ("pd", "decode"): 1, ("pd", "both"): 0,
    }  # fmt: skip

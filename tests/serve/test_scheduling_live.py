"""Dual-timescale scheduling live: `prfaas serve` as a real process over reference engines
(real forward passes, real KV over the paced transport, real sockets).

- Embedded default (one PD decode): lowering the emulated link at run time (the PrfaaS
  prefill's `POST /admin/egress`) raises `t`, so a prompt just over the old `t` now goes to
  the PD prefill; a prefill-heavy load makes the rebalancer want another prefill, and the
  guard rail refuses to convert the only decode, saying why.
- `[[launch]]` deployment with two PD decodes: the same kind of load converts one decode
  to prefill through the engine's role API, draining it first; no request fails, and the
  converted engine then serves prefills.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from coordinated_helpers import PROFILE
from serve_live_helpers import (
    ENGINE_AUTH,
    admin_state,
    complete,
    get,
    load,
    load_until_a_decode_converts,
    spawn,
    started,
    stop,
)

RAISE_WITHIN_S = 30.0
"""How long `t` may take to rise past the probe after the link falls. The probes' own
prefills come first (on two busy cores, seconds each), then a tick or two of a crawling link;
how fast `t` follows the link is measured by `benchmarks/scheduling.py` on the simulator."""


@pytest.fixture(scope="module")
def embedded() -> Iterator[str]:
    proc = spawn("serve", "--port", "0", "--scheduler-period", "3")
    try:
        yield started(proc)
    finally:
        stop(proc)


def _recent(state: dict[str, Any], loop: str, kind: str) -> list[dict[str, Any]]:
    return [d for d in state["scheduler"]["recent"] if d["loop"] == loop and d["kind"] == kind]


async def test_link_drop_raises_t_and_the_last_decode_is_kept(embedded: str) -> None:
    """Prefill-heavy warm-up (the rebalancer wants a second prefill and is refused); then
    the link falls from 10 to 1 Mbit/s while prompts just above `t` are sent beside a load
    that saturates the PD prefill (the offload is conditional: at light load they would stay
    local): `t` rises past them (their KV crawls), and the same prompt length goes to the PD
    prefill. Every request completes."""
    url = embedded
    async with aiohttp.ClientSession() as s:
        statuses = await load(url, 8.0, 700, 2, seed=1)  # prefill-heavy: 2 output tokens
        await asyncio.sleep(4.0)  # a long-term period sees it
        before = await admin_state(s, url)
        prfaas = before["clusters"]["prfaas"][0]["url"]
        probe = int(before["threshold"]) + 50
        egress = f"{prfaas}/admin/egress"
        # Three clients of prompts under `t` keep the PD prefill saturated (each waits there
        # longer than it computes), so the threshold governs the probes, not their own TTFT.
        busy = asyncio.create_task(load(url, RAISE_WITHIN_S, probe - 100, 3, seed=5))
        await asyncio.sleep(1.0)
        slow = [asyncio.create_task(complete(s, url, probe, seed=70 + i)) for i in range(2)]
        # The link falls once the probes are routed (they compute for seconds, so their KV
        # crawls): the long-term loop replans on the capacity step within a tick, and a
        # probe routed after that would meet the raised `t`.
        await _until_prfaas_busy(s, url)
        async with s.post(egress, json={"rate_mbps": 1}, headers=ENGINE_AUTH) as resp:
            assert resp.status == 200
        lowered = time.monotonic()
        while (await admin_state(s, url))["threshold"] < probe:
            assert time.monotonic() - lowered < RAISE_WITHIN_S, await admin_state(s, url)
            await asyncio.sleep(0.25)
        status, after = await complete(s, url, probe, seed=78)
        state = await admin_state(s, url)
        crawled = await asyncio.gather(*slow)
        statuses += await busy
        async with s.post(egress, json={"rate_mbps": 10}, headers=ENGINE_AUTH) as resp:
            assert resp.status == 200
    assert set(statuses) == {200}
    assert [status for status, _ in crawled] == [200, 200], crawled
    assert "prfaas" in {route for _, route in crawled}, crawled  # the threshold governed
    assert status == 200 and after == "pd", state["scheduler"]
    raises = [d for d in state["scheduler"]["recent"]
              if d["kind"] in ("threshold", "set_point") and d["at"] > 0
              and (d["inputs"].get("capacity_bytes_per_s")
                   or (d["inputs"].get("estimate") or {}).get("capacity_bytes_per_s")) == 1e6 / 8
              and d["inputs"]["state"]["threshold"] >= probe]  # fmt: skip
    assert raises, state["scheduler"]["recent"]
    refused = [d for d in _recent(before, "long-term", "rebalance")
               if d["inputs"]["outcome"] == "refused"]  # fmt: skip
    assert refused, before["scheduler"]["recent"]
    assert refused[-1]["reason"].endswith(
        "refused: the PD cluster has only 1 decode instance "
        "(at least one prefill and one decode must stay)"
    )
    assert {s["id"]: s["role"] for s in state["clusters"]["pd"]} == {
        "pd-p0": "prefill",
        "pd-d0": "decode",
    }


async def _until_prfaas_busy(s: aiohttp.ClientSession, url: str, within_s: float = 5.0) -> None:
    """Wait until the PrfaaS prefill has a request in flight (at most `within_s`: a probe
    that went to PD fails the route assertion, not this wait)."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        state = await admin_state(s, url)
        if any(i["in_flight"] for i in state["clusters"]["prfaas"]):
            return
        await asyncio.sleep(0.05)


def _deployment(tmp: Path) -> Path:
    (tmp / "profile.toml").write_text(PROFILE)
    launch = "".join(
        f'[[launch]]\nid = "{i}"\ncluster = "{c}"\nrole = "{r}"\n{extra}\n'
        for i, c, r, extra in (
            ("prfaas-p0", "prfaas", "prefill", "egress_rate_mbps = 10\n"),
            ("pd-p0", "pd", "prefill", ""),
            ("pd-d0", "pd", "decode", ""),
            ("pd-d1", "pd", "decode", ""),
        )
    )
    path = tmp / "deploy.toml"
    path.write_text(
        f'[gateway]\nthreshold = 1024\n\n{launch}\n[scheduler]\nprofile = "profile.toml"\n'
        "period_s = 3.0\n[scheduler.estimate]\nmin_samples = 5.0\n"
        # every move confirmed over periods (no urgent path), so the test sees that rail
        "[scheduler.rebalance]\nurgent_gain = inf\n"
    )
    return path


async def test_prefill_heavy_load_converts_one_of_two_decodes(tmp_path: Path) -> None:
    proc = spawn("serve", "--port", "0", "--config", str(_deployment(tmp_path)))
    try:
        url = started(proc)
        statuses: list[int] = []
        converted, seed = await load_until_a_decode_converts(url, 60, statuses)
        info = get(f"{converted['url']}/server_info", ENGINE_AUTH)
        served_before = get(f"{converted['url']}/stats", ENGINE_AUTH)["prompt_tokens_total"]
        statuses += await load(url, 4.0, 900, 3, seed)
        served_after = get(f"{converted['url']}/stats", ENGINE_AUTH)["prompt_tokens_total"]
        final = get(f"{url}/admin/state")
    finally:
        stop(proc)
    assert statuses and set(statuses) == {200}  # nothing lost to the conversion
    assert info["disaggregation_mode"] == "prefill"
    assert served_after > served_before  # it prefills now
    roles = [d for d in final["scheduler"]["recent"] if d["kind"] == "role"]
    assert roles and roles[-1]["inputs"]["drain_s"] >= 0
    assert roles[-1]["reason"] == f"{converted['id']} decode -> prefill"
    pending = [d for d in final["scheduler"]["recent"]
               if d["kind"] == "rebalance" and d["inputs"]["outcome"] == "pending"]  # fmt: skip
    assert pending and pending[0]["at"] < roles[-1]["at"]  # confirmed over periods first
    assert sorted(r for r in final["scheduler"]["roles"].values()) == [
        "decode", "prefill", "prefill"
    ]  # fmt: skip


async def test_embedded_with_two_decodes_converts_one_by_hand() -> None:
    """`--pd-decodes 2` gives the embedded PD cluster a second decode. Without schedulers an
    operator converts it by hand (`POST /admin/state` `roles`): a conversion that would
    leave no decode is refused naming `roles`; a good one drains the instance, switches it
    through the engine's role API, and it then serves prefills while every request
    completes, under load the whole time."""
    proc = spawn("serve", "--port", "0", "--pd-decodes", "2", "--no-scheduler",
                 "--threshold", "4096", "--admin-key", "op")  # fmt: skip
    admin = {"Authorization": "Bearer op"}
    try:
        url = started(proc)
        pd_before = get(f"{url}/admin/state", admin)["clusters"]["pd"]
        before = {i["id"]: i["role"] for i in pd_before}
        async with aiohttp.ClientSession(headers=admin) as s:
            both = {"roles": {"pd-d0": "prefill", "pd-d1": "prefill"}}
            async with s.post(f"{url}/admin/state", json=both) as r:
                refused = (r.status, (await r.json())["error"]["param"])
            loading = asyncio.create_task(load(url, 6.0, 600, 2, 7))
            await asyncio.sleep(1.0)  # requests in flight on the decode being converted
            async with s.post(f"{url}/admin/state", json={"roles": {"pd-d1": "prefill"}}) as r:
                converted = (r.status, await r.json())
            statuses = await loading
        pd = {i["id"]: i for i in converted[1]["clusters"]["pd"]}
        info = get(f"{pd['pd-d1']['url']}/server_info", ENGINE_AUTH)
        served_before = get(f"{pd['pd-d1']['url']}/stats", ENGINE_AUTH)["prompt_tokens_total"]
        statuses += await load(url, 4.0, 600, 3, 99)
        served_after = get(f"{pd['pd-d1']['url']}/stats", ENGINE_AUTH)["prompt_tokens_total"]
    finally:
        stop(proc)
    assert before == {"pd-p0": "prefill", "pd-d0": "decode", "pd-d1": "decode"}
    assert refused == (400, "roles")
    assert converted[0] == 200 and {i: s["role"] for i, s in pd.items()} == {
        "pd-p0": "prefill", "pd-d0": "decode", "pd-d1": "prefill"
    }  # fmt: skip
    assert info["disaggregation_mode"] == "prefill"
    assert statuses and set(statuses) == {200}  # nothing lost to the conversion
    assert served_after > served_before  # it prefills now

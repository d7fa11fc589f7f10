"""Three `prfaas serve` gateway processes over the same four reference engines (started once
for the module), coordinated through a real etcd: one leader at a time, failover after a
SIGKILL, a paused leader fenced by the engines, the whole traffic estimated by the leader
and converted once, and a store outage that stops conversions but not routing."""

from __future__ import annotations

import asyncio
import math
import signal
import threading
import time
import urllib.request
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from coordinated_helpers import (
    ENGINE_AUTH,
    Engine,
    Replica,
    agreed_leader,
    get_json,
    leaders,
    post_json,
    reset_roles,
    start_engines,
    start_replica,
    wait_for,
    write_deployment,
)
from etcd_helpers import EtcdServer
from metrics_helpers import Scrape

MODEL = "qwen3-next-tiny"
TTL_S = 2.0
PERIOD_S = 3.0

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Engine]]:
    started = start_engines(tmp_path_factory.mktemp("engines"))
    try:
        yield started
    finally:
        for engine in started:
            engine.stop()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd for the module, as a deployment has: its revisions (the leaders' epochs)
    only grow, and the engines remember the highest epoch they were shown."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data")
    server.start()
    yield server
    server.kill()


@pytest.fixture
def replicas(engines: list[Engine], store: EtcdServer, tmp_path: Path) -> Iterator[list[Replica]]:
    """Three replicas a, b, c of one deployment (engines back in their launch roles), under
    a key prefix of their own."""
    reset_roles(engines)
    config = write_deployment(
        tmp_path, engines, etcd=store.url, prefix=f"/t{time.monotonic_ns()}",
        period_s=PERIOD_S, lease_ttl_s=TTL_S,
    )  # fmt: skip
    started: list[Replica] = []
    try:
        for name in ("a", "b", "c"):
            started.append(start_replica(config, name, tmp_path))
        yield started
    finally:
        for r in started:
            r.stop()


def _roles(replicas: list[Replica]) -> dict[str, tuple[float, float, float]]:
    """Each replica's (elections, lead losses, leading gauge), from its `/metrics` read with
    prometheus_client's parser."""
    out = {}
    for r in replicas:
        with urllib.request.urlopen(f"{r.url}/metrics", timeout=5) as reply:
            scrape = Scrape.parse(reply.read().decode())
        out[r.name] = (
            scrape.value("prfaas_leader_elections_total"),
            scrape.value("prfaas_leader_losses_total"),
            scrape.value("prfaas_coordination_leader"),
        )
    return out


def _words(n_tokens: int, seed: int) -> str:
    """`n_tokens` byte-level tokens of fresh text (nothing shared with other seeds)."""
    import random

    rng = random.Random(seed)
    text = f"{seed} "
    while len(text) < n_tokens:
        text += "".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 7))) + " "
    return text[:n_tokens]


async def _open_loop(
    urls: list[str], rate: float, seconds: float, tokens: int, seed: int
) -> list[tuple[float, int]]:
    """Requests at fixed intervals (`rate` per second), round-robin over `urls`, whatever
    the answers take; (send time, status) of each (status 0: the connection failed)."""
    results: list[tuple[float, int]] = []
    body = {"model": MODEL, "max_tokens": 2}

    async def one(s: aiohttp.ClientSession, url: str, n: int) -> None:
        sent = time.monotonic()
        try:
            async with s.post(
                f"{url}/v1/completions", json={**body, "prompt": _words(tokens, seed + n)}
            ) as resp:
                await resp.read()
                results.append((sent, resp.status))
        except aiohttp.ClientError:
            results.append((sent, 0))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        tasks = []
        start = time.monotonic()
        n = 0
        while time.monotonic() - start < seconds:
            tasks.append(asyncio.create_task(one(s, urls[n % len(urls)], n)))
            n += 1
            await asyncio.sleep(max(start + n / rate - time.monotonic(), 0.0))
        await asyncio.gather(*tasks)
    return results


def _recent(state: dict[str, Any], loop: str, kind: str) -> list[dict[str, Any]]:
    return [d for d in state["scheduler"]["recent"] if d["loop"] == loop and d["kind"] == kind]


def test_one_leader_and_a_follower_leads_soon_after_a_sigkill(
    replicas: list[Replica],
) -> None:
    """Exactly one leader among three, all agreeing on it and its epoch; after the leader's
    SIGKILL a follower leads within 3 s of the lease's expiry at a newer epoch, its decisions
    continue (its periods run) and the remaining follower applies them; requests sent to
    the two live replicas meanwhile all succeed. The metrics say the same: the first leader
    counted one election, the followers none; then the new leader counts one election and
    its `prfaas_coordination_leader` is 1, the remaining follower's counts do not move."""
    leader, epoch = agreed_leader(replicas)
    for _ in range(20):  # one leader at any time (sampled over a second)
        assert len(leaders(replicas)) == 1
        time.sleep(0.05)
    before = _roles(replicas)
    assert before == {r.name: (1, 0, 1) if r.name == leader else (0, 0, 0) for r in replicas}
    old = next(r for r in replicas if r.name == leader)
    rest = [r for r in replicas if r is not old]
    killed = time.monotonic()
    old.signal(signal.SIGKILL)
    old.proc.wait()

    load = _Background(_open_loop([r.url for r in rest], 4.0, TTL_S + 2.0, 200, 1))
    new_leader, new_epoch = agreed_leader(rest)
    took = time.monotonic() - killed
    assert took <= TTL_S + 3.0, f"a follower led {took:.1f} s after the SIGKILL"
    assert new_leader != leader and new_epoch > epoch
    sent = load.result()
    assert sent and {status for _, status in sent} == {200}, sent

    new = next(r for r in rest if r.name == new_leader)
    follower = next(r for r in rest if r is not new)
    assert _roles(rest) == {new.name: (1, 0, 1), follower.name: (0, 0, 0)}
    periods = new.metric("prfaas_rebalance_periods_total")
    wait_for(
        "the new leader's periods",
        lambda: new.metric("prfaas_rebalance_periods_total") > periods,
        PERIOD_S * 2 + 1,
    )
    applied = wait_for(
        "the follower applying the new leader's state",
        lambda: (
            (follower.coordination()["last_applied"] or {}).get("leader") == new_leader
            and follower.coordination()["last_applied"]
        ),
        5.0,
    )
    assert applied["leader_epoch"] == new_epoch
    lead = _recent(new.state(), "leader", "lead")
    assert lead and lead[-1]["inputs"]["epoch"] == new_epoch
    shown = get_json(f"{new.url}/admin/dashboard")["state"]["coordination"]  # the page's data
    assert (shown["role"], shown["epoch"], shown["leader"]) == ("leader", new_epoch, new_leader)


class _Background:
    """A coroutine run to its end on a loop of its own, in a thread, while the test polls."""

    def __init__(self, coro: Coroutine[Any, Any, list[tuple[float, int]]]) -> None:
        self._out: list[list[tuple[float, int]]] = []
        self._thread = threading.Thread(target=lambda: self._out.append(asyncio.run(coro)))
        self._thread.start()

    def result(self) -> list[tuple[float, int]]:
        self._thread.join(120)
        assert self._out, "the load did not end"
        return self._out[0]


def test_a_paused_leader_is_fenced_by_the_engines_and_steps_down(
    replicas: list[Replica], engines: list[Engine]
) -> None:
    """The leader starts converting a decode whose drain is held by a long request; it is
    paused (SIGSTOP) for 10 s, a follower leads and announces its epoch to the engines; on
    SIGCONT, when the drain ends, the engine refuses the old leader's conversion (409
    fenced): the role is unchanged and the old leader says it follows. Its metrics count
    the lost lead once (`prfaas_leader_losses_total` 1, `prfaas_coordination_leader` 0),
    and the new leader counts one election and no loss."""
    leader, epoch = agreed_leader(replicas)
    old = next(r for r in replicas if r.name == leader)
    decodes = [e for e in engines if e.launch.role == "decode"]
    holds = [_hold(e, f"hold-{e.launch.id}") for e in decodes]
    try:
        seed = 100
        deadline = time.monotonic() + 90
        while not old.state()["scheduler"]["long_term"]["converting"]:
            assert time.monotonic() < deadline, old.state()["scheduler"]["long_term"]
            asyncio.run(_open_loop([r.url for r in replicas], 4.0, 2.0, 900, seed))
            seed += 1000
        old.signal(signal.SIGSTOP)
        paused = time.monotonic()
        rest = [r for r in replicas if r is not old]
        new_leader, new_epoch = agreed_leader(rest)
        assert new_epoch > epoch
        time.sleep(max(10.0 - (time.monotonic() - paused), 0.0))
        old.signal(signal.SIGCONT)
    finally:
        for engine, (rid, task) in zip(decodes, holds, strict=True):
            post_json(f"{engine.url}/abort_request", {"rid": rid}, ENGINE_AUTH)
            task.join(30)
    fenced: list[dict[str, Any]] = wait_for(
        "the old leader's conversion fenced",
        lambda: _recent(old.state(), "long-term", "fenced"),
        15.0,
    )
    assert fenced[-1]["reason"].endswith("/admin/role answered 409 (fenced)")
    assert old.coordination()["role"] == "follower"
    assert old.metric("prfaas_role_conversions_total", result="ok") == 0
    assert leaders(replicas) == [new_leader]
    roles = _roles(replicas)
    assert roles[old.name] == (1, 1, 0) and roles[new_leader] == (1, 0, 1), roles
    # the new leader may convert a decode itself (the same load's samples reached it): any
    # decode that switched did so at its hand, under its epoch
    new = next(r for r in replicas if r.name == new_leader)
    for engine in decodes:
        if _engine_role(engine) != "decode":
            _converted_by(new, f"{engine.launch.id} decode -> prefill")


def _converted_by(replica: Replica, why: str) -> None:
    def done() -> bool:
        return why in {d["reason"] for d in _recent(replica.state(), "long-term", "role")}

    wait_for(f"{replica.name}: {why}", done, 5.0)


def _hold(engine: Engine, rid: str) -> tuple[str, Any]:
    """A long decode on `engine` sent straight to it (so a drain waits for it), in a thread;
    aborted by the test."""
    body = {
        "rid": rid,
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": 5_000, "temperature": 0, "ignore_eos": True},
    }
    url = f"{engine.url}/generate"
    thread = threading.Thread(target=post_json, args=(url, body, ENGINE_AUTH, 600.0), daemon=True)
    thread.start()
    wait_for(f"{rid} decoding", lambda: get_json(f"{engine.url}/stats", ENGINE_AUTH)["running"], 10)
    return rid, thread


def _engine_role(engine: Engine) -> str:
    info = get_json(f"{engine.url}/server_info", ENGINE_AUTH)
    return str(info["disaggregation_mode"])


def test_the_leader_estimates_all_replicas_traffic_and_converts_once(
    replicas: list[Replica], engines: list[Engine]
) -> None:
    """Requests at a steady rate spread round-robin over three replicas: the leader's
    estimated arrival rate and mean incremental length are within 10% of the offered load's,
    and the prefill-heavy load converts exactly one decode (one conversion in all, not one
    per replica)."""
    leader, _ = agreed_leader(replicas)
    lead = next(r for r in replicas if r.name == leader)
    rate, tokens, seconds = 3.0, 900, 12 * PERIOD_S  # the EWMA forgets the start (0.7^12)
    load = _Background(_open_loop([r.url for r in replicas], rate, seconds, tokens, 10_000))
    time.sleep(seconds - 1.0)  # read it under load (idle periods after it count 0 arrivals)
    state = lead.state()["scheduler"]
    sent = load.result()
    assert {status for _, status in sent} == {200}
    offered = len(sent) / seconds
    estimate = state["long_term"]["estimate"]
    missed = sum(r.metric("prfaas_replica_reports_missed_total") for r in replicas)
    assert abs(estimate["rate"] - offered) <= 0.1 * offered, (offered, estimate, missed)
    mean_length = math.exp(estimate["length_mu"] + estimate["length_sigma"] ** 2 / 2)
    assert abs(mean_length - tokens) <= 0.1 * tokens, estimate
    conversions = sum(
        r.metric("prfaas_role_conversions_total", to_role="prefill", result="ok") for r in replicas
    )
    assert conversions == 1, [_recent(r.state(), "long-term", "rebalance") for r in replicas]
    roles = sorted(_engine_role(e) for e in engines if e.launch.cluster == "pd")
    assert roles == ["decode", "prefill", "prefill"]


def test_with_the_store_down_replicas_serve_and_nobody_converts(
    replicas: list[Replica], store: EtcdServer
) -> None:
    """etcd killed: every replica says the store is down, nobody leads (the leader counts a
    lost lead), every replica keeps serving on the last state, and a prefill-heavy load
    converts nothing. etcd back: a leader is elected within TTL + TTL/3 (+1 s of slack),
    and its first period comes within one period (+0.5 s) of that election.

    Why these bounds: the last leader's election key outlives the outage, bound to its
    lease, and etcd restarts every lease with its full TTL (plus its election timeout,
    0.5 s here; expired leases are reaped every 0.5 s), so the key is gone about TTL + 1 s
    after etcd is back at the latest. In fact sooner: the old leader, which kept its lease
    id when it could not revoke it, revokes it at its first election round that etcd
    answers (failed rounds are retried every TTL/3), and the next round, or a follower
    watching the key, creates it again. The
    scheduler's period timer runs in every replica whether it leads or not (a follower's
    period only drops its samples), so the first period after `lead()` comes at the
    timer's next expiry: within one period of the election. The election is timed when
    the test sees every replica agree on the leader, no earlier than it happened, so the
    second bound is never looser than the truth."""
    first, _ = agreed_leader(replicas)
    store.kill()
    wait_for(
        "every replica sees the store down and follows",
        lambda: all(
            not v["store_up"] and v["role"] == "follower"
            for v in (r.coordination() for r in replicas)
        ),
        TTL_S + 3.0,
    )
    roles = _roles(replicas)
    assert roles == {r.name: (1, 1, 0) if r.name == first else (0, 0, 0) for r in replicas}
    before = [r.metric("prfaas_role_conversions_total") for r in replicas]
    load = asyncio.run(_open_loop([r.url for r in replicas], 4.0, 2 * PERIOD_S, 900, 500))
    assert load and {status for _, status in load} == {200}
    assert [r.metric("prfaas_role_conversions_total") for r in replicas] == before
    assert all(not r.coordination()["store_up"] for r in replicas)
    assert all(r.metric("prfaas_coordination_store_up") == 0 for r in replicas)
    for r in replicas:  # still in a load balancer's rotation
        with urllib.request.urlopen(f"{r.url}/health", timeout=5) as reply:
            assert reply.status == 200
    periods = {r.name: r.metric("prfaas_rebalance_periods_total") for r in replicas}

    store.start()
    back = time.monotonic()
    leader, _ = agreed_leader(replicas)
    elected = time.monotonic()
    lead = next(r for r in replicas if r.name == leader)
    wait_for(
        "the new leader's first period",
        lambda: lead.metric("prfaas_rebalance_periods_total") > periods[leader],
        PERIOD_S + 2.0,
        every_s=0.02,
    )
    decided = time.monotonic()
    assert elected - back <= TTL_S + TTL_S / 3 + 1.0, f"elected {elected - back:.2f} s after"
    assert decided - elected <= PERIOD_S + 0.5, f"first period {decided - elected:.2f} s after"
    assert all(r.coordination()["store_up"] for r in replicas)
    assert all(r.metric("prfaas_coordination_store_up") == 1 for r in replicas)
    roles = _roles(replicas)
    assert sum(e for e, _, _ in roles.values()) == 2, roles  # the first election, and this
    assert [n for n, (_, _, leading) in roles.items() if leading] == [leader], roles
    print(
        f"\netcd back: {leader} led after {elected - back:.2f} s, its first period "
        f"{decided - elected:.2f} s later"
    )

"""The Envoy front door (deploy/envoy/) over three coordinated gateway replicas: each a
`prfaas serve` process with `[coordination]` on a real etcd (and `[scheduler]`, so one of
them is the elected leader), over one real reference engine; the leader is stopped under
load (streamed and whole requests through Envoy).

- SIGTERM of the leader: its drain lets every request it holds finish, or ends it at the
  drain deadline with an OpenAI error (a stream: an error event and no `[DONE]`), Envoy
  sends it no new request after the SIGTERM, it exits within the deadline plus a margin,
  and a follower leads (at a newer epoch) during its drain: it resigns as the drain begins.
- SIGKILL of the leader: only streams it had begun fail; requests on the other replicas,
  and every request started after the kill, succeed (also while nobody leads); a follower
  leads within the lease TTL plus a margin, and counts the election.
- The Grafana dashboard's `[coordination]` row queries only metrics these replicas export.
"""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from coordinated_helpers import PROFILE, Replica, agreed_leader, start_replica
from envoy_helpers import EnvoyFront
from etcd_helpers import EtcdServer
from grafana_helpers import dashboard, panels, queried
from metrics_helpers import Scrape
from replica_helpers import Engine, Outcome, completion, deployment_file, reference_engine

pytestmark = pytest.mark.timeout(150)

TTL_S = 2.0
DRAIN_S = 3.0
EXIT_MARGIN_S = 3.0
"""After the drain deadline: the coordinator's resignation and the process's exit."""
LONG = 300
"""Output tokens of the background requests (about a second each under this load), and of
the long streams (well past the drain deadline)."""
CLIENTS = 8


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """One reference engine (`--role both`) the module's replicas share."""
    with reference_engine(tmp_path_factory.mktemp("engine")) as running:
        yield running


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd for the module (each test's replicas under a key prefix of their own)."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data")
    server.start()
    yield server
    server.kill()


@dataclass
class Front:
    """Coordinated replicas a, b, c behind Envoy, and who leads them."""

    replicas: list[Replica]
    envoy: EnvoyFront
    leader: Replica
    epoch: int

    @property
    def others(self) -> list[Replica]:
        return [r for r in self.replicas if r is not self.leader]


def _address(replica: Replica) -> str:
    return replica.url.removeprefix("http://")


@pytest.fixture
def front(engine: Engine, store: EtcdServer, tmp_path: Path) -> Iterator[Front]:
    (tmp_path / "profile.toml").write_text(PROFILE)
    config = deployment_file(
        tmp_path / "deployment.toml",
        engine,
        '[scheduler]\nprofile = "profile.toml"\nperiod_s = 3.0\n'
        "[scheduler.rebalance]\nurgent_gain = inf\n"
        f'[coordination]\netcd = "{store.url}"\nprefix = "/t{time.monotonic_ns()}"\n'
        f"lease_ttl_s = {TTL_S}\npublish_s = 0.25\n",
    )
    started: list[Replica] = []
    envoy = None
    try:
        for name in ("a", "b", "c"):
            started.append(start_replica(config, name, tmp_path, "--drain-timeout", str(DRAIN_S)))
        leader, epoch = agreed_leader(started)
        envoy = EnvoyFront(tmp_path, [_address(r) for r in started])
        envoy.start()
        yield Front(started, envoy, next(r for r in started if r.name == leader), epoch)
    finally:
        if envoy is not None:
            envoy.stop()
        for r in started:
            r.stop()


class Load:
    """`CLIENTS` clients sending requests back to back through Envoy, every other one
    streamed, until `stop`."""

    def __init__(self, s: aiohttp.ClientSession, url: str) -> None:
        self.outcomes: list[Outcome] = []
        self._running = True
        self._tasks = [asyncio.create_task(self._client(c, s, url)) for c in range(CLIENTS)]

    async def _client(self, c: int, s: aiohttp.ClientSession, url: str) -> None:
        n = c
        while self._running:
            self.outcomes.append(await completion(s, url, n, stream=n % 2 == 0))
            n += CLIENTS

    async def stop(self) -> list[Outcome]:
        self._running = False
        await asyncio.gather(*self._tasks)
        return self.outcomes


async def _long_stream_on(
    s: aiohttp.ClientSession, envoy: EnvoyFront, address: str
) -> list[asyncio.Task[Outcome]]:
    """Long streams sent one at a time through Envoy (nothing else in flight, so Envoy's
    per-host active counts say where each went) until one is on `address`; all of them.
    Envoy's least-request picks two hosts at random, so a host can be passed over a few
    times in a row (8 tries miss it with a chance of about (4/9)^8, 1 in 660)."""
    sent: list[asyncio.Task[Outcome]] = []
    while len(sent) < 16:
        sent.append(asyncio.create_task(completion(s, envoy.url, 1000 + len(sent), True, LONG)))
        deadline = time.monotonic() + 10.0
        while sum(h.stats["rq_active"] for h in (await envoy.hosts(s)).values()) < len(sent):
            assert time.monotonic() < deadline, "a long stream never reached a replica"
            await asyncio.sleep(0.01)
        if (await envoy.hosts(s))[address].stats["rq_active"] > 0:
            return sent
    raise AssertionError(f"no long stream reached {address}")


async def test_sigterm_of_the_leader_under_load(front: Front) -> None:
    """Streams long enough to outlast the drain (one at least on the leader) and 8 clients'
    requests (half streamed) in flight; the leader gets SIGTERM. Envoy takes it out of its
    rotation within 1.5 s (its `/health` answers 503, new connections are refused); a
    request Envoy still sent it before that, on a pooled connection, is refused unrun
    (503, `x-prfaas-not-started`) and retried on another replica, so every request served
    there was sent before the SIGTERM. Each either completes normally by the deadline or,
    still running at the deadline, ends then with a `shutting_down` OpenAI error (a stream:
    an error event, a complete body, no `[DONE]`); at least one long stream there ends that
    way. Every request on the other replicas succeeds, and so does every request started
    after the SIGTERM. The leader resigns as its drain begins: a follower leads at a newer
    epoch before the drain's deadline; the process exits 0 within the deadline plus a
    margin."""
    envoy, victim = front.envoy, front.leader
    address, others = _address(victim), [_address(r) for r in front.others]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        await envoy.wait_routable(s, [_address(r) for r in front.replicas])
        long_streams = await _long_stream_on(s, envoy, address)
        load = Load(s, envoy.url)
        await asyncio.sleep(1.5)
        await envoy.wait_host(s, address, lambda h: h.stats["rq_active"] >= 2)
        victim.signal(signal.SIGTERM)
        termed = time.monotonic()
        at_term = (await envoy.hosts(s))[address]
        out = await envoy.wait_host(s, address, lambda h: not h.routable, timeout_s=3.0)
        out_after = time.monotonic() - termed
        new_leader, new_epoch = await asyncio.to_thread(agreed_leader, front.others, 10.0)
        led_after = time.monotonic() - termed
        code = await asyncio.to_thread(victim.proc.wait, DRAIN_S + EXIT_MARGIN_S + 5)
        exited_after = time.monotonic() - termed
        await asyncio.sleep(0.5)
        outcomes = await load.stop() + list(await asyncio.gather(*long_streams))
        end = (await envoy.hosts(s))[address]
    await asyncio.sleep(0.3)  # the access log is flushed every 50 ms
    log = {line["request_id"]: line for line in envoy.access_log()}
    host = {o.n: log[o.request_id or ""]["upstream_host"] for o in outcomes}

    assert out_after < 1.5, out  # its 503 to a probe, or a refused connection (retried)
    late = end.stats["rq_total"] - at_term.stats["rq_total"]  # sent to it after the SIGTERM
    retried = [line for line in log.values() if line["attempts"] > 1]
    assert late <= len(retried), (at_term.stats, end.stats, retried)
    assert all(line["upstream_host"] in others and line["status"] == 200 for line in retried)
    assert code == 0 and exited_after <= DRAIN_S + EXIT_MARGIN_S, exited_after
    assert new_leader != victim.name and new_epoch > front.epoch
    assert led_after < DRAIN_S, (led_after, exited_after)  # it resigned as its drain began

    on_victim = [o for o in outcomes if host[o.n] == address]
    drained = [o for o in on_victim if o.ok and o.end > termed]
    assert all(o.start < termed for o in on_victim)
    assert all(o.end - termed <= DRAIN_S + 0.5 for o in drained)
    cut = [o for o in on_victim if not o.ok]
    for o in cut:  # still running at the deadline: ended then, with the reason
        assert o.error is None and o.error_code() == "shutting_down", o
        assert o.status == (200 if o.stream else 503), o
        assert DRAIN_S - 0.5 <= o.end - termed <= DRAIN_S + 1.5, (o.end - termed, o)
    assert any(o.stream and o.n >= 1000 for o in cut), "no long stream outlasted the drain"
    on_others = [o for o in outcomes if host[o.n] in others]
    assert on_others and all(o.ok for o in on_others), [o for o in on_others if not o.ok]
    assert all(o.ok for o in outcomes if o.start > termed)
    assert len([o for o in outcomes if o.start > termed]) >= CLIENTS
    reason = "health check" if out.failed_active_health_check else "refused connection"
    refused = end.stats.get("cx_connect_fail", 0) - at_term.stats.get("cx_connect_fail", 0)
    print(
        f"\n{len(outcomes)} requests; the leader held {at_term.stats['rq_active']} at the "
        f"SIGTERM: {len(drained)} completed in the drain, {len(cut)} ended at the deadline "
        f"with shutting_down; out of Envoy's rotation after {out_after:.2f} s ({reason}), "
        f"{refused} connections refused, {late} requests refused unrun, all retried; exited after "
        f"{exited_after:.2f} s, {new_leader} led after {led_after:.2f} s"
    )


async def test_sigkill_of_the_leader_under_load(front: Front) -> None:
    """8 clients' requests (half streamed) through Envoy; the leader is SIGKILLed while it
    holds some. Every failed request is a stream it had begun answering; requests on the
    other replicas, and every request started after the kill, succeed (those sent while
    nobody leads too: routing needs no leader); Envoy made at most one attempt on the dead
    replica after its death and ejected it; a follower leads within the lease TTL plus
    3 s, at a newer epoch, and counts that election (`prfaas_leader_elections_total`)."""
    envoy, victim = front.envoy, front.leader
    address, others = _address(victim), [_address(r) for r in front.others]
    elections = {r.name: r.metric("prfaas_leader_elections_total") for r in front.others}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        await envoy.wait_routable(s, [_address(r) for r in front.replicas])
        load = Load(s, envoy.url)
        await asyncio.sleep(1.5)
        await envoy.wait_host(s, address, lambda h: h.stats["rq_active"] > 0)
        victim.signal(signal.SIGKILL)
        killed = time.monotonic()
        at_kill = (await envoy.hosts(s))[address]
        new_leader, new_epoch = await asyncio.to_thread(agreed_leader, front.others, 10.0)
        led_after = time.monotonic() - killed
        await asyncio.sleep(1.0)
        outcomes = await load.stop()
        end = await envoy.hosts(s)
        counters = await envoy.counters(s)
    await asyncio.sleep(0.3)  # the access log is flushed every 50 ms
    log = {line["request_id"]: line for line in envoy.access_log()}

    assert new_leader != victim.name and new_epoch > front.epoch
    assert led_after <= TTL_S + 3.0, led_after
    new = next(r for r in front.others if r.name == new_leader)
    follower = next(r for r in front.others if r is not new)
    assert new.metric("prfaas_leader_elections_total") == elections[new.name] + 1
    assert follower.metric("prfaas_leader_elections_total") == elections[follower.name]

    dead = end[address]
    after_death = dead.stats["rq_total"] - at_kill.stats["rq_total"] + dead.stats["cx_connect_fail"]
    assert after_death <= 1, dead.stats
    assert not dead.routable and all(end[a].routable for a in others)
    assert counters["outlier_detection.ejections_enforced_consecutive_local_origin_failure"] >= 1
    failed = [o for o in outcomes if not o.ok]
    for o in failed:  # a stream the dead replica had begun: headers came, then the cut
        assert o.stream and o.status == 200 and o.start < killed, o
        line = log[o.request_id or ""]
        assert line["upstream_host"] == address, line
        assert line["details"].startswith("upstream_reset_after_response_started"), line
    leaderless = [o for o in outcomes if killed < o.start < killed + led_after]
    assert leaderless and all(o.ok for o in leaderless)
    assert all(o.ok for o in outcomes if o.start > killed)
    on_others = [o for o in outcomes if log[o.request_id or ""]["upstream_host"] in others]
    assert on_others and all(o.ok for o in on_others)
    retried = [line for line in log.values() if line["attempts"] > 1]
    assert all(line["upstream_host"] in others and line["status"] == 200 for line in retried)
    print(
        f"\n{len(outcomes)} requests; the leader held {at_kill.stats['rq_active']} at the "
        f"kill: {len(failed)} streams it had begun were lost, {len(retried)} retried "
        f"elsewhere; {len(leaderless)} sent while nobody led, all answered; {new_leader} "
        f"led after {led_after:.2f} s"
    )


def test_the_grafana_coordination_panels_query_what_replicas_export(front: Front) -> None:
    """deploy/grafana/prfaas.json's `[coordination]` row has panels for who leads, elections
    and lead losses, etcd's reachability and the followers' apply lag, and every metric
    they name is in a real scrape of each coordinated replica, leader and followers."""
    named = queried(panels(dashboard(), coordination=True))
    assert {
        "prfaas_coordination_leader",
        "prfaas_leader_elections_total",
        "prfaas_leader_losses_total",
        "prfaas_coordination_store_up",
        "prfaas_schedule_apply_lag_seconds_bucket",
    } <= named
    for r in front.replicas:
        with urllib.request.urlopen(f"{r.url}/metrics", timeout=5) as reply:
            scrape = Scrape.parse(reply.read().decode())
        exported = {s.name for samples in scrape.families.values() for s in samples}
        assert named <= exported, (r.name, sorted(named - exported))

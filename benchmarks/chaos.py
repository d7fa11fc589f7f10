"""Benchmark: chaos against `prfaas serve` (the embedded default: three reference engines
as children, the paced cross-DC link, supervision, health with outlier detection; with
`--engines vllm`, four launched vLLM servers of the tiny checkpoint running the PrfaaS
connector, benchmarks/chaos_vllm.py).

Mixed load (closed-loop clients, greedy, streamed and whole, prompts from ~60 to ~3000
tokens, so both routes are used) runs for `--duration` seconds while a seeded schedule of
faults hits the engines one at a time: `kill` (SIGKILL), `restart` (SIGTERM, a graceful
exit the supervisor did not ask for), `stop` (SIGSTOP for a few seconds, then SIGCONT) and
`flood` (hundreds of connections on the PrfaaS prefill's KV bootstrap port, any engine's
with vLLM: garbage, HELLOs that never authenticate, forged AUTHs and REGISTERs, connections
that say nothing). With vLLM engines the fault hits the vLLM API server (not its reaper), and
every other stop outlasts the deployment's `unresponsive_restart_s` (set to 8 s there), so
the supervisor kills and restarts it; a vLLM start takes a minute or more here, so the
kinds come in seeded rounds (each once per round, stop twice: one long, one short) with
5-15 s between faults.
Every answer is classified:
- completed: a whole answer (`[DONE]` after a finish reason, or a JSON completion);
- failed: the client was told (an HTTP error, or an error event that ends a stream);
- refused: turned away at the door (429 queue full, or 503 while no instance of a needed
  role is up) - not accepted;
- lost: accepted, yet neither completed nor failed (a cut stream, a timeout): must be 0.
Every completed answer is compared with the same prompt's unfailed greedy output (from a
direct `--role both` engine, or an aggregated vLLM server without a connector, computed
before the chaos; with vLLM the same prompts through the gateway before the chaos are
checked against it too). Per fault it reports the time to recover (until the gateway routes
to every engine again; for kill and restart from the death, for stop from SIGCONT or from
the supervisor's kill, for flood from its end) and whether it took over 30 s (60 s with
vLLM); after a death, when the supervisor's new process appeared and the engine's own start
(new process to `/health`); peak RSS of the gateway and of each engine's process tree
(across restarts); the gateway's retries, migrations, ejections, engine restarts and
unresponsive kills from `/metrics`.

With `--replicas`, the faults hit gateways and the store instead: three `prfaas serve`
replicas over one etcd behind Envoy, SIGKILLed, SIGTERMed (drained), SIGSTOPped, and etcd
SIGKILLed (benchmarks/chaos_replicas.py).

The machine is shared (2 cores, other work running): latencies are not the point here,
what is lost and what is wrong is.
Usage: python benchmarks/chaos.py [--duration 600] [--seed 0] [--clients 3] [--json OUT]
       [--engines reference|vllm] [--replicas]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import re
import secrets
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from chaos_vllm import ENGINES as VLLM_ENGINES
from chaos_vllm import (
    LONG_STOP_S,
    VLLM_MODEL,
    VLLM_PYTHON,
    start_aggregated,
    watch_comeback,
    write_deployment,
)
from rich.console import Console
from rich.table import Table

from prfaas.common.secret import ENV_SECRET
from prfaas.engines.transport.frames import Kind, make_frame
from prfaas.engines.transport.wire import json_frame
from prfaas.engines.vllm.launch import VLLMProcess
from prfaas.serve.reaper import descendants
from prfaas.testing.processes import child_pids, engine_pid, waiting_standby

MODEL = "qwen3-next-tiny"
MAX_TOKENS = 16
RECOVERY_GOAL_S = 30.0
LISTENING = re.compile(r"PrfaaS gateway listening on (http://\S+)")
ENGINE_READY = re.compile(r"prfaas engine ready: (http://\S+)")
ENGINES = ("prfaas-p0", "pd-p0", "pd-d0")
VLLM_RECOVERY_GOAL_S = 60.0
FAULTS = ("kill", "restart", "stop", "flood")
VLLM_ROUND = (*FAULTS, "stop")
"""With vLLM, each round holds every kind and two stops: every other stop is long."""


# -- processes -----------------------------------------------------------------------------


def _spawn(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "prfaas.cli.main", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def _wait_line(proc: subprocess.Popen[str], pattern: re.Pattern[str], timeout_s: float) -> str:
    assert proc.stdout is not None
    deadline, seen = time.monotonic() + timeout_s, list[str]()
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("process exited before it was ready:\n" + "".join(seen[-30:]))
        seen.append(line)
        if match := pattern.search(line):
            return match.group(1)
    raise RuntimeError(f"not ready within {timeout_s} s")


def _engine_name(pid: int) -> str | None:
    """Which engine a child is, from its command line (a launched vLLM server's KV events
    socket is named after its instance)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except OSError:
        return None
    if "--kv-events-config" in argv:
        endpoint = orjson.loads(argv[argv.index("--kv-events-config") + 1])["endpoint"]
        return str(endpoint).rsplit("/", 1)[-1].removesuffix(".events")
    if "decode" in argv:
        return "pd-d0"
    if "prefill" in argv:
        return "prfaas-p0" if "--egress-rate-mbps" in argv else "pd-p0"
    return None


def engine_leaders(gateway_pid: int) -> dict[str, int]:
    """`prfaas serve`'s child for each engine (a vLLM server's reaper) by instance id (not
    the standby for its next start: a vLLM engine started from it counts from its `go`,
    when it starts its EngineCore)."""
    children = [p for p in child_pids(gateway_pid) if not waiting_standby(p)]
    found = {(_engine_name(p), p) for p in children}
    return {name: pid for name, pid in found if name is not None}


def engine_pids(gateway_pid: int) -> dict[str, int]:
    """Each engine's own process (a vLLM server, not its reaper) by instance id."""
    found = {(name, engine_pid(p)) for name, p in engine_leaders(gateway_pid).items()}
    return {name: pid for name, pid in found if pid is not None}


def alive(pid: int) -> bool:
    """Running or stopped (not gone, not a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def tree_rss_bytes(pid: int) -> int:
    """RSS of a process and its descendants (a vLLM server and its EngineCore)."""
    return sum(rss_bytes(p) for p in (pid, *descendants(pid)))


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# -- load ----------------------------------------------------------------------------------


def words(n_tokens: int, rng: random.Random) -> str:
    text = ""
    while len(text) < n_tokens:
        text += "".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 7))) + " "
    return text[:n_tokens]


@dataclass
class Outcome:
    kind: str  # completed | failed | refused | lost
    code: str = ""
    stream: bool = False
    correct: bool | None = None
    latency_s: float = 0.0
    message: str = ""
    """A failure's error message (the gateway's, naming the engine's where it relays it)."""
    at: float = 0.0
    """When it ended (the loop's clock)."""


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)
    t0: float = 0.0

    def counts(self) -> dict[str, int]:
        return dict(Counter(o.kind for o in self.outcomes))


async def one_request(
    session: aiohttp.ClientSession, url: str, prompt: str, stream: bool, expected: str
) -> Outcome:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": stream}  # fmt: skip
    start = time.monotonic()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            if r.status != 200:
                error = (await r.json(content_type=None)).get("error", {})
                code = str(error.get("code"))
                door = r.status == 429 or code == "no_instance_available"  # never accepted
                kind = "refused" if door else "failed"
                return Outcome(kind, code, stream, message=str(error.get("message"))[:300],
                               at=time.monotonic())  # fmt: skip
            if not stream:
                answer = await r.json()
                text = answer["choices"][0]["text"]
                done = answer["choices"][0]["finish_reason"] is not None
                return _finished(done, text, expected, stream, start)
            texts, finished, done = [], False, False
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                event = orjson.loads(data)
                if "error" in event:
                    error = event["error"]
                    return Outcome("failed", str(error.get("code")), stream,
                                   message=str(error.get("message"))[:300],
                                   at=time.monotonic())  # fmt: skip
                texts.append(event["choices"][0]["text"])
                finished = finished or event["choices"][0]["finish_reason"] is not None
            return _finished(done and finished, "".join(texts), expected, stream, start)
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
        return Outcome("lost", type(exc).__name__, stream)


def _finished(whole: bool, text: str, expected: str, stream: bool, start: float) -> Outcome:
    if not whole:
        return Outcome("lost", "incomplete", stream)
    return Outcome("completed", "", stream, text == expected, time.monotonic() - start)


async def client_loop(
    url: str, pool: list[tuple[str, str]], rng: random.Random, stop: float, tally: Tally
) -> None:
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.monotonic() < stop:
            prompt, expected = rng.choice(pool)
            outcome = await one_request(session, url, prompt, rng.random() < 0.5, expected)
            tally.outcomes.append(outcome)
            if outcome.kind == "refused":  # Retry-After
                await asyncio.sleep(1.0)


async def references(direct: str, prompts: list[str]) -> list[str]:
    """Unfailed greedy outputs from a direct aggregated engine."""
    out = []
    async with aiohttp.ClientSession() as session:
        for prompt in prompts:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            async with session.post(f"{direct}/v1/completions", json=body) as r:
                out.append((await r.json())["choices"][0]["text"])
    return out


# -- faults --------------------------------------------------------------------------------


@dataclass
class Fault:
    kind: str
    engine: str
    at_s: float
    duration_s: float = 0.0
    recovery_s: float | None = None
    within_goal: bool = False
    detail: str = ""
    respawn_s: float | None = None
    """After a death: when the supervisor's new process appeared (from the death)."""
    start_s: float | None = None
    """After a death: the engine's own start, from its new process to `/health`."""
    recovery_less_start_s: float | None = None
    """After a death: the recovery less the engine's own start (what PrfaaS adds: noticing
    the death, the supervisor's backoff, readmission)."""


async def state(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(f"{url}/admin/state") as r:
        body: dict[str, Any] = await r.json()
        return body


async def all_healthy(session: aiohttp.ClientSession, url: str) -> bool:
    s = await state(session, url)
    return all(i["status"] == "healthy" for c in s["clusters"].values() for i in c)


async def await_recovery(
    session: aiohttp.ClientSession, url: str, since: float, limit_s: float = 120.0
) -> float | None:
    while time.monotonic() - since < limit_s:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            if await all_healthy(session, url):
                return time.monotonic() - since
        await asyncio.sleep(0.25)
    return None


async def flood(port: int, seconds: float) -> dict[str, int]:
    """Hammer the bootstrap port without the key: every way in that a client without the
    deployment secret could try."""
    stop, stats = time.monotonic() + seconds, Counter[str]()

    async def attacker(i: int) -> None:
        while time.monotonic() < stop:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                stats["connect_failed"] += 1
                await asyncio.sleep(0.05)
                continue
            try:
                mode = i % 4
                if mode == 0:
                    writer.write(os.urandom(256))
                elif mode in (1, 2):
                    hello = {"peer": secrets.token_hex(16), "index": i % 4,
                             "nonce": secrets.token_hex(16)}  # fmt: skip
                    writer.write(_bytes(json_frame(Kind.HELLO, 0, hello)))
                    if mode == 2:
                        writer.write(_bytes(json_frame(Kind.AUTH, 0, {"proof": "0" * 64})))
                        for room in range(200):
                            writer.write(_bytes(make_frame(Kind.REGISTER, room + 1, [])))
                await writer.drain()
                # mode 3 says nothing at all
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(reader.read(), 5)
                stats["closed_by_sender"] += 1
            except OSError:
                stats["reset"] += 1
            finally:
                writer.close()

    await asyncio.gather(*(attacker(i) for i in range(200)))
    return dict(stats)


def _bytes(frame: Any) -> bytes:
    return b"".join([frame.header, *frame.pieces])


@dataclass(frozen=True)
class Target:
    """What the faults hit: the engines' names, the recovery goal, and with vLLM the long
    stops, floods of any engine's bootstrap port, and the kinds in seeded rounds (each kind
    once per round: a vLLM death costs minutes on this machine, so a run holds few faults)
    with shorter pauses between faults."""

    engines: tuple[str, ...] = ENGINES
    goal_s: float = RECOVERY_GOAL_S
    vllm: bool = False


async def _stop(pid: int, seconds: float, fault: Fault) -> float | None:
    """SIGSTOP `pid` for `seconds`, then SIGCONT; the time it died instead (the
    supervisor's kill of an engine that stopped answering), else None."""
    os.kill(pid, signal.SIGSTOP)
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        if not alive(pid):
            died = time.monotonic()
            fault.detail = f"killed by the supervisor {fault.duration_s - (until - died):.1f} s in"
            return died
        await asyncio.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)
    return None


async def chaos(
    url: str,
    gateway_pid: int,
    rng: random.Random,
    stop: float,
    faults: list[Fault],
    t0: float,
    target: Target = Target(),
) -> None:
    stops, round_ = 0, list[str]()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        await asyncio.sleep(rng.uniform(10, 20))
        while time.monotonic() < stop - 30:
            if target.vllm:
                round_ = round_ or rng.sample(VLLM_ROUND, len(VLLM_ROUND))
                kind, engine = round_[0], rng.choice(target.engines)
            else:
                kind, engine = rng.choice(FAULTS), rng.choice(target.engines)
            if kind == "flood" and not target.vllm:
                engine = "prfaas-p0"
            leader = engine_leaders(gateway_pid).get(engine)
            pid = None if leader is None else engine_pid(leader)
            if leader is None or pid is None:
                await asyncio.sleep(1)
                continue
            if round_:
                round_.pop(0)
            fault = Fault(kind, engine, round(time.monotonic() - t0, 1))
            faults.append(fault)
            print(f"[{fault.at_s:7.1f} s] {kind} {engine} (pid {pid})", flush=True)
            since, died = time.monotonic(), None
            instance = await _instance(session, url, engine)
            if kind in ("kill", "restart"):
                os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGTERM)
                died = since
            elif kind == "stop":
                fault.duration_s = round(rng.uniform(2, 12), 1)
                if target.vllm and stops % 2 == 0:
                    fault.duration_s = LONG_STOP_S
                stops += 1
                died = await _stop(pid, fault.duration_s, fault)
                since = died or time.monotonic()
            else:
                fault.duration_s = round(rng.uniform(10, 20), 1)
                fault.detail = str(await flood(instance["bootstrap_port"], fault.duration_s))
                since = time.monotonic()
            if died is not None:
                # a new leader: the old reaper may hold the orphaned EngineCore a moment
                def new_pid(old: int = leader, name: str = engine) -> int | None:
                    now = engine_leaders(gateway_pid).get(name)
                    return None if now is None or now == old else engine_pid(now)

                back = await watch_comeback(new_pid, instance["url"], died)
                fault.respawn_s, fault.start_s = back.respawn_s, back.start_s
                print(f"           new process after {back.respawn_s} s, /health "
                      f"{back.start_s} s later", flush=True)  # fmt: skip
            await asyncio.sleep(1.5)  # let the gateway notice (a probe round) before judging
            fault.recovery_s = await await_recovery(session, url, since, 300.0)
            if fault.recovery_s is not None:
                fault.recovery_s = round(fault.recovery_s, 2)
                if fault.start_s is not None:
                    fault.recovery_less_start_s = round(fault.recovery_s - fault.start_s, 2)
                fault.within_goal = fault.recovery_s <= target.goal_s
            print(f"           recovered in {fault.recovery_s} s", flush=True)
            await asyncio.sleep(rng.uniform(5, 15) if target.vllm else rng.uniform(15, 30))


async def _instance(session: aiohttp.ClientSession, url: str, name: str) -> dict[str, Any]:
    s = await state(session, url)
    return next(i for c in s["clusters"].values() for i in c if i["id"] == name)


async def sample_memory(
    gateway_pid: int, stop: float, peaks: dict[str, int], interval_s: float = 0.5
) -> None:
    while time.monotonic() < stop:
        peaks["gateway"] = max(peaks.get("gateway", 0), rss_bytes(gateway_pid))
        for name, pid in engine_pids(gateway_pid).items():
            peaks[name] = max(peaks.get(name, 0), tree_rss_bytes(pid))
        await asyncio.sleep(interval_s)


async def metrics(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as r:
        text = await r.text()
    wanted = ("prfaas_request_retries_total", "prfaas_request_migrations_total",
              "prfaas_instance_ejections_total", "prfaas_engine_restarts_total",
              "prfaas_engine_unresponsive_kills_total")  # fmt: skip
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in wanted:
            if line.startswith(name):
                key = name + line[len(name) :].split(" ")[0].removeprefix(name)
                out[key] = float(line.rsplit(" ", 1)[1])
    return out


# -- run -----------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    secret = secrets.token_hex(32)
    vllm = args.engines == "vllm"
    if vllm:
        config = write_deployment(MODEL, args.threshold, args.vllm_python, args.vllm_model)
        serve = _spawn(["serve", "--port", "0", "--config", str(config)], {ENV_SECRET: secret})
        direct: subprocess.Popen[str] | VLLMProcess = await asyncio.to_thread(
            start_aggregated, MODEL, args.vllm_python, args.vllm_model
        )
        target = Target(tuple(name for name, _, _ in VLLM_ENGINES), VLLM_RECOVERY_GOAL_S, True)
    else:
        serve = _spawn(["serve", "--port", "0", "--threshold", str(args.threshold)],
                       {ENV_SECRET: secret})  # fmt: skip
        direct = _spawn(["engine", "--role", "both", "--port", "0", "--threads", "1"])
        target = Target()
    try:
        url = await asyncio.to_thread(_wait_line, serve, LISTENING, 900 if vllm else 300)
        if isinstance(direct, VLLMProcess):
            direct_url = direct.url
        else:
            direct_url = _wait_line(direct, ENGINE_READY, 300)
        start: list[float] = []
        drain = asyncio.ensure_future(asyncio.to_thread(_drain, serve, start))
        lengths = [int(rng.lognormvariate(6.3, 0.9)) for _ in range(args.prompts)]
        prompts = [words(min(max(n, 60), 3000), rng) for n in lengths]
        print(f"gateway {url}; computing {len(prompts)} reference outputs", flush=True)
        expected = await references(direct_url, prompts)
        if isinstance(direct, VLLMProcess):
            direct.stop()
        else:
            direct.send_signal(signal.SIGTERM)
            direct.wait(30)
        # the gateway's unfailed answers, before any fault, against the references
        through = await references(url, prompts) if vllm else expected
        pre_chaos_equal = sum(a == b for a, b in zip(through, expected, strict=True))
        print(f"before the chaos: {pre_chaos_equal}/{len(prompts)} gateway answers equal "
              "the references", flush=True)  # fmt: skip
        pool = list(zip(prompts, expected, strict=True))
        t0 = time.monotonic()
        start.append(t0)
        stop = t0 + args.duration
        tally, faults, peaks = Tally(t0=t0), list[Fault](), dict[str, int]()
        tasks = [client_loop(url, pool, random.Random(args.seed * 100 + i), stop, tally)
                 for i in range(args.clients)]  # fmt: skip
        await asyncio.gather(
            *tasks,
            chaos(url, serve.pid, rng, stop, faults, t0, target),
            sample_memory(serve.pid, stop + 5, peaks),
        )
        counters = await metrics(url)
        serve.send_signal(signal.SIGTERM)
        serve.wait(60)
        drain.cancel()
        result = report(args, tally, faults, peaks, counters, [len(p) for p in prompts])
        result["pre_chaos_gateway_equal"] = f"{pre_chaos_equal}/{len(prompts)}"
        return result
    finally:
        if isinstance(direct, VLLMProcess):
            direct.stop()
        for proc in (serve, direct):
            if isinstance(proc, subprocess.Popen) and proc.poll() is None:
                proc.kill()
                proc.wait()


SERVE_LINES = ("restart", "exited", "back", "ejected", "readmitted", "standby")
"""The serve log's lines about engines' deaths and comebacks, shown as they come."""


def _drain(proc: subprocess.Popen[str], t0: list[float]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if any(w in line for w in SERVE_LINES):
            at = time.monotonic() - t0[0] if t0 else 0.0
            print(f"[{at:7.1f} s]   serve: {line.rstrip()}", flush=True)


def report(
    args: argparse.Namespace,
    tally: Tally,
    faults: list[Fault],
    peaks: dict[str, int],
    counters: dict[str, float],
    lengths: list[int],
) -> dict[str, Any]:
    counts = tally.counts()
    completed = [o for o in tally.outcomes if o.kind == "completed"]
    accepted = sum(v for k, v in counts.items() if k != "refused")
    recoveries = [f.recovery_s for f in faults if f.recovery_s is not None]
    starts = [f.start_s for f in faults if f.start_s is not None]
    deaths = [f for f in faults if f.kind in ("kill", "restart") or f.respawn_s is not None]
    return {
        "engines": args.engines,
        "duration_s": args.duration,
        "seed": args.seed,
        "clients": args.clients,
        "threshold": args.threshold,
        "prompt_tokens": {
            "min": min(lengths),
            "median": statistics.median(lengths),
            "max": max(lengths),
        },
        "sent": len(tally.outcomes),
        "accepted": accepted,
        "completed": counts.get("completed", 0),
        "failed_with_error": counts.get("failed", 0),
        "refused_429": counts.get("refused", 0),
        "lost": counts.get("lost", 0),
        "error_codes": dict(Counter(o.code for o in tally.outcomes if o.kind != "completed")),
        "failures": [
            {
                "at_s": round(o.at - tally.t0, 1),
                "code": o.code,
                "stream": o.stream,
                "message": o.message,
            }
            for o in tally.outcomes
            if o.kind == "failed"
        ],
        "completed_equal_to_unfailed": sum(1 for o in completed if o.correct),
        "completed_different": sum(1 for o in completed if not o.correct),
        "e2e_p50_s": statistics.median([o.latency_s for o in completed]) if completed else None,
        "faults": [asdict(f) for f in faults],
        "recovery_max_s": max(recoveries) if recoveries else None,
        "recovery_goal_s": VLLM_RECOVERY_GOAL_S if args.engines == "vllm" else RECOVERY_GOAL_S,
        "all_recovered_within_goal": all(f.within_goal for f in faults),
        "deaths": len(deaths),
        "deaths_back_on_health": sum(1 for f in deaths if f.start_s is not None),
        "engine_start_s": _spread(starts),
        "recovery_less_start_s": _spread(
            [f.recovery_less_start_s for f in faults if f.recovery_less_start_s is not None]
        ),
        "peak_rss_mib": {k: round(v / 2**20, 1) for k, v in sorted(peaks.items())},
        "gateway_counters": counters,
        "machine": "shared 2-core machine, other work running",
    }


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def print_report(r: dict[str, Any]) -> None:
    console = Console(width=160)
    table = Table(title=f"chaos: {r['duration_s']} s, seed {r['seed']}, {r['clients']} clients")
    for column in ("accepted", "completed", "failed_with_error", "lost", "refused_429",
                   "completed_equal_to_unfailed", "completed_different"):  # fmt: skip
        table.add_column(column)
    table.add_row(*(str(r[c]) for c in (
        "accepted", "completed", "failed_with_error", "lost", "refused_429",
        "completed_equal_to_unfailed", "completed_different")))  # fmt: skip
    console.print(table)
    faults = Table(title="faults")
    goal = f"within {r['recovery_goal_s']:g} s"
    for column in ("at_s", "kind", "engine", "duration_s", "new process s", "engine start s",
                   "recovery_s", goal, "detail"):  # fmt: skip
        faults.add_column(column)
    for f in r["faults"]:
        faults.add_row(str(f["at_s"]), f["kind"], f["engine"], str(f["duration_s"]),
                       str(f["respawn_s"]), str(f["start_s"]), str(f["recovery_s"]),
                       str(f["within_goal"]), f["detail"][:60])  # fmt: skip
    console.print(faults)
    console.print(f"peak RSS MiB: {r['peak_rss_mib']}")
    console.print(f"gateway counters: {r['gateway_counters']}")
    console.print(f"errors: {r['error_codes']}")
    for message, n in Counter(f["message"] for f in r["failures"]).most_common(8):
        console.print(f"  {n} x {message}")
    console.print(f"engine start (new process to /health) s: {r['engine_start_s']}; "
                  f"recovery less that start s: {r['recovery_less_start_s']}; "
                  f"gateway answers equal to the references before the chaos: "
                  f"{r.get('pre_chaos_gateway_equal')}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=48, help="distinct prompts")
    parser.add_argument("--threshold", type=float, default=768.0, help="gateway t (tokens)")
    parser.add_argument("--json", dest="json_out", default=None)
    parser.add_argument(
        "--engines",
        choices=("reference", "vllm"),
        default="reference",
        help="the embedded reference engines, or launched vLLM servers (benchmarks/chaos_vllm.py)",
    )
    parser.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON)
    parser.add_argument("--vllm-model", type=Path, default=VLLM_MODEL)
    parser.add_argument(
        "--replicas",
        action="store_true",
        help="gateway and etcd faults against three replicas behind Envoy "
        "(benchmarks/chaos_replicas.py) instead of engine faults against one gateway",
    )
    args = parser.parse_args()
    if args.replicas:
        from chaos_replicas import run_replicas

        return run_replicas(args.duration, args.seed, args.clients, args.json_out)
    # the flood's own sockets, written to after the sender cut them: not news
    logging.getLogger("asyncio").setLevel(logging.ERROR)
    result = asyncio.run(run(args))
    print_report(result)
    if args.json_out:
        Path(args.json_out).write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    ok = result["lost"] == 0 and result["completed_different"] == 0
    return 0 if ok and result["all_recovered_within_goal"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark (LIVE, beside its SIMULATED twin): the dual-timescale schedulers on real engines.

The embedded default deployment (`prfaas serve`: three reference engines on this machine,
real forward passes, KV over the real transport paced as a 10 Mbit/s, 5 ms link) runs one
scenario of phases, each long enough for the long-term loop to settle:

- `steady`: log-normal prompts as start-up profiling planned for, at `LOAD` of the
  planner's Lambda_max (the smallest over the phases, so every phase can be carried);
- `link-drop`: the link paced at a quarter (the PrfaaS prefill's `POST /admin/egress`);
- `burst`: the link back, arrivals at twice 55% of Lambda_max, gamma-bursty (CV 2);
- `longer`: median prompt length doubled;
- `decode-heavy`: three times the output tokens.

Three ways as the simulator defines them, each on a fresh deployment, the very same requests
at the very same instants (one seed), all on one profile: the first variant's deployment
measures it at start-up, the others start on it (`prfaas serve --profile`), as start-up's
shared-cores factor scatters from one start to the next (x1.00 / 1.24 / 1.45 in the three
starts of one run, when each variant's `t` and plans came from its own). The three: `static`
(the start-up `t`, no schedulers), `dual` (the dual-timescale schedulers), `oracle` (no
schedulers; each phase's planner optimum for its true conditions set through `POST
/admin/state` at the phase's start: `t`, and with `--pd-decodes 2` or more the PD split,
converting instances by hand as the long-term loop would). Without schedulers the gateway
has no load forecast, so static and oracle offload every prompt past `t`; the schedulers'
TTFT-predicting condition keeps one local when local is faster. The embedded default's
single PD decode leaves no conversion to make; `--pd-decodes 2` gives the PD cluster three
instances (one prefill, two decodes), so the long-term loop can convert one (all engines
still share this machine's cores). Per phase: served req/s, TTFT p50/p90, offload share,
egress utilisation, `t` and its changes, regime, queue waits, the gateway's offload
decisions (kept local, offloaded because faster, offloaded because the PD prefill was
saturated) and the predicted TTFT the saturated ones traded; the JSON keeps the schedulers'
decisions with their reasons. The goals: dual against the live oracle (served >= 0.95x, TTFT
P90 <= 1.5x), `t` at most once per 5 minutes once settled, settled within three periods.

The simulated twin: the same scenario through `prfaas simulate`'s scenario runner (the real
Router and schedulers, simulated engines on a virtual clock), fed the profile the live
deployment measured at start-up (`prfaas serve --profile-out`), and a table of live against
simulated per phase. The profile says how much slower a prefill ran with every engine
working (the engines share this machine's cores); the twin simulates that machine, each
engine at its alone speed while fewer work (`prfaas.sim.cores`). The JSON keeps the profile,
so `--twin-of LIVE.json` re-runs the twin of a recorded run without the live part
(`--dedicated-cores`: the twin as if each engine had cores of its own, for comparison), and
`--twin-seeds` checks the live goals on the twin over several draws of the scenario (dual
and the oracle, SIMULATED: what one live run cannot say), minutes instead of an hour.
Live numbers come from this machine's shared cores (compare within one run); simulated ones
are labelled so. The start-up profile's shared-cores factor is one timed prefill under
contention and scatters from one start to the next (x1.39-1.70), and the phases' rates with
it; `--profile-of LIVE.json` runs every variant on a recorded run's profile, at its rates,
so that two runs (before and after a change) compare.

Usage: python benchmarks/scheduling_live.py [--phase-s 180] [--period-s 20]
           [--variants static,dual,oracle] [--phases steady,...] [--seed 0]
           [--pd-decodes 1] [--json OUT]
           [--plot OUT.png] [--profile-of LIVE.json]
       python benchmarks/scheduling_live.py --twin-of LIVE.json [--dedicated-cores]
           [--twin-seeds 0,1,2,3,4 [--twin-steady-s 3600 [--twin-period-s 30]]] [--json OUT]

`--twin-steady-s` holds each phase's conditions that long on the twin and counts the moves
of `t` per five minutes once settled: the steadiness goal over a span that shows a cycle of
several minutes, which a live phase's two settled minutes cannot.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import re
import secrets
import statistics
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import tomli_w

from prfaas.common.secret import ENV_SECRET, DeploymentSecret
from prfaas.common.toml_tables import load_toml
from prfaas.gateway.link import EgressSample, fetch_sample
from prfaas.gateway.scheduling.config import SchedulerConfig
from prfaas.loadgen.apis import create_api
from prfaas.loadgen.arrivals import TraceArrivals
from prfaas.loadgen.client import StreamingClient
from prfaas.loadgen.driver import Driver
from prfaas.loadgen.records import RequestRecord
from prfaas.loadgen.spec import BenchSpec, NoProgress
from prfaas.loadgen.tokens import TokenSpace
from prfaas.policies.planner import plan
from prfaas.policies.profile import DeploymentProfile, parse_profile
from prfaas.serve.embedded import DEFAULT_LINK_MBPS, default_scheduler
from prfaas.sim.scenario_measure import SLO, phase_metrics
from prfaas.sim.scenario_run import ControlEvent, Sample, Variant, VariantRun, run_variant
from prfaas.sim.scenario_workload import ScenarioWorkload
from prfaas.sim.scenarios import Conditions, Phase, Scenario, conditioned, oracle_lambda
from prfaas.testing.serve_process import start_serve, stop_serve

LOAD = 0.9
VARIANTS: tuple[Variant, ...] = ("static", "dual", "oracle")
PHASES = ("steady", "link-drop", "burst", "longer", "decode-heavy")
MODEL = "qwen3-next-tiny"
VOCAB = 260  # the embedded model's byte-level vocabulary
CONTEXT = 8192
SAMPLE_S = 1.0
DECISIONS = re.compile(r'^prfaas_offload_decisions_total\{decision="(\w+)"\} (\S+)$', re.M)
TRADED = re.compile(r"^prfaas_offload_ttft_traded_seconds_sum (\S+)$", re.M)
QUEUE_WAIT = re.compile(r"^prfaas_queue_wait_seconds_(sum|count) (\S+)$", re.M)
LIVE_GOALS = {"served": 0.95, "p90": 1.5, "settle_periods": 3}
GOAL_KEYS = ("served_ok", "p90_ok", "settled_ok", "steady_ok")


def live_scenario(
    profile: DeploymentProfile, phase_s: float, only: tuple[str, ...] = ()
) -> Scenario:
    """The phases above, rates from the planner on the measured profile; `only`: just the
    phases named, in the scenario's order, one after the other (their rates as in the
    whole scenario)."""
    w = profile.workload
    link = base_link_gbps(profile)
    base = Conditions(1.0, w.lengths.mu, w.lengths.sigma, w.output_tokens, link)
    drop = replace(base, link_gbps=link / 4)
    longer = replace(base, mu=base.mu + math.log(2))
    heavy = replace(base, output_tokens=3 * base.output_tokens)
    rate = LOAD * min(oracle_lambda(profile, c) for c in (base, drop, longer, heavy))
    burst = replace(base, rate=2 * 0.55 * oracle_lambda(profile, base), burstiness=0.25)
    spec = [("steady", replace(base, rate=rate)), ("link-drop", replace(drop, rate=rate)),
            ("burst", burst), ("longer", replace(longer, rate=rate)),
            ("decode-heavy", replace(heavy, rate=rate))]  # fmt: skip
    if only:
        spec = [(name, c) for name, c in spec if name in only]
    phases = tuple(
        Phase(name, i * phase_s, (i + 1) * phase_s, c) for i, (name, c) in enumerate(spec)
    )
    return Scenario("live", "steady, link / 4, burst, longer prompts, decode-heavy", phases)


def base_link_gbps(profile: DeploymentProfile) -> float:
    """The link the profile measured (the embedded default's when it has none): the steady
    phase's, which the others scale."""
    return profile.prfaas.egress_gbps or DEFAULT_LINK_MBPS / 1000


def oracle_plan(profile: DeploymentProfile, c: Conditions) -> tuple[float, int]:
    """The planner's optimum for a phase's true conditions (exact costing): `t`, within the
    model's context (past it, every prompt is local anyway), and the PD prefill count."""
    best = plan(conditioned(profile, c), exact=True).prfaas_pd
    t = best.threshold_tokens
    return (CONTEXT if t is None or not math.isfinite(t) else min(t, CONTEXT)), best.n_p


def oracle_roles(roles: dict[str, str], n_p: int) -> dict[str, str]:
    """The conversions that give the PD cluster (`roles`: instance -> role) `n_p` prefills
    (at least one of each role kept): the last decodes made prefills, or the last prefills
    made decodes, by name."""
    n_p = min(max(n_p, 1), len(roles) - 1)
    prefill = sorted(i for i, r in roles.items() if r == "prefill")
    decode = sorted(i for i, r in roles.items() if r == "decode")
    if len(prefill) < n_p:
        return dict.fromkeys(decode[len(prefill) - n_p :], "prefill")
    return dict.fromkeys(prefill[n_p:], "decode")


@dataclass
class Deployment:
    proc: subprocess.Popen[bytes]
    url: str
    prfaas_url: str
    document: dict[str, Any]
    """The profile it runs on (`prfaas plan`'s TOML schema): measured at its start-up, or
    recorded at another's."""
    profile_path: Path
    """Where that profile is kept."""
    profile: DeploymentProfile
    engine_auth: dict[str, str]
    """The engines' control token (`/admin/egress`)."""
    admin_auth: dict[str, str]
    """The gateway's operator key (`/admin/state`)."""


def start(
    variant: str, logs: Path, period_s: float, pd_decodes: int, recorded: Path | None
) -> Deployment:
    """`prfaas serve` (embedded default, `pd_decodes` PD decodes) on the profile `recorded`,
    else on one it measures at start-up and writes out."""
    secret, admin_key = DeploymentSecret.generate(), secrets.token_hex(16)
    env = {**os.environ, ENV_SECRET: secret.hex()}
    log, profile = logs / f"{variant}.log", logs / f"{variant}-profile.toml"
    args = ["--port", "0", "--scheduler-period", f"{period_s:g}", "--admin-key", admin_key,
            "--pd-decodes", str(pd_decodes)]  # fmt: skip
    if recorded is None:
        args += ["--profile-out", str(profile)]
    else:
        args += ["--profile", str(recorded)]
        profile = recorded
    if variant != "dual":  # as in the simulator: no schedulers, so every prompt past t offloads
        args.append("--no-scheduler")
    proc, url = start_serve(args, log, env)
    admin = {"Authorization": f"Bearer {admin_key}"}
    prfaas = _get_json(f"{url}/admin/state", admin)["clusters"]["prfaas"][0]["url"]
    auth = {"Authorization": f"Bearer {secret.control_token()}"}
    document = load_toml(profile)
    parsed = parse_profile(document, source=str(profile))
    return Deployment(proc, url, prfaas, document, profile, parsed, auth, admin)


def _get_json(url: str, headers: dict[str, str]) -> Any:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as reply:
        return orjson.loads(reply.read())


@dataclass
class LiveRun:
    run: VariantRun
    utilisation: list[tuple[float, float | None]]
    """(at, egress utilisation) per sample."""
    counters: list[dict[str, float]]
    """The gateway's counters at each phase start, and at the end."""
    decisions: list[dict[str, Any]]
    """The schedulers' decisions (`/admin/state`'s recent ones, reason and inputs), each with
    `seen_s`, the first sample that showed it, and `at_s`, when the gateway made it on this
    run's clock (None where the two clocks did not agree). The changes of `t`, the
    set-point, the regime and the roles are timed by the decisions that made them (settling
    times are then not late by up to a sampling interval)."""


class Controller:
    """Applies each phase's conditions at its start (link pacing; the oracle's and static's
    pinned `t`), samples `/admin/state` every `SAMPLE_S`, and reads the gateway's counters
    at each phase boundary. Times are seconds since the schedule's start."""

    def __init__(self, d: Deployment, scenario: Scenario, variant: Variant,
                 http: aiohttp.ClientSession) -> None:  # fmt: skip
        self._d, self._scenario, self._variant, self._http = d, scenario, variant, http
        self._loop = asyncio.get_running_loop()
        self._t0: float | None = None
        self.timeline: list[Sample] = []
        self.events: list[ControlEvent] = []
        self.utilisation: list[tuple[float, float | None]] = []
        self.counters: list[dict[str, float]] = []
        self.decisions: dict[tuple[float, str, str], dict[str, Any]] = {}
        self._last: dict[str, Any] | None = None
        self._sampled = 0.0  # when the last sample was recorded
        self._tasks: list[asyncio.Task[None]] = []

    def started(self, run: asyncio.Task[Any]) -> None:
        """Schedule time 0 (the driver's `on_start`); `run` (the driver) is cancelled if
        the controller fails, so that a broken run ends at once."""
        self._t0 = self._loop.time()
        self._tasks = [asyncio.create_task(self._phases()), asyncio.create_task(self._sample())]

        def failed(task: asyncio.Task[None]) -> None:
            if not task.cancelled() and task.exception() is not None:
                run.cancel()

        for task in self._tasks:
            task.add_done_callback(failed)

    def now(self) -> float:
        return self._loop.time() - self._origin()

    def _origin(self) -> float:
        assert self._t0 is not None
        return self._t0

    async def stop(self) -> None:
        self.counters.append(await self._counters())
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _phases(self) -> None:
        link = None
        for phase in self._scenario.phases:
            await asyncio.sleep(max(phase.start_s - self.now(), 0.0))
            self.counters.append(await self._counters())
            c = phase.conditions
            mbps = DEFAULT_LINK_MBPS * c.link_gbps / base_link_gbps(self._d.profile)
            if mbps != link:
                link = mbps
                await self._post(f"{self._d.prfaas_url}/admin/egress", {"rate_mbps": mbps},
                                 self._d.engine_auth)  # fmt: skip
            if self._variant == "oracle":
                t, n_p = oracle_plan(self._d.profile, c)
                pd = (await self._state())["clusters"]["pd"]
                moves = oracle_roles({s["id"]: s["role"] for s in pd}, n_p)
                body = {"threshold": t, **({"roles": moves} if moves else {})}
                await self._post(f"{self._d.url}/admin/state", body, self._d.admin_auth)

    async def _post(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        """POST, waiting as long as a conversion's drain may take."""
        wait = aiohttp.ClientTimeout(total=SchedulerConfig.drain_timeout_s + 60)
        async with self._http.post(url, json=body, headers=headers, timeout=wait) as resp:
            if resp.status != 200:
                raise RuntimeError(f"POST {url} {body}: HTTP {resp.status} {await resp.text()}")

    async def _state(self) -> dict[str, Any]:
        async with self._http.get(f"{self._d.url}/admin/state",
                                  headers=self._d.admin_auth) as resp:  # fmt: skip
            return dict(await resp.json())

    async def _counters(self) -> dict[str, float]:
        async with self._http.get(f"{self._d.url}/metrics") as resp:
            text = await resp.text()
        out = {name: float(v) for name, v in DECISIONS.findall(text)}
        out.update({f"queue_wait_{k}": float(v) for k, v in QUEUE_WAIT.findall(text)})
        traded = TRADED.search(text)
        out["traded_s"] = float(traded.group(1)) if traded else 0.0
        return out

    async def _sample(self) -> None:
        before: EgressSample | None = None
        while True:
            try:
                state = await self._state()
                link = await fetch_sample(self._http, self._d.prfaas_url, self._d.engine_auth)
            except (aiohttp.ClientError, TimeoutError):  # a busy moment: the next sample
                await asyncio.sleep(SAMPLE_S)
                continue
            self._record(state, before, link)
            before = link
            await asyncio.sleep(SAMPLE_S)

    def _record(self, state: dict[str, Any], before: EgressSample | None,
                link: EgressSample) -> None:  # fmt: skip
        """One sample: the schedule from `/admin/state`, the link from the PrfaaS prefill's
        own transport counters (the same for every variant, schedulers or not)."""
        at = self.now()
        cap = link.capacity_bytes_per_s or 0.0
        util = None
        if before is not None and link.at > before.at and cap > 0:
            util = (link.bytes_total - before.bytes_total) / (link.at - before.at) / cap
        pd = state["clusters"]["pd"]
        roles = ",".join(f"{s['id']}={s['role']}" for s in pd)
        self.timeline.append(Sample(
            at=at, threshold=float(state["threshold"]), regime=state["regime"],
            n_prefill=sum(s["role"] == "prefill" for s in pd),
            n_decode=sum(s["role"] == "decode" for s in pd), n_draining=0,
            egress_gbps=(util or 0.0) * cap * 8 / 1e9, link_gbps=cap * 8 / 1e9,
        ))  # fmt: skip
        self.utilisation.append((at, util))
        scheduler = state.get("scheduler") or {}
        fresh: list[dict[str, Any]] = []
        for d in scheduler.get("recent", ()):
            key = (d["at"], d["loop"], d["kind"])
            if key not in self.decisions:
                made = decided_at(d["at"] - self._origin(), self._sampled, at)
                entry = {"seen_s": round(at, 1), "at_s": made, **d}
                self.decisions[key] = entry
                fresh.append(entry)
        now = {"threshold": state["threshold"], "set_point": scheduler.get("set_point"),
               "regime": state["regime"], "role": roles}  # fmt: skip
        if self._last is not None:
            for kind, value in now.items():
                if value != self._last[kind]:
                    self.events.append(ControlEvent(change_at(kind, fresh, at), kind, value))
        self._last = now
        self._sampled = at


CHANGED_BY = {
    "threshold": {
        ("long-term", "set_point"),
        ("long-term", "role"),  # (a conversion's end sets t too)
        ("short-term", "threshold"),
        ("operator", "pin"),
    },
    "set_point": {("long-term", "set_point"), ("long-term", "role"), ("operator", "pin")},
    "regime": {("short-term", "regime"), ("operator", "pin")},
    "role": {("long-term", "role")},
}
"""Which decisions (loop, kind) change each sampled field of the schedule."""


def decided_at(at_s: float, previous_sample_s: float, sample_s: float) -> float | None:
    """A decision's time on this run's clock, from the gateway's own (both loops read the
    machine's monotonic clock), where it falls between the sample before (less the
    `/admin/state` read's own time) and the one that first showed it; None where it does
    not (the clocks do not agree)."""
    if previous_sample_s - SAMPLE_S <= at_s <= sample_s + 0.01:
        return round(at_s, 3)
    return None


def change_at(kind: str, fresh: list[dict[str, Any]], sample_s: float) -> float:
    """When a field the sample at `sample_s` shows changed: the latest of the decisions it
    first showed that change that field, timed by the gateway (so a settling time is not
    late by up to a sampling interval); the sample's time where none is timed."""
    times = [d["at_s"] for d in fresh
             if (d["loop"], d["kind"]) in CHANGED_BY[kind] and d["at_s"] is not None]  # fmt: skip
    return max(times) if times else sample_s


async def drive(d: Deployment, scenario: Scenario, variant: Variant, seed: int) -> LiveRun:
    """The scenario's requests against the live gateway, the controller beside them."""
    lengths = d.profile.workload.lengths
    workload = ScenarioWorkload(scenario, round(lengths.lo), round(lengths.hi), TokenSpace(VOCAB))
    spec = BenchSpec(workload, TraceArrivals(1.0), None, scenario.duration_s, seed)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        client = StreamingClient(http, d.url, create_api("completions"), model=MODEL,
                                 timeout_s=600.0, origin=time.perf_counter())  # fmt: skip
        control = Controller(d, scenario, variant, http)

        def on_start() -> None:
            client.mark_origin()
            control.started(driving)

        wall = time.perf_counter()
        driving = asyncio.create_task(Driver(spec, client, NoProgress(), on_start).run())
        try:
            records = await driving
        finally:
            await control.stop()
    events = sorted(control.events, key=lambda e: e.at)  # (timed by decisions: near order)
    run = VariantRun(variant, tuple(records), tuple(control.timeline), tuple(events),
                     (), time.perf_counter() - wall)  # fmt: skip
    decisions = sorted(control.decisions.values(), key=lambda d: d["at"])
    return LiveRun(run, control.utilisation, control.counters, decisions)


def phase_row(live: LiveRun, phase: Phase, i: int) -> dict[str, Any]:
    """One phase of a live run: what the twin reports too, plus what only live has."""
    a, b = phase.start_s, phase.end_s
    utils = [u for at, u in live.utilisation if a <= at < b and u is not None]
    before, after = live.counters[i], live.counters[min(i + 1, len(live.counters) - 1)]
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    waits = delta.get("queue_wait_count", 0.0)
    regimes = sorted({s.regime for s in live.run.timeline if a <= s.at < b})
    return {
        **run_row(live.run, phase),
        "egress_utilisation": statistics.mean(utils) if utils else None,
        "regimes": regimes,
        "decisions": {k: delta.get(k, 0.0)
                      for k in ("kept_local", "offloaded_faster", "offloaded_saturated")},
        "traded_s_per_offload": delta.get("traded_s", 0.0)
        / max(delta.get("offloaded_saturated", 0.0), 1.0),
        "queue_wait_mean_s": delta.get("queue_wait_sum", 0.0) / waits if waits else None,
        "t_over_time": [(round(s.at), s.threshold) for s in live.run.timeline
                        if a <= s.at < b][:: max(int(10 / SAMPLE_S), 1)],
    }  # fmt: skip


def _share(records: list[RequestRecord], route: str) -> float | None:
    return sum(r.route == route for r in records) / len(records) if records else None


def run_row(run: VariantRun, phase: Phase) -> dict[str, Any]:
    """A phase of a run, live or simulated: the simulator's per-phase numbers, TTFT p50 and
    the offloaded share."""
    m = phase_metrics(run, phase, SLO())
    a, b = phase.start_s, phase.end_s
    arrived = [r for r in run.records if a <= r.scheduled_s < b and r.ok]
    ttft = [r.ttft_s for r in arrived if r.ttft_s is not None]
    return {**m.to_json(), "ttft_p50_s": statistics.median(ttft) if ttft else None,
            "offloaded": _share(arrived, "prfaas")}  # fmt: skip


def twin(profile: DeploymentProfile, scenario: Scenario, variant: Variant,
         config: SchedulerConfig, seed: int) -> VariantRun:  # fmt: skip
    """The same scenario SIMULATED on the measured profile."""
    return run_variant(profile, scenario, variant, scheduler=config, seed=seed)


def _recorded(
    out: dict[str, Any], dedicated_cores: bool
) -> tuple[DeploymentProfile, Scenario, SchedulerConfig]:
    """The profile a run recorded (`dedicated_cores`: without its `[machine]` table, each
    engine on cores of its own at the profile's times, as the twin was before it simulated
    the shared machine), the scenario it ran and its schedulers' config."""
    document = dict(out["profile"])
    if dedicated_cores:
        document.pop("machine", None)
    profile = parse_profile(document, source="<the live run's start-up profile>")
    config = replace(default_scheduler(), period_s=out["args"]["period_s"])
    only = tuple(out["args"].get("phases") or ())
    return profile, live_scenario(profile, out["args"]["phase_s"], only), config


def simulate_twins(out: dict[str, Any], dedicated_cores: bool = False) -> Scenario:
    """Every variant's twin, SIMULATED on the profile the run recorded, into `out`; the
    scenario."""
    profile, scenario, config = _recorded(out, dedicated_cores)
    for variant, got in out["variants"].items():
        sim = twin(profile, scenario, variant, config, out["args"]["seed"])
        got["simulated"] = [run_row(sim, p) for p in scenario.phases]
    out["twin_cores"] = "dedicated" if dedicated_cores else "as profiled"
    return scenario


def twin_goals(out: dict[str, Any], seeds: list[int], dedicated_cores: bool) -> dict[str, Any]:
    """The live goals on the twin (SIMULATED: dual against the simulated oracle), per seed:
    what one live run cannot say, the spread over draws of the same scenario."""
    profile, scenario, config = _recorded(out, dedicated_cores)
    per_seed = {}
    for seed in seeds:
        dual, oracle = (twin(profile, scenario, v, config, seed) for v in ("dual", "oracle"))
        moves = [(e.at, e.kind, e.value) for e in dual.events]
        per_seed[str(seed)] = phase_goals([run_row(dual, p) for p in scenario.phases],
                                     [run_row(oracle, p) for p in scenario.phases], moves,
                                     scenario, config.period_s)  # fmt: skip
    print(f"\nthe live goals on the twin (SIMULATED), seeds {seeds}: per phase, each seed's "
          "served / P90 against the simulated oracle, t moves once settled, settled at "
          "(s)")  # fmt: skip
    for i, phase in enumerate(scenario.phases):
        rows = [per_seed[str(s)][i] for s in seeds]
        cells = [f"{_f(g['served_vs_oracle'])}/{_f(g['p90_vs_oracle'])} "
                 f"{g['t_moves_settled']} {g['settle_s']:.0f}" for g in rows]  # fmt: skip
        met = sum(all(g[k] for k in GOAL_KEYS) for g in rows)
        print(f"{phase.name:>13}: {met}/{len(seeds)} all goals; " + "; ".join(cells))
    return per_seed


def twin_steadiness(out: dict[str, Any], seeds: list[int], hold_s: float,
                    period_s: float | None) -> list[dict[str, Any]]:  # fmt: skip
    """Each phase's conditions held for `hold_s` on the twin (SIMULATED, dual; `period_s`:
    the long-term period, None for the recorded run's): the moves of `t` once three periods
    have passed, per five minutes, against the goal of at most one. A live phase's settled
    window (two minutes) is too short to show a cycle of several minutes. A phase over the
    oracle's capacity (the burst) is not held: that is an overload, not a steady load."""
    profile, scenario, config = _recorded(out, dedicated_cores=False)
    if period_s is not None:
        config = replace(config, period_s=period_s)
    after = LIVE_GOALS["settle_periods"] * config.period_s
    if hold_s <= after:
        raise SystemExit(f"--twin-steady-s {hold_s:g} leaves nothing after three periods "
                         f"({after:g} s)")  # fmt: skip
    rows: list[dict[str, Any]] = []
    for phase in scenario.phases:
        capacity = oracle_lambda(profile, phase.conditions)
        if phase.conditions.rate > capacity:  # queues grow for as long as it is held
            rows.append({"phase": phase.name, "over_capacity": True})
            continue
        held = Scenario(scenario.name, f"{phase.name}, held",
                        (replace(phase, start_s=0.0, end_s=hold_s),))  # fmt: skip
        per_seed: list[dict[str, Any]] = []
        for seed in seeds:
            run = twin(profile, held, "dual", config, seed)
            events = [e for e in run.events if after <= e.at < hold_s]  # not the drain after
            moves = sum(e.kind == "threshold" for e in events)
            per_seed.append({
                "seed": seed, "t_moves": moves,
                "set_point_moves": sum(e.kind == "set_point" for e in events),
                "per_5_min": moves * 300 / (hold_s - after),
            })  # fmt: skip
        worst = max(r["per_5_min"] for r in per_seed)
        rows.append({"phase": phase.name, "seeds": per_seed, "worst_per_5_min": worst,
                     "steady_ok": worst <= 1.0})  # fmt: skip
    print(f"\nt held steady? Each phase's conditions for {hold_s:.0f} s on the twin (SIMULATED, "
          f"dual, {config.period_s:g} s periods), seeds {seeds}: moves of t after "
          f"{after:.0f} s (of them set-point moves), per 5 minutes (goal <= 1)")  # fmt: skip
    for row in rows:
        if row.get("over_capacity"):
            print(f"{row['phase']:>13}: not held, over the oracle's capacity")
            continue
        cells = [f"{r['t_moves']} ({r['set_point_moves']})" for r in row["seeds"]]
        print(f"{row['phase']:>13}: " + ", ".join(cells) + f"; worst {row['worst_per_5_min']:.2f}"
              f" per 5 min {'ok' if row['steady_ok'] else 'MISSED'}")  # fmt: skip
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    logs = Path(tempfile.mkdtemp(prefix="prfaas-scheduling-live-"))
    print(f"logs in {logs}", flush=True)
    scenario: Scenario | None = None
    recorded: Path | None = None
    if args.profile_of is not None:  # every variant on a recorded run's profile
        recorded = logs / "recorded-profile.toml"
        document = orjson.loads(args.profile_of.read_bytes()).get("profile")
        if document is None:
            raise SystemExit(f"{args.profile_of}: recorded before runs kept their profile")
        recorded.write_text(tomli_w.dumps(document))
    profile_of = None if args.profile_of is None else str(args.profile_of)
    out: dict[str, Any] = {
        "variants": {},
        "args": vars(args) | {"json": None, "plot": None, "profile_of": profile_of},
    }
    for variant in args.variants:
        print(f"{variant}: starting the embedded deployment ...", flush=True)
        d = start(variant, logs, args.period_s, args.pd_decodes, recorded)
        recorded = d.profile_path
        try:
            if scenario is None:  # one scenario for every variant: the first one's profile
                scenario = live_scenario(d.profile, args.phase_s, args.phases)
                out["profile"] = d.document
                out["scenario"] = [{"name": p.name, "start_s": p.start_s, "end_s": p.end_s,
                                    **vars(p.conditions)} for p in scenario.phases]  # fmt: skip
                print(_describe(scenario), flush=True)
            print(f"{variant}: {scenario.duration_s:.0f} s of load ...", flush=True)
            live = asyncio.run(drive(d, scenario, variant, args.seed))
        finally:
            stop_serve(d.proc)
        phases = [phase_row(live, p, i) for i, p in enumerate(scenario.phases)]
        out["variants"][variant] = {"live": phases, "moves": [
            (round(e.at, 1), e.kind, e.value) for e in live.run.events],
            "decisions": live.decisions}  # fmt: skip
    assert scenario is not None
    simulate_twins(out)
    out["goals"] = goals(out, scenario, args.period_s)
    report(out, scenario)
    return out


def _describe(scenario: Scenario) -> str:
    rows = [f"  {p.name:>13}: {p.conditions.rate:.3f} req/s, median "
            f"{math.exp(p.conditions.mu):.0f} tokens, {p.conditions.output_tokens} out, "
            f"link {p.conditions.link_gbps * 1000:.2f} Mbit/s"
            f"{', bursty' if p.conditions.burstiness != 1 else ''}"
            for p in scenario.phases]  # fmt: skip
    return "phases (from the first deployment's profile):\n" + "\n".join(rows)


def goals(out: dict[str, Any], scenario: Scenario, period_s: float) -> list[dict[str, Any]]:
    """The issue's live goals per phase, dual-timescale against the live oracle."""
    v = out["variants"]
    if not {"dual", "oracle"} <= set(v):
        return []
    return phase_goals(v["dual"]["live"], v["oracle"]["live"], v["dual"]["moves"], scenario,
                       period_s)  # fmt: skip


def phase_goals(dual_rows: list[dict[str, Any]], oracle_rows: list[dict[str, Any]],
                dual_moves: list[Any], scenario: Scenario,
                period_s: float) -> list[dict[str, Any]]:  # fmt: skip
    """The goals per phase from a run's rows (`run_row`, live or simulated) and dual's moves
    ((at, kind, value), seconds since the schedule's start)."""
    rows = []
    for phase, dual, oracle in zip(scenario.phases, dual_rows, oracle_rows, strict=True):
        served = _ratio(dual["served_rate"], oracle["served_rate"])
        p90 = _ratio(dual["ttft_p90_s"], oracle["ttft_p90_s"])
        settled = phase.start_s + LIVE_GOALS["settle_periods"] * period_s
        moves = [e for e in dual_moves
                 if e[1] == "threshold" and settled <= e[0] < phase.end_s]  # fmt: skip
        window = phase.end_s - settled
        rows.append({
            "phase": phase.name, "served_vs_oracle": served, "p90_vs_oracle": p90,
            "t_moves_settled": len(moves), "settled_window_s": window,
            "settle_s": dual["settle_s"],
            "served_ok": served is not None and served >= LIVE_GOALS["served"],
            "p90_ok": p90 is not None and p90 <= LIVE_GOALS["p90"],
            "settled_ok": dual["settle_s"] <= LIVE_GOALS["settle_periods"] * period_s,
            "steady_ok": len(moves) <= max(1, int(window // 300)),
        })  # fmt: skip
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _row(phase: str, variant: str, lv: dict[str, Any], sm: dict[str, Any]) -> list[str]:
    """One table row: live/simulated pairs, then what only the live run has."""

    def pair(key: str, spec: str, width: int) -> str:
        return f"{_f(lv[key], spec):>{width}}/{_f(sm[key], spec):<{width}}"

    d = lv["decisions"]
    decided = f"{d['kept_local']:.0f}/{d['offloaded_faster']:.0f}/{d['offloaded_saturated']:.0f}"
    return [f"{phase:>13}", f"{variant:>7}", pair("served_rate", ".3f", 7),
            pair("ttft_p50_s", ".2f", 6), pair("ttft_p90_s", ".2f", 6),
            pair("offloaded", ".0%", 5), f"{_f(lv['egress_utilisation']):>5}",
            f"{lv['threshold_end']:6.0f}", f"{lv['t_changes']:5d}", f"{decided:>13}",
            f"{lv['traded_s_per_offload']:6.1f}", f"{_f(lv['queue_wait_mean_s']):>6}"]  # fmt: skip


def report(out: dict[str, Any], scenario: Scenario) -> None:
    cores = out.get("twin_cores", "as profiled")
    print("\nLIVE (this machine's 2 shared cores; compare within this run) and SIMULATED "
          f"(the twin on the measured profile, engines' cores {cores})")  # fmt: skip
    head = (f"{'phase':>13} {'variant':>7} {'served/s':>15} {'TTFT p50':>13} "
            f"{'TTFT p90':>13} {'offload':>11} {'util':>5} {'t end':>6} {'moves':>5} "
            f"{'kept/fast/sat':>13} {'traded':>6} {'q wait':>6}")  # fmt: skip
    print(head + "\n" + " " * 22 + "live / sim  (each pair)")
    for i, phase in enumerate(scenario.phases):
        for variant, got in out["variants"].items():
            lv, sm = got["live"][i], got["simulated"][i]
            print(" ".join(_row(phase.name, variant, lv, sm)))
    if out["goals"]:
        print("\nlive goals, dual against the live oracle (served >= 0.95x, P90 TTFT <= 1.5x, "
              "t at most once per 5 min once settled, settled within 3 periods)")  # fmt: skip
        for g in out["goals"]:
            print(f"{g['phase']:>13}: served {_f(g['served_vs_oracle'])}x "
                  f"{'ok' if g['served_ok'] else 'MISSED'}, P90 {_f(g['p90_vs_oracle'])}x "
                  f"{'ok' if g['p90_ok'] else 'MISSED'}, t moved {g['t_moves_settled']} times "
                  f"in the {g['settled_window_s']:.0f} s after 3 periods "
                  f"{'ok' if g['steady_ok'] else 'MISSED'}, last set-point "
                  f"change or conversion {g['settle_s']:.0f} s in "
                  f"{'ok' if g['settled_ok'] else 'MISSED'}")  # fmt: skip
    print("\ntwin: simulated / live per phase (served rate within 15%, TTFT P90 within 30%?)")
    for variant, got in out["variants"].items():
        cells = []
        for lv, sm in zip(got["live"], got["simulated"], strict=True):
            s, p = (
                _ratio(sm["served_rate"], lv["served_rate"]),
                _ratio(sm["ttft_p90_s"], lv["ttft_p90_s"]),
            )
            cells.append(f"{lv['phase']} {_f(s)}/{_f(p)}")
        print(f"{variant:>7}: " + "; ".join(cells))


def plot(out: dict[str, Any], path: Path) -> None:
    """`t` over time per variant (live), phase boundaries marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    for variant, got in out["variants"].items():
        points = [pt for row in got["live"] for pt in row["t_over_time"]]
        if points:
            xs, ys = np.array(points).T
            ax.step(xs, ys, where="post", label=variant)
    for p in out["scenario"][1:]:
        ax.axvline(p["start_s"], color="grey", lw=0.5)
    ax.set_xlabel("s since the schedule's start")
    ax.set_ylabel("t (tokens)")
    ax.set_title("scheduling_live: t per variant (LIVE)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--phase-s", type=float, default=180.0)
    parser.add_argument("--period-s", type=float, default=20.0,
                        help="the long-term loop's period (three of them to settle)")  # fmt: skip
    parser.add_argument("--variants", type=_variants, default=VARIANTS)
    parser.add_argument("--phases", type=_phases, default=(), metavar="steady,...",
                        help="run only these phases, in the scenario's order (default: "
                        "all five)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--pd-decodes",
        type=int,
        default=1,
        help="PD decode instances (2+: the PD cluster has roles to convert)",
    )
    parser.add_argument("--json", type=Path, metavar="OUT")
    parser.add_argument("--plot", type=Path, metavar="OUT.png")
    parser.add_argument("--profile-of", type=Path, metavar="LIVE.json",
                        help="run every variant on the profile a recorded live run measured "
                        "(its phases' rates too), so that runs compare")  # fmt: skip
    parser.add_argument("--twin-of", type=Path, metavar="LIVE.json",
                        help="re-run only the twin of a recorded live run (its phases, "
                        "period, seed and variants are the recorded ones)")  # fmt: skip
    parser.add_argument("--dedicated-cores", action="store_true",
                        help="with --twin-of: the twin without the shared machine")  # fmt: skip
    parser.add_argument("--twin-seeds", type=_seeds, default=[], metavar="0,1,2",
                        help="with --twin-of: the live goals on the twin, a run per "
                        "seed")  # fmt: skip
    parser.add_argument("--twin-steady-s", type=float, metavar="S",
                        help="with --twin-of and --twin-seeds: each phase's conditions held "
                        "S seconds on the twin, and t's moves per 5 minutes")  # fmt: skip
    parser.add_argument("--twin-period-s", type=float, metavar="P",
                        help="with --twin-steady-s: the long-term period (default: the "
                        "recorded run's)")  # fmt: skip
    args = parser.parse_args()
    if args.profile_of is not None and args.twin_of is not None:
        parser.error("--profile-of starts a live run; --twin-of re-runs a recorded one's twin")
    if (args.dedicated_cores or args.twin_seeds) and args.twin_of is None:
        parser.error("--dedicated-cores and --twin-seeds re-run a recorded run's twin: "
                     "give --twin-of")  # fmt: skip
    if args.twin_steady_s is not None and not args.twin_seeds:
        parser.error("--twin-steady-s runs the twin on --twin-seeds: give them")
    if args.twin_period_s is not None and args.twin_steady_s is None:
        parser.error("--twin-period-s is the period of --twin-steady-s: give it")
    if args.twin_period_s is not None and args.twin_period_s <= 0:
        parser.error("--twin-period-s must be > 0")
    if args.phases and args.twin_of is not None:
        parser.error("--phases starts a live run; --twin-of re-runs the phases it recorded")
    if args.twin_of is None:
        result = run(args)
    else:
        result = rerun_twin(args.twin_of, args.dedicated_cores, args.twin_seeds)
        if args.twin_steady_s is not None:
            result["twin_steadiness"] = twin_steadiness(
                result, args.twin_seeds, args.twin_steady_s, args.twin_period_s
            )
    if args.json:
        args.json.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    if args.plot:
        plot(result, args.plot)


def rerun_twin(path: Path, dedicated_cores: bool, seeds: list[int]) -> dict[str, Any]:
    """A recorded live run with its twin SIMULATED again (on the profile it recorded), and
    the live goals on the twin over `seeds` (none: not run)."""
    out: dict[str, Any] = orjson.loads(path.read_bytes())
    if "profile" not in out:
        raise SystemExit(f"{path}: recorded before runs kept their profile; run it live again")
    report(out, simulate_twins(out, dedicated_cores))
    if seeds:
        out["twin_goals"] = twin_goals(out, seeds, dedicated_cores)
    return out


def _seeds(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds are integers, comma-separated: {text!r}") from None


def _phases(text: str) -> tuple[str, ...]:
    got = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in got if p not in PHASES]
    if bad or not got:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(PHASES)}: {text!r}")
    return got


def _variants(text: str) -> tuple[Variant, ...]:
    got = tuple(v.strip() for v in text.split(",") if v.strip())
    bad = [v for v in got if v not in VARIANTS]
    if bad or not got:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(VARIANTS)}: {text!r}")
    return got  # type: ignore[return-value]


if __name__ == "__main__":
    main()

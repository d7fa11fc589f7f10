"""Start-up profiling of the embedded deployment and the planner run that chooses `t`.

Measured on the live engines: prefill latency at a few prompt lengths (a PD pair, one
output token), KV bytes per prefill (what the PrfaaS prefill's transport sent, from its
`/transfer_stats`), the link's bandwidth (a KV transfer of known size over the real paced
transport, timed on the sender's clock), decode step time, and how much slower a prefill
runs while every engine works (the engines share the machine's cores: at capacity all of
them are busy). These fill a deployment profile (the `prfaas plan` format) whose workload is
a log-normal of prompts from a few hundred to a few thousand tokens, its times those of
engines sharing the cores; the planner's optimum threshold is the gateway's `t`.
"""

from __future__ import annotations

import asyncio
import math
import random
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from prfaas.engine_clients.base import BaseEngineClient, collect
from prfaas.gateway.link import EgressSample
from prfaas.policies.planner import PlanReport, plan
from prfaas.policies.profile import DeploymentProfile, parse_profile
from prfaas.protocol.generate import Bootstrap, GenerateRequest, SamplingParams

PROFILE_LENGTHS = (256, 1024, 3072)
SHARED_LENGTH = 1024
"""The PD prefill timed alone and beside the other engines' work (a `PROFILE_LENGTHS` entry
short of the longest, which the PrfaaS prefill computes meanwhile)."""
SHARED_BUSY_ENGINES = 3  # working while it is timed: it, the PrfaaS prefill, the decode
ALONE_RUNS = 2
"""PD pair runs per prompt length, the fastest kept: the first at a new length runs slower
(here 1.17 s against 0.96-1.00 s at 3,072 tokens: the engine's buffers grow), and start-up
profiles the deployment for the warm engines that serve."""
DECODE_TOKENS = 16
BUSY_DECODE_TOKENS = 2048  # keeps the decode stepping through a contended PD prefill
MIB = 2**20
PROBE_SAMPLE_S = 0.01
PROBE_MIN_BUSY_S = 0.25  # a shorter probe is too coarse for 10 ms samples: probe longer
StatsReader = Callable[[], Awaitable[EgressSample]]


@dataclass(frozen=True)
class Workload:
    """The prompt-length distribution `t` is planned for."""

    median_tokens: float = 1024.0
    sigma: float = 0.9
    min_tokens: int = 128
    max_tokens: int = 6144
    output_tokens: int = DECODE_TOKENS


@dataclass(frozen=True)
class Pair:
    """A prefill client, its bootstrap address, and the decode client."""

    prefill: BaseEngineClient
    bootstrap: tuple[str, int]
    decode: BaseEngineClient


@dataclass(frozen=True)
class MeasuredProfile:
    """What start-up profiling measured."""

    lengths: tuple[int, ...]
    prefill_s: tuple[float, ...]
    """PD-cluster pair time for one output token (prefill + hand-off on loopback), the
    fastest of `ALONE_RUNS`."""
    kv_bytes: tuple[int, ...]
    """Bytes the PrfaaS prefill's transport sent per prefill (frame headers included)."""
    decode_step_s: float
    decode_batch_max: int
    link_bytes_per_s: float
    """Measured: a cached prompt's KV (no compute to wait for) over the real transport."""
    shared_slowdown: float = 1.0
    """A `SHARED_LENGTH` PD prefill's time while the PrfaaS prefill computes and the decode
    steps (one run), over its time alone (the faster of `ALONE_RUNS`; at least 1).
    `prefill_s` and `decode_step_s` are alone."""

    def shared_prefill_s(self) -> tuple[float, ...]:
        """The prefill times with every engine working, as at capacity."""
        return tuple(s * self.shared_slowdown for s in self.prefill_s)

    def shared_decode_step_s(self) -> float:
        """The decode step with every engine working: the prefill's factor (not measured on
        its own: a step is mostly the same single-threaded matrix work as a prefill)."""
        return self.decode_step_s * self.shared_slowdown


async def _run_pair(
    pair: Pair, ids: list[int], max_new_tokens: int, decoding: asyncio.Event | None = None
) -> float:
    """Seconds for a fresh request through `pair`; `decoding` is set at the decode's first
    chunk (or when the pair ends, so that a waiter never hangs)."""
    loop = asyncio.get_running_loop()
    room = secrets.randbits(63)  # a room is a capability: never from a predictable stream
    request = GenerateRequest(
        rid=f"profile-{room}",
        input_ids=tuple(ids),
        # Exactly that many tokens: a random-weight model may pick EOS, and which token
        # greedy picks can depend on the batch it ran in.
        sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True),
        bootstrap=Bootstrap(pair.bootstrap[0], pair.bootstrap[1], room),
    )

    start = loop.time()
    started = None if decoding is None else (lambda _: decoding.set())
    try:
        await asyncio.gather(
            collect(pair.prefill.generate(request)),
            collect(pair.decode.generate(request), started),
        )
    finally:
        if decoding is not None:
            decoding.set()
    return loop.time() - start


async def _shared(pd: Pair, prfaas: Pair, prompt: list[int], rng: random.Random) -> float:
    """A PD pair's time for a fresh `SHARED_LENGTH` prompt while the PrfaaS prefill
    computes `prompt` and the decode steps through a long answer (given up once the timed
    pair ends): every engine working. A failure anywhere cancels the rest."""
    decoding = asyncio.Event()
    async with asyncio.TaskGroup() as group:
        busy = group.create_task(_run_pair(pd, _prompt(64, rng), BUSY_DECODE_TOKENS, decoding))
        remote = group.create_task(_run_pair(prfaas, prompt, 1))
        await decoding.wait()
        took = await _run_pair(pd, _prompt(SHARED_LENGTH, rng), 1)
        ended = {  # the PrfaaS pair's KV crosses the slow link long after its compute
            f"the decode finished {BUSY_DECODE_TOKENS} tokens": busy.done(),
            f"the PrfaaS pair finished {len(prompt)} tokens": remote.done(),
        }
        if lost := [what for what, done in ended.items() if done]:
            raise RuntimeError(f"{' and '.join(lost)} before a {SHARED_LENGTH}-token "
                               "prefill: the shared-cores timing lost its overlap")  # fmt: skip
        busy.cancel()
    return took


def _prompt(length: int, rng: random.Random) -> list[int]:
    return [rng.randrange(0, 256) for _ in range(length)]  # fresh bytes: no cache hits


async def measure(
    pd: Pair, prfaas: Pair, stats: StatsReader, batch_max: int, seed: int = 0
) -> MeasuredProfile:
    """Profile the engines (about a dozen seconds). Requests run one at a time but for two
    overlaps: while the PrfaaS prefill computes the longest prompt (its KV bytes counted),
    a PD pair at `SHARED_LENGTH` and a long decode run beside it (the shared-cores
    slowdown); and the link probe's paced, CPU-light tail overlaps the decode-step
    measurement (different engines but the decode one, which only receives KV meanwhile).
    `stats` reads the PrfaaS prefill's transport telemetry."""
    rng = random.Random(seed)
    await _run_pair(pd, _prompt(64, rng), 1)  # warm-up
    pd_s: list[float] = []
    kv: list[int] = []
    prompts: list[list[int]] = []
    shared_s = 0.0
    for n in PROFILE_LENGTHS:
        runs = [await _run_pair(pd, _prompt(n, rng), 1) for _ in range(ALONE_RUNS)]
        pd_s.append(min(runs))
        prompts.append(_prompt(n, rng))
        before = (await stats()).bytes_total
        if n == PROFILE_LENGTHS[-1]:
            shared_s = await _shared(pd, prfaas, prompts[-1], rng)
        else:
            await _run_pair(prfaas, prompts[-1], 1)
        kv.append((await stats()).bytes_total - before)
    slowdown = max(shared_s / pd_s[PROFILE_LENGTHS.index(SHARED_LENGTH)], 1.0)
    moving = asyncio.Event()
    probe = asyncio.ensure_future(probe_link(prfaas, stats, prompts[1:], moving))
    try:
        await moving.wait()  # the probe's compute is done; its paced tail is CPU-light
        step = await _decode_step(pd, rng)
        link = await probe
    finally:
        probe.cancel()
    return MeasuredProfile(PROFILE_LENGTHS, tuple(pd_s), tuple(kv), step, batch_max, link, slowdown)


async def _decode_step(pd: Pair, rng: random.Random) -> float:
    one = await _run_pair(pd, _prompt(64, rng), 1)
    many = await _run_pair(pd, _prompt(64, rng), DECODE_TOKENS)
    return max((many - one) / (DECODE_TOKENS - 1), 1e-4)


async def probe_link(
    prfaas: Pair, stats: StatsReader, prompts: list[list[int]], moving: asyncio.Event
) -> float:
    """Egress bytes/s of the PrfaaS prefill: re-send prompts it has cached (their KV leaves
    at once, so the link, not compute, sets the pace) while sampling its telemetry every
    10 ms; the busy span is timed on the engine's clock. Tries longer prompts until a probe
    is busy for PROBE_MIN_BUSY_S. Sets `moving` once bytes flow (or the probe ends).
    Raises ValueError if no byte was sent."""
    rate = 0.0
    try:
        for ids in prompts:
            samples: list[EgressSample] = [await stats()]
            run = asyncio.ensure_future(_run_pair(prfaas, ids, 1))
            while not run.done():
                await asyncio.wait({run}, timeout=PROBE_SAMPLE_S)
                samples.append(await stats())
                if samples[-1].bytes_total > samples[0].bytes_total:
                    moving.set()
            await run
            rate, busy_s = busy_rate(samples)
            if busy_s >= PROBE_MIN_BUSY_S:
                break
    finally:
        moving.set()
    if rate <= 0:
        raise ValueError("the link probe sent no KV bytes")
    return rate


def busy_rate(samples: list[EgressSample]) -> tuple[float, float]:
    """(bytes/s, seconds) over the span in which `bytes_total` grew: from the last sample
    before it moved to the first at its final value (so the span errs long by < 2 samples
    and the rate low)."""
    first, last = samples[0].bytes_total, samples[-1].bytes_total
    if last == first:
        return 0.0, 0.0
    start = max((s.at for s in samples if s.bytes_total == first), default=samples[0].at)
    end = min((s.at for s in samples if s.bytes_total == last), default=samples[-1].at)
    busy = end - start
    return ((last - first) / busy if busy > 0 else 0.0), busy


def _increasing(values: tuple[float, ...]) -> list[float]:
    out: list[float] = []
    for v in values:  # noise can invert neighbours; the profile format needs them sorted
        out.append(max(v, out[-1] * 1.001 if out else v))
    return out


def profile_document(
    m: MeasuredProfile, workload: Workload, pd_instances: int = 2
) -> dict[str, Any]:
    """The measured deployment as a planner profile (same schema as `prfaas plan`), its PD
    cluster `pd_instances` instances of the measured hardware, its times the shared-cores
    ones. One profile serves the start-up planner, the gateway's schedulers (their re-solves
    and predictions) and the simulated twin, so that they agree; it is right at capacity,
    where every engine works. At low load a request runs nearer its alone time: predicted
    compute then errs long by the slowdown, on the local and the remote side alike. Its
    `[machine]` table says so, and the simulator runs each engine at its alone speed while
    fewer work than the machine has cores."""
    return {
        "workload": {
            "input_distribution": "lognormal",
            "mu": math.log(workload.median_tokens),
            "sigma": workload.sigma,
            "min_tokens": workload.min_tokens,
            "max_tokens": workload.max_tokens,
            "output_tokens": workload.output_tokens,
        },
        "model": {
            "name": "embedded reference model",
            "kv_tokens": list(m.lengths),
            "kv_mib": _increasing(tuple(max(b, 1) / MIB for b in m.kv_bytes)),
        },
        "hardware": {
            "cpu": {
                "prefill_tokens": list(m.lengths),
                "prefill_seconds": _increasing(m.shared_prefill_s()),
                "decode_batch_max": m.decode_batch_max,
                "decode_step_seconds": m.shared_decode_step_s(),
            }
        },
        "clusters": {
            "prfaas": {
                "hardware": "cpu",
                "instances": 1,
                "egress_gbps": m.link_bytes_per_s * 8 / 1e9,
            },
            "pd": {"hardware": "cpu", "instances": pd_instances},
        },
        "machine": {"shared_slowdown": m.shared_slowdown, "busy_engines": SHARED_BUSY_ENGINES},
    }


def measured_profile(
    m: MeasuredProfile, workload: Workload, pd_instances: int = 2
) -> DeploymentProfile:
    """The measured deployment as a validated planner profile."""
    document = profile_document(m, workload, pd_instances)
    return parse_profile(document, source="<start-up profile>")


def profile_threshold(profile: DeploymentProfile) -> tuple[float, PlanReport]:
    """The planner's optimum threshold for a deployment profile, and its report.

    Raises:
        ValueError: the planner finds no PrfaaS-PD optimum.
    """
    report = plan(profile)
    t = report.prfaas_pd.threshold_tokens
    if t is None or not math.isfinite(t):
        raise ValueError(f"the planner found no threshold for the profile {profile.source}")
    return float(t), report

"""Start-up profiling of the embedded deployment and the planner run that chooses `t`.

Measured on the live engines: prefill latency at a few prompt lengths (a PD pair, one
output token), KV bytes per prefill (bytes that crossed the emulated link), decode step
time. These fill a deployment profile (the `prfaas plan` format) whose workload is a
log-normal of prompts from a few hundred to a few thousand tokens; the planner's optimum
threshold is the gateway's `t`.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass
from typing import Any

from prfaas.engines.client import (
    BaseEngineClient,
    Bootstrap,
    GenerateRequest,
    SamplingParams,
)
from prfaas.gateway.link import LinkEmulator
from prfaas.policies.planner import PlanReport, plan
from prfaas.policies.profile import parse_profile

PROFILE_LENGTHS = (256, 1024, 3072)
DECODE_TOKENS = 16
MIB = 2**20


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
    """PD-cluster pair time for one output token (prefill + hand-off on loopback)."""
    prfaas_s: tuple[float, ...]
    """Same through the PrfaaS prefill and the emulated link."""
    kv_bytes: tuple[int, ...]
    """Bytes that crossed the link per prefill."""
    decode_step_s: float
    decode_batch_max: int
    link_bytes_per_s: float


async def _run_pair(pair: Pair, ids: list[int], max_new_tokens: int) -> float:
    loop = asyncio.get_running_loop()
    room = random.getrandbits(63)
    request = GenerateRequest(
        rid=f"profile-{room}",
        input_ids=tuple(ids),
        sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0),
        bootstrap=Bootstrap(pair.bootstrap[0], pair.bootstrap[1], room),
    )

    async def drain(client: BaseEngineClient) -> None:
        async for _ in client.generate(request):
            pass

    start = loop.time()
    await asyncio.gather(drain(pair.prefill), drain(pair.decode))
    return loop.time() - start


def _prompt(length: int, rng: random.Random) -> list[int]:
    return [rng.randrange(0, 256) for _ in range(length)]  # fresh bytes: no cache hits


async def measure(
    pd: Pair, prfaas: Pair, link: LinkEmulator, batch_max: int, seed: int = 0
) -> MeasuredProfile:
    """Profile the engines (a few seconds; runs requests one at a time)."""
    rng = random.Random(seed)
    await _run_pair(pd, _prompt(64, rng), 1)  # warm-up
    pd_s, pf_s, kv = [], [], []
    for n in PROFILE_LENGTHS:
        pd_s.append(await _run_pair(pd, _prompt(n, rng), 1))
        before = link.egress_bytes
        pf_s.append(await _run_pair(prfaas, _prompt(n, rng), 1))
        kv.append(link.egress_bytes - before)
    one = await _run_pair(pd, _prompt(64, rng), 1)
    many = await _run_pair(pd, _prompt(64, rng), DECODE_TOKENS)
    step = max((many - one) / (DECODE_TOKENS - 1), 1e-4)
    return MeasuredProfile(
        PROFILE_LENGTHS, tuple(pd_s), tuple(pf_s), tuple(kv), step, batch_max,
        link.config.rate_bytes_per_s,
    )  # fmt: skip


def _increasing(values: tuple[float, ...]) -> list[float]:
    out: list[float] = []
    for v in values:  # noise can invert neighbours; the profile format needs them sorted
        out.append(max(v, out[-1] * 1.001 if out else v))
    return out


def profile_document(m: MeasuredProfile, workload: Workload) -> dict[str, Any]:
    """The measured deployment as a planner profile (same schema as `prfaas plan`)."""
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
                "prefill_seconds": _increasing(m.prefill_s),
                "decode_batch_max": m.decode_batch_max,
                "decode_step_seconds": m.decode_step_s,
            }
        },
        "clusters": {
            "prfaas": {
                "hardware": "cpu",
                "instances": 1,
                "egress_gbps": m.link_bytes_per_s * 8 / 1e9,
            },
            "pd": {"hardware": "cpu", "instances": 2},
        },
    }


def plan_threshold(m: MeasuredProfile, workload: Workload) -> tuple[float, PlanReport]:
    """The planner's optimum threshold for the measured profile, and its report.

    Raises:
        ValueError: the profile is invalid or the planner finds no PrfaaS-PD optimum.
    """
    report = plan(parse_profile(profile_document(m, workload), source="<start-up profile>"))
    t = report.prfaas_pd.threshold_tokens
    if t is None or not math.isfinite(t):
        raise ValueError("the planner found no threshold for the measured profile")
    return float(t), report

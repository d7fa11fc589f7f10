"""A failed prefix pull on an engine whose request fails with it (vLLM's connector runs
`kv_load_failure_policy` "fail") costs only the recompute: the Router runs the request again
without the pull, decided on what each cluster caches itself (here on the same prefill),
blaming no one and counting no retry; an export that
fails aborts the pulling prefill at once instead of leaving it waiting for the room.

The engines are scripted `BaseEngineClient`s (a double of the client interface, not of an
engine; the live pull is `tests/engines/vllm/test_vllm_prefix_pull.py`)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from prfaas.engine_clients.base import (
    BaseEngineClient,
    EngineCall,
    EngineError,
    EngineInfo,
    EngineStats,
    QueuedCall,
)
from prfaas.gateway.instances import InstanceManager, InstanceState
from prfaas.gateway.kv_index import KVIndexManager
from prfaas.gateway.router import RetryPolicy, Router, RoutingState
from prfaas.policies.routing import PrfaasPolicy
from prfaas.protocol.generate import GenerateChunk, GenerateRequest, SamplingParams
from prfaas.protocol.kv_events.events import BlockStored

BLOCK = 16
PROMPT = tuple(range(1, 129))


class _Call(QueuedCall):
    def _stop(self) -> None:
        pass


class _Scripted(BaseEngineClient):
    pull_failure_fails_request = True

    def __init__(self, instance_id: str, export_error: str | None = None) -> None:
        self.instance_id = instance_id
        self.calls: list[_Call] = []
        self.requests: list[GenerateRequest] = []
        self.export_error = export_error
        self.exports: list[int | None] = []

    def generate(self, request: GenerateRequest) -> EngineCall:
        self.calls.append(_Call())
        self.requests.append(request)
        return self.calls[-1]

    async def export_prefix(
        self, input_ids: Sequence[int], room: int, tokens: int | None = None
    ) -> int:
        self.exports.append(tokens)
        if self.export_error is not None:
            raise EngineError(self.export_error)
        return tokens or 0

    async def stats(self) -> EngineStats:
        return EngineStats()

    async def info(self) -> EngineInfo:
        return EngineInfo(role="both", page_size=BLOCK)


def _router(export_error: str | None = None) -> tuple[Router, dict[str, _Scripted]]:
    """A PrfaaS prefill, a PD prefill caching the prompt's first 64 tokens, a PD decode;
    the bandwidth-abundant regime, t = 32 (so the prompt's 64 uncached go to PrfaaS)."""
    clients = {
        "prfaas-p0": _Scripted("prfaas-p0"),
        "pd-p0": _Scripted("pd-p0", export_error),
        "pd-d0": _Scripted("pd-d0"),
    }
    instances = InstanceManager()
    for name, cluster, role, port in (
        ("prfaas-p0", "prfaas", "prefill", 9),
        ("pd-p0", "pd", "prefill", 10),
        ("pd-d0", "pd", "decode", None),
    ):
        state = InstanceState(name, cluster, role, clients[name], "127.0.0.1", port)
        state.prefix_pull = port is not None
        instances.add(state)
    index = KVIndexManager(block_size=BLOCK)
    hashes = tuple(range(100, 104))
    index.apply("pd-p0", [BlockStored(hashes, None, PROMPT[:64], BLOCK)])
    router = Router(
        instances,
        index,
        PrfaasPolicy(),
        RoutingState(32.0, "bandwidth_abundant"),
        retry=RetryPolicy(wait_s=0, max_retries=0),
    )
    return router, clients


def _answer(clients: dict[str, _Scripted], attempt: int) -> None:
    """Let attempt `attempt` (0-based) of the prefill and the decode answer."""
    prefill, decode = clients["prfaas-p0"], clients["pd-d0"]
    prefill.calls[attempt].push(GenerateChunk((0,), "", 128, 1, 0, "length"))
    prefill.calls[attempt].finish()
    decode.calls[attempt].push(GenerateChunk((7,), "x", 128, 1, 0, "length"))
    decode.calls[attempt].finish()


async def test_a_failed_pull_runs_again_on_the_same_prefill_without_it() -> None:
    router, clients = _router()
    sampling = SamplingParams(max_new_tokens=1, temperature=0.0)
    done = asyncio.ensure_future(router.dispatch("r", PROMPT, sampling, stream=False))
    await asyncio.sleep(0.01)
    prefill = clients["prfaas-p0"]
    first = prefill.requests[0]
    assert first.prefix_pull is not None and first.prefix_tokens == 64
    assert clients["pd-p0"].exports == [64]
    prefill.calls[0].finish(EngineError("KV load failed", code="engine_error"))
    await asyncio.sleep(0.01)
    assert len(prefill.requests) == 2 and prefill.requests[1].prefix_pull is None
    _answer(clients, 1)
    routed = await done
    assert routed.first is not None and routed.first.text == "x"
    assert routed.retries == 0 and router.instances["prfaas-p0"].healthy
    assert routed.decision.prefill_instance == "prfaas-p0"
    # decided afresh on what each cluster caches itself: no pull in it, none counted
    assert routed.decision.prefix_source is None and routed.decision.pull is None
    routed.close()


async def test_a_failed_export_aborts_the_pulling_prefill_at_once() -> None:
    router, clients = _router(export_error="the source answered 503")
    sampling = SamplingParams(max_new_tokens=1, temperature=0.0)
    done = asyncio.ensure_future(router.dispatch("r", PROMPT, sampling, stream=False))
    for _ in range(100):  # the export fails, the prefill is aborted, the request runs again
        await asyncio.sleep(0.01)
        if len(clients["prfaas-p0"].requests) == 2:
            break
    prefill = clients["prfaas-p0"]
    assert prefill.calls[0].ended.done()
    assert [r.prefix_pull is None for r in prefill.requests] == [False, True]
    assert router.prefix_pulls == {"started": 1, "exported": 0, "failed": 1}
    _answer(clients, 1)
    routed = await done
    assert routed.first is not None and routed.retries == 0
    routed.close()

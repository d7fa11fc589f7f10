"""`Router.dispatch`'s failure precedence when the prefill and the decode call fail in the
same event-loop turn: the prefill's error wins and the decode instance is not blamed.

Real sockets cannot schedule two failures into one loop turn deterministically, so the
engines here are scripted `BaseEngineClient`s (a test double of the client interface, not
of an engine): each call is a `QueuedCall` the test finishes by hand.
"""

from __future__ import annotations

import asyncio

import pytest

from prfaas.engines.client import (
    BaseEngineClient,
    EngineCall,
    EngineError,
    EngineInfo,
    EngineStats,
    QueuedCall,
)
from prfaas.gateway.instances import InstanceManager, InstanceState
from prfaas.gateway.kv_index import KVIndexManager
from prfaas.gateway.router import Router, RoutingState
from prfaas.policies.routing import PrfaasPolicy
from prfaas.protocol.generate import GenerateChunk, GenerateRequest, SamplingParams


class _Call(QueuedCall):
    """A call the test settles with `push` and `finish`; records whether it was aborted."""

    aborted = False

    def _stop(self) -> None:
        self.aborted = True


class _Scripted(BaseEngineClient):
    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.calls: list[_Call] = []

    def generate(self, request: GenerateRequest) -> EngineCall:
        self.calls.append(_Call())
        return self.calls[-1]

    async def stats(self) -> EngineStats:
        return EngineStats()

    async def info(self) -> EngineInfo:
        return EngineInfo(role="both", page_size=16)


def _router() -> tuple[Router, _Scripted, _Scripted]:
    instances = InstanceManager()
    prefill, decode = _Scripted("prfaas-p0"), _Scripted("pd-d0")
    instances.add(InstanceState("prfaas-p0", "prfaas", "prefill", prefill, "127.0.0.1", 9))
    instances.add(InstanceState("pd-d0", "pd", "decode", decode))
    router = Router(instances, KVIndexManager(block_size=16), PrfaasPolicy(), RoutingState(0.0))
    return router, prefill, decode


@pytest.mark.parametrize("decode_first", [False, True])
async def test_both_fail_in_one_turn_the_prefill_error_wins(decode_first: bool) -> None:
    router, prefill, decode = _router()
    done = asyncio.ensure_future(
        router.dispatch("r", tuple(range(64)), SamplingParams(), stream=False)
    )
    await asyncio.sleep(0)  # both calls sent
    failures = [
        (prefill.calls[0], EngineError("prefill: KV hand-off failed")),
        (decode.calls[0], EngineError("decode: refused", status=503, retryable=True)),
    ]
    for call, error in reversed(failures) if decode_first else failures:
        call.finish(error)
    with pytest.raises(EngineError, match="KV hand-off failed"):
        await done
    instances = router.instances
    assert instances["pd-d0"].healthy  # the decode failure followed from the prefill's
    assert instances["prfaas-p0"].in_flight == instances["pd-d0"].in_flight == 0


async def test_a_failed_prefill_aborts_the_waiting_decode_with_its_error() -> None:
    router, prefill, decode = _router()
    done = asyncio.ensure_future(
        router.dispatch("r", tuple(range(64)), SamplingParams(), stream=True)
    )
    await asyncio.sleep(0)
    prefill.calls[0].finish(EngineError("prefill died"))
    with pytest.raises(EngineError, match="prefill died"):
        await done
    assert decode.calls[0].aborted  # told to drop the request, not left waiting for KV


async def test_a_prefill_that_fails_after_the_decode_answered_does_not_fail_the_request() -> None:
    """The decode produced output, so it received (and verified) the KV: a prefill call
    that fails afterwards (its answer lost, say) does not cut a complete answer."""
    router, prefill, decode = _router()
    routed_task = asyncio.ensure_future(
        router.dispatch("r", tuple(range(64)), SamplingParams(), stream=False)
    )
    await asyncio.sleep(0)
    decode.calls[0].push(GenerateChunk((1,), "a", 64, 1, 0, "length"))
    decode.calls[0].finish()
    routed = await routed_task
    assert routed.first is not None and routed.first.text == "a"
    prefill.calls[0].finish(EngineError("prefill: transfer not acknowledged"))
    assert await routed.next() is None
    routed.close()
    assert router.instances["pd-d0"].in_flight == 0 and routed.retries == 0

"""`Router.complete`'s failure precedence when the prefill and the decode call fail in the
same event-loop turn: the prefill's error wins and the decode instance is not blamed.

Real sockets cannot schedule two failures into one loop turn deterministically, so the
engines here are scripted `BaseEngineClient`s (a test double of the client interface, not
of an engine): `begin` hands out futures the test fails by hand.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from prfaas.engines.client import (
    BaseEngineClient,
    EngineError,
    EngineInfo,
    EngineStats,
    GenerateChunk,
    GenerateRequest,
    SamplingParams,
)
from prfaas.gateway.instances import InstanceManager, InstanceState
from prfaas.gateway.kv_index import KVIndexManager
from prfaas.gateway.router import Router, RoutingState
from prfaas.policies.routing import PrfaasPolicy


class _Scripted(BaseEngineClient):
    """`begin` returns a pending future per call; the test settles them."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.calls: list[asyncio.Future[list[GenerateChunk]]] = []

    def begin(self, request: GenerateRequest) -> asyncio.Future[list[GenerateChunk]]:
        call: asyncio.Future[list[GenerateChunk]] = asyncio.get_running_loop().create_future()
        self.calls.append(call)
        return call

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateChunk, None]:
        for chunk in await self.begin(request):  # the same scripted call, as a stream
            yield chunk

    async def stats(self) -> EngineStats:
        return EngineStats()

    async def info(self) -> EngineInfo:
        return EngineInfo(role="both", page_size=16)


@pytest.mark.parametrize("decode_first", [False, True])
async def test_both_fail_in_one_turn_the_prefill_error_wins(decode_first: bool) -> None:
    instances = InstanceManager()
    prefill, decode = _Scripted("prfaas-p0"), _Scripted("pd-d0")
    instances.add(InstanceState("prfaas-p0", "prfaas", "prefill", prefill, "127.0.0.1", 9))
    instances.add(InstanceState("pd-d0", "pd", "decode", decode))
    router = Router(instances, KVIndexManager(block_size=16), PrfaasPolicy(), RoutingState(0.0))
    done = asyncio.ensure_future(router.complete("r", tuple(range(64)), SamplingParams()))
    await asyncio.sleep(0)  # both calls sent
    failures = [
        (prefill.calls[0], EngineError("prefill: KV hand-off failed")),
        (decode.calls[0], EngineError("decode: refused", status=503, retryable=True)),
    ]
    for call, error in reversed(failures) if decode_first else failures:
        call.set_exception(error)
    with pytest.raises(EngineError, match="KV hand-off failed"):
        await done
    assert instances["pd-d0"].healthy  # the decode failure followed from the prefill's
    assert instances["prfaas-p0"].in_flight == instances["pd-d0"].in_flight == 0

"""`Router.dispatch`'s failure precedence when the prefill and the decode call fail in the
same event-loop turn: the prefill's error wins and the decode instance is not blamed.

Real sockets cannot schedule two failures into one loop turn deterministically, so the
engines here are scripted `BaseEngineClient`s (a test double of the client interface, not
of an engine): each call is a `QueuedCall` the test finishes by hand.
"""

from __future__ import annotations

import asyncio

import pytest

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
from prfaas.gateway.router import Dispatch, RetryPolicy, Router, RoutingState
from prfaas.policies.routing import PrfaasPolicy
from prfaas.protocol.client_body import ClientBody
from prfaas.protocol.generate import GenerateChunk, GenerateRequest, SamplingParams
from prfaas.protocol.kv_events import BlockStored, SaltedBlockStored


class _Call(QueuedCall):
    """A call the test settles with `push` and `finish`; records whether it was aborted."""

    aborted = False

    def _stop(self) -> None:
        self.aborted = True


class _Scripted(BaseEngineClient):
    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.calls: list[_Call] = []
        self.requests: list[GenerateRequest] = []

    def generate(self, request: GenerateRequest) -> EngineCall:
        self.calls.append(_Call())
        self.requests.append(request)
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
    router = Router(
        instances,
        KVIndexManager(block_size=16),
        PrfaasPolicy(),
        RoutingState(0.0),
        retry=RetryPolicy(wait_s=0),  # nothing comes back here: fail at once
    )
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


async def test_a_lone_decode_that_dies_mid_stream_takes_the_request_back_once_readmitted() -> None:
    """The only decode dies after one token: nowhere to migrate, so the request waits; once
    the health monitor readmits the (restarted) decode, the prompt plus the token already
    streamed go to it, and the counts continue from the request's start."""
    router, prefill, decode = _router()
    router.retry = RetryPolicy(wait_s=5)
    routed = await _first(router, prefill, decode, GenerateChunk((7,), "a", 64, 1, 0))
    assert routed.first is not None and routed.first.token_ids == (7,)
    nxt = asyncio.ensure_future(routed.next())
    decode.calls[0].finish(EngineError("pd-d0: unreachable", unreachable=True, retryable=True))
    await asyncio.sleep(0.3)
    state = router.instances["pd-d0"]
    assert state.status == "ejected" and len(decode.calls) == 1 and not nxt.done()
    state.status, state.readmissions = "healthy", state.readmissions + 1  # came back
    await asyncio.sleep(0.3)  # the waiting request polls every 0.2 s
    assert len(decode.calls) == 2
    assert decode.requests[1].input_ids == (*range(64), 7)
    assert decode.requests[1].sampling.max_new_tokens == 3
    decode.calls[1].push(GenerateChunk((8, 9, 10), "bcd", 65, 3, 0, "length"))
    decode.calls[1].finish()
    prefill.calls[1].finish()
    chunk = await nxt
    assert chunk is not None and (chunk.completion_tokens, chunk.prompt_tokens) == (4, 64)
    assert await routed.next() is None
    routed.close()
    assert routed.migrations == 1 and routed.retries == 0


async def _first(
    router: Router, prefill: _Scripted, decode: _Scripted, chunk: GenerateChunk
) -> Dispatch:
    sampling = SamplingParams(max_new_tokens=4, temperature=0)
    task = asyncio.ensure_future(router.dispatch("r", tuple(range(64)), sampling, stream=True))
    await asyncio.sleep(0)
    decode.calls[0].push(chunk)
    prefill.calls[0].finish()
    return await task


async def _fails_without_migrating(routed: Dispatch, decode: _Scripted) -> None:
    """The decode dies after output: the request fails at once, not migrated."""
    decode.calls[0].finish(EngineError("pd-d0: died mid-stream"))
    with pytest.raises(EngineError, match="died mid-stream"):
        await asyncio.wait_for(routed.next(), 1.0)
    assert routed.migrations == 0 and len(decode.calls) == 1
    routed.close()


async def test_a_forwarded_request_is_never_migrated() -> None:
    """A request carrying the client's OpenAI body whose decode dies after output fails at
    once, although a migration would wait for the decode to come back (as a token-id
    request does above): its answer is the engine's own rendering, which no other engine
    continues exactly."""
    router, prefill, decode = _router()
    router.retry = RetryPolicy(wait_s=5)
    body = ClientBody("chat", {"model": "tiny", "messages": [], "tools": [{}]})
    task = asyncio.ensure_future(
        router.dispatch("r", tuple(range(64)), SamplingParams(), stream=True, client_body=body)
    )
    await asyncio.sleep(0)
    assert decode.requests[0].client_body is body and prefill.requests[0].client_body is body
    decode.calls[0].push(GenerateChunk((), "", 64, 1, 0, raw=b"{}"))
    prefill.calls[0].finish()
    routed = await task
    await _fails_without_migrating(routed, decode)


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(frequency_penalty=0.5), SamplingParams(temperature=1.0, seed=3)],
    ids=["output-penalty", "seeded"],
)
async def test_a_request_no_engine_continues_exactly_is_not_migrated(
    sampling: SamplingParams,
) -> None:
    """Penalties over the output alone, or a seeded draw keyed by the output's position,
    would change on another engine that takes the output as prompt: such a request's cut
    stream fails at once instead of continuing inexactly."""
    router, prefill, decode = _router()
    router.retry = RetryPolicy(wait_s=5)
    task = asyncio.ensure_future(router.dispatch("r", tuple(range(64)), sampling, stream=True))
    await asyncio.sleep(0)
    decode.calls[0].push(GenerateChunk((7,), "a", 64, 1, 0))
    prefill.calls[0].finish()
    routed = await task
    await _fails_without_migrating(routed, decode)


def test_a_migrated_request_keeps_its_minimum_and_its_budget() -> None:
    params = SamplingParams(max_new_tokens=10, min_new_tokens=6, repetition_penalty=1.2)
    assert params.resumable
    rest = params.continued(4)
    assert (rest.max_new_tokens, rest.min_new_tokens, rest.repetition_penalty) == (6, 2, 1.2)
    assert params.continued(12).max_new_tokens == 1


async def test_several_sequences_run_on_the_decode_alone() -> None:
    """`n > 1` (or prompt log-probabilities): the decode computes the prompt itself; no
    prefill call, no bootstrap."""
    router, prefill, decode = _router()
    body = ClientBody("completions", {"model": "tiny", "prompt": "x", "n": 2})
    task = asyncio.ensure_future(
        router.dispatch("r", tuple(range(64)), SamplingParams(), stream=False, client_body=body)
    )
    await asyncio.sleep(0)
    assert not prefill.calls and decode.requests[0].bootstrap is None
    decode.calls[0].push(GenerateChunk((), "", 64, 2, 0, "length", raw=b"{}"))
    decode.calls[0].finish()
    routed = await task
    assert routed.decision.prefill_instance == "pd-d0" and routed.decision.route == "pd"
    routed.close()


@pytest.mark.parametrize(
    ("fields", "credited"),
    [
        ({"cache_salt": "tenant-1"}, 32),
        ({}, 16),
        ({"cache_salt": ""}, 16),  # (SGLang salts nothing with it; vLLM refuses it)
        ({"cache_salt": "tenant-2"}, 0),
        ({"cache_salt": "tenant-1", "extra_key": "effort-high"}, 0),
        ({"lora_path": "adapter"}, 0),
        ({"cache_salt": ["tenant-1", "tenant-2"]}, 0),  # (SGLang's salt per batched prompt)
    ],
)
async def test_a_prompt_is_credited_what_is_cached_under_its_own_cache_key(
    fields: dict[str, object], credited: int
) -> None:
    """The engines key a prompt's blocks by its `cache_salt` too: the router looks a salted
    prompt up from that salt's root, so it is credited the chain stored under its salt
    alone (two blocks here), and an unsalted prompt the unsalted chain (one block). A
    request keyed by what the index does not read (SGLang's `extra_key`, an adapter, a
    salt per prompt) is credited nothing."""
    router, prefill, decode = _router()
    tokens = tuple(range(40))
    router.index.apply(
        "prfaas-p0", [SaltedBlockStored((1, 2), None, tokens[:32], 16, None, "tenant-1")]
    )
    router.index.apply("prfaas-p0", [BlockStored((3,), None, tokens[:16], 16)])
    body = ClientBody("completions", {"model": "tiny", "prompt": "x", **fields})
    task = asyncio.ensure_future(
        router.dispatch("r", tokens, SamplingParams(), stream=False, client_body=body)
    )
    await asyncio.sleep(0)
    decode.calls[0].push(GenerateChunk((), "", 40, 2, 0, "length", raw=b"{}"))
    decode.calls[0].finish()
    prefill.calls[0].finish()
    routed = await task
    assert routed.decision.prefill_instance == "prfaas-p0"
    assert routed.decision.cached_tokens == credited
    routed.close()


@pytest.mark.parametrize("salted", [False, True])
async def test_a_salted_prefix_is_computed_where_it_runs_never_pulled(salted: bool) -> None:
    """In the bandwidth-abundant regime a prefix the other cluster caches is pulled (its
    source exports it). An export names blocks by their tokens alone, so a salted prompt
    is routed as in the scarce regime instead, on what each cluster caches itself: here
    its 8 tokens beyond PD's cache (none) exceed the threshold, so PrfaaS computes them on
    its own 32 cached, where unsalted it runs in PD pulling PrfaaS's 32."""
    instances = InstanceManager()
    engines = {name: _Scripted(name) for name in ("prfaas-p0", "pd-p0", "pd-d0")}
    for name, cluster, role in (("prfaas-p0", "prfaas", "prefill"),
                                ("pd-p0", "pd", "prefill"), ("pd-d0", "pd", "decode")):  # fmt: skip
        instance = InstanceState(name, cluster, role, engines[name], "127.0.0.1", 9)
        instance.prefix_pull = True
        instances.add(instance)
    state = RoutingState(10.0, "bandwidth_abundant")
    router = Router(instances, KVIndexManager(block_size=16), PrfaasPolicy(), state)
    tokens = tuple(range(40))
    stored = (
        SaltedBlockStored((1, 2), None, tokens[:32], 16, None, "tenant-1")
        if salted
        else BlockStored((1, 2), None, tokens[:32], 16)
    )
    router.index.apply("prfaas-p0", [stored])
    fields = {"cache_salt": "tenant-1"} if salted else {}
    body = ClientBody("completions", {"model": "tiny", "prompt": "x", **fields})
    routed = Dispatch(router, "r", tokens, SamplingParams(), False, body)
    routed._launch()
    decision = routed.decision
    if salted:
        assert (decision.route, decision.prefix_source, decision.cached_tokens) == (
            "prfaas", None, 32)  # fmt: skip
        assert engines["prfaas-p0"].requests[0].prefix_pull is None
    else:
        assert (decision.route, decision.prefix_source) == ("pd", "prfaas-p0")
        assert engines["pd-p0"].requests[0].prefix_pull is not None
    routed.close()

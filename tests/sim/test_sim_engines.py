"""Simulated engines behind the real engine-client interface, on the virtual clock: FIFO
prefill timed by the profile on the incremental length, KV handed over through the bootstrap
room after the link, decode slots."""

from __future__ import annotations

import asyncio

import pytest

from prfaas.engine_clients.base import EngineError, collect
from prfaas.policies.tables import PiecewiseLinear
from prfaas.protocol.generate import Bootstrap, GenerateChunk, GenerateRequest, SamplingParams
from prfaas.protocol.kv_events import KVEvent
from prfaas.sim.cache import SimPrefixCache
from prfaas.sim.engines import (
    PrefillTiming,
    SimRooms,
    SimulatedDecodeEngine,
    SimulatedPrefillEngine,
)
from prfaas.sim.link import LinkConfig, SimLink
from prfaas.sim.virtual_loop import run_virtual

BS = 4
# prefill: 1 s + 0.1 s per token; KV: 100 bytes per token; link 1000 B/s
PREFILL = PiecewiseLinear((0.0, 100.0), (1.0, 11.0))
KV = PiecewiseLinear((0.0, 100.0), (0.0, 10_000.0))
LINK_GBPS = 1000 * 8 / 1e9


class _Rig:
    """One prefill and one decode instance sharing rooms and a link."""

    def __init__(self, *, pipelined: bool = True, batch_max: int = 4) -> None:
        loop = asyncio.get_running_loop()
        self.rooms = SimRooms(loop)
        self.link = SimLink(LinkConfig(LINK_GBPS), loop)
        self.events: list[tuple[str, KVEvent]] = []
        self.prefill = SimulatedPrefillEngine(
            "p0",
            timing=PrefillTiming(PREFILL, KV, pipelined),
            link=self.link,
            cache=SimPrefixCache(BS, None),
            rooms=self.rooms,
            publish=lambda iid, evs: self.events.extend((iid, e) for e in evs),
        )
        self.decode = SimulatedDecodeEngine(
            "d0", batch_max=batch_max, step_s=0.5, rooms=self.rooms, page_size=BS
        )
        self.room = 0

    async def run(
        self, ids: tuple[int, ...], max_tokens: int = 3
    ) -> list[tuple[float, GenerateChunk]]:
        """Dispatch to prefill and decode at once; return (time, chunk) of the decode stream."""
        loop = asyncio.get_running_loop()
        self.room += 1
        req = GenerateRequest(
            f"r{self.room}", ids, SamplingParams(max_new_tokens=max_tokens), True,
            Bootstrap("p0", 0, self.room),
        )  # fmt: skip

        prefill = self.prefill.generate(req)
        decode = self.decode.generate(req)
        out = []
        while (chunk := await decode.next()) is not None:
            out.append((loop.time(), chunk))
        await collect(prefill)
        return out


def test_prefill_then_transfer_then_decode_timing() -> None:
    """8 tokens: prefill 1.8 s, 800 B layer-wise at 444 B/s released < 1000 B/s link, so the
    KV arrives with the prefill; first token one step later, the rest after 2 more steps."""

    async def main() -> list[tuple[float, GenerateChunk]]:
        return await _Rig().run(tuple(range(8)))

    (t1, first), (t2, last) = run_virtual(main())
    assert t1 == pytest.approx(1.8 + 0.5)
    assert first.completion_tokens == 1 and first.finish_reason is None
    assert t2 == pytest.approx(1.8 + 1.5)
    assert last.completion_tokens == 3 and last.finish_reason == "length"
    assert len(last.token_ids) == 2


def test_non_pipelined_adds_the_transfer_after_the_prefill() -> None:
    """Same request, KV shipped only at the end: 1.8 s + 800 B / 1000 B/s."""

    async def main() -> float:
        chunks = await _Rig(pipelined=False).run(tuple(range(8)))
        return chunks[0][0]

    assert run_virtual(main()) == pytest.approx(1.8 + 0.8 + 0.5)


def test_cached_prefix_shortens_the_prefill_and_reaches_the_index_events() -> None:
    """The second prompt shares 2 cached blocks: it computes 2 tokens (1.2 s), reports 8 cached
    tokens, and its BlockStored chains after the cached prefix."""

    async def main() -> tuple[_Rig, float, GenerateChunk]:
        rig = _Rig()
        await rig.run(tuple(range(8)))
        start = asyncio.get_running_loop().time()
        chunks = await rig.run((*range(8), 50, 51))
        return rig, chunks[0][0] - start, chunks[0][1]

    rig, ttft, first = run_virtual(main())
    assert ttft == pytest.approx(1.2 + 0.5)
    assert first.cached_tokens == 8
    assert len(rig.events) == 1  # the 10-token prompt adds no full block
    assert len(rig.rooms) == 0  # rooms are cleaned up


def test_prefill_is_fifo_one_at_a_time_and_decode_waits_for_a_slot() -> None:
    """Two 8-token prompts at once: the second prefill starts when the first is done; with
    one decode slot, the second decode also waits for the first to finish."""

    async def main() -> list[float]:
        rig = _Rig(batch_max=1)
        runs = await asyncio.gather(rig.run(tuple(range(8))), rig.run(tuple(range(100, 108))))
        return [chunks[0][0] for chunks in runs]

    first, second = run_virtual(main())
    assert first == pytest.approx(2.3)
    # prefill done at 3.6; the slot frees at 1.8 + 1.5 = 3.3, so the first token comes at 4.1
    assert second == pytest.approx(3.6 + 0.5)


def test_a_request_without_bootstrap_is_refused() -> None:
    """The PD protocol needs a bootstrap room on both sides."""

    async def main() -> None:
        rig = _Rig()
        await collect(rig.decode.generate(GenerateRequest("x", (1, 2))))

    with pytest.raises(EngineError, match="bootstrap room"):
        run_virtual(main())

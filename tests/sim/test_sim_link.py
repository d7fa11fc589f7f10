"""The simulated link on the virtual clock: fair sharing, release-rate caps, one-way delay.

Capacity 800 bits/s = 100 bytes/s keeps the arithmetic exact.
"""

from __future__ import annotations

import asyncio

import pytest

from prfaas.sim.link import LinkConfig, SimLink
from prfaas.sim.virtual_loop import run_virtual

BYTES_PER_S = 100.0
GBPS = BYTES_PER_S * 8 / 1e9


async def _finish_times(
    transfers: list[tuple[float, float, float]], delay_s: float = 0.0
) -> list[float]:
    """Start each (at_s, nbytes, produce_s) transfer on one link; return arrival times."""
    loop = asyncio.get_running_loop()
    link = SimLink(LinkConfig(GBPS, delay_s), loop)

    async def one(at: float, nbytes: float, produce: float) -> float:
        await asyncio.sleep(at)
        await link.transfer(nbytes, produce_s=produce)
        return loop.time()

    times = await asyncio.gather(*(one(*t) for t in transfers))
    assert link.active == 0
    assert link.bytes_sent == pytest.approx(sum(t[1] for t in transfers))
    return list(times)


def test_single_transfer_takes_size_over_capacity_plus_delay() -> None:
    """A non-pipelined transfer alone on the link: S/B + delay."""
    assert run_virtual(_finish_times([(0, 500, 0)], delay_s=0.25)) == pytest.approx([5.25])


def test_concurrent_transfers_share_the_link_fairly() -> None:
    """Two equal transfers started together both finish at 2S/B; a third arriving later
    slows them from its arrival on (processor sharing)."""
    assert run_virtual(_finish_times([(0, 100, 0), (0, 100, 0)])) == pytest.approx([2.0, 2.0])
    # 0..1 s: two flows at 50 B/s (50 B left each); then three flows at 33.3 B/s
    times = run_virtual(_finish_times([(0, 100, 0), (0, 100, 0), (1, 100, 0)]))
    assert times[:2] == pytest.approx([2.5, 2.5])
    assert times[2] == pytest.approx(3.0)


def test_layer_wise_transfer_ends_with_its_prefill_when_the_link_is_fast() -> None:
    """Bytes released over a 10 s prefill at 20 B/s on a 100 B/s link: done at 10 s."""
    assert run_virtual(_finish_times([(0, 200, 10)])) == pytest.approx([10.0])


def test_layer_wise_transfer_is_link_bound_when_the_link_is_slow() -> None:
    """800 B over a 2 s prefill: the link (8 s) dominates, not compute + link (10 s)."""
    assert run_virtual(_finish_times([(0, 800, 2)])) == pytest.approx([8.0])


def test_a_capped_flow_leaves_its_unused_share_to_others() -> None:
    """Max-min fairness: a flow released at 20 B/s takes 20, the backlogged one gets 80."""
    times = run_virtual(_finish_times([(0, 200, 10), (0, 400, 0)]))
    assert times == pytest.approx([10.0, 5.0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"gbps": 0.0}, "gbps must be"), ({"gbps": 1.0, "delay_s": -1.0}, "delay_s must be")],
)
def test_bad_link_config_names_the_value(kwargs: dict[str, float], match: str) -> None:
    """Validation errors name the field and the bad value."""
    with pytest.raises(ValueError, match=match):
        LinkConfig(**kwargs)

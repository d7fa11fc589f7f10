"""The device-aware mover (`TorchPagePool`) driven as the engine adapters drive it, with CPU
tensors (the same code runs with CUDA tensors plus streams): torch views laid out as vLLM's
GPU layouts (NHD, HND, as byte pages), as its CPU backend, as SGLang's byte views, and
bf16/fp8 caches, moved over the real loopback transport through a `SendQueue`, placed
bit-exactly; the host budget bounding what a slow link lets pile up."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest
import torch

from prfaas.engines.kv_pages import PagedPool, PageError, PagePlacer, PageStream, SendQueue
from prfaas.engines.kv_pages.torch_pool import TorchPagePool
from prfaas.engines.transport import KVReceiver, KVSender, SenderConfig

HEADS, DIM, BLOCKS, PAGE = 2, 8, 12, 4
FULL, LINEAR = (1, 3), (0, 2)
STATE = {"conv": (6, 3), "ssm": (2, 4, 4)}

Layout = Callable[[torch.Tensor], dict[str, torch.Tensor]]


def _nhd(raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """vLLM's GPU default: physically (blocks, tokens, heads, K|V), moved as byte pages."""
    cache = raw.view(BLOCKS, PAGE, HEADS, 2 * DIM)
    return {"kv": cache.view(torch.uint8).view(BLOCKS, PAGE, -1)}


def _hnd(raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """FlashInfer on Blackwell: physically (blocks, heads, tokens, K|V); a block's bytes
    are not token rows, and move whole."""
    cache = raw.view(BLOCKS, HEADS, PAGE, 2 * DIM)
    return {"kv": cache.view(torch.uint8).view(BLOCKS, PAGE, -1)}


def _cpu_backend(raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """vLLM's CPU backend: per block and head the keys of every token, then the values;
    token-strided K and V views."""
    both = raw.view(BLOCKS, HEADS, 2 * PAGE, DIM)
    return {
        "k": both[:, :, :PAGE].transpose(1, 2),
        "v": both[:, :, PAGE:].transpose(1, 2),
    }


def _pool(layout: Layout, seed: int, dtype: torch.dtype = torch.bfloat16) -> TorchPagePool:
    gen = torch.Generator().manual_seed(seed)
    pages = {}
    for layer in FULL:
        raw = torch.randint(-(1 << 15), 1 << 15, (BLOCKS * PAGE * HEADS * 2 * DIM,), generator=gen)
        pages[layer] = layout(_as(raw, dtype))
    states = {
        layer: {
            n: torch.randn(5, *shape, generator=gen).to(torch.bfloat16)
            for n, shape in STATE.items()
        }
        for layer in LINEAR
    }
    return TorchPagePool(pages, states)


def _as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Random bits as `dtype` (all 16 bits random for bf16; one byte each for fp8)."""
    if dtype == torch.bfloat16:
        return raw.to(torch.int16).view(torch.bfloat16)
    return raw.to(torch.uint8).view(dtype)


def _block_bytes(pool: TorchPagePool, layer: int, block: int) -> bytes:
    return b"".join(t[block].contiguous().view(torch.uint8).numpy().tobytes()
                    for _, t in sorted(pool.pages[layer].items()))  # fmt: skip


async def _move(
    src: TorchPagePool,
    dst: TorchPagePool | PagedPool,
    src_blocks: list[int],
    dst_blocks: list[int],
    *,
    skip: int = 0,
    config: SenderConfig | None = None,
) -> PagePlacer:
    """Send a request layer by layer from a 'forward' thread through a `SendQueue`, states
    after the last layer, and place it at the decode side as the adapters do."""
    sender = KVSender(config or SenderConfig(connections=2, chunk_bytes=4096))
    receiver = KVReceiver()
    queue = SendQueue()
    await sender.start()
    try:
        transfer = await receiver.fetch("127.0.0.1", sender.bootstrap_port, 7, timeout_s=30)
        stream = PageStream(sender.open(7), queue)

        def forward() -> None:
            for layer in sorted(src.pages):
                stream.send_pages(src, layer, src_blocks, 0)
            for layer in sorted(src.states):
                stream.send_state(src, layer, 4)
            src.reads_done()
            stream.send_meta({"num_tokens": len(src_blocks) * PAGE})
            stream.finish()

        sent = asyncio.create_task(asyncio.to_thread(forward))
        placer = PagePlacer(dst, dict.fromkeys(src.pages, dst_blocks),
                            dict.fromkeys(src.states, 1), skip_tokens=skip)  # fmt: skip
        async for item in transfer:
            placer.place(item)
        await transfer.complete()
        await sent
        fence = getattr(dst, "fence", None)
        if fence is not None:
            fence().wait()
        placer.check_complete(len(src_blocks) * PAGE)
        return placer
    finally:
        queue.close()
        await receiver.close()
        await sender.close()


@pytest.mark.parametrize("layout", [_nhd, _hnd, _cpu_backend], ids=["nhd", "hnd", "cpu"])
async def test_pages_and_states_move_bit_exact_between_device_pools(layout: Layout) -> None:
    """Every byte of the request's blocks and states lands in the decode's own blocks and
    slot; no other block or slot changes."""
    src, dst = _pool(layout, 1), _pool(layout, 2)
    before = {b: _block_bytes(dst, 1, b) for b in range(BLOCKS)}
    slot_before = dst.states[0]["conv"][2].clone()
    await _move(src, dst, [9, 2, 5], [0, 7, 3])
    for layer in FULL:
        for s, d in zip([9, 2, 5], [0, 7, 3], strict=True):
            assert _block_bytes(dst, layer, d) == _block_bytes(src, layer, s), (layer, s)
    for layer in LINEAR:
        for name in STATE:
            assert torch.equal(dst.states[layer][name][1], src.states[layer][name][4])
    assert all(_block_bytes(dst, 1, b) == before[b] for b in set(range(BLOCKS)) - {0, 7, 3})
    assert torch.equal(dst.states[0]["conv"][2], slot_before)


async def test_fp8_pages_move_as_their_bits() -> None:
    """An fp8 cache (no numpy dtype) moves as uint8, bit for bit."""
    src = _pool(_nhd, 3, torch.float8_e4m3fn)
    dst = _pool(_nhd, 4, torch.float8_e4m3fn)
    await _move(src, dst, [4, 8], [11, 1])
    assert _block_bytes(dst, 3, 11) == _block_bytes(src, 3, 4)


async def test_a_device_pool_and_a_host_pool_speak_one_wire() -> None:
    """bf16 token pages from a torch pool land in a numpy (uint16) pool unchanged, and a
    local prefix hit at the decode (whole first block) is left as it was."""
    src = _pool(_cpu_backend, 5)
    rng = np.random.default_rng(0)
    host = {n: rng.integers(0, 1 << 16, (BLOCKS, PAGE, HEADS, DIM), dtype=np.uint16) for n in "kv"}
    dst = PagedPool(
        pages={layer: {n: host[n].copy() for n in "kv"} for layer in FULL},
        states={
            layer: {n: np.zeros((5, *shape), np.uint16) for n, shape in STATE.items()}
            for layer in LINEAR
        },
    )
    kept = dst.pages[1]["k"][6].copy()
    await _move(src, dst, [3, 10], [6, 2], skip=PAGE)
    want = src.pages[1]["k"][10].view(torch.uint16).numpy()
    assert dst.pages[1]["k"][2].tobytes() == np.ascontiguousarray(want).tobytes()
    assert np.array_equal(dst.pages[1]["k"][6], kept)


async def test_the_host_budget_bounds_what_a_slow_link_piles_up() -> None:
    """Four layers of 8 KiB each through a 16 KiB budget over a link paced to 50 KB/s
    (past its 4 KiB burst): the 'forward' waits for the first layers' bytes to leave
    instead of copying ahead; never more than the budget is held, and everything still
    arrives bit-exact."""

    def pool(seed: int) -> TorchPagePool:
        gen = torch.Generator().manual_seed(seed)
        pages = {x: {"kv": torch.randint(0, 256, (8, 4, 512), generator=gen, dtype=torch.uint8)}
                 for x in range(4)}  # fmt: skip
        return TorchPagePool(pages, send_budget_bytes=16 << 10)

    src, dst = pool(6), pool(7)
    paced = SenderConfig(connections=1, rate_bytes_per_s=50_000)
    await _move(src, dst, [0, 1, 2, 3], [4, 5, 6, 7], config=paced)
    assert src.budget.stats.waits >= 1
    assert src.budget.stats.peak_bytes == 16 << 10  # two layers in flight, never three
    assert src.budget.stats.held_bytes == 0
    for layer in range(4):
        assert torch.equal(dst.pages[layer]["kv"][4:8], src.pages[layer]["kv"][0:4])


def test_mismatches_are_refused_and_write_nothing() -> None:
    """Pages of another row shape or dtype, and states of another shape, raise PageError
    naming the layer; an unknown layer too."""
    dst = _pool(_nhd, 8)
    before = _block_bytes(dst, 1, 0)
    row = dst.pages[1]["kv"].shape[2]
    with pytest.raises(PageError, match="layer 1 'kv': token shape"):
        dst.scatter(1, {"kv": np.zeros((1, PAGE, row + 1), np.uint8)}, 0, [0])
    with pytest.raises(PageError, match="layer 1 'kv': dtype uint16"):
        dst.scatter(1, {"kv": np.zeros((1, PAGE, row), np.uint16)}, 0, [0])
    with pytest.raises(PageError, match="layer 0 is not a paged"):
        dst.scatter(0, {"kv": np.zeros((1, PAGE, row), np.uint8)}, 0, [0])
    with pytest.raises(PageError, match="layer 0 state 'conv'"):
        wrong = {"conv": np.zeros((6, 4), np.uint16), "ssm": np.zeros((2, 4, 4), np.uint16)}
        dst.write_state(0, 1, wrong)
    assert _block_bytes(dst, 1, 0) == before


def test_pool_description_is_validated() -> None:
    """Views must be tensors on one device, agree on their count and share one page size."""
    with pytest.raises(ValueError, match="disagree on their count"):
        TorchPagePool({0: {"k": torch.zeros(4, 2, 1), "v": torch.zeros(5, 2, 1)}})
    with pytest.raises(ValueError, match="one page size"):
        TorchPagePool({0: {"k": torch.zeros(4, 2, 1)}, 1: {"k": torch.zeros(4, 3, 1)}})
    with pytest.raises(ValueError, match="torch tensor"):
        TorchPagePool({0: {"k": np.zeros((4, 2, 1))}})  # type: ignore[dict-item]

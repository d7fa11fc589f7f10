"""Pages and state slots between two differently laid out pools, over the real loopback
transport: different physical block ids, page sizes, memory layouts and slot numbers."""

from __future__ import annotations

import numpy as np
import pytest

from prfaas.engines.kv_pages import (
    PagedPool,
    PageError,
    PagePlacer,
    PageStream,
    decode_meta,
    wire_layer,
)
from prfaas.engines.transport import Kind, KVReceiver, KVSender, LayerItem, SenderConfig
from prfaas.engines.transport.payload import LayerArrays

HEADS, DIM = 2, 8
CONV, STATE = (6, 3), (2, 4, 4)
FULL_LAYERS, LINEAR_LAYERS = (3, 7), (0, 1, 2, 4, 5, 6)


def _bits(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random bf16 bit patterns (uint16, as bfloat16 travels)."""
    return rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)


def vllm_like_pool(rng: np.random.Generator, pages: int, page: int, slots: int) -> PagedPool:
    """A pool over `(2, pages, heads, page, dim)` tensors (K and V fused, heads before
    tokens), seen through strided views, with `(slots, *state)` linear states."""
    layers = {}
    for layer in FULL_LAYERS:
        kv = _bits(rng, (2, pages, HEADS, page, DIM))
        layers[layer] = {"k": kv[0].transpose(0, 2, 1, 3), "v": kv[1].transpose(0, 2, 1, 3)}
    states = {
        layer: {"conv": _bits(rng, (slots, *CONV)), "ssm": _bits(rng, (slots, *STATE))}
        for layer in LINEAR_LAYERS
    }
    return PagedPool(pages=layers, states=states)


def sglang_like_pool(rng: np.random.Generator, tokens: int, page: int, slots: int) -> PagedPool:
    """A pool over token-major `(tokens, heads, dim)` buffers cut into pages of `page`."""
    layers = {
        layer: {n: _bits(rng, (tokens, HEADS, DIM)).reshape(-1, page, HEADS, DIM) for n in "kv"}
        for layer in FULL_LAYERS
    }
    states = {
        layer: {"conv": _bits(rng, (slots, *CONV)), "ssm": _bits(rng, (slots, *STATE))}
        for layer in LINEAR_LAYERS
    }
    return PagedPool(pages=layers, states=states)


def tokens_of(pool: PagedPool, layer: int, name: str, block_ids: list[int], n: int) -> np.ndarray:
    """The first `n` tokens of a request in `pool` (token-major copy)."""
    pages = pool.pages[layer][name][np.asarray(block_ids)]
    return pages.reshape(-1, *pages.shape[2:])[:n]


async def _ship(
    src: PagedPool,
    dst: PagedPool,
    src_blocks: list[int],
    dst_blocks: list[int],
    src_slot: int,
    dst_slot: int,
    num_tokens: int,
    pieces: list[int],
) -> PagePlacer:
    """Send the request in prefill `pieces` (page counts) as an engine would, layer by
    layer, states after the last piece, meta last; place everything at the decode side."""
    sender = KVSender(SenderConfig(connections=2, chunk_bytes=4096))
    receiver = KVReceiver()
    await sender.start()
    try:
        transfer = await receiver.fetch("127.0.0.1", sender.bootstrap_port, 42, timeout_s=30)
        stream = PageStream(sender.open(42))
        first = 0
        for count in pieces:
            for layer in sorted((*FULL_LAYERS, *LINEAR_LAYERS)):
                if layer in FULL_LAYERS:
                    stream.send_pages(src, layer, src_blocks[first : first + count], first)
            first += count
        for layer in LINEAR_LAYERS:
            stream.send_state(src, layer, src_slot)
        stream.send_meta({"num_tokens": num_tokens, "first_token": 11})
        stream.finish()
        placer = PagePlacer(
            dst,
            {layer: dst_blocks for layer in FULL_LAYERS},
            {layer: dst_slot + layer % 2 for layer in LINEAR_LAYERS},
        )
        async for item in transfer:
            placer.place(item)
        result = await transfer.complete()
        assert decode_meta(result.aux["meta"]) == {"num_tokens": num_tokens, "first_token": 11}
        placer.check_complete(num_tokens)
        await stream.sink.wait()  # type: ignore[attr-defined]
        return placer
    finally:
        await receiver.close()
        await sender.close()


@pytest.mark.parametrize(
    ("src_page", "dst_page", "num_tokens", "pieces"),
    [(4, 4, 29, [3, 5]), (4, 8, 30, [8]), (8, 2, 37, [2, 1, 2])],
)
async def test_pages_and_states_round_trip_bit_exact(
    src_page: int, dst_page: int, num_tokens: int, pieces: list[int]
) -> None:
    """Every token of every full layer and every state component arrives bit-exact in the
    decode pool's own blocks and slot, across layouts and page sizes; nothing else moves."""
    rng = np.random.default_rng(src_page * 100 + dst_page)
    src = vllm_like_pool(rng, pages=16, page=src_page, slots=4)
    dst = sglang_like_pool(rng, tokens=256, page=dst_page, slots=5)
    src_blocks = [int(b) for b in rng.permutation(16)[: -(-num_tokens // src_page)]]
    dst_blocks = [int(b) for b in rng.permutation(256 // dst_page)[: -(-num_tokens // dst_page)]]
    untouched = {n: dst.pages[3][n].copy() for n in "kv"}
    untouched_slot = dst.states[0]["conv"][1].copy()  # layer 0 goes to slot 3, 1 to 4
    await _ship(src, dst, src_blocks, dst_blocks, 2, 3, num_tokens, pieces)
    for layer in FULL_LAYERS:
        for name in "kv":
            want = tokens_of(src, layer, name, src_blocks, num_tokens)
            got = tokens_of(dst, layer, name, dst_blocks, num_tokens)
            assert got.tobytes() == want.tobytes(), (layer, name)
    for layer in LINEAR_LAYERS:
        for name in ("conv", "ssm"):
            got = dst.states[layer][name][3 + layer % 2]
            assert got.tobytes() == src.states[layer][name][2].tobytes()
    others = np.setdiff1d(np.arange(256 // dst_page), dst_blocks)
    for name in "kv":
        assert np.array_equal(dst.pages[3][name][others], untouched[name][others])
    assert np.array_equal(dst.states[0]["conv"][1], untouched_slot)


async def test_missing_layer_is_reported_incomplete() -> None:
    """A transfer that ended without one full layer's pages fails `check_complete`."""
    rng = np.random.default_rng(1)
    src = vllm_like_pool(rng, pages=8, page=4, slots=2)
    dst = vllm_like_pool(rng, pages=8, page=4, slots=2)
    placer = PagePlacer(dst, {3: [5, 6], 7: [5, 6]}, dict.fromkeys(LINEAR_LAYERS, 0))
    arrays = LayerArrays(src.gather(3, [0, 1]).arrays(), (0, 2))
    placer.place(LayerItem(wire_layer(3, 0), Kind.FULL_KV, arrays))
    for layer in LINEAR_LAYERS:
        placer.place(
            LayerItem(
                layer, Kind.LINEAR_STATE, LayerArrays(src.read_state(layer, 1).arrays(), None)
            )
        )
    assert placer.tokens(3) == 8
    with pytest.raises(PageError, match="layer 7: 0 tokens arrived, 8 expected"):
        placer.check_complete(8)


def test_mismatched_shapes_and_gaps_are_refused() -> None:
    """Pages of another head count, another dtype, or after a gap raise PageError naming
    the layer; nothing is written."""
    rng = np.random.default_rng(2)
    dst = vllm_like_pool(rng, pages=8, page=4, slots=2)
    before = dst.pages[3]["k"].copy()
    placer = PagePlacer(dst, {3: [1, 2, 3]}, {})
    wrong_heads = {n: _bits(rng, (1, 4, HEADS + 1, DIM)) for n in "kv"}
    with pytest.raises(PageError, match="layer 3 'k': token shape"):
        placer.place(LayerItem(3, Kind.FULL_KV, LayerArrays(wrong_heads, (0, 1))))
    wrong_dtype = {n: np.zeros((1, 4, HEADS, DIM), np.float32) for n in "kv"}
    with pytest.raises(PageError, match="dtype float32"):
        placer.place(LayerItem(3, Kind.FULL_KV, LayerArrays(wrong_dtype, (0, 1))))
    gap = {n: _bits(rng, (1, 4, HEADS, DIM)) for n in "kv"}
    with pytest.raises(PageError, match="token 8 arrived before"):
        placer.place(LayerItem(3, Kind.FULL_KV, LayerArrays(gap, (2, 3))))
    with pytest.raises(PageError, match="layer 0 is not a paged"):
        dst.scatter(0, gap, 0, [1])
    half = {"k": gap["k"], "v": wrong_dtype["v"]}
    with pytest.raises(PageError, match="layer 3 'v': dtype float32"):
        placer.place(LayerItem(3, Kind.FULL_KV, LayerArrays(half, (0, 1))))
    assert np.array_equal(dst.pages[3]["k"], before)


def test_pool_description_is_validated() -> None:
    """Components of one layer must agree on their page count, and pages on one size."""
    with pytest.raises(ValueError, match="disagree on their count"):
        PagedPool(pages={0: {"k": np.zeros((4, 2, 1)), "v": np.zeros((5, 2, 1))}})
    with pytest.raises(ValueError, match="one page size"):
        PagedPool(pages={0: {"k": np.zeros((4, 2, 1))}, 1: {"k": np.zeros((4, 3, 1))}})
    assert PagedPool(pages={}).page_size == 0


def test_local_prefix_hit_is_not_overwritten() -> None:
    """With `skip_tokens`, pages covering a prefix the decode already holds leave those
    tokens untouched and write only the rest; the layer counts as complete."""
    rng = np.random.default_rng(3)
    src = vllm_like_pool(rng, pages=8, page=4, slots=1)
    dst = sglang_like_pool(rng, tokens=32, page=4, slots=1)
    held = {n: dst.pages[3][n][2].copy() for n in "kv"}  # the decode's cached first page
    placer = PagePlacer(dst, {3: [2, 5]}, {}, skip_tokens=4)
    placer.place(LayerItem(3, Kind.FULL_KV, LayerArrays(src.gather(3, [6, 1]).arrays(), (0, 2))))
    assert placer.tokens(3) == 8 and placer.tokens(7) == 4
    for n in "kv":
        assert np.array_equal(dst.pages[3][n][2], held[n])
        assert np.array_equal(dst.pages[3][n][5], src.pages[3][n][1])

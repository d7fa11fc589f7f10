#!/usr/bin/env python
"""The KV data path's device check: two page pools on one device, laid out as vLLM's GPU
backends (NHD and HND, moved as byte pages) and as SGLang lays them (token byte rows), a
synthetic layer-by-layer forward pass on that device writing each layer's KV (or linear
state), and the layer-wise transfer of a request's pages and states through the real
transport on loopback, paced, placed into the decode pool; against the same transfer sent
after the forward (send-after).

It needs only torch (CUDA or CPU) and this package (numpy, orjson, xxhash), no vLLM or
SGLang. Reported per layout and mode, as JSON (`--json`) and a table:
- `bit_exact`: every byte of every moved block and state equals the prefill's;
- the forward's time without sends, with them, and the slowdown the copies cause;
- per-layer sent-to-placed latency (hook called at the prefill -> pages placed and fenced
  at the decode), median and max;
- the share of the request's bytes placed at the decode before the forward ended.

    python scripts/kv_device_check.py --device cuda --json kv_check.json
    python scripts/kv_device_check.py --device cpu --tokens 256 --json /tmp/kv.json

Exit status 0 only if every transfer was bit-exact.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from prfaas.engines.kv_pages import PagePlacer, PageStream, SendQueue, model_layer
from prfaas.engines.kv_pages.torch_pool import TorchPagePool
from prfaas.engines.transport import KVReceiver, KVSender, SenderConfig

FULL_EVERY = 4
"""Every 4th layer is full attention (Qwen3-Next's ratio); the others hold linear states."""
LAYOUTS = ("vllm-nhd", "vllm-hnd", "sglang")
MODES = ("layerwise", "send_after")


@dataclass(frozen=True)
class Shape:
    """The synthetic model and request."""

    layers: int
    tokens: int
    page: int
    heads: int
    dim: int
    matmuls: int
    """Matrix products per layer: the forward's compute between two layers' KV writes."""

    @property
    def blocks(self) -> int:
        return -(-self.tokens // self.page)

    @property
    def hidden(self) -> int:
        return self.heads * self.dim


@dataclass
class Run:
    """One transfer's measurements."""

    layout: str
    mode: str
    bit_exact: bool
    forward_ms: float
    transfer_ms: float
    layer_latency_ms: list[float] = field(default_factory=list)
    share_before_forward_end: float = 0.0
    nbytes: int = 0
    budget_peak_bytes: int = 0
    budget_waits: int = 0


def page_views(layout: str, shape: Shape, device: torch.device, seed: int) -> dict[str, Any]:
    """One full-attention layer's cache as its engine lays it out, and the pool's view."""
    gen = torch.Generator(device=device).manual_seed(seed)
    n = 2 * shape.blocks + 1  # room for the request at other block ids on each side
    if layout == "sglang":
        k, v = (
            torch.randn(n * shape.page, shape.heads, shape.dim, generator=gen, device=device).to(
                torch.bfloat16
            )
            for _ in "kv"
        )
        return {"k": _rows(k, n, shape.page), "v": _rows(v, n, shape.page)}
    dims = (
        (n, shape.page, shape.heads, 2 * shape.dim)
        if layout == "vllm-nhd"
        else (n, shape.heads, shape.page, 2 * shape.dim)
    )
    raw = torch.randn(*dims, generator=gen, device=device).to(torch.bfloat16)
    return {"kv": _rows(raw, n, shape.page)}


def _rows(cache: torch.Tensor, blocks: int, page: int) -> torch.Tensor:
    """A cache's bytes as `(blocks, page, bytes per row)` (no copy)."""
    return cache.view(torch.uint8).view(blocks, page, -1)


def make_pool(
    layout: str, shape: Shape, device: torch.device, seed: int, budget: int
) -> TorchPagePool:
    pages = {
        layer: page_views(layout, shape, device, seed * 1000 + layer)
        for layer in range(shape.layers)
        if layer % FULL_EVERY == FULL_EVERY - 1
    }
    states = {
        layer: {
            name: torch.zeros(4, *dims, dtype=torch.bfloat16, device=device)
            for name, dims in _state_shapes(shape).items()
        }
        for layer in range(shape.layers)
        if layer % FULL_EVERY != FULL_EVERY - 1
    }
    return TorchPagePool(pages, states, send_budget_bytes=budget)


def _state_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    """GDN-like states scaled to the model's width (the defaults at hidden 1024)."""
    scale = max(1, shape.hidden // 1024)
    return {"conv": (3, 2 * shape.hidden), "ssm": (shape.heads, shape.dim, shape.dim * scale)}


class Forward:
    """A synthetic prefill: per layer, `matmuls` products on the forward stream, then the
    layer's KV written into the request's blocks (or its state into the slot), then the
    hook an engine adapter would call."""

    def __init__(self, shape: Shape, device: torch.device, seed: int) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        self.shape, self.device = shape, device
        self.x = torch.randn(shape.tokens, shape.hidden, generator=gen, device=device)
        self.w = torch.randn(shape.hidden, shape.hidden, generator=gen, device=device) / (
            shape.hidden**0.5
        )

    def run(self, pool: TorchPagePool, block_ids: list[int], slot: int,
            hook: Callable[[int], None] | None) -> float:  # fmt: skip
        """Run every layer; returns the forward's wall time in seconds (until the device
        finished it)."""
        began = time.perf_counter()
        x = self.x
        ids = torch.tensor(block_ids, device=self.device)
        for layer in range(self.shape.layers):
            for _ in range(self.shape.matmuls):
                x = torch.tanh(x @ self.w)
            if layer in pool.pages:
                for view in pool.pages[layer].values():
                    rows = view.shape[2]
                    kv = _bits(x, self.shape.blocks * self.shape.page * rows, layer)
                    view.index_copy_(0, ids, kv.view(len(block_ids), self.shape.page, rows))
            else:
                for view in pool.states[layer].values():
                    view[slot].copy_(_bits(x, view[slot].numel() * 2, layer).view(view.dtype)
                                     .view(view[slot].shape))  # fmt: skip
            if hook is not None:
                hook(layer)
        _sync(self.device)
        return time.perf_counter() - began


def _bits(x: torch.Tensor, nbytes: int, layer: int) -> torch.Tensor:
    """`nbytes` bytes derived from the activations (so they depend on the forward)."""
    flat = (x.flatten() * (layer + 1)).to(torch.bfloat16).view(torch.uint8)
    reps = -(-nbytes // flat.numel())
    return flat.repeat(reps)[:nbytes]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


async def transfer(
    layout: str, mode: str, shape: Shape, device: torch.device, rate: float | None,
    budget: int, room: int,
) -> Run:  # fmt: skip
    """One request's prefill with its KV moved in `mode`; checked and timed."""
    src = make_pool(layout, shape, device, 1, budget)
    dst = make_pool(layout, shape, device, 2, budget)
    src_ids = list(range(shape.blocks))  # prefill's blocks, decode's at other ids
    dst_ids = [shape.blocks + 1 + i for i in reversed(range(shape.blocks))]
    forward = Forward(shape, device, 3)
    sender = KVSender(SenderConfig(connections=4, rate_bytes_per_s=rate))
    receiver = KVReceiver()
    queue = SendQueue()
    await sender.start()
    hooked: dict[int, float] = {}
    placed: dict[int, float] = {}
    placed_bytes: list[tuple[float, int]] = []
    try:
        fetch = await receiver.fetch("127.0.0.1", sender.bootstrap_port, room, timeout_s=300)
        stream = PageStream(sender.open(room), queue)

        def ship(layer: int) -> None:
            hooked[layer] = time.perf_counter()
            if layer in src.pages:
                stream.send_pages(src, layer, src_ids, 0)
            else:
                stream.send_state(src, layer, 1)

        def prefill() -> tuple[float, float]:
            seconds = forward.run(src, src_ids, 1, ship if mode == "layerwise" else None)
            ended = time.perf_counter()
            if mode == "send_after":
                for layer in range(shape.layers):
                    ship(layer)
            src.reads_done()
            stream.send_meta({"num_tokens": shape.tokens})
            stream.finish()
            return seconds, ended

        began = time.perf_counter()
        prefilled = asyncio.create_task(asyncio.to_thread(prefill))
        placer = PagePlacer(dst, dict.fromkeys(dst.pages, dst_ids), dict.fromkeys(dst.states, 2))
        async for item in fetch:
            placer.place(item)
            dst.fence().wait()
            now = time.perf_counter()
            placed[model_layer(item.layer)] = now
            placed_bytes.append((now, sum(a.nbytes for a in item.arrays.values())))
        await fetch.complete()
        forward_s, forward_end = await prefilled
        placer.check_complete(shape.tokens)
        done = time.perf_counter()
    finally:
        queue.close()
        await receiver.close()
        await sender.close()
    total = sum(n for _, n in placed_bytes)
    return Run(
        layout=layout,
        mode=mode,
        bit_exact=_same(src, dst, src_ids, dst_ids),
        forward_ms=forward_s * 1e3,
        transfer_ms=(done - began) * 1e3,
        layer_latency_ms=[(placed[x] - hooked[x]) * 1e3 for x in sorted(placed) if x in hooked],
        share_before_forward_end=sum(n for t, n in placed_bytes if t <= forward_end) / total,
        nbytes=total,
        budget_peak_bytes=src.budget.stats.peak_bytes,
        budget_waits=src.budget.stats.waits,
    )


def _same(src: TorchPagePool, dst: TorchPagePool, src_ids: list[int], dst_ids: list[int]) -> bool:
    for layer, comps in src.pages.items():
        for name, view in comps.items():
            a = view[torch.tensor(src_ids, device=view.device)].cpu()
            b = dst.pages[layer][name][torch.tensor(dst_ids, device=view.device)].cpu()
            if not torch.equal(a, b):
                return False
    for layer, comps in src.states.items():
        for name, view in comps.items():
            if not torch.equal(view[1].cpu(), dst.states[layer][name][2].cpu()):
                return False
    return True


async def alone_ms(layout: str, shape: Shape, device: torch.device) -> float:
    """The same forward, on a pool of the same layout, with no transfer (run like the
    transfers' forward, on a worker thread)."""
    pool = make_pool(layout, shape, device, 1, 1 << 20)
    forward = Forward(shape, device, 3)
    seconds = await asyncio.to_thread(forward.run, pool, list(range(shape.blocks)), 1, None)
    return seconds * 1e3


def summarise(runs: list[Run], alone: dict[str, list[float]]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for layout in LAYOUTS:
        for mode in MODES:
            mine = [r for r in runs if r.layout == layout and r.mode == mode]
            if not mine:
                continue
            latencies = [x for r in mine for x in r.layer_latency_ms]
            forward = statistics.median(r.forward_ms for r in mine)
            base = statistics.median(alone[layout])
            rows[f"{layout}/{mode}"] = {
                "bit_exact": all(r.bit_exact for r in mine),
                "forward_alone_ms": round(base, 2),
                "forward_ms": round(forward, 2),
                "forward_slowdown": round(forward / base, 3),
                "transfer_ms": round(statistics.median(r.transfer_ms for r in mine), 2),
                "layer_latency_ms_p50": round(statistics.median(latencies), 2),
                "layer_latency_ms_max": round(max(latencies), 2),
                "share_placed_before_forward_end": round(
                    statistics.median(r.share_before_forward_end for r in mine), 3
                ),
                "request_mb": round(mine[0].nbytes / 1e6, 2),
                "host_budget_peak_mb": round(max(r.budget_peak_bytes for r in mine) / 1e6, 2),
                "host_budget_waits": sum(r.budget_waits for r in mine),
            }
    return rows


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    shape = Shape(args.layers, args.tokens, args.page, args.heads, args.dim, args.matmuls)
    rate = args.rate_gbps * 1e9 / 8 if args.rate_gbps else None
    budget = args.budget_mb << 20
    await alone_ms(args.layouts[0], shape, device)  # warm-up
    runs: list[Run] = []
    alone: dict[str, list[float]] = {layout: [] for layout in args.layouts}
    room = 1
    for _ in range(args.reps):  # interleaved, so a noisy moment hits every variant alike
        for layout in args.layouts:
            alone[layout].append(await alone_ms(layout, shape, device))
            for mode in MODES:
                runs.append(await transfer(layout, mode, shape, device, rate, budget, room))
                room += 1
    results = summarise(runs, alone)
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": asdict(shape),
        "rate_gbps": args.rate_gbps,
        "host_budget_mb": args.budget_mb,
        "reps": args.reps,
        "bit_exact": all(r.bit_exact for r in runs),
        "results": results,
    }


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--matmuls", type=int, default=8)
    p.add_argument("--rate-gbps", type=float, default=25.0, help="paced link (0: unpaced)")
    p.add_argument("--budget-mb", type=int, default=256, help="host (pinned) budget")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    report = asyncio.run(main_async(args))
    print(f"{'layout/mode':24} {'exact':>5} {'fwd ms':>8} {'slow':>6} {'xfer ms':>8} "
          f"{'lat p50':>8} {'lat max':>8} {'placed<end':>10}")  # fmt: skip
    for name, row in report["results"].items():
        print(f"{name:24} {row['bit_exact']!s:>5} {row['forward_ms']:8.1f} "
              f"{row['forward_slowdown']:6.3f} {row['transfer_ms']:8.1f} "
              f"{row['layer_latency_ms_p50']:8.2f} {row['layer_latency_ms_max']:8.2f} "
              f"{row['share_placed_before_forward_end']:10.3f}")  # fmt: skip
    print(f"bit_exact={report['bit_exact']} (medians of {args.reps}; slow = forward with the "
          "transfer / forward alone)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if report["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())

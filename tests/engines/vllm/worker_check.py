"""Run in the vLLM environment (`test_vllm_worker.py` starts it): the connector's worker
halves, a prefill and a decode, over vLLM 0.32's own `create_kv_cache_views` and specs, the
real transport on loopback, in both model runners' call orders. Prints one JSON object:
per case, whether the decode's pages and states equal the prefill's byte for byte, or the
error the decode failed the request with.

    PYTHONPATH=. .venv-vllm/bin/python tests/engines/vllm/worker_check.py
"""

from __future__ import annotations

import json
import logging
import random
import socket
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from prfaas.engines.vllm.config import ConnectorConfig
from prfaas.engines.vllm.layout import GroupLayout, build_views
from prfaas.engines.vllm.metadata import PrfaasMetadata, RecvStart, SendStep
from prfaas.engines.vllm.worker_side import WorkerSide

NUM_BLOCKS = 12
LAYERS = 4  # model layers 0..3: 0 and 2 full attention, 1 and 3 gated-delta-net states
ATTN = ("model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn")
STATE = ("model.layers.1.linear_attn", "model.layers.3.linear_attn")


class Errors(logging.Handler):
    """Collects the connector's error lines (the reason a transfer failed)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


ERRORS = Errors()
logging.getLogger("prfaas").addHandler(ERRORS)


@dataclass
class Engine:
    views: dict[str, torch.Tensor]
    config: Any
    worker: WorkerSide


def attention_spec(kind: str) -> Any:
    if kind == "mla":
        return MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    dtype = torch.uint8 if kind == "fp8" else torch.bfloat16
    return FullAttentionSpec(block_size=32, num_kv_heads=4, head_size=64, dtype=dtype)


STATE_SPEC = MambaSpec(
    block_size=32, shapes=((3, 64), (4, 16, 16)), dtypes=(torch.bfloat16, torch.float32)
)


def engine(
    layout: KVCacheLayout, kind: str, kernel: int | None, tp: tuple[int, int], port: int, seed: int
) -> Engine:
    """One worker's KV memory laid out by vLLM itself, filled with random bytes, and its
    connector worker half."""
    spec = attention_spec(kind)
    page, spage = spec.page_size_bytes, STATE_SPEC.page_size_bytes
    compact = layout.is_layer_compact
    attn = KVCacheTensor(
        size=0,
        layers=list(ATTN),
        layer_stride=NUM_BLOCKS * page if compact else page,
        block_stride=page if compact else len(ATTN) * page,
    )
    states = KVCacheTensor(
        size=0,
        layers=list(STATE),
        layer_stride=NUM_BLOCKS * spage,
        block_stride=spage,
        offset=len(ATTN) * NUM_BLOCKS * page,
    )
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randint(
        -128,
        127,
        (len(ATTN) * NUM_BLOCKS * page + len(STATE) * NUM_BLOCKS * spage,),
        dtype=torch.int8,
        generator=gen,
    )
    views = dict(
        zip(
            ATTN,
            create_kv_cache_views(buf, spec, NUM_BLOCKS, layout, attn, kernel_block_size=kernel),
            strict=True,
        )
    )
    views.update(
        zip(STATE, create_kv_cache_views(buf, STATE_SPEC, NUM_BLOCKS, layout, states), strict=True)
    )
    config = SimpleNamespace(
        num_blocks=NUM_BLOCKS,
        kv_cache_groups=[
            SimpleNamespace(layer_names=list(ATTN), kv_cache_spec=spec),
            SimpleNamespace(layer_names=list(STATE), kv_cache_spec=STATE_SPEC),
        ],
    )
    pool = build_views(
        views,
        config,
        backend="TEST",
        cache_dtype="fp8" if kind == "fp8" else "auto",
        tp_size=tp[0],
        tp_rank=tp[1],
    )
    connector = ConnectorConfig(bootstrap_port=port, timeout_s=20)
    return Engine(
        views, config, WorkerSide(connector, pool, GroupLayout.from_kv_cache_config(config))
    )


def block_bytes(view: torch.Tensor, block: int, ratio: int) -> torch.Tensor:
    """Manager block `block` of a vLLM `[B * ratio, H, N, C]` view, as bytes (a copy)."""
    return view[block * ratio : (block + 1) * ratio].contiguous().view(torch.uint8).flatten()


def run_case(
    name: str, prefill: Engine, decode: Engine, *, order: str, tokens: int = 70, skip: int = 0
) -> dict[str, Any]:
    """One request: `tokens` tokens of KV and the states after them, prefill -> decode, in
    the call order of model runner `order` ("v1": loads before the forward, "v2": after)."""
    room = random.getrandbits(63)
    pages = -(-tokens // 32)
    src_ids = ([1, 4, 7, 9][:pages], [2, 5, 8, 10][:pages])
    dst_ids = ([11, 3, 6, 0][:pages], [10, 2, 9, 4][:pages])
    req = f"req-{name}"
    step = SendStep(req, room, src_ids, 0, tokens, True)
    recv = RecvStart(req, "127.0.0.1", prefill_port(prefill), room, dst_ids, tokens, skip)
    send_meta, recv_meta = PrfaasMetadata(sends=[step]), PrfaasMetadata(recvs=[recv], idle=True)
    before = len(ERRORS.lines)
    if order == "v1":
        decode.worker.start_recvs(recv_meta)  # V1: start_load_kv before the forward
    for layer in range(LAYERS):
        prefill.worker.save_layer(send_meta, layer)  # the forward: save_kv_layer per layer
    if order == "v2":
        decode.worker.start_recvs(recv_meta)  # V2: start_load_kv after the forward
    prefill.worker.end_step(send_meta)  # wait_for_save
    deadline = time.monotonic() + 30
    done: set[str] = set()
    failed: set[str] = set()
    while req not in done and time.monotonic() < deadline:
        d, f = decode.worker.transfer_results(set(), recv_meta)
        done |= d
        failed |= f
    if req not in done:
        return {"ok": False, "error": "no result within 30 s"}
    if req in failed:
        return {"ok": False, "error": " | ".join(ERRORS.lines[before:])}
    ratio = prefill.views[ATTN[0]].shape[0] // NUM_BLOCKS
    pairs = list(enumerate(zip(src_ids[0], dst_ids[0], strict=True)))
    equal = all(
        torch.equal(block_bytes(prefill.views[n], s, ratio), block_bytes(decode.views[n], d, ratio))
        for n in ATTN
        for i, (s, d) in pairs
        if i * 32 >= skip
    )
    slot_src, slot_dst = src_ids[1][(tokens - 1) // 32], dst_ids[1][(tokens - 1) // 32]
    states = all(
        torch.equal(
            block_bytes(prefill.views[n], slot_src, 1), block_bytes(decode.views[n], slot_dst, 1)
        )
        for n in STATE
    )
    untouched = all(
        not torch.equal(
            block_bytes(prefill.views[n], s, ratio), block_bytes(decode.views[n], d, ratio)
        )
        for n in ATTN
        for i, (s, d) in pairs
        if i * 32 < skip
    )
    return {
        "ok": equal and states and untouched,
        "pages_equal": equal,
        "states_equal": states,
        "skipped_untouched": untouched,
    }


def prefill_port(prefill: Engine) -> int:
    """The base port a decode is given (the prefill's rank 0's)."""
    return prefill.worker.bootstrap_port - prefill.worker.tp_rank


def free_ports(count: int) -> int:
    """The first of `count` consecutive loopback ports free now."""
    while True:
        base = random.randrange(20000, 60000)
        try:
            for port in range(base, base + count):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue


def main() -> None:
    results: dict[str, Any] = {}
    engines: list[Engine] = []

    def pair(
        layout_p: KVCacheLayout,
        layout_d: KVCacheLayout,
        kind: str,
        kernel: int | None,
        tp_p: tuple[int, int] = (1, 0),
        tp_d: tuple[int, int] = (1, 0),
    ) -> tuple[Engine, Engine]:
        base = free_ports(2)  # rank r binds base + r
        p = engine(layout_p, kind, kernel, tp_p, base, seed=base)
        d = engine(layout_d, kind, kernel, tp_d, free_ports(2), seed=base + 1)
        engines.extend((p, d))
        return p, d

    try:
        for layout in (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.BLNHC):
            for kind, kernel in (("bf16", None), ("bf16", 16), ("mla", None), ("fp8", None)):
                if kernel and not layout.is_layer_compact:
                    continue  # vLLM itself refuses to split packed blocks
                for order in ("v1", "v2"):
                    p, d = pair(layout, layout, kind, kernel)
                    results[f"{layout.name}-{kind}-k{kernel}-{order}"] = run_case(
                        f"{layout.name}{kind}{kernel}{order}", p, d, order=order
                    )
        p, d = pair(KVCacheLayout.LBHNC, KVCacheLayout.LBHNC, "bf16", None)
        results["skip-aligned"] = run_case("skipa", p, d, order="v1", skip=64)
        p, d = pair(KVCacheLayout.LBHNC, KVCacheLayout.LBHNC, "bf16", None)
        results["skip-unaligned"] = run_case("skipu", p, d, order="v1", skip=40)
        p, d = pair(KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, "bf16", None)
        results["layout-mismatch"] = run_case("mis", p, d, order="v1")
        p, d = pair(KVCacheLayout.LBNHC, KVCacheLayout.LBNHC, "bf16", None)
        d.worker.signature = type(d.worker.signature)(
            **{**d.worker.signature.__dict__, "cache_dtype": "fp8_e5m2"}
        )
        results["dtype-mismatch"] = run_case("dmis", p, d, order="v2")
        p, d = pair(KVCacheLayout.LBNHC, KVCacheLayout.LBNHC, "bf16", None, (2, 1), (2, 1))
        results["tp-rank1"] = run_case("tp1", p, d, order="v2")
        results["tp-rank1-port"] = {
            "ok": p.worker.bootstrap_port == p.worker.config.bootstrap_port + 1
        }
        p, d = pair(KVCacheLayout.LBNHC, KVCacheLayout.LBNHC, "bf16", None, (2, 0), (1, 0))
        results["tp-size-mismatch"] = run_case("tpmis", p, d, order="v2")
    finally:
        for e in engines:
            e.worker.close()
    print(json.dumps(results))


if __name__ == "__main__":
    main()

"""The engine-neutral page/state mover: a paged KV pool's pages and state slots to transport
messages and back, shared by every engine's hand-off (reference, vLLM, SGLang).

An engine adapter describes its memory as views, and this package does the rest: numpy
views of host memory (`PagedPool`, torch-free), or torch views on any device
(`torch_pool.TorchPagePool`, the device-aware mover: side-stream copies into a bounded
pinned budget, placement on its own stream, completion fences; import it from its module,
it needs torch):

    pool = PagedPool(pages={3: {"k": k3, "v": v3}}, states={0: {"conv": c0, "ssm": s0}})
    stream = PageStream(send_handle)                 # prefill, one per request
    # (device pools: PageStream(send_handle, queue) with one SendQueue per worker)
    stream.send_pages(pool, 3, block_ids=[7, 2], first_page=0)   # right after layer 3
    stream.send_state(pool, 0, slot=5)               # once the state is final
    stream.send_meta({"first_token": 17, "num_tokens": 20}); stream.finish()

    placer = PagePlacer(pool, {3: [4, 9]}, {0: 1})   # decode: its own block ids and slots
    async for item in transfer:                      # prfaas.engines.transport.Transfer
        placer.place(item)
    placer.check_complete(num_tokens=20)
    pool.fence().ready()                             # device pools: pages in place yet?

The wire conventions (logical page ranges, part numbering, meta) are in `wire.py`.
"""

from __future__ import annotations

from prfaas.engines.kv_pages.errors import PageError
from prfaas.engines.kv_pages.host_copy import Fence, HostCopy
from prfaas.engines.kv_pages.placer import PagePlacer
from prfaas.engines.kv_pages.pool import PagedPool, PagePool
from prfaas.engines.kv_pages.send_queue import SendQueue
from prfaas.engines.kv_pages.stream import LayerSink, PageStream
from prfaas.engines.kv_pages.wire import (
    LAYER_PART_STRIDE,
    META,
    decode_meta,
    encode_meta,
    model_layer,
    wire_layer,
)

__all__ = [
    "LAYER_PART_STRIDE",
    "META",
    "Fence",
    "HostCopy",
    "LayerSink",
    "PageError",
    "PagePlacer",
    "PagePool",
    "PageStream",
    "PagedPool",
    "SendQueue",
    "decode_meta",
    "encode_meta",
    "model_layer",
    "wire_layer",
]

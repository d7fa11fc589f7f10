"""Helpers for the SGLang plugin tests (run in the SGLang test environment, `make test`):
SGLang's runtime context for one process holding both PD roles, `KVArgs` over CPU tensors
shaped like a hybrid pool, and the real manager/sender/receiver classes driven the way
SGLang's scheduler drives them."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend
from sglang.srt.runtime_context import get_context, get_parallel
from sglang.srt.server_args import prepare_server_args

HOST = "127.0.0.1"
PAGE = 4
HEADS, DIM = 2, 8  # per token: K and V of (HEADS, DIM) bfloat16 each
FULL_LAYERS = (3, 7)
MAMBA_LAYERS = (0, 1, 2, 4, 5, 6)
CONV, SSM = (6, 3), (2, 4, 4)
AUX_SHAPES = ((16,), (8,))  # int32 output ids, float32 logprobs: two metadata buffers
# A scheduler process learns its ranks from its process groups; this process has none.
RANK_ZERO = {
    "attn_tp_rank": 0,
    "attn_cp_rank": 0,
    "attn_dp_rank": 0,
    "attn_dcp_rank": 0,
    "pp_group": None,
}


def server_args(bootstrap_port: int, *extra: str) -> Any:
    """Parse a prefill server's arguments and publish them as this process's context."""
    args = prepare_server_args(
        [
            "--model-path", "dummy", "--host", HOST, "--device", "cpu",
            "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "prfaas",
            "--disaggregation-bootstrap-port", str(bootstrap_port),
            "--disable-prefill-cuda-graph", *extra,
        ]
    )  # fmt: skip
    args.resolve_once()
    get_context().set_server_args(args)
    get_parallel().override_permanently(**RANK_ZERO)
    return args


@dataclass
class HybridPool:
    """One engine's KV memory: full-attention K/V token buffers, Mamba state slots, and
    SGLang's metadata buffers, as CPU tensors the `KVArgs` point into."""

    tokens: int
    slots: int
    aux_slots: int
    seed: int
    k: dict[int, torch.Tensor] = field(init=False)
    v: dict[int, torch.Tensor] = field(init=False)
    conv: dict[int, torch.Tensor] = field(init=False)
    ssm: dict[int, torch.Tensor] = field(init=False)
    aux: list[torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(self.seed)

        def bits(*shape: int) -> torch.Tensor:
            return (
                torch.randint(0, 1 << 16, shape, generator=g, dtype=torch.int32)
                .to(torch.uint16)
                .view(torch.bfloat16)
            )

        self.k = {layer: bits(self.tokens + PAGE, HEADS, DIM) for layer in FULL_LAYERS}
        self.v = {layer: bits(self.tokens + PAGE, HEADS, DIM) for layer in FULL_LAYERS}
        self.conv = {layer: bits(self.slots + 1, *CONV) for layer in MAMBA_LAYERS}
        self.ssm = {layer: torch.randn(self.slots + 1, *SSM, generator=g) for layer in MAMBA_LAYERS}
        self.aux = [
            torch.randint(
                0, 1000, (self.aux_slots, *AUX_SHAPES[0]), generator=g, dtype=torch.int32
            ),
            torch.randn(self.aux_slots, *AUX_SHAPES[1], generator=g),
        ]

    def kv_args(self) -> Any:
        """SGLang's `KVArgs` for this pool, filled like `PrefillBootstrapQueue._init_kv_manager`
        fills it for a `HybridLinearKVPool` (full layers' K then V, Mamba conv then ssm)."""
        from sglang.srt.disaggregation.utils import get_kv_class

        args = get_kv_class(TransferBackend.PRFAAS, KVClassType.KVARGS)()
        kv = [self.k[layer] for layer in FULL_LAYERS] + [self.v[layer] for layer in FULL_LAYERS]
        args.kv_data_ptrs = [t.data_ptr() for t in kv]
        args.kv_data_lens = [t.nbytes for t in kv]
        args.kv_item_lens = [t[0].nbytes * PAGE for t in kv]
        args.kv_layer_ids = list(FULL_LAYERS) * 2
        states = [self.conv[layer] for layer in MAMBA_LAYERS] + [
            self.ssm[layer] for layer in MAMBA_LAYERS
        ]
        from sglang.srt.disaggregation.base.conn import StateType

        args.state_types = [StateType.MAMBA]
        args.state_data_ptrs = [[t.data_ptr() for t in states]]
        args.state_data_lens = [[t.nbytes for t in states]]
        args.state_item_lens = [[t[0].nbytes for t in states]]
        args.state_layer_ids = [list(MAMBA_LAYERS) * 2]
        args.state_dim_per_tensor = [[]]
        args.state_slice_outer_counts = [[]]
        args.state_conv_shard_groups = [[]]
        args.aux_data_ptrs = [t.data_ptr() for t in self.aux]
        args.aux_data_lens = [t.nbytes for t in self.aux]
        args.aux_item_lens = [t[0].nbytes for t in self.aux]
        args.engine_rank = 0
        args.pp_rank = 0
        args.system_dp_rank = 0
        args.rust_http_port = None
        args.kv_cache_dtype_str = "bfloat16"
        args.kv_layout = None
        args.prefill_start_layer = 0
        args.prefill_end_layer = None
        args.num_draft_entries = 0
        args.kv_head_num = HEADS
        args.total_kv_head_num = HEADS
        args.page_size = PAGE
        args.ib_device = None
        args.gpu_id = 0
        args.is_hybrid_mla_backend = False
        args.swa_kv_cache_layout = None
        args.mla_compression_ratios = None
        return args

    def request_tokens(self, layer: int, pages: list[int], count: int) -> bytes:
        """The first `count` tokens' K and V bytes of a request stored in `pages`."""
        rows = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])[:count]
        return (
            self.k[layer][rows].view(torch.uint8).numpy().tobytes()
            + self.v[layer][rows].view(torch.uint8).numpy().tobytes()
        )

    def slot_bytes(self, layer: int, slot: int) -> bytes:
        return (
            self.conv[layer][slot].view(torch.uint8).numpy().tobytes()
            + self.ssm[layer][slot].view(torch.uint8).numpy().tobytes()
        )

    def aux_bytes(self, index: int) -> bytes:
        return b"".join(t[index].view(torch.uint8).numpy().tobytes() for t in self.aux)


def manager(pool: HybridPool, mode: DisaggregationMode, server: Any) -> Any:
    """A real `PrfaasKVManager` as SGLang's bootstrap/prealloc queue builds it."""
    from sglang.srt.disaggregation.utils import get_kv_class

    cls = get_kv_class(TransferBackend.PRFAAS, KVClassType.MANAGER)
    return cls(pool.kv_args(), mode, server, False)


def wait_for(polls: Callable[[], Any], want: Any, timeout_s: float = 30.0) -> Any:
    """Poll until `polls()` returns `want` (or a terminal state); returns the last value."""
    deadline = time.monotonic() + timeout_s
    value = polls()
    while value != want and time.monotonic() < deadline:
        if isinstance(value, tuple) and KVPoll.Failed in value:
            return value
        if value == KVPoll.Failed:
            return value
        time.sleep(0.01)
        value = polls()
    return value


def page_ids(start: int, count: int, rng: np.random.Generator, total: int) -> np.ndarray:
    """`count` distinct page ids (int32, as SGLang passes them), scrambled."""
    return rng.permutation(np.arange(start, total))[:count].astype(np.int32)


@dataclass
class Pair:
    """A prefill and a decode engine's pools and managers, and the bootstrap address."""

    address: str
    prefill: HybridPool
    decode: HybridPool
    prefill_mgr: Any
    decode_mgr: Any

    def sender(self, room: int) -> Any:
        """A real `PrfaasKVSender`, as the prefill's bootstrap queue creates it."""
        from sglang.srt.disaggregation.utils import get_kv_class

        cls = get_kv_class(TransferBackend.PRFAAS, KVClassType.SENDER)
        return cls(mgr=self.prefill_mgr, bootstrap_addr=self.address, bootstrap_room=room)

    def receiver(self, room: int) -> Any:
        """A real `PrfaasKVReceiver`, bootstrapped as the decode's prealloc queue does."""
        from sglang.srt.disaggregation.utils import get_kv_class

        assert self.decode_mgr.try_ensure_parallel_info(self.address)
        cls = get_kv_class(TransferBackend.PRFAAS, KVClassType.RECEIVER)
        receiver = cls(mgr=self.decode_mgr, bootstrap_addr=self.address, bootstrap_room=room)
        receiver.init(prefill_dp_rank=0)
        return receiver

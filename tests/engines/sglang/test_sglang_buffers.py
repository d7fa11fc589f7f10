"""`buffers.py`, the adapter of SGLang's `KVArgs` memory to the device-aware page mover:
every view must alias the memory SGLang registered (a copy is refused at build time, since
the decode's writes would never reach the engine), and a decode reports a room complete
only once the pool's fence after its last placement is ready."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import sglang_helpers as sh
import torch
from sglang.srt.disaggregation.base.conn import KVPoll

from prfaas.engines.kv_pages import Fence
from prfaas.engines.kv_pages.torch_pool import TorchPagePool
from prfaas.engines.sglang import buffers
from prfaas.engines.sglang.buffers import SGLangPool, check_alias

CPU = torch.device("cpu")


def test_views_alias_the_registered_memory() -> None:
    memory = sh.HybridPool(tokens=32, slots=2, aux_slots=2, seed=3)
    pool = SGLangPool(memory.kv_args(), CPU, is_mla=False)
    assert isinstance(pool, TorchPagePool)
    for layer in sh.FULL_LAYERS:
        assert pool.pages[layer]["k"].data_ptr() == memory.k[layer].data_ptr()
        assert pool.pages[layer]["v"].data_ptr() == memory.v[layer].data_ptr()
    for layer in sh.MAMBA_LAYERS:
        assert pool.states[layer]["0.0"].data_ptr() == memory.conv[layer].data_ptr()
        assert pool.states[layer]["0.1"].data_ptr() == memory.ssm[layer].data_ptr()


def test_a_view_that_is_a_copy_is_refused_at_build_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """What torch does with a pointer it cannot share (e.g. on another GPU): a copy."""
    real = buffers.raw_bytes
    monkeypatch.setattr(buffers, "raw_bytes", lambda p, n, d: real(p, n, d).clone())
    memory = sh.HybridPool(tokens=32, slots=2, aux_slots=2, seed=3)
    with pytest.raises(ValueError, match="does not alias the memory SGLang registered") as info:
        SGLangPool(memory.kv_args(), CPU, is_mla=False)
    assert "not at the registered" in str(info.value)


def test_check_alias_names_the_start_the_extent_and_the_device() -> None:
    memory = torch.zeros(64, dtype=torch.uint8)
    ptr = memory.data_ptr()
    check_alias(memory.view(4, 16), ptr, 64, CPU, "whole")
    with pytest.raises(ValueError, match=r"starts at .* not at the registered"):
        check_alias(memory[8:], ptr, 64, CPU, "offset")
    with pytest.raises(ValueError, match="spans 64 bytes of the 32 registered"):
        check_alias(memory, ptr, 32, CPU, "too long")
    with pytest.raises(ValueError, match="it is on meta"):
        check_alias(memory.to("meta"), ptr, 64, CPU, "elsewhere")


class HeldEvent:
    """An event that completes when the test says so (a copy still running on a GPU)."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.done.wait(30)


def test_the_decode_reports_success_only_once_its_placements_landed(
    pair: sh.Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    event = HeldEvent()
    fences: list[Fence] = []

    def fence() -> Fence:
        fences.append(Fence(event))
        return fences[-1]

    monkeypatch.setattr(pair.decode_mgr.pool, "fence", fence)
    src, dst = np.arange(4, dtype=np.int32), np.arange(8, 12, dtype=np.int32)
    sender, receiver = pair.sender(51), pair.receiver(51)
    receiver.send_metadata(dst, 2, [np.array([3], dtype=np.int32)], decode_prefix_len=0)
    assert sh.wait_for(sender.poll, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    sender.init(4, aux_index=1)
    sender.send(src, [np.array([1], dtype=np.int32)], 16)
    deadline = time.monotonic() + 30
    while not fences and time.monotonic() < deadline:  # everything placed, the fence taken
        time.sleep(0.01)
    assert fences
    time.sleep(0.2)
    assert receiver.poll() == KVPoll.WaitingForInput  # its copies have not landed yet
    event.done.set()
    assert sh.wait_for(receiver.poll, KVPoll.Success) == KVPoll.Success
    for layer in sh.FULL_LAYERS:
        got = pair.decode.request_tokens(layer, list(dst), 16)
        assert got == pair.prefill.request_tokens(layer, list(src), 16)


def _unused(_: Any) -> None: ...

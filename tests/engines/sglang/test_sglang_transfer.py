"""The prfaas backend's KV transfer between a prefill- and a decode-mode manager on
loopback, driven through SGLang's real sender/receiver classes the way its scheduler
drives them: pages of full-attention layers, Mamba state slots and the metadata buffers
arrive bit-exact at the decode's own page ids, slot and aux index, and both sides reach
Success; aborts and timeouts end in Failed on both sides with the reason raised."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sglang_helpers as sh
import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import KVTransferError
from sglang.srt.disaggregation.utils import DisaggregationMode

from prfaas.common.ports import free_port
from prfaas.engines.transport import ProcessSender

PAGES = 32  # pages of each pool (128 tokens)


def _bootstrapped(pair: sh.Pair, room: int, dst: np.ndarray, prefix: int = 0) -> tuple[Any, Any]:
    """Sender and receiver of `room` once the decode allocated `dst` (slot 3, aux 2)."""
    sender = pair.sender(room)
    receiver = pair.receiver(room)
    assert receiver.poll() == KVPoll.WaitingForInput
    receiver.send_metadata(dst, 2, [np.array([3], dtype=np.int32)], decode_prefix_len=prefix)
    assert sh.wait_for(sender.poll, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    return sender, receiver


def _failure(side: Any) -> str:
    with pytest.raises(KVTransferError) as info:
        side.failure_exception()
    return str(info.value)


@pytest.mark.parametrize(
    ("tokens", "chunk_pages", "prefix_pages"), [(23, 2, 0), (61, 4, 3), (16, 1, 0)]
)
def test_chunks_arrive_bit_exact_and_both_sides_succeed(
    pair: sh.Pair, tokens: int, chunk_pages: int, prefix_pages: int
) -> None:
    """Every token of both full layers (K and V), every Mamba state component and both
    metadata buffers arrive bit-exact after several chunks; nothing else changes."""
    _round_trip(pair, tokens, chunk_pages, prefix_pages)


def test_a_sender_process_prefill_arrives_bit_exact(make_pair: Any) -> None:
    """`PRFAAS_SGLANG_SENDER_PROCESS=1`: the prefill's KV sender runs in a process of its
    own, and the same transfer arrives the same."""
    pair = make_pair(SENDER_PROCESS="1")
    assert type(pair.prefill_mgr.prefill.sender).__name__ == "ProcessSender"
    _round_trip(pair, 61, 4, 3)


def test_a_killed_sender_process_fails_its_rooms_and_is_replaced(make_pair: Any) -> None:
    """The sender process killed: a room bootstrapped before the next one serves ends
    Failed on both sides, the decode's told by the next process (not left to its
    timeout), and once it serves the same transfer arrives as before."""
    pair = make_pair(SENDER_PROCESS="1")
    process_sender = pair.prefill_mgr.prefill.sender
    assert isinstance(process_sender, ProcessSender) and process_sender._child is not None
    first = process_sender._child.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    assert sh.wait_for(process_sender.is_alive, False) is False
    sender, receiver = pair.sender(31), pair.receiver(31)  # opened while no process runs
    receiver.send_metadata(np.arange(4, dtype=np.int32), 2, [np.array([3], dtype=np.int32)])
    assert sh.wait_for(sender.poll, KVPoll.Failed) == KVPoll.Failed
    assert sh.wait_for(receiver.poll, KVPoll.Failed, timeout_s=20) == KVPoll.Failed
    for side in (sender, receiver):
        assert "sender process exited" in _failure(side)
    assert sh.wait_for(process_sender.is_alive, True) is True
    assert process_sender.restarts == 1 and process_sender._child.pid != first
    _round_trip(pair, 61, 4, 3)


def _round_trip(pair: sh.Pair, tokens: int, chunk_pages: int, prefix_pages: int) -> None:
    rng = np.random.default_rng(tokens)
    prefix = prefix_pages * sh.PAGE
    count = -(-(tokens - prefix) // sh.PAGE)
    src, dst = sh.page_ids(0, count, rng, PAGES), sh.page_ids(0, count, rng, PAGES)
    before = {layer: pair.decode.k[layer].clone() for layer in sh.FULL_LAYERS}
    sender, receiver = _bootstrapped(pair, 11, dst, prefix)
    sender.init(count, aux_index=1)
    starts = list(range(0, count, chunk_pages))
    assert len(starts) >= 2 or count <= chunk_pages
    for first in starts:
        last = first + chunk_pages >= count
        chunk = src[first : first + chunk_pages]
        sent = (tokens - prefix - first * sh.PAGE) if last else len(chunk) * sh.PAGE
        sender.send(chunk, [np.array([1], dtype=np.int32)] if last else None, sent)
    assert sh.wait_for(receiver.poll, KVPoll.Success) == KVPoll.Success
    assert sh.wait_for(sender.poll, KVPoll.Success) == KVPoll.Success
    for layer in sh.FULL_LAYERS:
        got = pair.decode.request_tokens(layer, list(dst), tokens - prefix)
        assert got == pair.prefill.request_tokens(layer, list(src), tokens - prefix), layer
        others = _rows(np.setdiff1d(np.arange(PAGES), dst))  # whole pages move, never others
        assert _bits(pair.decode.k[layer][others]) == _bits(before[layer][others])
    for layer in sh.MAMBA_LAYERS:
        assert pair.decode.slot_bytes(layer, 3) == pair.prefill.slot_bytes(layer, 1), layer
        assert pair.decode.slot_bytes(layer, 2) != pair.prefill.slot_bytes(layer, 1)
    assert pair.decode.aux_bytes(2) == pair.prefill.aux_bytes(1)
    sender.clear()
    receiver.clear()


def _rows(pages: np.ndarray) -> np.ndarray:
    return np.concatenate([np.arange(p * sh.PAGE, (p + 1) * sh.PAGE) for p in pages])


def _bits(tensor: Any) -> bytes:
    return bytes(tensor.contiguous().view(torch.uint8).numpy())


def test_decode_abort_fails_both_sides(pair: sh.Pair) -> None:
    """A decode-side abort mid-transfer: the decode's room is Failed at once and the
    prefill's follows (SGLang's abort notification and our transport's cancel)."""
    src, dst = np.arange(4, dtype=np.int32), np.arange(8, 12, dtype=np.int32)
    sender, receiver = _bootstrapped(pair, 21, dst)
    sender.init(4, aux_index=0)
    sender.send(src[:2], None, 8)
    receiver.abort()
    assert receiver.poll() == KVPoll.Failed
    assert sh.wait_for(sender.poll, KVPoll.Failed) == KVPoll.Failed
    assert "Aborted by AbortReq" in _failure(receiver)
    # SGLang's ZMQ abort notice or our transport's cancel, whichever reaches it first
    assert re.search(r"(?i)aborted (by|on the) decode", _failure(sender))


def test_prefill_abort_fails_both_sides(pair: sh.Pair) -> None:
    """A prefill-side abort (SGLang's AbortReq) mid-transfer reaches the decode as a
    failed transfer naming the abort."""
    src, dst = np.arange(4, dtype=np.int32), np.arange(8, 12, dtype=np.int32)
    sender, receiver = _bootstrapped(pair, 22, dst)
    sender.init(4, aux_index=0)
    sender.send(src[:2], None, 8)
    sender.abort()
    assert sender.poll() == KVPoll.Failed
    assert sh.wait_for(receiver.poll, KVPoll.Failed) == KVPoll.Failed
    assert "aborted on the prefill side" in _failure(receiver)
    assert "Aborted" in _failure(sender)


def test_timeout_fails_both_sides(make_pair: Any) -> None:
    """A prefill that stops sending after the first chunk: the transfer times out after
    PRFAAS_SGLANG_TRANSFER_TIMEOUT_S and both sides end Failed with the timeout named (the
    prefill's by its own timer or by the decode's report, whichever comes first: both run
    the same timeout, started a round trip apart; so too the decode's, its own timer's or
    the prefill's report, whichever reaches it first)."""
    pair = make_pair(TRANSFER_TIMEOUT_S="1.5")
    src, dst = np.arange(4, dtype=np.int32), np.arange(8, 12, dtype=np.int32)
    sender, receiver = _bootstrapped(pair, 23, dst)
    sender.init(4, aux_index=0)
    sender.send(src[:2], None, 8)
    assert sh.wait_for(receiver.poll, KVPoll.Failed, timeout_s=15) == KVPoll.Failed
    assert sh.wait_for(sender.poll, KVPoll.Failed, timeout_s=15) == KVPoll.Failed
    timeout = r"not delivered within transfer_timeout_s=1\.5|timed out after 1\.5 s"
    for side in (receiver, sender):
        reason = _failure(side)
        assert re.search(timeout, reason), reason


def test_prefill_death_fails_the_decode(bootstrap: tuple[Any, str], repo_root: Path) -> None:
    """A prefill process killed (SIGKILL) after its first chunk: the decode's room ends
    Failed with a reason naming the lost prefill, not stuck in Transferring."""
    args, _ = bootstrap
    port = free_port()
    child = subprocess.Popen(
        [sys.executable, str(repo_root / "tests/support/sglang_prefill_child.py"), str(port), "31"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(repo_root / "tests/support")},
    )
    decode = sh.HybridPool(tokens=128, slots=4, aux_slots=4, seed=2)
    mgr = sh.manager(decode, DisaggregationMode.DECODE, args)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        pair = sh.Pair(f"{sh.HOST}:{port}", decode, decode, None, mgr)
        receiver = pair.receiver(31)
        receiver.send_metadata(np.arange(8, dtype=np.int32), 0, [np.array([0])], 0)
        assert child.stdout.readline().strip() == "sent"
        child.kill()
        child.wait(timeout=10)
        assert sh.wait_for(receiver.poll, KVPoll.Failed, timeout_s=30) == KVPoll.Failed
        reason = _failure(receiver)  # SGLang's heartbeat or our transport, whichever first
        assert re.search(r"Lost connection with prefill|connection", reason), reason
    finally:
        child.kill()
        mgr.teardown()

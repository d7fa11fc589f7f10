"""`ProcessSender`: the transport's sender in a process of its own, fed through a shared ring.
Its round trips run with the in-process sender's in `test_transport_roundtrip.py`; here what
only it has: the ring's backpressure, messages larger than the ring, the process dying,
start failures, re-pacing and its telemetry."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from transport_helpers import assert_same, eventually, make_pair

from prfaas.engines.transport import Kind, ProcessSender, SenderConfig, TlsConfig, TransferError
from prfaas.engines.transport.process_channel import Done, ReplyFrames, Started, framed
from prfaas.engines.transport.process_sender import restart_delay
from prfaas.testing.processes import argv, child_pids

pytestmark = pytest.mark.timeout(60)

MIB = 1 << 20
SENDER_MODULE = "prfaas.engines.transport.sender_process"


def _child_pid(sender: ProcessSender) -> int:
    assert sender._child is not None and sender._child.pid is not None
    return sender._child.pid


def _reply_fd(pid: int) -> int:
    """The reply pipe's write end in a sender process (python -P -m MODULE CMD_FD REPLY_FD)."""
    command = argv(pid)
    assert command is not None
    return int(command[5])


def _sender_processes() -> list[int]:
    """This process's children that run a sender process."""
    return [p for p in child_pids(os.getpid()) if SENDER_MODULE in (argv(p) or ())]


async def test_a_full_ring_holds_the_sender_until_the_decode_side_takes_the_bytes() -> None:
    """With a 1 MiB ring and 2 MiB held in the sender process, a forward thread sending 12
    layers of 512 KiB to a room nobody fetches yet waits (the engine's memory stays bounded);
    once the decode side fetches, every layer arrives bit-exact and nothing stays held."""
    sender = ProcessSender(SenderConfig(), ring_bytes=MIB, max_held_bytes=2 * MIB)
    pair = await make_pair()
    await pair.sender.close()
    pair.sender = sender
    await sender.start()
    rng = np.random.default_rng(3)
    layers = [rng.integers(0, 255, MIB // 2, dtype=np.uint8) for _ in range(12)]
    sent: list[int] = []
    try:
        handle = sender.open(1)

        def forward() -> None:
            for layer, data in enumerate(layers):
                handle.send_layer(layer, Kind.FULL_KV, {"kv": data})
                sent.append(layer)
            handle.finish()

        thread = threading.Thread(target=forward)
        thread.start()
        await asyncio.sleep(1.0)
        assert 2 <= len(sent) < 12  # ring + held + the message in hand, then it waits
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 1, timeout_s=20)
        result = await transfer.complete()
        await handle.wait()
        await asyncio.to_thread(thread.join)
        assert len(sent) == 12
        for item, data in zip(result.layers, layers, strict=True):
            assert_same({"kv": data}, item.arrays)
        await asyncio.sleep(0.4)  # a snapshot after the bytes were let go
        assert sender.held_bytes == 0
        assert sender.copied_bytes >= 2 * MIB  # those sent before a peer came were copied
    finally:
        await pair.receiver.close()
        await sender.close()


async def test_a_connected_peers_messages_go_from_the_ring_and_give_it_back() -> None:
    """With the decode side connected, messages are sent from the ring itself: 4 MiB through
    a 1 MiB ring (messages under its quarter, so none crosses in parts) arrive bit-exact,
    none copied out, so each message's room came back once it was sent (else the writer
    would wait for ever)."""
    pair = await make_pair()
    await pair.sender.close()
    pair.sender = sender = ProcessSender(SenderConfig(), ring_bytes=MIB)
    await sender.start()
    rng = np.random.default_rng(5)
    layers = [rng.integers(0, 255, MIB // 8, dtype=np.uint8) for _ in range(32)]  # whole
    try:
        handle = sender.open(6)
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 6, timeout_s=20)
        handle.send_layer(0, Kind.FULL_KV, {"kv": np.zeros(16, np.uint8)})  # inline
        await asyncio.wait_for(anext(aiter(transfer)), 5)  # so the peer is bound

        def forward() -> None:
            for layer, data in enumerate(layers, start=1):
                handle.send_layer(layer, Kind.FULL_KV, {"kv": data})
            handle.finish()

        thread = threading.Thread(target=forward)
        thread.start()
        result = await transfer.complete()
        await handle.wait()
        await asyncio.to_thread(thread.join)
        for item, data in zip(result.layers, layers, strict=True):
            assert_same({"kv": data}, item.arrays)
        assert sender.copied_bytes == 0 and sender.held_bytes == 0
    finally:
        await pair.receiver.close()
        await sender.close()


async def test_a_message_larger_than_the_ring_crosses_it_in_parts() -> None:
    """3 MiB through a 1 MiB ring, with at most 1 MiB held: the parts are assembled in the
    sender process (past the held bound, since the message's buffer is already held) and
    the message arrives bit-exact."""
    pair = await make_pair()
    await pair.sender.close()
    pair.sender = sender = ProcessSender(SenderConfig(), ring_bytes=MIB, max_held_bytes=MIB)
    await sender.start()
    data = np.random.default_rng(4).standard_normal(3 * MIB // 8)  # 3 MiB
    try:
        handle = sender.open(2)
        handle.send_layer(0, Kind.LINEAR_STATE, {"state": data})
        handle.finish()
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 2, timeout_s=20)
        result = await transfer.complete()
        await handle.wait()
        assert_same({"state": data}, result.layers[0].arrays)
        assert sender.telemetry().bytes_total > data.nbytes
        assert sender.copied_bytes >= data.nbytes
    finally:
        await pair.receiver.close()
        await sender.close()


async def test_the_sender_process_dying_fails_open_transfers_and_another_takes_over() -> None:
    """Killed mid-transfer: the open transfer's wait raises, and so does the decode side's
    fetch; a room opened before another process serves fails at once (the request fails,
    not the engine), and its decode side is told so by the next process, not left to its
    timeout. That process serves the same port: a transfer through it arrives bit-exact,
    paced at the rate set while no process ran (nothing hangs, nothing is lost silently)."""
    pair = await make_pair(
        SenderConfig(peer_timeout_s=1, process_rate_bytes_per_s=50e6, register_timeout_s=60),
        process=True,
    )
    sender = pair.sender
    assert isinstance(sender, ProcessSender)
    try:
        handle = sender.open(3)
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 3, timeout_s=4)
        handle.send_layer(0, Kind.FULL_KV, {"k": np.ones(1000)})
        first = _child_pid(sender)
        os.kill(first, signal.SIGKILL)
        with pytest.raises(TransferError, match="sender process exited"):
            await asyncio.wait_for(handle.wait(), 10)
        assert not sender.is_alive()  # the next process starts half a second later at the soonest
        missed = sender.open(4)
        missed.send_layer(0, Kind.FULL_KV, {"k": np.ones(10)})  # dropped, not raised
        with pytest.raises(TransferError, match="sender process exited"):
            await asyncio.wait_for(missed.wait(), 1)
        sender.set_process_rate(20e6)
        handle.send_layer(1, Kind.FULL_KV, {"k": np.ones(10)})  # dropped, not raised
        with pytest.raises(TransferError):
            await asyncio.wait_for(transfer.complete(), 10)

        await eventually(sender.is_alive, timeout_s=30)
        assert sender.restarts == 1 and _child_pid(sender) != first
        assert sender.bootstrap_port == pair.port
        told = await pair.receiver.fetch("127.0.0.1", pair.port, 4, timeout_s=50)
        with pytest.raises(TransferError, match="sender process exited"):
            await asyncio.wait_for(told.complete(), 10)  # not its 50 s, nor the sender's 60
        again = sender.open(5)
        fetch = await pair.receiver.fetch("127.0.0.1", pair.port, 5, timeout_s=10)
        layers = [{"k": np.arange(i, i + 5000)} for i in range(4)]
        for layer, arrays in enumerate(layers):
            again.send_layer(layer, Kind.FULL_KV, arrays)
        again.finish()
        result = await asyncio.wait_for(fetch.complete(), 20)
        await asyncio.wait_for(again.wait(), 10)
        for item, arrays in zip(result.layers, layers, strict=True):
            assert_same(arrays, item.arrays)
        await eventually(lambda: sender.telemetry().capacity_bytes_per_s == 20e6)
    finally:
        await pair.receiver.close()
        await sender.close()


async def test_a_process_that_dies_again_soon_is_restarted_later() -> None:
    """A second death soon after a restart waits `restart_delay(2)` (a second) before the
    next process, where the first waited half that: a crash loop backs off."""
    sender = ProcessSender(SenderConfig())
    await sender.start()
    try:
        for deaths in (1, 2):
            os.kill(_child_pid(sender), signal.SIGKILL)
            killed = time.monotonic()
            await eventually(lambda: not sender.is_alive())
            await eventually(sender.is_alive, timeout_s=30)
            assert time.monotonic() - killed >= restart_delay(deaths)
            assert sender.restarts == deaths
    finally:
        await sender.close()


async def test_a_death_is_seen_while_another_process_holds_the_reply_pipe() -> None:
    """A process the engine forked while starting its sender process may hold the reply
    pipe's write end (here: this test opens it), so that pipe never ends: the death is read
    from the process's pidfd, the open transfer fails and another process takes over."""
    sender = ProcessSender(SenderConfig())
    await sender.start()
    try:
        pid = _child_pid(sender)
        held = os.open(f"/proc/{pid}/fd/{_reply_fd(pid)}", os.O_WRONLY)
        try:
            handle = sender.open(1)
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(TransferError, match="sender process exited"):
                await asyncio.wait_for(handle.wait(), 10)
            await eventually(sender.is_alive, timeout_s=30)
            assert sender.restarts == 1
        finally:
            os.close(held)
    finally:
        await sender.close()


async def test_a_cancelled_close_leaves_no_sender_process() -> None:
    """A close cancelled while it waits for the process to exit (here: stopped, so it
    never reads `Close`) kills it: nothing keeps serving the engine's port."""
    sender = ProcessSender(SenderConfig())
    await sender.start()
    os.kill(_child_pid(sender), signal.SIGSTOP)
    closing = asyncio.create_task(sender.close())
    await asyncio.sleep(0.3)
    closing.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await closing
    await eventually(lambda: _sender_processes() == [], timeout_s=10)


def test_restart_delays_double_up_to_a_cap() -> None:
    assert [restart_delay(n) for n in (0, 1, 2, 3, 4)] == [0.5, 0.5, 1.0, 2.0, 4.0]
    assert restart_delay(100) == 30.0


async def test_close_while_waiting_to_restart_is_prompt_and_starts_nothing() -> None:
    """A close does not wait out the wait before a restart (here 30 s: a crash loop's)."""
    sender = ProcessSender(SenderConfig())
    await sender.start()
    try:
        sender._quick_deaths = 10
        os.kill(_child_pid(sender), signal.SIGKILL)
        await eventually(lambda: sender._restarting is not None)
        began = time.monotonic()
        await sender.close()
        assert time.monotonic() - began < 2
        assert sender.restarts == 0 and not sender.is_alive()
        assert _sender_processes() == []
    finally:
        await sender.close()


async def test_start_failures_are_the_senders_errors(tmp_path: Path) -> None:
    """A bound port is an OSError and a TLS file that does not load a ValueError, as with
    the in-process sender; no sender process is left after either."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = ProcessSender(SenderConfig(port=taken.getsockname()[1]))
        with pytest.raises(OSError):
            await busy.start()
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    tls = TlsConfig(cert_file=garbage, key_file=garbage)
    bad = ProcessSender(SenderConfig(tls=tls))
    with pytest.raises(ValueError):
        await bad.start()
    assert not busy.is_alive() and not bad.is_alive()
    assert _sender_processes() == []


async def test_repacing_reaches_the_sender_process() -> None:
    """`set_process_rate` as on the in-process sender: refused for an unpaced egress; on a
    paced one the next transfer is paced at the new rate and the telemetry's capacity
    follows."""
    unpaced = await make_pair(process=True)
    try:
        with pytest.raises(ValueError, match="not paced"):
            unpaced.sender.set_process_rate(1e6)
    finally:
        await unpaced.receiver.close()
        await unpaced.sender.close()
    config = SenderConfig(process_rate_bytes_per_s=1e9, chunk_bytes=65536)
    pair = await make_pair(config, process=True)
    try:
        pair.sender.set_process_rate(2e6)  # 1 MiB then takes about half a second
        with pytest.raises(ValueError, match="> 0"):
            pair.sender.set_process_rate(0)
        handle = pair.sender.open(5)
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 5, timeout_s=20)
        began = asyncio.get_running_loop().time()
        handle.send_layer(0, Kind.FULL_KV, {"k": np.zeros(MIB, np.uint8)})
        handle.finish()
        await transfer.complete()
        await handle.wait()
        assert asyncio.get_running_loop().time() - began > 0.3
        assert pair.sender.telemetry().capacity_bytes_per_s == 2e6
        assert pair.sender.config.process_rate_bytes_per_s == 2e6
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def test_send_after_holds_more_than_the_held_bound_and_delivers() -> None:
    """Not pipelined, every message waits for the transfer's end: 4 MiB through a 1 MiB ring
    with 1 MiB held arrive (send-after is not bounded by the held bytes, else its end could
    never be read)."""
    pair = await make_pair()
    await pair.sender.close()
    config = SenderConfig(pipelined=False)
    pair.sender = sender = ProcessSender(config, ring_bytes=MIB, max_held_bytes=MIB)
    await sender.start()
    rng = np.random.default_rng(6)
    layers = [rng.integers(0, 255, MIB // 2, dtype=np.uint8) for _ in range(8)]
    try:
        handle = sender.open(7)
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 7, timeout_s=20)

        def forward() -> None:
            for layer, data in enumerate(layers):
                handle.send_layer(layer, Kind.FULL_KV, {"kv": data})
            handle.finish()

        thread = threading.Thread(target=forward)
        thread.start()
        result = await asyncio.wait_for(transfer.complete(), 20)
        await handle.wait()
        await asyncio.to_thread(thread.join)
        for item, data in zip(result.layers, layers, strict=True):
            assert_same({"kv": data}, item.arrays)
    finally:
        await pair.receiver.close()
        await sender.close()


async def test_a_send_waiting_for_the_ring_returns_when_the_process_dies() -> None:
    """A forward thread waiting for room in a full ring (no peer, the held bound reached)
    returns once the sender process is killed, its messages dropped as after an abort, and
    the transfer fails; nothing waits for ever."""
    sender = ProcessSender(SenderConfig(), ring_bytes=MIB, max_held_bytes=MIB)
    await sender.start()
    data = np.ones(MIB // 2, np.uint8)
    try:
        handle = sender.open(8)
        thread = threading.Thread(
            target=lambda: [handle.send_layer(i, Kind.FULL_KV, {"kv": data}) for i in range(16)]
        )
        thread.start()
        await asyncio.sleep(0.5)
        assert thread.is_alive()  # waiting for the ring
        assert sender._child.process is not None
        sender._child.process.kill()
        await asyncio.wait_for(asyncio.to_thread(thread.join), 10)
        with pytest.raises(TransferError, match="sender process exited"):
            await asyncio.wait_for(handle.wait(), 10)
    finally:
        await sender.close()


async def test_a_send_on_the_loop_waiting_for_the_ring_returns_when_the_process_dies() -> None:
    """The same wait on the event loop's own thread (an engine that exports a prefix from
    its loop), which then cannot see the process's end through the loop: the process's
    exit is read from its pidfd, and the send returns."""
    sender = ProcessSender(SenderConfig(), ring_bytes=MIB, max_held_bytes=MIB)
    await sender.start()
    try:
        handle = sender.open(10)
        assert sender._child.process is not None
        killer = threading.Timer(1.0, sender._child.process.kill)
        killer.start()
        began = time.monotonic()
        for layer in range(16):  # blocks this thread (the loop's) once the ring is full
            handle.send_layer(layer, Kind.FULL_KV, {"kv": np.ones(MIB // 2, np.uint8)})
        assert time.monotonic() - began < 10
        killer.join()
        with pytest.raises(TransferError, match="sender process exited"):
            await asyncio.wait_for(handle.wait(), 10)
    finally:
        await sender.close()


async def test_a_room_opened_again_after_an_abort_is_a_new_transfer() -> None:
    """Abort a room and open the same number at once (a client's retry with the same
    bootstrap room): the old transfer's end does not touch the new one, which delivers."""
    pair = await make_pair(process=True)
    try:
        old = pair.sender.open(9)
        old.send_layer(0, Kind.FULL_KV, {"k": np.zeros(10)})
        old.abort("retried")
        await asyncio.sleep(0)  # the abort ends the room on the loop, as in-process
        new = pair.sender.open(9)  # its Open follows the Abort down the pipe at once
        new.send_layer(0, Kind.FULL_KV, {"k": np.arange(10)})
        new.finish()
        with pytest.raises(TransferError, match="retried"):
            await old.wait()
        await asyncio.sleep(0.3)  # the old opening's end has come back
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 9, timeout_s=10)
        result = await asyncio.wait_for(transfer.complete(), 10)
        await asyncio.wait_for(new.wait(), 10)
        assert_same({"k": np.arange(10)}, result.layers[0].arrays)
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def test_close_with_many_open_rooms_is_prompt() -> None:
    """Two hundred rooms waiting for peers: `close` fails them all and the process exits at
    once (its replies never wait on a pipe the engine no longer reads)."""
    sender = ProcessSender(SenderConfig())
    await sender.start()
    handles = [sender.open(room) for room in range(200)]
    for handle in handles:
        handle.send_layer(0, Kind.FULL_KV, {"k": np.zeros(100_000, np.uint8)})
    began = asyncio.get_running_loop().time()
    await sender.close()
    assert asyncio.get_running_loop().time() - began < 5
    assert sender._child.process is not None and sender._child.process.returncode == 0
    for handle in handles:
        with pytest.raises(TransferError, match="sender closed"):
            await handle.wait()


async def test_opening_rooms_while_a_send_waits_for_the_ring() -> None:
    """The loop opens rooms (each open reads whether the process lives) while a forward
    thread waits for the ring (reading the same, over and over): neither raises, and the
    waiting transfer completes once the decode side fetches it."""
    pair = await make_pair()
    await pair.sender.close()
    pair.sender = sender = ProcessSender(SenderConfig(), ring_bytes=MIB, max_held_bytes=MIB)
    await sender.start()
    layers = [np.full(MIB // 2, i, np.uint8) for i in range(8)]
    errors: list[BaseException] = []
    try:
        handle = sender.open(1)

        def forward() -> None:
            try:
                for layer, data in enumerate(layers):
                    handle.send_layer(layer, Kind.FULL_KV, {"kv": data})
                handle.finish()
            except BaseException as exc:  # reported by the test below
                errors.append(exc)

        thread = threading.Thread(target=forward)
        thread.start()
        for room in range(1000, 1300):  # about a second of opens beside the waiting send
            sender.open(room).abort("not needed")
            await asyncio.sleep(0.003)
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 1, timeout_s=20)
        result = await asyncio.wait_for(transfer.complete(), 20)
        await asyncio.to_thread(thread.join)
        assert not errors
        for item, data in zip(result.layers, layers, strict=True):
            assert_same({"kv": data}, item.arrays)
    finally:
        await pair.receiver.close()
        await sender.close()


def test_reply_frames_survive_any_split() -> None:
    """Replies framed for the pipe come back whole and in order however the reads split
    their bytes (one byte at a time, or everything at once)."""
    replies = [Done(1, 2, None), Done(3, 4, "failed: x" * 50), Started(8998)]
    data = b"".join(framed(r) for r in replies)
    for size in (1, 3, 7, 64, len(data)):
        frames = ReplyFrames()
        got = [r for i in range(0, len(data), size) for r in frames.feed(data[i : i + size])]
        assert got == replies

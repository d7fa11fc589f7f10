"""End-to-end over real loopback sockets: bit-exact layers, order, aux, start orders."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from transport_helpers import assert_same, layer_kind, make_pair, random_arrays

from prfaas.common.ports import free_port
from prfaas.engines.transport import Kind, KVReceiver, KVSender, SenderConfig, TransferError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=[False, True], ids=["loop", "process"])
def process(request: pytest.FixtureRequest) -> bool:
    """Whether the sender runs in a process of its own (`ProcessSender`): each test that
    takes it runs with both."""
    return bool(request.param)


@pytest.mark.parametrize("connections", [1, 4])
async def test_every_kind_round_trips_bit_exact(connections: int, process: bool) -> None:
    """FULL_KV (with block range), LINEAR_STATE, SWA_KV and AUX arrive exactly as sent,
    layers in the order sent, with small chunks so every layer is striped."""
    pair = await make_pair(SenderConfig(connections=connections, chunk_bytes=4096), process=process)
    rng = np.random.default_rng(connections)
    try:
        handle = pair.sender.open(11)
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 11, timeout_s=20)
        kinds = [Kind.FULL_KV, Kind.LINEAR_STATE, Kind.SWA_KV, Kind.LINEAR_STATE]
        sent = [random_arrays(rng, scale=1 + 40 * (i % 2)) for i in range(len(kinds))]
        handle.send_aux("meta", b'{"first_token": 42}')
        for layer, (kind, arrays) in enumerate(zip(kinds, sent, strict=True)):
            blocks = (3, 3 + layer) if kind is Kind.FULL_KV else None
            handle.send_layer(layer, kind, arrays, blocks=blocks)
        handle.send_aux("empty", b"")
        handle.finish()
        result = await transfer.complete()
        await handle.wait()
        assert [(i.layer, i.kind) for i in result.layers] == list(enumerate(kinds))
        for item, arrays in zip(result.layers, sent, strict=True):
            assert_same(arrays, item.arrays)
            for array in item.arrays.values():
                assert array.flags.writeable and array.ctypes.data % 64 == 0
        assert result.layers[0].arrays.blocks == (3, 3)
        assert result.layers[1].arrays.blocks is None
        assert result.aux == {"meta": b'{"first_token": 42}', "empty": b""}
        assert transfer.aux("meta") == b'{"first_token": 42}'
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def test_layer_order_is_send_order_under_striping(process: bool) -> None:
    """60 layers of very different sizes over 8 connections, 4 KiB frames: the receiver's
    iteration yields exactly the send order even though frames arrive interleaved."""
    pair = await make_pair(SenderConfig(connections=8, chunk_bytes=4096), process=process)
    rng = np.random.default_rng(5)
    order = [int(x) for x in rng.permutation(60)]  # layer numbers need not be sorted
    try:
        handle = pair.sender.open(1)
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 1, timeout_s=30)
        sent = {}
        for layer in order:
            size = int(rng.choice([1, 100, 20_000]))
            sent[layer] = {"x": rng.integers(0, 2**31, size=size, dtype=np.int32)}
            handle.send_layer(layer, layer_kind(layer), sent[layer])
        handle.finish()
        got = [(layer, kind, arrays) async for layer, kind, arrays in transfer]
        await handle.wait()
        assert [g[0] for g in got] == order
        for layer, kind, arrays in got:
            assert kind is layer_kind(layer)
            assert_same(sent[layer], arrays)
        assert len({c.index for c in pair.sender.telemetry().connections}) == 8
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def test_layers_stream_before_finish_when_pipelined(process: bool) -> None:
    """Pipelined: layer 0 is delivered while the transfer is still open."""
    pair = await make_pair(process=process)
    try:
        handle = pair.sender.open(2)
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 2, timeout_s=10)
        handle.send_layer(0, Kind.FULL_KV, {"k": np.ones(8, np.float16)})
        first = await asyncio.wait_for(anext(aiter(transfer)), 5)
        assert first.layer == 0 and not transfer.finished
        handle.finish()
        assert (await transfer.complete()).layers == ()
        await handle.wait()
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def test_non_pipelined_holds_everything_until_finish(process: bool) -> None:
    """pipelined=False: nothing reaches the receiver before finish(), then everything."""
    pair = await make_pair(SenderConfig(pipelined=False), process=process)
    try:
        handle = pair.sender.open(3)
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 3, timeout_s=10)
        for layer in range(3):
            handle.send_layer(layer, Kind.LINEAR_STATE, {"s": np.full(100, layer, np.float32)})
        await asyncio.sleep(0.3)
        assert pair.sender.telemetry().bytes_total < 1000  # handshakes only
        assert transfer.nbytes == 0
        handle.finish()
        result = await transfer.complete()
        assert [item.layer for item in result.layers] == [0, 1, 2]
        await handle.wait()
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def test_decode_registers_before_prefill_opens(process: bool) -> None:
    """Start order 1: the receiver fetches first; the sender opens the room later."""
    pair = await make_pair(process=process)
    try:
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 99, timeout_s=10)
        await asyncio.sleep(0.2)  # the registration is parked at the sender
        handle = pair.sender.open(99)
        handle.send_layer(0, Kind.FULL_KV, {"k": np.arange(10)})
        handle.finish()
        result = await transfer.complete()
        assert_same({"k": np.arange(10)}, result.layers[0].arrays)
        await handle.wait()
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def test_prefill_sends_before_decode_registers(process: bool) -> None:
    """Start order 2: every layer is sent and finished before anyone fetches."""
    pair = await make_pair(process=process)
    try:
        handle = pair.sender.open(5)
        handle.send_layer(0, Kind.FULL_KV, {"k": np.arange(10)})
        handle.finish()
        await asyncio.sleep(0.2)
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 5, timeout_s=10)
        result = await transfer.complete()
        assert_same({"k": np.arange(10)}, result.layers[0].arrays)
        await handle.wait()
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def test_receiver_up_before_the_sender_process() -> None:
    """The decode side may fetch from a bootstrap port nobody listens on yet: it retries."""
    port = free_port()
    receiver = KVReceiver()
    sender = KVSender(SenderConfig(port=port))
    try:
        transfer = await receiver.fetch("127.0.0.1", port, 7, timeout_s=10)
        await asyncio.sleep(0.3)  # connection refused a few times
        await sender.start()
        handle = sender.open(7)
        handle.send_aux("x", b"y")
        handle.finish()
        assert (await transfer.complete()).aux == {"x": b"y"}
        await handle.wait()
    finally:
        await receiver.close()
        await sender.close()


async def test_send_layer_from_worker_threads(process: bool) -> None:
    """send_layer is thread-safe: a "forward pass" thread streams layers of two rooms while
    the loop runs; everything arrives intact and in per-room order."""
    pair = await make_pair(SenderConfig(chunk_bytes=8192), process=process)
    rng = np.random.default_rng(7)
    data = {room: [random_arrays(rng, scale=20) for _ in range(12)] for room in (1, 2)}
    try:
        handles = {room: pair.sender.open(room) for room in data}
        transfers = {
            room: await pair.receiver.fetch("127.0.0.1", pair.port, room, timeout_s=30)
            for room in data
        }

        def forward(room: int) -> None:
            for layer, arrays in enumerate(data[room]):
                handles[room].send_layer(layer, layer_kind(layer), arrays)
            handles[room].finish()

        threads = [threading.Thread(target=forward, args=(room,)) for room in data]
        for thread in threads:
            thread.start()
        results = {room: await t.complete() for room, t in transfers.items()}
        for thread in threads:
            thread.join()
        for room, result in results.items():
            await handles[room].wait()
            assert [item.layer for item in result.layers] == list(range(12))
            for item, arrays in zip(result.layers, data[room], strict=True):
                assert_same(arrays, item.arrays)
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def test_many_rooms_leave_no_state_behind() -> None:
    """After 30 concurrent transfers both sides hold no room, frame or buffered byte."""
    pair = await make_pair(SenderConfig(connections=3, chunk_bytes=4096))
    try:
        handles = [pair.sender.open(r) for r in range(30)]
        transfers = [
            await pair.receiver.fetch("127.0.0.1", pair.port, r, timeout_s=30) for r in range(30)
        ]
        for r, handle in enumerate(handles):
            handle.send_layer(0, Kind.FULL_KV, {"k": np.full(5000, r, np.int16)})
            handle.finish()
        results = await asyncio.gather(*(t.complete() for t in transfers))
        await asyncio.gather(*(h.wait() for h in handles))
        assert [int(res.layers[0].arrays["k"][0]) for res in results] == list(range(30))
        telemetry = pair.sender.telemetry()
        assert telemetry.active_transfers == 0 and telemetry.peers == 1
        peer = next(iter(pair.sender._peers.values()))
        assert peer.queued_frames == 0 and peer.in_flight_bytes == 0
        link = next(iter(pair.receiver._links.values()))
        assert link.transfers == {} and link._buffered == 0
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def test_api_misuse_is_a_clear_error(process: bool) -> None:
    pair = await make_pair(process=process)
    try:
        handle = pair.sender.open(4)
        with pytest.raises(ValueError, match="already open"):
            pair.sender.open(4)
        with pytest.raises(ValueError, match="room must be"):
            pair.sender.open(-1)
        with pytest.raises(ValueError, match="kind must be one of"):
            handle.send_layer(0, Kind.END, {})
        handle.send_layer(0, Kind.FULL_KV, {})
        with pytest.raises(ValueError, match="layer 0 was already sent"):
            handle.send_layer(0, Kind.FULL_KV, {})
        handle.finish()
        with pytest.raises(ValueError, match="already finished"):
            handle.send_aux("late", b"")
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 4, timeout_s=10)
        with pytest.raises(ValueError, match="already being fetched"):
            await pair.receiver.fetch("127.0.0.1", pair.port, 4)
        with pytest.raises(ValueError, match="timeout_s"):
            await pair.receiver.fetch("127.0.0.1", pair.port, 8, timeout_s=0)
        await transfer.complete()
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def test_sends_after_an_abort_are_dropped(process: bool) -> None:
    """A request given up while its forward pass runs (the engine aborts its room from the
    event loop): the pass's later sends, its metadata and its finish are dropped, not
    raised into the pass (where they failed every request computed in it), and the decode
    side's fetch fails with the abort's reason."""
    pair = await make_pair(process=process)
    try:
        handle = pair.sender.open(5)
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 5, timeout_s=10)
        handle.send_layer(0, Kind.FULL_KV, {"k": np.zeros(4, np.float32)})
        handle.abort("request aborted")
        handle.send_layer(1, Kind.FULL_KV, {"k": np.zeros(4, np.float32)})
        handle.send_aux("meta", b"{}")
        handle.finish()
        with pytest.raises(TransferError, match="aborted by prefill: request aborted"):
            await asyncio.wait_for(transfer.complete(), 10)
        with pytest.raises(ValueError, match="layer 1 was already sent"):
            handle.send_layer(1, Kind.FULL_KV, {})  # misuse is still an error
    finally:
        await pair.receiver.close()
        await pair.sender.close()


def test_runs_on_uvloop() -> None:
    """The gateway and engines may run uvloop: a striped transfer, a reset of every receiver
    connection and a second transfer all work there, with TCP_INFO telemetry."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> None:
        pair = await make_pair(SenderConfig(chunk_bytes=4096))
        sent = [random_arrays(np.random.default_rng(i), scale=10) for i in range(4)]
        try:
            for room in (1, 2):
                handle = pair.sender.open(room)
                transfer = await pair.receiver.fetch("127.0.0.1", pair.port, room, timeout_s=20)
                for layer, arrays in enumerate(sent):
                    handle.send_layer(layer, layer_kind(layer), arrays)
                handle.finish()
                result = await transfer.complete()
                await handle.wait()
                for item, arrays in zip(result.layers, sent, strict=True):
                    assert_same(arrays, item.arrays)
                assert pair.sender.telemetry().rtt_s is not None
                for conn in list(next(iter(pair.receiver._links.values())).conns.values()):
                    assert conn.transport is not None
                    conn.transport.abort()
        finally:
            await pair.receiver.close()
            await pair.sender.close()

    uvloop.run(scenario())


async def test_a_room_failed_before_it_started_stays_failed() -> None:
    """A room opened and failed in one step of the loop (a sender process serves an open and
    an abort in one read): its tombstone answers the decode side's fetch at once, and a
    registration parked before the open is aborted, not left to time out."""
    pair = await make_pair(SenderConfig(register_timeout_s=30))
    try:
        parked = await pair.receiver.fetch("127.0.0.1", pair.port, 1, timeout_s=20)
        await asyncio.sleep(0.2)  # its registration is parked at the sender
        for room in (1, 2):
            pair.sender.open(room).fail("aborted by prefill: gone")
        later = await pair.receiver.fetch("127.0.0.1", pair.port, 2, timeout_s=20)
        for transfer in (parked, later):
            with pytest.raises(TransferError, match="aborted by prefill: gone"):
                await asyncio.wait_for(transfer.complete(), 5)
    finally:
        await pair.receiver.close()
        await pair.sender.close()

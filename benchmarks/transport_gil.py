"""Benchmark: the KV transport beside a GIL-busy thread, as a prefill engine runs it (and
a decode engine).

A prefill engine sends KV from its event loop while the forward's thread launches kernels,
holding the GIL between them. Each frame costs the loop several GIL hand-offs (a send, a
poll, an acknowledgement), and a thread waiting for the GIL gets it only after the
interpreter's switch interval (`sys.setswitchinterval`, 5 ms by default). Per frame size
and switch interval: the goodput of a transfer (16 x 8 MiB; the sender in this process,
the receiver in its own, loopback, unpaced) alone and beside a thread of short GIL-holding
numpy steps (a stand-in for a launch-bound forward), and that thread's slowdown (its steps
per second alone over while the transfer runs). The last rows run the sender in a process
of its own (`ProcessSender`, the engine's `--kv-sender process`): this process then only
copies each layer into a shared ring and writes a command. The rows whose busy side is the
decode run the thread in the receiver's process instead (the decode engine's forward beside
its receiver, which reads every frame and writes its acknowledgements on its loop), the
sender alone in this one. On a GPU the campaign's overlap stage measures the sender's
variants inside a real prefill (`benchmarks/gpu/handoff_overlap.py`).
Every figure is the median of --runs transfers after a warm-up one; the machine is shared
and noisy: read the ratios of rows measured in one run.
Usage: python benchmarks/transport_gil.py [--runs 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from prfaas.engines.transport import (
    Kind,
    KVReceiver,
    KVSender,
    ProcessSender,
    ReceiverConfig,
    SenderConfig,
)

LAYERS, LAYER_MIB = 16, 8
VARIANTS = (
    (1024, 5.0, "loop", "prefill"),
    (1024, 0.5, "loop", "prefill"),
    (8192, 5.0, "loop", "prefill"),
    (8192, 0.5, "loop", "prefill"),
    (1024, 5.0, "process", "prefill"),
    (1024, 0.5, "process", "prefill"),
    (1024, 5.0, "loop", "decode"),
    (1024, 0.5, "loop", "decode"),
)
"""(frame KiB, GIL switch interval ms, where the sender runs, which side's process the busy
thread runs in): the engine's default first."""
RECEIVER = Path(__file__).with_name("transport.py")
"""Its receiver role (a separate process, as a decode engine is)."""


class Ticker:
    """A thread taking short GIL-holding steps, counting them."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._steps = 0
        self._thread = threading.Thread(target=self._run, name="ticker")
        self.rate = 0.0
        """Steps per second over its last run."""

    def _run(self) -> None:
        x = np.zeros(16)
        while not self._stop.is_set():
            x += 1.0
            self._steps += 1

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        began = time.perf_counter()
        self._thread.start()
        try:
            yield
        finally:
            self._stop.set()
            self._thread.join()
            self.rate = self._steps / (time.perf_counter() - began)


def idle_rate(seconds: float = 1.0) -> float:
    """The ticker's steps per second with nothing else running."""
    ticker = Ticker()
    with ticker.running():
        time.sleep(seconds)
    return ticker.rate


async def variant(
    frame_kib: int, switch_ms: float, where: str, busy_side: str, runs: int, idle: float
) -> dict[str, Any]:
    """Alternating transfers alone and beside the ticker (first pair: warm-up), the ticker
    in this process (`busy_side` "prefill") or in the receiver's ("decode")."""
    default = sys.getswitchinterval()
    sys.setswitchinterval(switch_ms / 1e3)
    config = SenderConfig(host="127.0.0.1", chunk_bytes=frame_kib << 10, register_timeout_s=60)
    sender = KVSender(config) if where == "loop" else ProcessSender(config)
    receiver: asyncio.subprocess.Process | None = None
    rooms = 2 * (runs + 1)
    data = np.random.default_rng(0).integers(0, 255, LAYER_MIB << 20, dtype=np.uint8)
    alone: list[float] = []
    busy: list[float] = []
    slowdown: list[float] = []
    try:
        await sender.start()
        if busy_side == "prefill":
            receiver = await asyncio.create_subprocess_exec(
                sys.executable, str(RECEIVER), "--role", "receiver", "--host", "127.0.0.1",
                "--port", str(sender.bootstrap_port), "--rooms", str(rooms), "--tls-dir", "",
                stdout=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
        else:
            receiver = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "--busy-receiver", str(sender.bootstrap_port),
                "--rooms", str(rooms), "--switch-ms", str(switch_ms),
                stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
        for room in range(rooms):
            ticker = Ticker() if room % 2 and busy_side == "prefill" else None
            with ticker.running() if ticker else contextlib.nullcontext():
                began = time.perf_counter()
                handle = sender.open(room)
                for layer in range(LAYERS):
                    handle.send_layer(layer, Kind.FULL_KV, {"kv": data})
                handle.finish()
                await handle.wait()
                seconds = time.perf_counter() - began
            if room < 2:
                continue
            goodput = LAYERS * LAYER_MIB * 2**20 / seconds / 1e9
            (busy if room % 2 else alone).append(goodput)
            if ticker is not None:
                slowdown.append(idle / ticker.rate)
        if busy_side == "decode":
            assert receiver.stdout is not None
            out = await asyncio.wait_for(receiver.stdout.read(), 120)
            result = next(line for line in out.decode().splitlines() if line.startswith("RESULT "))
            slowdown = json.loads(result.removeprefix("RESULT "))["slowdowns"][1:]  # warm-up
        await asyncio.wait_for(receiver.wait(), 120)
    finally:
        if receiver is not None and receiver.returncode is None:
            receiver.kill()
            await receiver.wait()
        await sender.close()
        sys.setswitchinterval(default)
    return {
        "frame_kib": frame_kib, "gil_switch_ms": switch_ms, "sender": where,
        "busy_side": busy_side,
        "alone_GBps": round(statistics.median(alone), 3),
        "beside_busy_thread_GBps": round(statistics.median(busy), 3),
        "busy_thread_slowdown": round(statistics.median(slowdown), 3),
    }  # fmt: skip


async def busy_receiver(port: int, rooms: int, switch_ms: float) -> None:
    """The decode side with the ticker beside its receiver: rooms 0..rooms-1 in order, the
    ticker running through each odd room's transfer; prints each odd room's slowdown."""
    sys.setswitchinterval(switch_ms / 1e3)
    idle = idle_rate()
    receiver = KVReceiver(ReceiverConfig(connect_timeout_s=30))
    transfers = [
        await receiver.fetch("127.0.0.1", port, room, timeout_s=600) for room in range(rooms)
    ]
    slowdowns = []
    for room, transfer in enumerate(transfers):
        ticker = Ticker() if room % 2 else None
        with ticker.running() if ticker else contextlib.nullcontext():
            result = await transfer.complete()
        del result
        if ticker is not None:
            slowdowns.append(idle / ticker.rate)
    print("RESULT " + json.dumps({"slowdowns": slowdowns}), flush=True)
    await receiver.close()


async def measure(runs: int) -> list[dict[str, Any]]:
    idle = idle_rate()
    return [await variant(*v, runs, idle) for v in VARIANTS]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", type=Path)
    p.add_argument("--busy-receiver", type=int, metavar="PORT", help=argparse.SUPPRESS)
    p.add_argument("--rooms", type=int, help=argparse.SUPPRESS)
    p.add_argument("--switch-ms", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.busy_receiver is not None:  # the decode side of a "decode" row
        asyncio.run(busy_receiver(args.busy_receiver, args.rooms, args.switch_ms))
        return 0
    rows = asyncio.run(measure(args.runs))
    print(f"transport beside a GIL-busy thread ({LAYERS} x {LAYER_MIB} MiB, loopback, "
          f"medians of {args.runs})")  # fmt: skip
    print(
        f"{'busy side':>9} {'sender':>7} {'frame KiB':>9} {'GIL ms':>6} {'alone GB/s':>10} "
        f"{'beside GB/s':>11} {'thread slow':>11}"
    )
    for r in rows:
        print(f"{r['busy_side']:>9} {r['sender']:>7} {r['frame_kib']:9} {r['gil_switch_ms']:6g} "
              f"{r['alone_GBps']:10.3f} {r['beside_busy_thread_GBps']:11.3f} "
              f"{r['busy_thread_slowdown']:11.3f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"layers": LAYERS, "layer_mib": LAYER_MIB,
                                         "runs": args.runs, "rows": rows}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

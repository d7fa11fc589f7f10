"""The decode side of `handoff_overlap.py`, in a process of its own as a decode engine's is
(its event loop and GIL apart from the prefill's), and its handle in the prefill's process.

The child fetches each room it is told (`PORT ROOM` on stdin), says `READY` once its
fetch is registered, and when the transfer completes prints one JSON line: each message's
arrival time (`time.perf_counter`, on Linux the system-wide monotonic clock, so comparable
with the parent's) and byte count, and an xxh3 digest of every (model layer, array) it
received, for the parent to compare with what its prefill computed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from prfaas.engines.kv_pages import model_layer
from prfaas.engines.transport import KVReceiver

SCRIPT = Path(__file__).resolve()


def digest(array: np.ndarray) -> str:
    """The array's bytes, hashed (the same on both sides for equal bits)."""
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)


class ReceiverProcess:
    """The parent's handle: one child, one room at a time."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self._proc = proc

    @classmethod
    async def start(cls) -> ReceiverProcess:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(SCRIPT),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        return cls(proc)

    async def fetch(self, port: int, room: int) -> None:
        """Have the child fetch `room`; returns once its fetch is registered."""
        assert self._proc.stdin is not None
        self._proc.stdin.write(f"{port} {room}\n".encode())
        await self._proc.stdin.drain()
        if (line := await self._line()) != "READY":
            raise RuntimeError(f"the receiver process said {line!r}, not READY")

    async def result(self) -> dict[str, Any]:
        """The completed room's arrivals `[[time, bytes], ...]` and digests."""
        got: dict[str, Any] = json.loads(await self._line())
        if "error" in got:
            raise RuntimeError(f"the receiver process failed: {got['error']}")
        return got

    async def _line(self) -> str:
        assert self._proc.stdout is not None
        line = await asyncio.wait_for(self._proc.stdout.readline(), 300)
        if not line:
            raise RuntimeError(f"the receiver process exited ({await self._proc.wait()})")
        return line.decode().strip()

    async def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            await asyncio.wait_for(self._proc.wait(), 30)
        except TimeoutError:
            self._proc.kill()
            await self._proc.wait()


async def _serve() -> None:
    receiver = KVReceiver()
    loop = asyncio.get_running_loop()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            port, room = map(int, line.split())
            try:
                transfer = await receiver.fetch("127.0.0.1", port, room, timeout_s=300)
                print("READY", flush=True)
                arrivals: list[tuple[float, int]] = []
                digests: dict[str, str] = {}
                async for item in transfer:
                    arrivals.append(
                        (time.perf_counter(), sum(a.nbytes for a in item.arrays.values()))
                    )
                    for name, array in item.arrays.items():
                        digests[f"{model_layer(item.layer)}/{name}"] = digest(array)
                await transfer.complete()
                print(json.dumps({"arrivals": arrivals, "digests": digests}), flush=True)
            except Exception as exc:  # reported to the parent, which fails the stage
                print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
    finally:
        await receiver.close()


if __name__ == "__main__":
    asyncio.run(_serve())

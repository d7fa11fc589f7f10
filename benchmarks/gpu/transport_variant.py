"""The KV transport variant a GPU benchmark runs: its frame size and the interpreter's GIL
switch interval, written `KIB:MS` on the command line. The transport's event loop shares
the GIL with the forward's kernel launches, and each frame costs it GIL hand-offs
(`benchmarks/transport_gil.py`): fewer, larger frames and a shorter switch interval are the
variant measured beside the engine's defaults."""

from __future__ import annotations

from typing import NamedTuple


class TransportVariant(NamedTuple):
    frame_kib: int
    switch_ms: float

    def label(self) -> str:
        return f"{self.frame_kib} KiB frames, GIL switch {self.switch_ms:g} ms"


ENGINE_DEFAULT = TransportVariant(1024, 5.0)
"""`prfaas engine`'s `--transfer-chunk-kib` and Python's own switch interval."""
FEWER_HANDOFFS = TransportVariant(8192, 0.5)


def parse(text: str) -> TransportVariant:
    """`KIB:MS` (e.g. `8192:0.5`)."""
    frame, switch = text.split(":")
    return TransportVariant(int(frame), float(switch))

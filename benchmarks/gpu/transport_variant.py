"""The KV transport variant a GPU benchmark runs: its frame size and the interpreter's GIL
switch interval, written `KIB:MS` on the command line. The transport's event loop shares
the GIL with the forward's kernel launches, and each frame costs it GIL hand-offs
(`benchmarks/transport_gil.py`): fewer, larger frames and a shorter switch interval are the
variant measured beside the engine's defaults."""

from __future__ import annotations

from typing import NamedTuple


class TransportVariant(NamedTuple):
    """A frame size and a GIL switch interval."""

    frame_kib: int
    """The transport's largest frame (`prfaas engine --transfer-chunk-kib`)."""
    gil_switch_ms: float
    """`sys.setswitchinterval`, in ms (`prfaas engine --gil-switch-ms`)."""

    def label(self) -> str:
        """For progress lines and tables."""
        return f"{self.frame_kib} KiB frames, GIL switch {self.gil_switch_ms:g} ms"


ENGINE_DEFAULT = TransportVariant(1024, 5.0)
"""`prfaas engine`'s frame size and Python's own switch interval."""
FEWER_HANDOFFS = TransportVariant(8192, 0.5)
"""Eight times fewer frames, and the GIL back to the event loop ten times sooner."""


def parse(text: str) -> TransportVariant:
    """`KIB:MS` (e.g. `8192:0.5`)."""
    frame, switch = text.split(":")
    return TransportVariant(int(frame), float(switch))

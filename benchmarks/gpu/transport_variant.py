"""The KV transport variant a GPU benchmark runs: its frame size, the interpreter's GIL
switch interval and where the sender runs, written `KIB:MS[:process]` on the command line.
The transport's event loop shares the GIL with the forward's kernel launches, and each frame
costs it GIL hand-offs (`benchmarks/transport_gil.py`): fewer, larger frames and a shorter
switch interval are one variant measured beside the engine's defaults, and the sender in a
process of its own (`ProcessSender`, `prfaas engine --kv-sender process`) another."""

from __future__ import annotations

from typing import NamedTuple


class TransportVariant(NamedTuple):
    """A frame size and a GIL switch interval."""

    frame_kib: int
    """The transport's largest frame (`prfaas engine --transfer-chunk-kib`)."""
    gil_switch_ms: float
    """`sys.setswitchinterval`, in ms (`prfaas engine --gil-switch-ms`)."""
    sender: str = "loop"
    """`loop` (the engine's event loop) or `process` (`prfaas engine --kv-sender`)."""

    def label(self) -> str:
        """For progress lines and tables."""
        where = ", sender process" if self.sender == "process" else ""
        return f"{self.frame_kib} KiB frames, GIL switch {self.gil_switch_ms:g} ms{where}"


ENGINE_DEFAULT = TransportVariant(1024, 5.0)
"""`prfaas engine`'s frame size and Python's own switch interval."""
FEWER_HANDOFFS = TransportVariant(8192, 0.5)
"""Eight times fewer frames, and the GIL back to the event loop ten times sooner."""
SENDER_PROCESS = TransportVariant(1024, 0.5, "process")
"""The sockets in a process of its own; the engine's thread that hands each message over
still waits for the GIL after its copy and its command, so the shorter interval too."""


def parse(text: str) -> TransportVariant:
    """`KIB:MS[:process]` (e.g. `8192:0.5`, `1024:0.5:process`).

    Raises:
        ValueError: another form.
    """
    frame, switch, *where = text.split(":")
    if where not in ([], ["loop"], ["process"]):
        raise ValueError(f"expected KIB:MS[:process], got {text!r}")
    return TransportVariant(int(frame), float(switch), *where)

"""Engine configuration: role, batch and KV capacity, page size; the KV transport's egress."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from prfaas.engines.transport import SenderConfig, TlsConfig

ROLES = ("prefill", "decode", "both")
MIB = 2**20
DTYPES = ("float32", "bfloat16", "float16")
"""Weight and KV dtypes the engine runs in."""
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def is_device(device: str) -> bool:
    """Whether `device` names a torch device the engine runs on (`cpu`, `cuda`, `cuda:N`)."""
    return _DEVICE.fullmatch(device) is not None


def default_dtype(device: str) -> str:
    """The dtype an engine on `device` runs in unless told: float32 on the CPU (exact
    cross-checks against `transformers`), bfloat16 on a GPU (as serving engines run)."""
    return "float32" if device == "cpu" else "bfloat16"


@dataclass(frozen=True)
class EngineConfig:
    """Sizes and role of one reference engine; validated on construction."""

    role: str = "both"
    """prefill (compute prompts, ship KV), decode (receive KV, generate) or both."""
    max_batch: int = 32
    """Most requests in one decode step (continuous batching)."""
    kv_capacity_tokens: int = 65536
    """Tokens of full-attention KV the block pool holds (rounded down to whole blocks)."""
    block_size: int = 64
    """Tokens per KV block; prefix reuse and state snapshots are block-aligned."""
    num_state_slots: int = 256
    """Linear-state snapshots kept for prefix reuse."""
    max_prefill_tokens: int = 1024
    """Prompt tokens computed per engine step (rounded down to whole blocks): a long prompt
    is prefilled over several steps, interleaved with decode steps of running requests."""
    handoff_timeout_s: float = 240.0
    """How long a decode engine waits for a prefill engine's KV. The wait includes the
    prefill's queue, which under overload runs past a minute (a wait of 60 s lost those
    requests, each one after its prefill began); it stays under the gateway's read timeout
    of an engine (300 s), so a client gets the engine's own error, and a role switch's drain
    (`switch_role`, 600 s) outlasts it."""
    pull_timeout_s: float = 60.0
    """How long a prefix pull (`prefix_pull`) may take before the request computes the
    prefix itself: a pull is best effort, and the request waits for it."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_capacity_tokens < self.block_size:
            raise ValueError(
                f"kv_capacity_tokens must hold at least one block of {self.block_size}, "
                f"got {self.kv_capacity_tokens}"
            )
        if self.max_prefill_tokens < self.block_size:
            raise ValueError(
                f"max_prefill_tokens must be >= block_size ({self.block_size}), "
                f"got {self.max_prefill_tokens}"
            )
        if self.num_state_slots < 0:
            raise ValueError(f"num_state_slots must be >= 0, got {self.num_state_slots}")
        if not self.handoff_timeout_s > 0:
            raise ValueError(f"handoff_timeout_s must be > 0, got {self.handoff_timeout_s}")
        if not self.pull_timeout_s > 0:
            raise ValueError(f"pull_timeout_s must be > 0, got {self.pull_timeout_s}")

    @property
    def num_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_size


def _optional_positive(name: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number or unset, got {value!r}")


@dataclass(frozen=True)
class TransferConfig:
    """The prefill side's KV transport: connections, frame size and the egress link.

    The egress rate caps the whole process (every decode peer together), not each peer: a
    PrfaaS prefill instance's KV leaves its cluster through one shared egress link, so the
    emulated cross-DC link (or a scheduler's egress cap) is a per-process token bucket.
    """

    connections: int = 4
    """TCP connections each decode peer opens to this engine's bootstrap port."""
    chunk_bytes: int = MIB
    """Largest frame payload; also the pacing burst, so keep it small on a slow paced link."""
    egress_rate_bytes_per_s: float | None = None
    """Token-bucket cap of this process's KV egress (None: unpaced)."""
    egress_delay_s: float = 0.0
    """Added one-way delay of every KV frame (link emulation)."""
    capacity_bytes_per_s: float | None = None
    """Link capacity that telemetry utilisation is measured against (default: the rate)."""
    layerwise: bool = True
    """Put each layer's KV on the wire as soon as it is computed; False: hold every message
    until the prefill is over (send-after, the baseline layer-wise pipelining is measured
    against)."""
    sender_process: bool = False
    """Run the transport's sender in a process of its own (`ProcessSender`), fed through a
    shared ring, so that its socket work never takes the GIL from the forward pass."""

    def __post_init__(self) -> None:
        if not 1 <= self.connections <= 64:
            raise ValueError(f"transfer connections must be in 1..64, got {self.connections}")
        if not 4096 <= self.chunk_bytes <= 64 * MIB:
            raise ValueError(f"transfer chunk_bytes must be in 4096..{64 * MIB}, "
                             f"got {self.chunk_bytes}")  # fmt: skip
        _optional_positive("egress_rate_bytes_per_s", self.egress_rate_bytes_per_s)
        _optional_positive("capacity_bytes_per_s", self.capacity_bytes_per_s)
        if not (math.isfinite(self.egress_delay_s) and 0 <= self.egress_delay_s <= 10):
            raise ValueError(f"egress_delay_s must be in [0, 10] s, got {self.egress_delay_s}")

    def sender_config(
        self, host: str, port: int, auth_key: bytes = b"", tls: TlsConfig | None = None
    ) -> SenderConfig:
        """The transport's `SenderConfig` for a bootstrap listener on `host:port`; peers
        authenticate with `auth_key` (the deployment secret's transport key), over `tls`
        if given."""
        return SenderConfig(
            host=host,
            port=port,
            auth_key=auth_key,
            tls=tls,
            connections=self.connections,
            chunk_bytes=self.chunk_bytes,
            window_bytes=max(32 * MIB, self.chunk_bytes),
            process_rate_bytes_per_s=self.egress_rate_bytes_per_s,
            capacity_bytes_per_s=self.capacity_bytes_per_s,
            delay_s=self.egress_delay_s,
            pipelined=self.layerwise,
        )

"""`ConnectorConfig`: the connector's settings, from vLLM's `kv_connector_extra_config`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from prfaas.engines.transport import ReceiverConfig, SenderConfig

MBPS = 1e6 / 8  # bytes per second in one Mbit/s


@dataclass(frozen=True)
class ConnectorConfig:
    """How one vLLM instance's connector sends and receives KV."""

    bootstrap_host: str = "127.0.0.1"
    """Address the KV sender listens on (decode instances connect here)."""
    bootstrap_port: int = 0
    """KV sender port (the gateway hands it to decodes); 0 picks a free one."""
    connections: int = 4
    """TCP connections per decode peer."""
    pipelined: bool = True
    """True: each full-attention layer's KV leaves as soon as the layer has run (layer-wise);
    False: everything leaves after the prefill's last forward (send-after-prefill)."""
    egress_rate_mbps: float | None = None
    """Pace this instance's whole KV egress (emulated link), Mbit/s."""
    egress_delay_ms: float = 0.0
    """Added one-way delay of every KV frame (emulated distance)."""
    timeout_s: float = 120.0
    """Decode side: a transfer not complete within this fails its request."""
    trace_path: str | None = None
    """Append JSON lines of transfer events (layer sent/placed, forward end) here."""

    def __post_init__(self) -> None:
        if not 0 <= self.bootstrap_port < 65536:
            raise ValueError(f"bootstrap_port must be in 0..65535, got {self.bootstrap_port!r}")
        rate = self.egress_rate_mbps
        if rate is not None and not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"egress_rate_mbps must be > 0, got {rate!r}")
        if not 0 <= self.egress_delay_ms <= 10_000:
            raise ValueError(f"egress_delay_ms must be in [0, 10000], got {self.egress_delay_ms!r}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """From `kv_connector_extra_config`; unknown keys are an error naming them."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"unknown PrfaasConnector settings {unknown}; known: {sorted(known)}")
        return cls(**extra)

    def sender(self, auth_key: bytes = b"") -> SenderConfig:
        """The KV sender's settings; `auth_key`: the handshake's key (`transport_key()`)."""
        rate = self.egress_rate_mbps * MBPS if self.egress_rate_mbps else None
        return SenderConfig(
            auth_key=auth_key,
            host=self.bootstrap_host,
            port=self.bootstrap_port,
            connections=self.connections,
            pipelined=self.pipelined,
            process_rate_bytes_per_s=rate,
            delay_s=self.egress_delay_ms / 1000,
        )

    def receiver(self, auth_key: bytes = b"") -> ReceiverConfig:
        return ReceiverConfig(auth_key=auth_key)

"""`ConnectorConfig`: the connector's settings, from vLLM's `kv_connector_extra_config`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from prfaas.engines.transport import ReceiverConfig, SenderConfig

MBPS = 1e6 / 8  # bytes per second in one Mbit/s
LAYOUTS = frozenset({"auto", "NHD", "HND", "LBNHC", "LBHNC", "BLNHC", "BLHNC"})
"""Layouts whose pages are dense byte ranges per (layer, block); vLLM's LHBNC and BHLNC
interleave other blocks or layers inside a page's range and are refused."""


@dataclass(frozen=True)
class ConnectorConfig:
    """How one vLLM instance's connector sends and receives KV."""

    bootstrap_host: str = "127.0.0.1"
    """Address the KV sender listens on (decode instances connect here)."""
    bootstrap_port: int = 0
    """KV sender port of TP rank 0 (the gateway hands it to decodes); rank r listens on
    this port + r and a decode's rank r fetches from the prefill's port + r. 0 picks a free
    one (TP=1 only)."""
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
    pull_timeout_s: float = 30.0
    """A prefix pull not complete within this fails (the gateway then has the prompt
    computed): a source whose KV sender never answers costs this much before the
    recompute (a sender that answered and then went away, `connect_timeout_s`)."""
    trace_path: str | None = None
    """Append JSON lines of transfer events (layer sent/placed, forward end) here."""
    kv_cache_layout: str = "NHD"
    """The KV cache layout the connector asks vLLM for (`get_required_kvcache_layout`):
    "NHD" (LBNHC, the GPU backends' default), "HND" (LBHNC, FlashInfer on Blackwell), any
    `KVCacheLayout` name, or "auto" (vLLM's choice). The CPU backend reads only HND, which
    the connector then asks for. A prefill and a decode must end up with the same one: the
    decode checks it before placing a byte."""
    sender_process: bool = False
    """Run the KV sender in a process of its own (`ProcessSender`), fed through a shared
    ring, so that its socket work never takes the GIL from vLLM's forward pass."""
    send_budget_mb: float = 1024.0
    """Host memory that pages copied out of the KV cache may hold while they wait for the
    link (pinned on a GPU); a link slower than the prefill holds the forward back at this
    bound instead of growing host memory."""

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
        if not (math.isfinite(self.pull_timeout_s) and self.pull_timeout_s > 0):
            raise ValueError(f"pull_timeout_s must be > 0, got {self.pull_timeout_s!r}")
        if not (math.isfinite(self.send_budget_mb) and self.send_budget_mb > 0):
            raise ValueError(f"send_budget_mb must be > 0, got {self.send_budget_mb!r}")
        if not isinstance(self.sender_process, bool):
            raise ValueError(f"sender_process must be true or false, got {self.sender_process!r}")
        if self.kv_cache_layout not in LAYOUTS:
            raise ValueError(
                f"kv_cache_layout must be one of {sorted(LAYOUTS)}, got {self.kv_cache_layout!r}"
            )

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """From `kv_connector_extra_config`; unknown keys are an error naming them."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"unknown PrfaasConnector settings {unknown}; known: {sorted(known)}")
        return cls(**extra)

    @property
    def send_budget_bytes(self) -> int:
        return int(self.send_budget_mb * 2**20)

    def required_layout(self) -> str | None:
        """What `get_required_kvcache_layout` answers (None: no preference)."""
        return None if self.kv_cache_layout == "auto" else self.kv_cache_layout

    def sender_port(self, tp_rank: int) -> int:
        """The KV sender port of TP rank `tp_rank`."""
        if tp_rank and not self.bootstrap_port:
            raise ValueError("bootstrap_port 0 (a free port) works only with TP=1: a decode "
                             "finds rank r at the prefill's port + r")  # fmt: skip
        return peer_port(self.bootstrap_port, tp_rank) if self.bootstrap_port else 0

    def sender(self, auth_key: bytes = b"", tp_rank: int = 0) -> SenderConfig:
        """The KV sender's settings for TP rank `tp_rank`; `auth_key`: the handshake's key
        (`transport_key()`)."""
        rate = self.egress_rate_mbps * MBPS if self.egress_rate_mbps else None
        return SenderConfig(
            auth_key=auth_key,
            host=self.bootstrap_host,
            port=self.sender_port(tp_rank),
            connections=self.connections,
            pipelined=self.pipelined,
            process_rate_bytes_per_s=rate,
            delay_s=self.egress_delay_ms / 1000,
        )

    def receiver(self, auth_key: bytes = b"") -> ReceiverConfig:
        return ReceiverConfig(auth_key=auth_key)


def peer_port(base_port: int, tp_rank: int) -> int:
    """The port of TP rank `tp_rank` of an instance whose KV sender base port is
    `base_port` (a decode's rank r fetches from the prefill's rank r)."""
    port = base_port + tp_rank
    if not 0 < port < 65536:
        raise ValueError(f"bootstrap port {base_port} + TP rank {tp_rank} is not a port")
    return port

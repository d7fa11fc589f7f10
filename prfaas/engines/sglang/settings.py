"""Settings of the prfaas transfer backend, and the server flags it requires.

SGLang's server arguments have no room for a backend's own options, so they come from the
environment of the SGLang process (`PRFAAS_SGLANG_*`, read once per KV manager), with
defaults that suit one machine. Invalid values raise at start-up, naming the variable.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "PRFAAS_SGLANG_"
PREFILL_FLAG = "--disable-prefill-cuda-graph"


@dataclass(frozen=True)
class BackendSettings:
    """Transport settings of one SGLang engine (prefill or decode side)."""

    connections: int = 4
    """TCP connections per prefill/decode pair (`PRFAAS_SGLANG_CONNECTIONS`)."""
    transfer_timeout_s: float = 300.0
    """A transfer not delivered within this fails on both sides (`..._TRANSFER_TIMEOUT_S`)."""
    bind_host: str = ""
    """Where the prefill's transport listens (`..._BIND_HOST`); empty: the rank's own IP."""
    rate_bytes_per_s: float = 0.0
    """Pace each prefill's egress (`..._RATE_BYTES_PER_S`); 0: unpaced."""

    def __post_init__(self) -> None:
        if not 1 <= self.connections <= 64:
            raise ValueError(f"{ENV_PREFIX}CONNECTIONS must be in 1..64, got {self.connections}")
        for name in ("transfer_timeout_s", "rate_bytes_per_s"):
            value = getattr(self, name)
            if (
                not math.isfinite(value)
                or value < 0
                or (name == "transfer_timeout_s" and not value)
            ):
                raise ValueError(f"{ENV_PREFIX}{name.upper()} must be positive, got {value!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> BackendSettings:
        """Settings from `PRFAAS_SGLANG_*` variables (unset ones keep their defaults).

        Raises:
            ValueError: a variable that does not parse or is out of range (named).
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for name, kind in (
            ("connections", int),
            ("transfer_timeout_s", float),
            ("bind_host", str),
            ("rate_bytes_per_s", float),
        ):
            raw = env.get(f"{ENV_PREFIX}{name.upper()}")
            if raw is None:
                continue
            try:
                values[name] = kind(raw)
            except ValueError:
                raise ValueError(
                    f"{ENV_PREFIX}{name.upper()}={raw!r} is not "
                    + ("an integer" if kind is int else "a number")
                ) from None
        return cls(**values)


def check_prefill_args(server_args: Any) -> None:
    """Refuse a prefill server whose prefill forward may replay CUDA graphs.

    Layer-wise sending hooks each layer's forward; CUDA graph replay runs no Python hooks,
    so layers would never be handed over while the forward runs.

    Raises:
        ValueError: a prefill server with the prfaas backend and prefill CUDA graphs on.
    """
    if (
        getattr(server_args, "disaggregation_mode", None) == "prefill"
        and getattr(server_args, "disaggregation_transfer_backend", None) == "prfaas"
        and not getattr(server_args, "disable_prefill_cuda_graph", False)
        and not getattr(server_args, "disable_cuda_graph", False)
    ):
        raise ValueError(
            "the prfaas transfer backend sends KV layer by layer from forward hooks, which do "
            f"not run on CUDA graph replay: start the prefill server with {PREFILL_FLAG}"
        )

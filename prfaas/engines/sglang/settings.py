"""Settings of the prfaas transfer backend, and the server configurations it refuses.

SGLang's server arguments have no room for a backend's own options, so they come from the
environment of the SGLang process (`PRFAAS_SGLANG_*`, read once per KV manager), with
defaults that suit one machine. Invalid values raise at start-up, naming the variable.

A prefill that sends layer by layer runs a torch forward hook after each decoder layer
(`layer_tap.py`). In sglang 0.5.23 two paths run the decoder layers without calling their
modules, so no hook fires and nothing would leave before the forward ended:

- a prefill CUDA graph (`cuda_graph_config.prefill.backend` "breakable", the piecewise
  default on CUDA, or "full"): `PrefillCudaGraphRunner._execute_body_capture` replaces
  `layer_model.forward` by the graph's replay (`model_executor/model_runner.py` `_forward_raw`
  takes that path for every extend batch the runner `can_run_graph`);
- two-batch overlap (`enable_two_batch_overlap`): the MoE models that support it run their
  layers as operation lists (`batch_overlap/two_batch_overlap.py` `model_forward_stages`);
- PD multiplexing (`enable_pdmux`) splits one prefill forward across several `run_batch`
  calls (`forward_split_prefill`), which the per-batch page plan does not follow.

`check_prefill_args` refuses those for a layer-wise prefill. It reads what SGLang resolved
(`ServerArgs.resolve_once`: its own defaults and compatibility cascade, e.g. breakable on
CUDA unless disabled, an explicit `--cuda-graph-backend-prefill` winning over
`--disable-prefill-cuda-graph`), and before resolution (the CLI's `prepare_server_args`)
what the flags will resolve to by SGLang's precedence, assuming CUDA's default.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "PRFAAS_SGLANG_"
PREFILL_FLAG = "--disable-prefill-cuda-graph"
DEFAULT_SEND_BUDGET_BYTES = 1 << 30  # kv_pages.staging.DEFAULT_BUDGET_BYTES (no torch here)
DISABLED = "disabled"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


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
    layerwise: bool = True
    """Prefill: send each layer's pages (and, in the last chunk, its Mamba state) from the
    forward as soon as that layer ran (`..._LAYERWISE`); false: send everything after the
    last chunk's forward (the send-after baseline layer-wise sending is measured against)."""
    sender_process: bool = False
    """Prefill: run the KV sender in a process of its own (`ProcessSender`), so that its
    socket work never takes the GIL from SGLang's forward (`..._SENDER_PROCESS`)."""
    send_budget_bytes: int = DEFAULT_SEND_BUDGET_BYTES
    """Prefill: host memory that copied pages may hold while they wait for the link
    (`..._SEND_BUDGET_BYTES`); a spent budget holds the forward back."""

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
        if self.send_budget_bytes <= 0:
            raise ValueError(
                f"{ENV_PREFIX}SEND_BUDGET_BYTES must be positive, got {self.send_budget_bytes}"
            )

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
            ("layerwise", bool),
            ("send_budget_bytes", int),
            ("sender_process", bool),
        ):
            raw = env.get(f"{ENV_PREFIX}{name.upper()}")
            if raw is None:
                continue
            values[name] = _parse(f"{ENV_PREFIX}{name.upper()}", raw, kind)
        return cls(**values)


def _parse(variable: str, raw: str, kind: type) -> Any:
    if kind is bool:
        if raw.strip().lower() in _TRUE:
            return True
        if raw.strip().lower() in _FALSE:
            return False
        raise ValueError(f"{variable}={raw!r} is not a boolean (1/0, true/false)")
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(
            f"{variable}={raw!r} is not " + ("an integer" if kind is int else "a number")
        ) from None


def prefill_graph_backend(server_args: Any) -> str:
    """The prefill CUDA graph backend SGLang runs with ("breakable", "full", "disabled").

    Resolved arguments (`ServerArgs.resolve_once` ran, with a model) answer with SGLang's own
    decision; otherwise the flags by SGLang's precedence (`cuda_graph_hook.py`
    `parse_cuda_graph_config`: the JSON `--cuda-graph-config` > `--cuda-graph-backend-prefill`
    > `--disable-prefill-cuda-graph` / `--disable-cuda-graph` > the default, which is
    "breakable" on CUDA and assumed here, since a server's flags are checked before it knows
    its device).
    """
    config = _resolved(server_args, "cuda_graph_config")  # resolved, or the JSON flag's dict
    prefill = (
        config.get("prefill") if isinstance(config, Mapping) else getattr(config, "prefill", None)
    )
    backend = (
        prefill.get("backend")
        if isinstance(prefill, Mapping)
        else getattr(prefill, "backend", None)
    )
    if backend:
        return str(backend)
    chosen = _resolved(server_args, "cuda_graph_backend_prefill")
    if chosen:
        return str(chosen)
    if _resolved(server_args, "disable_prefill_cuda_graph") or _resolved(
        server_args, "disable_cuda_graph"
    ):
        return DISABLED
    return "breakable"


def _resolved(server_args: Any, field: str) -> Any:
    """`field` as SGLang resolved it (its declarations over the raw input), or the plain
    attribute of an object that is not a `ServerArgs`."""
    try:
        from sglang.srt.arg_groups.overrides import resolution_result
    except ImportError:  # pragma: no cover - only without SGLang
        return getattr(server_args, field, None)
    try:
        return resolution_result(server_args, field)
    except (AttributeError, TypeError, KeyError):
        return getattr(server_args, field, None)


def hook_bypasses(server_args: Any) -> list[str]:
    """What in `server_args` would run the prefill's decoder layers without their forward
    hooks (see the module docstring), each with the flag that turns it off."""
    reasons = []
    backend = prefill_graph_backend(server_args)
    if backend != DISABLED:
        reasons.append(
            f"the prefill CUDA graph (backend {backend!r}: its replay runs no layer hooks; "
            f"start with {PREFILL_FLAG} and no --cuda-graph-backend-prefill, or a "
            f'--cuda-graph-config prefill backend of "disabled")'
        )
    if _resolved(server_args, "enable_two_batch_overlap"):
        reasons.append(
            "two-batch overlap (layers run as operation lists: drop --enable-two-batch-overlap)"
        )
    if _resolved(server_args, "enable_pdmux"):
        reasons.append("PD multiplexing (split prefill forwards: drop --enable-pdmux)")
    return reasons


def check_prefill_args(server_args: Any, *, layerwise: bool | None = None) -> None:
    """Refuse a prfaas prefill server whose forward would bypass the layer hooks.

    `layerwise` defaults to `PRFAAS_SGLANG_LAYERWISE`; a send-after prefill
    (`PRFAAS_SGLANG_LAYERWISE=0`) hooks nothing and runs with any of them.

    Raises:
        ValueError: a layer-wise prfaas prefill with a configuration that bypasses the
            hooks (named, with the flag to change).
    """
    if (
        _resolved(server_args, "disaggregation_mode") != "prefill"
        or _resolved(server_args, "disaggregation_transfer_backend") != "prfaas"
    ):
        return
    if layerwise is None:
        layerwise = BackendSettings.from_env().layerwise
    reasons = hook_bypasses(server_args) if layerwise else []
    if reasons:
        raise ValueError(
            "the prfaas transfer backend sends KV layer by layer from forward hooks on the "
            "prefill's decoder layers, which do not run under "
            + "; nor under ".join(reasons)
            + f" (or send after the forward instead: {ENV_PREFIX}LAYERWISE=0)"
        )

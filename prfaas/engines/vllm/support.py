"""What the connector refuses at start, with a message saying why and what to change: the
deployments it cannot hand over correctly (no vLLM import: checked on vLLM's config objects
as they are, so the rules are testable without vLLM).

Handled, not refused: tensor parallelism with equal TP sizes (a port per rank, ranks
paired, checked by the layout signature), MLA and fp8 caches (moved as bytes), kernel-block
splitting, both model runners. Model Runner V2 (vLLM 0.32's CUDA default) starts the
step's loads after the forward and V1 before it; this connector's loads are asynchronous
(a request runs only once `get_finished` reports it) and its sends open at the step's first
saved layer or at `wait_for_save`, whichever comes first, so neither order matters.
"""

from __future__ import annotations

from typing import Any

from prfaas.engines.vllm.config import ConnectorConfig
from prfaas.engines.vllm.layout import PAGED_SPECS, STATE_SPECS


def check_supported(vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig) -> None:
    """Raise ValueError naming what this deployment needs that the connector cannot do."""
    parallel = getattr(vllm_config, "parallel_config", None)
    for attr, what in (
        ("pipeline_parallel_size", "pipeline parallelism"),
        ("data_parallel_size", "data parallelism inside one vLLM server (run one server per "
                               "replica, each with its own bootstrap port)"),
        ("decode_context_parallel_size", "decode context parallelism"),
        ("prefill_context_parallel_size", "prefill context parallelism"),
    ):  # fmt: skip
        size = int(getattr(parallel, attr, 1) or 1)
        if size > 1:
            raise ValueError(f"PrfaasConnector does not support {what} ({attr}={size})")
    tp = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    if tp > 1 and not config.bootstrap_port:
        raise ValueError(
            f"PrfaasConnector with tensor_parallel_size={tp} needs an explicit bootstrap_port "
            "(rank r listens on bootstrap_port + r; leave that many ports free)"
        )
    if kv_cache_config is None:
        return
    cache_mode = getattr(getattr(vllm_config, "cache_config", None), "mamba_cache_mode", None)
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        if kind not in PAGED_SPECS | STATE_SPECS:
            raise ValueError(
                f"PrfaasConnector does not move {kind} KV caches (layers "
                f"{list(group.layer_names)[:3]}...): it hands over every token's KV and the "
                f"linear states ({sorted(PAGED_SPECS | STATE_SPECS)})"
            )
        if kind in STATE_SPECS:
            check_state_spec(spec, cache_mode)


def check_state_spec(spec: Any, cache_mode: str | None) -> None:
    """Refuse Mamba groups whose prefill checkpoints vLLM takes inside a chunk.

    In "align" mode (prefix caching) the handoff point C is a block boundary where vLLM ends
    a prefill chunk and keeps the linear states in that block's slot. A backend that can
    export the checkpoint from inside a forward (`MambaSpec.num_prefill_checkpoint_blocks`
    > 0, `prefill_checkpoint_alignment` set: Mamba2 mixers in vLLM 0.32, i.e. NemotronH and
    Granite 4.0, and KDA) lets the scheduler run past C in one step, so the states at C are
    never in a slot when the layer hook runs; every transfer longer than a block would fail.
    Qwen3-Next's gated delta net sets neither and is handled.
    """
    mode = getattr(spec, "mamba_cache_mode", None)
    align = cache_mode == "align" or mode == "align"
    in_chunk = int(getattr(spec, "num_prefill_checkpoint_blocks", 0) or 0) > 0 or (
        getattr(spec, "prefill_checkpoint_alignment", None) is not None
    )
    if align and in_chunk:
        kind = getattr(getattr(spec, "mamba_type", None), "name", "this Mamba")
        raise ValueError(
            f"PrfaasConnector does not support {kind} layers whose prefill checkpoints vLLM "
            "takes inside a chunk (num_prefill_checkpoint_blocks="
            f"{getattr(spec, 'num_prefill_checkpoint_blocks', None)}, prefill_checkpoint_alignment="
            f"{getattr(spec, 'prefill_checkpoint_alignment', None)}; e.g. NemotronH, Granite 4.0): "
            "the scheduler does not stop at the handoff point, so the states there are never "
            "kept. Without prefix caching (--no-enable-prefix-caching) vLLM takes no such "
            "checkpoints and the handoff is the prompt's last token but one (not tested here "
            "with these models)."
        )

"""`PrfaasConnector`: vLLM's KV connector over the PrfaaS transport (hybrid models: HMA).

Load it with
`--kv-transfer-config '{"kv_connector": "PrfaasConnector", "kv_role": "kv_both",
"kv_connector_module_path": "prfaas.engines.vllm.connector",
"kv_connector_extra_config": {"bootstrap_port": 8998}}'` (settings: `ConnectorConfig`).
One instance may prefill for some requests and decode others; each request's
`kv_transfer_params` says which (`prfaas.protocol.kv_transfer`). vLLM creates one connector
per role: the scheduler's (`SchedulerSide`) and each worker's (`WorkerSide`).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from prfaas.engines.vllm.config import ConnectorConfig
from prfaas.engines.vllm.layout import GroupLayout, build_views, layer_index
from prfaas.engines.vllm.metadata import PrfaasMetadata
from prfaas.engines.vllm.scheduler_side import SchedulerSide, StateBlocks
from prfaas.engines.vllm.support import check_supported
from prfaas.engines.vllm.worker_side import WorkerSide

logger = logging.getLogger(__name__)


class PrfaasConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """Scheduler or worker half, by `role`; the other half's methods are never called."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._config = ConnectorConfig.from_extra(extra)
        check_supported(vllm_config, kv_cache_config, self._config)
        self._groups = GroupLayout.from_kv_cache_config(kv_cache_config)
        self._scheduler: SchedulerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            blocks = StateBlocks(vllm_config.cache_config, any(self._groups.is_state))
            self._scheduler = SchedulerSide(blocks)
        self._worker: WorkerSide | None = None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """The layout both sides of a transfer should run (`kv_cache_layout`, NHD unless
        set; the CPU backend reads only HND). vLLM drops a preference its backends cannot
        take, with a warning: the decode's signature check then names the difference."""
        from vllm.platforms import current_platform

        transfer = getattr(vllm_config, "kv_transfer_config", None)
        extra = getattr(transfer, "kv_connector_extra_config", None)
        config = ConnectorConfig.from_extra(extra)
        if current_platform.is_cpu():
            return "HND"
        return config.required_layout()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """`save_kv_layer` runs between a graph's pieces; a FULL graph (a step where every
        request has one token, e.g. a repeated prompt's last step after a prefix hit) would
        skip it and that step's pages would never leave."""
        return True

    # -- scheduler side ----------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        self._sched().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        """A transfer restores every group: pages and the linear states alike."""
        return tuple(self._kv_cache_config.transfer_group_ids)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> PrfaasMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request)

    # -- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        views = build_views(
            kv_caches,
            self._kv_cache_config,
            backend=_attention_backend(self._vllm_config, kv_caches),
            cache_dtype=str(self._vllm_config.cache_config.cache_dtype),
            tp_size=get_tensor_model_parallel_world_size(),
            tp_rank=get_tensor_model_parallel_rank(),
        )
        self._worker = WorkerSide(self._config, views, self._groups)
        logger.info(
            "PrfaasConnector: TP rank %d/%d KV sender on %s:%d, %d paged (%s, %s) and %d "
            "state layers",
            views.signature.tp_rank,
            views.signature.tp_size,
            self._config.bootstrap_host,
            self._worker.bootstrap_port,
            len(views.pages),
            views.signature.layout,
            views.signature.backend,
            len(views.states),
        )

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._work().start_recvs(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous (a request runs only once its KV has arrived)."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._work().save_layer(self._meta(), layer_index(layer_name))

    def wait_for_save(self) -> None:
        self._work().end_step(self._meta())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        assert meta is None or isinstance(meta, PrfaasMetadata)
        done, failed = self._work().transfer_results(finished_req_ids, meta)
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, _ = self._work().transfer_results(finished_req_ids, None)
        return None, done

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def _meta(self) -> PrfaasMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PrfaasMetadata)
        return meta

    def _sched(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side call on the worker connector"
        return self._scheduler

    def _work(self) -> WorkerSide:
        assert self._worker is not None, "register_kv_caches has not run"
        return self._worker


def _attention_backend(vllm_config: Any, kv_caches: dict[str, Any]) -> str:
    """The attention backend of the full-attention layers (how they read a page's bytes),
    from vLLM's layer registry; "" when it cannot tell."""
    context = getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}
    names = set()
    for name in kv_caches:
        backend = getattr(context.get(name), "attn_backend", None)
        if backend is not None and hasattr(backend, "get_name"):
            names.add(str(backend.get_name()))
    return "/".join(sorted(names))

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
from prfaas.engines.vllm.layout import GroupLayout, build_pool, layer_index
from prfaas.engines.vllm.metadata import PrfaasMetadata
from prfaas.engines.vllm.scheduler_side import SchedulerSide, StateBlocks
from prfaas.engines.vllm.worker_side import WorkerSide

logger = logging.getLogger(__name__)


class PrfaasConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """Scheduler or worker half, by `role`; the other half's methods are never called."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._config = ConnectorConfig.from_extra(extra)
        self._groups = GroupLayout.from_kv_cache_config(kv_cache_config)
        self._scheduler: SchedulerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            blocks = StateBlocks(vllm_config.cache_config, any(self._groups.is_state))
            self._scheduler = SchedulerSide(blocks)
        self._worker: WorkerSide | None = None

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
        pool = build_pool(kv_caches, self._kv_cache_config)
        self._worker = WorkerSide(self._config, pool, self._groups)
        logger.info(
            "PrfaasConnector: KV sender on %s:%d, %d paged and %d state layers",
            self._config.bootstrap_host,
            self._worker.bootstrap_port,
            len(pool.pages),
            len(pool.states),
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

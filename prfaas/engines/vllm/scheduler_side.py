"""The scheduler half of the connector: which requests send or receive, and their blocks.

Prefill (`do_remote_decode`): the request's last prompt token is dropped on arrival (the
decode computes it from the linear states at N-1, which a recurrent state cannot be rewound
to) and it stops after one token; every step that computes part of it becomes a `SendStep`.
Decode (`do_remote_prefill`): N-1 prompt tokens are loaded asynchronously into the blocks the
scheduler allocates, then vLLM computes the last one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from prfaas.engines.vllm.metadata import BlockIds, PrfaasMetadata, RecvStart, SendStep
from prfaas.protocol.kv_transfer import RemoteDecode, RemotePrefill, parse_kv_transfer_params

logger = logging.getLogger(__name__)


@dataclass
class _Sending:
    room: int
    prompt_len: int  # after truncation
    block_ids: BlockIds = ()


class SchedulerSide:
    """Per-request bookkeeping between vLLM's scheduler and the worker half."""

    def __init__(self) -> None:
        self._sending: dict[str, _Sending] = {}
        self._recvs: list[RecvStart] = []
        self._local_hits: dict[str, int] = {}

    def on_new_request(self, request: Any) -> None:
        side = _side(request)
        if isinstance(side, RemoteDecode) and request.num_prompt_tokens > 1:
            _truncate_last_token(request)
            self._sending[request.request_id] = _Sending(side.room, request.num_prompt_tokens)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        side = _side(request)
        if not isinstance(side, RemotePrefill):
            return 0, False
        count = request.num_prompt_tokens - 1 - num_computed_tokens
        if count <= 0:
            return 0, False
        self._local_hits[request.request_id] = num_computed_tokens
        return count, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        side = _side(request)
        if not isinstance(side, RemotePrefill) or num_external_tokens <= 0:
            return
        hit = self._local_hits.pop(request.request_id, 0)
        self._recvs.append(
            RecvStart(
                req_id=request.request_id,
                host=side.host,
                port=side.port,
                room=side.room,
                block_ids=tuple(list(ids) for ids in blocks.get_block_ids()),
                num_tokens=hit + num_external_tokens,
                skip_tokens=hit,
            )
        )
        # one transfer per request, even if it is scheduled again after the load
        request.kv_transfer_params = {**request.kv_transfer_params, "do_remote_prefill": False}

    def build_connector_meta(self, scheduler_output: Any) -> PrfaasMetadata:
        meta = PrfaasMetadata(
            recvs=self._recvs, idle=not scheduler_output.total_num_scheduled_tokens
        )
        self._recvs = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            sending = self._sending.get(new.req_id)
            if sending is not None:
                sending.block_ids = tuple(list(ids) for ids in new.block_ids)
                meta.sends.append(_step(new.req_id, sending, new.num_computed_tokens, scheduled))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            sending = self._sending.get(req_id)
            if sending is None:
                continue
            added = cached.new_block_ids[i]
            if added is not None:
                pairs = zip(sending.block_ids, added, strict=True)
                sending.block_ids = tuple([*old, *new] for old, new in pairs)
            meta.sends.append(_step(req_id, sending, cached.num_computed_tokens[i], scheduled))
        return meta

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """The worker copies pages as it sends them: blocks are freed at once."""
        self._sending.pop(request.request_id, None)
        self._local_hits.pop(request.request_id, None)
        return False, None


def _step(req_id: str, sending: _Sending, start: int, scheduled: dict[str, int]) -> SendStep:
    end = start + scheduled[req_id]
    return SendStep(req_id, sending.room, sending.block_ids, start, end, end >= sending.prompt_len)


def _side(request: Any) -> RemoteDecode | RemotePrefill | None:
    try:
        return parse_kv_transfer_params(request.kv_transfer_params)
    except ValueError as exc:
        logger.warning("request %s: ignoring kv_transfer_params: %s", request.request_id, exc)
        return None


def _truncate_last_token(request: Any) -> None:
    """Drop the prompt's last token and stop after one output token (vLLM's own Mooncake
    connector does the same for hybrid models)."""
    request.prompt_token_ids.pop()
    request._all_token_ids.pop()
    request.num_prompt_tokens -= 1
    request.max_tokens = 1

"""The scheduler half of the connector: which requests send or receive, and their blocks.

Both sides hand over at the same token C of an N-token prompt (`handoff`): the
prefill ships the KV of [0, C) and the linear states at C, the decode computes [C, N) itself
(a recurrent state cannot be rewound, so the decode must compute at least the last token to
sample from). With vLLM's Mamba "align" cache mode, C is where vLLM ends the aggregated
run's second-to-last chunk, so the decode's piece is the aggregated run's last chunk and the
states at C are final a whole chunk before the prefill's forward ends. A prompt of at most
one block is one chunk in the aggregated run: C is 0 and the decode computes all of it (any
other C splits that chunk, and bf16 kernels on other pieces flip near-tied greedy tokens).
Prefill (`do_remote_decode`): the prompt is cut on arrival (to C + 1 tokens in "align" mode:
vLLM then stops a chunk at C, as it does for the whole prompt) and it stops after one token;
every step that computes part of [0, C) becomes a `SendStep`, the one reaching C the last.
With C = 0 it sends nothing (no room is opened) and computes one token only, to answer.
Decode (`do_remote_prefill`): C prompt tokens are loaded asynchronously into the blocks the
scheduler allocates, then vLLM computes the rest (everything when C = 0: no transfer).
Prefix pull (`prefix_pull`, on a prefill or a lone request): the S tokens another instance
exports (its own prefill request on the prompt's first S + 1 tokens, whose handoff point is
S) are loaded the same way, then vLLM computes the rest; a prefill then sends from page 0,
the pulled pages too. S must be a handoff point of this request (a block boundary no later
than its own C), else nothing is pulled and the prompt is computed here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from prfaas.engines.vllm.metadata import BlockIds, PrfaasMetadata, RecvStart, SendStep
from prfaas.protocol.kv_transfer import (
    PrefixPull,
    RemoteDecode,
    RemotePrefill,
    parse_kv_transfer_params,
    parse_prefix_pull,
)

logger = logging.getLogger(__name__)


class Handoff(NamedTuple):
    """Where the prefill hands a prompt over to the decode."""

    tokens: int
    """C: the prompt tokens whose KV (and the linear states after them) the prefill sends."""
    prefill_tokens: int
    """The prefill's prompt, cut so that one of its chunks ends at C."""


def handoff(prompt_len: int, state_block: int | None) -> Handoff:
    """Where an N-token prompt is handed over.

    `state_block` is vLLM's block size when it caches Mamba states in "align" mode (None
    otherwise). There vLLM ends a prefill chunk at the last block boundary before the
    prompt's last token (`get_mamba_prefill_checkpoint_position`) and keeps the states at it
    in that block's slot: C is that boundary, and the prefill's prompt is C + 1 tokens (its
    chunks then end where the whole prompt's do, up to C). For a prompt of at most one block
    that boundary is 0: vLLM computes the prompt in one chunk, so the decode computes all of
    it (C = 0, the prefill's prompt one token, nothing sent). Handing over at N - 1 there
    instead splits that chunk into N - 1 tokens and a one-token step, whose bf16 kernels
    (chunked vs recurrent gated delta rule, prefill vs decode attention) move the first
    token's logprobs by up to 0.34 nats on the tiny model and flip near-tied greedy tokens.
    Elsewhere C is N - 1 and the prefill computes just those (vLLM's own Mooncake connector
    does the same for hybrid models).
    """
    if state_block is not None:
        boundary = (prompt_len - 1) // state_block * state_block
        return Handoff(boundary, boundary + 1)
    return Handoff(prompt_len - 1, max(prompt_len - 1, 1))


class StateBlocks:
    """vLLM's block size where it splits prefills at Mamba checkpoints ("align" mode), read
    when asked: vLLM may change `cache_config.block_size` after it has created the
    connector (the tiny model on CPU, left to choose its block size: 384 then, 128 when the
    scheduler splits; served with `--block-size`, that size throughout)."""

    def __init__(self, cache_config: Any, has_states: bool) -> None:
        self._cache, self._has_states = cache_config, has_states

    def __call__(self) -> int | None:
        if self._has_states and self._cache.mamba_cache_mode == "align":
            return int(self._cache.block_size)
        return None


@dataclass
class _Sending:
    room: int
    tokens: int  # C: the tokens whose KV goes out
    block_ids: BlockIds = ()


class SchedulerSide:
    """Per-request bookkeeping between vLLM's scheduler and the worker half."""

    def __init__(self, state_block: Callable[[], int | None]) -> None:
        self._state_block = state_block
        self._sending: dict[str, _Sending] = {}
        self._recvs: list[RecvStart] = []
        self._local_hits: dict[str, int] = {}
        self._pulls: dict[str, PrefixPull] = {}

    def on_new_request(self, request: Any) -> None:
        """A prefill request is cut to its part of the prompt; it sends only when the
        handoff point is past token 0 (otherwise the decode computes the whole prompt and
        never asks for the room)."""
        side = _side(request)
        if isinstance(side, RemoteDecode):
            point = handoff(request.num_prompt_tokens, self._state_block())
            _truncate(request, point.prefill_tokens)
            if point.tokens > 0:
                self._sending[request.request_id] = _Sending(side.room, point.tokens)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        side = _side(request)
        if not isinstance(side, RemotePrefill):
            return self._pull_tokens(request, num_computed_tokens)
        count = handoff(request.num_prompt_tokens, self._state_block()).tokens
        count -= num_computed_tokens
        if count <= 0:
            return 0, False
        self._local_hits[request.request_id] = num_computed_tokens
        return count, True

    def _pull_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """The tokens a prefix pull loads past the local hit (0: no pull, or one this
        request cannot use: past its own handoff point, off a state block, or no longer
        than the local hit; the room is then left to the source's register timeout)."""
        pull = _pull(request)
        if pull is None:
            return 0, False
        state_block = self._state_block()
        usable = handoff(request.num_prompt_tokens, state_block).tokens
        aligned = state_block is None or pull.tokens % state_block == 0
        if pull.tokens > usable or not aligned or pull.tokens <= num_computed_tokens:
            logger.info("request %s: prefix pull of %d tokens not used (local hit %d, "
                        "handoff %d)", request.request_id, pull.tokens, num_computed_tokens,
                        usable)  # fmt: skip
            return 0, False
        self._local_hits[request.request_id] = num_computed_tokens
        self._pulls[request.request_id] = pull
        return pull.tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        side, pull = _side(request), self._pulls.pop(request.request_id, None)
        source = pull if pull is not None else side
        if not isinstance(source, RemotePrefill | PrefixPull) or num_external_tokens <= 0:
            return
        hit = self._local_hits.pop(request.request_id, 0)
        self._recvs.append(
            RecvStart(
                req_id=request.request_id,
                host=source.host,
                port=source.port,
                room=source.room,
                block_ids=tuple(list(ids) for ids in blocks.get_block_ids()),
                num_tokens=hit + num_external_tokens,
                skip_tokens=hit,
                pull=pull is not None,
            )
        )
        # one transfer per request, even if it is scheduled again after the load
        params = {**request.kv_transfer_params}
        params.pop("prefix_pull", None)
        if isinstance(side, RemotePrefill):
            params["do_remote_prefill"] = False
        request.kv_transfer_params = params

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
                self._add_step(meta, new.req_id, sending, new.num_computed_tokens, scheduled)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            sending = self._sending.get(req_id)
            if sending is None:
                continue
            added = cached.new_block_ids[i]
            if added is not None:
                pairs = zip(sending.block_ids, added, strict=True)
                sending.block_ids = tuple([*old, *new] for old, new in pairs)
            self._add_step(meta, req_id, sending, cached.num_computed_tokens[i], scheduled)
        return meta

    def _add_step(
        self,
        meta: PrfaasMetadata,
        req_id: str,
        sending: _Sending,
        start: int,
        scheduled: dict[str, int],
    ) -> None:
        """The step computing [start, ...) sends up to C; the one reaching C is the last
        (the prefill's remaining token, [C, C + 1), sends nothing). A step that runs past C
        never had the states at C (vLLM did not stop there: other split rules than
        `handoff` knows): its transfer fails, naming both, rather than send wrong states."""
        end = start + scheduled[req_id]
        error = None
        if end > sending.tokens and start != sending.tokens:  # a hit at C kept its states
            error = (f"vLLM computed tokens {start}..{end} in one step, past the handoff point "
                     f"{sending.tokens}: the linear states there were not kept")  # fmt: skip
            logger.error("request %s: %s", req_id, error)
        end = min(end, sending.tokens)
        last = end == sending.tokens
        step = SendStep(req_id, sending.room, sending.block_ids, start, end, last, error)
        meta.sends.append(step)
        if last:
            del self._sending[req_id]

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """The worker copies pages as it sends them: blocks are freed at once."""
        self._sending.pop(request.request_id, None)
        self._local_hits.pop(request.request_id, None)
        self._pulls.pop(request.request_id, None)
        return False, None


def _side(request: Any) -> RemoteDecode | RemotePrefill | None:
    try:
        return parse_kv_transfer_params(request.kv_transfer_params)
    except ValueError as exc:
        logger.warning("request %s: ignoring kv_transfer_params: %s", request.request_id, exc)
        return None


def _pull(request: Any) -> PrefixPull | None:
    try:
        return parse_prefix_pull(request.kv_transfer_params)
    except ValueError as exc:
        logger.warning("request %s: ignoring prefix_pull: %s", request.request_id, exc)
        return None


def _truncate(request: Any, length: int) -> None:
    """Cut the prompt to its first `length` tokens and stop after one output token (in
    place: vLLM's read-only views of the lists stay valid). Its block hashes past `length`
    stay, unused: vLLM caps prefix-cache lookups at the prompt's length."""
    del request.prompt_token_ids[length:]
    del request._all_token_ids[length:]
    request.num_prompt_tokens = length
    request.max_tokens = 1

"""What the scheduler-side connector tells the worker-side one each step (plain values:
vLLM may pickle them across processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

BlockIds = tuple[list[int], ...]  # one block table per KV-cache group


@dataclass(frozen=True)
class SendStep:
    """Prefill side: this step computes tokens [start, end) of a request whose KV goes to
    room `room` (`end` capped at the tokens that go out); `last` when it reaches that cap."""

    req_id: str
    room: int
    block_ids: BlockIds
    start: int
    end: int
    last: bool
    error: str | None = None
    """Why the transfer fails instead (the step ran past the handoff point)."""


@dataclass(frozen=True)
class RecvStart:
    """Decode side: fetch `room` from host:port into the request's blocks: `num_tokens`
    tokens of KV (the first `skip_tokens` are a local prefix hit) and the linear states."""

    req_id: str
    host: str
    port: int
    room: int
    block_ids: BlockIds
    num_tokens: int
    skip_tokens: int
    pull: bool = False
    """A prefix pull (from another cluster's cache) rather than a prefill's handoff."""


@dataclass
class PrfaasMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's work for the worker side."""

    sends: list[SendStep] = field(default_factory=list)
    recvs: list[RecvStart] = field(default_factory=list)
    idle: bool = False
    """The step schedules no token: the engine is only polling for transfers."""

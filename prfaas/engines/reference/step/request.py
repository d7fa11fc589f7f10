"""One request inside the engine, and the events it emits towards its HTTP handler."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from prfaas.engines.reference.handoff.base import Outbox, Received
from prfaas.engines.reference.model.hybrid_cache import SeqState
from prfaas.engines.reference.step.prefill import PrefillRun
from prfaas.engines.reference.step.sampling import Choice, Constraint, TokenLogprob
from prfaas.protocol.generate import SamplingParams


class Phase(enum.Enum):
    WAITING = "waiting"  # queued for prefill (or for capacity after a received hand-off)
    RUNNING = "running"  # in the decode batch
    FINISHED = "finished"


@dataclass(frozen=True)
class TokenEvent:
    """New output tokens of a request, and its end when `finish_reason` is set."""

    token_ids: tuple[int, ...]
    finish_reason: dict[str, object] | None = None
    cached_tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    """Each new token's log-probabilities, when the request asked for them."""

    @classmethod
    def of(cls, choice: Choice, reason: dict[str, object] | None, cached: int) -> TokenEvent:
        lp = () if choice.logprob is None else (choice.logprob,)
        return cls((choice.token,), reason, cached, lp)


@dataclass(eq=False)
class Request:
    """Mutable engine-side request. Fields set by the HTTP side before submission are final;
    the engine thread owns the rest (`aborted` is the only flag written from outside)."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    emit: Callable[[TokenEvent], None]
    seed: int = 0  # sampling seed (resolved: given or random)
    outbox: Outbox | None = None  # prefill role: where KV goes
    received: Received | None = None  # decode role: the KV that came in
    constraint: Constraint | None = None  # a grammar over the output (structured output)
    output: list[int] = field(default_factory=list)
    phase: Phase = Phase.WAITING
    state: SeqState | None = None
    prefill: PrefillRun | None = None  # while the prompt is being computed
    cached_tokens: int = 0
    prompt_blocks_written: int = 0  # leading blocks whose KV pages are written
    boundary: SeqState | None = None  # linear states at the latest block boundary (decode)
    aborted: bool = False

    @property
    def num_computed(self) -> int:
        """Tokens whose KV and state exist (prompt + all outputs but the last)."""
        return len(self.prompt) + max(len(self.output) - 1, 0)

    def tokens_with_kv(self) -> list[int]:
        return (self.prompt + self.output)[: self.num_computed]

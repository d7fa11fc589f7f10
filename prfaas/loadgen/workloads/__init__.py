"""Workloads by name: `lognormal`, `mooncake:PATH`, `shared-prefix`, `multi-turn`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from prfaas.loadgen.tokens import TokenSpace
from prfaas.loadgen.workload import Workload
from prfaas.loadgen.workloads.lengths import LogNormalLengths, UniformLengths
from prfaas.loadgen.workloads.lognormal import LogNormalWorkload
from prfaas.loadgen.workloads.mooncake import MOONCAKE_BLOCK, MooncakeWorkload, TraceError
from prfaas.loadgen.workloads.multi_turn import MultiTurnWorkload
from prfaas.loadgen.workloads.shared_prefix import SharedPrefixWorkload

WORKLOADS = ("lognormal", "mooncake:PATH", "shared-prefix", "multi-turn")

__all__ = ["WORKLOADS", "TraceError", "WorkloadOptions", "create_workload"]


@dataclass(frozen=True)
class WorkloadOptions:
    """Every workload knob `prfaas bench` exposes; each workload reads the ones it uses."""

    inputs: LogNormalLengths = field(default_factory=LogNormalLengths)
    """lognormal: input lengths (the paper's by default)."""
    output_tokens: int | None = None
    """Output length; None: 1024 (lognormal), 256 (others), the trace's own (mooncake)."""
    output_range_ratio: float = 0.0
    """Output lengths uniform in +-ratio around `output_tokens` (0: fixed)."""
    space: TokenSpace = field(default_factory=TokenSpace)
    num_groups: int = 8
    system_len: int = 2048
    question_len: int = 256
    turns: int = 4
    first_len: int = 1024
    turn_len: int = 256
    think_time_s: float = 1.0
    block_size: int = MOONCAKE_BLOCK
    seed: int = 0
    """Seeds trace block contents (the rng seeds the rest)."""

    def outputs(self, default: int) -> UniformLengths:
        return UniformLengths(self.output_tokens or default, self.output_range_ratio)


def create_workload(spec: str, options: WorkloadOptions) -> Workload:
    """Build the workload named by `spec`.

    Raises:
        ValueError: unknown name or a bad option (named in the message).
        TraceError: a trace that cannot be read or replayed.
    """
    o = options
    if spec.startswith("mooncake:"):
        path = Path(spec.removeprefix("mooncake:"))
        return MooncakeWorkload.from_file(
            path,
            block_size=o.block_size,
            space=o.space,
            block_seed=o.seed,
            output_tokens=o.output_tokens,
        )
    if spec == "lognormal":
        return LogNormalWorkload(o.inputs, o.outputs(1024), o.space)
    if spec == "shared-prefix":
        questions = UniformLengths(o.question_len, o.output_range_ratio)
        return SharedPrefixWorkload(o.num_groups, o.system_len, questions, o.outputs(256), o.space)
    if spec == "multi-turn":
        first, follow = UniformLengths(o.first_len), UniformLengths(o.turn_len)
        return MultiTurnWorkload(o.turns, first, follow, o.outputs(256), o.think_time_s, o.space)
    raise ValueError(f"unknown workload {spec!r}; choose one of {', '.join(WORKLOADS)}")

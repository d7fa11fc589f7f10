"""Engine configuration: role, batch and KV capacity, page size."""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class EngineConfig:
    """Sizes and role of one reference engine; validated on construction."""

    role: str = "both"
    """prefill (compute prompts, ship KV), decode (receive KV, generate) or both."""
    max_batch: int = 32
    """Most requests in one decode step (continuous batching)."""
    kv_capacity_tokens: int = 65536
    """Tokens of full-attention KV the block pool holds (rounded down to whole blocks)."""
    block_size: int = 64
    """Tokens per KV block; prefix reuse and state snapshots are block-aligned."""
    num_state_slots: int = 256
    """Linear-state snapshots kept for prefix reuse."""
    max_prefill_tokens: int = 1024
    """Prompt tokens computed per engine step (rounded down to whole blocks): a long prompt
    is prefilled over several steps, interleaved with decode steps of running requests."""
    handoff_timeout_s: float = 60.0
    """How long a decode engine waits for a prefill engine's KV."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_capacity_tokens < self.block_size:
            raise ValueError(
                f"kv_capacity_tokens must hold at least one block of {self.block_size}, "
                f"got {self.kv_capacity_tokens}"
            )
        if self.max_prefill_tokens < self.block_size:
            raise ValueError(
                f"max_prefill_tokens must be >= block_size ({self.block_size}), "
                f"got {self.max_prefill_tokens}"
            )
        if self.num_state_slots < 0:
            raise ValueError(f"num_state_slots must be >= 0, got {self.num_state_slots}")
        if not self.handoff_timeout_s > 0:
            raise ValueError(f"handoff_timeout_s must be > 0, got {self.handoff_timeout_s}")

    @property
    def num_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_size

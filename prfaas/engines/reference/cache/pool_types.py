"""Value types of the hybrid prefix cache pool: config, errors, match, stats, request blocks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockPoolConfig:
    """Sizes of the hybrid prefix cache pool."""

    num_blocks: int
    """KV blocks shared by all full-attention layers."""
    block_size: int = 64
    """Tokens per KV block (the page size)."""
    num_state_slots: int = 64
    """Linear-state snapshot slots (0: no hybrid prefix reuse)."""

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "num_state_slots"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_state_slots < 0:
            raise ValueError(f"num_state_slots must be >= 0, got {self.num_state_slots}")


class BlockPoolError(Exception):
    """Base of the pool's errors; the pool is unchanged when one is raised."""


class OutOfKVCapacity(BlockPoolError):
    """An allocation needs more blocks than are free or evictable."""

    def __init__(self, requested: int, available: int) -> None:
        super().__init__(f"out of KV capacity: requested {requested} blocks, {available} available")
        self.requested = requested
        self.available = available


class StaleMatch(BlockPoolError):
    """A `PrefixMatch` no longer describes the pool (a block or snapshot was evicted)."""


@dataclass(frozen=True)
class PrefixMatch:
    """Longest cached prefix of a prompt (`BlockPool.match_prefix`).

    `block_ids` is the usable match for a hybrid model: blocks 0..k-1 cached AND a state
    snapshot (`state_slot`) saved at block k-1. `block_only_ids` is the longest match of KV
    blocks alone (>= k), what a pure full-attention model could reuse.
    """

    block_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    state_slot: int | None
    block_only_ids: tuple[int, ...]
    block_only_hashes: tuple[int, ...]
    block_size: int

    @property
    def num_tokens(self) -> int:
        """Tokens covered by the usable match."""
        return len(self.block_ids) * self.block_size

    @property
    def num_block_only_tokens(self) -> int:
        """Tokens covered by the block-only match."""
        return len(self.block_only_ids) * self.block_size

    def without_state(self) -> PrefixMatch:
        """The block-only match as the usable one (for pure full-attention callers)."""
        return PrefixMatch(
            block_ids=self.block_only_ids,
            block_hashes=self.block_only_hashes,
            state_slot=None,
            block_only_ids=self.block_only_ids,
            block_only_hashes=self.block_only_hashes,
            block_size=self.block_size,
        )


@dataclass(frozen=True)
class BlockPoolStats:
    """Occupancy snapshot (blocks and slots)."""

    num_blocks: int
    free_blocks: int
    cached_blocks: int
    evictable_blocks: int
    used_blocks: int
    num_state_slots: int
    held_state_slots: int
    num_requests: int


@dataclass
class RequestBlocks:
    """What the pool tracks for one request (internal to the pool; exposed for checks)."""

    blocks: list[int]
    transfer: bool
    num_indexed: int = 0  # blocks[:num_indexed] are this request's indexed chain
    last_hash: int | None = None  # hash of blocks[num_indexed - 1]
    chain_broken: bool = False  # a duplicate or a flush ended indexing for this request
    state_slot: int | None = None  # snapshot slot pinned by the match it was allocated with

"""`mooncake:PATH`: replay a Mooncake-format trace with the trace's exact prefix sharing.

One JSON object per line: `timestamp` (ms), `input_length`, `output_length`, `hash_ids`
(one id per 512-token block; equal ids mean a shareable prefix block). Block `h` is always
the same tokens (a pure function of `(h, seed)`), different ids give different tokens, and
the last block holds `input_length - block_size * (n - 1)` tokens, so a server's prefix
cache sees exactly the sharing in the trace.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

from prfaas.loadgen.tokens import TokenArray, TokenSpace
from prfaas.loadgen.workload import Session, Turn

MOONCAKE_BLOCK = 512


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the file and line."""


@dataclass(frozen=True)
class TraceEntry:
    """One validated trace line."""

    line: int
    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _entry(raw: object, line: int, block: int) -> TraceEntry:
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    ts, n_in, n_out, ids = (
        raw.get(k) for k in ("timestamp", "input_length", "output_length", "hash_ids")
    )
    if not isinstance(ts, int | float) or ts < 0:
        raise ValueError(f"timestamp must be a number >= 0, got {ts!r}")
    if not isinstance(n_out, int) or n_out < 0:
        raise ValueError(f"output_length must be an integer >= 0, got {n_out!r}")
    if not isinstance(ids, list) or not ids or not all(isinstance(h, int) for h in ids):
        raise ValueError(f"hash_ids must be a non-empty list of integers, got {ids!r}")
    if not isinstance(n_in, int) or not block * (len(ids) - 1) < n_in <= block * len(ids):
        raise ValueError(f"input_length {n_in!r} does not fit {len(ids)} blocks of {block} tokens")
    return TraceEntry(line, ts / 1000.0, n_in, max(1, n_out), tuple(ids))


def load_trace(path: Path, block_size: int = MOONCAKE_BLOCK) -> list[TraceEntry]:
    """Parse and validate a whole trace, sorted by timestamp (stable).

    Raises:
        TraceError: unreadable file, bad JSON, or a line that breaks the format.
    """
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from exc
    entries = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entries.append(_entry(orjson.loads(line), number, block_size))
        except (orjson.JSONDecodeError, ValueError) as exc:
            raise TraceError(f"{path}:{number}: {exc}") from exc
    if not entries:
        raise TraceError(f"trace {path} has no requests")
    return sorted(entries, key=lambda e: e.timestamp_s)


@dataclass(frozen=True)
class MooncakeWorkload:
    """Replays `entries` in timestamp order, timestamps relative to the first entry."""

    path: Path
    entries: tuple[TraceEntry, ...]
    block_size: int = MOONCAKE_BLOCK
    space: TokenSpace = field(default_factory=TokenSpace)
    block_seed: int = 0
    """Seeds the block contents; the same seed replays the same tokens."""
    output_tokens: int | None = None
    """Ask every request for this many output tokens instead of the trace's."""

    @classmethod
    def from_file(
        cls,
        path: Path,
        *,
        block_size: int = MOONCAKE_BLOCK,
        space: TokenSpace | None = None,
        block_seed: int = 0,
        output_tokens: int | None = None,
    ) -> MooncakeWorkload:
        """Load and validate `path` (see `load_trace`)."""
        entries = tuple(load_trace(path, block_size))
        return cls(path, entries, block_size, space or TokenSpace(), block_seed, output_tokens)

    @property
    def name(self) -> str:
        return f"mooncake:{self.path.name}"

    @property
    def has_timestamps(self) -> bool:
        return True

    def prompt(self, entry: TraceEntry, cache: dict[int, TokenArray] | None = None) -> TokenArray:
        """The prompt tokens of one trace entry (blocks of its hash ids, last one cut)."""
        cache = {} if cache is None else cache
        blocks = []
        for h in entry.hash_ids:
            if h not in cache:
                if len(cache) >= 8192:  # bound memory on long traces; blocks are recomputable
                    cache.clear()
                cache[h] = self.space.block(h, self.block_seed, self.block_size)
            blocks.append(cache[h])
        tail = entry.input_length - self.block_size * (len(blocks) - 1)
        blocks[-1] = blocks[-1][:tail]
        return np.concatenate(blocks)

    def sessions(self, rng: np.random.Generator) -> Iterator[Session]:
        cache: dict[int, TokenArray] = {}
        start = self.entries[0].timestamp_s
        for sid, entry in enumerate(self.entries):
            turn = Turn(self.prompt(entry, cache), self.output_tokens or entry.output_length)
            yield Session(sid, (turn,), timestamp_s=entry.timestamp_s - start, group=entry.line)

"""The per-request measurement record."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it. Times are seconds; `*_s` offsets are from run start.

    Token counts are the server's (`usage` / `meta_info`); None when it reported none.
    """

    request_id: str
    session_id: int
    turn: int
    scheduled_s: float
    """When the arrival process wanted the request sent."""
    start_s: float
    """When the client actually sent it."""
    ok: bool
    error: str | None
    status: int | None
    ttft_s: float | None
    e2e_s: float | None
    itl_s: tuple[float, ...]
    sent_tokens: int
    """Our own count of prompt tokens (ids sent, or words of text prompts)."""
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    route: str | None
    """`x-prfaas-route` response header (which prefill path served it), if present."""
    incremental_tokens: int | None
    """`x-prfaas-incremental-tokens` response header (uncached prompt length), if present."""

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (completion_tokens - 1)."""
        n = self.completion_tokens
        if self.ttft_s is None or self.e2e_s is None or n is None or n < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (n - 1)

    @property
    def end_s(self) -> float | None:
        """Completion time from run start."""
        return None if self.e2e_s is None else self.start_s + self.e2e_s

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (with `tpot_s`)."""
        out = asdict(self)
        out["itl_s"] = [round(x, 6) for x in self.itl_s]
        out["tpot_s"] = self.tpot_s
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        """Inverse of `to_json` (derived fields dropped)."""
        fields = {k: v for k, v in data.items() if k != "tpot_s"}
        fields["itl_s"] = tuple(fields["itl_s"])
        return cls(**fields)

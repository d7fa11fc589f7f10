"""What one gateway replica's request path saw, as it publishes it for the others.

Every replica of a coordinated deployment (`prfaas.coordination`) publishes a report every
`publish_s` under its own etcd key: the samples the long-term scheduler estimates from
(incremental lengths, answers and when their requests arrived, decode starts) since its
previous report, the predicted prefill seconds it dispatched to the PD prefill pool, and its
load now (requests decoding, the predicted prefill backlog it has booked on each instance).
The leader adds the samples to its own period, so it estimates the whole traffic; every
replica adds the others' load and PD prefill work to its own, so conditional disaggregation
predicts queues and the PD pool's offered load from all the traffic. Times are relative to
`at` (the publisher's wall clock), so replicas need no shared monotonic clock.
"""

from __future__ import annotations

import msgspec


class ReplicaReport(msgspec.Struct, frozen=True, kw_only=True):
    """One replica's report (JSON on the wire, compact: a few hundred bytes at a few
    requests per second)."""

    replica: str
    seq: int
    """Counts this replica's reports; a gap means some were missed (their samples lost)."""
    at: float
    """The publisher's wall-clock time (Unix seconds) when it made the report."""
    incremental: tuple[int, ...] = ()
    """Incremental lengths of the requests routed since the previous report."""
    outputs: tuple[int, ...] = ()
    """Answer lengths of the requests that finished since the previous report."""
    arrived_ago: tuple[float, ...] = ()
    """For each of `outputs`: seconds before `at` its request was first dispatched."""
    decode_starts: int = 0
    """Requests whose first token came out since the previous report."""
    local_work_s: float = 0.0
    """Predicted prefill seconds dispatched to the PD prefill pool since the previous report."""
    decoding: int = 0
    """Requests decoding now (first token out, not finished)."""
    backlog: dict[str, float] = {}
    """Predicted prefill backlog (seconds at `at`) this replica has booked per instance."""

    def encode(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> ReplicaReport:
        """Raises: msgspec.ValidationError, msgspec.DecodeError: not a report."""
        return msgspec.json.decode(data, type=cls)

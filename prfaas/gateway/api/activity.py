"""What the gateway did lately, for the live dashboard (`GET /dashboard`, `GET /admin/dashboard`).

`ActivityRecorder` keeps three bounded logs on the event loop's clock:
- a ring of finished requests (route, status, incremental length, TTFT, TPOT, E2E), booked by
  the completion service after the answer is written (off the request path);
- a timeline sampled once a second: `t`, regime, the role split per cluster, requests per
  second by route (and the cumulative counts, for rates over longer windows), link egress,
  capacity, retransmissions and RTT, queue depths, and TTFT and TPOT percentiles over the
  sliding window;
- decisions: timestamped changes of `t`, regime or roles with their reason (the schedulers and
  `POST /admin/state` report them through `decision`).
`snapshot(since)` is the JSON the page polls: everything newer than `since` plus the current
state, so a page that polls once a second receives each record once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from prfaas.gateway.api.window_stats import percentiles, rates

Snapshot = Callable[[], Mapping[str, Any]]
"""The gateway's current state (`Gateway.admin_state`), read at each sample and poll."""


class FinishedRequest(NamedTuple):
    """One finished request (a tuple: booked for every request, so cheap to build)."""

    at: float
    """Loop clock when it finished."""
    route: str
    """`prfaas`, `pd`, or `none` when it was refused before routing."""
    status: int
    incremental_tokens: int | None
    ttft_s: float | None
    tpot_s: float | None
    """Mean time per output token after the first; streamed answers of 2+ tokens only."""
    e2e_s: float | None


@dataclass(frozen=True)
class Decision:
    """A change of `t`, regime or roles and why it was made."""

    at: float
    kind: str
    """`threshold`, `regime` or `roles`."""
    reason: str
    before: Any
    after: Any
    source: str
    """Who decided: `operator` (POST /admin/state), `short_term`, `long_term`, ..."""


@dataclass(frozen=True)
class ActivityLimits:
    """How much the recorder keeps; every log is bounded."""

    requests: int = 2048
    """Finished requests kept (percentiles use those inside `window_s` of them)."""
    timeline: int = 600
    """Once-a-second samples kept (10 minutes)."""
    decisions: int = 256
    window_s: float = 60.0
    """Sliding window of the latency percentiles."""
    sample_interval_s: float = 1.0
    sent_requests: int = 1000
    """At most this many requests in one snapshot (the newest)."""

    def __post_init__(self) -> None:
        for name in ("requests", "timeline", "decisions", "sent_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("window_s", "sample_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


class ActivityRecorder:
    """Owns the logs and the once-a-second sampling task (`start`/`stop`)."""

    def __init__(
        self,
        state: Snapshot,
        limits: ActivityLimits | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.limits = limits or ActivityLimits()
        self._state = state
        self._clock = clock or (lambda: asyncio.get_running_loop().time())
        self.run_id = secrets.token_hex(6)
        """Changes when the gateway restarts: a page then drops what it kept."""
        self.requests: deque[FinishedRequest] = deque(maxlen=self.limits.requests)
        self.timeline: deque[dict[str, Any]] = deque(maxlen=self.limits.timeline)
        self.decisions: deque[Decision] = deque(maxlen=self.limits.decisions)
        self.totals: dict[str, int] = {}
        """Finished requests by route since start."""
        self.errors = 0
        """Finished requests whose status was not 200."""
        self._last_totals: tuple[float, dict[str, int]] | None = None
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ recording

    def finished(self, request: FinishedRequest) -> None:
        """Book one finished request (the completion service calls this off the request path)."""
        self.requests.append(request)
        self.totals[request.route] = self.totals.get(request.route, 0) + 1
        if request.status != 200:
            self.errors += 1

    def decision(
        self, kind: str, reason: str, before: Any, after: Any, source: str = "operator"
    ) -> None:
        """Record a decision (what a scheduler or an operator changed, and why)."""
        self.decisions.append(Decision(self._clock(), kind, reason, before, after, source))

    def sample(self) -> None:
        """Append one timeline point for now."""
        now = self._clock()
        totals = dict(self.totals)
        previous, self._last_totals = self._last_totals, (now, totals)
        state = self._state()
        link = state.get("link") or {}
        window = self._window(now)
        point: dict[str, Any] = {
            "at": now,
            "threshold": state["threshold"],
            "regime": state["regime"],
            "roles": _roles(state["clusters"]),
            "requests_per_s": rates(previous, (now, totals)),
            "totals": totals,
            "egress_bytes_per_s": link.get("egress_bytes_per_s"),
            "capacity_bytes_per_s": link.get("capacity_bytes_per_s"),
            "retransmission_rate": link.get("retransmission_rate"),
            "rtt_s": link.get("rtt_s"),
            "queue_running": state["queue"]["running"],
            "queue_waiting": state["queue"]["waiting"],
            "ttft_s": percentiles(r.ttft_s for r in window),
            "tpot_s": percentiles(r.tpot_s for r in window),
        }
        self.timeline.append(point)

    # ------------------------------------------------------------ reading

    def snapshot(self, since: float | None = None) -> dict[str, Any]:
        """The dashboard's JSON: current state, totals, window percentiles, and the
        requests, timeline points and decisions recorded after `since` (loop clock; the
        previous snapshot's `now`), or all of them when `since` is None."""
        now = self._clock()
        after = float("-inf") if since is None else since
        window = self._window(now)
        sent = _newer(self.requests, after)[-self.limits.sent_requests :]
        return {
            "run_id": self.run_id,
            "now": now,
            "window_s": self.limits.window_s,
            "state": dict(self._state()),
            "totals": dict(self.totals),
            "errors": self.errors,
            "latency": {
                "ttft_s": percentiles(r.ttft_s for r in window),
                "tpot_s": percentiles(r.tpot_s for r in window),
                "e2e_s": percentiles(r.e2e_s for r in window),
                "requests": len(window),
            },
            "requests": [r._asdict() for r in sent],
            "timeline": [p for p in self.timeline if p["at"] > after],
            "decisions": [_decision_json(d) for d in self.decisions if d.at > after],
        }

    def _window(self, now: float) -> list[FinishedRequest]:
        return _newer(self.requests, now - self.limits.window_s)

    # ------------------------------------------------------------ sampling task

    def start(self) -> None:
        """Sample now and then every `sample_interval_s` until `stop`."""
        self.sample()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.limits.sample_interval_s)
            self.sample()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


def _newer(requests: deque[FinishedRequest], after: float) -> list[FinishedRequest]:
    """The requests finished after `after`, oldest first (the ring is in time order, so
    this walks back from the newest end only as far as needed)."""
    newest = list(itertools.takewhile(lambda r: r.at > after, reversed(requests)))
    newest.reverse()
    return newest


def _roles(clusters: Mapping[str, Iterable[Mapping[str, Any]]]) -> dict[str, dict[str, int]]:
    """Healthy instances per cluster and role: `{"pd": {"prefill": 1, "decode": 2}, ...}`."""
    out: dict[str, dict[str, int]] = {}
    for cluster, members in clusters.items():
        counts = out.setdefault(cluster, {})
        for m in members:
            if m["healthy"]:
                counts[m["role"]] = counts.get(m["role"], 0) + 1
    return out


def _decision_json(d: Decision) -> dict[str, Any]:
    return {
        "at": d.at,
        "kind": d.kind,
        "reason": d.reason,
        "before": d.before,
        "after": d.after,
        "source": d.source,
    }

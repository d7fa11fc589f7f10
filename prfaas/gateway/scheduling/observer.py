"""The schedulers' hook on the request path (the Router's `RoutingObserver`).

Per request it books the predicted prefill time of each dispatch in a `BacklogLedger` (and
takes it back when the prefill ends), hands the routing policy a `LoadForecast` built from
those predictions, the PD prefill pool's busy share and offered load, and the last link
measurement (conditional disaggregation), and samples what the long-term loop estimates
from: arrivals, incremental lengths, output lengths. Times come from the running loop's
clock.

Among several gateway replicas (`prfaas.coordination`) it also keeps what this replica
publishes for the others (`report`: the samples since the previous report, its load now) and
adds what the others publish (`merge`): their samples to the period, their decoding
requests, booked backlog and PD prefill work to its own, so the estimates and predictions
cover all traffic.
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prfaas.gateway.router import RouteEvent
from prfaas.policies.backlog import BacklogLedger, merged_backlogs
from prfaas.policies.routing import RouteDecision
from prfaas.policies.ttft_forecast import LinkState, LoadForecast, PrefillCosts
from prfaas.protocol.replica_report import ReplicaReport

RECENT_LENGTHS = 100  # incremental lengths kept across periods for the step test
BUSY_SMOOTHING_S = 20.0
"""Time constant of the PD prefill pool's busy share and offered work
(`SchedulingObserver.local_busy_share`, `local_work`)."""


@dataclass
class PeriodSamples:
    """What requests did since the last long-term period."""

    started: float
    incremental: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    """When each of `outputs`' requests was first dispatched."""
    capacities: list[float] = field(default_factory=list)
    """Link capacity measured at each short-term tick (bytes/s)."""
    decoding: list[int] = field(default_factory=list)
    """Requests decoding (first token out, not finished) at each tick."""
    decode_starts: int = 0
    """Requests whose first token came out in the period (the decode stage's arrivals)."""

    def answers_since(self, at: float) -> list[int]:
        """The answers of the requests first dispatched at or after `at`."""
        return [n for n, t in zip(self.outputs, self.arrivals, strict=True) if t >= at]

    def mean_decoding(self) -> float | None:
        return sum(self.decoding) / len(self.decoding) if self.decoding else None

    def mean_capacity(self) -> float | None:
        caps = self.capacities
        return sum(caps) / len(caps) if caps else None


@dataclass
class _Outbox:
    """Samples since this replica's previous report."""

    incremental: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    decode_starts: int = 0
    local_work_s: float = 0.0


@dataclass(frozen=True)
class _RemoteLoad:
    decoding: int
    backlog: dict[str, float]
    at: float
    """This loop's clock when the report was made."""


class SchedulingObserver:
    """Implements `RoutingObserver`. `costs` None: no profile, so no predictions (the
    period's samples are still taken); `conditional` False: an offload past `t` is not
    conditional on the predictions (they still feed the trimmer's queues and check each
    prefix pull)."""

    def __init__(
        self,
        costs: PrefillCosts | None,
        *,
        conditional: bool = True,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.costs = costs
        self.conditional = conditional and costs is not None
        self.ledger = BacklogLedger()
        self.link: LinkState | None = None
        """The last link measurement (set by the short-term loop every tick)."""
        self._clock = clock or asyncio.get_running_loop().time
        self._samples = PeriodSamples(self._clock())
        self._decoding: set[str] = set()
        self._arrived: dict[str, float] = {}  # requests in flight: when first dispatched
        self.recent_lengths: collections.deque[int] = collections.deque(maxlen=RECENT_LENGTHS)
        """The last `RECENT_LENGTHS` incremental lengths routed, whatever the period."""
        self.lengths_routed = 0
        """Incremental lengths routed in all (which of `recent_lengths` are new)."""
        self._outbox: _Outbox | None = None  # kept once `report` was called
        self._remote: dict[str, _RemoteLoad] = {}
        self.local_busy_share = 0.0
        """The share of about the last `BUSY_SMOOTHING_S` in which the PD prefill pool had no
        idle instance, as the short-term loop sampled it (`local_pool_sampled`)."""
        self._busy_sampled_at: float | None = None
        self.local_work = DecayedRate(BUSY_SMOOTHING_S)
        """Predicted prefill seconds dispatched to the PD prefill pool, per second, on every
        replica: the load offered to it (in instances' worth of work)."""

    def now(self) -> float:
        return self._clock()

    def forecast(self) -> LoadForecast | None:
        if self.costs is None:
            return None
        now = self._clock()
        return LoadForecast(self.costs, self.backlogs(now), self.link, self.conditional,
                            self.local_busy_share, self.local_work.read(now))  # fmt: skip

    def backlogs(self, now: float) -> dict[str, float]:
        """Predicted backlog per instance: this gateway's bookings plus the other replicas'."""
        own = self.ledger.backlogs(now)
        if not self._remote:
            return own
        return merged_backlogs(own, [(r.backlog, now - r.at) for r in self._remote.values()])

    def dispatched(self, rid: str, decision: RouteDecision, request: str) -> None:
        self._arrived.setdefault(request, self._clock())
        self._samples.incremental.append(decision.incremental_tokens)
        if self._outbox is not None:
            self._outbox.incremental.append(decision.incremental_tokens)
        self.recent_lengths.append(decision.incremental_tokens)
        self.lengths_routed += 1
        if self.costs is not None:
            now = self._clock()
            seconds = self.occupancy_s(decision.route, decision.incremental_tokens)
            self.ledger.admit(decision.prefill_instance, rid, seconds, now)
            if decision.route == "pd":
                self.local_work.add(now, seconds)
                if self._outbox is not None:
                    self._outbox.local_work_s += seconds

    def occupancy_s(self, route: str, tokens: int) -> float:
        """Predicted seconds a prefill holds its instance: an instance takes its next request
        once its KV is sent, and KV streams layer by layer during the compute, so in PrfaaS
        it is the longer of the compute and the KV over the spare egress."""
        assert self.costs is not None
        seconds = self.costs.prefill_s(route, tokens)
        if route == "prfaas" and self.link is not None:
            spare = self.link.spare_bytes_per_s()
            if spare > 0:
                seconds = max(seconds, float(self.costs.kv_bytes(max(tokens, 1))) / spare)
        return seconds

    def prefill_ended(self, rid: str, decision: RouteDecision) -> None:
        self.ledger.finish(decision.prefill_instance, rid, self._clock())

    def first_token(self, rid: str) -> None:
        self._decoding.add(rid)
        self._samples.decode_starts += 1
        if self._outbox is not None:
            self._outbox.decode_starts += 1

    def finished(self, event: RouteEvent) -> None:
        self._decoding.discard(event.rid)
        arrived = self._arrived.pop(event.rid, -math.inf)
        if event.error is None:
            self._samples.outputs.append(event.completion_tokens)
            self._samples.arrivals.append(arrived)
            if self._outbox is not None:
                self._outbox.outputs.append(event.completion_tokens)
                self._outbox.arrivals.append(arrived)

    def measured(self, link: LinkState | None) -> None:
        """The short-term loop's link measurement of this tick."""
        self.link = link
        if link is not None:
            self._samples.capacities.append(link.capacity_bytes_per_s)
        self._samples.decoding.append(self.decoding_now)

    def local_pool_sampled(self, backlog_s: float) -> None:
        """The short-term loop read the PD prefill pool's least backlog (`pool_backlog`):
        fold whether the pool was busy into `local_busy_share`."""
        now = self._clock()
        last, self._busy_sampled_at = self._busy_sampled_at, now
        if last is not None:
            self.local_busy_share = decayed_share(
                self.local_busy_share, backlog_s > 0, now - last, BUSY_SMOOTHING_S
            )

    def pool_backlog(self, instance_ids: Iterable[str]) -> float:
        """The least predicted backlog in a pool (0 for an empty pool: nothing to wait on)."""
        backlogs = self.backlogs(self._clock())
        return min((backlogs.get(i, 0.0) for i in instance_ids), default=0.0)

    @property
    def decoding_now(self) -> int:
        """Requests decoding now (first token out, not finished), on every replica."""
        return len(self._decoding) + sum(r.decoding for r in self._remote.values())

    def report(self, replica: str, seq: int, wall_now: float) -> ReplicaReport:
        """What this replica saw since its previous report (the first call starts the
        outbox: it holds nothing before), and its load now."""
        box, self._outbox = self._outbox or _Outbox(), _Outbox()
        now = self._clock()
        return ReplicaReport(
            replica=replica,
            seq=seq,
            at=wall_now,
            incremental=tuple(box.incremental),
            outputs=tuple(box.outputs),
            arrived_ago=tuple(max(now - t, 0.0) for t in box.arrivals),
            decode_starts=box.decode_starts,
            local_work_s=box.local_work_s,
            decoding=len(self._decoding),
            backlog=self.ledger.backlogs(now),
        )

    def merge(self, report: ReplicaReport, age_s: float) -> None:
        """Add another replica's report, made `age_s` seconds ago: its samples to this
        period's (and to the recent lengths), its load in place of its previous report's."""
        now = self._clock()
        made = now - max(age_s, 0.0)
        samples = self._samples
        samples.incremental.extend(report.incremental)
        self.recent_lengths.extend(report.incremental)
        self.lengths_routed += len(report.incremental)
        samples.outputs.extend(report.outputs)
        samples.arrivals.extend(made - ago for ago in report.arrived_ago)
        samples.decode_starts += report.decode_starts
        self.local_work.add(now, report.local_work_s)
        self._remote[report.replica] = _RemoteLoad(report.decoding, report.backlog, made)

    def forget(self, replica: str) -> None:
        """Another replica left (its report's key expired): its load no longer counts."""
        self._remote.pop(replica, None)

    @property
    def replicas_heard(self) -> tuple[str, ...]:
        """The other replicas whose load counts now."""
        return tuple(sorted(self._remote))

    @property
    def num_samples(self) -> int:
        """Requests routed since the last `take_samples`."""
        return len(self._samples.incremental)

    def peek_samples(self) -> PeriodSamples:
        """The samples since the last `take_samples`, which keeps them (read them only)."""
        return self._samples

    def take_samples(self) -> PeriodSamples:
        """The samples since the last call; a new period starts now."""
        samples, self._samples = self._samples, PeriodSamples(self._clock())
        return samples


class DecayedRate:
    """A rate (per second) over about the last `tau` seconds: each amount added counts
    `1 / tau` per unit at once and fades by `e` every `tau` seconds (an exponential
    average, so a steady stream of `r` per second reads `r`)."""

    def __init__(self, tau: float) -> None:
        self.tau = tau
        self._rate = 0.0
        self._at: float | None = None

    def read(self, now: float) -> float:
        if self._at is None:
            return 0.0
        return self._rate * math.exp(-max(now - self._at, 0.0) / self.tau)

    def add(self, now: float, amount: float) -> None:
        if amount:
            self._rate, self._at = self.read(now) + amount / self.tau, now


def decayed_share(share: float, now_true: bool, dt: float, tau: float) -> float:
    """An exponential average of a yes/no reading taken every `dt` seconds: the share of
    about the last `tau` seconds in which it read yes."""
    keep = math.exp(-max(dt, 0.0) / tau)
    return share * keep + (1.0 - keep) * float(now_true)

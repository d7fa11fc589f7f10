"""The schedulers' hook on the request path (the Router's `RoutingObserver`).

Per request it books the predicted prefill time of each dispatch in a `BacklogLedger` (and
takes it back when the prefill ends), hands the routing policy a `LoadForecast` built from
those predictions and the last link measurement (conditional disaggregation), and samples
what the long-term loop estimates from: arrivals, incremental lengths, output lengths.
Times come from the running loop's clock.
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prfaas.gateway.router import RouteEvent
from prfaas.policies.backlog import BacklogLedger
from prfaas.policies.routing import RouteDecision
from prfaas.policies.ttft_forecast import LinkState, LoadForecast, PrefillCosts

RECENT_LENGTHS = 100  # incremental lengths kept across periods for the step test


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


class SchedulingObserver:
    """Implements `RoutingObserver`. `costs` None: no profile, so no predictions (the
    period's samples are still taken); `conditional` False: predictions feed the trimmer's
    queues but are not given to the policy."""

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

    def now(self) -> float:
        return self._clock()

    def forecast(self) -> LoadForecast | None:
        if not self.conditional or self.costs is None:
            return None
        return LoadForecast(self.costs, self.ledger.backlogs(self._clock()), self.link)

    def dispatched(self, rid: str, decision: RouteDecision, request: str) -> None:
        self._arrived.setdefault(request, self._clock())
        self._samples.incremental.append(decision.incremental_tokens)
        self.recent_lengths.append(decision.incremental_tokens)
        self.lengths_routed += 1
        if self.costs is not None:
            seconds = self.occupancy_s(decision.route, decision.incremental_tokens)
            self.ledger.admit(decision.prefill_instance, rid, seconds, self._clock())

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

    def finished(self, event: RouteEvent) -> None:
        self._decoding.discard(event.rid)
        arrived = self._arrived.pop(event.rid, -math.inf)
        if event.error is None:
            self._samples.outputs.append(event.completion_tokens)
            self._samples.arrivals.append(arrived)

    def measured(self, link: LinkState | None) -> None:
        """The short-term loop's link measurement of this tick."""
        self.link = link
        if link is not None:
            self._samples.capacities.append(link.capacity_bytes_per_s)
        self._samples.decoding.append(len(self._decoding))

    def pool_backlog(self, instance_ids: Iterable[str]) -> float:
        """The least predicted backlog in a pool (0 for an empty pool: nothing to wait on)."""
        now = self._clock()
        return min((self.ledger.backlog(i, now) for i in instance_ids), default=0.0)

    @property
    def decoding_now(self) -> int:
        """Requests decoding now (first token out, not finished)."""
        return len(self._decoding)

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

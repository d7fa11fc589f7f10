"""The cross-cluster link as the gateway sees it: egress telemetry of the PrfaaS prefill
instances' KV transports, polled from each engine's `GET /transfer_stats`.

The link itself lives in the engines: a PrfaaS prefill engine paces its own KV egress (the
transport's per-process token bucket, `prfaas engine --egress-rate-mbps`), so KV bytes
never pass through the gateway. `EgressMonitor` keeps the latest sample per instance and
publishes their sum for `/admin/state` (`link`) and `/metrics` (`prfaas_egress_*`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

logger = logging.getLogger(__name__)
TRANSFER_STATS_PATH = "/transfer_stats"


class NoTelemetry(ValueError):
    """The engine has no `/transfer_stats` (404): it does not run our transport."""


@dataclass(frozen=True)
class EgressSample:
    """One instance's transport telemetry (the fields of `/transfer_stats` the gateway uses)."""

    at: float
    """The engine's loop clock when sampled (differences between samples are durations)."""
    egress_bytes_per_s: float
    bytes_total: int
    capacity_bytes_per_s: float | None
    utilisation: float | None
    retransmission_rate: float
    rtt_s: float | None
    active_transfers: int

    @classmethod
    def from_json(cls, body: Any) -> EgressSample:
        """Parse a `/transfer_stats` body. Raises ValueError if a field is missing or mistyped."""
        try:
            return cls(
                at=float(body["at"]),
                egress_bytes_per_s=float(body["egress_bytes_per_s"]),
                bytes_total=int(body["bytes_total"]),
                capacity_bytes_per_s=_opt(body["capacity_bytes_per_s"]),
                utilisation=_opt(body["utilisation"]),
                retransmission_rate=float(body["retransmission_rate"]),
                rtt_s=_opt(body["rtt_s"]),
                active_transfers=int(body["active_transfers"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad {TRANSFER_STATS_PATH} body: {exc!r}") from exc


def _opt(value: Any) -> float | None:
    return None if value is None else float(value)


async def fetch_sample(
    session: aiohttp.ClientSession, base_url: str, headers: Mapping[str, str] | None = None
) -> EgressSample:
    """GET `base_url/transfer_stats` (with `headers`: the engine's control token).
    Raises aiohttp.ClientError, TimeoutError, ValueError."""
    timeout = aiohttp.ClientTimeout(total=2.0)
    url = f"{base_url}{TRANSFER_STATS_PATH}"
    async with session.get(url, timeout=timeout, headers=headers) as resp:
        if resp.status == 404:
            raise NoTelemetry(f"{base_url} has no {TRANSFER_STATS_PATH}")
        if resp.status != 200:
            raise ValueError(f"{TRANSFER_STATS_PATH} answered {resp.status}")
        return EgressSample.from_json(await resp.json())


class EgressMonitor:
    """Polls the PrfaaS prefill instances' `/transfer_stats` (`urls`: instance id -> base
        URL); `state` is the live JSON for `/admin/state`, `samples` the latest per instance
    (`gateway/api/metrics.py` turns them into `/metrics` gauges).

        An instance that answers 404 (an engine without the transport, e.g. SGLang) is skipped
        from then on; any other failure keeps its last sample out of the sums until it answers.
    """

    def __init__(
        self,
        urls: Mapping[str, str],
        static: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self._urls = dict(urls)
        self._headers = dict(headers or {})
        self._session: aiohttp.ClientSession | None = None
        self.samples: dict[str, EgressSample] = {}
        self.state: dict[str, Any] = {**(static or {}), "instances": {}}

    async def poll(self) -> None:
        """Sample every instance once (mutates `samples` and `state`)."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        await asyncio.gather(*(self._poll(i, u) for i, u in list(self._urls.items())))
        self._publish()

    async def _poll(self, instance_id: str, url: str) -> None:
        assert self._session is not None
        try:
            self.samples[instance_id] = await fetch_sample(self._session, url, self._headers)
        except NoTelemetry:
            logger.info("%s has no transport telemetry; not polled again", instance_id)
            del self._urls[instance_id]
        except (aiohttp.ClientError, TimeoutError, ValueError):
            self.samples.pop(instance_id, None)

    def relocate(self, instance_id: str, url: str) -> None:
        """Poll `instance_id` at a new base URL (its engine restarted elsewhere)."""
        if instance_id in self._urls:
            self._urls[instance_id] = url

    def _publish(self) -> None:
        s = list(self.samples.values())
        rate = sum(x.egress_bytes_per_s for x in s)
        capped = [x for x in s if x.capacity_bytes_per_s]  # utilisation of known capacity
        caps = [x.capacity_bytes_per_s or 0.0 for x in capped]
        rtts = [x.rtt_s for x in s if x.rtt_s is not None]
        util = sum(x.egress_bytes_per_s for x in capped) / sum(caps) if caps else None
        self.state.update(
            egress_bytes_per_s=rate,
            egress_bytes_total=sum(x.bytes_total for x in s),
            capacity_bytes_per_s=sum(caps) if caps else None,
            egress_utilisation=util,
            retransmission_rate=max((x.retransmission_rate for x in s), default=0.0),
            rtt_s=sum(rtts) / len(rtts) if rtts else None,
            active_transfers=sum(x.active_transfers for x in s),
            instances={i: asdict(x) for i, x in self.samples.items()},
        )
        if self.state["egress_utilisation"] is None:
            del self.state["egress_utilisation"]  # unknown: no instance reports a capacity

    async def close(self) -> None:
        if self._session is not None:
            with contextlib.suppress(Exception):
                await self._session.close()
            self._session = None

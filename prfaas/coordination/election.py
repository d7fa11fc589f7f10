"""Leader election among gateway replicas on one lease-bound etcd key.

A replica campaigns by granting itself a lease and creating the election key (value: its
replica id) bound to it, only if the key does not exist. The one that creates it leads, and
renews the lease every ttl/3; the key's create_revision is its epoch, so epochs strictly
increase from one leader to the next. The others follow: they watch the key and campaign
again the moment it is deleted (a resignation revokes the lease; a crashed leader's lease
expires), and re-read it every ttl in case a watch stalls.

A leader knows it leads only until its local deadline: the send time of its last renewal
that etcd answered, plus the TTL (etcd's lease started no earlier, so it cannot outlive the
deadline). It steps down the moment it passes, whether or not etcd can be reached, and
`leading_now()` says False past it even before the loop notices, so a process that was
paused and wakes up does not act as a leader on an old belief.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from prfaas.coordination.etcd import EtcdClient, EtcdError, KeyValue

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Leadership:
    """What a replica knows of the election: its role; the epoch (the etcd revision that
    made the current leader leader, 0 when unknown); the leader's replica id (None when
    unknown); whether etcd answered its last call."""

    role: Literal["leader", "follower"]
    epoch: int
    leader: str | None
    store_up: bool


UNKNOWN = Leadership("follower", 0, None, True)
"""Before the first answer from etcd, and after `stop()`."""


def renewed_deadline(sent_at: float, ttl_s: float, answered_ttl: int) -> float | None:
    """The lead's local deadline after a keepalive sent at `sent_at` was answered with
    `answered_ttl` seconds left; None when etcd says the lease is gone (TTL <= 0)."""
    if answered_ttl <= 0:
        return None
    return sent_at + min(ttl_s, answered_ttl)


def holds_key(holder: KeyValue | None, lease: int) -> bool:
    """Whether the election key (as read) is still the one bound to our lease."""
    return holder is not None and holder.lease == lease


def follower_of(holder: KeyValue) -> Leadership:
    """A follower's view of the key's holder (the store just answered)."""
    return Leadership("follower", holder.create_revision, holder.value.decode(), True)


class Election:
    """Campaigns for `key` on `client` as `replica_id` until stopped; `on_change` is called
    (from the election's task or `stop()`; it must not raise) exactly when the `Leadership`
    changes.
    `ttl_s` is the lease's TTL (etcd's is whole seconds: rounded up there, while the local
    deadline keeps `ttl_s`); `clock` is monotonic seconds."""

    def __init__(
        self,
        client: EtcdClient,
        *,
        key: str,
        replica_id: str,
        ttl_s: float,
        on_change: Callable[[Leadership], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"Election ttl_s must be > 0, got {ttl_s}")
        self._client = client
        self._key = key
        self._replica_id = replica_id
        self._ttl_s = ttl_s
        self._on_change = on_change
        self._clock = clock
        self._leadership = UNKNOWN
        self._deadline = -math.inf
        self._lease: int | None = None  # granted, not known to be revoked
        self._task: asyncio.Task[None] | None = None

    @property
    def leadership(self) -> Leadership:
        return self._leadership

    def leading_now(self) -> bool:
        """Leader, and the local deadline has not passed (checked against the clock now,
        not only when the loop last woke)."""
        return self._leadership.role == "leader" and self._clock() < self._deadline

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("Election already started")
        self._task = asyncio.create_task(self._run(), name=f"election {self._key}")

    async def stop(self, *, resign: bool = True) -> None:
        """Stop campaigning. `resign` revokes the lease held, so that another replica leads
        at once; without it the lease is left to expire, as after a crash."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if resign and self._lease is not None:
            await self._release(self._lease)
        self._lease = None
        self._deadline = -math.inf
        self._set(UNKNOWN)

    async def _run(self) -> None:
        while True:
            try:
                await self._round()
            except EtcdError as exc:
                if self._leadership.store_up:
                    logger.warning("election %s: etcd unreachable: %s", self._key, exc)
                self._set(replace(self._leadership, store_up=False))
                await asyncio.sleep(self._ttl_s / 3)

    async def _round(self) -> None:
        """Lead if the key is free (until the lead is lost), else follow its holder until
        it goes or the re-read period passes."""
        holder, revision = await self._client.get_with_revision(self._key)
        if holder is not None and holder.lease == self._lease:
            await self._client.revoke(holder.lease)  # ours, from a lead lost while etcd was down
            self._lease = None
            return
        if holder is None:
            if await self._campaign():
                return
            holder, revision = await self._client.get_with_revision(self._key)
            if holder is None:
                return  # gone again already: campaign at once
        self._set(follower_of(holder))
        await self._follow(revision + 1)

    async def _campaign(self) -> bool:
        """Try to create the key; True if we did (and have led since, and stepped down)."""
        sent = self._clock()
        lease = self._lease = await self._client.grant(math.ceil(self._ttl_s))
        try:
            epoch = await self._client.create(self._key, self._replica_id.encode(), lease=lease)
        except EtcdError:
            await self._release(lease)
            raise
        if epoch is None:
            await self._release(lease)
            return False
        await self._lead(lease, epoch, sent + self._ttl_s)
        return True

    async def _lead(self, lease: int, epoch: int, deadline: float) -> None:
        self._deadline = deadline
        self._set(Leadership("leader", epoch, self._replica_id, True))
        logger.info("election %s: %s leads (epoch %d)", self._key, self._replica_id, epoch)
        while await self._renew(lease):
            pass
        logger.info("election %s: %s stepped down", self._key, self._replica_id)
        await self._release(lease)

    async def _renew(self, lease: int) -> bool:
        """Wait for the next renewal and renew; False once the lead is lost (deadline
        passed, lease gone, key no longer ours), having stepped down."""
        await asyncio.sleep(max(0.0, min(self._ttl_s / 3, self._deadline - self._clock())))
        sent = self._clock()
        if sent >= self._deadline:
            self._step_down(self._leadership.store_up)
            return False
        try:
            async with asyncio.timeout(self._deadline - sent):  # too late past it anyway
                answered = await self._client.keepalive(lease)
                holder = await self._client.get(self._key) if answered > 0 else None
        except (EtcdError, TimeoutError):
            self._set(replace(self._leadership, store_up=False))
            return True  # the next turn steps down if nothing renews by the deadline
        deadline = renewed_deadline(sent, self._ttl_s, answered)
        if deadline is None or not holds_key(holder, lease):
            self._step_down(True)
            return False
        self._deadline = deadline
        self._set(replace(self._leadership, store_up=True))
        return True

    def _step_down(self, store_up: bool) -> None:
        self._deadline = -math.inf
        self._set(replace(UNKNOWN, store_up=store_up))

    async def _follow(self, start_revision: int) -> None:
        """Watch the key from `start_revision` until it is deleted, the watch breaks or the
        re-read period (ttl) passes; a put updates who leads."""
        watch = self._client.watch(self._key, start_revision=start_revision)
        try:
            async with asyncio.timeout(self._ttl_s):
                async for event in watch:
                    if event.kind == "delete":
                        return
                    self._set(follower_of(event.kv))
        except (EtcdError, TimeoutError):
            return  # the next round's read says whether etcd is up
        finally:
            await watch.aclose()

    async def _release(self, lease: int) -> None:
        """Revoke `lease` if etcd can be reached; else it stays ours to revoke when etcd
        answers again (or expires by itself)."""
        try:
            await self._client.revoke(lease)
        except EtcdError:
            return
        if self._lease == lease:
            self._lease = None

    def _set(self, leadership: Leadership) -> None:
        if leadership != self._leadership:
            self._leadership = leadership
            self._on_change(leadership)

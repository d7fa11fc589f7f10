"""`Election` against a real etcd: one leader that all agree on, fast hand-over on
resignation, crash and deleted key, strictly increasing epochs, a store that dies and comes
back, and a leader that trusts its lead only until its local deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import groupby

import pytest
from etcd_helpers import EtcdServer

from prfaas.coordination.election import (
    UNKNOWN,
    Election,
    Leadership,
    holds_key,
    renewed_deadline,
)
from prfaas.coordination.etcd import EtcdClient, KeyValue

KEY = "/prfaas/test/leader"
TTL_S = 1.0


@dataclass
class Replica:
    """One campaigning replica and every Leadership its on_change was handed."""

    name: str
    election: Election
    changes: list[Leadership] = field(default_factory=list)

    @property
    def leads(self) -> bool:
        return self.election.leadership.role == "leader"


class FakeClock:
    """A monotonic clock that moves only when a test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


MakeReplica = Callable[..., Replica]


@pytest.fixture
async def make_replica(etcd: EtcdServer) -> AsyncIterator[MakeReplica]:
    """`make_replica(name, clock=...)`: a started Election on its own client; all stopped
    (resigning) and closed at teardown."""
    made: list[tuple[Replica, EtcdClient]] = []

    def make(name: str, *, clock: Callable[[], float] = time.monotonic) -> Replica:
        client = EtcdClient([etcd.url], timeout_s=1.0)
        changes: list[Leadership] = []
        election = Election(client, key=KEY, replica_id=name, ttl_s=TTL_S,
                            on_change=changes.append, clock=clock)  # fmt: skip
        replica = Replica(name, election, changes)
        made.append((replica, client))
        election.start()
        return replica

    yield make
    for replica, client in made:
        await replica.election.stop()
        await client.close()


async def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll every 5 ms until `predicate()`; the seconds it took (fails after `timeout_s`)."""
    began = time.monotonic()
    while not predicate():
        if time.monotonic() - began > timeout_s:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.005)
    return time.monotonic() - began


def settled(replicas: list[Replica]) -> bool:
    """Exactly one leader, and every replica names it with the same epoch, store up."""
    views = {(r.election.leadership.leader, r.election.leadership.epoch) for r in replicas}
    return (
        sum(r.leads for r in replicas) == 1
        and len(views) == 1
        and all(r.election.leadership.store_up for r in replicas)
        and next(iter(views))[1] > 0
    )


def leader_of(replicas: list[Replica]) -> Replica:
    (leader,) = [r for r in replicas if r.leads]
    return leader


def assert_changes_only(replica: Replica) -> None:
    """on_change was called exactly on changes: no value twice in a row, the last is now."""
    pairs = zip([UNKNOWN, *replica.changes], replica.changes, strict=False)
    assert all(a != b for a, b in pairs), replica.changes
    assert replica.changes[-1] == replica.election.leadership


async def test_three_replicas_elect_one_leader_all_agree(
    make_replica: MakeReplica, client: EtcdClient
) -> None:
    """One leads; all name it with its epoch, the election key's create_revision; each
    replica's on_change saw exactly one value."""
    replicas = [make_replica(f"r{i}") for i in range(3)]
    await wait_for(lambda: settled(replicas), 3, "one agreed leader")
    leader = leader_of(replicas)
    key = await client.get(KEY)
    assert key is not None and key.value == leader.name.encode()
    assert leader.election.leading_now()
    for replica in replicas:
        role = "leader" if replica is leader else "follower"
        assert replica.changes == [Leadership(role, key.create_revision, leader.name, True)]
        assert replica.election.leading_now() == (replica is leader)


async def test_a_resigning_leader_hands_over_at_once(make_replica: MakeReplica) -> None:
    """stop() revokes the lease: another replica leads within 0.5 s, sooner than the lease
    could run out (1 s, renewed every third of it: not before 0.67 s), at a later epoch."""
    replicas = [make_replica(f"r{i}") for i in range(3)]
    await wait_for(lambda: settled(replicas), 3, "one agreed leader")
    old = leader_of(replicas)
    old_epoch = old.election.leadership.epoch
    await old.election.stop()
    assert old.election.leadership == UNKNOWN and not old.election.leading_now()
    rest = [r for r in replicas if r is not old]
    took = await wait_for(lambda: settled(rest), 2, "a new agreed leader")
    assert took < 0.5 < TTL_S * 2 / 3
    assert rest[0].election.leadership.epoch > old_epoch
    for replica in replicas:
        assert_changes_only(replica)


async def test_a_crashed_leader_is_replaced_within_ttl_plus_1s(make_replica: MakeReplica) -> None:
    """A leader that stops renewing without revoking (a crash) loses the key when its lease
    expires; a follower leads within ttl + 1 s."""
    replicas = [make_replica(f"r{i}") for i in range(3)]
    await wait_for(lambda: settled(replicas), 3, "one agreed leader")
    crashed = leader_of(replicas)
    old_epoch = crashed.election.leadership.epoch
    await crashed.election.stop(resign=False)
    rest = [r for r in replicas if r is not crashed]
    took = await wait_for(lambda: settled(rest), TTL_S + 3, "a new agreed leader")
    assert took < TTL_S + 1
    assert rest[0].election.leadership.epoch > old_epoch


async def test_epochs_strictly_increase_across_leaders(make_replica: MakeReplica) -> None:
    """Leader after leader (each resigning, a newcomer joining), every epoch is above the
    last, and no replica ever sees the epoch go back."""
    replicas = [make_replica(f"r{i}") for i in range(3)]
    epochs = []
    for turn in range(4):
        await wait_for(partial(settled, replicas), 3, "one agreed leader")
        leader = leader_of(replicas)
        epochs.append(leader.election.leadership.epoch)
        await leader.election.stop()
        replicas = [r for r in replicas if r is not leader] + [make_replica(f"n{turn}")]
    assert epochs == sorted(set(epochs))
    for replica in replicas:
        seen = [c.epoch for c in replica.changes if c.epoch]
        assert seen == sorted(seen)


async def test_a_leader_whose_key_is_deleted_steps_down(
    make_replica: MakeReplica, client: EtcdClient
) -> None:
    """Deleting the election key (an operator forcing a new election) ends the lead at the
    next renewal, and a new leader is elected at a later epoch."""
    replicas = [make_replica(f"r{i}") for i in range(2)]
    await wait_for(lambda: settled(replicas), 3, "one agreed leader")
    old_epoch = leader_of(replicas).election.leadership.epoch
    await client.delete(KEY)
    await wait_for(
        lambda: settled(replicas) and replicas[0].election.leadership.epoch > old_epoch,
        2,
        "a leader at a later epoch",
    )
    for replica in replicas:
        assert_changes_only(replica)


async def test_store_down_then_back(make_replica: MakeReplica, etcd: EtcdServer) -> None:
    """etcd killed: every replica says store_up False (keeping the leader it knew, if a
    follower), the leader steps down by its deadline; etcd back: one leader again."""
    replicas = [make_replica(f"r{i}") for i in range(3)]
    await wait_for(lambda: settled(replicas), 3, "one agreed leader")
    leader = leader_of(replicas)
    followers = [r for r in replicas if r is not leader]
    known = leader.election.leadership
    etcd.kill()
    killed = time.monotonic()
    await wait_for(
        lambda: not any(r.election.leadership.store_up for r in replicas), 2, "store_up False"
    )
    for follower in followers:
        assert follower.election.leadership == Leadership("follower", known.epoch, known.leader,
                                                          False)  # fmt: skip
    await wait_for(lambda: not leader.leads, TTL_S + 0.5, "the leader to step down")
    assert time.monotonic() - killed < TTL_S + 0.2  # by its deadline: last renewal + ttl
    assert not leader.election.leading_now()
    assert leader.election.leadership == replace(UNKNOWN, store_up=False)
    await asyncio.sleep(0.5)
    assert not any(r.leads for r in replicas)
    etcd.start()
    await wait_for(lambda: settled(replicas), TTL_S + 3, "a leader after the restart")
    assert leader_of(replicas).election.leadership.epoch > known.epoch
    for replica in replicas:
        assert_changes_only(replica)


async def test_leading_now_is_false_past_the_deadline(make_replica: MakeReplica) -> None:
    """A leader whose clock jumps past its deadline (a paused process waking up) does not
    lead now, before its loop has even noticed; then it steps down and campaigns again."""
    clock = FakeClock()
    replica = make_replica("r0", clock=clock)
    await wait_for(lambda: replica.leads, 3, "the lead")
    epoch = replica.election.leadership.epoch
    assert replica.election.leading_now()
    clock.now += TTL_S - 0.01
    assert replica.election.leading_now()
    clock.now += 0.01
    assert not replica.election.leading_now()
    assert replica.leads  # the loop has not woken yet
    await wait_for(
        lambda: replica.leads and replica.election.leadership.epoch > epoch, 2, "a new lead"
    )
    assert replica.election.leading_now()
    roles = [role for role, _ in groupby(c.role for c in replica.changes)]
    assert roles == ["leader", "follower", "leader"]  # (a slow renewal may flip store_up)


def test_renewed_deadline_from_the_send_time() -> None:
    """The lead lasts ttl from the renewal's send time (less if etcd has less left); a
    TTL <= 0 answer means the lease is gone."""
    assert renewed_deadline(10.0, 2.0, 2) == 12.0
    assert renewed_deadline(10.0, 2.0, 5) == 12.0
    assert renewed_deadline(10.0, 2.5, 1) == 11.0
    assert renewed_deadline(10.0, 2.0, 0) is None
    assert renewed_deadline(10.0, 2.0, -1) is None


def test_holds_key_only_while_bound_to_our_lease() -> None:
    assert holds_key(KeyValue(KEY, b"r0", 5, 5, 77), 77)
    assert not holds_key(KeyValue(KEY, b"r1", 9, 9, 78), 77)
    assert not holds_key(None, 77)

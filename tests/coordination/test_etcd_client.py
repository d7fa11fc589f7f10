"""`EtcdClient` against a real etcd: key-value calls, the two transactions, leases, watches,
and the one `EtcdError` for a store that is down, silent or refusing."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.request
from collections.abc import Iterator

import pytest
from etcd_helpers import EtcdServer

from prfaas.common.ports import free_port
from prfaas.coordination.etcd import (
    EtcdClient,
    EtcdError,
    KeyValue,
    WatchCompacted,
    WatchEvent,
    prefix_end,
)


async def test_put_get_delete_and_prefix_reads(client: EtcdClient) -> None:
    """A put returns its revision, which get reports as create/mod revision; get_prefix
    reads only the prefix, in key order, and like get_with_revision says the store's
    revision at the read; delete removes."""
    r1 = await client.put("/p/a", b"1")
    r2 = await client.put("/p/b", b"\x00\xff")
    assert r2 == r1 + 1
    assert await client.get("/p/a") == KeyValue("/p/a", b"1", r1, r1, 0)
    r3 = await client.put("/p/a", b"2")
    assert await client.get("/p/a") == KeyValue("/p/a", b"2", r1, r3, 0)
    outside = await client.put("/q", b"other")
    kvs, revision = await client.get_prefix("/p/")
    assert [(kv.key, kv.value) for kv in kvs] == [("/p/a", b"2"), ("/p/b", b"\x00\xff")]
    assert revision == outside  # the store's revision, not the prefix's last write
    assert await client.get_with_revision("/p/b") == (
        KeyValue("/p/b", b"\x00\xff", r2, r2, 0),
        outside,
    )
    await client.delete("/p/a")
    assert await client.get("/p/a") is None
    assert await client.get("/never") is None


def test_prefix_end_follows_etcds_rule() -> None:
    assert prefix_end(b"/p/") == b"/p0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"


async def test_create_race_has_exactly_one_winner(client: EtcdClient, etcd: EtcdServer) -> None:
    """Two creators at once (each with its own client): one gets the revision of its put,
    the other None, and the key holds the winner's value."""
    other = EtcdClient([etcd.url])
    try:
        results = await asyncio.gather(
            client.create("/race", b"one", lease=0), other.create("/race", b"two", lease=0)
        )
    finally:
        await other.close()
    winners = [i for i, r in enumerate(results) if r is not None]
    assert len(winners) == 1
    kv = await client.get("/race")
    assert kv is not None
    assert kv.value == [b"one", b"two"][winners[0]]
    assert kv.create_revision == results[winners[0]]
    assert await client.create("/race", b"late", lease=0) is None


async def test_create_binds_the_key_to_the_lease(client: EtcdClient) -> None:
    """A created key carries its lease; revoking the lease deletes it, and the key can be
    created again (with a later create_revision)."""
    lease = await client.grant(5)
    first = await client.create("/leader", b"me", lease=lease)
    assert first is not None
    kv = await client.get("/leader")
    assert kv is not None and kv.lease == lease
    await client.revoke(lease)
    assert await client.get("/leader") is None
    second = await client.create("/leader", b"you", lease=0)
    assert second is not None and second > first


async def test_put_if_value_refused_once_the_guard_changes(client: EtcdClient) -> None:
    """The fenced publish lands while the guard holds the value, and is refused (nothing
    written) once the guard holds another value or is gone."""
    await client.put("/guard", b"leader-a")
    assert await client.put_if_value("/guard", b"leader-a", "/data", b"v1")
    await client.put("/guard", b"leader-b")
    assert not await client.put_if_value("/guard", b"leader-a", "/data", b"v2")
    await client.delete("/guard")
    assert not await client.put_if_value("/guard", b"leader-a", "/data", b"v3")
    kv = await client.get("/data")
    assert kv is not None and kv.value == b"v1"


async def test_keepalive_renews_and_reports_a_lost_lease(client: EtcdClient) -> None:
    """keepalive answers the TTL while the lease lives, and <= 0 once it was revoked or has
    expired; revoking a lease already gone is not an error."""
    lease = await client.grant(1)
    assert await client.keepalive(lease) == 1
    await asyncio.sleep(2.2)  # past the TTL and etcd's expiry sweep (every 0.5 s)
    assert await client.keepalive(lease) <= 0
    revoked = await client.grant(5)
    assert await client.keepalive(revoked) == 5
    await client.revoke(revoked)
    assert await client.keepalive(revoked) <= 0
    await client.revoke(revoked)


async def test_watch_sees_puts_and_deletes_in_order(client: EtcdClient) -> None:
    """A prefix watch yields each put (value, revisions) and delete under the prefix, and
    nothing outside it; a watch from an old revision replays history."""
    start = await client.put("/w/before", b"0")
    seen: list[WatchEvent] = []

    async def collect() -> None:
        async for event in client.watch("/w/", prefix=True):
            seen.append(event)
            if len(seen) == 3:
                return

    task = asyncio.create_task(collect())
    await asyncio.sleep(0.2)  # the watch is created
    r1 = await client.put("/w/a", b"1")
    await client.put("/x", b"outside")
    r2 = await client.put("/w/a", b"2")
    r3 = await client.put("/w/b", b"3")
    await client.delete("/w/a")
    await asyncio.wait_for(task, 5)
    assert seen == [
        WatchEvent("put", KeyValue("/w/a", b"1", r1, r1, 0)),
        WatchEvent("put", KeyValue("/w/a", b"2", r1, r2, 0)),
        WatchEvent("put", KeyValue("/w/b", b"3", r3, r3, 0)),
    ]
    replay = client.watch("/w/before", start_revision=start)
    first = await asyncio.wait_for(anext(replay), 5)
    await replay.aclose()
    assert first == WatchEvent("put", KeyValue("/w/before", b"0", start, start, 0))
    delete = client.watch("/w/a", start_revision=r3 + 1)
    gone = await asyncio.wait_for(anext(delete), 5)
    await delete.aclose()
    assert gone.kind == "delete" and gone.kv.key == "/w/a" and gone.kv.mod_revision == r3 + 1


async def test_watch_of_a_compacted_revision_says_so(client: EtcdClient, etcd: EtcdServer) -> None:
    """A watch from before the compaction point ends with `WatchCompacted` and the revision
    to read from again."""
    for i in range(3):
        revision = await client.put("/c", str(i).encode())
    _post(etcd.url, "/v3/kv/compaction", {"revision": str(revision)})
    watch = client.watch("/c", start_revision=1)
    with pytest.raises(WatchCompacted) as caught:
        await asyncio.wait_for(anext(watch), 5)
    assert caught.value.compact_revision == revision


async def test_watch_breaks_with_etcd_error_when_the_store_dies(
    client: EtcdClient, etcd: EtcdServer
) -> None:
    watch = client.watch("/k")
    waiting = asyncio.ensure_future(anext(watch))
    await asyncio.sleep(0.2)
    etcd.kill()
    with pytest.raises(EtcdError):
        await asyncio.wait_for(waiting, 5)


async def test_store_down_raises_etcd_error_at_once(client: EtcdClient, etcd: EtcdServer) -> None:
    """Every call against a killed etcd raises EtcdError, without waiting out a timeout
    (the refused connection is known at once); after a restart calls work again."""
    await client.put("/k", b"v")
    etcd.kill()
    calls = [client.get("/k"), client.put("/k", b"w"), client.grant(1), client.keepalive(1)]
    for call in calls:
        began = time.monotonic()
        with pytest.raises(EtcdError, match="unreachable"):
            await call
        assert time.monotonic() - began < 0.5
    etcd.start()
    kv = await client.get("/k")
    assert kv is not None and kv.value == b"v"


async def test_silent_store_times_out_within_the_bound(silent_url: str) -> None:
    """An endpoint that accepts but never answers costs at most `timeout_s`."""
    client = EtcdClient([silent_url], timeout_s=0.3)
    try:
        began = time.monotonic()
        with pytest.raises(EtcdError, match=r"unreachable within 0\.3 s"):
            await client.get("/k")
        assert 0.25 < time.monotonic() - began < 0.8
    finally:
        await client.close()


async def test_next_endpoint_answers_when_the_first_is_down(etcd: EtcdServer) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    client = EtcdClient([dead, etcd.url])
    try:
        revision = await client.put("/k", b"v")
        kv = await client.get("/k")
        assert kv is not None and kv.mod_revision == revision
    finally:
        await client.close()


async def test_a_refused_call_raises_etcd_error_with_etcds_message(client: EtcdClient) -> None:
    with pytest.raises(EtcdError, match="key is not provided"):
        await client.put("", b"v")


def _post(url: str, path: str, body: dict[str, str]) -> None:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=5) as r:
        r.read()


@pytest.fixture
def silent_url() -> Iterator[str]:
    """An endpoint that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"

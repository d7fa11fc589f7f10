"""A small asyncio client of etcd v3 over its JSON gateway (HTTP POSTs under `/v3/`).

The replicas need only a handful of etcd's calls: read, write and delete keys, two
compare-and-put transactions (create a key that does not exist; put while a guard key holds a
value), leases (grant, keep alive, revoke) and watches. etcd's gRPC gateway serves them as
JSON over HTTP, so `aiohttp` (already the project's client) does it without a gRPC stack.

On the wire keys and values are base64 and int64s are JSON strings; here keys are `str`,
values `bytes`, revisions and lease ids `int`. Each call tries the endpoints in turn (from the
last one that answered) while they cannot be reached; every failure, whether unreachable,
timed out, a bad status or an answer that does not parse, raises `EtcdError`.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import orjson


class EtcdError(Exception):
    """etcd could not be reached, did not answer in time, or refused the call."""


class WatchCompacted(EtcdError):
    """etcd cancelled a watch because its start revision was compacted away: restart from
    a fresh read (`get_prefix`), not from the last seen revision."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"etcd watch cancelled: revisions before {compact_revision} compacted")
        self.compact_revision = compact_revision


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd stores it (`mod_revision` is the revision of its last write; `lease`
    0 when it is bound to none). A deleted key in a watch event has only key and
    mod_revision."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    """A put or a delete of a watched key."""

    kind: Literal["put", "delete"]
    kv: KeyValue


class EtcdClient:
    """etcd v3 over HTTP; one pooled session, `timeout_s` per call and endpoint (a watch's
    limit is on connecting only). `close()` when done."""

    def __init__(self, endpoints: Sequence[str], *, timeout_s: float = 1.0) -> None:
        if not endpoints:
            raise ValueError("EtcdClient needs at least one endpoint")
        self._endpoints = tuple(u.rstrip("/") for u in endpoints)
        self._timeout_s = timeout_s
        self._first = 0  # the endpoint that answered last: tried first
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def get(self, key: str) -> KeyValue | None:
        return (await self.get_with_revision(key))[0]

    async def get_with_revision(self, key: str) -> tuple[KeyValue | None, int]:
        """`key` (None if absent) and the revision it was read at: watch from it + 1 to miss
        nothing (the key's own mod_revision may since have been compacted away)."""
        answer = await self._call("/v3/kv/range", {"key": _b64(key)})
        kvs = answer.get("kvs", [])
        return (_key_value(kvs[0]) if kvs else None), _revision(answer)

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under `prefix`, in key order, and the revision they were read at (watch
        from it + 1 to miss nothing)."""
        body = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix.encode()))}
        answer = await self._call("/v3/kv/range", body)
        return [_key_value(kv) for kv in answer.get("kvs", [])], _revision(answer)

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        """Write `key`; the revision of the write."""
        return _revision(await self._call("/v3/kv/put", _put(key, value, lease)))

    async def delete(self, key: str) -> None:
        await self._call("/v3/kv/deleterange", {"key": _b64(key)})

    async def grant(self, ttl_s: int) -> int:
        """A new lease of `ttl_s` seconds (etcd may raise it to its minimum); its id."""
        return int((await self._call("/v3/lease/grant", {"TTL": str(ttl_s)}))["ID"])

    async def keepalive(self, lease: int) -> int:
        """Renew `lease`; the TTL it has now, in seconds (<= 0: it expired or was revoked)."""
        answer = await self._call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(answer.get("result", {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        """End `lease` and delete its keys; a lease already gone is not an error."""
        await self._call("/v3/lease/revoke", {"ID": str(lease)}, missing_ok=True)

    async def create(self, key: str, value: bytes, *, lease: int) -> int | None:
        """Put `key` only if it does not exist; the revision of the put, None if it existed."""
        compare = {"target": "CREATE", "key": _b64(key), "create_revision": "0"}
        return await self._txn(compare, _put(key, value, lease))

    async def put_if_value(
        self, guard_key: str, guard_value: bytes, key: str, value: bytes
    ) -> bool:
        """Put `key` only while `guard_key` holds `guard_value` (a leader's fenced write: it
        lands only while the writer still holds the election key); whether it did."""
        compare = {"target": "VALUE", "key": _b64(guard_key), "value": _b64(guard_value),
                   "result": "EQUAL"}  # fmt: skip
        return await self._txn(compare, _put(key, value, 0)) is not None

    async def watch(
        self, key: str, *, prefix: bool = False, start_revision: int = 0
    ) -> AsyncGenerator[WatchEvent, None]:
        """The puts and deletes of `key` (or every key under it) from `start_revision` (0:
        from now), as they happen. Never ends by itself: a broken stream raises `EtcdError`
        (restart from the last seen mod_revision + 1), a compacted start `WatchCompacted`."""
        create: dict[str, str] = {"key": _b64(key), "start_revision": str(start_revision)}
        if prefix:
            create["range_end"] = _b64(prefix_end(key.encode()))
        response = await self._open("/v3/watch", {"create_request": create}, stream=True)
        if response.status != 200:
            text = await _safe_text(response)
            raise EtcdError(f"etcd watch of {key!r} refused ({response.status}): {text}")
        try:
            async for message in _lines(response):
                for event in _watch_events(message):
                    yield event
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EtcdError(f"etcd watch of {key!r} broke: {_describe(exc)}") from exc
        finally:
            response.close()
        raise EtcdError(f"etcd watch of {key!r} ended (the server closed it)")

    async def _txn(self, compare: dict[str, str], put: dict[str, str]) -> int | None:
        """One compare-then-put transaction; the revision of the put, None if refused."""
        body = {"compare": [compare], "success": [{"request_put": put}]}
        answer = await self._call("/v3/kv/txn", body)
        return _revision(answer) if answer.get("succeeded", False) else None

    async def _call(self, path: str, body: dict[str, Any], *, missing_ok: bool = False) -> Any:
        """POST one unary call; etcd's answer (a streamed call's: its first message).
        `missing_ok`: a "not found" refusal is an empty answer."""
        response = await self._open(path, body, stream=False)
        try:
            data = await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EtcdError(f"etcd {path} failed reading the answer: {_describe(exc)}") from exc
        finally:
            response.release()
        try:
            answer = orjson.loads(data.split(b"\n", 1)[0])
        except orjson.JSONDecodeError as exc:
            raise EtcdError(
                f"etcd {path} answered {response.status}, not JSON: {data[:200]!r}"
            ) from exc
        if missing_ok and response.status == 404:
            return {}
        _raise_error(path, answer)
        if response.status != 200:
            raise EtcdError(f"etcd {path} answered {response.status}: {data[:200]!r}")
        return answer

    async def _open(
        self, path: str, body: dict[str, Any], *, stream: bool
    ) -> aiohttp.ClientResponse:
        """POST `body` to each endpoint in turn until one answers (a stream is limited on
        connecting only: it may wait any time for its next event)."""
        session = self._session_now()
        timeout = (
            aiohttp.ClientTimeout(total=None, sock_connect=self._timeout_s, sock_read=None)
            if stream
            else aiohttp.ClientTimeout(total=self._timeout_s)
        )
        data, n, failures = orjson.dumps(body), len(self._endpoints), []
        for i in (self._first + k for k in range(n)):
            url = self._endpoints[i % n] + path
            try:
                response = await session.post(url, data=data, timeout=timeout)
            except (aiohttp.ClientError, TimeoutError) as exc:
                failures.append(f"{url}: {_describe(exc)}")
                continue
            self._first = i % n
            return response
        raise EtcdError(f"etcd unreachable within {self._timeout_s} s: " + "; ".join(failures))

    def _session_now(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers={"Content-Type": "application/json"}, raise_for_status=False
            )
        return self._session


def prefix_end(prefix: bytes) -> bytes:
    """The `range_end` that with `prefix` as key selects every key starting with `prefix`
    (etcd's rule: the prefix with its last byte below 0xff incremented)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"  # every key
    return stripped[:-1] + bytes([stripped[-1] + 1])


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(data: str) -> bytes:
    return base64.b64decode(data)


def _put(key: str, value: bytes, lease: int) -> dict[str, str]:
    body = {"key": _b64(key), "value": _b64(value)}
    if lease:
        body["lease"] = str(lease)
    return body


def _revision(answer: dict[str, Any]) -> int:
    return int(answer.get("header", {}).get("revision", 0))


def _key_value(kv: dict[str, Any]) -> KeyValue:
    """A `mvccpb.KeyValue` as JSON (fields at their zero value are left out)."""
    return KeyValue(
        key=_unb64(kv["key"]).decode(),
        value=_unb64(kv.get("value", "")),
        create_revision=int(kv.get("create_revision", 0)),
        mod_revision=int(kv.get("mod_revision", 0)),
        lease=int(kv.get("lease", 0)),
    )


def _watch_events(message: dict[str, Any]) -> list[WatchEvent]:
    """The events of one watch message; raises on an error or a cancelled watch."""
    _raise_error("/v3/watch", message)
    result = message.get("result", {})
    if result.get("canceled", False):
        compacted = int(result.get("compact_revision", 0))
        if compacted:
            raise WatchCompacted(compacted)
        raise EtcdError(f"etcd cancelled the watch: {result.get('cancel_reason', '')}")
    return [
        WatchEvent("delete" if e.get("type") == "DELETE" else "put", _key_value(e["kv"]))
        for e in result.get("events", [])
    ]


def _raise_error(path: str, answer: dict[str, Any]) -> None:
    """Raise the error an answer carries: a unary call's `{"error": text, "message"}`, or a
    stream message's `{"error": {"message"}}`."""
    error = answer.get("error")
    if error is None:
        return
    message = (
        error.get("message", error) if isinstance(error, dict) else answer.get("message", error)
    )
    raise EtcdError(f"etcd {path} failed: {message}")


async def _lines(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The newline-delimited JSON messages of a streamed answer (split here: one message
    may exceed the reader's line limit)."""
    pending = b""
    async for piece in response.content.iter_any():
        pending += piece
        *whole, pending = pending.split(b"\n")
        for line in whole:
            if line.strip():
                try:
                    yield orjson.loads(line)
                except orjson.JSONDecodeError as exc:
                    raise EtcdError(f"etcd watch sent something not JSON: {line[:200]!r}") from exc


async def _safe_text(response: aiohttp.ClientResponse) -> str:
    """An error answer's body for the message (it may itself fail to arrive)."""
    try:
        return (await response.text())[:500]
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return "(no readable body)"
    finally:
        response.release()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

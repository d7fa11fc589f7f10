"""Stored responses in Redis, which several gateway replicas share: a follow-up turn finds
its conversation whichever replica it reaches (`[responses] store = "redis://..."`).

Each response is one key (`prfaas:response:ID`) holding its encoded record, set with the
store's time to live; Redis's own `maxmemory` policy bounds what it keeps. A Redis that
cannot be reached raises `StoreUnavailable` (the gateway answers 503 for a follow-up it
cannot load, and counts an answer it could not store).
"""

from __future__ import annotations

from redis.asyncio import Redis
from redis.exceptions import RedisError

from prfaas.gateway.responses.conversation import StoredResponse
from prfaas.gateway.responses.store import ResponseStore, StoreUnavailable

KEY_PREFIX = "prfaas:response:"
TIMEOUT_S = 2.0
"""Connecting to Redis and each command: a store that does not answer in this long is
unavailable (the request fails fast instead of holding its client)."""


class RedisResponseStore(ResponseStore):
    """Responses in the Redis at `url` (`redis://HOST:PORT/DB`, `rediss://` for TLS)."""

    def __init__(self, url: str, ttl_s: float) -> None:
        self._redis: Redis = Redis.from_url(
            url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S
        )
        self._ttl_ms = max(1, round(ttl_s * 1000))

    @property
    def redis(self) -> Redis:
        """The store's client (the event log of background streams shares it)."""
        return self._redis

    async def get(self, response_id: str) -> StoredResponse | None:
        try:
            raw = await self._redis.get(KEY_PREFIX + response_id)
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(str(exc)) from exc
        if raw is None:
            return None
        return StoredResponse.decode(raw.encode() if isinstance(raw, str) else raw)

    async def put(self, response_id: str, record: StoredResponse) -> None:
        try:
            await self._redis.set(KEY_PREFIX + response_id, record.encode(), px=self._ttl_ms)
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(str(exc)) from exc

    async def delete(self, response_id: str) -> bool:
        try:
            return bool(await self._redis.delete(KEY_PREFIX + response_id))
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(str(exc)) from exc

    async def close(self) -> None:
        await self._redis.aclose()

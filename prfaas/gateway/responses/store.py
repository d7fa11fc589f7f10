"""Where stored responses live: `ResponseStore`, and the gateway's own bounded, expiring
memory (`MemoryResponseStore`, one gateway's); `redis_store.py` has the store several gateway
replicas share.

Every stored response is kept until its time to live runs out, and the memory store also
forgets the least recently used ones once their bytes pass its bound: a follow-up to a
forgotten response is answered 404, as one to an unknown id (never a wrong conversation).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from prfaas.gateway.responses.conversation import StoredResponse


class StoreUnavailable(RuntimeError):
    """The store could not be reached (a shared store that is down)."""


class ResponseStore(ABC):
    """Stored responses by id. Every method may raise `StoreUnavailable`."""

    @abstractmethod
    async def get(self, response_id: str) -> StoredResponse | None:
        """The response stored under `response_id` (None: unknown, expired or forgotten).
        Does not change what is stored (a memory store marks it recently used)."""

    @abstractmethod
    async def put(self, response_id: str, record: StoredResponse) -> None:
        """Store `record` under `response_id` (replacing one there) for the time to live."""

    @abstractmethod
    async def delete(self, response_id: str) -> bool:
        """Forget `response_id`; whether it was stored."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections (the memory store has none)."""


@dataclass
class MemoryResponseStore(ResponseStore):
    """Responses in this gateway's memory: at most `max_bytes` of encoded records (least
    recently used forgotten first), each for `ttl_s` seconds after it was stored."""

    max_bytes: int
    ttl_s: float
    clock: Callable[[], float] = time.monotonic
    _records: OrderedDict[str, tuple[float, bytes]] = field(default_factory=OrderedDict)
    _bytes: int = 0

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or not self.ttl_s > 0:
            raise ValueError(f"max_bytes must be >= 1 and ttl_s > 0, got {self.max_bytes}, "
                             f"{self.ttl_s}")  # fmt: skip

    @property
    def bytes_stored(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._records)

    async def get(self, response_id: str) -> StoredResponse | None:
        entry = self._records.get(response_id)
        if entry is None:
            return None
        if entry[0] <= self.clock():
            self._drop(response_id)
            return None
        self._records.move_to_end(response_id)
        return StoredResponse.decode(entry[1])

    async def put(self, response_id: str, record: StoredResponse) -> None:
        self.put_now(response_id, record)

    def put_now(self, response_id: str, record: StoredResponse) -> None:
        """`put`, which in memory never waits."""
        raw = record.encode()
        self._drop(response_id)
        if len(raw) > self.max_bytes:
            return  # larger than the whole store: never kept
        self._records[response_id] = (self.clock() + self.ttl_s, raw)
        self._bytes += len(raw)
        self._evict()

    async def delete(self, response_id: str) -> bool:
        return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self._records.pop(response_id, None)
        if entry is not None:
            self._bytes -= len(entry[1])
        return entry is not None

    def _evict(self) -> None:
        """The least recently used records while they have expired or the store is over
        its bound (an expired record further in is never returned, and goes in its turn)."""
        now = self.clock()
        while self._records:
            oldest = next(iter(self._records))
            if self._records[oldest][0] > now and self._bytes <= self.max_bytes:
                return
            self._drop(oldest)

"""The `[responses]` table of a deployment file: where the gateway keeps the OpenAI Responses
API's state (stored responses, the conversations `previous_response_id` continues).

```toml
[responses]
store = "memory"          # this gateway's memory, or "redis://HOST:PORT/DB" (shared by replicas)
ttl_s = 86400.0           # a stored response is forgotten this long after it was stored
max_mb = 256.0            # memory store: past this, the least recently used are forgotten
cancel_poll_s = 1.0       # shared store: how often a background response running on this
                          # replica looks for a cancel another replica recorded
```

Without the table: the memory store with these defaults. Gateway replicas (`[coordination]`)
should share a Redis store: with memory stores, a follow-up reaching another replica than the
one that answered the previous turn is answered 404.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import urlparse

from prfaas.common.toml_tables import check


@dataclass(frozen=True)
class ResponsesConfig:
    """Where stored responses live, and for how long."""

    store: str = "memory"
    ttl_s: float = 86400.0
    max_mb: float = 256.0
    cancel_poll_s: float = 1.0
    """With a shared store: how often a background response running here reads its stored
    status, so that a cancel recorded through another replica stops its engine work."""

    def __post_init__(self) -> None:
        check(self.store == "memory" or _redis_url(self.store), "store", self.store,
              'must be "memory" or redis://HOST[:PORT][/DB] (rediss:// for TLS)')  # fmt: skip
        check(0 < self.ttl_s < math.inf, "ttl_s", self.ttl_s, "must be > 0 and finite")
        check(0 < self.max_mb < math.inf, "max_mb", self.max_mb, "must be > 0 and finite")
        poll = self.cancel_poll_s
        check(0 < poll <= 60, "cancel_poll_s", poll, "must be in (0, 60]")

    @property
    def shared(self) -> bool:
        """Whether the store is one several gateways share."""
        return self.store != "memory"


def _redis_url(url: str) -> bool:
    try:
        parsed = urlparse(url)
        parsed.port  # noqa: B018 - raises ValueError on a port out of range
    except ValueError:
        return False
    return parsed.scheme in ("redis", "rediss") and bool(parsed.hostname)

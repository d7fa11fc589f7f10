"""The `[coordination]` table of a deployment file: the etcd cluster the replicas share.

```toml
[coordination]
etcd = "http://127.0.0.1:2379"   # etcd's v3 JSON gateway (one URL, or several comma-separated)
prefix = "/prfaas/default"       # this deployment's keys (election, schedule, samples)
lease_ttl_s = 2.0                # a silent leader loses the lead this long after its last renewal
publish_s = 0.5                  # how often a replica publishes its request-path samples
```

Without the table a gateway runs alone, as one process that is always its own leader.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import urlparse

from prfaas.common.toml_tables import check


@dataclass(frozen=True)
class CoordinationConfig:
    """Where the replicas of one deployment meet."""

    etcd: str = "http://127.0.0.1:2379"
    prefix: str = "/prfaas/default"
    lease_ttl_s: float = 2.0
    publish_s: float = 0.5

    def __post_init__(self) -> None:
        bad = [u for u in self.endpoints if not _http_url(u)]
        check(not bad and bool(self.endpoints), "etcd", self.etcd,
              "must be http(s)://HOST[:PORT] URLs, comma-separated")  # fmt: skip
        check(self.prefix.startswith("/") and not self.prefix.endswith("/"), "prefix",
              self.prefix, "must start with / and not end with /")  # fmt: skip
        check(1 <= self.lease_ttl_s < math.inf, "lease_ttl_s", self.lease_ttl_s,
              "must be >= 1 (etcd's unit) and finite")  # fmt: skip
        check(0 < self.publish_s < self.lease_ttl_s, "publish_s", self.publish_s,
              "must be > 0 and < lease_ttl_s")  # fmt: skip

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(u.strip().rstrip("/") for u in self.etcd.split(",") if u.strip())


def _http_url(url: str) -> bool:
    """An http or https URL of a host, and a port number (1-65535) if it names one: no
    path, query or fragment (the client appends etcd's `/v3/...` routes to it)."""
    try:
        parsed = urlparse(url)
        port = parsed.port  # raises ValueError on a port that is not a number in range
    except ValueError:
        return False
    bare = parsed.path in ("", "/") and not (parsed.query or parsed.fragment)
    return parsed.scheme in ("http", "https") and bool(parsed.hostname) and bare and port != 0

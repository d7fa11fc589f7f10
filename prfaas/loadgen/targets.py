"""Bench targets: a live HTTP server (`HttpRunner`) or, later, the simulator (`sim:CONFIG`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime

import aiohttp

from prfaas.loadgen.apis import create_api
from prfaas.loadgen.client import StreamingClient
from prfaas.loadgen.driver import Driver
from prfaas.loadgen.spec import BenchSpec, Progress, RunResult, TargetError


@dataclass(frozen=True)
class HttpOptions:
    """How to talk to an HTTP target."""

    api: str = "completions"
    """`completions`, `chat` (OpenAI) or `generate` (SGLang native)."""
    model: str | None = None
    """Model name for OpenAI APIs; None asks the server's `/v1/models`."""
    timeout_s: float = 600.0
    """Per-request limit (whole stream); a request past it is a failed record."""
    max_connections: int = 0
    """Connection-pool cap; 0 means unlimited (open-loop arrivals must never queue here)."""

    def __post_init__(self) -> None:
        create_api(self.api)  # raises with the list of valid names
        if not self.timeout_s > 0:
            raise ValueError(f"request timeout must be > 0 s, got {self.timeout_s}")
        if self.max_connections < 0:
            raise ValueError(f"max_connections must be >= 0, got {self.max_connections}")


class HttpRunner:
    """Runs a spec against an OpenAI-compatible (or SGLang) server over real HTTP."""

    def __init__(self, base_url: str, options: HttpOptions) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise TargetError(f"target must be an http(s):// URL or sim:CONFIG, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.options = options

    async def run(self, spec: BenchSpec, progress: Progress) -> RunResult:
        connector = aiohttp.TCPConnector(limit=self.options.max_connections, force_close=False)
        async with aiohttp.ClientSession(connector=connector) as http:
            listed = await self._discover_model(http)  # also proves the server is reachable
            model = self.options.model or listed
            started_at = datetime.now(UTC).isoformat(timespec="seconds")
            origin = time.perf_counter()  # re-marked when the schedule starts
            client = StreamingClient(
                http,
                self.base_url,
                create_api(self.options.api),
                model=model,
                timeout_s=self.options.timeout_s,
                origin=origin,
            )
            progress.start(spec.num_requests, spec.duration_s)
            try:
                records = await Driver(spec, client, progress, client.mark_origin).run()
            finally:
                progress.stop()
            ends = [r.end_s for r in records if r.end_s is not None]
            duration = max(ends, default=time.perf_counter() - origin)
        return RunResult(self.base_url, tuple(records), duration, started_at)

    async def _discover_model(self, http: aiohttp.ClientSession) -> str:
        """The first model the server lists, or "default" if it lists none."""
        timeout = aiohttp.ClientTimeout(total=10)
        try:
            async with http.get(f"{self.base_url}/v1/models", timeout=timeout) as resp:
                if resp.status != 200:
                    return "default"
                data = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TargetError(f"cannot reach {self.base_url}: {exc}") from exc
        except ValueError:
            return "default"
        models = data.get("data") if isinstance(data, dict) else None
        if models and isinstance(models[0], dict) and isinstance(models[0].get("id"), str):
            return str(models[0]["id"])
        return "default"

"""`ControlPlane`: an engine's control routes as the gateway calls them, shared by every
client whose engine speaks them: `/health` with what the engine says about itself, and the
role API (`POST /admin/role`, `POST /admin/fence`) of reference engines and of vLLM servers
running PrfaaS's role middleware (`prfaas.engines.vllm.role`). Every call carries the
deployment's control token; a non-200 answer is an `EngineError` with the engine's status
and its OpenAI-style error code.
"""

from __future__ import annotations

import errno
import re
from typing import Any

import aiohttp
import orjson

from prfaas.engine_clients.base import EngineError, EngineReport, Role

JSON_HEADERS = {"Content-Type": "application/json"}
ROLES: dict[str, Role] = {
    "prefill": "prefill", "decode": "decode", "null": "both", "both": "both"
}  # fmt: skip
_SAFE_CODE = re.compile(r"[a-z_]{1,40}")


def error_code(body: bytes, default: str) -> str:
    """The `error.code` of an OpenAI-style error body when it is a short identifier (safe to
    show a client), else `default`."""
    try:
        code = orjson.loads(body)["error"]["code"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return default
    return code if isinstance(code, str) and _SAFE_CODE.fullmatch(code) else default


class ControlPlane:
    """The control routes of the engine at `base_url` (see the module docstring)."""

    def __init__(
        self,
        instance_id: str,
        base_url: str,
        session: aiohttp.ClientSession,
        headers: dict[str, str],
        *,
        control_timeout: aiohttp.ClientTimeout,
        health_timeout: aiohttp.ClientTimeout,
        connect_timeout_s: float,
    ) -> None:
        self.instance_id, self.base_url = instance_id, base_url
        self._session = session
        self._headers = {**JSON_HEADERS, **headers}
        self._control_timeout, self._health_timeout = control_timeout, health_timeout
        self._connect_timeout_s = connect_timeout_s

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        limits: aiohttp.ClientTimeout | None = None,
    ) -> Any:
        """`method path` with a JSON `body`: the decoded JSON answer (None when empty).

        Raises:
            EngineError: a non-200 answer (its status and error code).
            aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError: no usable answer.
        """
        async with self._session.request(
            method,
            f"{self.base_url}{path}",
            data=None if body is None else orjson.dumps(body),
            headers=self._headers,
            timeout=limits or self._control_timeout,
        ) as resp:
            raw = await resp.read()
            if resp.status != 200:
                code = error_code(raw, "engine_error")
                raise EngineError(
                    f"{self.instance_id}: {path} answered {resp.status} ({code})",
                    status=resp.status,
                    code=code,
                )
            return orjson.loads(raw) if raw else None

    async def probe(self) -> EngineReport:
        """One `/health` call: alive or not (and whether the connection was refused), plus
        what the engine says about itself (role, start id, whether it drains; an engine
        whose `/health` answers nothing leaves them None)."""
        try:
            body = await self.request("GET", "/health", limits=self._health_timeout)
        except aiohttp.ClientConnectorError as exc:
            refused = exc.os_error.errno in (errno.ECONNREFUSED, errno.ECONNRESET)
            return EngineReport(alive=False, refused=refused)
        except (aiohttp.ClientError, TimeoutError, EngineError, orjson.JSONDecodeError):
            return EngineReport(alive=False)
        if not isinstance(body, dict):
            return EngineReport(alive=True)
        role, start_id = body.get("role"), body.get("start_id")
        return EngineReport(
            alive=True,
            role=ROLES.get(role) if isinstance(role, str) else None,
            start_id=start_id if isinstance(start_id, str) else None,
            draining=body.get("draining") is True,
            prefix_pull=body.get("prefix_pull") is True,
        )

    async def set_role(self, role: Role, *, timeout_s: float, epoch: int) -> float:
        """`POST /admin/role` (the engine drains, then switches); the switch time in seconds.

        Raises:
            EngineError: refused (401 without the deployment's token, 400 for a bad role,
                409 `fenced` from an older leader's epoch, 503 when the drain timed out),
                unreachable, or past `timeout_s`.
        """
        timeout = aiohttp.ClientTimeout(total=timeout_s, connect=self._connect_timeout_s)
        body = await self._role_api("/admin/role", {"role": role, "epoch": epoch}, timeout)
        try:
            return float(body["switch_seconds"])
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"{self.instance_id}: /admin/role answered {body!r}") from exc

    async def fence(self, epoch: int) -> int:
        """`POST /admin/fence`: the engine's floor after announcing `epoch`."""
        body = await self._role_api("/admin/fence", {"epoch": epoch}, None)
        try:
            return int(body["epoch"])
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"{self.instance_id}: /admin/fence answered {body!r}") from exc

    async def _role_api(
        self, path: str, body: dict[str, Any], limits: aiohttp.ClientTimeout | None
    ) -> Any:
        try:
            return await self.request("POST", path, body, limits)
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
            raise EngineError(f"{self.instance_id}: {path} failed: {exc!r}") from exc

"""The engine's routes behind the deployment's control token (finding 3): without it every
route but `/health` answers 401 before doing anything (no role switch, no flush, no abort,
no transfer telemetry naming peers); with it they work. `/health` stays open and reports
the engine's role, whether it drains, and its start id."""

from __future__ import annotations

import aiohttp
import orjson
from engine_harness import engine_server

from prfaas.common.secret import DeploymentSecret
from prfaas.engines.reference.handoff.base import InProcessHub
from prfaas.engines.reference.model.runner import ModelRunner

SECRET = DeploymentSecret(b"s" * 32)
CONTROL = [  # the role switch last: a decode engine refuses a /generate without bootstrap
    ("POST", "/flush_cache", None),
    ("POST", "/abort_request", {"rid": "x"}),
    ("GET", "/transfer_stats", None),
    ("GET", "/server_info", None),
    ("GET", "/stats", None),
    ("POST", "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}),
    ("POST", "/kv/export", {"input_ids": [1, 2], "room": 3}),
    ("POST", "/admin/role", {"role": "decode"}),
    ("POST", "/admin/fence", {"epoch": 1}),
]


async def _call(
    s: aiohttp.ClientSession, method: str, url: str, body: object, token: str | None
) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = None if body is None else orjson.dumps(body)
    async with s.request(method, url, data=data, headers=headers) as r:
        await r.read()
        return r.status


async def test_control_routes_need_the_token(tiny_runner: ModelRunner) -> None:
    token = SECRET.control_token()
    async with (
        engine_server(tiny_runner, InProcessHub(), token=token) as eng,
        aiohttp.ClientSession() as s,
    ):
        for method, path, body in CONTROL:
            for wrong in (None, "nope", DeploymentSecret(b"t" * 32).control_token()):
                assert await _call(s, method, f"{eng.url}{path}", body, wrong) == 401, path
        assert eng.service.core.role == "both"  # the refused role switch did nothing
        async with s.get(f"{eng.url}/health") as r:
            health = await r.json()
        statuses = {p: await _call(s, m, f"{eng.url}{p}", b, token) for m, p, b in CONTROL}
        async with s.get(f"{eng.url}/health") as r:
            after = await r.json()
    assert health == {
        "status": "ok",
        "role": "both",
        "draining": False,
        "start_id": eng.service.start_id,
        "prefix_pull": True,
    }
    assert statuses["/transfer_stats"] == 404  # in-process hand-off: no transport, but let in
    assert all(v == 200 for p, v in statuses.items() if p != "/transfer_stats"), statuses
    assert after["role"] == "decode" and after["start_id"] == health["start_id"]

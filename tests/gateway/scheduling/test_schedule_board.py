"""The decision board: each change becomes a new version applied to the Router and the
registry and handed to listeners (a publisher); a follower applies only newer versions."""

from __future__ import annotations

import aiohttp

from prfaas.engine_clients.sglang import SGLangClient
from prfaas.gateway.instances import InstanceManager, InstanceState
from prfaas.gateway.router import RoutingState
from prfaas.gateway.scheduling.decisions import ScheduleBoard
from prfaas.policies.schedule_state import ScheduleState


def _board(session: aiohttp.ClientSession) -> tuple[ScheduleBoard, RoutingState, InstanceManager]:
    instances = InstanceManager()
    for iid, role in (("pd-p0", "prefill"), ("pd-d0", "decode")):
        client = SGLangClient(iid, "http://127.0.0.1:9", session)  # never called here
        instances.add(InstanceState(iid, "pd", role, client))
    routing = RoutingState(1000.0)
    state = ScheduleState(threshold=1000, set_point=1000, roles=(("pd-d0", "decode"),))
    return ScheduleBoard(state, routing, instances, clock=lambda: 5.0), routing, instances


async def test_a_change_is_applied_published_and_logged() -> None:
    async with aiohttp.ClientSession() as session:
        board, routing, instances = _board(session)
    published: list[ScheduleState] = []
    board.listeners.append(published.append)
    new = board.change("long-term", "role", "pd-d0 decode -> prefill", {"why": 1},
                       threshold=1500, roles={"pd-d0": "prefill", "pd-p0": "prefill"})  # fmt: skip
    assert published == [new] and new.epoch == 1
    assert routing.threshold == 1500 and instances["pd-d0"].role == "prefill"
    (decision,) = board.recent
    assert (decision.at, decision.loop, decision.kind, decision.epoch) == (
        5.0,
        "long-term",
        "role",
        1,
    )
    assert decision.inputs["why"] == 1 and decision.inputs["state"]["threshold"] == 1500


async def test_a_follower_applies_only_newer_versions() -> None:
    async with aiohttp.ClientSession() as session:
        leader, _, _ = _board(session)
        follower, routing, instances = _board(session)
    seen: list[ScheduleState] = []
    follower.listeners.append(seen.append)
    v1 = leader.change("short-term", "threshold", "raise", {}, threshold=1250)
    v2 = leader.change("short-term", "regime", "abundant", {}, regime="bandwidth_abundant")
    assert follower.apply(ScheduleState.decode(v2.encode()))
    assert not follower.apply(v1)  # stale: never applied over a newer one
    assert seen == [v2]  # its listeners (the dashboard's) see what it applied
    assert (routing.threshold, routing.regime) == (1250, "bandwidth_abundant")
    assert follower.state == v2 and instances["pd-d0"].role == "decode"

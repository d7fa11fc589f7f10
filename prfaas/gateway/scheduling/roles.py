"""Converting one PD-cluster instance between prefill and decode, losing no request.

1. The gateway stops routing new work to it (`InstanceState.draining`: the policies see it
   as unavailable), so nothing new lands there while it drains.
2. The engine's role API (`BaseEngineClient.set_role`: `POST /admin/role` of a reference
   engine, or of a vLLM server's role middleware, `prfaas.engines.vllm.role`) refuses new
   work, lets every request it holds finish, then switches.
   A request that raced the first step is refused with a retryable 503, which the Router
   retries elsewhere.
3. The gateway reads the engine's new bootstrap address (a prefill needs one), records the
   role, and routes to it again.

If any step fails the instance keeps (or gets back) the role the engine reports, and the
failure is returned; nothing is retried here (the long-term loop decides again next period).
Every conversion carries the leader's epoch (0 for a gateway alone): an engine that has seen
a newer leader refuses it (`fenced` in the result; `prfaas.engines.role_fence`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from prfaas.engine_clients.base import EngineError, Role
from prfaas.gateway.instances import InstanceManager


@dataclass(frozen=True)
class ConversionResult:
    instance_id: str
    to_role: Role
    ok: bool
    started_at: float
    """The loop's clock when the drain began."""
    drain_s: float
    """Seconds from the start of the drain to the end (switch included)."""
    error: str | None = None
    fenced: bool = False
    """The engine refused the conversion: a newer leader has announced itself."""


class RoleConverter:
    """Runs conversions on the instances of one registry, on the loop's clock."""

    def __init__(self, instances: InstanceManager, *, drain_timeout_s: float) -> None:
        if not drain_timeout_s > 0:
            raise ValueError(f"drain_timeout_s must be > 0, got {drain_timeout_s}")
        self._instances = instances
        self._timeout_s = drain_timeout_s

    async def convert(self, instance_id: str, to_role: Role, *, epoch: int = 0) -> ConversionResult:
        """Drain `instance_id`, switch it to `to_role`, route to it again, as the leader of
        `epoch`.

        Raises:
            KeyError: no such instance.
        """
        state = self._instances[instance_id]
        loop = asyncio.get_running_loop()
        start = loop.time()
        state.draining = True
        try:
            await state.client.set_role(to_role, timeout_s=self._timeout_s, epoch=epoch)
            info = await state.client.info()
        except EngineError as exc:
            await self._resync(instance_id)
            fenced = exc.code == "fenced"
            took = loop.time() - start
            return ConversionResult(instance_id, to_role, False, start, took, str(exc), fenced)
        finally:
            state.draining = False
        state.role = info.role
        if info.role != "decode":
            state.bootstrap_host = info.bootstrap_host or state.bootstrap_host
            state.bootstrap_port = info.bootstrap_port
        ok = info.role == to_role
        error = None if ok else f"the engine reports role {info.role} after the switch"
        return ConversionResult(instance_id, to_role, ok, start, loop.time() - start, error)

    async def _resync(self, instance_id: str) -> None:
        """After a failed switch, take the role the engine reports (it may have switched)."""
        state = self._instances[instance_id]
        try:
            info = await state.client.info()
        except EngineError:
            return
        state.role = info.role
        if info.role != "decode" and info.bootstrap_port is not None:
            state.bootstrap_host = info.bootstrap_host or state.bootstrap_host
            state.bootstrap_port = info.bootstrap_port


def asked_conversions(
    pd_roles: Mapping[str, Role], asked: object, healthy: Collection[str]
) -> list[tuple[str, Role]]:
    """The conversions an operator's `{instance: role}` asks of the PD cluster (whose roles
    are `pd_roles`), those already in their role left out. The PrfaaS cluster prefills only,
    and the PD cluster keeps at least one `healthy` prefill and one `healthy` decode (as the
    long-term loop does).

    Raises:
        ValueError: what is wrong, naming it.
    """
    if not isinstance(asked, dict) or not asked:
        raise ValueError(f"'roles' must be an object of instance -> role, got {asked!r}")
    moves: list[tuple[str, Role]] = []
    after = dict(pd_roles)
    for instance_id, role in asked.items():
        if instance_id not in pd_roles:
            raise ValueError(f"'roles': {instance_id!r} is not a PD-cluster instance "
                             f"(those are {sorted(pd_roles)})")  # fmt: skip
        if role not in ("prefill", "decode"):
            raise ValueError(f"'roles': {instance_id}'s role must be prefill|decode, got {role!r}")
        target: Role = "prefill" if role == "prefill" else "decode"
        if pd_roles[instance_id] != target:
            moves.append((instance_id, target))
        after[instance_id] = target
    kept = {r for i, r in after.items() if i in healthy}
    for role in ("prefill", "decode"):
        if role not in kept:
            raise ValueError(f"'roles' would leave the PD cluster no healthy {role} instance")
    return moves

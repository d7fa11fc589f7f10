"""Routing policies by name: the built-ins plus third-party ones from the entry-point group
`prfaas.policies` (each entry point names a `BaseRoutingPolicy` subclass)."""

from __future__ import annotations

from importlib.metadata import entry_points

from prfaas.policies.routing import BUILTIN_POLICIES, BaseRoutingPolicy

ENTRY_POINT_GROUP = "prfaas.policies"


def available_policies() -> dict[str, type[BaseRoutingPolicy]]:
    """Every policy name known now: built-ins first; a plug-in may not shadow a built-in."""
    found = dict(BUILTIN_POLICIES)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in found:
            found[ep.name] = _load(ep.name, ep.load())
    return found


def _load(name: str, obj: object) -> type[BaseRoutingPolicy]:
    if not (isinstance(obj, type) and issubclass(obj, BaseRoutingPolicy)):
        raise TypeError(
            f"entry point {name!r} in group {ENTRY_POINT_GROUP!r} is {obj!r}, "
            "not a BaseRoutingPolicy subclass"
        )
    return obj


def create_policy(name: str) -> BaseRoutingPolicy:
    """Instantiate the policy called `name`.

    Raises:
        ValueError: no built-in or installed policy has that name (lists the known ones).
    """
    if name in BUILTIN_POLICIES:
        return BUILTIN_POLICIES[name]()
    policies = available_policies()
    if name not in policies:
        raise ValueError(f"unknown routing policy {name!r} (known: {', '.join(sorted(policies))})")
    return policies[name]()

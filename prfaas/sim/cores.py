"""Where simulated engines compute: cores of their own, or one machine's cores shared.

A profile's compute times (`T_prefill(l)`, `T_decode`) hold for the engines it was measured
on. At the paper's scale each engine has its own GPUs (`DedicatedCores`: a computation of
`s` profile seconds takes `s`). The embedded deployment's engines share one machine's cores,
and its start-up profile says so (`[machine]`, `SharedMachine`): its times were measured
with `busy_engines` engines working at once. `SharedCores` simulates that machine as
processor sharing: an engine with any computation under way counts as working, and each
computation advances at `min(1, cores / engines working)` of its alone speed
(`SharedMachine.cores`), so a prefill runs at its alone time while at most `cores` engines
work and at the profile's time when `busy_engines` do (slower still when more do). An
engine's concurrent computations (a decode's batch) count it once: a decode step serves the
whole batch. Computations that end at the same instant end in the order they began, so a
seeded run repeats exactly.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from prfaas.policies.profile import SharedMachine

DONE_S = 1e-9  # alone seconds left below which a computation has finished (float rounding)


class Cores(Protocol):
    """What a simulated engine computes on."""

    async def compute(self, owner: str, profile_s: float) -> None:
        """Return once `owner` has computed what takes `profile_s` by the profile."""

    def expected_s(self, owner: str, profile_s: float) -> float:
        """How long that computation would take if what runs now kept running."""


class DedicatedCores:
    """Every engine on hardware of its own: the profile's times as they are."""

    async def compute(self, owner: str, profile_s: float) -> None:
        await asyncio.sleep(profile_s)

    def expected_s(self, owner: str, profile_s: float) -> float:
        return profile_s


@dataclass(eq=False)
class _Job:
    owner: str
    left_s: float
    """Alone seconds still to compute."""
    done: asyncio.Future[None] = field(repr=False)


class SharedCores:
    """One machine's cores shared by the engines on it (see the module docstring)."""

    def __init__(self, machine: SharedMachine) -> None:
        self.machine = machine
        self._jobs: dict[_Job, None] = {}  # in the order they began
        self._since = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def speed(self, owners: set[str]) -> float:
        """Each computation's share of its alone speed while `owners` work."""
        return min(1.0, self.machine.cores / len(owners)) if owners else 1.0

    def _owners(self) -> set[str]:
        return {job.owner for job in self._jobs}

    def _alone(self, profile_s: float) -> float:
        """A computation's time on the machine alone (the profile's is `busy_engines`')."""
        return profile_s / self.machine.shared_slowdown

    def expected_s(self, owner: str, profile_s: float) -> float:
        return self._alone(profile_s) / self.speed(self._owners() | {owner})

    async def compute(self, owner: str, profile_s: float) -> None:
        alone = self._alone(profile_s)
        if alone <= DONE_S:
            return
        loop = asyncio.get_running_loop()
        self._advance(loop.time())
        job = _Job(owner, alone, loop.create_future())
        self._jobs[job] = None
        self._reschedule(loop)
        try:
            await job.done
        finally:
            if job in self._jobs:  # cancelled before it finished
                self._advance(loop.time())
                del self._jobs[job]
                self._reschedule(loop)

    def _advance(self, now: float) -> None:
        """Charge every computation the work done since the last change."""
        speed = self.speed(self._owners())
        for job in self._jobs:
            job.left_s -= (now - self._since) * speed
        self._since = now

    def _reschedule(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wake at the next computation's end at today's speed."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._jobs:
            first = min(job.left_s for job in self._jobs)
            speed = self.speed(self._owners())
            self._timer = loop.call_at(self._since + max(first, 0.0) / speed, self._finish, loop)

    def _finish(self, loop: asyncio.AbstractEventLoop) -> None:
        """The timer set for the computation with the least left: it ends (whatever float
        rounding left of it), with every other one as nearly done."""
        self._timer = None
        self._advance(loop.time())
        least = min((job.left_s for job in self._jobs), default=0.0)
        for job in [j for j in self._jobs if j.left_s <= max(least, DONE_S)]:
            del self._jobs[job]
            if not job.done.done():
                job.done.set_result(None)
        self._reschedule(loop)


def cores_for(machine: SharedMachine | None) -> Cores:
    """The cores a profile's engines compute on."""
    return DedicatedCores() if machine is None else SharedCores(machine)

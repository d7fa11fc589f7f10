"""`prfaas bench --target sim:CONFIG`: a `BenchRunner` that runs the spec in the simulator.

The deployment is the profile's PrfaaS-PD at the planner's optimum (threshold and PD split),
routed by the real Router; the spec's workload, arrivals, stopping rule and seed are used
as given. The simulation runs on its own virtual-clock loop in a worker thread, so the
caller's (real) loop stays responsive. Results are flagged `simulated`.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path

from prfaas.common.toml_tables import ConfigError
from prfaas.loadgen.spec import BenchSpec, Progress, RunResult, TargetError
from prfaas.policies.planner import plan
from prfaas.policies.profile import DeploymentProfile, load_profile
from prfaas.sim.deployments import Deployment, SimOptions, deployments
from prfaas.sim.runner import run_bench

SIM_PREFIX = "sim:"
DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "paper_case_study.toml"


class SimBenchRunner:
    """Runs bench plans against a simulated deployment of one profile."""

    def __init__(
        self, profile: DeploymentProfile, *, options: SimOptions | None = None, label: str = ""
    ) -> None:
        self.profile = profile
        self.options = options or SimOptions()
        self.deployment: Deployment = deployments(profile, plan(profile), self.options)["prfaas_pd"]
        self.label = label or f"{SIM_PREFIX}{profile.source}"

    @classmethod
    def from_target(cls, target: str) -> SimBenchRunner:
        """`sim:CONFIG` (a profile TOML path; `sim:` alone: the paper's case study).

        Raises:
            TargetError: not a sim target, or a profile that cannot be loaded.
        """
        if not target.startswith(SIM_PREFIX):
            raise TargetError(f"not a simulator target (sim:CONFIG): {target!r}")
        path = target.removeprefix(SIM_PREFIX) or str(DEFAULT_CONFIG)
        try:
            return cls(load_profile(path), label=target)
        except ConfigError as exc:
            raise TargetError(f"target {target!r}: {exc}") from exc

    async def run(self, plan_: BenchSpec, progress: Progress) -> RunResult:
        """Simulate `plan_`; records carry virtual-clock times (seconds)."""
        started_at = datetime.now(UTC).isoformat(timespec="seconds")
        progress.start(plan_.num_requests, plan_.duration_s)
        try:
            records, _, end = await asyncio.to_thread(
                run_bench, self.profile, self.deployment, self.options, plan_
            )
        finally:
            progress.stop()
        return RunResult(self.label, tuple(records), end, started_at, simulated=True)

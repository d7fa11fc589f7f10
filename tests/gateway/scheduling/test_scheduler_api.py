"""The schedulers' decisions are visible and steerable over HTTP: `/admin/state` shows the
schedule, `POST /admin/state` pins `t` (the loops stop moving it) until `{"scheduler":
"auto"}`, `/metrics` exports the schedule, and every change is one JSON log line with its
inputs. The `[scheduler]` table of a deployment file is read and validated. Null engines:
these tests are about the gateway."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
from gateway_helpers import Engines, GatewayFactory, deployment
from metrics_helpers import Scrape

from prfaas.common.toml_tables import ConfigError
from prfaas.gateway.api.assembly import build_gateway
from prfaas.gateway.deployment import load_deployment
from prfaas.gateway.scheduling.config import SchedulerConfig

OPERATOR = {"Authorization": "Bearer op-key"}


def _scheduled(engines: Engines, profile: Path) -> object:
    config = deployment(engines.urls, admin_keys=("op-key",))
    return replace(config, scheduler=SchedulerConfig(profile=str(profile), tick_s=0.05))


async def test_admin_state_pin_release_and_metrics(
    null_engines: Engines,
    gateway_factory: GatewayFactory,
    case_study_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="prfaas.scheduler")
    url, gateway = await gateway_factory(_scheduled(null_engines, case_study_path))
    async with aiohttp.ClientSession(headers=OPERATOR) as s:
        state = (await (await s.get(f"{url}/admin/state")).json())["scheduler"]
        assert (state["threshold"], state["set_point"], state["pinned"]) == (100, 100, False)
        assert state["roles"] == {"pd-p0": "prefill", "pd-d0": "decode"}
        assert state["loops"] == {"short_term": True, "long_term": True, "tick_s": 0.05,
                                  "period_s": 60.0}  # fmt: skip
        epoch = state["epoch"]
        r = await s.post(f"{url}/admin/state", json={"threshold": 500})
        pinned = (await r.json())["scheduler"]
        await asyncio.sleep(0.3)  # several ticks: a pinned t does not move
        later = await (await s.get(f"{url}/admin/state")).json()
        bad = await s.post(f"{url}/admin/state", json={"scheduler": "manual"})
        by_hand = await s.post(f"{url}/admin/state", json={"roles": {"pd-p0": "decode"}})
        refused = (by_hand.status, (await by_hand.json())["error"]["code"])
        r = await s.post(f"{url}/admin/state", json={"scheduler": "auto"})
        released = (await r.json())["scheduler"]
        scrape = Scrape.parse(await (await s.get(f"{url}/metrics")).text())
    assert pinned["pinned"] and pinned["epoch"] == epoch + 1 and pinned["threshold"] == 500
    assert pinned["recent"][-1]["loop"] == "operator" and pinned["recent"][-1]["kind"] == "pin"
    assert later["threshold"] == 500 and gateway.router.state.threshold == 500
    assert bad.status == 400 and not released["pinned"]
    assert refused == (409, "scheduler_owns_roles")  # the long-term loop converts here
    assert scrape.value("prfaas_threshold_set_point_tokens") == 500
    assert scrape.value("prfaas_schedule_epoch") == epoch + 1
    assert scrape.value("prfaas_pd_instances", role="decode") == 1
    assert scrape.value("prfaas_schedule_changes_total", loop="operator", kind="pin") == 1
    lines = [json.loads(r.message) for r in caplog.records if r.name == "prfaas.scheduler"]
    pin = next(line for line in lines if line["kind"] == "pin")
    assert pin["inputs"]["threshold"] == 500 and pin["inputs"]["state"]["threshold"] == 500


async def test_a_scheduler_needs_a_profile(null_engines: Engines) -> None:
    config = replace(deployment(null_engines.urls), scheduler=SchedulerConfig())
    async with aiohttp.ClientSession() as session:
        with pytest.raises(ValueError, match="needs a planner profile"):
            build_gateway(config, session)


def _write(tmp: Path, scheduler: str) -> Path:
    path = tmp / "deploy.toml"
    path.write_text(
        '[[instances]]\nid = "pd-d0"\ncluster = "pd"\nrole = "decode"\n'
        'url = "http://127.0.0.1:1"\n\n' + scheduler
    )
    return path


def test_scheduler_table_is_read_with_its_nested_tuning(tmp_path: Path) -> None:
    """The profile path is relative to the deployment file; nested tables set the cores."""
    path = _write(tmp_path, '[scheduler]\nprofile = "p.toml"\nperiod_s = 30\n'
                            '[scheduler.trim]\nhigh_water = 0.8\nband = [0.5, 1.5]\n'
                            '[scheduler.rebalance]\nconfirm_periods = 3\n'
                            '[scheduler.steps]\nstep_ticks = 3\n')  # fmt: skip
    sched = load_deployment(path).scheduler
    assert sched is not None
    assert sched.profile == str(tmp_path / "p.toml") and sched.period_s == 30
    assert sched.trim.high_water == 0.8 and sched.trim.band == (0.5, 1.5)
    assert sched.rebalance.confirm_periods == 3 and sched.regime.confirm_ticks == 10
    assert sched.steps.step_ticks == 3 and sched.steps.output_step == 1.5
    assert sched.long_term_config().steps is sched.steps


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("[scheduler]\nperiod_s = 0.5\n", "scheduler.period_s: must be >= tick_s (got 0.5)"),
        ("[scheduler.trim]\nhigh_water = 2\n", "scheduler.trim.high_water: must be in (0, 1.5]"),
        ("[scheduler]\nperiods = 3\n", "scheduler.periods: unknown key"),
        ("[scheduler.steps]\noutput_step = 1\n", "scheduler.steps.output_step: must be > 1"),
    ],
)
def test_bad_scheduler_values_are_named(tmp_path: Path, table: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_deployment(_write(tmp_path, table))

"""`benchmarks/scheduling_live.py`'s twin-only parts (SIMULATED, no engines): the phases a
live run may be limited to, and the steadiness check that holds each phase's conditions on
the twin for longer than a live phase lasts."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "benchmarks/results/scheduling_live/2026-12-06-eighth.json"


def _benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "scheduling_live", ROOT / "benchmarks/scheduling_live.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_a_run_limited_to_some_phases_runs_them_back_to_back_at_their_own_rates() -> None:
    bench = _benchmark()
    recorded = json.loads(RECORDED.read_text())
    profile, whole, _ = bench._recorded(recorded, dedicated_cores=False)
    only = bench.live_scenario(profile, 60.0, ("link-drop", "longer"))
    assert [(p.name, p.start_s, p.end_s) for p in only.phases] == [
        ("link-drop", 0.0, 60.0),
        ("longer", 60.0, 120.0),
    ]
    by_name = {p.name: p.conditions for p in whole.phases}
    assert [p.conditions for p in only.phases] == [by_name["link-drop"], by_name["longer"]]
    # the link the driver paces each phase at is the steady phase's, scaled
    assert math.isclose(bench.base_link_gbps(profile), by_name["steady"].link_gbps)


def test_the_steadiness_check_holds_each_phase_under_capacity(tmp_path: Path) -> None:
    """Each phase but the burst (over the oracle's capacity: an overload, not a steady
    load) held 400 s on one seed, and the moves of `t` after three 30-second periods
    counted."""
    out = tmp_path / "twin.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/scheduling_live.py"), "--twin-of",
         str(RECORDED), "--twin-seeds", "0", "--twin-steady-s", "400", "--twin-period-s",
         "30", "--json", str(out)],
        check=True, cwd=ROOT, capture_output=True, timeout=300,
    )  # fmt: skip
    rows = {r["phase"]: r for r in json.loads(out.read_text())["twin_steadiness"]}
    assert list(rows) == ["steady", "link-drop", "burst", "longer", "decode-heavy"]
    assert rows["burst"] == {"phase": "burst", "over_capacity": True}
    for name in ("steady", "link-drop", "longer", "decode-heavy"):
        (seed,) = rows[name]["seeds"]
        assert seed["seed"] == 0 and seed["t_moves"] >= 0 and seed["set_point_moves"] >= 0


def test_a_recorded_run_of_some_phases_has_its_twin_on_those_phases() -> None:
    """A run's JSON keeps `--phases` as a list; its twin runs those phases only."""
    bench = _benchmark()
    recorded = json.loads(RECORDED.read_text())
    recorded["args"]["phases"] = ["longer"]
    _, scenario, _ = bench._recorded(recorded, dedicated_cores=False)
    assert [(p.name, p.start_s) for p in scenario.phases] == [("longer", 0.0)]


def test_a_change_is_timed_by_the_decision_that_made_it_not_by_the_sample() -> None:
    """A set-point move the gateway made at 59.4 s, first shown by the sample at 60.2 s,
    counts at 59.4 s (settling is judged to the second); a decision whose time falls
    outside the span between the samples (the two clocks disagree) is not trusted."""
    bench = _benchmark()
    assert bench.decided_at(59.4, 59.2, 60.2) == 59.4
    assert bench.decided_at(61.0, 59.2, 60.2) is None  # after the sample that showed it
    assert bench.decided_at(20.0, 59.2, 60.2) is None  # long before the sample before
    fresh = [
        {"loop": "long-term", "kind": "rebalance", "at_s": 59.4},
        {"loop": "long-term", "kind": "set_point", "at_s": 59.4},
        {"loop": "short-term", "kind": "threshold", "at_s": 59.9},
    ]
    assert bench.change_at("set_point", fresh, 60.2) == 59.4
    assert bench.change_at("threshold", fresh, 60.2) == 59.9
    assert bench.change_at("role", fresh, 60.2) == 60.2  # no decision of that kind: the sample
    assert bench.change_at("set_point", [{**fresh[1], "at_s": None}], 60.2) == 60.2
    ended = [{"loop": "long-term", "kind": "role", "at_s": 59.6}]  # a conversion's end sets t
    assert bench.change_at("set_point", ended, 60.2) == bench.change_at("role", ended, 60.2)
    assert bench.change_at("threshold", ended, 60.2) == 59.6

"""`benchmarks/kv_index.py` on its quick size, ours alone: the index ends up holding the
same entries and answering the same cross-check lookups whichever layout the events took
on the wire (PrfaaS's positional arrays or vLLM's tagged maps, `--layout map`), so the
two layouts' ingest rates measure the same work; and each apply call's hold is read as
wall time and as this thread's CPU time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(directory: Path, layout: str) -> dict[str, Any]:
    out = directory / f"{layout}.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/kv_index.py"), "--quick", "--sides", "ours",
         "--no-snapshot", "--reps", "5", "--layout", layout, "--out", str(out)],
        check=True, cwd=ROOT, capture_output=True, timeout=300,
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert report["layout"] == layout
    (row,) = report["sizes"].values()
    ours: dict[str, Any] = row["ours"]
    return ours


@pytest.fixture(scope="module")
def positional(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run(tmp_path_factory.mktemp("positional"), "positional")


def test_both_layouts_build_the_same_index(positional: dict[str, Any], tmp_path: Path) -> None:
    maps = _run(tmp_path, "map")
    assert positional["layout"] == "positional" and maps["layout"] == "map"
    assert positional["entries_held"] == maps["entries_held"] == positional["entries"]
    assert positional["checks"] == maps["checks"]
    assert any(positional["checks"].values())


def test_the_hold_is_split_into_cpu_and_off_cpu_time(positional: dict[str, Any]) -> None:
    ingest = positional["ingest"]
    wall, cpu = ingest["apply_calls"], ingest["apply_calls_cpu"]
    assert 0 < cpu["longest_wall_call_cpu_ms"] <= cpu["max_ms"]
    assert cpu["over_1ms_off_cpu"] <= wall["over_1ms"]
    assert cpu["of_those_preempted"] + cpu["of_those_waiting"] == cpu["over_1ms_off_cpu"]
    assert cpu["of_those_beside_a_helper_thread"] <= cpu["over_1ms_off_cpu"]
    assert cpu["longest_wall_call_voluntary_switches"] >= 0
    assert 0 <= cpu["p99_ms"] <= cpu["max_ms"]
    assert ingest["machine_steal_s"] >= 0

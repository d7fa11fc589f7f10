"""The GPU campaign (`scripts/gpu_campaign.py`) in its `--device cpu --dry-run` mode: every
stage runs for real at tiny sizes (engine processes, the transport, real model forwards),
and the JSON and markdown have the shape a GPU run's will; the device-generic engine path
(copier, wire dtypes, send queue) is exercised on the CPU. Its numbers are not measurements.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "gpu_campaign.py"
STAGES = ["env", "device_check", "overlap", "pd", "phi_kv"]


def test_dry_run_writes_every_stage(engine_model_cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "campaign"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--dry-run", "--out", str(out),
         "--carried", str(tmp_path / "no-wheels")],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PRFAAS_MODEL_CACHE": str(engine_model_cache)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # three files come back from a device run: the JSON, the tables, every stage's output
    assert sorted(p.name for p in out.iterdir()) == ["campaign.json", "campaign.md", "logs.txt"]
    assert all(f"=== {name} ===" in (out / "logs.txt").read_text() for name in STAGES)
    report = json.loads((out / "campaign.json").read_text())
    assert list(report["stages"]) == STAGES
    assert report["materialise_rc"] == 0
    assert all(s["status"] == "ok" and "result" in s for s in report["stages"].values())
    results = {name: stage["result"] for name, stage in report["stages"].items()}

    assert results["env"]["device"]["requested"] == "cpu"
    assert "torch" in results["env"]["libraries"]
    assert results["device_check"]["bit_exact"] is True

    overlap = results["overlap"]
    # a paced and an unpaced link, each with the engine's transport, the fewer-hand-off one
    # and the sender process
    assert overlap["bit_exact"] is True and len(overlap["rows"]) == 6
    assert {(r["frame_kib"], r["gil_switch_ms"], r["sender"]) for r in overlap["rows"]} == {
        (1024, 5, "loop"),
        (8192, 0.5, "loop"),
        (1024, 0.5, "process"),
    }
    for row in overlap["rows"]:
        assert row["kv_bytes"] > 0 and row["forward_alone_ms"] > 0
        assert 0 < row["share_before_forward_end"] <= 1 and row["tail_after_forward_ms"] >= 0

    pd = results["pd"]
    assert pd["greedy_equal"] is True and len(pd["rows"]) == 1
    # the engines ran with the flags
    assert (pd["frame_kib"], pd["gil_switch_ms"], pd["sender"]) == (1024, 0.5, "process")
    row = pd["rows"][0]
    assert row["kv_bytes"] > 0
    assert all(row[f"ttft_{m}_s"] > 0 for m in ("aggregated", "layerwise", "send_after"))

    phi = results["phi_kv"]
    assert set(phi["presets"]) == {"qwen3.5", "kimi-linear", "mimo-v2-flash", "ring-2.5",
                                   "dense-gqa", "dense-mla"}  # fmt: skip
    assert all(len(p["rows"]) == 2 and "error" not in p for p in phi["presets"].values())
    twins = {(r["preset"], r["twin"]) for r in phi["ratios"]}
    assert twins == {("qwen3.5", "dense-gqa"), ("kimi-linear", "dense-mla"),
                     ("mimo-v2-flash", "dense-gqa"), ("ring-2.5", "dense-mla")}  # fmt: skip
    # hybrids keep less KV than their dense twins at every length, as Table 3's models do
    for preset in ("qwen3.5", "kimi-linear", "mimo-v2-flash", "ring-2.5"):
        twin = {"qwen3.5": "dense-gqa", "mimo-v2-flash": "dense-gqa"}.get(preset, "dense-mla")
        mine, dense = phi["presets"][preset]["rows"], phi["presets"][twin]["rows"]
        assert all(a["kv_bytes"] < b["kv_bytes"] for a, b in zip(mine, dense, strict=True))

    table = (out / "campaign.md").read_text()
    assert "dry run" in table and "### Targets" in table and "### Phi_kv" in table
    assert "(8192 KiB frames, GIL 0.5 ms)" in table

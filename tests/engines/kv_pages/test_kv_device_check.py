"""`scripts/kv_device_check.py` (the device check a lent GPU runs) runs here with
`--device cpu`: the same code with CPU tensors, every layout and mode bit-exact, and the
report carries the figures the README quotes from a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "kv_device_check.py"


def test_the_device_check_runs_on_cpu_and_reports_bit_exact(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    small = ["--tokens", "200", "--layers", "8", "--heads", "2", "--dim", "32", "--page", "16"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", *small, "--matmuls", "1",
         "--reps", "1", "--rate-gbps", "2", "--budget-mb", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["bit_exact"] is True and report["device"] == "cpu"
    rows = report["results"]
    assert set(rows) == {f"{lay}/{mode}" for lay in ("vllm-nhd", "vllm-hnd", "sglang")
                         for mode in ("layerwise", "send_after")}  # fmt: skip
    for name, row in rows.items():
        assert row["bit_exact"] is True, name
        assert row["forward_ms"] > 0 and row["layer_latency_ms_max"] >= row["layer_latency_ms_p50"]
        assert row["host_budget_peak_mb"] <= 1.05, name  # the 1 MiB budget held
    # send-after places nothing before the forward ends
    assert all(rows[f"{lay}/send_after"]["share_placed_before_forward_end"] == 0
               for lay in ("vllm-nhd", "sglang"))  # fmt: skip

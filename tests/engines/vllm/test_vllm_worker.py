"""The connector's worker halves over vLLM 0.32's own KV cache views (`worker_check.py`,
run in the vLLM environment): page bytes and states placed bit-exactly for the NHD, HND and
block-outermost layouts, kernel-block splitting, MLA and fp8 caches, in both model runners'
call orders, through the real transport on loopback; a layout, dtype or TP mismatch and a
prefix hit inside a block refused before anything is placed; TP rank r paired with rank r."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest
from vllm_helpers import ROOT, VLLM_PYTHON, require_vllm

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    require_vllm()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_LOGGING_LEVEL": "ERROR"}
    run = subprocess.run(
        [str(VLLM_PYTHON), str(ROOT / "tests/engines/vllm/worker_check.py")],
        capture_output=True, text=True, env=env, timeout=540, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return out


ROUND_TRIPS = [
    f"{layout}-{kind}-k{kernel}-{order}"
    for layout in ("LBNHC", "LBHNC", "BLNHC")
    for kind, kernel in (("bf16", None), ("bf16", 16), ("mla", None), ("fp8", None))
    if not (kernel and layout == "BLNHC")
    for order in ("v1", "v2")
]


@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_pages_and_states_round_trip_bit_exactly(results: dict[str, Any], case: str) -> None:
    assert results[case] == {
        "ok": True, "pages_equal": True, "states_equal": True, "skipped_untouched": True
    }  # fmt: skip


def test_a_block_aligned_local_hit_is_left_alone(results: dict[str, Any]) -> None:
    assert results["skip-aligned"]["ok"], results["skip-aligned"]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("skip-unaligned", "inside a 32-token block"),
        (
            "layout-mismatch",
            "KV cache layout differs: the prefill's pages are NHD, this decode's HND",
        ),
        ("dtype-mismatch", "KV cache dtype differs"),
        (
            "tp-size-mismatch",
            "tensor-parallel size differs: the prefill runs TP=2, this decode TP=1",
        ),
    ],
)
def test_mismatches_fail_the_request_with_a_clear_error(
    results: dict[str, Any], case: str, message: str
) -> None:
    assert not results[case]["ok"]
    assert message in results[case]["error"]


def test_tp_rank_r_listens_on_base_plus_r_and_pairs_with_rank_r(results: dict[str, Any]) -> None:
    assert results["tp-rank1-port"]["ok"]
    assert results["tp-rank1"]["ok"], results["tp-rank1"]

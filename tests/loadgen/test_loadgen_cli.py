"""`prfaas bench` end to end: the null server in its own process, table, JSON and plots."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from prfaas.cli.main import main


def test_bench_against_null_process(
    null_process: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run.json"
    code = main(
        [
            "bench",
            "--target",
            null_process,
            "--workload",
            "shared-prefix",
            "--system-len",
            "64",
            "--question-len",
            "16",
            "--output-len",
            "4",
            "--rate",
            "100",
            "--num-requests",
            "40",
            "--seed",
            "3",
            "--no-progress",
            "--slo",
            "ttft=10s",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "plots"),
        ]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "completed / failed" in table and "40 / 0" in table and "goodput" in table
    doc = orjson.loads(out.read_bytes())
    assert doc["summary"]["completed"] == 40 and len(doc["requests"]) == 40
    assert doc["run"]["arrivals"] == "100 req/s (Poisson)"
    # 8 groups share a 64-token prefix: the null server (block 16) reports real cache hits
    assert doc["summary"]["prefix_hit_rate"] > 0.3
    assert doc["summary"]["goodput"] == pytest.approx(doc["summary"]["request_throughput"])
    assert all(r["completion_tokens"] == 4 for r in doc["requests"])
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs == [
        "input_length_by_route.png",
        "throughput_latency_over_time.png",
        "ttft_cdf_by_route.png",
    ]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--target", "sim:/nonexistent/x.toml"], "x.toml: cannot read"),
        (["--target", "http://127.0.0.1:9", "--rate", "1", "--concurrency", "2"], "not both"),
        (
            ["--target", "http://127.0.0.1:9", "--workload", "mooncake:/nonexistent.jsonl"],
            "cannot read trace",
        ),
        (["--target", "http://127.0.0.1:9", "--slo", "ttft=soon"], "bad SLO"),
        (["--target", "http://127.0.0.1:9", "--rate", "-3"], "rate must be > 0 req/s, got -3"),
        (["--target", "http://127.0.0.1:9", "--burstiness", "0.5"], "give --rate too"),
        (["--target", "http://127.0.0.1:9", "--speedup", "5"], "use it with mooncake:PATH"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("prfaas bench: error:") and needle in err

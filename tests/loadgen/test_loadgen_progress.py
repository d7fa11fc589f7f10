"""The live progress bar and the final table render what the run measured."""

from __future__ import annotations

import io

from rich.console import Console

from prfaas.loadgen.progress import RichProgress
from prfaas.loadgen.records import RequestRecord
from prfaas.loadgen.report import print_report
from prfaas.loadgen.spec import RunResult
from prfaas.loadgen.stats import Slo, summarize


def _rec(i: int, ok: bool) -> RequestRecord:
    return RequestRecord(
        request_id=f"r{i}",
        session_id=i,
        turn=0,
        scheduled_s=0.0,
        start_s=0.0,
        ok=ok,
        error=None if ok else "timeout after 1s",
        status=200,
        ttft_s=0.1 if ok else None,
        e2e_s=0.5 if ok else None,
        itl_s=(0.1,) * 4 if ok else (),
        sent_tokens=10,
        prompt_tokens=10,
        completion_tokens=5 if ok else None,
        cached_tokens=None,
        route="prfaas" if i % 2 else "pd",
        incremental_tokens=None,
    )


def test_progress_counts_done_and_failed() -> None:
    out = io.StringIO()
    bar = RichProgress(Console(file=out, force_terminal=True, width=100))
    bar.start(total=3, duration_s=None)
    for i, ok in enumerate([True, False, True]):
        bar.done(_rec(i, ok))
    bar._bar.refresh()
    bar.stop()
    text = out.getvalue()
    assert "3/3" in text and "failed 1" in text


def test_table_shows_counts_routes_and_errors() -> None:
    records = [_rec(i, ok=i != 3) for i in range(4)]
    result = RunResult("http://x", tuple(records), 2.0, "2026-01-01T00:00:00+00:00")
    out = io.StringIO()
    summary = summarize(records, 2.0, Slo(ttft=1.0))
    print_report(result, summary, {"target": "http://x"}, Console(file=out, width=120))
    text = out.getvalue()
    assert "3 / 1" in text and "1.50" in text  # completed/failed, 3 req / 2 s
    assert "pd 2 (67%)" in text and "prfaas 1 (33%)" in text
    assert "1 x timeout after 1s" in text and "goodput" in text

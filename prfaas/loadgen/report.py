"""Reports of a run: the terminal table (rich) and the JSON document."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from prfaas.loadgen.spec import RunResult
from prfaas.loadgen.stats import LatencyStats, Slo, Summary

JSON_VERSION = 1


def _ms(value: float) -> str:
    return f"{value * 1e3:,.1f}"


def _latency_rows(table: Table, name: str, stats: LatencyStats | None) -> None:
    if stats is None:
        table.add_row(f"{name} (ms)", "n/a")
        return
    cells = (
        f"mean {_ms(stats.mean)}  median {_ms(stats.median)}  p90 {_ms(stats.p90)}  "
        f"p99 {_ms(stats.p99)}"
    )
    table.add_row(f"{name} (ms)", cells)


def render_table(result: RunResult, summary: Summary, header: dict[str, str]) -> Table:
    """The final table: run header, counts, throughput, latencies, routes, cache, errors."""
    title = "prfaas bench" + ("  [SIMULATED, not measured]" if result.simulated else "")
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("metric", style="bold")
    table.add_column("value")
    for key, value in header.items():
        table.add_row(key, value)
    table.add_section()
    table.add_row("completed / failed", f"{summary.completed} / {summary.failed}")
    table.add_row("duration (s)", f"{summary.duration_s:.2f}")
    table.add_row("request throughput (req/s)", f"{summary.request_throughput:.2f}")
    table.add_row("input tokens/s", f"{summary.input_token_throughput:,.0f}")
    table.add_row("output tokens/s", f"{summary.output_token_throughput:,.0f}")
    if summary.goodput is not None:
        table.add_row("goodput (req/s)", f"{summary.goodput:.2f}")
        table.add_row("SLO attainment", f"{summary.slo_attainment or 0:.1%}")
    table.add_section()
    for name, stats in (
        ("TTFT", summary.ttft),
        ("TPOT", summary.tpot),
        ("ITL", summary.itl),
        ("E2E", summary.e2e),
    ):
        _latency_rows(table, name, stats)
    table.add_section()
    total = sum(summary.routes.values()) or 1
    routes = ", ".join(f"{k} {v} ({v / total:.0%})" for k, v in sorted(summary.routes.items()))
    reported = set(summary.routes) - {"-"}
    table.add_row("routes (x-prfaas-route)", routes if reported else "not reported")
    hit = summary.prefix_hit_rate
    table.add_row("prefix hit rate", "not reported" if hit is None else f"{hit:.1%}")
    for kind, count in summary.errors.items():
        table.add_row("error", f"{count} x {kind}")
    return table


def print_report(
    result: RunResult, summary: Summary, header: dict[str, str], console: Console | None = None
) -> None:
    """Print the final table."""
    (console or Console()).print(render_table(result, summary, header))


def report_json(
    result: RunResult, summary: Summary, header: dict[str, str], slo: Slo | None
) -> dict[str, Any]:
    """The `--json` document: run header, summary, and every request record."""
    return {
        "version": JSON_VERSION,
        "target": result.target,
        "started_at": result.started_at,
        "simulated": result.simulated,
        "run": header,
        "slo": None if slo is None else slo.describe(),
        "summary": summary.to_json(),
        "requests": [r.to_json() for r in result.records],
    }


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Write `document` to `path` (parents created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))

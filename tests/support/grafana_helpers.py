"""deploy/grafana/prfaas.json read back: its panels (those of a gateway alone, and those of
the `[coordination]` row, whose metrics only a coordinated replica exports) and the metric
names their PromQL queries select."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import promql_parser

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "prfaas.json"
COORDINATION_ROW = "Gateway replicas ([coordination])"


def dashboard() -> dict[str, Any]:
    board: dict[str, Any] = json.loads(GRAFANA.read_text())
    return board


def panels(board: dict[str, Any], *, coordination: bool) -> list[dict[str, Any]]:
    """The panels before the coordination row (`coordination=False`: any gateway exports
    their metrics) or after it (a replica with `[coordination]` does); rows left out."""
    (row,) = [n for n, p in enumerate(board["panels"]) if p.get("title") == COORDINATION_ROW]
    chosen = board["panels"][row + 1 :] if coordination else board["panels"][:row]
    return [p for p in chosen if p["type"] != "row"]


def metric_names(query: str) -> set[str]:
    """The metrics a Grafana PromQL query selects (its variables given values as Grafana
    would). Raises ValueError if it does not parse."""
    expr = promql_parser.parse(query.replace("$__rate_interval", "1m").replace("$job", ".*"))
    names: set[str] = set()

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            names.add(node.name)

    promql_parser.walk(expr, visit)
    return names


def queried(chosen: list[dict[str, Any]]) -> set[str]:
    """Every metric the panels' queries select."""
    return {name for p in chosen for t in p["targets"] for name in metric_names(t["expr"])}

"""Reports of simulations: the `prfaas simulate` JSON document and terminal tables.

Everything printed here is labelled SIMULATED: these are discrete-event simulation outputs
driven by a profile, never measurements.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table

from prfaas.sim.find_max import FindMaxResult
from prfaas.sim.runner import SimResult
from prfaas.sim.table6 import PAPER_TABLE6, Table6, Table6Row

JSON_KEYS = (
    "offered_rate",
    "served_rate",
    "ttft_mean_s",
    "ttft_p90_s",
    "tpot_mean_s",
    "egress_gbps",
    "theta_prfaas",
    "theta_pd_p",
    "theta_pd_d",
    "p_offload",
    "threshold_tokens",
)


def run_json(result: SimResult, found: FindMaxResult | None = None) -> dict[str, Any]:
    """The `--json` document of one run (with `lambda_max` and the probes under --find-max)."""
    doc: dict[str, Any] = {"simulated": True}
    if found is not None:
        doc["lambda_max"] = found.lambda_max
        doc["probes"] = [{"rate": r, "sustained": ok} for r, ok in found.probes]
    full = result.to_json()
    doc.update({k: full[k] for k in JSON_KEYS})
    doc["details"] = {k: v for k, v in full.items() if k not in JSON_KEYS}
    return doc


def _fmt(value: Any, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int) or (isinstance(value, float) and abs(value) >= 1000):
        return f"{value:,.0f}"
    return format(value, spec) if isinstance(value, float) else str(value)


def run_table(result: SimResult, found: FindMaxResult | None = None) -> Table:
    """One run as a two-column table."""
    table = Table(title="prfaas simulate (SIMULATED, not measured)", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value")
    d = result.spec.deployment
    table.add_row("deployment", f"{d.name} (policy {d.policy})")
    table.add_row(
        "instances", f"{d.n_prfaas} PrfaaS prefill, {d.n_p} PD prefill, {d.n_d} PD decode"
    )
    table.add_row("workload", result.spec.workload.name)
    if found is not None:
        table.add_row("lambda_max (req/s)", _fmt(found.lambda_max, ".3f"))
    for key, value in run_json(result)["details"].items():
        if key not in ("simulated", "deployment", "policy", "workload"):
            table.add_row(key, _fmt(value))
    table.add_section()
    for key in JSON_KEYS:
        table.add_row(key, _fmt(getattr(result.metrics, key)))
    return table


def table6_table(t6: Table6) -> Table:
    """Table 6 side by side, one column per deployment: paper (published), model
    (representative T(E[L]) and exact E[T(L)] costing), simulation (SIMULATED)."""
    table = Table(title="Table 6: paper vs model vs simulation (sim rows: SIMULATED)")
    table.add_column("")
    for r in t6.rows:
        table.add_column(r.name, justify="right")
    for label, cell in _table6_rows(t6):
        table.add_row(label, *(cell(r) for r in t6.rows))
    return table


def _pair(a: float | None, b: float | None) -> str:
    return f"{_fmt(a, '.2f')} / {_fmt(b, '.2f')}"


def _paper_ttft(r: Table6Row) -> str:
    paper = PAPER_TABLE6[r.name]
    return _pair(paper["ttft_mean_s"], paper["ttft_p90_s"])


def _ttft(result: SimResult) -> str:
    return _pair(result.metrics.ttft_mean_s, result.metrics.ttft_p90_s)


def _egress(r: Table6Row) -> str:
    return _fmt(r.at_own.metrics.egress_gbps if r.model.n_prfaas else None, ".1f")


def _table6_rows(t6: Table6) -> list[tuple[str, Callable[[Table6Row], str]]]:
    common = f"{t6.common_rate:.2f}"
    return [
        ("λmax paper", lambda r: _fmt(PAPER_TABLE6[r.name]["lambda_max"], ".2f")),
        ("λmax model T(E[L])", lambda r: _fmt(r.model.lambda_max, ".2f")),
        ("λmax model E[T(L)]", lambda r: _fmt(r.model_exact.lambda_max, ".2f")),
        ("λmax sim, bisection", lambda r: _fmt(r.sim.lambda_max, ".2f")),
        ("λmax sim, capacity", lambda r: _fmt(r.at_own.metrics.lambda_capacity, ".2f")),
        ("ratio paper", lambda r: _fmt(PAPER_TABLE6[r.name]["ratio"], ".2f")),
        ("ratio model T(E[L])", lambda r: _fmt(t6.ratio(r.name, "model"), ".2f")),
        ("ratio model E[T(L)]", lambda r: _fmt(t6.ratio(r.name, "model_exact"), ".2f")),
        ("ratio sim, bisection", lambda r: _fmt(t6.ratio(r.name), ".2f")),
        ("ratio sim, capacity", lambda r: _fmt(t6.ratio(r.name, "capacity"), ".2f")),
        ("TTFT mean / P90 paper", _paper_ttft),
        (f"TTFT mean / P90 sim @{common}", lambda r: _ttft(r.at_common)),
        ("TTFT mean / P90 sim @90% own", lambda r: _ttft(r.at_own)),
        ("egress Gbps sim @90% own", _egress),
        ("p_offload sim", lambda r: _fmt(r.at_own.metrics.p_offload, ".2f")),
    ]  # fmt: skip


def print_table(table: Table, console: Console | None = None) -> None:
    """Print a table to the terminal."""
    (console or Console()).print(table)

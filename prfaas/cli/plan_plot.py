"""Figure 5 of the paper from a plan: (a) Lambda_max vs N_p, (b) the two prefill bounds vs t."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from prfaas.policies.planner import PlanReport


def write_figure5(report: PlanReport, out_dir: Path) -> list[Path]:
    """Write fig5a_lambda_vs_np.png and fig5b_bounds_vs_threshold.png into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        _fig_a(report, out_dir / "fig5a_lambda_vs_np.png"),
        _fig_b(report, out_dir / "fig5b_bounds_vs_threshold.png"),
    ]


def _fig_a(report: PlanReport, path: Path) -> Path:
    g, best = report.grid, report.prfaas_pd
    j = int(np.argmin(np.abs(g.thresholds - (best.threshold_tokens or 0.0))))
    prefill = np.fmin(g.prfaas_bound[j], g.pd_prefill_bound[:, j])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(g.n_p, g.lambda_max[:, j], "o-", label="Lambda_max", color="black")
    ax.plot(g.n_p, prefill, "s--", label="prefill bound min(Θprfaas/p, Θpd-p/(1-p))")
    ax.plot(g.n_p, g.decode_bound, "^--", label="decode bound Θpd-d")
    ax.axvline(best.n_p, color="grey", lw=0.8)
    ax.set(
        xlabel="N_p (PD-cluster prefill instances)",
        ylabel="throughput (req/s)",
        title=f"(a) Lambda_max vs N_p at t = {best.threshold_tokens:,.0f} tokens",
    )
    ax.set_ylim(0, float(np.nanmax(g.decode_bound)) * 1.05)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _fig_b(report: PlanReport, path: Path) -> Path:
    g, best = report.grid, report.prfaas_pd
    k = best.n_p - 1
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(g.thresholds / 1000, g.prfaas_bound, label="PrfaaS bound Θprfaas/p")
    ax.plot(g.thresholds / 1000, g.pd_prefill_bound[k], label="PD-prefill bound Θpd-p/(1-p)")
    ax.plot(
        [(best.threshold_tokens or 0) / 1000],
        [best.lambda_max],
        "*",
        ms=14,
        color="red",
        label=f"optimum t = {best.threshold_tokens:,.0f}, Λ = {best.lambda_max:.2f}",
    )
    ax.set(
        xlabel="threshold t (K tokens)",
        ylabel="throughput bound (req/s)",
        title=f"(b) prefill bounds vs t at N_p = {best.n_p}, N_d = {best.n_d}",
    )
    ax.set_ylim(0, best.lambda_max * 3)
    ax.set_xscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

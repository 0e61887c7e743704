"""Figures of the O(1/sqrt(nT)) check: the synthetic problem's fitted slopes against -1/2, the GPT from a
trained checkpoint (fitted slopes per policy and what analysis.rate measured about the regime, table rate_gpt.md), and the GPT sweep's failure-free curves
against n x step (from results/analysis/rate-<profile>.json only).

    python -m paper_figures.rate [--quick]
"""

from __future__ import annotations

import sys

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from mecefo.errors import UsageError, guarded
from mecefo.results import quick_flag, read_measurement


from .common import plain_log_ticks, save_figure, style, write_table


def slope_figure(points: list, fits: dict, title: str, start: float | None = None):
    pts = pd.DataFrame(points)
    fig, ax = plt.subplots(figsize=(8, 4))
    sns.scatterplot(pts, x="nT", y="mean_sq_grad", hue="policy", hue_order=list(fits), style="n", ax=ax)
    xs = np.logspace(np.log10(pts["nT"].min()), np.log10(pts["nT"].max()), 50)
    for i, (p, f) in enumerate(fits.items()):
        ax.plot(xs, np.exp(f["intercept"]) * xs ** f["slope"], color=sns.color_palette()[i], lw=1,
                label=f"{p}: slope {f['slope']:.3f} [{f['ci95'][0]:.3f}, {f['ci95'][1]:.3f}]")
    anchor = pts[pts["policy"] == "failure-free"]["mean_sq_grad"].max() * pts["nT"].min() ** 0.5
    ax.plot(xs, anchor * xs ** -0.5, "k--", lw=1, label="theory: slope -1/2")
    if start is not None:
        ax.axhline(start, color="grey", lw=0.8, ls=":", label="the start's ||grad f(x_0)||^2")
    ax.set(xscale="log", yscale="log", xlabel="nT", ylabel="(1/T) sum ||grad f(x_t)||^2", title=title)
    plain_log_ticks(ax.xaxis)
    plain_log_ticks(ax.yaxis)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)
    fig.tight_layout()
    return fig


def _slope(f: dict | None) -> str:
    return f"{f['slope']:+.3f} [{f['ci95'][0]:+.3f}, {f['ci95'][1]:+.3f}]" if f else "not fitted"


def gpt_table(gpt: dict) -> str:
    lines = [f"# Theorem 1's rate on the GPT (nano from a checkpoint trained {gpt['reference_steps']} steps, momentum "
             "SGD, eta = C sqrt(n/T), per-rank batch fixed)\n",
             "| policy | slope of (1/T) sum ‖grad f(x_t)‖² against nT (held-out, unbiased), 95% interval | word | plug-in "
             "estimate's slope | slope of the excess over the start | on unseen training windows | held-out, in log n | "
             "held-out, in log T |", "|---|---|---|---|---|---|---|---|"]
    for p in gpt["policies"]:
        f = gpt["fits"][p]
        two = f.get("n_and_T")
        lines.append(f"| {p} | {_slope(f['unbiased'])} | {f['unbiased']['word'] if f['unbiased'] else 'not fitted'} | "
                     f"{_slope(f['plug_in'])} | {_slope(f['excess_over_start'])} | {_slope(f.get('train'))} | "
                     f"{_slope(two and {'slope': two['slope_n'], 'ci95': two['ci95_n']})} | "
                     f"{_slope(two and {'slope': two['slope_T'], 'ci95': two['ci95_T']})} |")
    lines.append(f"\n{gpt['verdict']}")
    return "\n".join(lines) + "\n"


def figures(result: dict, committed: bool = False) -> list:
    style()
    out = []
    if result.get("gpt_rate"):
        fits = {p: f["unbiased"] for p, f in result["gpt_rate"]["fits"].items() if f["unbiased"]}
        out += save_figure(slope_figure(result["gpt_rate"]["points"], fits,
                                        "GPT (nano) from a trained checkpoint, momentum SGD, eta ~ sqrt(n/T)",
                                        start=result["gpt_rate"]["start_grad_sq"]), "rate_gpt_slope",
                           committed=committed)
        out.append(write_table("rate_gpt", gpt_table(result["gpt_rate"])))
    fig = slope_figure(result["synthetic"]["points"], result["synthetic"]["fits"],
                       "Synthetic non-convex problem, momentum SGD, eta ~ sqrt(n/T)")
    out += save_figure(fig, "rate_synthetic")
    if result["gpt"]:
        df = pd.DataFrame(result["gpt"])
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        for ax, col in zip(axes, ("loss", "grad_norm")):
            sns.lineplot(df, x="nT", y=col, hue="n", palette="viridis", ax=ax, lw=0.8)
            ax.set(xscale="log", yscale="log", xlabel="n x step")
        fig.suptitle("GPT sweep, failure-free runs (global batch fixed: n x step counts ranks, not samples)", fontsize=9)
        out += save_figure(fig, "rate_gpt_curves")
    return out


def main(argv: list[str] | None = None) -> int:
    quick = quick_flag(argv, __doc__)
    result = read_measurement("analysis", "rate", quick, "analysis.rate")
    if result.get("gpt_rate") and "policies" not in result["gpt_rate"]:
        raise UsageError(f"results/analysis/rate lacks gpt_rate.policies (an older analysis.rate wrote it); run python -m "
                         f"analysis.rate{' --quick' if quick else ''} again")
    for p in figures(result, committed=not quick):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

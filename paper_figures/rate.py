"""Figures of the O(1/sqrt(nT)) check: the synthetic problem's fitted slopes against -1/2, the GPT in the
theory's regime (fitted slopes per policy, table rate_gpt.md), and the GPT sweep's failure-free curves
against n x step (from results/analysis/rate-<profile>.json only).

    python -m paper_figures.rate [--quick]
"""

from __future__ import annotations

import sys

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from mecefo.errors import guarded
from mecefo.results import quick_flag, read_measurement

from .common import save_figure, style, write_table


def slope_figure(points: list, fits: dict, title: str):
    pts = pd.DataFrame(points)
    fig, ax = plt.subplots(figsize=(5.8, 4))
    sns.scatterplot(pts, x="nT", y="mean_sq_grad", hue="policy", hue_order=list(fits), style="n", ax=ax)
    xs = np.logspace(np.log10(pts["nT"].min()), np.log10(pts["nT"].max()), 50)
    for i, (p, f) in enumerate(fits.items()):
        ax.plot(xs, np.exp(f["intercept"]) * xs ** f["slope"], color=sns.color_palette()[i], lw=1,
                label=f"{p}: slope {f['slope']:.3f} [{f['ci95'][0]:.3f}, {f['ci95'][1]:.3f}]")
    anchor = pts[pts["policy"] == "failure-free"]["mean_sq_grad"].max() * pts["nT"].min() ** 0.5
    ax.plot(xs, anchor * xs ** -0.5, "k--", lw=1, label="theory: slope -1/2")
    ax.set(xscale="log", yscale="log", xlabel="nT", ylabel="(1/T) sum ||grad f(x_t)||^2", title=title)
    ax.legend(fontsize=6, loc="lower left")
    return fig


def gpt_table(gpt: dict) -> str:
    lines = ["# Theorem 1's rate on the GPT (nano, momentum SGD, eta ~ sqrt(n/T), per-rank batch fixed)\n",
             "| policy | slope of (1/T) sum ‖grad f(x_t)‖² against nT | 95% interval | -1/2 inside | regime of the bound reached |",
             "|---|---|---|---|---|"]
    for p, f in gpt["fits"].items():
        lines.append(f"| {p} | {f['slope']:.3f} | [{f['ci95'][0]:.3f}, {f['ci95'][1]:.3f}] | "
                     f"{'yes' if f['contains_-0.5'] else 'no'} | {'yes' if f['regime_reached'] else 'no'} |")
    growth = gpt["held_out_growth"]
    lines.append(f"\nThe held-out squared gradient norm at the last iterate is {growth:.2f}x its value at the start "
                 "(mean over runs): " + ("it grows while the loss falls, so the iterates are still leaving the "
                                         "initial region, far from the near-stationary regime the bound describes."
                                         if growth > 1 else "it falls along training."))
    return "\n".join(lines) + "\n"


def figures(result: dict, committed: bool = False) -> list:
    style()
    out = []
    if result.get("gpt_rate"):
        out += save_figure(slope_figure(result["gpt_rate"]["points"], result["gpt_rate"]["fits"],
                                        "GPT (nano), momentum SGD, eta ~ sqrt(n/T), held-out gradient"), "rate_gpt_slope",
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
    for p in figures(read_measurement("analysis", "rate", quick, "analysis.rate"), committed=not quick):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

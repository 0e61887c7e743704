"""Figure: Assumption 3's relative gradient error of MeCeFO at every step with a failure, per failure level,
against the paper's 0.6 (from results/analysis/grad_error-<profile>.json only).

    python -m paper_figures.grad_error [--quick]
"""

from __future__ import annotations

import sys

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from mecefo.errors import guarded
from mecefo.results import quick_flag, read_measurement

from .common import save_figure, style


def main(argv: list[str] | None = None) -> int:
    result = read_measurement("analysis", "grad_error", quick_flag(argv, __doc__), "analysis.grad_error")
    bound, rows, levels = result["paper_bound"], result["points"], list(result["levels"])
    style()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    if rows:
        sns.scatterplot(pd.DataFrame(rows), x="step", y="relative error", hue="level", hue_order=levels, s=12, ax=ax)
    ax.axhline(bound, color="k", ls="--", lw=1, label=f"paper: below {bound} (LLaMA-1B)")
    ax.axhline(1.0, color="grey", ls=":", lw=1, label="1 (Assumption 3 needs < 1)")
    ax.legend(fontsize=7)
    ax.set(title="Relative gradient error of MeCeFO vs failure-free, same batches", ylabel="||g~ - g|| / ||g||")
    for p in save_figure(fig, "grad_error"):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

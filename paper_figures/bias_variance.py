"""Figures of the bias/variance measurement: MSE against the low-rank r beside drop's, bias^2 and variance
by parameter group, MSE against the failure level (from results/analysis/bias_variance-<profile>.json only).

    python -m paper_figures.bias_variance [--quick]
"""

from __future__ import annotations

import sys

import pandas as pd
import seaborn as sns

from mecefo.errors import guarded
from mecefo.results import quick_flag, read_measurement

from .common import save_figure, style


def figures(df: pd.DataFrame) -> list:
    style()
    order = ["early", "middle", "late"]
    fixed = df[(df["group"] == "all") & df["name"].str.contains("r=")].copy()
    fixed["family"] = fixed["name"].str.split(" ").str[0]
    g = sns.relplot(fixed, x="r", y="mse", hue="family", col="stage", col_order=order, kind="line", marker="o",
                    height=3.2, facet_kws={"sharey": False})
    for ax, stage in zip(g.axes.flat, order):
        sub = df[(df["group"] == "all") & (df["stage"] == stage)]
        for name, style_ in (("drop", "--"), ("failure-free", ":")):
            row = sub[sub["name"] == name].iloc[0]
            ax.axhline(row["mse"], ls=style_, color="k", lw=1, label=name)
            ax.axhspan(*row["mse_ci"], color="grey", alpha=0.15)
        ax.set(xscale="log", ylabel="MSE ||g~ - grad f||^2")
    g.axes.flat[0].legend(fontsize=7)
    g.figure.suptitle("MSE vs low-rank r, one failed rank: drop (unbiased, fewer samples) vs MeCeFO (biased, all samples)", fontsize=9, y=1.03)
    out = save_figure(g.figure, "bias_variance_mse_vs_r")

    groups = df[(df["group"] != "all") & df["name"].isin(["drop", "skip_attention", "failure-free"] +
                                                          [n for n in df["name"].unique() if n.startswith("mecefo r=")][:1])]
    melted = groups.melt(id_vars=["stage", "name", "group"], value_vars=["bias_sq_debiased", "variance"], var_name="part")
    g = sns.catplot(melted, x="group", y="value", hue="name", col="part", row="stage", row_order=order, kind="bar",
                    height=2.6, aspect=1.5, sharey=False)
    g.set_xticklabels(rotation=20)
    out += save_figure(g.figure, "bias_variance_by_group")

    levels = df[(df["group"] == "all") & df["name"].str.contains("@")].copy()
    levels["policy"], levels["level"] = levels["name"].str.split(" @ ").str[0], levels["name"].str.split(" @ ").str[1]
    g = sns.catplot(levels, x="level", y="mse", hue="policy", col="stage", col_order=order, kind="point", height=3,
                    sharey=False)
    out += save_figure(g.figure, "bias_variance_vs_level")
    return out


def main(argv: list[str] | None = None) -> int:
    result = read_measurement("analysis", "bias_variance", quick_flag(argv, __doc__), "analysis.bias_variance")
    for p in figures(pd.DataFrame(result["rows"])):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

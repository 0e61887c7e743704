"""The Table 3 analog, validation-loss curves, perplexity against failure level, and the Figure 3 analog,
from results/sweep/ only; with the default profile it also rewrites the README's results section.

    python -m paper_figures.sweep [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from mecefo.errors import UsageError, guarded
from mecefo.results import RESULTS, paper_numbers, sweep_index
from mecefo.stats import Paired, interval_half_width, paired_relative_change, seeds_needed, verdict_word

from .common import read_jsonl, save_figure, style, update_readme, write_table

LEVELS = ["none", "low", "mid", "high"]
PAPER = paper_numbers()


def load(profile: str) -> tuple[pd.DataFrame, dict]:
    path = sweep_index(profile == "quick")
    if not path.exists():
        raise UsageError(f"no {path}; run python -m experiments.sweep{' --quick' if profile == 'quick' else ''} first")
    index = json.loads(path.read_text())
    df = pd.DataFrame([c for c in index["cells"] if "final_val_ppl" in c])
    return df, index


def relative_table(df: pd.DataFrame) -> pd.DataFrame:
    """Mean and std of final validation ppl per (n, level, policy) over seeds, and the change vs failure-free
    at the same n (paired by seed where the seeds match)."""
    main = df[df["tag"] == "main"]
    base = main[main["level"] == "none"].set_index(["n", "seed"])["final_val_ppl"]
    rows = []
    for (n, level, policy), g in main.groupby(["n", "level", "policy"]):
        ref = base.reindex([(n, s) for s in g["seed"]]).to_numpy()
        rel = 100 * (g["final_val_ppl"].to_numpy() / ref - 1)
        rows.append({"n": n, "level": level, "policy": policy, "seeds": len(g), "ppl_mean": g["final_val_ppl"].mean(),
                     "ppl_std": g["final_val_ppl"].std(ddof=1) if len(g) > 1 else float("nan"),
                     "rel_mean": np.nanmean(rel), "rel_std": np.nanstd(rel, ddof=1) if len(g) > 1 else float("nan")})
    return pd.DataFrame(rows)


def fmt(mean: float, std: float, digits: int = 2) -> str:
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if np.isfinite(std) else "")


def table_markdown(rel: pd.DataFrame, index: dict) -> str:
    lines = ["# Validation perplexity under failures (the paper's Table 3, at our scale)\n",
             f"Embedded Shakespeare+Milton corpus, base config `experiments/configs/{index['base_config']}.toml`, "
             "global batch fixed and split over n ranks; mean ± std over seeds (seeds column); change relative to "
             "failure-free at the same n, paired by seed.\n"]
    for n, g in rel[rel["n"] > 1].groupby("n"):
        lines += [f"\n## n = {n}\n", "| policy | " + " | ".join(LEVELS) + " |", "|---|" + "---|" * len(LEVELS)]
        none = g[g["level"] == "none"].iloc[0]
        for policy in sorted(set(g["policy"]) - {"none"}):
            cells = [fmt(none["ppl_mean"], none["ppl_std"])]
            for level in LEVELS[1:]:
                r = g[(g["level"] == level) & (g["policy"] == policy)]
                cells.append("" if r.empty else f"{fmt(r.iloc[0]['ppl_mean'], r.iloc[0]['ppl_std'])} "
                             f"({r.iloc[0]['rel_mean']:+.2f}%, {r.iloc[0]['seeds']} seed{'s' if r.iloc[0]['seeds'] > 1 else ''})")
            lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    t3 = PAPER["table3_val_ppl"]
    lines += ["\n## The paper's Table 3 (C4 validation perplexity, MeCeFO)\n", f"Source: {t3['source']}.\n",
              "| model | " + " | ".join(t3["levels"]) + " | high vs none |", "|---|" + "---|" * (len(t3["levels"]) + 1)]
    for name, vals in t3["rows"].items():
        lines.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in vals) + f" | {100 * (vals[-1] / vals[0] - 1):+.2f}% |")
    lines.append(f"\nSource of our numbers: results/sweep/index-{index['profile']}.json, commit `{index['git_commit'][:12]}`.\n")
    return "\n".join(lines)


def curves(df: pd.DataFrame):
    rows = []
    for _, c in df[(df["tag"] == "main") & df["policy"].isin(["none", "mecefo", "drop"])].iterrows():
        for m in read_jsonl(RESULTS / c["run"] / "metrics.jsonl"):
            if m.get("val_loss") is not None and not m.get("replay"):
                rows.append({"n": c["n"], "level": c["level"], "policy": "failure-free" if c["policy"] == "none" else c["policy"],
                             "seed": c["seed"], "step": m["step"], "val_loss": m["val_loss"]})
    data = pd.DataFrame(rows)
    data = data[data["step"] >= data["step"].max() * 0.2]  # the early drop dwarfs the differences
    ns = sorted(data["n"].unique())
    fig, axes = plt.subplots(1, len(ns), figsize=(3.6 * len(ns), 3.4), sharey=True, squeeze=False)
    for ax, n in zip(axes[0], ns):
        sub = data[data["n"] == n]
        sns.lineplot(sub, x="step", y="val_loss", hue="level", hue_order=[l for l in LEVELS if l in set(sub["level"])],
                     style="policy", errorbar="sd", ax=ax)
        ax.set(title=f"n = {n}", ylabel="validation loss")
        if ax is not axes[0][-1] and ax.get_legend():
            ax.get_legend().remove()
    return fig


def ppl_vs_level(rel: pd.DataFrame, df: pd.DataFrame):
    main = df[df["tag"] == "main"].copy()
    none = main[main["level"] == "none"]
    parts = [main[main["level"] != "none"]]
    for policy in sorted(set(main["policy"]) - {"none"}):  # failure-free is every policy's left point
        parts.append(none.assign(policy=policy))
    data = pd.concat(parts, ignore_index=True)
    data = data[data["n"] > 1]
    data["level"] = pd.Categorical(data["level"], LEVELS, ordered=True)
    g = sns.catplot(data, x="level", y="final_val_ppl", hue="policy", col="n", kind="point", errorbar="sd",
                    dodge=0.3, height=3.4, aspect=1.0, sharey=False, markersize=4)
    g.set_axis_labels("failure level", "final validation ppl (mean ± sd)")
    return g.figure


def figure3(df: pd.DataFrame):
    fig3 = df[df["tag"] == "fig3"]
    if fig3.empty:
        return None
    n, level = int(fig3.iloc[0]["n"]), fig3.iloc[0]["level"]
    runs = [(f"neighbours skip {'attention' if t == 'skip_attention' else 'FFN'} in backward", c)
            for t in ("skip_attention", "skip_ffn") for _, c in fig3[fig3["techniques"] == t].iterrows()]
    runs += [("failure-free", c) for _, c in df[(df["n"] == n) & (df["level"] == "none")].iterrows()]
    rows = []
    for label, c in runs:
        metrics = pd.DataFrame([m for m in read_jsonl(RESULTS / c["run"] / "metrics.jsonl") if m.get("loss") is not None])
        metrics["smoothed"] = metrics["loss"].rolling(20, min_periods=1).mean()
        rows += [{"variant": label, "seed": c["seed"], "step": s, "train loss": v} for s, v in zip(metrics["step"], metrics["smoothed"])]
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    sns.lineplot(pd.DataFrame(rows), x="step", y="train loss", hue="variant", errorbar="sd", ax=ax)
    ax.set(title=f"Figure 3 analog: n = {n}, {level} failures (20-step mean)", ylim=(None, None))
    return fig


COMPARISONS = [("mecefo", "none"), ("drop", "none"), ("mecefo", "drop"), ("spread-mecefo", "none")]


def paired(df: pd.DataFrame, n: int, level: str, a: str, b: str) -> Paired | None:
    """a's final ppl against b's at (n, level), paired by seed (b = 'none': failure-free at the same n)."""
    main = df[(df["tag"] == "main") & (df["n"] == n)]
    x = main[(main["level"] == level) & (main["policy"] == a)].set_index("seed")["final_val_ppl"]
    y = main[(main["level"] == ("none" if b == "none" else level)) & (main["policy"] == b)].set_index("seed")["final_val_ppl"]
    seeds = sorted(set(x.index) & set(y.index))
    return paired_relative_change(x[seeds], y[seeds]) if seeds else None


def paired_table(df: pd.DataFrame, n: int) -> list[str]:
    levels = [lvl for lvl in LEVELS[1:] if lvl in set(df["level"])]
    lines = ["| level | comparison | change of final val ppl (95% interval) | verdict | seeds | seeds for ±1 |",
             "|---|---|---|---|---|---|"]
    for level in levels:
        for a, b in COMPARISONS:
            r = paired(df, n, level, a, b)
            if r is None:
                continue
            ci = "" if not np.isfinite(r.ci[0]) else f" [{r.ci[0]:+.2f}, {r.ci[1]:+.2f}]"
            need = seeds_needed(r.sd)
            lines.append(f"| {level} | {a} − {'failure-free' if b == 'none' else b} | {r.mean:+.2f}%{ci} | "
                         f"{verdict_word(r.ci)} | {r.pairs} | {need if need else '—'} |")
    return lines


def power_figure(df: pd.DataFrame, n: int):
    """95% interval half-width of each paired comparison at the high level against the number of seeds,
    from the measured seed-to-seed standard deviation."""
    ks = np.arange(2, 65)
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for a, b in COMPARISONS:
        r = paired(df, n, "high", a, b)
        if r is not None and np.isfinite(r.sd):
            ax.plot(ks, [interval_half_width(r.sd, k) for k in ks], label=f"{a} − {'failure-free' if b == 'none' else b} (sd {r.sd:.2f})")
    ax.axhline(1.0, color="k", ls="--", lw=1, label="target ±1 point")
    ax.set(xlabel="seeds", ylabel="95% half-width (points of ppl, %)", yscale="log", title=f"Power curve, n = {n}, high failures")
    ax.legend(fontsize=7)
    return fig


def results_section(rel: pd.DataFrame, df: pd.DataFrame, index: dict) -> str:
    """The README's results paragraph, from the numbers only: paired changes with intervals and verdicts."""
    t3 = PAPER["table3_val_ppl"]["rows"]
    paper = {lvl: [100 * (v[i] / v[0] - 1) for v in t3.values()] for i, lvl in enumerate(LEVELS) if i}
    n_main = int(rel["n"].max())
    lines = [f"{index['profile'].capitalize()} CPU sweep ({len(index['cells'])} runs, {index['wall_time_s'] / 60:.0f} min, commit "
             f"`{index['git_commit'][:12]}`; tables and figures in `paper_figures/out/sweep_*`). Change of the final "
             f"validation perplexity at n = {n_main}, paired by seed (same initialisation, data order and failure "
             "schedule), with its 95% t-interval; the verdict is computed from the interval (equal within ±1 point, "
             "better, worse, or unresolved); 'seeds for ±1' is the power curve read at a half-width of 1 point:\n",
             *paired_table(df, n_main),
             "\nThe paper's MeCeFO change against failure-free (350M-7B): "
             + ", ".join(f"{lvl} +{min(v):.2f} .. +{max(v):.2f}%" for lvl, v in paper.items()) + "."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    profile = "quick" if parser.parse_args(argv).quick else "default"
    df, index = load(profile)
    rel = relative_table(df)
    style()
    paths = [write_table("sweep_table3", table_markdown(rel, index))]
    paths += save_figure(curves(df), "sweep_val_loss_curves")
    paths += save_figure(ppl_vs_level(rel, df), "sweep_ppl_vs_level")
    fig = figure3(df)
    if fig is not None:
        paths += save_figure(fig, "sweep_figure3_skip_attention_vs_ffn")
    paths += save_figure(power_figure(df, int(rel["n"].max())), "sweep_power_curve")
    section = results_section(rel, df, index)
    paths.append(write_table("results_section", section + "\n"))
    if profile == "default":
        paths.append(update_readme("results", section))
    for p in paths:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

"""The Table 3 analog, validation-loss curves, perplexity against failure level, and the Figure 3 analog,
from results/sweep/ only; with the default (--long) profile it also rewrites the README's results (results-long)
section and the committed PNGs in docs/figures/ (with a _long suffix for --long).

    python -m paper_figures.sweep [--quick | --long]
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

from mecefo import failures
from mecefo.errors import UsageError, guarded
from mecefo.results import RESULTS, load_config, paper_numbers, sweep_index
from mecefo.stats import Paired, interval_half_width, paired_relative_change, seeds_needed, verdict_word

from .common import read_jsonl, save_figure, style, update_readme, write_table

LEVELS = ["none", "low", "mid", "high"]
PAPER = paper_numbers()
METRIC = "val_ppl"  # exp of the mean validation loss of a run's last evaluations (experiments.sweep)
PROFILES = ("quick", "default", "long")


def load(profile: str) -> tuple[pd.DataFrame, dict]:
    path = sweep_index(profile == "quick") if profile != "long" else sweep_index(False).with_name("index-long.json")
    if not path.exists():
        raise UsageError(f"no {path}; run python -m experiments.sweep{'' if profile == 'default' else ' --' + profile} first")
    index = json.loads(path.read_text())
    df = pd.DataFrame([c for c in index["cells"] if METRIC in c])
    if df.empty:
        raise UsageError(f"{path} has no finished run with {METRIC!r} (an older format, or every run failed); rerun "
                         f"python -m experiments.sweep{'' if profile == 'default' else ' --' + profile}")
    for col, default in (("failable", ""), ("tag", "main")):
        df[col] = df[col].fillna(default) if col in df else default
    return df, index


def relative_table(df: pd.DataFrame) -> pd.DataFrame:
    """Mean and std of the perplexity per (n, level, policy) over seeds, and the change vs failure-free
    at the same n (paired by seed where the seeds match)."""
    main = df[df["tag"] == "main"]
    base = main[main["level"] == "none"].set_index(["n", "seed"])[METRIC]
    rows = []
    for (n, level, policy), g in main.groupby(["n", "level", "policy"]):
        at_n = n in base.index.get_level_values(0)  # otherwise n = 1's failure-free runs: the same samples
        ref = np.array([base.get((n if at_n else 1, s), np.nan) for s in g["seed"]])
        rel = 100 * (g[METRIC].to_numpy() / ref - 1)
        rows.append({"n": n, "level": level, "policy": policy, "seeds": len(g), "ppl_mean": g[METRIC].mean(),
                     "ppl_std": g[METRIC].std(ddof=1) if len(g) > 1 else float("nan"),
                     "rel_mean": np.nanmean(rel), "rel_std": np.nanstd(rel, ddof=1) if len(g) > 1 else float("nan")})
    return pd.DataFrame(rows)


def fmt(mean: float, std: float, digits: int = 2) -> str:
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if np.isfinite(std) else "")


def table_markdown(rel: pd.DataFrame, index: dict, n_main: int) -> str:
    lines = ["# Validation perplexity under failures (the paper's Table 3, at our scale)\n",
             f"Embedded Shakespeare+Milton corpus, base config `experiments/configs/{index['base_config']}.toml`, "
             f"global batch fixed and split over n ranks; perplexity = {evaluation_words(index)}; mean ± std over "
             "seeds (seeds column); change relative to failure-free at the same n, paired by seed.\n"]
    for n, g in rel[rel["n"] == n_main].groupby("n"):  # the n-sweep: sweep_n.md
        lines += [f"\n## n = {n}\n", "| policy | " + " | ".join(LEVELS) + " |", "|---|" + "---|" * len(LEVELS)]
        if g[g["level"] == "none"].empty:
            lines.append("(no failure-free run at this n)")
            continue
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


def mark_warm_start(ax, index: dict) -> None:
    k = load_config(index["base_config"]).cluster.failure_free_steps
    if k:
        ax.axvline(k, color="grey", ls=":", lw=1)
        ax.annotate("failures start", (k, 0.98), xycoords=("data", "axes fraction"), fontsize=7, ha="left", va="top")


def curves(df: pd.DataFrame, n: int, index: dict):
    rows = []
    main = df[(df["tag"] == "main") & (df["n"] == n) & df["policy"].isin(["none", "mecefo", "drop"])]
    for _, c in main.iterrows():
        for m in read_jsonl(RESULTS / c["run"] / "metrics.jsonl"):
            if m.get("val_loss") is not None and not m.get("replay"):
                rows.append({"level": c["level"], "policy": "failure-free" if c["policy"] == "none" else c["policy"],
                             "seed": c["seed"], "step": m["step"], "val_loss": m["val_loss"]})
    data = pd.DataFrame(rows)
    data = data[data["step"] >= data["step"].max() * 0.2]  # the early drop dwarfs the differences
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    sns.lineplot(data, x="step", y="val_loss", hue="level", hue_order=[lvl for lvl in LEVELS if lvl in set(data["level"])],
                 style="policy", errorbar="sd", ax=ax)
    ax.set(title=f"Validation loss, n = {n} (mean ± sd over seeds)", ylabel="validation loss")
    mark_warm_start(ax, index)
    return fig


def ppl_vs_level(df: pd.DataFrame, n: int):
    """The paired change of each policy against failure-free training per failure level, with its 95% interval
    (a level's seeds differ from another's, so raw means across levels would not compare like with like)."""
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    levels = [lvl for lvl in LEVELS[1:] if lvl in set(df["level"])]
    for k, policy in enumerate(("mecefo", "drop", "spread-mecefo")):
        xs, means, lows, highs = [], [], [], []
        for i, lvl in enumerate(levels):
            r = paired(df, n, lvl, policy, "none")
            if r is None:
                continue
            lo, hi = r.ci if np.isfinite(r.ci[0]) else (r.mean, r.mean)
            xs.append(i + (k - 1) * 0.12)
            means.append(r.mean)
            lows.append(r.mean - lo)
            highs.append(hi - r.mean)
        if xs:
            ax.errorbar(xs, means, yerr=[lows, highs], fmt="o-", capsize=3, label=policy)
    paper = PAPER["table3_val_ppl"]["rows"]
    for i, lvl in enumerate(levels):
        vals = [100 * (v[LEVELS.index(lvl)] / v[0] - 1) for v in paper.values()]
        ax.fill_between([i - 0.3, i + 0.3], min(vals), max(vals), color="grey", alpha=0.3, lw=0,
                        label="paper, MeCeFO (350M-7B)" if i == 0 else None)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(levels)), levels)
    ax.set(xlabel="failure level", ylabel="change of val ppl vs failure-free (%)",
           title=f"Paired change, n = {n} (95% t-intervals)")
    ax.legend(fontsize=7)
    return fig


# ------------------------------------------------------------------------------------ paired comparisons
# A row of the results: (label, a, b), each side a selector of runs (tag, level, policy, techniques) at
# the main n; a's perplexity against b's, paired by seed.
NONE = ("main", "none", "none", "mecefo")


def runs(df: pd.DataFrame, n: int, tag: str, level: str, policy: str, techniques: str = "mecefo") -> pd.Series:
    sel = df[(df["tag"] == tag) & (df["n"] == n) & (df["level"] == level) & (df["policy"] == policy)
             & (df["techniques"] == techniques)]
    return sel.set_index("seed")[METRIC]


def paired_of(df: pd.DataFrame, n: int, a: tuple, b: tuple) -> Paired | None:
    x, y = runs(df, n, *a), runs(df, n, *b)
    seeds = sorted(set(x.index) & set(y.index))
    return paired_relative_change(x[seeds], y[seeds]) if seeds else None


def paired(df: pd.DataFrame, n: int, level: str, a: str, b: str) -> Paired | None:
    """a's perplexity against b's at (n, level) in the main cells, paired by seed (b = 'none': failure-free)."""
    return paired_of(df, n, ("main", level, a, "mecefo"), NONE if b == "none" else ("main", level, b, "mecefo"))


COMPARISONS = [("mecefo", "none"), ("drop", "none"), ("mecefo", "drop"), ("spread-mecefo", "none")]


def name(policy: str) -> str:
    return "failure-free" if policy == "none" else policy


def rows_of(df: pd.DataFrame, index: dict) -> list[tuple[str, str, tuple, tuple]]:
    """Every paired row of the results table: (row, comparison, a, b)."""
    out = [(lvl, f"{name(a)} − {name(b)}", ("main", lvl, a, "mecefo"), NONE if b == "none" else ("main", lvl, b, "mecefo"))
           for lvl in LEVELS[1:] if lvl in set(df["level"]) for a, b in COMPARISONS]
    asym = df[df["tag"] == "asymmetric"]
    if not asym.empty:
        first, last = asym.iloc[0]["failable"].split(",")[0], asym.iloc[0]["failable"].split(",")[-1]
        label = f"high, asymmetric (only ranks {first}-{last} fail)"
        out += [(label, f"{p} − failure-free", ("asymmetric", "high", p, "mecefo"), NONE) for p in ("mecefo", "drop")]
        out += [(label, "mecefo − drop", ("asymmetric", "high", "mecefo", "mecefo"), ("asymmetric", "high", "drop", "mecefo"))]
    high = failures.SCENARIOS["high"]
    for spec in sorted(set(df[df["tag"] == "frequency"]["level"]), key=lambda s: -failures.scenario(s).interval_h):
        sc = failures.scenario(spec)
        label = (f"high x{high.interval_h / sc.interval_h:g} frequency (Table 1 interval {sc.interval_h:g} h, "
                 f"recovery {sc.recovery_h:g} h)")
        out += [(label, f"{p} − failure-free", ("frequency", spec, p, "mecefo"), NONE) for p in ("mecefo", "drop")]
        out += [(label, "mecefo − drop", ("frequency", spec, "mecefo", "mecefo"), ("frequency", spec, "drop", "mecefo"))]
    return out


def figure3_rows(df: pd.DataFrame) -> list[tuple[str, str, tuple, tuple]]:
    att, ffn = ("fig3", "high", "mecefo", "skip_attention"), ("fig3", "high", "mecefo", "skip_ffn")
    return [("high", "skip attention − failure-free", att, NONE), ("high", "skip FFN − failure-free", ffn, NONE),
            ("high", "skip attention − skip FFN", att, ffn)]


def paired_table(df: pd.DataFrame, n: int, rows: list | None = None) -> list[str]:
    lines = ["| row | comparison | change of val ppl (95% interval) | verdict | seeds | seeds for ±1 |",
             "|---|---|---|---|---|---|"]
    for label, what, a, b in (rows_of(df, {}) if rows is None else rows):
        r = paired_of(df, n, a, b)
        if r is None:
            continue
        ci = "" if not np.isfinite(r.ci[0]) else f" [{r.ci[0]:+.2f}, {r.ci[1]:+.2f}]"
        need = seeds_needed(r.sd)
        lines.append(f"| {label} | {what} | {r.mean:+.2f}%{ci} | {verdict_word(r.ci)} | {r.pairs} | {need if need else '—'} |")
    return lines


def n_sweep(df: pd.DataFrame) -> pd.DataFrame:
    """Per n: mecefo's and drop's change at high failures against failure-free training at n = 1 (seed 0; the
    same samples at every n), the reference of every n alike."""
    main, rows = df[(df["tag"] == "main") & (df["seed"] == 0)], []
    ref = main[(main["level"] == "none")].set_index("n")[METRIC]
    for n in sorted(main["n"].unique()):
        at = main[main["n"] == n].set_index(["level", "policy"])[METRIC]
        row = {"n": int(n), "failure-free ppl": ref.get(1, np.nan)}
        for p in ("mecefo", "drop"):
            row[f"{p} − failure-free (%)"] = 100 * (at.get(("high", p), np.nan) / row["failure-free ppl"] - 1)
        rows.append(row)
    return pd.DataFrame(rows)


def n_sweep_markdown(table: pd.DataFrame) -> str:
    cols = list(table.columns)
    lines = ["# n-sweep at a fixed global batch, high failures, seed 0\n",
             "Every n against failure-free training at n = 1 (the same samples at every n).\n", "| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
    lines += ["| " + " | ".join(str(int(r[c])) if c == "n" else f"{r[c]:.2f}" for c in cols) + " |" for _, r in table.iterrows()]
    return "\n".join(lines) + "\n"


def n_sweep_figure(table: pd.DataFrame):
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for p in ("mecefo", "drop"):
        sub = table[table["n"] > 1]
        ax.plot(sub["n"], sub[f"{p} − failure-free (%)"], marker="o", label=p)
    ax.axhline(0, color="k", lw=0.8)
    ax.set(xscale="log", xlabel="data-parallel ranks n (global batch fixed)", ylabel="change of val ppl (%)",
           title="n-sweep, high failures, seed 0")
    ax.set_xticks(table["n"][table["n"] > 1], [str(v) for v in table["n"][table["n"] > 1]])
    ax.legend()
    return fig


def figure3(df: pd.DataFrame, n: int, index: dict):
    """Figure 3 analog: training-loss curves (20-step mean, mean ± sd over seeds) and the paired change of
    the perplexity with its 95% interval, skip attention vs skip FFN on the neighbour."""
    fig3 = df[(df["tag"] == "fig3") & (df["n"] == n)]
    if fig3.empty:
        return None
    runs_ = [(f"skip {'attention' if t == 'skip_attention' else 'FFN'}", c)
             for t in ("skip_attention", "skip_ffn") for _, c in fig3[fig3["techniques"] == t].iterrows()]
    runs_ += [("failure-free", c) for _, c in df[(df["n"] == n) & (df["level"] == "none") & (df["tag"] == "main")].iterrows()]
    rows = []
    for label, c in runs_:
        metrics = pd.DataFrame([m for m in read_jsonl(RESULTS / c["run"] / "metrics.jsonl") if m.get("loss") is not None])
        metrics["smoothed"] = metrics["loss"].rolling(20, min_periods=1).mean()
        rows += [{"variant": label, "seed": c["seed"], "step": s, "train loss": v} for s, v in zip(metrics["step"], metrics["smoothed"])]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [3, 2]})
    sns.lineplot(pd.DataFrame(rows), x="step", y="train loss", hue="variant", errorbar="sd", ax=ax)
    ax.set(title=f"Figure 3 analog: n = {n}, high failures (20-step mean)")
    mark_warm_start(ax, index)
    labels, means, halves = [], [], []
    for _, what, a, b in figure3_rows(df):
        r = paired_of(df, n, a, b)
        if r is not None:
            labels.append(what.replace(" − ", "\n− "))
            means.append(r.mean)
            halves.append(r.ci[1] - r.mean if np.isfinite(r.ci[1]) else 0.0)
    bx.errorbar(range(len(means)), means, yerr=halves, fmt="o", capsize=4)
    bx.axhline(0, color="k", lw=0.8)
    bx.set_xticks(range(len(labels)), labels, fontsize=7)
    bx.set(ylabel="change of val ppl (%), 95% interval", title="paired by seed")
    return fig


def power_figure(df: pd.DataFrame, n: int):
    """95% interval half-width of each paired comparison at the high level against the number of seeds,
    from the measured seed-to-seed standard deviation."""
    ks = np.arange(2, 65)
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for a, b in COMPARISONS:
        r = paired(df, n, "high", a, b)
        if r is not None and np.isfinite(r.sd):
            ax.plot(ks, [interval_half_width(r.sd, k) for k in ks], label=f"{a} − {name(b)} (sd {r.sd:.2f}, {r.pairs} seeds)")
    ax.axhline(1.0, color="k", ls="--", lw=1, label="target ±1 point")
    ax.set(xlabel="seeds", ylabel="95% half-width (points of ppl, %)", yscale="log", title=f"Power curve, n = {n}, high failures")
    ax.legend(fontsize=7)
    return fig


def trajectory_spread(df: pd.DataFrame, n: int) -> str:
    ff = df[(df["tag"] == "main") & (df["level"] == "none") & (df["seed"] == 0)].set_index("n")[METRIC]
    if 1 not in ff.index or n not in ff.index or n == 1:
        return ""
    change = 100 * (ff[n] / ff[1] - 1)
    if abs(change) < 1e-9:
        return (f"Failure-free training at n = {n} and at n = 1 (seed 0, the same samples) reach the same perplexity to "
                "the last digit: the batched backend performs the same sums, so n alone changes nothing; every "
                "difference in the tables comes from the failures and the policy.")
    return (f"Failure-free training at n = {n} against n = 1 (seed 0, the same samples; only the order of floating-point "
            f"sums differs): {change:+.2f}%, the trajectory's own sensitivity to a perturbation of rounding size.")


def against_paper(df: pd.DataFrame, n: int, paper: dict[str, list[float]]) -> str:
    """Where our interval of MeCeFO - failure-free lies against the paper's range, per level."""
    parts = []
    for lvl, v in paper.items():
        r = paired(df, n, lvl, "mecefo", "none")
        if r is None or not np.isfinite(r.ci[0]):
            continue
        lo, hi = min(v), max(v)
        where = ("above the paper's range" if r.ci[0] > hi else "below the paper's range" if r.ci[1] < lo
                 else "overlapping the paper's range")
        parts.append(f"{lvl} [{r.ci[0]:+.2f}, {r.ci[1]:+.2f}]% ({where})")
    return ("Ours, MeCeFO − failure-free: " + "; ".join(parts) + ".") if parts else ""


def spread_words(index: dict, n: int) -> str:
    if load_config(index["base_config"]).data.micro_batch_size // n > 1:
        return ""
    return ("\nAt n = " + str(n) + " a rank holds one sequence, which spread-mecefo cannot split by rows: it gives each "
            "failed rank's sequence to one survivor, with the techniques on that extra sequence only (MeCeFO's "
            "neighbour applies them to both of its sequences), so its row is a lighter MeCeFO, not a spread.")


def evaluation_words(index: dict) -> str:
    cfg = load_config(index["base_config"])
    windows = "the whole validation split" if cfg.data.val_windows == 0 else f"{cfg.data.val_windows} validation windows"
    return (f"exp of the mean loss on {windows} over the last {index.get('last_evaluations', 1)} evaluations, "
            f"every {cfg.train.eval_every} steps")


def results_section(df: pd.DataFrame, index: dict, n: int, table: pd.DataFrame) -> str:
    """The README's results paragraph, from the numbers only: paired changes with intervals and verdicts."""
    t3 = PAPER["table3_val_ppl"]["rows"]
    paper = {lvl: [100 * (v[i] / v[0] - 1) for v in t3.values()] for i, lvl in enumerate(LEVELS) if i}
    wall = sum(c.get("wall_time_s", 0.0) for c in index["cells"]) / 60
    lines = [f"{index['profile'].capitalize()} CPU sweep ({len(index['cells'])} runs, {wall:.0f} min of training, commit "
             f"`{index['git_commit'][:12]}`; base config `experiments/configs/{index['base_config']}.toml`; tables and "
             f"figures in `paper_figures/out/sweep_*`). Change of the validation perplexity ({evaluation_words(index)}) at "
             f"n = {n}, paired "
             "by seed (same initialisation, data order and failure schedule), with its 95% t-interval; the verdict "
             "is computed from the interval (equal within ±1 point, better, worse, or unresolved); 'seeds for ±1' is "
             "the power curve read at a half-width of 1 point:\n",
             *paired_table(df, n),
             "\nFigure 3 analog (the neighbour skips attention or the FFN in its backward pass), same pairing:\n",
             *paired_table(df, n, figure3_rows(df)),
             "\nThe paper's MeCeFO change against failure-free (350M-7B): "
             + ", ".join(f"{lvl} +{min(v):.2f} .. +{max(v):.2f}%" for lvl, v in paper.items()) + ". "
             + against_paper(df, n, paper),
             "", trajectory_spread(df, n), spread_words(index, n)]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true")
    group.add_argument("--long", action="store_true")
    args = parser.parse_args(argv)
    profile = "quick" if args.quick else "long" if args.long else "default"
    df, index = load(profile)
    n = int(index.get("design", {}).get("n", df["n"].max()))
    suffix = "" if profile != "long" else "_long"
    committed = profile == "default"
    style()
    table = n_sweep(df)
    paths = [write_table(f"sweep_table3{suffix}", table_markdown(relative_table(df), index, n)),
             write_table(f"sweep_n{suffix}", n_sweep_markdown(table))]
    paths += save_figure(curves(df, n, index), f"sweep_val_loss_curves{suffix}")
    paths += save_figure(ppl_vs_level(df, n), f"sweep_ppl_vs_level{suffix}", committed)
    paths += save_figure(n_sweep_figure(table), f"sweep_n{suffix}", committed)
    fig = figure3(df, n, index)
    if fig is not None:
        paths += save_figure(fig, f"sweep_figure3_skip_attention_vs_ffn{suffix}", committed)
    paths += save_figure(power_figure(df, n), f"sweep_power_curve{suffix}", committed)
    section = results_section(df, index, n, table)
    paths.append(write_table(f"results_section{suffix}", section))
    if profile != "quick":
        paths.append(update_readme("results" if profile == "default" else "results-long", section))
    for p in paths:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

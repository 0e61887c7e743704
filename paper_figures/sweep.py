"""The Table 3 analog, validation-loss curves, the paired change against failure level, the n-sweep and the
Figure 3 analog, drawn from results/sweep/table3-<profile>.json (experiments.table3 decides every verdict) and
the runs it lists; the default profile also rewrites the README's results section and the committed PNGs in
docs/figures/.

    python -m paper_figures.sweep [--quick]
"""

from __future__ import annotations

import json
import sys

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from mecefo.errors import UsageError, guarded
from mecefo.model import count_parameters, preset
from mecefo.results import RESULTS, paper_numbers, quick_flag

from .common import plain_log_ticks, read_jsonl, save_figure, style, write_block, write_table

LEVELS = ["none", "low", "mid", "high"]
POLICY_NAMES = {"none": "failure-free"}  # the one display map of policy ids


def load(profile: str) -> tuple[pd.DataFrame, dict]:
    path = RESULTS / "sweep" / f"table3-{profile}.json"
    if not path.exists():
        raise UsageError(f"no {path}; run python -m experiments.table3{' --quick' if profile == 'quick' else ''} first")
    table = json.loads(path.read_text())
    return pd.DataFrame(table["cells"]), table


def name(policy: str) -> str:
    return POLICY_NAMES.get(policy, policy)


def shared_seeds(main: pd.DataFrame) -> list[int]:
    """The seeds every (level, policy) cell of a table ran: raw means over them compare like with like."""
    sets = [set(g["seed"]) for _, g in main.groupby(["level", "policy"])]
    return sorted(set.intersection(*sets)) if sets else []


def table_markdown(df: pd.DataFrame, t3: dict) -> str:
    """Mean ± sd of the perplexity per (level, policy) at the main n over the seeds every cell shares, and the
    paper's Table 3."""
    n, cfg = t3["n"], t3["resolved_base_config"]
    main = df[(df["tag"] == "main") & (df["n"] == n)]
    seeds = shared_seeds(main)
    main = main[main["seed"].isin(seeds)]
    lines = ["# Validation perplexity under failures (the paper's Table 3, at our scale)\n",
             f"Embedded Shakespeare+Milton corpus, base config `experiments/configs/{t3['base_config']}.toml`, n = {n}, "
             f"global batch fixed and split over n ranks; perplexity = {evaluation_words(t3)}; mean ± sd over seeds "
             f"{', '.join(map(str, seeds))} (the seeds every cell ran; paired changes with all seeds: docs/results.md).\n",
             "| policy | " + " | ".join(LEVELS) + " |", "|---|" + "---|" * len(LEVELS)]
    none = main[main["level"] == "none"]["val_ppl"]
    for policy in sorted(set(main["policy"]) - {"none"}):
        cells = [f"{none.mean():.2f} ± {none.std(ddof=1):.2f}" if len(none) > 1 else f"{none.mean():.2f}"]
        for level in LEVELS[1:]:
            r = main[(main["level"] == level) & (main["policy"] == policy)]["val_ppl"]
            cells.append("" if r.empty else f"{r.mean():.2f}" + (f" ± {r.std(ddof=1):.2f}" if len(r) > 1 else ""))
        lines.append(f"| {name(policy)} | " + " | ".join(cells) + " |")
    paper = paper_numbers()["table3_val_ppl"]
    lines += ["\n## The paper's Table 3 (C4 validation perplexity, MeCeFO)\n", f"Source: {paper['source']}.\n",
              "| model | " + " | ".join(paper["levels"]) + " | high vs none |", "|---|" + "---|" * (len(paper["levels"]) + 1)]
    for model, vals in paper["rows"].items():
        lines.append(f"| {model} | " + " | ".join(f"{v:.2f}" for v in vals) + f" | {100 * (vals[-1] / vals[0] - 1):+.2f}% |")
    lines.append(f"\nSource of our numbers: results/sweep/table3-{'quick' if 'quick' in t3['indices'] else 'default'}.json, "
                 f"commit `{t3['git_commit'][:12]}`.\n")
    return "\n".join(lines)


def mark_warm_start(ax, t3: dict) -> None:
    k = t3["resolved_base_config"]["cluster"]["failure_free_steps"]
    if k:
        ax.axvline(k, color="grey", ls=":", lw=1)
        ax.annotate("failures start", (k, 0.02), xycoords=("data", "axes fraction"), xytext=(3, 0),
                    textcoords="offset points", fontsize=7, ha="left", va="bottom")


def curves(df: pd.DataFrame, t3: dict):
    n, rows = t3["n"], []
    main = df[(df["tag"] == "main") & (df["n"] == n) & df["policy"].isin(["none", "mecefo", "drop"])]
    for _, c in main.iterrows():
        for m in read_jsonl(RESULTS / c["run"] / "metrics.jsonl"):
            if m.get("val_loss") is not None and not m.get("replay"):
                rows.append({"level": c["level"], "policy": name(c["policy"]), "seed": c["seed"], "step": m["step"],
                             "val_loss": m["val_loss"]})
    data = pd.DataFrame(rows)
    if data.empty:
        raise UsageError(f"no metrics.jsonl under {RESULTS} for the runs of the table; rerun python -m experiments.sweep")
    data = data[data["step"] >= data["step"].max() * 0.2]  # the early drop dwarfs the differences
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    sns.lineplot(data, x="step", y="val_loss", hue="level", hue_order=[lvl for lvl in LEVELS if lvl in set(data["level"])],
                 style="policy", errorbar="sd", ax=ax)
    ax.set(title=f"Validation loss, n = {n} (mean ± sd over seeds)", ylabel="validation loss")
    mark_warm_start(ax, t3)
    return fig


def row(t3: dict, row_id: str) -> dict | None:
    return next((r for r in t3["rows"] if r["id"] == row_id), None)


def main_id(level: str, a: str, b: str) -> str:
    sel = lambda lvl, p: f"main:{lvl}:{p}:mecefo"  # noqa: E731
    return f"{sel(level, a)}/{sel('none' if b == 'none' else level, b)}"


COLD_ID = "cold:high:mecefo:mecefo/" + main_id("none", "none", "none").split("/")[0]  # experiments.table3's cold row


def ppl_vs_level(t3: dict):
    """The paired change of each policy against failure-free training per failure level with its 95% interval
    (pooled noise), beside the paper's range (its rounding included)."""
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    levels = [lvl for lvl in LEVELS[1:] if any(row(t3, main_id(lvl, p, "none")) for p in ("mecefo", "drop"))]
    for k, policy in enumerate(("mecefo", "drop", "spread-mecefo")):
        pts = [(i + (k - 1) * 0.14, r) for i, lvl in enumerate(levels) if (r := row(t3, main_id(lvl, policy, "none")))]
        if pts:
            ax.errorbar([x for x, _ in pts], [r["change_pct"] for _, r in pts], capsize=3, fmt="o", label=name(policy),
                        yerr=[[r["change_pct"] - r["change_ci_pct"][0] for _, r in pts],
                              [r["change_ci_pct"][1] - r["change_pct"] for _, r in pts]])
    for i, lvl in enumerate(levels):
        if lvl in t3["paper"]:
            lo, hi = t3["paper"][lvl]["with_rounding"]
            ax.fill_between([i - 0.35, i + 0.35], lo, hi, color="grey", alpha=0.3, lw=0,
                            label="paper, MeCeFO, 350M-7B (with rounding)" if i == 0 else None)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(levels)), levels)
    ax.set(xlabel="failure level", ylabel="change of val ppl vs failure-free (%)",
           title=f"Paired change, n = {t3['n']} (95% intervals, pooled noise)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: clear of the intervals
    return fig


def n_sweep_markdown(t3: dict) -> str:
    seeds = max((r.get(f"{p}_seeds") or 0 for r in t3["n_sweep"] for p in ("mecefo", "drop")), default=0)
    lines = [f"# n-sweep at a fixed global batch, high failures, up to {seeds} seed(s) per n\n",
             "Every n against failure-free training at n = 1 (the same samples at every n), paired by seed; the failure "
             "schedule differs between n (Table 1's per-rank rate on n ranks draws different events), so n and the "
             "schedule are confounded" + (": each point is one run, not a mean.\n" if seeds < 2 else
                                         "; intervals from each n's own paired differences.\n"),
             "| n | failure-free ppl (n = 1, seed 0) | mecefo − failure-free (%) | drop − failure-free (%) |", "|---|---|---|---|"]

    def f(r, p):
        if r[p] is None:
            return ""
        ci = r.get(f"{p}_ci")
        return f"{r[p]:+.2f}" + (f" [{ci[0]:+.2f}, {ci[1]:+.2f}] ({r[f'{p}_seeds']} seeds)" if ci else "")

    ppl = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
    lines += [f"| {r['n']} | {ppl(r['failure_free_ppl'])} | {f(r, 'mecefo')} | {f(r, 'drop')} |" for r in t3["n_sweep"]
              if r["failure_free_ppl"] is not None or r["mecefo"] is not None or r["drop"] is not None]
    return "\n".join(lines) + "\n"


def n_sweep_figure(t3: dict):
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    rows = [r for r in t3["n_sweep"] if r["n"] > 1]
    seeds = 1
    for k, p in enumerate(("mecefo", "drop")):
        pts = [(r["n"] * (1 + 0.04 * (2 * k - 1)), r[p], r.get(f"{p}_ci")) for r in rows if r[p] is not None]
        seeds = max([seeds] + [r.get(f"{p}_seeds") or 1 for r in rows])
        err = [[y - ci[0] if ci else 0 for _, y, ci in pts], [ci[1] - y if ci else 0 for _, y, ci in pts]]
        ax.errorbar([x for x, _, _ in pts], [y for _, y, _ in pts], yerr=err if any(ci for *_, ci in pts) else None,
                    fmt="o", capsize=3, label=p + (" (one run per n)" if seeds < 2 else f" (mean of {seeds} seeds, 95%)"))
    ax.axhline(0, color="k", lw=0.8)
    ax.set(xscale="log", xlabel="data-parallel ranks n (global batch fixed)", ylabel="change of val ppl (%)",
           title=f"n-sweep, high failures, {seeds} seed(s) per n")
    plain_log_ticks(ax.xaxis, [r["n"] for r in rows])
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)
    fig.tight_layout()
    return fig


def figure3(df: pd.DataFrame, t3: dict):
    """Figure 3 analog: training-loss curves (20-step mean, mean ± sd over seeds) and the paired change of
    the perplexity with its 95% interval, skip attention vs skip FFN on the neighbour."""
    n = t3["n"]
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
    mark_warm_start(ax, t3)
    bars = [r for r in t3["rows"] if r["figure3"]]
    bx.errorbar(range(len(bars)), [r["change_pct"] for r in bars], capsize=4, fmt="o",
                yerr=[[r["change_pct"] - r["change_ci_pct"][0] for r in bars], [r["change_ci_pct"][1] - r["change_pct"] for r in bars]])
    bx.axhline(0, color="k", lw=0.8)
    bx.set_xticks(range(len(bars)), [r["comparison"].replace(" − ", "\n− ") for r in bars], fontsize=7)
    bx.set(ylabel="change of val ppl (%), 95% interval", title="paired by seed (pooled noise)")
    return fig


def power_figure(t3: dict):
    """The |mean| a direction word needs against the number of seeds, at the pooled sd and at its upper bound
    (experiments.table3.power); beside it, how far each high-level mean lies from 0."""
    noise, pw = t3["noise"], t3["power"]
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for curve, label, ls in (("at_sd", f"pooled sd {noise['sd']:.2f} ({noise['df']} df)", "-"),
                             ("at_upper", f"its 95% upper bound {noise['upper']:.2f}", "--")):
        ax.plot(pw["seeds"], pw[curve], ls=ls, color="k", label=label)
    for (a, b), color in zip((("mecefo", "none"), ("drop", "none"), ("mecefo", "drop")), sns.color_palette()):
        r = row(t3, main_id("high", a, b))
        if r is not None:
            ax.axhline(abs(r["mean"]), color=color, ls=":", label=f"|{name(a)} − {name(b)}| at high ({r['pairs']} seeds)")
    ax.set(xlabel="seeds", ylabel="|100 ln(ppl ratio)| a word needs", yscale="log",
           title=f"Seeds a verdict needs, n = {t3['n']}")
    plain_log_ticks(ax.yaxis)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def trajectory_spread(t3: dict) -> str:
    same = t3.get("n_alone")  # experiments.table3.n_alone
    if same is None:
        return ""
    if same["identical"]:
        return (f"Failure-free training at n = {same['n']} and at n = 1 (seed 0, the same samples) reach the same perplexity "
                "to the last digit: the batched backend performs the same sums, so n alone changes nothing; every "
                "difference in the tables comes from the failures and the policy.")
    return (f"Failure-free training at n = {same['n']} against n = 1 (seed 0, the same samples; only the order of "
            f"floating-point sums differs): {same['change_pct']:+.2f}%, the trajectory's own sensitivity to a perturbation "
            "of rounding size.")


def against_paper(t3: dict) -> str:
    parts = [f"{lvl} [{p['ours_ci'][0]:+.2f}, {p['ours_ci'][1]:+.2f}]% against the paper's +{p['printed'][0]:.2f} .. "
             f"+{p['printed'][1]:.2f}% (+{p['with_rounding'][0]:.2f} .. +{p['with_rounding'][1]:.2f}% with its two-decimal "
             f"rounding): {p['where']} (P {p['probability']:.2f})"
             for lvl, p in sorted(t3["paper"].items(), key=lambda kv: LEVELS.index(kv[0]))]
    if parts:
        parts[-1] += (f" (each decided as the words are: 'above', 'below' or 'within' only where a rerun's interval "
                      f"would say so with probability >= {100 * t3['agree']:.0f}%; P: that probability for the likeliest)")
    return ("MeCeFO − failure-free, ours against the paper's range over 350M-7B: " + "; ".join(parts) + ".") if parts else ""


def spread_words(t3: dict) -> str:
    n = t3["n"]
    if t3.get("spread_splits_rows", True):  # experiments.table3 decides it
        return ""
    return ("\nAt n = " + str(n) + " a rank holds one sequence, which spread-mecefo cannot split by rows: it gives each "
            "failed rank's sequence to one survivor, with the techniques on that extra sequence only (MeCeFO's "
            "neighbour applies them to both of its sequences), so its row is a lighter MeCeFO, not a spread.")


def evaluation_words(t3: dict) -> str:
    cfg = t3["resolved_base_config"]
    windows = "the whole validation split" if cfg["data"]["val_windows"] == 0 else f"{cfg['data']['val_windows']} validation windows"
    last = next(iter(t3["indices"].values())).get("last_evaluations", 1)
    return f"exp of the mean loss on {windows} over the last {last} evaluations, every {cfg['train']['eval_every']} steps"


def paired_table(t3: dict, figure3_rows: bool = False) -> list[str]:
    lines = ["| row | comparison | change of val ppl (95% interval) | verdict | claim: P (margin) | repeat | seeds (profile) | "
             "seeds a verdict needs | word under its group's noise |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in t3["rows"] if r["figure3"] == figure3_rows):
        word = r["word"] + ("" if r["word_family"] == r["word"] else f" (family-wise: {r['word_family']})")
        need = ("— (decided)" if not r["word"].startswith("not decided") else
                f"{r['seeds_needed']} (for '{r['needed_for']}')" if r["seeds_needed"] else "more than 10,000")
        margin = f" ({r['margin']:+.2f})" if r["margin"] is not None else " (—)"
        repeat = "—" if r["repeat"] is None else f"{r['repeat']:.2f}"
        group = "—" if r.get("word_group_noise") is None else r["word_group_noise"]
        lines.append(f"| {r['group']} | {r['comparison']} | {r['change_pct']:+.2f}% [{r['change_ci_pct'][0]:+.2f}, "
                     f"{r['change_ci_pct'][1]:+.2f}] | {word} | {r['claim']}: {r['probability']:.3f}{margin} | {repeat} | "
                     f"{r['pairs']} ({r['profile']}) | {need} | {group} |")
    return lines


def homogeneity_words(t3: dict) -> str:
    """The per-group sds of the paired differences and Bartlett's test (experiments.table3.group_noise)."""
    h = t3.get("homogeneity") or {}
    groups, test = h.get("groups", {}), h.get("bartlett")
    if not groups:
        return ""
    sds = "; ".join(f"{g}: {v['sd']:.2f} ({v['df']} df)" for g, v in groups.items())
    cold = next((r for r in t3["rows"] if r["id"] == COLD_ID), None)
    cold_sd = f"; the no-warm-start row, on its own: {cold['noise']['sd']:.2f} ({cold['noise']['df']} df)" if cold else ""
    verdict = ("" if test is None else
               f" Bartlett's test of one variance across them: chi2 {test['statistic']:.2f} on {test['df']} df, p = "
               f"{test['p']:.2g} (approximate: the groups share the failure-free runs)"
               + (": no evidence against pooling." if test["p"] >= 0.05 else ": the groups' variances differ; read the "
                  "last column (each row decided on its own group's noise)."))
    return ("Is one pooled sd right for every row? Each group's own block fit (its configurations with the failure-free "
            f"runs), sd per paired difference: {sds}{cold_sd}.{verdict}")


def resolution_words(t3: dict) -> str:
    """What deciding the paper's low and mid effects would take (experiments.table3.resolution)."""
    res = t3.get("resolution", {})
    fmt_h = lambda h: "" if h is None else f" ({h:.1f} h of runs)"  # noqa: E731
    parts = [f"{lvl} (+{r['effect'][0]:.2f} .. +{r['effect'][1]:.2f}%): a size within ±{t3['tolerance']:g}% needs "
             f"{r['within_seeds'] if r['within_seeds'] else 'more than 10,000'} seeds per row{fmt_h(r['within_hours'])}, a "
             f"direction at +{r['effect'][0]:.2f}% needs {r['direction_seeds'] if r['direction_seeds'] else 'more than 10,000'}"
             f"{fmt_h(r['direction_hours'])}" for lvl, r in res.items() if lvl in ("low", "mid")]
    if not parts:
        return ""
    run = f"{res['run_s']:.0f} s per run here, " if res.get("run_s") else ""
    return ("If the paper's effects held here, deciding them would take (at the sd's upper bound; " + run +
            "a failure-free and a MeCeFO run per seed): " + "; ".join(parts) + ".")


def cold_words(t3: dict) -> str:
    """The estimate without the warm start beside the main one (experiments.table3's cold row)."""
    by = {r["id"]: r for r in t3["rows"]}
    cold, main = by.get(COLD_ID), by.get(main_id("high", "mecefo", "none"))
    if cold is None or main is None:
        return ""
    nz = cold["noise"]
    return (f"Without the warm start (failures from step 0, {t3['cold_failure_hours']:.1f} h of them per run), MeCeFO − "
            f"failure-free at high is {cold['change_pct']:+.2f}% [{cold['change_ci_pct'][0]:+.2f}, "
            f"{cold['change_ci_pct'][1]:+.2f}] *{cold['word']}* "
            f"({cold['pairs']} seeds; decided on its own noise, sd {nz['sd']:.2f} with {nz['df']} df, against the pooled "
            f"rows' {t3['noise']['sd']:.2f} with {t3['noise']['df']} df, upper bound {t3['noise']['upper']:.2f}), against "
            f"{main['change_pct']:+.2f}% [{main['change_ci_pct'][0]:+.2f}, {main['change_ci_pct'][1]:+.2f}] with it.")


def results_section(df: pd.DataFrame, t3: dict) -> str:
    """The README's results paragraph, from results/sweep/table3-*.json only."""
    n, noise, cfg = t3["n"], t3["noise"], t3["resolved_base_config"]
    params = count_parameters(preset(cfg["model"]["preset"], vocab_size=cfg["data"]["vocab_size"]))
    decided = [r for r in t3["rows"] if not r["word"].startswith("not decided")]
    family = [r for r in decided if r["word_family"] == r["word"]]
    ws = t3["warm_start"]
    profiles = ", ".join(f"{p}: {m['runs']} runs, commit `{(m['git_commit'] or '')[:12]}`" for p, m in t3["indices"].items())
    lines = [f"Table 3 at our scale: `{cfg['model']['preset']}` ({params / 1e6:.2f}M parameters), {cfg['train']['steps']} steps, "
             f"n = {n} ranks, global batch {cfg['data']['micro_batch_size']} x {cfg['data']['seq_len']} tokens; the first "
             f"{ws['steps']} steps failure-free (a warm start every policy of a seed shares; they carry "
             f"{100 * ws['lr_weighted_share']:.0f}% of the learning-rate-weighted updates), then "
             f"{t3['failure_hours']:.1f} h of failures per run (the paper does not state its runs' hours). Sweep indices "
             f"read ({profiles}); every row uses all the seeds they hold and names the profile they come from. Change of "
             f"the validation perplexity ({evaluation_words(t3)}), paired by seed (same initialisation, data order and "
             "failure schedule), decided on the log scale (100 ln of the ratio, the scale the noise is fitted on) and "
             "printed as percent, with its 95% interval from the pooled seed-to-seed noise (one sd for every row but the "
             "no-warm-start one, which is decided on its own: "
             f"{noise['sd']:.2f} log points per paired difference, {noise['df']} df, 95% upper bound {noise['upper']:.2f}; "
             "`mecefo.stats.block_noise`). A verdict word is printed only where a rerun on another machine (new rounding, "
             "in effect new draws of every seed) would give it from its own 95% interval with probability >= "
             f"{100 * t3['agree']:.0f}% (`mecefo.stats.rerun_probability`: our sd's uncertainty, with its df, and both "
             "runs' noise taken in). A word claims a direction ('worse', 'better'), a size ('equal within ±1%': a ratio "
             "within [0.99, 1.01]) or both ('worse by less than 1%'); an undecided row names the claim cheapest to "
             "decide. P is that claim's probability, and the margin how far the mean lies past (+) or short of (−) the "
             "mean at which P reaches the threshold, in log points (for both: the nearer of the two; —: at these seeds no "
             "mean decides a size, the interval is too wide for ±1%). P is not the probability that a rerun deciding by "
             "this same rule prints the word again: 'repeat' states that for a direction (about 0.5 at the threshold, as "
             "for any rule that prints above a threshold). 'Seeds a verdict needs' is where the current mean would "
             "decide a word at the sd's upper bound; the last column decides each row on its own group's pooled noise "
             "instead (see the homogeneity check below):\n",
             *paired_table(t3),
             "\nFigure 3 analog (the neighbour skips attention or the FFN in its backward pass), same pairing:\n",
             *paired_table(t3, True), "",
             f"Multiplicity: {t3['family']} intervals at 95% each. Decided again with the rerun's intervals at the Bonferroni "
             f"level over the {t3['family']} rows (family-wise 95% coverage of the intervals; the rerun probability stays "
             f"per row), {len(family)} of the {len(decided)} printed words stand; the others say their word at that level.",
             "", homogeneity_words(t3), "", cold_words(t3), "", against_paper(t3), "", resolution_words(t3), "", trajectory_spread(t3), spread_words(t3)]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    profile = "quick" if quick_flag(argv, __doc__) else "default"
    df, t3 = load(profile)
    committed = profile == "default"
    style()
    paths = [write_table("sweep_table3", table_markdown(df, t3)), write_table("sweep_n", n_sweep_markdown(t3))]
    paths += save_figure(curves(df, t3), "sweep_val_loss_curves")
    paths += save_figure(ppl_vs_level(t3), "sweep_ppl_vs_level", committed)
    paths += save_figure(n_sweep_figure(t3), "sweep_n", committed)
    fig = figure3(df, t3)
    if fig is not None:
        paths += save_figure(fig, "sweep_figure3_skip_attention_vs_ffn", committed)
    paths += save_figure(power_figure(t3), "sweep_power_curve", committed)
    section = results_section(df, t3)
    paths.append(write_table("results_section", section))
    paths.append(write_block("results", section, profile == "quick"))
    for p in paths:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

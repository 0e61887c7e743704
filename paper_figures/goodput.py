"""Goodput rendered: the frontier (throughput lost against quality lost, every policy and level of the
registry, intervals on both axes), goodput against the failure level and from 32 GPUs to 100k, the table,
and (default profile) the README's goodput section with its answer; from results/goodput/goodput-<profile>.json
(python -m experiments.goodput). Nothing is decided here.

    python -m paper_figures.goodput [--quick]
"""

from __future__ import annotations

import sys

import matplotlib.pyplot as plt
import numpy as np

from experiments.goodput import LEVELS
from experiments.table2 import in_order
from mecefo.errors import guarded
from mecefo.results import quick_flag, read_measurement

from .common import plain_log_ticks, save_figure, style, update_readme, write_table

WITHIN = ", within q's interval"
LEVEL_MARKERS = {"low": "o", "mid": "s", "high": "^"}


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _range(r: list[float]) -> str:
    return f"[{100 * r[0]:.1f}, {100 * r[1]:.1f}]"


def frontier_figure(result: dict):
    eff = in_order(result["effective"])
    fig, axes = plt.subplots(1, len(eff), figsize=(5 * len(eff), 4.4), sharey=True)
    policies = list(next(iter(eff.values()))["levels"]["high"])
    colors = dict(zip(policies, plt.get_cmap("tab10").colors))
    for ax, (model, m) in zip(np.atleast_1d(axes), eff.items()):
        for level, cells in m["levels"].items():
            for p, c in cells.items():
                if c["q"] is None:
                    continue
                x, y = 100 * (1 - c["kept"]), 100 * (1 - c["q"]["mean"])
                xerr = [[x - 100 * (1 - c["kept_ci95"][1])], [100 * (1 - c["kept_ci95"][0]) - x]]
                yerr = [[y - 100 * (1 - c["q"]["ci95"][1])], [100 * (1 - c["q"]["ci95"][0]) - y]]
                ax.errorbar(x, y, xerr=np.abs(xerr), yerr=np.abs(yerr), fmt=LEVEL_MARKERS[level], color=colors[p],
                            capsize=2, ms=6, label=p if level == "high" else None)
        xs = np.linspace(0, 100, 200)
        for g in (0.9, 0.75, 0.5):  # (1 - x)(1 - y) = g
            ax.plot(xs, 100 * (1 - g / np.maximum(1 - xs / 100, 1e-9)), color="grey", lw=0.8, ls=":")
            ax.annotate(f"goodput {g:g}", (100 * (1 - g) * 0.98, 1), color="grey", fontsize=7, rotation=90, va="bottom")
        ax.axhline(0, color="black", lw=0.6)
        ax.set(title=model, xlabel="throughput lost (simulated trained tokens/s), %", xlim=(-2, 70), ylim=(-25, 25))
    np.atleast_1d(axes)[0].set_ylabel("quality lost per trained token (1 - q), %")
    handles, labels = np.atleast_1d(axes)[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8,
               title="policy (markers: o low, s mid, ^ high; dotted: equal goodput)", title_fontsize=8)
    fig.suptitle("Goodput frontier: quality (trained, CPU, n = 32) x throughput (simulated, the paper's jobs)")
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    return fig


def rate_figure(result: dict):
    eff, scale = in_order(result["effective"]), result["scale"]
    fig, axes = plt.subplots(1, len(eff) + 1, figsize=(4.4 * (len(eff) + 1), 4))
    levels = ["none", "low", "mid", "high"]
    for ax, (model, m) in zip(axes, eff.items()):
        for p in m["levels"]["high"]:
            if m["levels"]["high"][p]["q"] is None:
                continue
            ax.plot(levels, [1.0] + [m["levels"][lv][p]["goodput"] for lv in levels[1:]], marker="o", label=p)
        ax.set(title=model, xlabel="Table 1 failure level (intervals: the table)", ylim=(0, 1.1))
    axes[0].set_ylabel("goodput G = throughput kept x q")
    axes[0].legend(fontsize=7)
    ax = axes[-1]
    sizes = sorted(scale["sizes"], key=int)
    for p in scale["sizes"][sizes[0]]:
        if "goodput" not in scale["sizes"][sizes[0]][p]:
            continue
        ax.plot([int(s) for s in sizes], [scale["sizes"][s][p]["goodput"] for s in sizes], marker="o", label=p)
    ax.set_xscale("log")
    plain_log_ticks(ax.xaxis, [int(s) for s in sizes])
    ax.tick_params(axis="x", labelrotation=45)
    ax.set(title=f"llama-7b at Llama 3's rate ({scale['scenario']['name']})", xlabel="GPUs", ylim=(0, 1.1))
    fig.tight_layout()
    return fig


def table(result: dict) -> list[str]:
    lines = ["| job | level | policy | throughput kept [95%] | q [95% over seeds] | goodput G [q's interval] | time to failure-free quality |",
             "|---|---|---|---|---|---|---|"]
    for model, m in in_order(result["effective"]).items():
        for level, cells in ((lv, m["levels"][lv]) for lv in LEVELS):
            for p, c in sorted(cells.items(), key=lambda pc: -pc[1].get("goodput", -1)):
                if c["q"] is None:
                    lines.append(f"| {model} | {level} | `{p}` | {_pct(c['kept'])} {_range(c['kept_ci95'])} | not measured | | |")
                    continue
                q = "1 (exact)" if c["q"]["by"].startswith("construction") else f"{c['q']['mean']:.3f} [{c['q']['ci95'][0]:.3f}, {c['q']['ci95'][1]:.3f}]"
                lines.append(f"| {model} | {level} | `{p}` | {_pct(c['kept'])} {_range(c['kept_ci95'])} | {q} | "
                             f"{_pct(c['goodput'])} {_range(c['goodput_q_range'])} | {c['time_to_quality']:.2f}x |")
    return lines


def quality_table(result: dict) -> list[str]:
    lines = ["| policy | level | failure-free steps worth (S*/S) [95%] | q per trained token [95%] | seeds | failed fraction |",
             "|---|---|---|---|---|---|"]
    for p, levels in result["quality"].items():
        for level, v in ((lv, levels[lv]) for lv in LEVELS if lv in levels):
            sf, q = v["steps_fraction"], v["q"]
            ci = (lambda r: f"[{r[0]:.3f}, {r[1]:.3f}]" if np.isfinite(r[0]) else "(one seed)")
            lines.append(f"| `{p}` | {level} | {sf['mean']:.3f} {ci(sf['ci95'])}{' (extrapolated)' if v['extrapolated'] else ''} | "
                         f"{q['mean']:.3f} {ci(q['ci95'])} | {len(v['seeds'])} | {100 * v['failed_fraction']:.1f}% |")
    return lines


def answer(result: dict) -> str:
    """One paragraph: per job and level, the policy of highest goodput, by how much, and whether its lead
    survives q's interval."""
    parts, mine = [], []
    for model, levels in in_order(result["winners"]).items():
        said = []
        for level in LEVELS:
            w, g = levels[level], result["effective"][model]["levels"][level]
            said.append(f"{level}: `{w['best']}` (G {_pct(g[w['best']]['goodput'])}, {100 * w['ahead']:+.1f}% over "
                        f"`{w['second']}`{'' if w['decided'] else WITHIN})")
        parts.append(f"**{model}**: " + "; ".join(said))
        high = result["effective"][model]["levels"]["high"]
        ranked = sorted((p for p in high if "goodput" in high[p]), key=lambda p: -high[p]["goodput"])
        mine.append(f"{model} G {_pct(high['mecefo']['goodput'])} (throughput kept {_pct(high['mecefo']['kept'])}, "
                    f"q {high['mecefo']['q']['mean']:.3f}; rank {ranked.index('mecefo') + 1} of {len(ranked)})")
    return ("Which policy reaches the failure-free run's quality first (highest goodput G; time to that quality is 1/G "
            "times the failure-free time): " + ". ".join(parts) + ". MeCeFO at high: " + "; ".join(mine) + ".")


def scale_answer(scale: dict) -> str:
    """Per size: the policy of highest goodput at Llama 3's rate, and MeCeFO's."""
    said = []
    for size in sorted(scale["sizes"], key=int):
        cells = {p: c for p, c in scale["sizes"][size].items() if "goodput" in c}
        best = max(cells, key=lambda p: cells[p]["goodput"])
        said.append(f"{int(size):,}: `{best}` {_pct(cells[best]['goodput'])} (`mecefo` {_pct(cells['mecefo']['goodput'])})")
    return "Highest goodput at each size: " + "; ".join(said) + "."


def report(result: dict) -> tuple[str, str]:
    scale = result["scale"]
    sizes = sorted(scale["sizes"], key=int)
    head = ["| GPUs | " + " | ".join(f"`{p}`" for p in scale["sizes"][sizes[0]] if "goodput" in scale["sizes"][sizes[0]][p]) + " |"]
    head.append("|---|" + "---|" * (head[0].count("|") - 2))
    for s in sizes:
        head.append(f"| {int(s):,} | " + " | ".join(_pct(c["goodput"]) for c in scale["sizes"][s].values() if "goodput" in c) + " |")
    intro = (f"Quality from the sweep's runs at n = {result['n']} ({result['profile']} profile) against failure-free runs of "
             f"{', '.join(str(x) for x in next(iter(result['curves'].values()))['lengths'])} steps per seed (fit L = a + b ln S, "
             f"largest residual {max(c['max_residual'] for c in result['curves'].values()):.4f}); throughput simulated for "
             "the paper's jobs (Table 2's runs). q is quality per trained token (q > 1: fewer tokens, each worth more, as "
             "for `drop`, whose lost tokens the throughput already counts); exact policies have q = 1 by construction. "
             "The combination assumes that q measured on our CPU model at a failure level carries over to the paper's jobs "
             "at the same level.")
    section = "\n".join([
        intro, "", answer(result), "", *quality_table(result), "", *table(result), "",
        f"At Llama 3's rate ({scale['scenario']['interval_h']:g} h between failures per 32 GPUs, {scale['scenario']['recovery_h']:g} h "
        f"down) a run fails {100 * scale['run_failed_fraction']:.4f}% of its rank-steps: q is 1 within "
        f"{max(abs(1 - v['mean']) for v in scale['q'].values()):.1e} for every policy, so goodput at scale is the throughput kept:",
        "", *head, "", scale_answer(scale), "", "![goodput frontier](docs/figures/goodput_frontier.png)", "![goodput against the failure rate](docs/figures/goodput_rate.png)"])
    return "# Goodput\n\n" + section + "\n", section


def main(argv: list[str] | None = None) -> int:
    quick = quick_flag(argv, __doc__)
    result = read_measurement("goodput", "goodput", quick, "experiments.goodput")
    style()
    doc, section = report(result)
    paths = [write_table("goodput", doc)]
    paths += save_figure(frontier_figure(result), "goodput_frontier", committed=not quick)
    paths += save_figure(rate_figure(result), "goodput_rate", committed=not quick)
    if not quick:
        paths.append(update_readme("goodput", section))
    for p in paths:
        if p is not None:
            print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

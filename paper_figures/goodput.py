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

LEVEL_MARKERS = {"low": "o", "mid": "s", "high": "^"}


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _range(r: list[float]) -> str:
    return f"[{100 * r[0]:.1f}, {100 * r[1]:.1f}]"


def frontier_figure(result: dict):
    eff = in_order(result["effective"])
    fig, axes = plt.subplots(1, len(eff), figsize=(5 * len(eff), 4.4), sharey=True)
    policies = list(dict.fromkeys(p for m in eff.values() for cells in m["levels"].values() for p in cells))
    cycle = plt.get_cmap("tab10").colors  # (repeats beyond 10 policies; the legend names each)
    colors = {p: cycle[i % len(cycle)] for i, p in enumerate(policies)}
    ys = [100 * (1 - c["q"]["ci95"][i]) for m in eff.values() for cells in m["levels"].values() for c in cells.values()
          if c["q"] is not None for i in (0, 1) if np.isfinite(c["q"]["ci95"][i])]
    unmeasured = sorted({p for m in eff.values() for cells in m["levels"].values() for p, c in cells.items() if c["q"] is None})
    for ax, (model, m) in zip(np.atleast_1d(axes), eff.items()):
        labelled = set()
        for level in LEVELS:
            for p, c in m["levels"][level].items():
                if c["q"] is None:
                    continue
                exact = c["q"]["by"].startswith("construction")
                x, y = 100 * (1 - c["kept"]), 100 * (1 - c["q"]["mean"])
                xerr = [[x - 100 * (1 - c["kept_ci95"][1])], [100 * (1 - c["kept_ci95"][0]) - x]]
                yerr = [[y - 100 * (1 - c["q"]["ci95"][1])], [100 * (1 - c["q"]["ci95"][0]) - y]]
                ax.errorbar(x, y, xerr=np.abs(xerr), yerr=None if exact else np.abs(yerr), fmt=LEVEL_MARKERS[level],
                            color=colors[p], mfc="none" if exact else colors[p], capsize=2, ms=6,
                            label=(p + (" (exact: q = 1)" if exact else "")) if p not in labelled else None)
                labelled.add(p)
        xs = np.linspace(0, 100, 200)
        for g in (0.9, 0.75, 0.5):  # (1 - x)(1 - y) = g
            ax.plot(xs, 100 * (1 - g / np.maximum(1 - xs / 100, 1e-9)), color="grey", lw=0.8, ls=":")
            ax.annotate(f"goodput {g:g}", (100 * (1 - g) * 0.98, 1), color="grey", fontsize=7, rotation=90, va="bottom")
        ax.axhline(0, color="black", lw=0.6)
        ax.set(title=model, xlabel="throughput lost (simulated trained tokens/s), %", xlim=(-2, 70),
               ylim=(min(ys + [-5]) - 2, max(ys + [5]) + 2))
    np.atleast_1d(axes)[0].set_ylabel("quality lost per trained token (1 - q), %")
    handles, labels = np.atleast_1d(axes)[-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize=8,
               title="policy (markers: o low, s mid, ^ high; hollow: exact, q = 1; dotted: equal goodput)", title_fontsize=8)
    fig.suptitle("Goodput frontier: quality (trained, CPU, n = 32) x throughput (simulated, the paper's jobs)"
                 + (f"; quality not measured: {', '.join(unmeasured)}" if unmeasured else ""))
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    return fig


def rate_figure(result: dict):
    eff, scale = in_order(result["effective"]), result["scale"]
    fig, axes = plt.subplots(1, len(eff) + 1, figsize=(4.4 * (len(eff) + 1), 4))
    levels = ["none", "low", "mid", "high"]
    for ax, (model, m) in zip(axes, eff.items()):
        for p in m["levels"]["high"]:
            if m["levels"]["high"][p]["q"] is None:
                continue
            ax.plot(levels, [m["failure_free_kept"][p]] + [m["levels"][lv][p]["goodput"] for lv in levels[1:]], marker="o",
                    label=p)
        ax.set(title=model, xlabel="Table 1 failure level (intervals: the table)", ylim=(0, 1.1))
    axes[0].set_ylabel("goodput G = throughput kept x q")
    axes[0].legend(fontsize=7)
    ax = axes[-1]
    sizes = sorted(scale["sizes"], key=int)
    for p, c in scale["sizes"][sizes[0]]["policies"].items():
        if "goodput" in c:
            ax.plot([int(s) for s in sizes], [scale["sizes"][s]["policies"][p]["goodput"] for s in sizes], marker="o", label=p)
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
            said.append(f"{level}: `{w['best']}`, G {_pct(g[w['best']]['goodput'])} {_range(g[w['best']]['goodput_range'])}, "
                        f"{100 * w['ahead']:+.1f}% over `{w['second']}`"
                        + (" (leads)" if w["leads"] else f" (tied with {', '.join(f'`{t}`' for t in w['tied'])})"))
        parts.append(f"**{model}**: " + "; ".join(said))
        high = result["effective"][model]["levels"]["high"]
        ranked = sorted((p for p in high if "goodput" in high[p]), key=lambda p: -high[p]["goodput"])
        mine.append(f"{model} G {_pct(high['mecefo']['goodput'])} (throughput kept {_pct(high['mecefo']['kept'])}, "
                    f"q {high['mecefo']['q']['mean']:.3f}; rank {ranked.index('mecefo') + 1} of {len(ranked)})")
    return ("Which policy reaches the failure-free run's quality first (highest goodput G, with its range over q's and the "
            "throughput's intervals; time to that quality is 1/G times the failure-free time; \"leads\": the low end of its "
            "range is above the high end of every other policy's, else the policies whose ranges reach it are named): " + ". ".join(parts) + ". MeCeFO at high: " + "; ".join(mine) + ".")


def scale_answer(scale: dict) -> str:
    """Per size: the policy of highest goodput at Llama 3's rate, and MeCeFO's."""
    said = []
    for size in sorted(scale["sizes"], key=int):
        cells, w = scale["sizes"][size]["policies"], scale["sizes"][size]["leaders"]
        said.append(f"{int(size):,}: `{w['best']}` {_pct(cells[w['best']]['goodput'])}"
                    + ("" if w["leads"] else f" (tied with {', '.join(f'`{t}`' for t in w['tied'])})")
                    + f", `mecefo` {_pct(cells['mecefo']['goodput'])}")
    clamped = {p: q["clamped_at"] for p, q in scale["q"].items() if q.get("clamped_at") is not None}
    held = ("" if not clamped else f" The run's failed fraction, {100 * scale['run_failed_fraction']:.1f}%, is beyond "
            "the largest measured for " + ", ".join(f"`{p}` ({100 * f:.1f}%)" for p, f in clamped.items())
            + ": their q is held at that fraction's, so their G here is not a measurement.")
    return "Highest goodput at each size: " + "; ".join(said) + "." + held


def report(result: dict) -> tuple[str, str]:
    scale = result["scale"]
    sizes = sorted(scale["sizes"], key=int)
    shown = [p for p, c in scale["sizes"][sizes[0]]["policies"].items() if "goodput" in c]
    head = ["| GPUs | " + " | ".join(f"`{p}`" for p in shown) + " |", "|---|" + "---|" * len(shown)]
    for s in sizes:
        head.append(f"| {int(s):,} | " + " | ".join(_pct(scale["sizes"][s]["policies"][p]["goodput"]) for p in shown) + " |")
    intro = (f"Quality from the sweep's runs at n = {result['n']} ({result['profile']} profile) against failure-free runs of "
             f"{', '.join(str(x) for x in next(iter(result['curves'].values()))['lengths'])} steps per seed (fit L = a + b ln S, "
             f"largest residual {max(c['max_residual'] for c in result['curves'].values()):.4f}); throughput simulated for "
             "the paper's jobs (Table 2's runs). q is quality per trained token (q > 1: fewer tokens, each worth more, as "
             "for `drop`, whose lost tokens the throughput already counts); exact policies have q = 1 by construction. "
             "The combination assumes that q measured on our CPU model at a failure level carries over to the paper's jobs "
             "at the same level.")
    c = result["comparability"]
    caveat = ("What the combination cannot match: the failed fractions of rank-steps, on the CPU (after the 100-step warm start) "
              + ", ".join(f"{lv} {100 * c[lv]['cpu_failed_fraction']:.1f}%" for lv in LEVELS) + ", in the simulator (steady state) "
              + ", ".join(f"{lv} {100 * c[lv]['simulated_failed_fraction']:.1f}%" for lv in LEVELS)
              + "; and the samples `drop` loses, on the CPU (a rank is one GPU) "
              + ", ".join(f"{lv} {100 * c[lv]['drop_samples_lost_cpu']:.1f}%" for lv in LEVELS if c[lv]["drop_samples_lost_cpu"] is not None)
              + ", on 7B's 4 pipeline stages (a failed GPU takes its replica) "
              + ", ".join(f"{lv} {100 * c[lv]['drop_samples_lost_7b']:.1f}%" for lv in LEVELS if c[lv]["drop_samples_lost_7b"] is not None)
              + ": q per trained token is assumed to hold where many more samples are dropped.")
    section = "\n".join([
        intro, "", caveat, "", answer(result), "", *quality_table(result), "", *table(result), "",
        f"At Llama 3's rate ({scale['scenario']['interval_h']:g} h between failures per 32 GPUs, {scale['scenario']['recovery_h']:g} h "
        f"down) a run fails {100 * scale['run_failed_fraction']:.4f}% of its rank-steps: q is 1 within "
        f"{max(abs(1 - v['mean']) for v in scale['q'].values()):.1e} for every policy, so goodput at scale is the throughput kept "
        "(the scaling experiment's 7B job, against the failure-free job's throughput: each policy's own failure-free overhead, "
        "e.g. Bamboo's redundant computation, taken from Table 2's 7B job):",
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

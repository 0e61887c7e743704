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

from mecefo.errors import guarded
from mecefo.stats import percent
from mecefo.results import in_paper_order as in_order
from mecefo.results import quick_flag, read_measurement

from .common import plain_log_ticks, save_figure, style, write_block, write_table

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
        for level in result["levels"]:
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
        for level, cells in ((lv, m["levels"][lv]) for lv in result["levels"]):
            for p, c in sorted(cells.items(), key=lambda pc: -pc[1].get("goodput", -1)):
                if c["q"] is None:
                    lines.append(f"| {model} | {level} | `{p}` | {_pct(c['kept'])} {_range(c['kept_ci95'])} | not measured | | |")
                    continue
                q = "1 (exact)" if c["q"]["by"].startswith("construction") else f"{c['q']['mean']:.3f} [{c['q']['ci95'][0]:.3f}, {c['q']['ci95'][1]:.3f}]"
                lines.append(f"| {model} | {level} | `{p}` | {_pct(c['kept'])} {_range(c['kept_ci95'])} | {q} | "
                             f"{_pct(c['goodput'])} {_range(c['goodput_q_range'])} | {c['time_to_quality']:.2f}x |")
    return lines


def quality_table(result: dict) -> list[str]:
    lines = ["| runs | policy | level | failure-free steps worth (S*/S) [95% over seeds] | q per trained token [pooled 95%] | seeds | failed fraction of rank-steps |",
             "|---|---|---|---|---|---|---|"]
    cohorts = (("the level's", result["quality"]), ("at 7B's lost fraction", result.get("transfer", {})),
               ("null control", {p: {lv: result["null_control"][p][lv] | {"q_pooled": result["null_control"][p][lv]}
                                     for lv in levels} for p, levels in result.get("null_control", {}).items()}))
    ci = (lambda r: f"[{r[0]:.3f}, {r[1]:.3f}]" if np.isfinite(r[0]) else "(unbounded)")
    for name, measured in cohorts:
        for p, levels in measured.items():
            for level, v in ((lv, levels[lv]) for lv in result["levels"] if lv in levels):
                q = v.get("q_pooled", v.get("q"))
                sf = v.get("steps_fraction")
                sf_text = "" if sf is None else f"{sf['mean']:.3f} {ci(sf['ci95'])}{' (extrapolated)' if v.get('extrapolated') else ''}"
                frac = "" if "failed_fraction" not in v else f"{100 * v['failed_fraction']:.1f}%"
                lines.append(f"| {name} | `{p}` | {level} | {sf_text} | {q['mean']:.3f} {ci(q['ci95'])} | {len(v['seeds'])} | {frac} |")
    return lines


def _percent(points: float) -> float:
    """log points as percent (mecefo.stats.percent), a float for formatting."""
    return float(percent(points))


def _who(ps) -> str:
    return ", ".join(f"`{p}`" for p in ps)


def _and(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _tied(names: list[str]) -> str:
    """A tie, short: up to three names, then how many more."""
    return _who(names) if len(names) <= 3 else f"{_who(names[:3])} and {len(names) - 3} more"


def job_sentence(model: str, levels: dict, order: list[str]) -> str:
    """One sentence for a job: the levels where one policy leads under every reading, grouped by policy; elsewhere
    which policy each reading puts ahead, or none (so the readings that decide it are named), levels with the same
    answer said once (in `order`, the result's levels). Who is tied with whom is in the table."""
    robust: dict[str, list[str]] = {}
    open_: dict[tuple, list[str]] = {}
    for level in order:
        v = levels[level]["verdict"]
        if v["leader"]:
            robust.setdefault(v["leader"], []).append(level)
            continue
        said: dict[str, list[str]] = {}
        for outcome, readings in v["outcomes"].items():
            said.setdefault("no lead" if outcome.startswith("tied") else f"`{outcome}`", []).extend(readings)
        open_.setdefault(tuple((k, tuple(r)) for k, r in said.items()), []).append(level)
    parts = [f"`{p}` leads at {_and(lv)} under every reading" for p, lv in robust.items()]
    parts += [f"at {_and(lv)} the reading decides: " + "; ".join(f"{k} under {', '.join(r)}" for k, r in said)
              for said, lv in open_.items()]
    return f"**{model}**: " + "; ".join(parts) + "."


def answer(result: dict) -> str:
    """The README's answer: one sentence per job (job_sentence)."""
    readings = sorted({r for levels in result["envelope"].values() for e in levels.values() for r in e["by_reading"]},
                      key=result["readings"].index)
    return ("Which policy reaches the failure-free run's quality first (highest goodput G = throughput kept x q; \"leads\": "
            f"its paired difference with every other policy is above 0 at 95% and not wholly within {result['tolerance']:g}%, under every "
            "reading of the throughput: "
            + ", ".join(readings) + " (paper: high only)): "
            + " ".join(job_sentence(m, levels, result["levels"]) for m, levels in in_order(result["envelope"]).items()))


def _margin(c: dict) -> str:
    """A reading's answer in a table cell: the leader and its margin over the runner-up, or the policies within noise
    of the best (with their differences)."""
    if c["second"] is None:
        return f"`{c['best']}`"

    def diff(p: str) -> str:
        m = c["margin"][p]
        return f"{_percent(m['d']):+.1f}% [{_percent(m['lo']):+.1f}, {_percent(m['hi']):+.1f}]" if np.isfinite(m["lo"]) else "unbounded"

    if c["leads"]:
        return f"`{c['best']}` {diff(c['second'])} over `{c['second']}`"
    said = []
    for words, names in (("within noise", c["tied"]), (f"equal within {c['tolerance_pct']:g}%", c["equal"])):
        if names:
            said.append(f"{words} " + ", ".join(f"`{p}` ({diff(p)})" for p in names[:2])
                        + (f" and {len(names) - 2} more" if len(names) > 2 else ""))
    return f"no lead: `{c['best']}`; " + "; ".join(said)


def envelope_table(result: dict) -> list[str]:
    readings = [r for r in result["readings"] if any(r in e["by_reading"] for lv in result["envelope"].values() for e in lv.values())]
    lines = ["| job | level | " + " | ".join(readings) + " | verdict |", "|---|---|" + "---|" * (len(readings) + 1)]
    for model, levels in in_order(result["envelope"]).items():
        for level in result["levels"]:
            e = levels[level]
            cells = [_margin(e["by_reading"][r]) if r in e["by_reading"] else "" for r in readings]
            v = e["verdict"]
            lines.append(f"| {model} | {level} | " + " | ".join(cells) + " | "
                         + (f"`{v['leader']}` leads" if v["leader"] else "depends on the reading") + " |")
    return lines


def drop_paragraph(result: dict) -> str:
    r = result["drop_readings"]
    said = []
    for lv in result["levels"]:
        x = r[lv]
        if x["measured"] is None:
            continue
        said.append(f"{lv}: drop loses {100 * x['samples_lost']:.1f}% of its samples there; q read at that fraction "
                    f"({100 * x['read_at']:.1f}% of a CPU run's rank-steps, the warm start counted) between drop's runs "
                    + ("(beyond the last: held) " if x["q"].get("clamped") else "")
                    + f"is {x['q']['mean']:.3f}, so G is {_pct(x['measured'])} {_range(x['measured_range'])}, where carrying the "
                    f"level's q per trained token over gave {_pct(x['per_token'])} and carrying its steps' worth over gave "
                    f"{_pct(x['per_step'])}")
    runs = result.get("transfer", {}).get("drop", {})
    trained = ", ".join(f"{100 * m['failed_fraction']:.1f}% ({len(m['seeds'])} seeds)"
                        for m in sorted(runs.values(), key=lambda m: m["failed_fraction"]))
    return ("`drop` on llama-7b, measured instead of assumed (a failed GPU takes its replica's samples, so drop loses "
            f"about 4 times the GPUs' failed fraction; runs trained near those fractions: {trained} of rank-steps, besides "
            "the level's): " + "; ".join(said) + ".")


def null_paragraph(result: dict) -> str:
    said = [f"`{p}` at {lv}: q {v['mean']:.4f} [{v['ci95'][0]:.4f}, {v['ci95'][1]:.4f}] over {len(v['seeds'])} seeds, "
            + ("1 within its interval" if v["holds"] else "**1 outside its interval: the pipeline is biased**")
            for p, levels in result["null_control"].items() for lv, v in levels.items()]
    noise = result["noise"]
    return ("Null control: an exact policy trained through the same pipeline must give q = 1 (it checks the token accounting, the fit and its reading; `spread` trains the failure-free samples, so its loss differs from the failure-free run only by the order of floating-point sums). " + "; ".join(said)
            + (f". Intervals of q use the noise pooled over every trained cell (sd of a paired difference "
               f"{noise['sd']:.2f} log points, {noise['df']} df, {noise['runs']} runs)." if noise else "."))


def _tie_words(c: dict) -> str:
    """Who keeps a policy of highest G from leading: within noise, or equal within the tolerance."""
    return "; ".join(f"{words} {_tied(names)}" for words, names in (("within noise", c["tied"]),
                     (f"equal within {c['tolerance_pct']:g}%", c["equal"])) if names)


def map_answer(result: dict) -> str:
    """What the map says, counted: the policies of highest goodput in how many cells, the range of their margin over
    the next policy, and MeCeFO's G against the best."""
    pts = result["map"]
    groups: dict[str, list[dict]] = {}
    for p in pts:
        groups.setdefault(", ".join(f"`{x}`" for x in sorted(p["group"])), []).append(p)
    said = []
    for g, ps in groups.items():
        d = [_percent(p["margin"]["d"]) for p in ps if p["margin"] is not None and np.isfinite(p["margin"]["d"])]
        span = f"{min(d):+.1f}%" if d and min(d) == max(d) else (f"{min(d):+.1f}% to {max(d):+.1f}%" if d else "")
        said.append(f"{g} in {len(ps)} cell{'s' if len(ps) > 1 else ''}" + (f" ({span} over the next policy)" if d else ""))
    mine = [100 * (p["goodput"]["mecefo"] / p["goodput"][p["best"]] - 1) for p in pts
            if "mecefo" in p["goodput"] and p["goodput"][p["best"]] > 0]
    clamped = sum(bool(p["clamped"]) for p in pts)
    led = sum(p["leads"] for p in pts)
    return (f"one policy leads in {led} of the map's {len(pts)} cells; the highest goodput, with those not separable from it "
            f"(within noise or {result['tolerance']:g}%): " + "; ".join(said)
            + (f"; MeCeFO's G is {min(mine):+.1f}% to {max(mine):+.1f}% against the best" if mine else "")
            + (f"; in {clamped} a q is held beyond the measured fractions" if clamped else "") + ".")


def scale_answer(scale: dict) -> str:
    """Per size: the policy of highest goodput at Llama 3's rate, whether it leads, and MeCeFO's."""
    said = []
    for size in sorted(scale["sizes"], key=int):
        cells, w = scale["sizes"][size]["policies"], scale["sizes"][size]["leaders"]
        said.append(f"{int(size):,}: `{w['best']}` {_pct(cells[w['best']]['goodput'])}"
                    + (" (leads)" if w["leads"] else f" (no lead: {_tie_words(w)})")
                    + f", `mecefo` {_pct(cells['mecefo']['goodput'])}")
    clamped = {p: f for s in scale["sizes"].values() for p, f in s["clamped"].items()}
    held = ("" if not clamped else " Beyond the largest failed fraction measured for " + ", ".join(
        f"`{p}` ({100 * f:.1f}%)" for p, f in clamped.items()) + " q is held at that fraction's: there G is not a measurement.")
    return "Highest goodput at each size: " + "; ".join(said) + "." + held


def map_figure(result: dict):
    """Per recovery time, over GPUs x a GPU's MTBF: the policies of highest goodput (the best and those not separable
    from it), their margin over the next policy, and MeCeFO's G against the best."""
    pts, grid = result["map"], result["map_grid"]
    recs = grid["recovery_h"]
    fig, axes = plt.subplots(1, len(recs), figsize=(4.8 * len(recs), 4.6), squeeze=False)
    groups = sorted({", ".join(sorted(p["group"])) for p in pts})
    cycle = plt.get_cmap("Pastel1").colors
    colors = {g: cycle[i % len(cycle)] for i, g in enumerate(groups)}
    gpus, mtbf = list(grid["gpus"]), list(grid["gpu_mtbf_h"])
    for ax, rec in zip(axes[0], recs):
        for p in (p for p in pts if p["recovery_h"] == rec):
            i, j = gpus.index(p["gpus"]), mtbf.index(p["gpu_mtbf_h"])
            key = ", ".join(sorted(p["group"]))
            ax.add_patch(plt.Rectangle((i - 0.5, j - 0.5), 1, 1, color=colors[key], lw=0))
            m = p["margin"]
            lines = ["\n".join(p["group"][:3]) + (f"\n+{len(p['group']) - 3} more" if len(p["group"]) > 3 else "")]
            if m is not None and np.isfinite(m["lo"]):
                lines.append(f"{_percent(m['d']):+.1f}% [{_percent(m['lo']):+.1f}, {_percent(m['hi']):+.1f}]\nover {p['next']}")
            if "mecefo" in p["goodput"] and "mecefo" not in p["group"] and p["goodput"][p["best"]] > 0:
                lines.append(f"mecefo {100 * (p['goodput']['mecefo'] / p['goodput'][p['best']] - 1):+.1f}%")
            ax.text(i, j, "\n".join(lines) + ("*" if p["clamped"] else ""), ha="center", va="center", fontsize=5.5)
        ax.set(xlim=(-0.5, len(gpus) - 0.5), ylim=(-0.5, len(mtbf) - 0.5), xticks=range(len(gpus)), yticks=range(len(mtbf)),
               xticklabels=[f"{g:,}" for g in gpus], yticklabels=[f"{m:,.0f}" for m in mtbf], xlabel="GPUs",
               title=f"failed GPU down {rec:g} h")
        ax.grid(False)
    axes[0][0].set_ylabel("a GPU's mean time between failures, h")
    fig.suptitle("Highest goodput, simulated 7B job (weak scaling): the best policies (not separable at 95% or within "
                 f"{result['tolerance']:g}%), their margin over the next, MeCeFO against the best (*: q held beyond the measured)",
                 fontsize=8)
    fig.tight_layout()
    return fig


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
             "the paper's jobs (Table 2's runs and `experiments.goodput_sim`). q is quality per trained token (q > 1: fewer "
             "tokens, each worth more, as for `drop`, whose lost tokens the throughput already counts); exact policies have "
             "q = 1 by construction. q is measured at each job's failed fraction: the level's runs, and for `drop` on "
             "llama-7b the fraction of samples it loses there, read between drop's runs.")
    c = result["comparability"]
    caveat = ("What the combination cannot match: the failed fractions of rank-steps, on the CPU (over the whole run, its "
              f"failure-free warm start counted: failures fill {100 * result.get('warm_share', 1):.0f}% of it) "
              + ", ".join(f"{lv} {100 * c[lv]['cpu_failed_fraction']:.1f}%" for lv in result["levels"]) + ", in the simulator (steady state) "
              + ", ".join(f"{lv} {100 * c[lv]['simulated_failed_fraction']:.1f}%" for lv in result["levels"]) + ".")
    section = "\n".join([
        intro, "", caveat, "", answer(result), "", *envelope_table(result), "", drop_paragraph(result), "",
        null_paragraph(result), "", *quality_table(result), "",
        "The simulated reading in full (the throughput's 95% interval; G's range over q's pooled interval):", "",
        *table(result), "",
        f"At Llama 3's rate ({scale['scenario']['interval_h']:g} h between failures per 32 GPUs, {scale['scenario']['recovery_h']:g} h "
        f"down) a run fails {100 * scale['run_failed_fraction']:.4f}% of its rank-steps: q is 1 within "
        f"{scale['max_q_gap']:.1e} for every policy, so goodput at scale is the throughput kept (the scaling experiment's 7B "
        "job, against the failure-free job's throughput: each policy's own failure-free overhead, e.g. Bamboo's redundant "
        "computation, taken from the same scaling job):",
        "", *head, "", scale_answer(scale), "",
        "![goodput frontier](docs/figures/goodput_frontier.png)", "![goodput against the failure rate](docs/figures/goodput_rate.png)",
        "", "Where the leader changes, over GPUs, a GPU's mean time between failures and how long a failed GPU stays down "
        "(the scaling experiment's 7B job, simulated reading; every policy's G against the same failure-free job): "
        + map_answer(result), "", "![where the leader changes](docs/figures/goodput_map.png)"])
    return "# Goodput\n\n" + section + "\n", section


def main(argv: list[str] | None = None) -> int:
    quick = quick_flag(argv, __doc__)
    result = read_measurement("goodput", "goodput", quick, "experiments.goodput", keys=("levels", "readings", "tolerance"))
    style()
    doc, section = report(result)
    paths = [write_table("goodput", doc)]
    paths += save_figure(frontier_figure(result), "goodput_frontier", committed=not quick)
    paths += save_figure(rate_figure(result), "goodput_rate", committed=not quick)
    paths += save_figure(map_figure(result), "goodput_map", committed=not quick)
    paths.append(write_block("goodput", section, quick))
    for p in paths:
        if p is not None:
            print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

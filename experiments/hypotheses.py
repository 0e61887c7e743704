"""Readings under which the paper's MeCeFO drops (Table 2: 1.07 / 2.98 / 4.18% for 350M / 1B / 7B) could
hold, each a parameter of the throughput simulator swept on the paper's three jobs under Table 1's high
scenario, with the value that reproduces each drop:

    H1  measurement window: a cold start (every GPU alive) and a window of W seconds
    H2  neighbour slack: a share s of the neighbour's extra time hidden in idle time (Job.neighbour_slack)
    H3  neighbour cost: the neighbour's step-time factor alpha (Job.neighbour_alpha), beside the exact
        alpha of each technique set of the ablation
    H4  failure unit: GPUs that fail together, up to a node of 8 (Job.failure_unit; failed fraction kept)
    H5  work spread over survivors: spread-mecefo with each failed GPU's work split over w peers
        (Job.spread_width)
and the bound that frames them (mecefo.simulator.spread_bound): the relative cost c of covering the missing
work that each drop needs at Table 1's stationary failed fraction, beside the c of each technique set. Two more
readings, and checks of the paper's columns against each other:

    A   no synchronous barrier: throughput as the per-GPU step rate averaged over the alive GPUs, a neighbour
        slowing only itself: drop = f (1 - 1/alpha) / (1 - f) at the failed fraction f
    B   brief covering: a neighbour covers a failure for tau seconds only (a spare or a fast restart takes
        over), Table 1's arrivals kept; and MeCeFO with spares (tau = a spare's start, as checkpoint-restart gets)
    the Oobleck check: the failed fraction our Oobleck model needs for the paper's Oobleck column, and Oobleck's
        drop under H1's window and B's covering (a reading must hold for every column of Table 2 at once)
    H1 across models: each model's window, and the drop it predicts for the other two

    python -m experiments.hypotheses [--quick]

Writes results/throughput/hypotheses-<profile>.json.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np
from tqdm import tqdm

from mecefo.failures import REFERENCE_RANKS, SCENARIOS, FailureScenario
from mecefo.records import atomic_write_json, git_commit
from mecefo.results import measurement, reusable, sources_digest, paper_numbers, quick_flag
from mecefo.simulator import CostModel, ci95, cost_needed, spread_bound

from .common import guarded
from .throughput import HORIZON_S, PAPER_JOBS, drops

LEVEL = "high"
# the ablation's technique sets (experiments/ablation.py), as Techniques.parse specs
TECHNIQUE_SETS = {"naive NDB": "normal", "+ skip_attention": "skip_attention",
                  "+ recompute_ffn": "skip_attention+recompute_ffn",
                  "+ low_rank_wgrad (MeCeFO)": "mecefo"}


def paper_drops() -> dict[str, float]:
    """The paper's MeCeFO drop per model, as a fraction."""
    return {m: paper_drop_of(m, "MeCeFO") for m in PAPER_JOBS}


def curve(values, run) -> dict:
    """The drop (mean and 95% interval over seeds) at each parameter value; run(value) -> drops per seed."""
    rows = [ci95(run(v)) for v in values]
    return {"values": [float(v) for v in values], "mean": [r[0] for r in rows], "lo": [r[1] for r in rows],
            "hi": [r[2] for r in rows]}


def crossing(values, means, target: float, log: bool = False) -> float | None:
    """The parameter at which the mean drop crosses `target`, by linear interpolation between the grid
    points that bracket it (in log-parameter if log); None if no two neighbouring points bracket it."""
    x = np.log(values) if log else np.asarray(values, dtype=float)
    for i in range(len(values) - 1):
        a, b = means[i] - target, means[i + 1] - target
        if a == 0:
            return float(values[i])
        if a * b < 0:
            xi = x[i] + (x[i + 1] - x[i]) * a / (a - b)
            return float(np.exp(xi) if log else xi)
    return float(values[-1]) if means[-1] == target else None


def paper_drop_of(model: str, system: str) -> float:
    """The paper's Table 2 drop of a system (MeCeFO, Bamboo, Oobleck) for a model, as a fraction."""
    return paper_numbers()["table2_throughput_tokens_per_s"]["rows"][model][system][2] / 100


def failed_fraction() -> float:
    sc = SCENARIOS[LEVEL]
    return sc.recovery_h / sc.interval_h / REFERENCE_RANKS  # Little's law: GPUs down / GPUs


def reading_a(hyp: dict) -> dict:
    """Reading A per model, no synchronous barrier: every GPU trains at its own pace, a neighbour at 1/alpha steps
    per unit time with two shares per step, a failed GPU not at all. In tokens/s (Table 2's unit) the drop is
    2 f (1 - 1/alpha) at the failed fraction f, and the alpha giving the paper's drop d is 1 / (1 - d / (2 f));
    averaging step rates over the alive GPUs instead (no token counted twice) gives f (1 - 1/alpha) / (1 - f)."""
    f, out = failed_fraction(), {}
    for name, row in hyp.items():
        d, alpha = row["target"], row["alpha_1"]
        drop, step_rate = 2 * f * (1 - 1 / alpha), f * (1 - 1 / alpha) / (1 - f)
        x = 1 - d / (2 * f)
        need = 1 / x if x > 0 else None
        sets = row["H3"]["technique_sets"]
        lo = min(sets, key=sets.get)
        reach = need is not None and need >= alpha  # MeCeFO's own alpha would then lose no more than the paper's drop
        need_words = "no alpha" if need is None else f"alpha = {need:.3f}"
        out[name] = {"drop": drop, "drop_step_rate": step_rate, "alpha_needed": need, "plausible": reach, "sentence": (
            f"without a synchronous barrier our alpha = {alpha:.3f} loses {100 * drop:.2f}% of the tokens/s "
            f"({100 * step_rate:.2f}% of the alive GPUs' mean step rate; paper {100 * d:.2f}%); the paper's drop needs "
            f"{need_words}, " + ("within reach of MeCeFO's" if reach else
                                 f"below MeCeFO's {alpha:.3f} and the cheapest technique set's {sets[lo]:.3f} ({lo})")
            + "; and a data-parallel step that all-reduces its gradients is synchronous, so the reading also needs the "
            "paper to have measured without the barrier")}
    return out


def covering(tau_s: float) -> FailureScenario:
    """Table 1's high arrivals with each failure covered for tau_s seconds only."""
    return FailureScenario(f"cover-{tau_s:g}s", SCENARIOS[LEVEL].interval_h, tau_s / 3600)


def reading_b(seeds: int, quick: bool) -> dict:
    """Reading B per model: MeCeFO's drop against the covering time tau, the tau that gives the paper's drop,
    Oobleck's drop when the same spares serve it, and MeCeFO and Oobleck with spares at a spare's start."""
    taus = np.geomspace(5, SCENARIOS[LEVEL].recovery_h * 3600, 8 if quick else 16)
    out = {}
    for name, job in PAPER_JOBS.items():
        target = paper_drop_of(name, "MeCeFO")
        row = curve(taus, lambda t: drops(job, "mecefo", seeds, scenario=covering(float(t))))
        row["needed"] = crossing(taus, row["mean"], target, log=True)
        spare = job.const("replacement_delay_s") + job.const("reform_s")
        row["spare_s"] = spare
        row["with_spares"] = {p: ci95(drops(job, p, seeds, scenario=covering(spare))) for p in ("mecefo", "oobleck")}
        tau = row["needed"]
        row["oobleck_at_needed"] = None if tau is None else ci95(drops(job, "oobleck", seeds, scenario=covering(tau)))
        oob = paper_drop_of(name, "Oobleck")
        row["sentence"] = ("no covering time in the swept range reproduces the drop" if tau is None else (
            f"{tau:.0f} s of covering per failure (Table 1 says a failed GPU recovers after "
            f"{SCENARIOS[LEVEL].recovery_h:g} h); a spare ready after {job.const('replacement_delay_s'):.0f} s plus a "
            f"{job.const('reform_s'):g} s rendezvous covers for {spare:.0f} s, "
            + ("so spares could do it" if spare <= tau else f"more than the {tau:.0f} s needed")
            + f"; MeCeFO with such spares loses {100 * row['with_spares']['mecefo'][0]:.2f}% "
            f"[{100 * row['with_spares']['mecefo'][1]:.2f}, {100 * row['with_spares']['mecefo'][2]:.2f}]"
            + f"; failures as short for Oobleck (the same spares) give it {100 * row['oobleck_at_needed'][0]:.2f}% against "
            f"the paper's {100 * oob:.2f}% (with a spare's {spare:.0f} s: {100 * row['with_spares']['oobleck'][0]:.2f}%)"))
        out[name] = row
    return out


def oobleck_check(seeds: int, quick: bool, hyp: dict) -> dict:
    """Per model: the failed fraction f at which our Oobleck model gives the paper's Oobleck drop (Table 1's
    interval kept, the recovery time varied), and Oobleck's drop under H1's window (a cold start and W seconds)."""
    sc = SCENARIOS[LEVEL]
    recov = np.geomspace(0.05, 8.0, 8 if quick else 17)  # hours
    out = {}
    for name, job in PAPER_JOBS.items():
        target = paper_drop_of(name, "Oobleck")
        row = curve(recov, lambda h: drops(job, "oobleck", seeds, scenario=FailureScenario("oobleck-f", sc.interval_h, float(h))))
        h = crossing(recov, row["mean"], target, log=True)
        row["values_f"] = [v / sc.interval_h / REFERENCE_RANKS for v in recov]
        row["f_needed"] = None if h is None else h / sc.interval_h / REFERENCE_RANKS
        w = hyp[name]["H1"]["needed"]
        row["under_H1"] = None if w is None else ci95(drops(job, "oobleck", 4 * seeds, horizon_s=float(w), start="cold"))
        f = failed_fraction()
        row["sentence"] = (
            (f"our Oobleck model gives the paper's Oobleck drop {100 * target:.2f}% at f = {100 * row['f_needed']:.1f}% "
             f"({REFERENCE_RANKS * row['f_needed']:.1f} of {REFERENCE_RANKS} GPUs down; Table 1's high: "
             f"{REFERENCE_RANKS * f:.0f})" if h is not None else
             f"no failed fraction in the swept range gives the paper's Oobleck drop {100 * target:.2f}%")
            + ("" if w is None else f"; in H1's {w:.0f} s window Oobleck's drop would be {100 * row['under_H1'][0]:.2f}%"))
        out[name] = row
    return out


def h1_across(hyp: dict) -> dict:
    """Each model's H1 window, and the drop that window predicts for every model (log-linear interpolation of
    that model's H1 curve): one window would have to serve all three of the paper's rows."""
    out = {}
    for name, row in hyp.items():
        w = row["H1"]["needed"]
        if w is None:
            continue
        out[name] = {"window_s": w, "predicts": {m: float(np.interp(np.log(w), np.log(r["H1"]["values"]), r["H1"]["mean"]))
                                                 for m, r in hyp.items()},
                     "extrapolated": {m: not min(r["H1"]["values"]) <= w <= max(r["H1"]["values"]) for m, r in hyp.items()}}
    return out


def consistency(a: dict, b: dict, oob: dict, across: dict) -> list[str]:
    """The sentences that hold the readings against every column of Table 2 at once."""
    lines = []
    for name in PAPER_JOBS:
        target, oob_paper = paper_drop_of(name, "MeCeFO"), paper_drop_of(name, "Oobleck")
        parts = [f"A: {a[name]['sentence']}", f"B: {b[name]['sentence']}", f"Oobleck: {oob[name]['sentence']}"]
        if name in across:
            pred = across[name]["predicts"]
            ext = across[name]["extrapolated"]
            parts.append(f"H1's {across[name]['window_s']:.0f} s window predicts " + ", ".join(
                f"{100 * v:.2f}% for {m} (paper {100 * paper_drop_of(m, 'MeCeFO'):.2f}%{', outside its swept windows' if ext[m] else ''})"
                for m, v in pred.items() if m != name))
        broken = [h for h, d in (("H1", oob[name]["under_H1"]), ("B", b[name]["oobleck_at_needed"])) if d is not None
                  and d[2] < oob_paper]
        parts.append((f"{' and '.join(broken)} reconcile{'s' if len(broken) == 1 else ''} MeCeFO's {100 * target:.2f}% only "
                      f"by taking Oobleck's drop below the paper's {100 * oob_paper:.2f}%: under {' or '.join(broken)} the "
                      "paper's MeCeFO and Oobleck columns cannot both hold") if broken else
                     "neither H1 nor B takes Oobleck's drop below the paper's")
        lines.append(f"{name}: " + "; ".join(parts) + ".")
    return lines


def hypotheses(seeds: int, quick: bool) -> dict:
    targets = paper_drops()
    windows = np.geomspace(5, HORIZON_S, 10 if quick else 20)
    slacks = np.linspace(0, 1, 6 if quick else 11)
    units = [1, 2, 4, 8]
    widths = [1, 2, 4, 8, 16, 0]  # 0: all survivors
    out = {}
    steps = tqdm(total=5 * len(PAPER_JOBS), desc="hypotheses", disable=not sys.stderr.isatty())
    for name, job in PAPER_JOBS.items():
        target, cost = targets[name], CostModel(job)
        alphas = np.linspace(1.0, 2.0, 6 if quick else 21)  # up to naive NDB (both micro-batches exact)
        row = {"target": target, "alpha_1": cost.alpha(1), "c": cost.relative_cost}
        # H1: a window of W seconds that starts with every GPU alive (more seeds: short windows are noisy)
        row["H1"] = curve(windows, lambda w: drops(job, "mecefo", 4 * seeds, horizon_s=float(w), start="cold"))
        row["H1"]["needed"] = crossing(windows, row["H1"]["mean"], target, log=True)
        steps.update(1)
        row["H2"] = curve(slacks, lambda v: drops(replace(job, neighbour_slack=float(v)), "mecefo", seeds))
        row["H2"]["needed"] = crossing(slacks, row["H2"]["mean"], target)
        steps.update(1)
        row["H3"] = curve(alphas, lambda v: drops(replace(job, neighbour_alpha=float(v)), "mecefo", seeds))
        row["H3"]["needed"] = crossing(alphas, row["H3"]["mean"], target)
        row["H3"]["technique_sets"] = {k: CostModel(replace(job, techniques=v)).alpha(1) for k, v in TECHNIQUE_SETS.items()}
        steps.update(1)
        row["H4"] = curve(units, lambda v: drops(replace(job, failure_unit=int(v)), "mecefo", seeds))
        row["H4"]["needed"] = crossing(units, row["H4"]["mean"], target)
        steps.update(1)
        row["H5"] = curve(widths, lambda v: drops(replace(job, spread_width=int(v)), "spread-mecefo", seeds))
        row["H5"]["needed"] = crossing(widths[:-1], row["H5"]["mean"][:-1], target)  # the last point is "all"
        steps.update(1)
        out[name] = row
    return out


def bound() -> dict:
    """c needed by each paper drop at Table 1's stationary failed fraction, and the c of each technique set."""
    f = failed_fraction()
    out = {"f": f, "models": {}}
    for name, target in paper_drops().items():
        job = PAPER_JOBS[name]
        sets = {k: CostModel(replace(job, techniques=v)).relative_cost for k, v in TECHNIQUE_SETS.items()}
        out["models"][name] = {"target": target, "c_needed": cost_needed(target, f),
                               "technique_sets": {k: {"c": c, "bound": spread_bound(f, c)} for k, c in sets.items()}}
    return out


def main(argv: list[str] | None = None) -> int:
    quick = quick_flag(argv, __doc__)
    path = measurement("throughput", "hypotheses", quick)
    digest = sources_digest()
    if reusable(path, digest):
        print(f"reusing {path}")
        return 0
    seeds = 8 if quick else 100
    result = {"level": LEVEL, "horizon_s": HORIZON_S, "seeds": seeds, "git_commit": git_commit(), "sources_digest": digest,
              "interval_s": SCENARIOS[LEVEL].interval_h * 3600,  # between failure events on the 32 GPUs
              "hypotheses": hypotheses(seeds, quick), "bound": bound()}
    hyp = result["hypotheses"]
    result["readings"] = {"A": reading_a(hyp), "B": reading_b(seeds, quick), "oobleck": oobleck_check(seeds, quick, hyp),
                          "H1_across": h1_across(hyp)}
    r = result["readings"]
    result["readings"]["consistency"] = consistency(r["A"], r["B"], r["oobleck"], r["H1_across"])
    atomic_write_json(path, result)
    for name, row in result["hypotheses"].items():
        print(f"{name}: paper {100 * row['target']:.2f}%; needed W {row['H1']['needed']}, s {row['H2']['needed']}, "
              f"alpha {row['H3']['needed']}, unit {row['H4']['needed']}, width {row['H5']['needed']}; "
              f"c needed {result['bound']['models'][name]['c_needed']:.3f}")
    for line in result["readings"]["consistency"]:
        print(line)
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

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
work that each drop needs at Table 1's stationary failed fraction, beside the c of each technique set.

    python -m experiments.hypotheses [--quick]

Writes results/throughput/hypotheses-<profile>.json.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np
from tqdm import tqdm

from mecefo.failures import REFERENCE_RANKS, SCENARIOS
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
    rows = paper_numbers()["table2_throughput_tokens_per_s"]["rows"]
    return {m: rows[m]["MeCeFO"][2] / 100 for m in PAPER_JOBS}


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
    sc = SCENARIOS[LEVEL]
    f = sc.recovery_h / sc.interval_h / REFERENCE_RANKS  # Little's law: GPUs down / GPUs
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
    atomic_write_json(path, result)
    for name, row in result["hypotheses"].items():
        print(f"{name}: paper {100 * row['target']:.2f}%; needed W {row['H1']['needed']}, s {row['H2']['needed']}, "
              f"alpha {row['H3']['needed']}, unit {row['H4']['needed']}, width {row['H5']['needed']}; "
              f"c needed {result['bound']['models'][name]['c_needed']:.3f}")
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

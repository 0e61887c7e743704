"""Goodput: which policy a cluster should run. Every policy's quality and throughput on the same failures in
one measure, from 32 GPUs to 100k; from the sweep (quality, trained on the CPU at n = 32) and the throughput
simulation (the paper's three jobs) to results/goodput/goodput-<profile>.json, which paper_figures.goodput
renders.

    python -m experiments.goodput [--quick]

Quality-equivalent steps. Failure-free runs of the sweep's config at several lengths (each its own full
learning-rate schedule: a shorter run is a real shorter run), on each seed of the sweep's failure-free
cells, give the final validation loss as a function of the length S. Per seed we fit
        L(S) = a + b ln S        (least squares over the lengths; the residuals are recorded)
and a run under failures with final validation loss l is worth S* = exp((l - a) / b) failure-free steps
(S* outside the lengths trained is extrapolated, and flagged); measured against the same seed's failure-free
run of the same length S (loss l_ff, so that the fit's own error at S cancels), the fraction of its steps it
is worth is S*(l) / S*(l_ff), and its quality per trained token
        q = S*(l) / S*(l_ff) x (tokens a failure-free run of S steps trains) / (tokens it trained),
so that a policy that drops samples (drop) is not charged twice: the simulator's throughput counts trained
tokens only. Exact policies (the registry's `exact`) train every sample exactly: q = 1 by construction, and
they are not trained here.

Effective throughput. G = (simulated trained tokens/s under the failures / failure-free tokens/s) x q, the
share of the failure-free job's progress a policy keeps (an ETTR-style ratio); time to the failure-free
run's quality is 1/G times the failure-free time. The quality is measured on our CPU model, the
throughput simulated for the paper's jobs: the combination assumes that q, measured at the same Table 1
level, carries over from the small model to the paper's. The levels are the same, the failed fractions are
not quite (the CPU runs start failing after a 100-step failure-free warm start; the simulator is in steady
state), nor is what a failure costs a policy (drop on 7B's 4 pipeline stages loses a whole replica's samples
per failed GPU; on the CPU a rank is one GPU): the report says both. The bracketed G is its range over q's
95% interval over seeds and the throughput's over the simulator's seeds; a policy "leads" a level when the
low end of its range is above the high end of every other policy's.

Scale. The simulator's scaling experiment (llama-7b, 4 stages, 32 to 100k GPUs at Llama 3's rate) gives the
throughput kept; q there is interpolated in the run's failed fraction between failure-free (q = 1) and the
levels measured (Llama 3's rate fails a smaller fraction than Table 1's low level at every size).
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np
from tqdm import tqdm

from mecefo import config as config_mod
from mecefo import failures, policies
from mecefo.errors import UsageError, guarded
from mecefo.records import atomic_write_json, git_commit
from mecefo.results import RESULTS, measurement, profile, quick_flag, read_measurement, run_dir
from mecefo.simulator import ci95
from mecefo.train import run

from . import sweep

LENGTHS = {"quick": (30, 40, 50), "default": (200, 240, 270)}  # besides the sweep's own length (60, 300)
LEVELS = ("low", "mid", "high")
REFERENCE = "mecefo"  # whose failure-free throughput is the job's (no failure: every policy trains alike)


def failure_free_curves(prof: str) -> dict[int, list[dict]]:
    """Per seed of the sweep's failure-free cells: (steps, final validation loss) of failure-free runs of
    every length (trained here, or reused; the sweep's own length is its run)."""
    d = sweep.DESIGNS[prof]
    todo = [(seed, length) for seed in range(d.high_seeds) for length in LENGTHS[prof]]
    bar = tqdm(todo, desc="failure-free runs of other lengths", disable=not sys.stderr.isatty())
    curves: dict[int, list[dict]] = {}
    for seed in range(d.high_seeds):
        full = sweep.cell_config(d.base, sweep.Cell(d.n, "none", "none", seed))
        curves[seed] = [{"steps": full.train.steps, "run": str(run_dir("sweep", full).relative_to(RESULTS)),
                         "val_loss": run(full, run_dir("sweep", full), quiet=True)["final_val_loss"]}]
    for seed, length in bar:
        full = sweep.cell_config(d.base, sweep.Cell(d.n, "none", "none", seed))
        cfg = config_mod.with_overrides(full, train={"steps": length})
        out = run_dir("goodput", cfg)
        curves[seed].append({"steps": length, "run": str(out.relative_to(RESULTS)),
                             "val_loss": run(cfg, out, quiet=True)["final_val_loss"]})
    return {seed: sorted(points, key=lambda p: p["steps"]) for seed, points in curves.items()}


def fit(points: list[dict]) -> dict:
    """L(S) = a + b ln S by least squares; with the largest residual."""
    s = np.log([p["steps"] for p in points])
    loss = np.array([p["val_loss"] for p in points])
    b, a = np.polyfit(s, loss, 1)
    if b >= 0:
        raise ValueError(f"failure-free loss does not fall with the run's length ({points})")
    return {"a": float(a), "b": float(b), "max_residual": float(np.max(np.abs(a + b * s - loss))),
            "lengths": [p["steps"] for p in points]}


def equivalent_steps(curve: dict, loss: float) -> float:
    """S* = exp((loss - a) / b): the failure-free steps whose final validation loss is `loss`."""
    return math.exp((loss - curve["a"]) / curve["b"])


def interval(values: list[float]) -> dict:
    mean, lo, hi = ci95(values)
    return {"mean": mean, "ci95": [lo, hi], "values": values}


def quality(index: dict, curves: dict[int, dict]) -> dict:
    """Per trained policy and level of the sweep's main cells at its n: S*/S and q (per seed, mean, 95%
    interval), the failed fraction, whether any S* was extrapolated."""
    n = index["design"]["n"]
    per: dict = {}
    for cell in index["cells"]:
        if cell["tag"] != "main" or cell["n"] != n or cell["level"] not in LEVELS or "error" in cell:
            continue
        if cell["seed"] not in curves:
            raise UsageError(f"seed {cell['seed']} of {cell['policy']} at {cell['level']} has no failure-free runs; "
                             "rerun python -m experiments.sweep for this profile")
        summary = json.loads((RESULTS / cell["run"] / "summary.json").read_text())
        curve = curves[cell["seed"]]
        s_star = equivalent_steps(curve, summary["final_val_loss"])
        own = equivalent_steps(curve, curve["full_loss"])  # the seed's failure-free run of the same length
        steps = summary["steps"]
        entry = per.setdefault((cell["policy"], cell["level"]), {"seeds": [], "steps_fraction": [], "q": [],
                                                                  "failed_fraction": [], "extrapolated": False})
        entry["seeds"].append(cell["seed"])
        entry["steps_fraction"].append(s_star / own)
        entry["q"].append(s_star / own * summary["tokens_seen"] / summary["tokens_trained"])
        entry["failed_fraction"].append(summary["failure_schedule"]["fraction_failed"])
        entry["extrapolated"] |= not min(curve["lengths"]) <= s_star <= max(curve["lengths"])
    out: dict = {}
    for (policy, level), e in sorted(per.items()):
        out.setdefault(policy, {})[level] = {
            "seeds": e["seeds"], "steps_fraction": interval(e["steps_fraction"]), "q": interval(e["q"]),
            "failed_fraction": float(np.mean(e["failed_fraction"])), "extrapolated": e["extrapolated"]}
    return out


def quality_of(policy: str, level: str, measured: dict) -> dict | None:
    """q for a registry policy at a level: 1 for an exact one (by construction), the measurement for a
    trained one, None where none was made."""
    if policies.get(policy).exact:
        return {"mean": 1.0, "ci95": [1.0, 1.0], "by": "construction (exact policy)"}
    m = measured.get(policy, {}).get(level)
    return None if m is None else {"mean": m["q"]["mean"], "ci95": m["q"]["ci95"], "by": "measured"}


def effective(throughput: dict, measured: dict) -> dict:
    """Per job, level and registry policy: throughput kept, q, G and its sensitivity, time to quality."""
    out = {}
    for model, row in throughput["table2"].items():
        reference = row["none"][REFERENCE]["mean"]
        simulated = [p for p in policies.simulator_policies() if all(p in row[lv] for lv in ("none", *LEVELS))]
        out[model] = {"failure_free_tok_s": reference, "levels": {},
                      "failure_free_kept": {p: row["none"][p]["mean"] / reference for p in simulated},
                      "not_simulated": [p for p in policies.simulator_policies() if p not in simulated]}
        for level in LEVELS:
            cells = {}
            for policy in simulated:
                kept = row[level][policy]["mean"] / reference
                kept_ci = [c / reference for c in row[level][policy]["ci95"]]
                q = quality_of(policy, level, measured)
                cell = {"tok_s": row[level][policy]["mean"], "kept": kept, "kept_ci95": kept_ci, "q": q}
                if q is not None:
                    cell |= {"goodput": kept * q["mean"], "goodput_q_range": [kept * c for c in q["ci95"]],
                             "goodput_range": [kept_ci[0] * q["ci95"][0], kept_ci[1] * q["ci95"][1]],
                             "effective_tok_s": row[level][policy]["mean"] * q["mean"],
                             "time_to_quality": 1 / (kept * q["mean"])}
                cells[policy] = cell
            out[model]["levels"][level] = cells
    return out


def leaders(cells: dict) -> dict:
    """The policy of highest G; the runner-up and how far ahead; `leads`: the low end of its range above the
    high end of every other policy's (else `tied`: those whose ranges reach the leader's low end). A bound that is
    missing (one seed: no interval) is unbounded: such a policy ties with the leader, and as the leader it leads
    nothing (`unbounded` names them)."""
    ranked = sorted((p for p in cells if "goodput" in cells[p]), key=lambda p: -cells[p]["goodput"])
    best, second = ranked[0], ranked[1]

    def bounds(p: str) -> tuple[float, float]:
        lo, hi = cells[p]["goodput_range"]
        return (lo if math.isfinite(lo) else -math.inf), (hi if math.isfinite(hi) else math.inf)

    tied = [p for p in ranked[1:] if bounds(p)[1] >= bounds(best)[0]]
    return {"best": best, "second": second, "ahead": cells[best]["goodput"] / cells[second]["goodput"] - 1,
            "leads": not tied, "tied": tied, "not_measured": [p for p in cells if "goodput" not in cells[p]],
            "unbounded": [p for p in ranked if not all(map(math.isfinite, cells[p]["goodput_range"]))]}


def winners(eff: dict) -> dict:
    """Per job and level: leaders()."""
    return {model: {level: leaders(cells) for level, cells in m["levels"].items()} for model, m in eff.items()}


def at_scale(throughput: dict, measured: dict, base_cfg) -> dict:
    """G from 32 to 100k GPUs at the scaling experiment's rate: its throughput kept x q interpolated in the
    run's failed fraction (the scenario's expected fraction over the steps with failures)."""
    sc = throughput["scaling"]["scenario"]
    scenario = failures.FailureScenario(sc["name"], sc["interval_h"], sc["recovery_h"])
    cc, steps = base_cfg.cluster, base_cfg.train.steps
    fraction = scenario.expected_failed_fraction() * (steps - cc.failure_free_steps) / steps
    q = {}
    for policy in policies.simulator_policies():
        if policies.get(policy).exact:
            q[policy] = {"mean": 1.0, "ci95": [1.0, 1.0]}
        elif policy in measured and all(lv in measured[policy] for lv in LEVELS):
            points = sorted((measured[policy][lv]["failed_fraction"], measured[policy][lv]["q"]) for lv in LEVELS)
            xs = [0.0] + [x for x, _ in points]
            q[policy] = {"mean": float(np.interp(fraction, xs, [1.0] + [v["mean"] for _, v in points])),
                         "ci95": [float(np.interp(fraction, xs, [1.0] + [v["ci95"][i] for _, v in points])) for i in (0, 1)],
                         # beyond the largest measured failed fraction np.interp holds the last q: not a measurement
                         "clamped_at": xs[-1] if fraction > xs[-1] else None}
    # the scaling experiment's ratios are against each policy's own failure-free run: put them on the failure-free
    # job's (REFERENCE's) with each policy's failure-free overhead in Table 2's 7B job (e.g. Bamboo's redundancy)
    own = throughput["table2"]["llama-7b"]["none"]
    sizes = {}
    for gpus, cells in throughput["scaling"]["results"].items():
        sizes[gpus] = {}
        for p, c in cells.items():
            if p not in policies.simulator_policies() or p not in own:
                continue
            base = own[p]["mean"] / own[REFERENCE]["mean"]
            kept, kept_ci = c["retained"] * base, [x * base for x in c["ci95"]]
            sizes[gpus][p] = {"kept": kept, "kept_ci95": kept_ci, "failure_free_kept": base, "q": q.get(p)}
            if p in q:
                sizes[gpus][p] |= {"goodput": kept * q[p]["mean"], "goodput_q_range": [kept * x for x in q[p]["ci95"]],
                                   "goodput_range": [kept_ci[0] * q[p]["ci95"][0], kept_ci[1] * q[p]["ci95"][1]]}
        sizes[gpus] = {"policies": sizes[gpus], "leaders": leaders(sizes[gpus])}
    return {"scenario": sc, "run_failed_fraction": fraction, "q": q, "sizes": sizes}


def main(argv: list[str] | None = None) -> int:
    quick = quick_flag(argv, __doc__)
    prof = profile(quick)
    index = json.loads((RESULTS / "sweep" / f"index-{prof}.json").read_text()) if (
        RESULTS / "sweep" / f"index-{prof}.json").exists() else None
    if index is None:
        raise UsageError(f"no results/sweep/index-{prof}.json; run python -m experiments.sweep{' --quick' if quick else ''} first")
    throughput = read_measurement("throughput", "throughput", quick, "experiments.throughput")
    points = failure_free_curves(prof)
    curves = {seed: fit(p) | {"points": p, "full_loss": p[-1]["val_loss"]} for seed, p in points.items()}
    measured = quality(index, curves)
    eff = effective(throughput, measured)
    d = sweep.DESIGNS[prof]
    base_cfg = sweep.cell_config(d.base, sweep.Cell(d.n, "none", "none", 0))
    compared = {lv: {"cpu_failed_fraction": float(np.mean([measured[p][lv]["failed_fraction"] for p in measured if lv in measured[p]])),
                     "simulated_failed_fraction": failures.SCENARIOS[lv].expected_failed_fraction(),
                     "drop_samples_lost_cpu": 1 - measured["drop"][lv]["steps_fraction"]["mean"] / measured["drop"][lv]["q"]["mean"]
                     if lv in measured.get("drop", {}) else None,
                     "drop_samples_lost_7b": 1 - eff["llama-7b"]["levels"][lv]["drop"]["kept"] if "drop" in eff["llama-7b"]["levels"][lv] else None}
                for lv in LEVELS}
    result = {"profile": prof, "n": d.n, "curves": {str(k): v for k, v in curves.items()}, "quality": measured,
              "comparability": compared,
              "effective": eff, "winners": winners(eff), "scale": at_scale(throughput, measured, base_cfg),
              "throughput_sources_digest": throughput["sources_digest"], "sweep_git_commit": index["git_commit"],
              "git_commit": git_commit()}
    path = measurement("goodput", "goodput", quick)
    atomic_write_json(path, result)
    for model, levels in result["winners"].items():
        print(model + ": " + "; ".join(f"{lv} {w['best']} (+{100 * w['ahead']:.1f}% over {w['second']}"
                                       f"{'' if w['leads'] else ', tied with ' + ', '.join(w['tied'])})"
                                       for lv, w in levels.items()))  # noqa: E501
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

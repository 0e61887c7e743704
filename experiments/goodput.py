"""Goodput: which policy a cluster should run. Every policy's quality and throughput on the same failures in
one measure, from 32 GPUs to 100k; from the sweep (quality, trained on the CPU at n = 32) and the throughput
simulation (the paper's three jobs) to results/goodput/goodput-<profile>.json, which paper_figures.goodput
renders.

    python -m experiments.goodput [--quick]      (after python -m experiments.goodput_runs, which trains its runs)

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
run's quality is 1/G times the failure-free time. The quality is measured on our CPU model, the throughput
simulated for the paper's jobs: the combination assumes that q at a failed fraction carries over from the small
model to the paper's. q is read at each job's own fraction: the sweep's runs at the level for every policy, and
for drop on TRANSFER_JOB (where a failed GPU takes its replica's samples) q read at the share of samples it loses
there, between drop's runs: the level's and those experiments.goodput_runs trained near that share (transfer_spec; drop_at); what
carrying the level's q per token or per step over would give instead is reported beside it (drop_readings). q's intervals use the seed-to-seed noise pooled over every trained
cell (pooled_noise, Table 3's model); the null control (goodput_runs.NULL_CONTROL, exact, trained at high) must give q = 1
within its interval. G under every reading of the throughput, the paired comparisons and the verdict:
experiments.goodput_envelope.

Scale. The simulator's scaling experiment (llama-7b, 4 stages, 32 to 100k GPUs at Llama 3's rate) gives the
throughput kept, put on each scaling job's own failure-free overhead (experiments.goodput_sim); q there is
interpolated per seed in the run's failed fraction between failure-free (q = 1) and the levels measured, held
(and flagged) beyond the largest. The leader map does the same over goodput_sim's grid.
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np

from mecefo import failures, policies
from mecefo.errors import UsageError, guarded
from mecefo.records import atomic_write_json, git_commit
from mecefo.results import RESULTS, measurement, profile, quick_flag, read_measurement
from mecefo.simulator import ci95
from mecefo.stats import block_noise, interval_half_width

from . import goodput_envelope as envelope_mod
from . import goodput_sim
from . import sweep
from . import goodput_runs
from .goodput_runs import LEVELS, REFERENCE, TRANSFER_JOB, lost_by_drop, transfer_spec
from .throughput import PAPER_JOBS

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


def run_quality(summary: dict, curve: dict) -> dict:
    """One run against its seed's failure-free curve: S*/S, q per trained token, its failed fraction, and whether
    S* lies outside the lengths trained."""
    s_star = equivalent_steps(curve, summary["final_val_loss"])
    own = equivalent_steps(curve, curve["full_loss"])  # the seed's failure-free run of the same length
    return {"steps_fraction": s_star / own, "q": s_star / own * summary["tokens_seen"] / summary["tokens_trained"],
            "failed_fraction": summary["failure_schedule"]["fraction_failed"],
            "extrapolated": not min(curve["lengths"]) <= s_star <= max(curve["lengths"])}


def quality_of_runs(entries: list[dict], curves: dict[int, dict]) -> dict:
    """Per policy and level of the entries (policy, level, seed, run): S*/S and q (per seed, mean, 95% interval
    over seeds), the mean failed fraction, whether any S* was extrapolated."""
    per: dict = {}
    for e in entries:
        if e["seed"] not in curves:
            raise UsageError(f"seed {e['seed']} of {e['policy']} at {e['level']} has no failure-free runs; "
                             "rerun python -m experiments.goodput_runs for this profile")
        one = run_quality(json.loads((RESULTS / e["run"] / "summary.json").read_text()), curves[e["seed"]])
        g = per.setdefault((e["policy"], e["level"]), {"seeds": [], "steps_fraction": [], "q": [], "failed_fraction": [],
                                                       "extrapolated": False})
        g["seeds"].append(e["seed"])
        for k in ("steps_fraction", "q", "failed_fraction"):
            g[k].append(one[k])
        g["extrapolated"] |= one["extrapolated"]
    out: dict = {}
    for (policy, level), g in sorted(per.items()):
        out.setdefault(policy, {})[level] = {
            "seeds": g["seeds"], "steps_fraction": interval(g["steps_fraction"]), "q": interval(g["q"]),
            "failed_fraction": float(np.mean(g["failed_fraction"])), "extrapolated": g["extrapolated"]}
    return out


def quality(index: dict, curves: dict[int, dict]) -> dict:
    """quality_of_runs over the sweep's main cells at its n (Table 1's levels)."""
    n = index["design"]["n"]
    return quality_of_runs([c for c in index["cells"] if c["tag"] == "main" and c["n"] == n and c["level"] in LEVELS
                            and "error" not in c], curves)


def pooled_noise(cohorts: dict[str, dict]):
    """The seed-to-seed noise of q, pooled over every trained (cohort, policy, level) as Table 3 pools
    perplexities (mecefo.stats.block_noise: a seed is a block; y = 100 ln q); None without residual df."""
    runs = [((cohort, p, lv), seed, q) for cohort, measured in cohorts.items() for p, levels in measured.items()
            for lv, m in levels.items() for seed, q in zip(m["seeds"], m["q"]["values"])]
    try:
        return block_noise(runs)
    except ValueError:
        return None


def pooled_interval(m: dict, noise, factor: float = 1.0) -> dict:
    """q's geometric mean over seeds and its 95% interval with the pooled noise (unbounded without it): 100 ln q is a
    paired difference (a run against its seed's failure-free run), of variance sd^2 per seed (times `factor` for an
    interpolated q)."""
    logs = 100 * np.log(m["q"]["values"])
    if noise is None:
        return {"mean": float(np.exp(logs.mean() / 100)), "ci95": [-math.inf, math.inf]}
    half = math.sqrt(factor) * interval_half_width(noise.sd, len(logs), df=noise.df)
    return {"mean": float(np.exp(logs.mean() / 100)), "ci95": [float(np.exp((logs.mean() - half) / 100)),
                                                              float(np.exp((logs.mean() + half) / 100))]}


def steps_kept(throughput: dict, level: str, job: str = TRANSFER_JOB) -> float:
    """The share of the failure-free step rate drop keeps on `job` at `level` (the time not paused nor lost)."""
    row = throughput["table2"][job]

    def stepping(lv: str) -> float:
        b = row[lv]["drop"]["breakdown_share"]
        return 1 - b["pause"] - b["lost_work"]

    return stepping(level) / stepping("none")


def samples_lost(throughput: dict, level: str, job: str = TRANSFER_JOB) -> float:
    """The share of samples drop loses on `job` at `level` while it steps (1 - kept / steps_kept: its pauses are not
    lost samples)."""
    row = throughput["table2"][job]
    return 1 - row[level]["drop"]["mean"] / row["none"][REFERENCE]["mean"] / steps_kept(throughput, level, job)


def log_q_of(m: dict) -> dict:
    """seed -> 100 ln q of a measured cell."""
    return {s: float(100 * math.log(v)) for s, v in zip(m["seeds"], m["q"]["values"])}


def warm_share(cfg) -> float:
    """The share of a CPU run after its failure-free warm start (where its failures are)."""
    return (cfg.train.steps - cfg.cluster.failure_free_steps) / cfg.train.steps


def drop_at(level: str, x: float, measured: dict, transfer: dict, noise) -> dict:
    """drop's q on TRANSFER_JOB at `level`: interpolated at x (the CPU runs' scale: its samples lost x the share of a
    run after the warm start) between drop's runs, the level's and those trained near 7B's lost fractions."""
    log_q, held, factor = envelope_mod.interp_log_q(q_points("drop", measured, transfer), x)
    q = pooled_interval({"q": {"values": [math.exp(v / 100) for v in log_q.values()]}}, noise, factor)
    return q | {"by": "measured near the job's lost fraction (interpolated)", "log_q": log_q, "q_var": factor,
                "x": x, "clamped": held}


def quality_of(policy: str, level: str, measured: dict, model: str | None = None, transfer: dict | None = None,
               read_at: dict | None = None, noise=None) -> dict | None:
    """q for a registry policy at a level of a job: 1 for an exact one (by construction); for drop on TRANSFER_JOB,
    with `read_at` (level -> x), drop_at; else the sweep's runs at the level; None where none was made. Its
    interval is the pooled one where the measurement has it."""
    if policies.get(policy).exact:
        return {"mean": 1.0, "ci95": [1.0, 1.0], "by": "construction (exact policy)"}
    if policy == "drop" and model == TRANSFER_JOB and transfer and read_at:
        return drop_at(level, read_at[level], measured, transfer, noise)
    m = measured.get(policy, {}).get(level)
    if m is None:
        return None
    q = m.get("q_pooled", m["q"])
    return {"mean": q["mean"], "ci95": q["ci95"], "by": "measured",
            "log_q": log_q_of(m)}


def effective(throughput: dict, measured: dict, transfer: dict | None = None, read_at: dict | None = None, noise=None) -> dict:
    """Per job, level and registry policy under the simulated reading: throughput kept, q, G, time to quality."""
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
                q = quality_of(policy, level, measured, model, transfer, read_at, noise)
                cell = {"tok_s": row[level][policy]["mean"], "kept": kept, "kept_ci95": kept_ci, "q": q}
                if q is not None:
                    cell |= {"goodput": kept * q["mean"], "goodput_q_range": [kept * c for c in q["ci95"]],
                             "goodput_range": [kept_ci[0] * q["ci95"][0], kept_ci[1] * q["ci95"][1]],
                             "effective_tok_s": row[level][policy]["mean"] * q["mean"],
                             "time_to_quality": 1 / (kept * q["mean"])}
                cells[policy] = cell
            out[model]["levels"][level] = cells
    return out


def envelope(throughput: dict, sim: dict, measured: dict, transfer: dict, noise, warm: float, read_at: dict) -> dict:
    """Per job and level: every reading's throughput kept (goodput_envelope.kept_readings), its compare() of the
    policies whose q is known, and the verdict over the readings. Under `spares` a failed GPU's place is empty for
    a spare's wait only, so q is read at that reading's far smaller failed fraction (scale_cells; `warm`: the share
    of a CPU run after its warm start); under the others at the level's."""
    from .hypotheses import paper_drop_of

    paper = {m: {"high": {p: paper_drop_of(m, system) for p, system in envelope_mod.PAPER_SYSTEMS.items()}} for m in PAPER_JOBS}
    out = {}
    for model in throughput["table2"]:
        out[model] = {}
        for level in LEVELS:
            readings = envelope_mod.kept_readings(throughput, sim, model, level, paper)
            q = {p: quality_of(p, level, measured, model, transfer, read_at, noise) for p in readings["simulated"]}
            known = [p for p in q if q[p] is not None]
            by = {r: envelope_mod.compare({p: kept[p] | {"log_q": q[p].get("log_q"), "q_var": q[p].get("q_var", 1.0)}
                                           for p in known if p in kept}, noise)
                  for r, kept in readings.items() if r != "spares"}
            f_spares = goodput_sim.with_spares(level, PAPER_JOBS[model]).expected_failed_fraction()
            cells, clamped = scale_cells(readings["spares"], f_spares, warm, measured, transfer if model == TRANSFER_JOB else {},
                                         PAPER_JOBS[model].pp)
            by["spares"] = envelope_mod.compare(cells, noise)
            by = {r: by[r] for r in readings}  # in READINGS' order
            out[model][level] = {"readings": readings, "by_reading": by, "verdict": envelope_mod.verdict(by),
                                 "not_measured": [p for p in q if q[p] is None], "spares_clamped": clamped,
                                 "clamped": [p for p in q if q[p] is not None and q[p].get("clamped")]}
    return out


def q_points(policy: str, measured: dict, transfer: dict) -> list[tuple[float, dict]]:
    """(the runs' failed fraction, seed -> 100 ln q) of every level a policy was trained at (drop: also its runs
    at TRANSFER_JOB's lost fractions)."""
    sources = [measured.get(policy, {})] + ([transfer.get(policy, {})] if policy == "drop" else [])
    return [(m["failed_fraction"], log_q_of(m)) for src in sources for m in src.values()]


def scale_cells(kept: dict, gpu_fraction: float, warm: float, measured: dict, transfer: dict, pp: int) -> tuple[dict, dict]:
    """Cells for compare() from kept (policy -> {"kept", "se"}) where the failed fraction of GPUs is gpu_fraction
    (steady state): q interpolated at the CPU runs' scale (the steady fraction x `warm`, the share of the run after
    its warm start; for drop the share of samples it loses, that of replicas with a failed GPU among their pp
    stages, 1 - (1 - f)^pp), and which policies' q was held beyond the largest measured fraction."""
    cells, clamped = {}, {}
    for p, k in kept.items():
        if policies.get(p).exact:
            cells[p] = {"kept": k["kept"], "se": k["se"], "log_q": None}
            continue
        points = q_points(p, measured, transfer)
        if not points:
            continue
        x = warm * ((1 - (1 - gpu_fraction) ** pp) if p == "drop" else gpu_fraction)
        log_q, held, factor = envelope_mod.interp_log_q(points, x)
        cells[p] = {"kept": k["kept"], "se": k["se"], "log_q": log_q, "q_var": factor, "x": x}
        if held:
            clamped[p] = max(pt[0] for pt in points)
    return cells, clamped


def kept_cell(mean: float, ci95: list[float], seeds: int | None = None) -> dict:
    """A simulated throughput kept as scale_cells takes it: mean and standard error in log points."""
    return {"kept": mean, "se": envelope_mod._se({"mean": mean, "ci95": ci95, "seeds": seeds}, 1.0)}


def spares_held(policy: str, f: float) -> float:
    """GPUs provisioned per job GPU: 1 + f for a policy that holds spares (checkpoint-restart: f of the job's GPUs
    down on average, Little's law), else 1; at scale and on the map G is per provisioned GPU."""
    return 1 + f if policy in envelope_mod.SPARES else 1.0


def at_scale(throughput: dict, measured: dict, base_cfg, own: dict, noise, transfer: dict | None = None) -> dict:
    """G from 32 to 100k GPUs at the scaling experiment's rate: its throughput kept, put on the failure-free job's
    (REFERENCE's) throughput with each policy's failure-free overhead in that scaling job (`own`: size -> policy ->
    failure-free tok/s; Bamboo's redundancy differs with the job's micro-batches), x q interpolated in the failed
    fraction; compare() per size."""
    sc = throughput["scaling"]["scenario"]
    scenario = failures.FailureScenario(sc["name"], sc["interval_h"], sc["recovery_h"])
    warm = warm_share(base_cfg)
    sizes = {}
    for gpus, cells in throughput["scaling"]["results"].items():
        ff = own[gpus]
        f = scenario.expected_failed_fraction()
        kept = {p: kept_cell(c["retained"] * ff[p] / ff[REFERENCE] / spares_held(p, f),
                             [x * ff[p] / ff[REFERENCE] / spares_held(p, f) for x in c["ci95"]])
                for p, c in cells.items() if p in policies.simulator_policies() and p in ff}
        compared, clamped = scale_cells(kept, scenario.expected_failed_fraction(), warm, measured, transfer or {},
                                        PAPER_JOBS[TRANSFER_JOB].pp)
        shown = {p: {"kept": k["kept"], "failure_free_kept": ff[p] / ff[REFERENCE]} | (
            {"goodput": envelope_mod.goodput_of(compared[p])} if p in compared else {}) for p, k in kept.items()}
        sizes[gpus] = {"policies": shown, "leaders": envelope_mod.compare(compared, noise), "clamped": clamped}
    gaps = [abs(1 - c["goodput"] / c["kept"]) for s in sizes.values() for c in s["policies"].values() if "goodput" in c]
    return {"scenario": sc, "run_failed_fraction": scenario.expected_failed_fraction() * warm, "sizes": sizes,
            "max_q_gap": max(gaps, default=0.0)}


def leader_map(sim: dict, measured: dict, base_cfg, noise, transfer: dict) -> list[dict]:
    """Per point of goodput_sim's map (GPUs x GPU MTBF x recovery): compare() of every policy whose q is known
    (simulated reading); `group`: the best and every policy not separable from it (within noise or the tolerance),
    `next`: the best policy outside it and the paired margin over it; policies whose q was held beyond the measured
    fractions."""
    warm = warm_share(base_cfg)
    out = []
    for pt in sim["map"]:
        f = pt["failed_fraction"]
        kept = {p: kept_cell(v["mean"] / spares_held(p, f), [c / spares_held(p, f) for c in v["ci95"]], sim["map_grid"]["seeds"])
                for p, v in pt["kept"].items() if p in policies.simulator_policies()}
        cells, clamped = scale_cells(kept, pt["failed_fraction"], warm, measured, transfer, PAPER_JOBS[TRANSFER_JOB].pp)
        c = envelope_mod.compare(cells, noise)
        group = [p for p in c["goodput"] if p == c["best"] or p in c["tied"] or p in c["equal"]]  # not separable from the best
        after = next((p for p in c["goodput"] if p not in group), None)
        out.append({k: pt[k] for k in ("gpus", "gpu_mtbf_h", "recovery_h", "failed_fraction")}
                   | {"best": c["best"], "leads": c["leads"], "tied": c["tied"], "equal": c["equal"], "goodput": c["goodput"],
                      "group": group, "next": after, "margin": c["margin"].get(after) if after else None, "clamped": clamped})
    return out


def drop_readings(throughput: dict, measured: dict, eff: dict, warm: float) -> dict:
    """Per level, drop's G on TRANSFER_JOB three ways: measured (q read at the samples it loses there, drop_at), and
    the two transfers the measurement replaces: q per trained token from the level's runs (per token), and the
    failure-free steps a step is worth from them x the share of the failure-free step rate kept (per step)."""
    lost = lost_by_drop(throughput)
    out = {}
    for lv in LEVELS:
        cell, m = eff[TRANSFER_JOB]["levels"][lv]["drop"], measured.get("drop", {}).get(lv)
        q = cell["q"]
        out[lv] = {"lost_simulated": lost[lv], "samples_lost": samples_lost(throughput, lv), "spec": transfer_spec(lv, lost[lv]),
                   "kept": cell["kept"], "steps_kept": steps_kept(throughput, lv), "read_at": warm * samples_lost(throughput, lv),
                   "measured": None if q is None else cell["goodput"], "q": q,
                   "measured_range": None if q is None else cell["goodput_q_range"],
                   "per_token": None if m is None else cell["kept"] * m["q_pooled"]["mean"],
                   "per_step": None if m is None else steps_kept(throughput, lv) * m["steps_fraction"]["mean"]}
    return out


def main(argv: list[str] | None = None) -> int:
    quick = quick_flag(argv, __doc__)
    prof = profile(quick)
    index = json.loads((RESULTS / "sweep" / f"index-{prof}.json").read_text()) if (
        RESULTS / "sweep" / f"index-{prof}.json").exists() else None
    if index is None:
        raise UsageError(f"no results/sweep/index-{prof}.json; run python -m experiments.sweep{' --quick' if quick else ''} first")
    throughput = read_measurement("throughput", "throughput", quick, "experiments.throughput")
    sim = read_measurement("throughput", "goodput_sim", quick, "experiments.goodput_sim")
    runs = read_measurement("goodput", "runs", quick, "experiments.goodput_runs")
    if (runs["throughput_sources_digest"], runs.get("design")) != (throughput["sources_digest"], goodput_runs.design(prof)):
        raise UsageError("results/goodput/runs was trained for another throughput simulation or sweep design than the ones "
                         f"here; rerun python -m experiments.goodput_runs{' --quick' if quick else ''}")
    curves = {int(seed): fit(p) | {"points": p, "full_loss": p[-1]["val_loss"]} for seed, p in runs["curves"].items()}
    measured = quality(index, curves)
    extra = runs["extra"]
    transfer = quality_of_runs([e for e in extra if e["cohort"] == "transfer"], curves)
    null = quality_of_runs([e for e in extra if e["cohort"] == "null"], curves)
    noise = pooled_noise({"sweep": measured, "transfer": transfer})  # the null control is judged by it, not part of it
    for cohort in (measured, transfer, null):
        for levels in cohort.values():
            for m in levels.values():
                m["q_pooled"] = pooled_interval(m, noise)
    null_control = {p: {lv: m["q_pooled"] | {"holds": m["q_pooled"]["ci95"][0] <= 1 <= m["q_pooled"]["ci95"][1],
                                             "seeds": m["seeds"], "steps_fraction": m["steps_fraction"],
                                             "failed_fraction": m["failed_fraction"]}
                        for lv, m in levels.items()} for p, levels in null.items()}
    d = sweep.DESIGNS[prof]
    base_cfg = sweep.cell_config(d.base, sweep.Cell(d.n, "none", "none", 0))
    warm = warm_share(base_cfg)
    read_at = {lv: warm * samples_lost(throughput, lv) for lv in LEVELS}  # drop on TRANSFER_JOB, at the CPU runs' scale
    eff = effective(throughput, measured, transfer, read_at, noise)
    compared = {lv: {"cpu_failed_fraction": float(np.mean([measured[p][lv]["failed_fraction"] for p in measured if lv in measured[p]])),
                     "simulated_failed_fraction": failures.SCENARIOS[lv].expected_failed_fraction(),
                     "drop_samples_lost_cpu": 1 - measured["drop"][lv]["steps_fraction"]["mean"] / measured["drop"][lv]["q"]["mean"]
                     if lv in measured.get("drop", {}) else None,
                     "drop_samples_lost_7b": lost_by_drop(throughput)[lv]}
                for lv in LEVELS}
    result = {"profile": prof, "n": d.n, "curves": {str(k): v for k, v in curves.items()}, "quality": measured,
              "transfer": transfer, "transfer_runs": extra, "null_control": null_control,
              "noise": None if noise is None else {"sd": noise.sd, "df": noise.df, "runs": noise.runs},
              "comparability": compared, "drop_readings": drop_readings(throughput, measured, eff, warm), "warm_share": warm,
              "effective": eff, "envelope": envelope(throughput, sim, measured, transfer, noise, warm, read_at),
              "scale": at_scale(throughput, measured, base_cfg, sim["own_failure_free"], noise, transfer),
              "map": leader_map(sim, measured, base_cfg, noise, transfer), "map_grid": sim["map_grid"],
              "throughput_sources_digest": throughput["sources_digest"], "goodput_sim_digest": sim["sources_digest"],
              "levels": list(LEVELS), "readings": list(envelope_mod.READINGS), "tolerance": envelope_mod.TOLERANCE,
              "sweep_git_commit": index["git_commit"], "runs_git_commit": runs["git_commit"], "git_commit": git_commit()}
    path = measurement("goodput", "goodput", quick)
    atomic_write_json(path, result)
    for model, levels in result["envelope"].items():
        print(model + ": " + "; ".join(f"{lv} " + (f"{e['verdict']['leader']} leads under every reading" if e["verdict"]["leader"]
                                                   else " | ".join(f"{o} ({', '.join(r)})" for o, r in e["verdict"]["outcomes"].items()))
                                       for lv, e in levels.items()))
    for p, levels in null_control.items():
        print(f"null control {p}: " + ", ".join(f"{lv} q {v['mean']:.4f} [{v['ci95'][0]:.4f}, {v['ci95'][1]:.4f}] "
                                                f"{'holds' if v['holds'] else 'FAILS'}" for lv, v in levels.items()))
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

"""Simulated cluster throughput under failures (mecefo.simulator): the paper's Table 2 analog on 32 A100s,
sensitivity to what the paper leaves unknown, and retained throughput from 32 to 100k GPUs.

    python -m experiments.throughput [--quick]

Writes results/throughput/throughput-<profile>.json and every generated failure trace (the `t_ms,add|remove,nodeN`
CSV format) under results/throughput/traces/.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from mecefo.failures import SCENARIOS, FailureScenario, Schedule, export_trace
from mecefo.records import atomic_write_json, git_commit, stable_hash
from mecefo.policies import simulator_policies
from mecefo.results import measurement, neighbour_bench, reusable, sources_digest, quick_flag
from mecefo.simulator import CostModel, Job, ci95, mtbf, scenario_failures, simulate

from .common import RESULTS, guarded

HORIZON_S = 24 * 3600.0
# The paper's models on 32 A100s (4 nodes x 8). Layout and micro-batch are unknown; 350M and 1B fit a GPU
# each (pure data parallelism), 7B is split into 4 pipeline stages (8 replicas). Global batch: the paper's,
# read as sequences of 256 tokens.
PAPER_JOBS = {
    "llama-350m": Job(model="llama-350m", dp=32, pp=1, micro_batch=16, global_batch=8192),
    "llama-1b": Job(model="llama-1b", dp=32, pp=1, micro_batch=8, global_batch=4096),
    "llama-7b": Job(model="llama-7b", dp=8, pp=4, micro_batch=2, global_batch=1024),
}
# LLaMA-3 405B: about one failure every 3 hours on 16,384 GPUs; as a Table-1-style scenario on 32 GPUs.
LLAMA3 = FailureScenario("llama3-rate", interval_h=3 * 16384 / 32, recovery_h=3.0)


# Readings of a baseline that its public code allows, simulated beside the registry's policies:
# label -> (policy, Job fields).
VARIANTS = {"oobleck (rejoin at next failure)": ("oobleck", {"oobleck_rejoin": "next_failure"})}


FITTED = "bamboo (reconfiguration fitted on 7B)"
TIMED = "mecefo (c by time)"
def time_readings(path: Path | None = None) -> dict:
    """model -> the MeCeFO techniques' time / FLOP quotient that experiments.bench_neighbour measured at the model's
    layer shape (its full profile's where it has run, else its default's: mecefo.results.neighbour_bench; {} where
    neither has), with the commit that measured it."""
    path = path or neighbour_bench(quick=False)
    if not path.exists():
        return {}
    import json

    bench = json.loads(path.read_text())
    return {s["preset"]: {"time_over_flop": s["sets"]["mecefo"]["time_over_flop"], "git_commit": bench["git_commit"]}
            for s in bench["shapes"] if s["preset"] in PAPER_JOBS}


def timed(job: Job, reading: dict) -> Job:
    """The job with the neighbour's micro-batch and apply times scaled from their FLOPs by the measured quotient
    (Job.neighbour_time_scale): the reading of Table 2 whose c is the neighbour's measured time, not its FLOP count."""
    return replace(job, neighbour_time_scale=reading["time_over_flop"])


def drops(job: Job, policy: str, seeds: int, horizon_s: float = HORIZON_S, start: str = "stationary",
          recovery: str = "fixed", scenario: FailureScenario = SCENARIOS["high"]) -> list[float]:
    """1 - throughput under `scenario` / failure-free throughput, one value per seed (seeds 0.., the same for
    every job and policy: common random numbers)."""
    base = simulate(job, policy, [], horizon_s).throughput
    out = []
    for seed in range(seeds):
        events, down = scenario_failures(scenario, job, horizon_s, seed, start, recovery)
        out.append(1 - simulate(job, policy, events, horizon_s, mtbf(scenario, job.gpus), down).throughput / base)
    return out


def fit_bamboo_reconfig(seeds: int, target_pct: float) -> float | None:
    """The one constant we fit: a factor k on Bamboo's reconfiguration times (simulator_constants.json) such
    that the 7B high-failure drop equals the paper's Bamboo column (bisection on the mean over seeds; the
    drop grows with k); 350M and 1B are then predicted with the same k. None if k = 0 is already above."""
    job = PAPER_JOBS["llama-7b"]

    def drop_pct(k: float) -> float:
        return 100 * float(np.mean(drops(replace(job, bamboo_reconfig_s=k * job.const("bamboo_reconfig_s")), "bamboo", seeds)))

    lo, hi = 0.0, 4.0
    if drop_pct(lo) > target_pct or drop_pct(hi) < target_pct:
        return None
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if drop_pct(mid) < target_pct else (lo, mid)
    return (lo + hi) / 2


def run_cell(job: Job, scenario: FailureScenario, seeds: int, policies=None, trace_dir=None,
             tuned_for: FailureScenario | None = None, start: str = "stationary", variants=None) -> dict:
    """Throughput (mean and 95% interval over seeds) and the mean time breakdown for each policy (and
    VARIANTS, when `policies` is None, and `variants`), over Table 1's process from a stationary start. Checkpoint-restart
    checkpoints at the Young/Daly interval of `tuned_for` (default: the scenario itself; none without failures)."""
    runs = {p: (p, {}) for p in (policies or simulator_policies())} | ({} if policies else VARIANTS) | (variants or {})
    interval_mtbf = mtbf(tuned_for or scenario, job.gpus)
    out = {label: {"throughput": [], "breakdown": []} for label in runs}
    for seed in range(seeds):
        events, down = scenario_failures(scenario, job, HORIZON_S, seed, start)
        if trace_dir is not None and events:
            path = trace_dir / f"{scenario.name}-{job.gpus}gpus-seed{seed}.csv"
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                export_trace(Schedule(job.gpus, (), tuple(events), 1.0, down), path)
        for label, (policy, fields) in runs.items():
            o = simulate(replace(job, **fields), policy, events, HORIZON_S, interval_mtbf, down)
            out[label]["throughput"].append(o.throughput)
            out[label]["breakdown"].append({k: v / o.wall_s for k, v in o.breakdown.items()})
    return {p: {"mean": ci95(v["throughput"])[0], "ci95": list(ci95(v["throughput"])[1:]), "seeds": seeds,
                "breakdown_share": {k: float(np.mean([b[k] for b in v["breakdown"]])) for k in v["breakdown"][0]}}
            for p, v in out.items()}


def table2(seeds: int, trace_dir, readings: dict | None = None) -> tuple[dict, dict]:
    """Per model and failure level, every policy's throughput; and the Bamboo fit (fit_bamboo_reconfig). readings
    (time_readings): where a model's layer shape was measured, MeCeFO again as TIMED, its c by time."""
    from mecefo.results import paper_numbers

    paper_bamboo = paper_numbers()["table2_throughput_tokens_per_s"]["rows"]["llama-7b"]["Bamboo"][2]
    k = fit_bamboo_reconfig(seeds, paper_bamboo)
    fit = {"factor": k, "fitted_on": "llama-7b", "target_pct": paper_bamboo, "label": FITTED}
    rows = {}
    for name, job in PAPER_JOBS.items():
        cost = CostModel(job)
        fitted = {} if k is None else {FITTED: ("bamboo", {"bamboo_reconfig_s": k * job.const("bamboo_reconfig_s")})}
        rows[name] = {"job": asdict(job), "cost": {"alpha_1": cost.alpha(1), "c": cost.relative_cost,
                                                   "step_s": sum(cost.base.values())}}
        if name in (readings or {}):
            q, slow = readings[name], CostModel(timed(job, readings[name]))
            fitted[TIMED] = ("mecefo", {"neighbour_time_scale": q["time_over_flop"]})
            rows[name]["cost"] |= {"c_time": slow.relative_cost, "time_over_flop": q["time_over_flop"],
                                   "alpha_1_time": slow.alpha(1), "measured_by": q["git_commit"]}
        for level in ("none", "low", "mid", "high"):
            rows[name][level] = run_cell(job, SCENARIOS[level], 1 if level == "none" else seeds, trace_dir=trace_dir,
                                         variants=fitted)
    return rows, fit


def sensitivity(seeds: int) -> list[dict]:
    """MeCeFO's (and drop's) high-failure drop on 7B as one unknown at a time moves."""
    base = PAPER_JOBS["llama-7b"]
    variants = [("baseline", base, "fixed")]
    variants += [(f"mfu={m}", replace(base, mfu=m), "fixed") for m in (0.3, 0.6)]
    variants += [(f"overlap={o}", replace(base, overlap=o), "fixed") for o in (0.0, 0.9)]
    variants += [(f"layout dp{d}xpp{p}", replace(base, dp=d, pp=p, micro_batch=mb), "fixed")
                 for d, p, mb in ((32, 1, 2), (4, 8, 2), (16, 2, 2))]
    variants += [("exponential recovery", base, "exponential")]
    policies = ("mecefo", "spread-mecefo", "drop", "oobleck")
    return [{"variant": label, "alpha_1": CostModel(job).alpha(1),
             **{f"{p}_drop_pct": 100 * float(np.mean(drops(job, p, seeds, recovery=recovery))) for p in policies}}
            for label, job, recovery in variants]


def active_fraction(seeds: int) -> float:
    """Share of time with at least one failed GPU under Table 1's high scenario on 32 GPUs (stationary)."""
    shares = []
    for seed in range(seeds):
        events, start_down = scenario_failures(SCENARIOS["high"], PAPER_JOBS["llama-7b"], HORIZON_S, seed)
        down, t_last, active = set(start_down), 0.0, 0.0
        for e in sorted(events, key=lambda e: e.time_s):
            if e.time_s > HORIZON_S:
                break
            active += (e.time_s - t_last) if down else 0.0
            t_last = e.time_s
            (down.add if e.kind == "remove" else down.discard)(e.rank)
        active += (HORIZON_S - t_last) if down else 0.0
        shares.append(active / HORIZON_S)
    return float(np.mean(shares))


def scaling(seeds: int, sizes) -> dict:
    out = {}
    for gpus in sizes:
        dp = gpus // 4
        job = replace(PAPER_JOBS["llama-7b"], dp=dp, global_batch=dp * 2 * 16)  # weak scaling: 16 micro-batches per replica
        res = run_cell(job, LLAMA3, seeds, simulator_policies())
        base = run_cell(job, SCENARIOS["none"], 1, simulator_policies())
        out[str(gpus)] = {p: {"retained": res[p]["mean"] / base[p]["mean"],
                              "ci95": [c / base[p]["mean"] for c in res[p]["ci95"]]} for p in res}
    return out


def main(argv: list[str] | None = None) -> int:
    quick = quick_flag(argv, __doc__)
    path = measurement("throughput", "throughput", quick)
    readings = time_readings()
    digest = sources_digest() + ("" if not readings else "+" + stable_hash(readings))  # (a new measurement: a new run)
    if reusable(path, digest):
        print(f"reusing {path}")
        return 0
    seeds = 5 if quick else 100
    sizes = (32, 512, 8192, 100_000) if quick else (32, 128, 512, 2048, 8192, 32768, 100_000)
    steps = tqdm(total=4, desc="throughput", disable=not sys.stderr.isatty())
    result = {"horizon_s": HORIZON_S, "seeds": seeds, "git_commit": git_commit(), "sources_digest": digest}
    result["table2"], result["bamboo_fit"] = table2(seeds, RESULTS / "throughput" / "traces", readings)
    steps.update(1)
    result["sensitivity"] = sensitivity(max(3, seeds // 3))
    steps.update(1)
    result["active_fraction_high_32"] = active_fraction(seeds)
    steps.update(1)
    result["scaling"] = {"scenario": asdict(LLAMA3), "sizes": list(sizes), "results": scaling(max(3, seeds // 3), sizes)}
    steps.update(1)
    atomic_write_json(path, result)
    t7 = result["table2"]["llama-7b"]
    print(f"Bamboo reconfiguration factor fitted on 7B: {result['bamboo_fit']['factor']}")
    for p in t7["high"]:
        print(f"7B {p:18s} none {t7['none'][p]['mean']:10.0f} tok/s  high {t7['high'][p]['mean']:10.0f} "
              f"({100 * (1 - t7['high'][p]['mean'] / t7['none'][p]['mean']):.2f}% drop)")
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

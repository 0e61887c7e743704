"""The runs goodput is measured from, trained (or reused) beside the sweep's: failure-free runs of other lengths (the
loss-against-length curve that turns a final loss into quality-equivalent steps), drop at the share of samples it
loses on TRANSFER_JOB at each level (from the throughput simulation), and the null control (an exact policy at
high). Writes their index to results/goodput/runs-<profile>.json; experiments.goodput decides from it.

    python -m experiments.goodput_runs [--quick]

Every run is a sweep cell's config (experiments.sweep.cell_config) in results/goodput/<preset>-<config hash>/, reused
on rerun. Needs the sweep's index (its failure-free runs are the curves' longest points) and experiments.throughput.
"""

from __future__ import annotations

import json
import sys

from mecefo import config as config_mod
from mecefo import failures
from mecefo.errors import UsageError, guarded
from mecefo.records import atomic_write_json, git_commit
from mecefo.results import RESULTS, measurement, profile, quick_flag, read_measurement, run_dir, sweep_index
from mecefo.train import run

from . import sweep
from .common import default_jobs, in_order
from .goodput_envelope import LEVELS, REFERENCE

LENGTHS = {"quick": (30, 40, 50), "default": (200, 240, 270)}  # besides the sweep's own length (60, 300)
NULL_CONTROL = "spread"  # exact: trained through the same pipeline, its q must be 1 within its interval
TRANSFER_JOB = "llama-7b"  # the job whose failed GPU takes its replica's samples under drop (4 pipeline stages)


def transfer_spec(level: str, target: float) -> str:
    """The failure scenario at which drop on the CPU model loses a fraction `target` of its samples, as it does on
    TRANSFER_JOB at `level`: Table 1's recovery time at that level, arrivals frequent enough that `target` of the
    ranks are down in steady state (Little's law). On 7B a failed GPU takes its replica of 4 GPUs: a replica fails
    about 4 times as often as a GPU and stays down as long, which is what the shorter interval does to a rank."""
    rec = failures.SCENARIOS[level].recovery_h
    if not 0 < round(target, 3) <= 1:
        raise ValueError(f"a lost fraction of {target} cannot be trained")
    return f"custom:{rec / (failures.REFERENCE_RANKS * round(target, 3)):.6g}:{rec:g}"  # 3 digits: a rerun of the simulation keeps the runs


def lost_by_drop(throughput: dict, job: str = TRANSFER_JOB) -> dict[str, float]:
    """Per level: the share of the job's samples drop loses in the simulation (1 - its throughput kept)."""
    row = throughput["table2"][job]
    return {lv: 1 - row[lv]["drop"]["mean"] / row["none"][REFERENCE]["mean"] for lv in LEVELS}


def extra_cells(prof: str, throughput: dict) -> list[tuple[str, str, "sweep.Cell"]]:
    """(cohort, level, cell) of the runs trained for goodput beside the sweep's: drop near TRANSFER_JOB's lost
    fraction of each level ("transfer"; the sweep's seeds, its high-level seeds at high), and the null control
    (NULL_CONTROL at high, the high-level seeds)."""
    d = sweep.DESIGNS[prof]
    out = [("transfer", lv, sweep.Cell(d.n, transfer_spec(lv, target), "drop", s, tag="transfer"))
           for lv, target in lost_by_drop(throughput).items() for s in range(d.high_seeds if lv == "high" else d.seeds)]
    return out + [("null", "high", sweep.Cell(d.n, "high", NULL_CONTROL, s, tag="null")) for s in range(d.high_seeds)]


def _train(job: tuple) -> dict:
    """One run (or its cached summary): job = (config, folder); top-level, for in_parallel's processes. A cell
    continues from its seed's warm start where the sweep trained one (equal to training it from step 0)."""
    cfg, path = job
    return run(cfg, path, quiet=True, warm_start=sweep.trained_warm_start(cfg))


def train_extra(prof: str, throughput: dict) -> list[dict]:
    """Train (or reuse) extra_cells: one entry per run, as the sweep's index lists its cells."""
    todo = extra_cells(prof, throughput)
    jobs = []
    for _, _, cell in todo:
        cfg = sweep.cell_config(sweep.DESIGNS[prof].base, cell)
        jobs.append((cfg, run_dir("goodput", cfg)))
    in_order(_train, jobs, default_jobs(1), "goodput's own runs")
    return [{"cohort": cohort, "level": level, "policy": cell.policy, "seed": cell.seed, "failures": cell.level,
             "run": str(path.relative_to(RESULTS))} for (cohort, level, cell), (_, path) in zip(todo, jobs)]


def failure_free_curves(prof: str) -> dict[int, list[dict]]:
    """Per seed of the sweep's failure-free cells: (steps, final validation loss) of failure-free runs of
    every length (trained here, or reused; the sweep's own length is its run)."""
    d = sweep.DESIGNS[prof]
    seeds, jobs = [], []  # the sweep's own run of each seed (cached there), then the other lengths
    for seed in range(d.high_seeds):
        full = sweep.cell_config(d.base, sweep.Cell(d.n, "none", "none", seed))
        seeds.append(seed)
        jobs.append((full, run_dir("sweep", full)))
        for length in LENGTHS[prof]:
            cfg = config_mod.with_overrides(full, train={"steps": length})
            seeds.append(seed)
            jobs.append((cfg, run_dir("goodput", cfg)))
    curves: dict[int, list[dict]] = {seed: [] for seed in range(d.high_seeds)}
    for seed, (cfg, out), summary in zip(seeds, jobs, in_order(_train, jobs, default_jobs(1), "failure-free runs of other lengths")):
        curves[seed].append({"steps": cfg.train.steps, "run": str(out.relative_to(RESULTS)),
                             "val_loss": summary["final_val_loss"]})
    return {seed: sorted(points, key=lambda p: p["steps"]) for seed, points in curves.items()}


def design(prof: str) -> dict:
    """What the runs were chosen from beside the throughput simulation: the sweep's design and the lengths (as JSON
    reads them back)."""
    return json.loads(json.dumps({"sweep": sweep.DESIGNS[prof].__dict__, "lengths": LENGTHS[prof],
                                  "null_control": NULL_CONTROL, "transfer_job": TRANSFER_JOB}))


def main(argv: list[str] | None = None) -> int:
    quick = quick_flag(argv, __doc__)
    prof = profile(quick)
    if not sweep_index(quick).exists():
        raise UsageError(f"no {sweep_index(quick)}; run python -m experiments.sweep{' --quick' if quick else ''} first")
    throughput = read_measurement("throughput", "throughput", quick, "experiments.throughput")
    curves = failure_free_curves(prof)
    extra = train_extra(prof, throughput)
    path = measurement("goodput", "runs", quick)
    atomic_write_json(path, {"profile": prof, "curves": {str(seed): points for seed, points in curves.items()},
                             "extra": extra, "throughput_sources_digest": throughput["sources_digest"], "design": design(prof),
                             "git_commit": git_commit()})
    print(f"{sum(len(p) for p in curves.values())} failure-free points, {len(extra)} runs of goodput's own -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

"""The simulations the goodput envelope needs beyond Table 2's (experiments.throughput), on the same simulator:

    spares   every policy on Table 1's arrivals with each failed GPU replaced by a spare after the wait that
             checkpoint-restart already gets (replacement_delay_s + reform_s): the same spare pool for every
             policy (Table 2's reading B, for all of them)
    own      each scaling job's failure-free throughput per policy (each policy's failure-free overhead, e.g.
             Bamboo's redundant computation, at that job's own 16 micro-batches per replica)
    map      throughput kept by every policy over GPUs x mean time between failures (per GPU) x recovery time,
             the weak-scaling 7B job of the scaling experiment: where the leader changes

    python -m experiments.goodput_sim [--quick]

Writes results/throughput/goodput_sim-<profile>.json; reused while the simulator's sources are unchanged.
"""

from __future__ import annotations

import sys
from dataclasses import replace


from mecefo.failures import REFERENCE_RANKS, SCENARIOS, FailureScenario
from mecefo.policies import simulator_policies
from mecefo.records import atomic_write_json, git_commit
from mecefo.results import SIMULATOR_SOURCES, measurement, quick_flag, read_measurement, reusable, sources_digest

from .common import default_jobs, guarded, in_order
from .goodput_envelope import LEVELS
from .throughput import PAPER_JOBS, run_cell

SOURCES = SIMULATOR_SOURCES + ("experiments/goodput_sim.py",)
# the leader map's axes: GPUs, a GPU's mean time between failures (hours; Llama 3 405B: about 16,384 x 3 h), and
# the hours a failed GPU stays down (Table 1: 2-4 h)
MAP = {"quick": {"gpus": (32, 2048), "gpu_mtbf_h": (5_000.0, 50_000.0), "recovery_h": (3.0,), "seeds": 2},
       "default": {"gpus": (32, 512, 8192, 32768), "gpu_mtbf_h": (1_000.0, 5_000.0, 50_000.0), "recovery_h": (0.5, 3.0, 24.0),
                   "seeds": 2}}


def spare_s(job) -> float:
    """How long a failed GPU's place stays empty when a spare takes it: the wait for the spare and the rendezvous."""
    return job.const("replacement_delay_s") + job.const("reform_s")


def with_spares(level: str, job) -> FailureScenario:
    """Table 1's arrivals at `level`, each failure covered by a spare after spare_s(job)."""
    sc = SCENARIOS[level]
    return FailureScenario(f"{level}-spares", sc.interval_h, spare_s(job) / 3600)


def spares(seeds: int) -> dict:
    """Per paper job and level: every policy's tokens/s (mean, 95% interval) with spares for every policy."""
    out = {}
    for name, job in PAPER_JOBS.items():
        out[name] = {"spare_s": spare_s(job)}
        for level in LEVELS:
            out[name][level] = run_cell(job, with_spares(level, job), seeds, simulator_policies())
    return out


def scaling_job(gpus: int):
    """The scaling experiment's weak-scaling 7B job (experiments.throughput.scaling): 16 micro-batches per replica."""
    dp = gpus // PAPER_JOBS["llama-7b"].pp
    return replace(PAPER_JOBS["llama-7b"], dp=dp, global_batch=dp * PAPER_JOBS["llama-7b"].micro_batch * 16)


def own_failure_free(sizes) -> dict:
    """Per scaling size: every policy's failure-free tokens/s."""
    return {str(g): {p: v["mean"] for p, v in run_cell(scaling_job(g), SCENARIOS["none"], 1, simulator_policies()).items()}
            for g in sizes}


def scenario_of(gpu_mtbf_h: float, recovery_h: float) -> FailureScenario:
    """A GPU failing every gpu_mtbf_h hours, down for recovery_h, as a Table-1-style scenario (per 32 GPUs)."""
    return FailureScenario(f"mtbf{gpu_mtbf_h:g}-rec{recovery_h:g}", gpu_mtbf_h / REFERENCE_RANKS, recovery_h)


def map_point(point: tuple[int, float, float, int]) -> dict:
    """One (GPUs, GPU MTBF, recovery, seeds) point of the leader map: each policy's throughput kept against the
    job's failure-free throughput (mecefo's, which every policy without redundancy shares) and the run's failed
    fraction of GPUs."""
    gpus, m, r, seeds = point
    job, sc = scaling_job(gpus), scenario_of(m, r)
    base = run_cell(job, SCENARIOS["none"], 1, simulator_policies())["mecefo"]["mean"]
    cell = run_cell(job, sc, seeds, simulator_policies())
    return {"gpus": gpus, "gpu_mtbf_h": m, "recovery_h": r, "failed_fraction": sc.expected_failed_fraction(),
            "kept": {p: {"mean": v["mean"] / base, "ci95": [c / base for c in v["ci95"]]} for p, v in cell.items()}}


def leader_map(grid: dict, jobs: int) -> list[dict]:
    """map_point at every point of the grid, `jobs` points at a time (the simulator is one Python thread)."""
    points = [(g, m, r, grid["seeds"]) for r in grid["recovery_h"] for m in grid["gpu_mtbf_h"] for g in grid["gpus"]]
    return in_order(map_point, points, jobs, f"goodput map ({jobs} at a time)")


def main(argv: list[str] | None = None) -> int:
    quick = quick_flag(argv, __doc__)
    path = measurement("throughput", "goodput_sim", quick)
    digest = sources_digest(SOURCES)
    if reusable(path, digest):
        print(f"reusing {path}")
        return 0
    sizes = read_measurement("throughput", "throughput", quick, "experiments.throughput")["scaling"]["sizes"]
    grid = MAP["quick" if quick else "default"]
    result = {"git_commit": git_commit(), "sources_digest": digest, "seeds": 5 if quick else 30,
              "map_grid": grid}
    result["spares"] = spares(result["seeds"])
    result["own_failure_free"] = own_failure_free(sizes)
    result["map"] = leader_map(grid, default_jobs(2))
    atomic_write_json(path, result)
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

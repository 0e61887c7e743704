"""Benchmark: two independent training runs at once, one torch thread each, against one after the other with
this process's threads: which of run_all.sh's run families gain from experiments.common.in_parallel.

    python -m experiments.bench_jobs [--quick]     (--quick: fewer steps, for CI)

Each family trains two runs of its own config (short versions of what its experiment trains), twice: one after the
other, then both at once in spawned processes (the start of those processes counted). Writes
results/bench/jobs-<profile>.json: the seconds of each way and their ratio per family (above 1: at once is faster).
Measured on 2 cores, this decides experiments.common.default_jobs' `best` for each caller.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from mecefo import config as config_mod
from mecefo.records import atomic_write_json, git_commit, package_versions
from mecefo.results import measurement, quick_flag
from mecefo.train import run

from . import sweep
from .common import guarded, in_parallel, load_config


def sweep_cell(policy: str, steps: int):
    """A default sweep cell (tiny, n = 32, high failures from step 0), `steps` long, evaluated once."""
    cfg = sweep.cell_config("sweep", sweep.Cell(32, "high", policy, 0))
    return config_mod.with_overrides(cfg, train={"steps": steps, "eval_every": steps}, cluster={"failure_free_steps": 0})


def nano_run(policy: str, steps: int):
    """A nano run of the size the rate's runs train (experiments.rate_gpt: 4 ranks of 4 sequences)."""
    return load_config("nano", steps=steps, eval_every=steps, checkpoint_every=0, ranks=4, micro_batch_size=4,
                       failures="high", policy=policy, seconds_per_step=180)


FAMILIES = {"sweep cells (tiny, n = 32)": (sweep_cell, {"quick": 10, "default": 40}),  # (config, steps per profile)
            "nano runs (4 ranks)": (nano_run, {"quick": 100, "default": 400})}


def _train(job: tuple) -> float:
    cfg, out = job
    start = time.perf_counter()
    run(cfg, out, quiet=True)
    return time.perf_counter() - start


def measure(make, steps: int, root: Path) -> dict:
    jobs = [(make(p, steps), root / f"after-{p}") for p in ("mecefo", "drop")]
    start = time.perf_counter()
    for job in jobs:
        _train(job)
    after = time.perf_counter() - start
    jobs = [(cfg, root / f"together-{p}") for (cfg, _), p in zip(jobs, ("mecefo", "drop"))]
    start = time.perf_counter()
    list(in_parallel(_train, jobs, 2))
    together = time.perf_counter() - start
    return {"steps": steps, "one_after_the_other_s": after, "at_once_s": together, "speedup": after / together}


def main(argv: list[str] | None = None) -> int:
    quick = quick_flag(argv, __doc__)
    root = Path(tempfile.mkdtemp(prefix="bench_jobs-"))
    try:
        families = {}
        for i, (name, (make, steps)) in enumerate(FAMILIES.items()):
            families[name] = measure(make, steps["quick" if quick else "default"], root / str(i))
            f = families[name]
            print(f"{name}: one after the other {f['one_after_the_other_s']:.1f} s ({torch.get_num_threads()} threads), "
                  f"two at once {f['at_once_s']:.1f} s (one thread each): {f['speedup']:.2f}x", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    path = measurement("bench", "jobs", quick)
    atomic_write_json(path, {"threads": torch.get_num_threads(), "families": families, "git_commit": git_commit(),
                             "packages": package_versions()})
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

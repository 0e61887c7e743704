"""Where the seed-to-seed variance of the Table 3 analog comes from, before choosing a design that resolves it.

    python -m experiments.variance [--quick]

At the sweep's main cell (its base config, n = 8, high failures), K seeds per factor:
- training seed (initialisation and data order) varied, the failure schedule held fixed (failure_seed 100);
- failure schedule varied (failure_seed), the training seed held fixed (0);
for failure-free training (training-seed factor only: it sees no failures), MeCeFO and drop. Measured per
factor: the standard deviation over seeds of the final validation perplexity and of the paired relative
changes MeCeFO - failure-free, drop - failure-free and MeCeFO - drop (paired by training seed, and every
policy of a seed on the same schedule). Runs are cached by config hash under results/variance/.
Writes results/variance/variance-<profile>.json; python -m paper_figures.variance tabulates it.
"""

from __future__ import annotations

import sys

import numpy as np
from tqdm import tqdm

from mecefo import config as config_mod
from mecefo.records import atomic_write_json, git_commit
from mecefo.results import measurement, quick_flag
from mecefo.stats import paired_relative_change
from mecefo.train import run

from .common import guarded, run_dir
from .sweep import Cell, cell_config

FIXED_FAILURE_SEED = 100
N = 8


def config(base: str, policy: str, seed: int, failure_seed: int):
    """The sweep's cell (experiments.sweep.cell_config) with its own failure seed (failure-free: one run per seed)."""
    cfg = cell_config(base, Cell(N, "none" if policy == "none" else "high", policy, seed))
    return config_mod.with_overrides(cfg, cluster={"failure_seed": -1 if policy == "none" else failure_seed})


def main(argv: list[str] | None = None) -> int:
    quick = quick_flag(argv, __doc__)
    base, k = ("sweep-quick", 2) if quick else ("sweep", 4)
    factors = {"training seed": [(s, FIXED_FAILURE_SEED) for s in range(k)],
               "failure schedule": [(0, 200 + s) for s in range(k)]}
    plan = [(f, p, s, fs) for f, pairs in factors.items() for s, fs in pairs for p in ("none", "mecefo", "drop")]
    ppl = {}
    for f, p, s, fs in tqdm(plan, desc="variance", disable=not sys.stderr.isatty()):
        cfg = config(base, p, s, fs)
        ppl[(f, p, s, fs)] = run(cfg, run_dir("variance", cfg), quiet=True)["final_val_ppl"]  # reused when done
    out = {}
    for f, pairs in factors.items():
        get = {p: np.array([ppl[(f, p, s, fs)] for s, fs in pairs]) for p in ("none", "mecefo", "drop")}
        row = {"seeds": k, "ppl_sd": {p: float(v.std(ddof=1)) for p, v in get.items()}}
        for a, b in (("mecefo", "none"), ("drop", "none"), ("mecefo", "drop")):
            r = paired_relative_change(get[a], get[b])
            row[f"{a}-{b}"] = {"mean": r.mean, "sd": r.sd, "ci95": list(r.ci)}
        out[f] = row
    path = measurement("variance", "variance", quick)
    atomic_write_json(path, {"base_config": base, "n": N, "level": "high", "factors": out, "git_commit": git_commit()})
    for f, row in out.items():
        print(f"{f}: sd of paired change mecefo-none {row['mecefo-none']['sd']:.2f}, drop-none {row['drop-none']['sd']:.2f}, "
              f"mecefo-drop {row['mecefo-drop']['sd']:.2f} points")
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

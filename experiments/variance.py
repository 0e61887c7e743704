"""Where the seed-to-seed variance of the Table 3 analog comes from, before choosing a design that resolves it.

    python -m experiments.variance [--quick]

At the sweep's main cell (its base config and main n: 32, one rank per GPU of the paper's cluster; high
failures), K = 3 seeds per factor:
- training seed (initialisation and data order) varied, the failure schedule held fixed (failure_seed 100);
- failure schedule varied (failure_seed), the training seed held fixed (0);
- both varied, as in the sweep (its cells, reused);
- both varied, with failures from step 0 (without the base config's failure-free warm start; seconds per
  step scaled so that the failures still span the same hours);
for failure-free training (training-seed factor only: it sees no failures), MeCeFO and drop. Measured per
factor: the standard deviation over seeds of the reported perplexity (experiments.sweep.last_evaluations_ppl) and of the paired relative
changes MeCeFO - failure-free, drop - failure-free and MeCeFO - drop (paired by training seed, and every
policy of a seed on the same schedule). Runs are cached by config hash under results/sweep/ (shared with
the sweep). run_all.sh runs it in the --long and --quick profiles.
Writes results/variance/variance-<profile>.json; python -m paper_figures.variance tabulates it.
"""

from __future__ import annotations

import sys

import numpy as np
from tqdm import tqdm

from mecefo import config as config_mod
from mecefo.records import atomic_write_json, git_commit
from mecefo.results import measurement, quick_flag
from mecefo.stats import paired_relative_change, seeds_needed
from mecefo.train import run

from .common import guarded, run_dir
from .sweep import DESIGNS, Cell, cell_config, run_ppl

FIXED_FAILURE_SEED = 100
POLICIES = ("none", "mecefo", "drop")


def config(base: str, n: int, policy: str, seed: int, failure_seed: int, warm_start: bool = True):
    """The sweep's cell (experiments.sweep.cell_config) with its own failure seed (-1: the training seed), and
    without the base's failure-free warm start if not warm_start (failure-free: one run per seed)."""
    cfg = cell_config(base, Cell(n, "none" if policy == "none" else "high", policy, seed))
    if policy == "none":
        return config_mod.with_overrides(cfg, cluster={"failure_seed": -1})
    if warm_start:
        return config_mod.with_overrides(cfg, cluster={"failure_seed": failure_seed})
    cc, steps = cfg.cluster, cfg.train.steps  # the same hours of failures over all the steps
    return config_mod.with_overrides(cfg, cluster={"failure_seed": failure_seed, "failure_free_steps": 0,
                                                   "seconds_per_step": cc.seconds_per_step * (steps - cc.failure_free_steps) / steps})


def factors(k: int) -> dict[str, list[tuple[int, int, bool]]]:
    """Per factor, its k (training seed, failure seed, warm start) triples."""
    return {"training seed (schedule fixed)": [(s, FIXED_FAILURE_SEED, True) for s in range(k)],
            "failure schedule (training seed fixed)": [(0, 200 + s, True) for s in range(k)],
            "both, as the sweep": [(s, -1, True) for s in range(k)],
            "both, failures from step 0 (no warm start)": [(s, -1, False) for s in range(k)]}


def main(argv: list[str] | None = None) -> int:
    quick = quick_flag(argv, __doc__)
    design, k = (DESIGNS["quick"], 2) if quick else (DESIGNS["default"], 3)
    base, n = design.base, design.n
    plan = [(f, p, *t) for f, triples in factors(k).items() for t in triples for p in POLICIES]
    ppl = {}
    for key in tqdm(plan, desc="variance", disable=not sys.stderr.isatty()):
        cfg = config(base, n, *key[1:])
        out = run_dir("sweep", cfg)  # the sweep's folder: cells the sweep ran are reused
        run(cfg, out, quiet=True)  # reused when done
        ppl[key] = run_ppl(out)
    out = {}
    for f, triples in factors(k).items():
        get = {p: np.array([ppl[(f, p, *t)] for t in triples]) for p in POLICIES}
        row = {"seeds": k, "ppl_sd": {p: float(v.std(ddof=1)) for p, v in get.items()}}
        for a, b in (("mecefo", "none"), ("drop", "none"), ("mecefo", "drop")):
            r = paired_relative_change(get[a], get[b])
            row[f"{a}-{b}"] = {"mean": r.mean, "sd": r.sd, "ci95": list(r.ci),
                               "seeds_for_1": seeds_needed(r.sd)}  # a 95% t-interval of half-width 1 point at this sd
        out[f] = row
    path = measurement("variance", "variance", quick)
    atomic_write_json(path, {"base_config": base, "n": n, "level": "high", "factors": out, "git_commit": git_commit()})
    for f, row in out.items():
        print(f"{f}: sd of paired change mecefo-none {row['mecefo-none']['sd']:.2f}, drop-none {row['drop-none']['sd']:.2f}, "
              f"mecefo-drop {row['mecefo-drop']['sd']:.2f} points")
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

"""Assumption 3 along training (the paper's Figures 4-7 analog): at every step with an active failure, the
relative error ||g~ - g|| / ||g|| between MeCeFO's aggregated gradient g~ and the failure-free one g on the
same batches, for each failure level; the paper reports it below 0.6 throughout LLaMA-1B training.

    python -m analysis.grad_error [--quick]

Trains with `cluster.track_grad_error = true` (results/analysis/grad_error/<preset>-<hash>/, reused) and
writes results/analysis/grad_error-<profile>.json; python -m paper_figures.grad_error draws it.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from mecefo.errors import guarded
from mecefo.records import atomic_write_json, git_commit, read_jsonl
from mecefo.results import RESULTS, load_config, measurement, paper_numbers, quick_flag, run_dir
from mecefo.train import run

LEVELS = ("low", "mid", "high")


def paper_bound() -> float:
    return paper_numbers()["grad_relative_error_bound"]["value"]


def configs(quick: bool):
    base, n = ("sweep-quick", 4) if quick else ("sweep", 8)
    for level in LEVELS:
        cfg = load_config(base, ranks=n, micro_batch_size=8 // n, failures=level, policy="mecefo", track_grad_error="true")
        yield level, cfg


def main(argv: list[str] | None = None) -> int:
    quick = quick_flag(argv, __doc__)
    bound, rows, summary = paper_bound(), [], {}
    for level, cfg in configs(quick):
        out = run_dir("analysis/grad_error", cfg)
        run(cfg, out, quiet=True)
        errors = [(m["step"], m["grad_rel_error"]) for m in read_jsonl(out / "metrics.jsonl")
                  if m.get("grad_rel_error") is not None and not m.get("replay")]
        e = np.array([v for _, v in errors])
        summary[level] = {"run": str(out.relative_to(RESULTS)), "steps_with_failure": len(e), "steps": cfg.train.steps,
                          "max": float(e.max()) if len(e) else None, "median": float(np.median(e)) if len(e) else None,
                          "fraction_above_0.6": float((e > bound).mean()) if len(e) else None,
                          "fraction_above_1": float((e > 1).mean()) if len(e) else None}
        rows += [{"level": level, "step": s, "relative error": v} for s, v in errors]
        print(f"grad error {level}: {len(e)} steps with a failure; max {summary[level]['max']}, "
              f"above {bound}: {summary[level]['fraction_above_0.6']}, above 1: {summary[level]['fraction_above_1']}")
    path = measurement("analysis", "grad_error", quick)
    worst = max((r["relative error"] for r in rows), default=None)  # Assumption 3 needs it below 1
    atomic_write_json(path, {"levels": summary, "paper_bound": bound, "points": rows, "max_relative_error": worst,
                             "git_commit": git_commit()})
    print(f"-> {path} (figure: python -m paper_figures.grad_error)")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

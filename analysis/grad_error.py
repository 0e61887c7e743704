"""Assumption 3 along training (the paper's Figures 4-7 analog): at every step with an active failure, the
relative error ||g~ - g|| / ||g|| between MeCeFO's aggregated gradient g~ and the failure-free one g on the
same batches, for each failure level; the paper reports it below 0.6 throughout LLaMA-1B training.

    python -m analysis.grad_error [--quick]

Trains with `cluster.track_grad_error = true` (results/analysis/grad_error/<preset>-<hash>/, reused) and
writes results/analysis/grad_error-<profile>.json and paper_figures/out/grad_error.png|pdf.
"""

from __future__ import annotations

import argparse
import json
import sys

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from experiments.common import RESULTS, guarded, load_config
from mecefo.records import atomic_write_json, git_commit
from mecefo.train import run
from paper_figures.common import read_jsonl, save_figure, style

LEVELS = ("low", "mid", "high")


def paper_bound() -> float:
    from paper_figures.sweep import PAPER

    return PAPER["grad_relative_error_bound"]["value"]


def configs(quick: bool):
    base, n = ("sweep-quick", 4) if quick else ("sweep", 8)
    for level in LEVELS:
        cfg = load_config(base, ranks=n, micro_batch_size=8 // n, failures=level, policy="mecefo", track_grad_error="true")
        yield level, cfg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    quick = parser.parse_args(argv).quick
    bound, rows, summary = paper_bound(), [], {}
    for level, cfg in configs(quick):
        out = RESULTS / "analysis" / "grad_error" / f"{cfg.model.preset}-{cfg.hash()}"
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
    profile = "quick" if quick else "default"
    atomic_write_json(RESULTS / "analysis" / f"grad_error-{profile}.json",
                      {"levels": summary, "paper_bound": bound, "points": rows, "git_commit": git_commit()})
    style()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    if rows:
        sns.scatterplot(pd.DataFrame(rows), x="step", y="relative error", hue="level", hue_order=list(LEVELS), s=12, ax=ax)
    ax.axhline(bound, color="k", ls="--", lw=1, label=f"paper: below {bound} (LLaMA-1B)")
    ax.axhline(1.0, color="grey", ls=":", lw=1, label="1 (Assumption 3 needs < 1)")
    ax.legend(fontsize=7)
    ax.set(title="Relative gradient error of MeCeFO vs failure-free, same batches", ylabel="||g~ - g|| / ||g||")
    save_figure(fig, "grad_error")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

"""Validation-loss curve and one-row results table of the failure-free reference run (from results/ only).

    python -m paper_figures.failure_free [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from mecefo.errors import UsageError, guarded
from mecefo.results import failure_free_run

from .common import read_jsonl, save_figure, style, write_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    folder = failure_free_run(args.quick)
    if not (folder / "summary.json").exists():
        raise UsageError(f"no finished run in {folder}; run python -m experiments.failure_free first")
    summary = json.loads((folder / "summary.json").read_text())
    rows = pd.DataFrame(read_jsonl(folder / "metrics.jsonl"))

    style()
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    train = rows.dropna(subset=["loss"]) if "loss" in rows else rows.iloc[0:0]
    sns.lineplot(x=train["step"], y=train["loss"].rolling(10, min_periods=1).mean(), ax=ax, label="train (10-step mean)", alpha=0.7)
    val = rows.dropna(subset=["val_loss"])
    sns.lineplot(x=val["step"], y=val["val_loss"], ax=ax, marker="o", label="validation")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)",
           title=f"{summary['config']['model']['preset']}, failure-free (seed {summary['seed']}, config {summary['config_hash']})")
    paths = save_figure(fig, "failure_free_val_loss")

    m = summary["model"]
    table = (
        "| model | parameters | tokens | steps | final val loss | final val ppl | wall time (s) | config | commit |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
        f"| {summary['config']['model']['preset']} ({m['n_layers']}L, d={m['dim']}, V={m['vocab_size']}) | {summary['n_parameters']:,} "
        f"| {summary['tokens_seen']:,} | {summary['steps']} | {summary['final_val_loss']:.4f} "
        f"| {summary['final_val_ppl']:.2f} | {summary['wall_time_s']:.0f} | {summary['config_hash']} "
        f"| {summary['git_commit'][:12]} |\n"
    )
    paths.append(write_table("failure_free_table", table))
    for p in paths:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

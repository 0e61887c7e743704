"""What a slow heal costs on torchft: run time against heal time, beside 'each heal costs its own duration'
(from results/bench/heal-<profile>.json, written by python -m experiments.bench_heal).

    python -m paper_figures.heal [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys

import matplotlib.pyplot as plt

from mecefo.errors import UsageError, guarded
from mecefo.results import RESULTS

from .common import save_figure, style


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    path = RESULTS / "bench" / f"heal-{'quick' if args.quick else 'default'}.json"
    if not path.exists():
        raise UsageError(f"{path} does not exist; run python -m experiments.bench_heal first")
    result = json.loads(path.read_text())
    runs = [r for r in result["runs"] if r["finished"]]
    base = runs[0]["seconds"]
    style()
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    ax.plot([r["heal_s"] for r in runs], [r["seconds"] for r in runs], "o-", label="measured")
    ax.plot([r["heal_s"] for r in runs], [base + r["heals"] * r["heal_s"] for r in runs], "k--",
            label="no heal time + each heal's own duration")
    for r in result["runs"]:
        if not r["finished"]:
            ax.axvline(r["heal_s"], color="r", lw=1, label=f"heal {r['heal_s']:g} s: {r['note']}")
    ax.set(xlabel="seconds every heal takes", ylabel=f"seconds for {result['steps']} steps",
           title=f"nano, 3 torchft replicas, 3 kills (commit {result['git_commit'][:8]})")
    ax.legend(fontsize=8)
    for p in save_figure(fig, "heal_cost"):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

"""The variance decomposition of the Table 3 analog (from results/variance/ only): for each factor varied
alone, the seed-to-seed standard deviation of the final perplexity and of the paired changes, and the
seeds a +-1 point 95% interval would need at that standard deviation.

    python -m paper_figures.variance [--quick]
"""

from __future__ import annotations

import sys

from mecefo.errors import UsageError, guarded
from mecefo.results import quick_flag, read_measurement

from .common import write_table

COMPARISONS = ("mecefo-none", "drop-none", "mecefo-drop")


def seeds_for(cell: dict) -> str:
    if "seeds_for_1" not in cell:
        raise UsageError("results/variance was written before experiments.variance computed the seeds; rerun it")
    k = cell["seeds_for_1"]  # experiments.variance computes it
    return "—" if k is None else str(k)


def table(result: dict) -> str:
    lines = [f"# Where the variance comes from (base `{result['base_config']}`, n = {result['n']}, {result['level']} failures)\n",
             "Each factor varied over the seeds as its name says; sd in points of relative perplexity change (%); 'seeds for ±1': "
             "the seeds a 95% t-interval of half-width 1 point needs at that sd.\n",
             "| factor varied | seeds | sd of ppl: failure-free / MeCeFO / drop | " +
             " | ".join(f"{c}: mean (sd), seeds for ±1" for c in COMPARISONS) + " |",
             "|---|---|---|" + "---|" * len(COMPARISONS)]
    for factor, row in result["factors"].items():
        sd = row["ppl_sd"]
        cells = [f"{row[c]['mean']:+.2f}% ({row[c]['sd']:.2f}), {seeds_for(row[c])}" for c in COMPARISONS]
        lines.append(f"| {factor} | {row['seeds']} | {sd['none']:.2f} / {sd['mecefo']:.2f} / {sd['drop']:.2f} | "
                     + " | ".join(cells) + " |")
    lines.append(f"\nSource: results/variance/variance-*.json (runs in results/sweep), commit `{result['git_commit'][:12]}`.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    result = read_measurement("variance", "variance", quick_flag(argv, __doc__), "experiments.variance")
    print(f"wrote {write_table('variance_decomposition', table(result))}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

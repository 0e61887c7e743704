"""Table of the randomized-SVD measurement: captured-energy gap of V1 against the exact SVD, before
(torch.svd_lowrank, q = r + 8, niter = 2) and with LowRankWgrad's default (from results/svd/ only).

    python -m paper_figures.svd_accuracy [--quick]
"""

from __future__ import annotations

import sys

from mecefo.errors import guarded
from mecefo.results import quick_flag, read_measurement

from .common import write_table


def table(result: dict) -> str:
    d = result["default"]
    draws = result["matrices"][0]["rows"][0].get("draws", 1)
    lines = [f"Randomized V1 vs exact SVD (profile {result['profile']}): energy gap = 1 - ||W V1||_F^2 / ||W V1_exact||_F^2 "
             f"and mean cos^2 of the principal angles, the worst of {draws} random test matrices; default oversample {d['oversample']} x r (at least 8 columns), "
             f"niter {d['niter']}; chosen by the measurement: {result['chosen'] or 'none'} "
             f"(cheapest with every gap below {100 * result['margin'] * result['tolerance']:g}%).", "",
             "| matrix | r | gap before | cos^2 before | gap default | cos^2 default | worst gap over the grid |",
             "|---|---|---|---|---|---|---|"]
    for m in result["matrices"]:
        before = m["rows"][0]
        ours = next(r for r in m["rows"][1:] if (r["oversample"], r["niter"]) == (d["oversample"], d["niter"]))
        worst = max(r["energy_gap"] for r in m["rows"][1:])
        lines.append(f"| {m['matrix']} ({m['shape'][0]} x {m['shape'][1]}) | {m['r']} | {100 * before['energy_gap']:.3f}% | "
                     f"{before['mean_cos2']:.3f} | {100 * ours['energy_gap']:.3f}% | {ours['mean_cos2']:.3f} | "
                     f"{100 * worst:.3f}% |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    result = read_measurement("svd", "svd_accuracy", quick_flag(argv, __doc__), "experiments.svd_accuracy")
    out = write_table("svd_accuracy", table(result))
    print(f"randomized-SVD table -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

"""docs/torchft.md's measured block: the chaos harness on the torchft example (results/chaos/example-default.json
where `run_all.sh --full` ran it, else example-quick.json; written by python -m experiments.chaos_example) and the numbers a torchft user weighs MeCeFO against `drop` by (the
rows of the README's claims table on quality under failures, the neighbour's cost and goodput), all read from results.

    python -m paper_figures.torchft [--quick]
"""

from __future__ import annotations

import json
import sys

from mecefo.errors import guarded
from mecefo.results import RESULTS, quick_flag

from .common import write_block
from .headline import claims, claims_table

WEIGHED = ("Table 3", "Table 6", "which policy reaches")  # the claims rows that say what MeCeFO costs and keeps


def harness(result: dict | None, profile: str) -> str:
    if result is None:
        return f"No results/chaos/example-{profile}.json yet (`python -m experiments.chaos_example`)."
    s = result["summary"]
    bad = "; ".join(f"seed {k}: {', '.join(v)}" for k, v in s["violations"].items()) or "none"
    whole = sum("whole" not in r["violations"] for r in result["runs"])
    return (f"Measured by `python -m experiments.chaos_example` (`results/chaos/example-{result['profile']}.json`, commit "
            f"`{result['git_commit'][:12]}`): {s['schedules']} schedules of {result['groups']} groups x {result['steps']} "
            f"steps, {result['rate_per_min']:g} kills a minute ({result['multi']:.0%} of them two groups at once), "
            f"{s['kills']} groups killed in all; {s['steps_with_failures']} steps committed with a dead group's batch "
            f"computed by its neighbour; the global batch whole at every step in {whole} of {s['schedules']} schedules; "
            f"violations: {bad} (the groups' parameters equal at every step by their checksums); the losses against our "
            f"engine's replay (one process, the same failed sets) within {s['replay_rel_diff_first_window_max']:.1e} "
            f"relative through each run's first window with a dead group (bound {result['replay_rtol']:g}), "
            f"{s['replay_rel_diff_max']:.1e} over whole runs (float32 rounding amplified by training).")


def section(quick: bool) -> str:
    # the harness's default profile where it ran (run_all.sh --full), else its quick one (as the chaos block)
    path = next((p for p in (RESULTS / "chaos" / f"example-{x}.json" for x in ("default", "quick")) if p.exists()), None)
    rows = [r for r in claims(quick) if (r[0].startswith(WEIGHED) or r[0].lower().startswith("not in the paper: which"))
            and r[2] != "no result yet"]
    weighed = ("What MeCeFO costs and keeps (the rows of the README's table that weigh it against `drop`):\n\n"
               + claims_table(rows).replace("](docs/", "](")) if rows else (
        "What MeCeFO costs and keeps: the README's table (rows Table 3, Table 6 and goodput), once this profile's "
        "results hold them.\n")
    return harness(json.loads(path.read_text()) if path else None, "quick") + "\n\n" + weighed


def main(argv: list[str] | None = None) -> int:
    quick = quick_flag(argv, __doc__)
    print(f"wrote {write_block('torchft', section(quick), quick)}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

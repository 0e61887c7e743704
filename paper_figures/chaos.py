"""The chaos harness's results: restart-to-rejoin and kill-to-next-step distributions, the events fired, and the
README's real-failures figures (from results/chaos/chaos-<profile>.json, written by python -m experiments.chaos).

    python -m paper_figures.chaos [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys

import matplotlib.pyplot as plt
import numpy as np

from mecefo.errors import UsageError, guarded
from mecefo.results import RESULTS

from .common import save_figure, style, write_block, write_table


def _ecdf(ax, values: list[float], label: str, color, ls: str = "-") -> None:
    if values:
        v = np.sort(values)
        ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", color=color, ls=ls, label=f"{label} (n = {len(v)})")
        ax.axvline(np.percentile(v, 95), color=color, ls=":", lw=1)


def figure(result: dict):
    style()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    colors = dict(zip(result["summary"]["families"], ("C0", "C1", "C2")))
    done = [r for r in result["runs"] if not r["lost"] and not r.get("skipped")]
    for family, color in colors.items():
        mine = [r for r in done if r["family"] == family]
        _ecdf(axes[0], [t for r in mine for t in r["restart_to_rejoin_s"]], family, color)
        _ecdf(axes[1], [t for r in mine for t in r["kill_to_step_s"]], family, color)
        _ecdf(axes[1], [t for r in mine for t in r.get("kill_to_step_clear_s", [])], f"{family}, no stall or outage",
              color, ls="--")
        target = result["targets"]["rejoin_p95_s"].get(family)
        if target:
            axes[0].axvline(target, color=color, lw=2, alpha=0.35, label=f"target p95 {target:g} s")
    axes[1].axvline(result["targets"]["kill_to_step_p95_s"], color="k", lw=2, alpha=0.35,
                    label=f"target p95 {result['targets']['kill_to_step_p95_s']:g} s")
    axes[0].set(xlabel="seconds from a restart to its first committed step", ylabel="fraction (dotted: p95)",
                title="restart -> rejoin")
    axes[1].set(xlabel="seconds from the kill of a training rank to the next committed step", title="kill -> next step")
    for ax in axes[:2]:
        ax.legend(fontsize=7)
    kinds = sorted(result["summary"]["events"])
    fired = [result["summary"]["events"][k].get("fired", 0) for k in kinds]
    expired = [result["summary"]["events"][k].get("expired", 0) for k in kinds]
    axes[2].barh(kinds, fired, label="fired")
    axes[2].barh(kinds, expired, left=fired, label="expired (its moment did not come)")
    axes[2].set(xlabel="events over all schedules", title="chaos events")
    axes[2].legend(fontsize=7)
    fig.suptitle(f"chaos harness, {result['profile']} profile (commit {result['git_commit'][:8]})", fontsize=10)
    fig.tight_layout()
    return fig


def _q(q: dict, key: str) -> str:
    return f"{q[key]:.2f}" if q.get("n") else "-"


def _tail(runs: list[dict], key: str, p95: float | None) -> str:
    """The entries of one timing above its p95 (the summary's, over the same runs), counted by cause (chaos kind, or
    an unplanned death) and by whether their interval met a stall or a lighthouse outage."""
    if p95 is None:
        return ""
    counts: dict = {}
    for t, c in ((t, c) for r in runs for t, c in zip(r.get(key, []), r.get("causes", {}).get(key, []))):
        if t > p95:
            n = counts.setdefault(c["why"].removeprefix("chaos: "), [0, 0])
            n[0], n[1] = n[0] + 1, n[1] + (not c["clear"])
    return ", ".join(f"{k} {n}" + (f" ({bad} not clear)" if bad else "")
                     for k, (n, bad) in sorted(counts.items(), key=lambda kv: (-kv[1][0], kv[0])))


def _unscripted(s: dict) -> str:
    """The failures outside torchft's timeouts: stalls past the end of the run, torn checkpoints, the full disk."""
    fam = s["families"]
    left = ", ".join(f"{f.get('left_behind', 0)} ({family})" for family, f in fam.items())
    torn = sum(f.get("torn_resumes", 0) for f in fam.values())
    disk = fam.get("full disk")
    if disk is None:
        filled = "no full-disk schedule in this profile"
    elif disk.get("skipped"):
        filled = f"the full-disk schedules were skipped: {'; '.join(disk['skipped'])}"
    else:
        filled = (f"{disk['schedules'] - disk['lost']} of {disk['schedules']} full-disk schedules stopped at the first "
                  "write that could not succeed (exit 3, its line naming ENOSPC, no replica restarted for it, the "
                  "checkpoint --resume uses verified) and completed once the disk had room (a violation otherwise)")
    return (f"Failures outside every timeout: replicas left behind by a stall that outlasted the run (they woke after "
            f"the others had finished, stopped without training and are named in the summary and the last line): {left}; "
            f"resumes after every rank was down with the newest checkpoint torn first (its largest file cut to a third), "
            f"each skipping it for the earlier one kept: {torn}; {filled}.")


def section(result: dict) -> str:
    """The README's real-failures figures, every number read from the result."""
    s, targets = result["summary"], result["targets"]
    lines = [f"Measured by `python -m experiments.chaos` (`results/chaos/chaos-{result['profile']}.json`, commit "
             f"`{result['git_commit'][:12]}`; `paper_figures/out/chaos.png`), nano on 2 CPU cores, every heal and checkpoint "
             f"write held {result['hold_s']:g} s:", "",
             "| replicas | schedules | lost runs | invariant violations | resumed after every rank was down | "
             "restart -> rejoin p50 / p95 / max (s) | kill -> next step p50 / p95 / max (s) | not rejoined | "
             "largest loss deviation from the local twin; the torch twin |",
             "|---|---|---|---|---|---|---|---|---|"]
    for family, f in s["families"].items():
        r, k = f["restart_to_rejoin_s"], f["kill_to_step_s"]
        rc, kc = f.get("restart_to_rejoin_clear_s", {"n": 0}), f.get("kill_to_step_clear_s", {"n": 0})
        lines.append(f"| {family} | {f['schedules']} | {f['lost']} | {f['violations']} | {f['resumed_after_all_down']} | "
                     f"{_q(r, 'p50')} / {_q(r, 'p95')} / {_q(r, 'max')} (n = {r['n']}); clear: "
                     f"{_q(rc, 'p50')} / {_q(rc, 'p95')} / {_q(rc, 'max')} (n = {rc['n']}) | "
                     f"{_q(k, 'p50')} / {_q(k, 'p95')} / {_q(k, 'max')} (n = {k['n']}); clear: "
                     f"{_q(kc, 'p50')} / {_q(kc, 'p95')} / {_q(kc, 'max')} (n = {kc['n']}) | {f['not_rejoined']} | "
                     + (f"{f['twin_max_rel']:.1e}" if f["twin_max_rel"] is not None else "-")
                     + (f"; {f['torch_twin_max_rel']:.1e} ({f['torch_twins']} schedules) |" if f.get("torch_twins") else "; - |"))
    met = []
    for family, f in s["families"].items():
        for what, key, target in (("restart -> rejoin", "restart_to_rejoin", targets["rejoin_p95_s"].get(family)),
                                  ("kill -> next step", "kill_to_step", targets["kill_to_step_p95_s"])):
            p95, clear = f[f"{key}_s"].get("p95"), f.get(f"{key}_clear_s", {}).get("p95")
            if target is None or p95 is None:
                continue
            met.append(f"{what} p95 {p95:.2f} s against {target:g} s ({family}): " + ("met" if p95 <= target else "NOT met")
                       + ("" if clear is None else f", clear of stalls and outages {clear:.2f} s: "
                          + ("met" if clear <= target else "NOT met")))
    tails = []
    for family in s["families"]:
        mine = [r for r in result.get("runs", []) if r["family"] == family and not r["lost"] and not r.get("skipped")]
        for what, key in (("kill -> next step", "kill_to_step_s"), ("restart -> rejoin", "restart_to_rejoin_s")):
            tail = _tail(mine, key, s["families"][family][key].get("p95"))
            if tail:
                tails.append(f"{what} ({family}): {tail}")
    waiting = "; ".join(f"{family} p50 {_q(f['restart_to_waiting_s'], 'p50')} / p95 {_q(f['restart_to_waiting_s'], 'p95')} s"
                        for family, f in s["families"].items() if f.get("restart_to_waiting_s", {}).get("n"))
    events = ", ".join(f"{k} {v.get('fired', 0)}" + (f" (+{v['expired']} expired)" if v.get("expired") else "")
                       for k, v in sorted(s["events"].items()))
    lines += ["", "Targets: " + "; ".join(met) + ". (*Clear*: the intervals that met no stalled rank, which holds every "
              "synchronous step, and no lighthouse outage, in which no quorum forms.)", "",
              "What each tail is made of (the entries above the p95, by the death behind them; *not clear*: the interval "
              "met a stall or a lighthouse outage): " + "; ".join(tails) + ".", "",
              f"From a restart until the replica waits for a live peer (its process forked, its model built): {waiting}.", "",
              f"Events fired over all schedules: {events}.", "",
              f"The twins replay each run's `failed_steps.json` within relative {result['twin_rtol']:g}: the local backend "
              "(its batched sums differ in order from an all-reduce's), and, on every "
              f"{result.get('exact_every', 5)}th schedule and wherever the local twin is beyond that, the torch backend "
              "(torchrun), which sums as torchft does and then decides. Steps committed by a replica alone that then died "
              "with it (torchft agrees on a commit within a replica group, not across groups; or a lone quorum's steps), "
              "superseded by the version its peers redid: " + ", ".join(f"{f.get('superseded_rows', 0)} ({family})" for family, f in s["families"].items())
              + ".", "", _unscripted(s)]
    if s["lost"]:
        lines += ["", "Lost: " + "; ".join(f"seed {x['seed']}: {x['why']}" for x in s["lost"]) + "."]
    if s["violated"]:
        lines += ["", "Violations: " + "; ".join(f"seed {x['seed']}: {', '.join(x['violations'])}" for x in s["violated"]) + "."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    path = RESULTS / "chaos" / f"chaos-{'quick' if args.quick else 'default'}.json"
    if not path.exists():
        raise UsageError(f"{path} does not exist; run python -m experiments.chaos{' --quick' if args.quick else ''} first")
    result = json.loads(path.read_text())
    paths = save_figure(figure(result), "chaos")
    text = section(result)
    paths.append(write_table("chaos", text + "\n"))
    paths.append(write_block("chaos", text, args.quick))
    for p in paths:
        if p is not None:
            print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

"""The neighbour's cost where Table 2 is decided: FLOP c of each technique set at Table 2's jobs (exact count), and the
time against the FLOPs at the layer shapes of llama-350m and 1b (and 7b: its --full profile) on this CPU
(results/bench/neighbour-<profile>.json, written by python -m experiments.bench_neighbour). Writes paper_figures/out/neighbour.md and, for the default profile,
the README's block.

    python -m paper_figures.neighbour [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys

from mecefo.errors import UsageError, guarded
from mecefo.results import RESULTS, neighbour_bench, profile

from .common import write_block, write_table

SETS = ("skip_attention", "recompute_ffn", "low_rank_wgrad", "mecefo")


HEAPS = {"retain": "freed memory kept in the process, as a GPU's caching allocator keeps it",
         "system": "glibc's default heap, which page-faults every large activation anew"}


ROWS = (*SETS, "mecefo_before")


def commit(result: dict) -> str:
    """The result's commit, 12 digits, marked when the tree had uncommitted changes."""
    return result["git_commit"][:12] + ("-dirty" if result["git_commit"].endswith("-dirty") else "")


def section(result: dict, system: dict | None = None, refresh: dict | None = None) -> str:
    """system: the same benchmark under --heap system, its time ratios in a column beside the default's; refresh:
    experiments.bench_refresh's result (the V1 refresh shared among torch ranks), a sentence."""
    c = result["c"]
    measured = [s["preset"] for s in result["shapes"]]
    models = sorted(c, key=lambda m: (measured.index(m) if m in measured else len(measured), m))
    heap = result.get("heap", "system")
    lines = [f"Measured by `python -m experiments.bench_neighbour` (`results/bench/neighbour-*.json`, commit "
             f"`{commit(result)}`), {result['threads']} CPU threads, fp32, heap {heap} ({HEAPS[heap]}).", "",
             "c, a neighbour's cost of a failed GPU's micro-batches relative to computing them normally (the per-step "
             "V1^T product included), at Table 2's jobs (FLOPs by exact count: `mecefo.costs`' closed forms, equal to "
             "FlopCounterMode's; the time reading scales each by its measured time / FLOP quotient below):", "",
             "| technique set | " + " | ".join(f"{m} ({c[m]['micro_batch']} x {c[m]['seq_len']}): FLOPs; time" for m in models) + " |",
             "|---|" + "---|" * len(models)]
    for k in SETS:
        cells = [f"{c[m]['flop'][k]:.3f}; " + (f"{c[m]['time'][k]:.3f}" if "time" in c[m] else "-") for m in models]
        lines.append(f"| {k.replace('_', ' ')} | " + " | ".join(cells) + " |")
    lines += ["", "One layer's forward and backward at the models' exact layer shapes (one sequence of the tokens "
              "shown), a failed micro-batch under each set against a normal one: time ratio / FLOP ratio = their "
              "quotient (1: the set runs at its FLOP floor); the V1 refresh (the three FFN SVDs) amortised over "
              "tau = 50 steps in both; activation bytes kept per layer. *mecefo before* is the implementation this "
              "one replaced (the checkpoint reran the down projection), timed in the same rounds:", "",
              "| shape | set | time ratio | FLOP ratio | time / FLOPs | " + (
                  f"time / FLOPs, heap system (commit `{commit(system)}`) | " if system else "")
              + "activation MiB per layer |", "|---|---|---|---|---|---|" + ("---|" if system else "")]
    other = {s["preset"]: s["sets"] for s in (system or {}).get("shapes", [])}
    for shape in result["shapes"]:
        for k in ROWS:
            v = shape["sets"][k]
            alt = other.get(shape["preset"], {}).get(k)
            lines.append(f"| {shape['preset']} (D {shape['dim']}, F {shape['ffn_dim']}, T {shape['tokens']}) | "
                         f"{k.replace('_', ' ')} | {v['time_ratio']:.3f} | {v['flop_ratio']:.3f} | "
                         f"{v['time_over_flop']:.3f} | " + ((f"{alt['time_over_flop']:.3f} | " if alt else "- | ")
                                                            if system else "")
                         + f"{v['activation_bytes'] / 2**20:.1f} |")
    h = result["host_overhead"]
    lines += ["", f"Host overhead (width {h['dim']}, {h['tokens']} tokens, {h['blocks']} blocks: the time is Python's and "
              f"the dispatcher's): a neighbour's micro-batch takes {h['ratio']:.2f}x a normal one's."]
    pairs = [(s["preset"], s["own_and_failed"]) for s in result["shapes"] if s.get("own_and_failed")]
    if pairs and "own_and_failed" in h:
        lines += ["", "A neighbour's own and failed micro-batch (the three techniques) as one pass of both "
                  "(`--neighbour_pass fused`) against one pass each (`sequential`, the default), time fused / sequential: "
                  + "; ".join(f"{m} {p['fused_over_sequential']:.3f}" for m, p in pairs)
                  + f"; the host-overhead proxy {h['own_and_failed']['fused_over_sequential']:.3f}."]
    if refresh:
        parts = [f"{r['preset']} ({r['matrices']} matrices, {r['svd_method']} SVD) {r['local_s_per_matrix']:.3f} s per "
                 f"matrix computed by each rank, {r['shared_s_per_matrix']:.3f} s shared, {r['local_over_shared']:.2f}x"
                 + ("" if r["ranks_equal"] else " (the ranks' subspaces differed)") for r in refresh["shapes"]]
        lines += ["", f"The V1 refresh on the torch backend (`python -m experiments.bench_refresh`, commit "
                  f"`{commit(refresh)}`, {refresh['shapes'][0]['ranks']} gloo ranks of one thread): "
                  + "; ".join(parts) + ". Shared, each alive rank computes its turn of the stale matrices and "
                  "broadcasts them (`cluster.low_rank_refresh`), so every rank holds the same V1."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    path = neighbour_bench(args.quick)
    if not path.exists():
        raise UsageError(f"{path} does not exist; run python -m experiments.bench_neighbour{' --quick' if args.quick else ''} first")
    system = path.with_name(path.stem + "-system-heap.json")
    refresh = RESULTS / "bench" / f"refresh-{profile(args.quick)}.json"
    text = section(json.loads(path.read_text()), json.loads(system.read_text()) if system.exists() else None,
                   json.loads(refresh.read_text()) if refresh.exists() else None)
    paths = [write_table("neighbour", text + "\n")]
    paths.append(write_block("neighbour", text, args.quick))
    for p in paths:
        if p is not None:
            print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

"""Benchmark: the V1 refresh on the torch backend, shared among the ranks against computed by each.

    python -m experiments.bench_refresh [--quick]     (--quick: the tiny shape, for CI)

Two gloo processes (one thread each, the two cores of this machine) hold the FFN matrices of a few blocks of
llama-350m's and llama-1b's layer shapes (exact SVD at 350m, the randomized range finder at 1b: the method
mecefo.neighbour picks), and refresh V1 through engine.TorchReplicated.prepare, alternating rounds with
`low_rank_refresh` 'local' (each rank computes every SVD, as before) and 'shared' (each alive rank computes its share
and broadcasts it). Writes results/bench/refresh-<profile>.json: the median seconds of a refresh per matrix in each
mode and their ratio (2 ranks and an even number of matrices: the ideal is 2; on n ranks, n), and whether the ranks
held equal subspaces after every refresh of each mode.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import replace

import torch

from mecefo.records import atomic_write_json, git_commit, package_versions

from .common import RESULTS, guarded

RANKS = 2


def _ranks_equal(lowrank, stack) -> bool:
    """Whether every rank holds the same V1 of every matrix (a collective)."""
    import torch.distributed as dist

    bases = torch.cat([lowrank.basis(m).reshape(-1) for m in lowrank.matrices(stack)])
    gathered = [torch.empty_like(bases) for _ in range(RANKS)]
    dist.all_gather(gathered, bases)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _worker(rank: int, port: int, name: str, blocks: int, rounds: int, out: str) -> None:
    import torch.distributed as dist

    from mecefo.engine import TorchReplicated
    from mecefo.neighbour import MECEFO, LowRankWgrad
    from mecefo.plan import Piece, StepPlan

    from .bench_neighbour import R, Stack, layer_cfg

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    torch.manual_seed(0)
    stack = Stack(layer_cfg(name, blocks))
    lowrank = LowRankWgrad(r=R, tau=1, svd="auto", seed=0).bind(stack)
    engine = TorchReplicated(stack, None, 0, torch.device("cpu"), lowrank, n_ranks=RANKS, rank=rank)
    plan = StepPlan(0, frozenset(), {}, {r: (Piece(r, 0, 0, 1, 1, MECEFO),) for r in range(RANKS)})
    times = {"local": [], "shared": []}
    equal = {}
    for i in range(rounds + 1):  # (round 0 warms up)
        for mode in ("local", "shared") if i % 2 else ("shared", "local"):
            engine.low_rank_refresh = mode
            lowrank.steps = 2 * i + (mode == "shared")  # tau 1: a new epoch, every matrix stale
            dist.barrier()
            t = time.perf_counter()
            engine.prepare(replace(plan, step=lowrank.steps))
            dist.barrier()
            if i:
                times[mode].append(time.perf_counter() - t)
            equal[mode] = equal.get(mode, True) and _ranks_equal(lowrank, stack)
    if rank == 0:
        m = lowrank.matrices(stack)[0]
        torch.save({"times": times, "matrices": len(lowrank.matrices(stack)),
                    "method": lowrank.method(*m.weight.shape, lowrank.empty_basis(m).shape[1]),
                    "equal": equal}, out)
    dist.destroy_process_group()


def measure(name: str, blocks: int, rounds: int) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.spawn(_worker, args=(port, name, blocks, rounds, out), nprocs=RANKS)
        got = torch.load(out)
    local, shared = (statistics.median(got["times"][k]) for k in ("local", "shared"))
    n = got["matrices"]
    return {"preset": name, "blocks": blocks, "matrices": n, "svd_method": got["method"], "ranks": RANKS,
            "local_s_per_matrix": local / n, "shared_s_per_matrix": shared / n, "local_over_shared": local / shared,
            "rounds": {k: [round(t, 4) for t in v] for k, v in got["times"].items()},
            "ranks_equal": all(got["equal"].values()), "ranks_equal_by_mode": got["equal"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the CI-sized profile")
    args = parser.parse_args(argv)
    shapes = [("tiny", 2, 3)] if args.quick else [("llama-350m", 2, 3), ("llama-1b", 2, 3)]
    results = []
    for name, blocks, rounds in shapes:
        results.append(measure(name, blocks, rounds))
        r = results[-1]
        print(f"{name} ({r['matrices']} matrices, {r['svd_method']} SVD, {RANKS} ranks): a refresh takes "
              f"{r['local_s_per_matrix']:.3f} s per matrix computed by each rank, {r['shared_s_per_matrix']:.3f} s "
              f"shared: {r['local_over_shared']:.2f}x; ranks equal: {r['ranks_equal']}", flush=True)
    path = RESULTS / "bench" / f"refresh-{'quick' if args.quick else 'default'}.json"
    atomic_write_json(path, {"shapes": results, "git_commit": git_commit(), "packages": package_versions()})
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

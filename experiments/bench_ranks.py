"""Benchmark: the in-process backend does not get slower with n at a fixed global batch.

    python -m experiments.bench_ranks [--quick]

One model (tiny; nano with --quick) and one global batch of G sequences; a step of n simulated ranks
splits it into n micro-batches of G / n rows. LocalCluster runs all pieces that share a micro-batch index
and a technique set as one batch, so the step should cost what one rank with the whole batch costs.
Measured, alternating the settings within each round and taking the median over rounds of the time ratio
to the n = 1 failure-free step (the whole step: plan, forward and backward, aggregation, AdamW):
- n = 32 without failures;
- n = 32 with 4 of 32 ranks failed (Table 1's high-scenario mean), MeCeFO (4 neighbours with the techniques)
  and drop;
- n = 1 .. 16 without failures.
Target: n = 32 costs at most 1.15x the n = 1 step, with and without failures. Writes
results/bench/ranks-<profile>.json.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time

import torch

from mecefo.cluster import LocalCluster
from mecefo.data import DataConfig, TokenData
from mecefo.model import GPT, preset
from mecefo.neighbour import LowRankWgrad
from mecefo.policies import plan_step
from mecefo.records import atomic_write_json, git_commit, package_versions
from mecefo.results import quick_flag
from mecefo.train import apply_update, clip_gradients

from .common import RESULTS, guarded

FAILED_32 = frozenset({3, 11, 19, 27})  # 4 of 32 down, spread over the ring


def main(argv: list[str] | None = None) -> int:
    quick = quick_flag(argv, __doc__)
    name, global_batch, seq, rounds = ("nano", 32, 64, 3) if quick else ("tiny", 32, 128, 7)
    data = TokenData(DataConfig(vocab_size=512 if quick else 4096, seq_len=seq, micro_batch_size=global_batch))
    torch.manual_seed(0)
    model = GPT(preset(name, vocab_size=data.vocab_size))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    lowrank = LowRankWgrad().bind(model)
    split = _Split(data)  # every n reads the same global rows, split n ways
    settings = {f"n={n}": (n, "mecefo", frozenset()) for n in (1, 2, 4, 8, 16, 32)}
    settings |= {"n=32 mecefo 4 failed": (32, "mecefo", FAILED_32), "n=32 drop 4 failed": (32, "drop", FAILED_32)}

    def step(n: int, policy: str, failed: frozenset[int], k: int) -> float:
        cluster = LocalCluster(model, split, 0, torch.device("cpu"), lowrank, contextlib.nullcontext, n_ranks=n)
        plan = plan_step(policy, k, failed, n, 1, global_batch // n)
        t = time.perf_counter()
        cluster.prepare(plan)
        cluster.step(plan)
        clip_gradients(model, 1.0)
        apply_update(opt, 1e-4)
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    times = {label: [] for label in settings}
    for label, args in settings.items():  # warm-up (allocator, kernels, V1)
        step(*args, 0)
    for r in range(rounds):
        order = list(settings) if r % 2 == 0 else list(reversed(settings))
        for label in order:
            times[label].append(step(*settings[label], r + 1))
    base = times["n=1"]
    ratios = {label: statistics.median(t / b for t, b in zip(v, base)) for label, v in times.items()}
    result = {"preset": name, "global_batch": global_batch, "seq_len": seq, "rounds": rounds,
              "median_seconds": {k: statistics.median(v) for k, v in times.items()}, "ratio_to_n1": ratios,
              "target": 1.15, "meets_target": all(ratios[k] <= 1.15 for k in ("n=32", "n=32 mecefo 4 failed")),
              "threads": torch.get_num_threads(), "git_commit": git_commit(), "packages": package_versions()}
    path = RESULTS / "bench" / f"ranks-{'quick' if quick else 'default'}.json"
    atomic_write_json(path, result)
    for k, v in ratios.items():
        print(f"{k:22s} {result['median_seconds'][k] * 1e3:8.1f} ms/step  {v:.3f}x n=1")
    print(f"target n=32 <= 1.15x n=1 (with and without failures): {'met' if result['meets_target'] else 'NOT met'} -> {path}")
    return 0


class _Split:
    """The same global batch of rows, addressed as n ranks' micro-batches of G / n rows."""

    def __init__(self, data: TokenData):
        self.rows = data.micro_batch(0, 0, rank=0, micro=0, n_ranks=1)

    def micro_batch(self, seed, step, rank=0, micro=0, n_ranks=1):
        x, y = self.rows
        b = len(x) // n_ranks
        return x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]


if __name__ == "__main__":
    sys.exit(guarded(main))

"""Benchmark: the in-process backend does not get slower with n at a fixed global batch.

    python -m experiments.bench_ranks [--quick]

One model (tiny; nano with --quick) and one global batch of G sequences; a step of n simulated ranks
splits it into n micro-batches of G / n rows. Batched runs all pieces that share a micro-batch index
and a technique set as one batch, so the step should cost what one rank with the whole batch costs.
Measured, alternating the settings within each round (each a block of BLOCK steps, the first not timed) and
taking the median over rounds of the time ratio
to the n = 1 failure-free step (the trainer's whole step, mecefo.train.Run.step: plan, forward and backward,
aggregation, clipping, AdamW, the metrics row; the global batch injected as the run's data):
- n = 32 without failures;
- n = 32 with 4 of 32 ranks failed (Table 1's high-scenario mean), MeCeFO (4 neighbours with the techniques)
  and drop;
- n = 1 .. 16 without failures.
Target: n = 32 costs at most 1.15x the n = 1 step, with and without failures. Writes
results/bench/ranks-<profile>.json.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from mecefo import config as config_mod
from mecefo.data import DataConfig, TokenData
from mecefo.records import atomic_write_json, git_commit, package_versions
from mecefo.results import quick_flag
from mecefo.train import Run

from .common import RESULTS, guarded

FAILED_32 = frozenset({3, 11, 19, 27})  # 4 of 32 down, spread over the ring
BLOCK = 4  # steps of one setting in a row (the first not timed)


def main(argv: list[str] | None = None) -> int:
    quick = quick_flag(argv, __doc__)
    name, global_batch, seq, rounds = ("nano", 32, 64, 3) if quick else ("tiny", 32, 128, 7)
    data = TokenData(DataConfig(vocab_size=512 if quick else 4096, seq_len=seq, micro_batch_size=global_batch))
    split = _Split(data)  # every n reads the same global rows, split n ways
    settings = {f"n={n}": (n, "mecefo", frozenset()) for n in (1, 2, 4, 8, 16, 32)}
    settings |= {"n=32 mecefo 4 failed": (32, "mecefo", FAILED_32), "n=32 drop 4 failed": (32, "drop", FAILED_32)}

    def trainer(n: int, policy: str) -> Run:
        """The trainer of n local ranks under the policy (the same seeded initial weights for every n), AdamW at a
        constant lr, clipping at 1; nothing is written (no step is recorded)."""
        cfg = config_mod.load(None, {"preset": name, "seq_len": str(seq), "micro_batch_size": str(global_batch // n),
                                     "ranks": str(n), "failures": "none", "policy": policy, "lr": "1e-4",
                                     "warmup_steps": "0", "min_lr_ratio": "1.0", "grad_clip": "1.0", "device": "cpu",
                                     "precision": "fp32"})
        return Run(cfg, RESULTS / "bench" / "unused", torch.device("cpu"), quiet=True, data=split)

    runs = {label: trainer(n, policy) for label, (n, policy, _) in settings.items()}

    def step(label: str, k: int) -> float:
        """The trainer's step (mecefo.train.Run.step) with the setting's ranks down, BLOCK times in a row; the
        seconds of one, averaged over all but the first (each setting trains its own model: the first step of a
        block brings that model back into the caches)."""
        runs[label].step(k * BLOCK, settings[label][2])
        t = time.perf_counter()
        for i in range(1, BLOCK):
            runs[label].step(k * BLOCK + i, settings[label][2])
        return (time.perf_counter() - t) / (BLOCK - 1)

    times = {label: [] for label in settings}
    for label in settings:  # warm-up (allocator, kernels, V1)
        step(label, 0)
    for r in range(rounds):
        order = list(settings) if r % 2 == 0 else list(reversed(settings))
        for label in order:
            times[label].append(step(label, r + 1))
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

    splits = ("val",)

    def __init__(self, data: TokenData):
        self.rows = data.micro_batch(0, 0, rank=0, micro=0, n_ranks=1)
        self.vocab_size = data.vocab_size

    def micro_batch(self, seed, step, rank=0, micro=0, n_ranks=1):
        x, y = self.rows
        b = len(x) // n_ranks
        return x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]


if __name__ == "__main__":
    sys.exit(guarded(main))

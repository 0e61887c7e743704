"""Theorem 1's O(1/sqrt(nT)) rate on the GPT itself, in the theory's regime.

    python -m experiments.rate_gpt [--quick]

Every run: nano, momentum SGD (beta 0.9), the constant step size of the theory eta = C sqrt(n / T), a fixed
per-rank batch (the global batch grows with n), no clipping; n ranks on the in-process
backend, failure-free, or under Table 1's high scenario (stationary start, SECONDS_PER_STEP per step, so
that failure dynamics per step are the same for every T) with drop or MeCeFO. The quantity of the bound,
    (1/T) sum_t ||grad f(x_t)||^2,
is estimated on K + 1 evenly spaced iterates (t = 0, T/K, ..., T), f being the mean loss over the fixed
held-out windows of the validation split (one forward and backward over all of them, outside training).
Writes one record per run to results/rate_gpt/rate_gpt-<profile>.json (reused run by run);
`python -m analysis.rate` fits the slope against nT.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from tqdm import tqdm

from mecefo.records import atomic_write_json, git_commit, stable_hash
from mecefo.results import measurement, quick_flag
from mecefo.train import Run

from .common import guarded, load_config, RESULTS

C = 0.3  # eta = C sqrt(n / T): at most 0.13 (n = 8, T = 40); 0.25 made nano spike
PER_RANK_BATCH = 4  # sequences of 64 tokens
SECONDS_PER_STEP = 180.0  # Table 1's 2 h recovery = 40 steps
EVAL_POINTS = 10  # K
POLICIES = {"failure-free": ("none", "mecefo"), "drop": ("high", "drop"), "mecefo": ("high", "mecefo")}


def grid(quick: bool) -> dict:
    if quick:
        return {"ns": [1, 2, 4], "ts": [16, 50, 160], "seeds": [0]}
    return {"ns": [1, 2, 4, 8], "ts": [40, 126, 400], "seeds": [0, 1, 2]}


def held_out_grad_sq(model, data) -> float:
    """||grad f(x)||^2 for f = the mean loss over the validation split's fixed windows."""
    model.zero_grad(set_to_none=True)
    batches = list(data.eval_batches("val"))
    rows = sum(len(x) for x, _ in batches)
    for x, y in batches:
        loss = model(torch.from_numpy(x), torch.from_numpy(y)) * (len(x) / rows)
        loss.backward()
    sq = sum(float((p.grad.double() ** 2).sum()) for p in model.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)
    return sq


def one_run(policy: str, n: int, steps: int, seed: int) -> dict:
    level, name = POLICIES[policy]
    cfg = load_config("nano", **{"optimizer": "sgd", "momentum": 0.9, "lr": C * (n / steps) ** 0.5, "warmup_steps": 0,
                                 "min_lr_ratio": 1.0, "grad_clip": 0.0, "micro_batch_size": PER_RANK_BATCH,
                                 "steps": steps, "seed": seed, "eval_every": steps, "checkpoint_every": 0,
                                 "ranks": n, "failures": level, "policy": name, "seconds_per_step": SECONDS_PER_STEP})
    out = RESULTS / "rate_gpt" / "runs" / f"{policy}-n{n}-T{steps}-seed{seed}-{cfg.hash()}"
    training = Run(cfg, out, torch.device("cpu"), main=True, quiet=True)
    training.start(resume=False)
    points = sorted({round(k * steps / EVAL_POINTS) for k in range(EVAL_POINTS + 1)})
    sq, failed_steps = [], 0
    for step in range(steps):
        if step in points:
            sq.append(held_out_grad_sq(training.model, training.data))
        row, plan = training.step(step)
        failed_steps += bool(plan.failed)
    sq.append(held_out_grad_sq(training.model, training.data))
    training.metrics.close()
    return {"policy": policy, "n": n, "T": steps, "seed": seed, "lr": cfg.optim.lr, "config_hash": cfg.hash(),
            "avg_grad_sq": float(np.mean(sq)), "grad_sq": sq, "failed_step_fraction": failed_steps / steps,
            "final_loss": row["loss"]}


def main(argv: list[str] | None = None) -> int:
    quick = quick_flag(argv, __doc__)
    g = grid(quick)
    path = measurement("rate_gpt", "rate_gpt", quick)
    key = stable_hash({"grid": g, "C": C, "batch": PER_RANK_BATCH, "s": SECONDS_PER_STEP, "K": EVAL_POINTS})
    import json

    old = json.loads(path.read_text()) if path.exists() else {}
    done = {(r["policy"], r["n"], r["T"], r["seed"]): r for r in old.get("runs", [])} if old.get("key") == key else {}
    cells = [(p, n, t, s) for p in POLICIES for n in g["ns"] for t in g["ts"] for s in g["seeds"]]
    runs = []
    for cell in tqdm(cells, desc="rate on the GPT", disable=not sys.stderr.isatty()):
        runs.append(done.get(cell) or one_run(*cell))
        atomic_write_json(path, {"key": key, "grid": g, "C": C, "per_rank_batch": PER_RANK_BATCH,
                                 "seconds_per_step": SECONDS_PER_STEP, "eval_points": EVAL_POINTS,
                                 "git_commit": git_commit(), "runs": runs})  # after every run: an interruption keeps them
    print(f"{len(runs)} runs -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

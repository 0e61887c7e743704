"""Theorem 1's O(1/sqrt(nT)) rate on the GPT itself, from a trained checkpoint (an attempt at the theory's regime).

    python -m experiments.rate_gpt [--quick]

The bound is on the quantity
    (1/T) sum_{t<T} E ||grad f(x_t)||^2    under momentum SGD with the constant step eta = C sqrt(n / T).
Runs from random initialisation never reach it (the squared gradient norm grows while the loss falls, so
every slope came out positive), so every run here starts from one trained checkpoint: a failure-free nano
run (AdamW, cosine schedule, REFERENCE_STEPS steps), made first and reused. From it, each run trains T steps
with momentum SGD (beta 0.9, a fresh momentum buffer), eta = C sqrt(n / T), a fixed per-rank batch (the
global batch grows with n) and no clipping, on n ranks of the in-process backend: failure-free, or under
Table 1's high scenario (stationary start, SECONDS_PER_STEP per step, so that failure dynamics per step are
the same for every T) with drop or MeCeFO. At n = 1 a failure of the only rank leaves nobody to cover it (the
step is skipped under every policy), so drop and MeCeFO are run, and fitted, from n = 2.

f is the loss over the held-out population; its gradient is estimated at K + 1 evenly spaced iterates
(t = 0, T/K, ..., T) from HELD_OUT_WINDOWS fixed validation windows, split into two disjoint halves
(`held_out_gradient_sq`), so that the squared norm is estimated without the upward bias of the plug-in
estimate's own variance. Beside it, the same estimate on the training distribution that SGD samples from:
HELD_OUT_WINDOWS windows of the training split that the run itself never reads (the tail of its seed's first
epoch; the run reads the head; the starting checkpoint's training did read them), in two halves that are random
sets of windows from across the text (`training_gradient_sq`), so that neither neighbouring windows nor another
text's gradient enter it. It is a sample of that distribution independent of the run's own, not its whole loss. At the checkpoint the estimate is also taken with other splits (`split_check`: how
much neighbouring windows' correlation and the choice of held-out text move it), and one cell is rerun at
smaller C (`step_sweep`: how much of the level the step size sets).
--quick runs a smaller grid with smaller estimates (QUICK_ESTIMATE: K and W), to check the pipeline, not the rate.
Writes one record per run to results/rate_gpt/rate_gpt-<profile>.json (reused run by run while the grid and
the code are unchanged); `python -m analysis.rate` fits the slopes against nT and words them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from mecefo import checkpoint
from mecefo.records import atomic_write_json, git_commit, stable_hash
from mecefo.results import measurement, quick_flag, sources_digest
from mecefo.data import TokenData
from mecefo.model import GPT, preset
from mecefo.train import Run

from .common import RESULTS, default_jobs, guarded, in_parallel, load_config, run_dir

C = 0.3  # eta = C sqrt(n / T): at most 0.19 (n = 16, T = 40)
PER_RANK_BATCH = 4  # sequences of 64 tokens
SECONDS_PER_STEP = 180.0  # Table 1's 2 h recovery = 40 steps
EVAL_POINTS = 10  # K
HELD_OUT_WINDOWS = 512  # W: of the validation split's 1921 windows of 64 tokens; two halves of 256
QUICK_ESTIMATE = {"K": 4, "W": 256}  # --quick: the estimates (not the runs) were ~90% of its time at K = 10, W = 512
REFERENCE_STEPS = {"quick": 300, "default": 2000}
POLICIES = {"failure-free": ("none", "mecefo"), "drop": ("high", "drop"), "mecefo": ("high", "mecefo")}
SOURCES = ("experiments/rate_gpt.py", "src/mecefo/train.py", "src/mecefo/cluster.py", "src/mecefo/neighbour.py",
           "src/mecefo/model.py", "src/mecefo/failures.py", "src/mecefo/policies", "src/mecefo/data.py",
           "src/mecefo/config.py", "src/mecefo/checkpoint.py")
STEP_SWEEP = {"quick": {"n": 2, "T": 50, "Cs": [0.03, 0.1]}, "default": {"n": 4, "T": 126, "Cs": [0.03, 0.1]}}  # + C


def grid(quick: bool) -> dict:
    if quick:
        return {"ns": [1, 2, 4], "ts": [16, 50, 160], "seeds": [0]}
    return {"ns": [1, 2, 4, 8, 16], "ts": [40, 126, 400], "seeds": [0, 1, 2]}


def estimate(quick: bool) -> dict:
    """The gradient estimates' size: K + 1 points per run, W held-out windows per point."""
    return QUICK_ESTIMATE if quick else {"K": EVAL_POINTS, "W": HELD_OUT_WINDOWS}


def reference_config(quick: bool):
    steps = REFERENCE_STEPS["quick" if quick else "default"]
    return load_config("nano", steps=steps, eval_every=steps, checkpoint_every=0, warmup_steps=50, seed=0,
                       val_windows=estimate(quick)["W"])


def split_check(quick: bool, start: Path) -> dict:
    """The two-halves estimate at the checkpoint under each of SPLITS: against interleaved blocks, what the
    correlation of neighbouring windows adds to the alternating split; against the first and last half, how much
    the held-out texts' gradients differ."""
    cfg = reference_config(quick)
    data = TokenData(cfg.data)
    model = GPT(preset("nano", vocab_size=data.vocab_size))
    model.load_state_dict(checkpoint.read_model(start))
    w = estimate(quick)["W"]
    return {**{k: held_out_gradient_sq(model, data, k, w) for k in SPLITS},
            "train_unseen": training_gradient_sq(model, data, unseen_training_windows(data, 0, 0, 1, w))}


def reference(quick: bool) -> tuple[Path, list[dict]]:
    """The trained starting point: a failure-free nano run (the nano config's AdamW and cosine schedule),
    made once (its checkpoint reused), with the held-out squared gradient norm measured along it at
    doubling steps: whether training approaches a stationary point at all."""
    cfg = reference_config(quick)
    steps = cfg.train.steps
    out = run_dir("rate_gpt", cfg)
    curve_path = out / "grad_sq_curve.json"
    if curve_path.exists() and (out / "checkpoint").exists():
        return out / "checkpoint", json.loads(curve_path.read_text())
    training = Run(cfg, out, torch.device("cpu"), quiet=True)
    training.start(resume=False)
    marks, curve = {steps >> k for k in range(6)}, []
    for step in range(steps):
        row, _ = training.step(step, training.schedule.failed[step])
        training.record(row)
        if step + 1 in marks:
            curve.append({"step": step + 1, "train_loss": row["loss"], "val_loss": training.evaluate("val"),
                          **held_out_gradient_sq(training.model, training.data, windows=estimate(quick)["W"])})
    training.save(steps)
    training.metrics.close()
    atomic_write_json(curve_path, curve)
    return out / "checkpoint", curve


SPLITS = {  # how the held-out windows (in text order) are assigned to the two halves
    "alternate": lambda i: i % 2 == 0,  # even / odd windows (the experiment's)
    "blocks64": lambda i: (i // 64) % 2 == 0,  # interleaved blocks of 64 windows: correlated neighbours on one side
    "first_last": lambda i: i < len(i) // 2,  # the split's first and second half (for Shakespeare, largely two plays)
}


def held_out_gradient_sq(model, data, split: str = "alternate", windows: int | None = None) -> dict:
    """Three estimates of ||grad f(x)||^2 from the gradients g_A, g_B of the mean loss over two disjoint
    halves of the held-out windows (SPLITS[split] chooses them):
        unbiased  g_A . g_B              E = ||grad f||^2 if the halves are independent draws of windows
                                          (neighbouring windows of one text are positively correlated, which
                                          biases it upward; split_check measures that)
        floor     ||g_A - g_B||^2 / 4    E = tr(Sigma) / W, the variance of the mean over all W windows
        plug-in   ||(g_A + g_B) / 2||^2  = unbiased + floor: the squared norm of the full-sample gradient,
                                          biased upward by its own variance.
    From the first `windows` validation windows (HELD_OUT_WINDOWS unless given)."""
    x, y = next(data.eval_batches("val", batch=windows or HELD_OUT_WINDOWS))
    return _two_halves(model, x, y, SPLITS[split](np.arange(len(x))))


def _two_halves(model, x: np.ndarray, y: np.ndarray, first: np.ndarray) -> dict:
    """unbiased, floor and plug-in estimates (held_out_gradient_sq) from windows x, y split by the mask `first`."""
    halves = []
    for idx in (first, ~first):
        model.zero_grad(set_to_none=True)
        xs, ys = torch.from_numpy(x[idx]), torch.from_numpy(y[idx])
        for i in range(0, len(xs), 64):
            loss = model(xs[i:i + 64], ys[i:i + 64]) * (len(xs[i:i + 64]) / len(xs))
            loss.backward()
        halves.append(torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None]))
    model.zero_grad(set_to_none=True)
    a, b = halves
    return {"unbiased": float(a @ b), "floor": float(((a - b) ** 2).sum() / 4), "plug_in": float(((a + b) ** 2).sum() / 4)}


def unseen_training_windows(data, seed: int, steps: int, n: int, windows: int | None = None) -> np.ndarray:
    """The starts of `windows` (HELD_OUT_WINDOWS unless given) training windows a run of `steps` steps on n ranks never reads: the last ones of
    its seed's first-epoch permutation (the sampler reads that permutation from its head, mecefo.data)."""
    offset, perm = data.epoch_order(seed, 0)
    read, w = steps * n * PER_RANK_BATCH * data.cfg.grad_accum, windows or HELD_OUT_WINDOWS
    if read + w > len(perm):
        raise ValueError(f"a run reading {read} windows leaves fewer than {w} of {len(perm)} unseen")
    return offset + perm[-w:].astype(np.int64) * (data.cfg.seq_len + 1)


def training_gradient_sq(model, data, starts: np.ndarray) -> dict:
    """held_out_gradient_sq's three estimates on training windows (starts: unseen_training_windows), alternately
    assigned to the two halves: the windows are in random order, so each half is a random set of windows."""
    t = data.cfg.seq_len
    xy = np.stack([data.tokens["train"][s:s + t + 1] for s in starts]).astype(np.int64)
    return _two_halves(model, xy[:, :-1], xy[:, 1:], np.arange(len(starts)) % 2 == 0)


def one_run(policy: str, n: int, steps: int, seed: int, start: Path, size: dict, c: float = C) -> dict:
    """One run of T = `steps` steps from the checkpoint `start`, with the estimates at K + 1 points (size: estimate())."""
    level, name = POLICIES[policy]
    k, w = size["K"], size["W"]
    cfg = load_config("nano", **{"optimizer": "sgd", "momentum": 0.9, "lr": c * (n / steps) ** 0.5, "warmup_steps": 0,
                                 "min_lr_ratio": 1.0, "grad_clip": 0.0, "micro_batch_size": PER_RANK_BATCH,
                                 "val_windows": w, "steps": steps, "seed": seed, "eval_every": steps,
                                 "checkpoint_every": 0, "ranks": n, "failures": level, "policy": name,
                                 "seconds_per_step": SECONDS_PER_STEP})
    out = run_dir("rate_gpt/runs", cfg)
    training = Run(cfg, out, torch.device("cpu"), quiet=True)
    training.model.load_state_dict(checkpoint.read_model(start))
    training.start(resume=False)
    points = sorted({round(i * steps / k) for i in range(k + 1)})
    unseen = unseen_training_windows(training.data, seed, steps, n, w)
    estimates, failed_steps = [], 0
    for step in range(steps + 1):
        if step in points:
            estimates.append({**held_out_gradient_sq(training.model, training.data, windows=w),
                              **{f"train_{k}": v for k, v in training_gradient_sq(training.model, training.data, unseen).items()}})
        if step < steps:
            row, plan = training.step(step, training.schedule.failed[step])
            training.record(row)
            failed_steps += bool(plan.failed)
    training.metrics.close()
    per_point = {k: [e[k] for e in estimates] for k in estimates[0]}
    return {"policy": policy, "n": n, "T": steps, "seed": seed, "C": c, "lr": cfg.optim.lr, "config_hash": cfg.hash(),
            "points": points, **{f"grad_sq_{k}": v for k, v in per_point.items()},
            "avg_grad_sq": float(np.mean(per_point["unbiased"])), "avg_grad_sq_train": float(np.mean(per_point["train_unbiased"])), "avg_grad_sq_plug_in": float(np.mean(per_point["plug_in"])),
            "failed_step_fraction": failed_steps / steps, "final_loss": row["loss"]}


def _one_run(args: tuple) -> dict:
    return one_run(*args)


def main(argv: list[str] | None = None) -> int:
    quick = quick_flag(argv, __doc__)
    jobs = default_jobs(2)
    g = grid(quick)
    path = measurement("rate_gpt", "rate_gpt", quick)
    start, curve = reference(quick)
    splits = split_check(quick, start)
    sweep = STEP_SWEEP["quick" if quick else "default"]
    size = estimate(quick)
    key = stable_hash({"grid": g, "C": C, "batch": PER_RANK_BATCH, "s": SECONDS_PER_STEP, "K": size["K"],
                       "W": size["W"], "reference": REFERENCE_STEPS, "step_sweep": sweep,
                       "sources": sources_digest(SOURCES)})
    old = json.loads(path.read_text()) if path.exists() else {}
    done = {(r["policy"], r["n"], r["T"], r["seed"]): r for r in old.get("runs", [])} if old.get("key") == key else {}
    cells = [(p, n, t, s) for p in POLICIES for n in g["ns"] for t in g["ts"] for s in g["seeds"]
             if p == "failure-free" or n > 1]
    swept = {r["C"]: r for r in old.get("step_sweep", [])} if old.get("key") == key else {}
    runs, step_sweep = [], []

    def write() -> None:
        atomic_write_json(path, {"key": key, "grid": g, "C": C, "per_rank_batch": PER_RANK_BATCH,
                                 "seconds_per_step": SECONDS_PER_STEP, "eval_points": size["K"],
                                 "held_out_windows": size["W"], "reference": str(start.parent.relative_to(RESULTS)),
                                 "reference_steps": REFERENCE_STEPS["quick" if quick else "default"],
                                 "reference_curve": curve, "split_check": splits, "step_sweep_cell": sweep, "step_sweep": step_sweep,
                                 "complete": len(runs) == len(cells) and len(step_sweep) == len(sweep["Cs"]),
                                 "git_commit": git_commit(), "runs": runs})

    runs += [done[c] for c in cells if c in done]
    step_sweep += [swept[c] for c in sweep["Cs"] if c in swept]
    todo = [(*c, start, size) for c in cells if c not in done]
    n_cells = len(todo)  # todo's first n_cells are the grid's, the rest the step sweep's
    todo += [("failure-free", sweep["n"], sweep["T"], 0, start, size, c) for c in sweep["Cs"] if c not in swept]
    bar = tqdm(total=len(todo), desc=f"rate on the GPT ({jobs} at a time)", disable=not sys.stderr.isatty())
    for i, r in in_parallel(_one_run, todo, jobs):  # the same cell at smaller C: failure-free, seed 0, its own C
        (runs if i < n_cells else step_sweep).append(r)
        bar.update()
        write()  # after every run: an interruption keeps them
    runs.sort(key=lambda r: cells.index((r["policy"], r["n"], r["T"], r["seed"])))
    step_sweep.sort(key=lambda r: sweep["Cs"].index(r["C"]))
    write()
    print(f"{len(runs)} runs -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

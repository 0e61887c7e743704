"""Sweep the data-parallel size n and the failure level across the policies (the paper's Table 3 and
Figure 3, with seeds): every cell is one training run on the same failure schedule for a given
(n, level, seed), whichever the policy.

    python -m experiments.sweep [--quick | --long | --full]

Each run lands in results/sweep/<preset>-<config hash>/ (summary.json: resolved config, final validation
loss and perplexity, wall time, commit; metrics.jsonl) and is reused on rerun; a run that fails is reported
and the sweep goes on. results/sweep/index-<profile>.json lists the cells of the profile. The failure-free first
steps (cluster.failure_free_steps) that a seed's cells share are trained once, in results/sweep/warm/ (warm_start).
--full writes the paper-scale torchrun commands to results/sweep/full_commands.sh after a dry run
(configs resolve, shapes instantiate on the meta device); it trains nothing here.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from mecefo import config as config_mod
from mecefo import failures, policies
from mecefo.costs import Shape, training_memory
from mecefo.data import c4_download
from mecefo.errors import UsageError
from mecefo.model import GPT, preset
from mecefo.neighbour import Techniques
from mecefo.records import atomic_write_json, atomic_write_text, git_commit, read_jsonl
from mecefo.train import run, warm_config

from .common import CONFIGS, RESULTS, default_jobs, guarded, in_parallel, run_dir


@dataclass(frozen=True)
class Cell:
    n: int
    level: str  # none | low | mid | high | custom:<interval_h>:<recovery_h> (the higher-frequency rows)
    policy: str
    seed: int
    techniques: str = "mecefo"
    tag: str = "main"  # main (Table 3, its n-sweep) | fig3 (skip attention vs skip FFN) | asymmetric | frequency
    #                    | cold (high, MeCeFO, no failure-free warm start: failures from step 0)
    failable: str = ""  # asymmetric: the ranks that can fail (the first node)


@dataclass(frozen=True)
class Design:
    """A sweep profile: which runs, at what n, with how many seeds (every seed has its own failure schedule,
    shared by all policies of that seed, so comparisons are paired by seed)."""

    base: str  # the base config, experiments/configs/<base>.toml (global batch split over the n ranks)
    n: int  # the main cells' data-parallel size (32: one rank is one GPU of the paper's cluster)
    ns: tuple[int, ...]  # the n-sweep: high failures, seeds 0 .. n_seeds - 1
    seeds: int  # seeds of every row at the main n
    high_seeds: int  # seeds of the high-level rows that decide the claim: failure-free, mecefo, drop
    node: int  # ranks per node; the asymmetric rows fail only the first node's ranks
    others: bool = True  # also the exact policies of OTHER_POLICIES at high, seed 0
    n_seeds: int = 1  # seeds of every n of the n-sweep (each paired with failure-free at n = 1 on its seed)


DESIGNS = {
    "quick": Design("sweep-quick", 4, (1, 2, 4), 2, 2, 2),
    "default": Design("sweep", 32, (1, 2, 4, 8, 16, 32), 2, 3, 8, others=False),  # its time: docs/profiles.md
    "long": Design("sweep", 32, (1, 2, 4, 8, 16, 32), 2, 8, 8, n_seeds=3),
}
FREQUENCIES = (2, 4)  # the higher-frequency rows: high's interval and recovery divided by k (same ratio, 1:4)
OTHER_POLICIES = ("ndb-exact", "spread", "checkpoint-restart")  # beside the main ones, high, seed 0
LAST_EVALUATIONS = 2  # the reported perplexity: exp of the mean validation loss of the run's last 2 evaluations


def frequency_spec(k: int) -> str:
    """Table 1's high scenario k times as frequent, with the same interval-to-recovery ratio."""
    hi = failures.SCENARIOS["high"]
    return f"custom:{hi.interval_h / k:g}:{hi.recovery_h / k:g}"


def cells(profile: str, extra: tuple[str, ...] = ()) -> list[Cell]:
    """The grid of a profile (DESIGNS), plus the main comparison cells (beside mecefo's and drop's) for each
    policy in `extra` (any registered trainer policy). Failure-free cells run once per (n, seed): every
    policy is the same there."""
    for name in extra:
        policies.get(name, trainer=True)
    d = DESIGNS[profile]
    seeds, high = range(d.seeds), range(d.high_seeds)
    out = [Cell(d.n, "none", "none", s) for s in high]
    out += [Cell(d.n, "high", p, s) for s in high for p in ("mecefo", "drop")]
    for level in ("low", "mid", "high"):
        out += [Cell(d.n, level, p, s) for s in seeds for p in ("mecefo", "drop", "spread-mecefo")]
    # the n-sweep at a fixed global batch; failure-free at n = 1 is every n's reference (the same samples;
    # what differs from the main n's is the order of floating-point sums: the trajectory's own sensitivity)
    out += [Cell(1, "none", "none", s) for s in range(d.n_seeds)]
    out += [Cell(n, "high", p, s) for s in range(d.n_seeds) for n in d.ns if n > 1 for p in ("mecefo", "drop")]
    out += [Cell(d.n, "high", p, 0) for p in OTHER_POLICIES if d.others]
    out += [Cell(d.n, "high", "mecefo", s, t, "fig3") for s in seeds for t in ("skip_attention", "skip_ffn")]
    first_node = ",".join(str(r) for r in range(d.node))
    out += [Cell(d.n, "high", p, s, tag="asymmetric", failable=first_node) for s in seeds for p in ("mecefo", "drop")]
    out += [Cell(d.n, frequency_spec(k), "mecefo", s, tag="frequency") for k in FREQUENCIES for s in seeds]
    out += [Cell(d.n, "high", "mecefo", s, tag="cold") for s in high]  # the estimate without the warm start
    out += [Cell(d.n, level, p, s) for p in extra for level in ("low", "mid", "high") for s in seeds]
    return list(dict.fromkeys(out))  # a cell listed twice runs once


def cell_config(base: str, cell: Cell):
    """The base config with the cell's n (the global batch split over ranks), failures, policy and seed."""
    cfg = config_mod.load(CONFIGS / f"{base}.toml")
    global_batch = cfg.data.micro_batch_size
    if global_batch % cell.n:
        raise ValueError(f"global batch {global_batch} does not split over {cell.n} ranks")
    return config_mod.with_overrides(
        cfg, data={"micro_batch_size": global_batch // cell.n}, train={"seed": cell.seed},
        cluster={"ranks": cell.n, "failures": cell.level, "policy": "mecefo" if cell.policy == "none" else cell.policy,
                 "techniques": cell.techniques, "failable": cell.failable,
                 **({"failure_free_steps": 0} if cell.tag == "cold" else {})})


def run_ppl(out) -> float:
    """The reported perplexity of the finished run in folder `out` (its metrics.jsonl)."""
    return last_evaluations_ppl(read_jsonl(out / "metrics.jsonl"))


def last_evaluations_ppl(metrics: list[dict], k: int = LAST_EVALUATIONS) -> float:
    """exp of the mean validation loss over the last k evaluations of a run (its metrics rows)."""
    losses = [m["val_loss"] for m in metrics if m.get("val_loss") is not None and not m.get("replay")]
    if not losses:
        raise ValueError("the run has no validation evaluation")
    return math.exp(sum(losses[-k:]) / len(losses[-k:]))


def warm_start(cfg) -> tuple[config_mod.Config, Path] | None:
    """The config and folder of the warm start a cell shares with its seed's other cells (mecefo.train.warm_config,
    stopped at cluster.failure_free_steps), or None where it trains from step 0: no failure-free steps, or a policy that
    holds state at them (checkpoint-restart). Measured on the default's n = 32 cells: 33.7 s for the warm start, then
    52.2 s per cell against 82.0 s from step 0; run_sweep trains one where at least two cells to train share it."""
    cc = cfg.cluster
    if cc.failure_free_steps <= 0 or policies.get(cc.policy, trainer=True)(cc).state_dict():
        return None
    warm = warm_config(cfg)
    return warm, run_dir("sweep/warm", warm)


def train_warm_start(job: tuple) -> None:
    """Train (or reuse) one warm start: its config's run stopped at its failure-free steps, with the torch threads it
    was trained with (OUT/threads.json; bit equality with a cell trained from step 0 holds at equal threads). A failure
    is reported and its cells train from step 0."""
    warm, out = job
    if (out / "threads.json").exists():
        return
    try:
        run(warm, out, resume=(out / "checkpoint").exists(), quiet=True, stop_after=warm.cluster.failure_free_steps)
        atomic_write_json(out / "threads.json", {"threads": torch.get_num_threads()})
    except Exception:
        traceback.print_exc()


def trained_warm_start(cfg) -> Path | None:
    """The folder of cfg's warm start where one was trained (run_sweep: where cells to train share it), else None."""
    warm = warm_start(cfg)
    return warm[1] if warm is not None and (warm[1] / "threads.json").exists() else None


def run_cell(job: tuple[str, "Cell"]) -> dict:
    """One cell's run (or its cached result): its index entry, with the error where it failed. A cell with a warm
    start continues from it (trained by run_sweep first): equal to training it from step 0, tests/test_warm_start.py."""
    base, cell = job
    cfg = cell_config(base, cell)
    out = run_dir("sweep", cfg)
    entry = {**cell.__dict__, "run": str(out.relative_to(RESULTS)), "config_hash": cfg.hash(),
             "threads": torch.get_num_threads(), "warm_start": None}
    try:
        summary = run(cfg, out, quiet=True, warm_start=trained_warm_start(cfg))
        warm = summary.get("warm_start")  # (a cached run: as it was trained, from its warm start or from step 0)
        if warm:  # (its folder named under results/sweep/warm/, wherever results/ was when it ran)
            threads = RESULTS / "sweep" / "warm" / Path(warm["run"]).name / "threads.json"
            entry["warm_start"] = {"run": f"sweep/warm/{Path(warm['run']).name}", "step": warm["step"],
                                   "threads": json.loads(threads.read_text())["threads"] if threads.exists() else None}
        entry["final_val_ppl"] = summary["final_val_ppl"]
        entry["val_ppl"] = run_ppl(out)
        entry["wall_time_s"] = summary["wall_time_s"]
    except Exception as e:  # report and go on; the index records the failure
        entry["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    return entry


def run_sweep(profile: str, extra: tuple[str, ...] = (), jobs: int = 1) -> dict:
    base = DESIGNS[profile].base
    grid = cells(profile, extra)
    index: list[dict | None] = [None] * len(grid)
    bar = tqdm(total=len(grid), desc=f"sweep ({profile}, {jobs} at a time)", disable=not sys.stderr.isatty())
    t0 = time.perf_counter()
    to_train = [cfg for cfg in (cell_config(base, c) for c in grid) if not (run_dir("sweep", cfg) / "summary.json").exists()]
    starts = [w for w in map(warm_start, to_train) if w is not None]
    shared = {folder: cfg for cfg, folder in starts if sum(f == folder for _, f in starts) > 1}  # (alone: no gain)
    for _ in in_parallel(train_warm_start, [(cfg, folder) for folder, cfg in shared.items()], jobs):
        pass  # the failure-free first steps, once per (n, seed)
    for done, (i, entry) in enumerate(in_parallel(run_cell, [(base, c) for c in grid], jobs), 1):
        index[i] = entry
        bar.update()
        if bar.disable:
            cell = grid[i]
            print(f"[{done}/{len(grid)}] n={cell.n} {cell.level:4s} {cell.policy:18s} {cell.techniques:15s} {cell.tag:10s} "
                  f"seed {cell.seed}: " + (f"ppl {entry['val_ppl']:.3f}" if "val_ppl" in entry else entry["error"]), flush=True)
    failed = [e for e in index if "error" in e]
    result = {"profile": profile, "base_config": base, "design": DESIGNS[profile].__dict__,
              "last_evaluations": LAST_EVALUATIONS, "cells": index, "git_commit": git_commit(), "jobs": jobs,
              "wall_time_s": time.perf_counter() - t0}
    atomic_write_json(RESULTS / "sweep" / f"index-{profile}.json", result)
    print(f"sweep {profile}: {len(index) - len(failed)}/{len(index)} runs ok in {result['wall_time_s']:.0f} s "
          f"({jobs} at a time) -> {RESULTS / 'sweep'}")
    return result


FULL = {  # the paper's settings: global batch read as sequences of 256 tokens; 7B sharded (replicated it needs
    # 16 bytes x 6.7e9 parameters = 108 GB per GPU for fp32 weights, gradients and AdamW moments)
    "llama-350m": {"global_batch": 8192, "steps": 6000, "micro_batch": 16, "shard": "none"},
    "llama-1b": {"global_batch": 4096, "steps": 20000, "micro_batch": 8, "shard": "none"},
    "llama-7b": {"global_batch": 1024, "steps": 60000, "micro_batch": 2, "shard": "fsdp"},
}
GPU_BYTES = 80 * 10**9  # one A100 80 GB, the paper's GPU


def memory_per_gpu(cfg: config_mod.Config) -> dict[str, int]:
    """mecefo.costs.training_memory for a run's preset, micro-batch, n, sharding and neighbour techniques."""
    cc = cfg.cluster
    return training_memory(preset(cfg.model.preset, vocab_size=cfg.data.vocab_size),
                           Shape(cfg.data.micro_batch_size, cfg.data.seq_len), cc.ranks, cc.shard,
                           Techniques.parse(cc.techniques), cc.r)


def check_fits(cfg: config_mod.Config, gpu_bytes: int = GPU_BYTES) -> dict[str, int]:
    """The per-GPU memory of cfg, or a UsageError that names the fix when it exceeds gpu_bytes."""
    mem = memory_per_gpu(cfg)
    if mem["total"] > gpu_bytes:
        fix = ("shard it: --shard fsdp" if cfg.cluster.shard == "none" else "lower --micro_batch_size")
        raise UsageError(f"{cfg.model.preset} at micro-batch {cfg.data.micro_batch_size} on {cfg.cluster.ranks} ranks "
                         f"(shard={cfg.cluster.shard}) needs {mem['total'] / 1e9:.1f} GB per GPU > "
                         f"{gpu_bytes / 1e9:.0f} GB; {fix}")
    return mem


def full_commands(ranks: int = 32, nodes: int = 4) -> tuple[str, dict]:
    """torchrun commands for the paper-scale sweep on `nodes` x 8 GPUs, each dry-run checked here (config
    resolves, shape instantiates on meta, per-GPU memory fits an 80 GB A100); and the memory per preset."""
    lines = ["#!/usr/bin/env bash", "# Paper-scale sweep (not run by run_all.sh): launch on each of the nodes with",
             "# MASTER_ADDR, NODE_RANK set; C4 shards in $C4_DIR (see docs/training.md, Data). Generated by experiments/sweep.py --full.",
             "set -euo pipefail"]
    memory = {}
    for name, s in FULL.items():
        per_rank = s["global_batch"] // ranks
        accum = per_rank // s["micro_batch"]
        with torch.device("meta"):
            GPT(preset(name))  # the shape instantiates without memory
        for level in ("none", "low", "mid", "high"):
            overrides = {"preset": name, "dataset": "c4", "vocab_size": "32000", "seq_len": "256",
                         "micro_batch_size": str(s["micro_batch"]), "grad_accum": str(accum), "steps": str(s["steps"]),
                         "lr": "1e-3", "warmup_steps": str(s["steps"] // 10), "eval_every": "1000",
                         "checkpoint_every": "1000", "ranks": str(ranks), "backend": "torch", "failures": level,
                         "policy": "mecefo", "seconds_per_step": "2.2", "device": "cuda", "shard": s["shard"],
                         "c4_train_tokens": "0"}  # 0: one pass of the run's tokens, no window repeated
            cfg = config_mod.load(None, overrides)  # resolves, or raises with the field named
            if name not in memory:
                download = c4_download(cfg.data.c4_train_tokens)
                memory[name] = check_fits(cfg) | {"gpu_bytes": GPU_BYTES, "shard": s["shard"],
                                                  "micro_batch": s["micro_batch"], "ranks": ranks,
                                                  "c4_train_tokens": cfg.data.c4_train_tokens, "c4_download": download}
                lines.append(f"# {name}: {memory[name]['total'] / 1e9:.1f} GB per GPU of {GPU_BYTES / 1e9:.0f} "
                             f"(shard={s['shard']}; mecefo.costs.training_memory)")
                lines.append(f"# {name}: {cfg.data.c4_train_tokens / 1e9:.2f}B training tokens (one pass), in about "
                             f"{download['shards']} of C4's 1024 English train shards, {download['gigabytes']:g} GB: "
                             f"huggingface-cli download allenai/c4 --repo-type dataset --local-dir $C4_DIR --include "
                             + " ".join(f'"{p}"' for p in download["include"]))
            args = " ".join(f"--{k} {v}" for k, v in overrides.items())
            lines.append(f"torchrun --nnodes {nodes} --nproc_per_node {ranks // nodes} --node_rank $NODE_RANK "
                         f"--master_addr $MASTER_ADDR -m mecefo.train {args} --data_dir $C4_DIR "
                         f"--out results/sweep-full/{name}-{level}-{cfg.hash()}")
    return "\n".join(lines) + "\n", memory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="a few nano cells (CI)")
    group.add_argument("--long", action="store_true", help=f"{DESIGNS['long'].high_seeds} seeds of the deciding high-level rows")
    group.add_argument("--full", action="store_true", help="write the paper-scale torchrun commands (dry run)")
    parser.add_argument("--policies", default="", help="comma-separated registered policies to add to the main cells")
    parser.add_argument("--jobs", type=int, default=default_jobs(1),
                        help="runs at once, one torch thread each when above 1 (default: MECEFO_JOBS, else 1: two at a time "
                             "gain nothing on 2 cores)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        raise UsageError(f"--jobs {args.jobs} must be at least 1")
    if args.full:
        path = RESULTS / "sweep" / "full_commands.sh"
        script, memory = full_commands()
        atomic_write_text(path, script)
        atomic_write_json(RESULTS / "sweep" / "full_memory.json", memory)
        for name, mem in memory.items():
            parts = ", ".join(f"{k} {mem[k] / 1e9:.1f}" for k in ("parameters", "gradients", "optimizer_states",
                                                                    "gathered", "autocast", "bases", "activations"))
            print(f"{name}: {mem['total'] / 1e9:.1f} GB per GPU of {GPU_BYTES / 1e9:.0f} (shard={mem['shard']}; {parts}); "
                  f"{mem['c4_train_tokens'] / 1e9:.2f}B C4 tokens, about {mem['c4_download']['shards']} train shards "
                  f"({mem['c4_download']['gigabytes']:g} GB)")
        print(f"paper-scale commands (dry-run checked: configs resolve, shapes instantiate on meta, memory fits) -> {path}")
        return 0
    profile = "quick" if args.quick else "long" if args.long else "default"
    result = run_sweep(profile, tuple(p for p in args.policies.split(",") if p), args.jobs)
    return 1 if any("error" in c for c in result["cells"]) else 0


if __name__ == "__main__":
    sys.exit(guarded(main))

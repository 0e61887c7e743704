"""The paper's Table 6 ablation, measured: what a neighbour that computes its own and a failed rank's
micro-batches costs under each combination of the MeCeFO techniques, relative to a normal rank.

    python -m experiments.ablation [--quick]

Rows: normal rank; naive NDB (two exact micro-batches); + skip_attention; + recompute_ffn;
+ low_rank_wgrad (= MeCeFO). For each preset at sequence length 256 and each low-rank r:
- FLOPs per optimizer step, counted by FlopCounterMode on the meta device (and checked against the closed
  forms of mecefo.costs), with k micro-batches per step (a neighbour does 2k, applying V1^T once);
- activation bytes saved for backward (exact, fp32) when the neighbour holds both micro-batches at once
  ("together", the schedule under which the paper's naive NDB runs out of memory) and when it runs them
  one after the other ("sequential": the peak is one micro-batch's);
- wall time on this CPU (tiny and small only), normal and neighbour steps timed alternately in one run;
- peak memory by category from torch's MemTracker under FakeTensorMode (tiny and small);
- a memory-fit statement for one A100 80 GB per rank (assumptions in the JSON and the table notes).
Writes results/ablation/ablation-<profile>.json; a rerun with the same settings (their hash is in the file) reuses it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from tqdm import tqdm

from mecefo.costs import (Shape, analytic_flops, counted_flops, ffn_matrices, peak_memory, refresh_flops,
                          saved_activation_bytes)
from mecefo.model import GPT, count_parameters, preset
from mecefo.neighbour import LowRankWgrad, Neighbour, Techniques
from mecefo.records import atomic_write_json, git_commit, package_versions, stable_hash

from mecefo.results import measurement

from .common import guarded

ROWS = {  # row name -> (techniques, micro-batches computed by this rank per step slot)
    "normal rank": (Techniques(), 1),
    "naive NDB": (Techniques(), 2),
    "+ skip_attention": (Techniques(skip_attention=True), 2),
    "+ recompute_ffn": (Techniques(skip_attention=True, recompute_ffn=True), 2),
    "+ low_rank_wgrad (MeCeFO)": (Techniques(skip_attention=True, recompute_ffn=True, low_rank_wgrad=True), 2),
}
SEQ_LEN = 256
# Sequences per micro-batch and micro-batches per step (k) for each preset. For the paper's models, the
# per-rank batch is the paper's global batch (8192 / 4096 / 1024, read as sequences) over 32 ranks,
# split into k = 16 micro-batches; ours are the CPU configs' shapes at sequence length 256.
SHAPES = {"tiny": (8, 1), "small": (8, 1), "llama-350m": (16, 16), "llama-1b": (8, 16), "llama-7b": (2, 16)}
A100_BYTES = 80 * 10**9
DP_RANKS = 32
WALL_PRESETS = ("tiny", "small")


def step_flops(name: str, techniques: Techniques, micro_batches: int, r: float) -> dict:
    """Counted FLOPs of one step slot: micro_batches x k micro-batches, the low-rank factor applied once."""
    cfg, (b, k) = preset(name), SHAPES[name]
    counted = counted_flops(cfg, Shape(b, SEQ_LEN), techniques, r)
    analytic = analytic_flops(cfg, Shape(b, SEQ_LEN), techniques, r)
    if counted != analytic:
        raise AssertionError(f"{name} {techniques.names}: counted {counted} != analytic {analytic}")
    per_micro = counted["total"] - counted["wgrad_apply"]
    return {"flops": micro_batches * k * per_micro + counted["wgrad_apply"], "per_micro_batch": counted}


def time_ratio(name: str, techniques: Techniques, micro_batches: int, r: float, rounds: int) -> float:
    """Median over rounds of (time of this row's step slot) / (time of a normal rank's), alternating."""
    torch.manual_seed(0)
    cfg, (b, _) = preset(name), SHAPES[name]
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (b, SEQ_LEN))
    lowrank = LowRankWgrad(r=r)

    def slot(tech: Techniques, count: int) -> float:
        neighbour = None if tech == Techniques() else Neighbour(tech, lowrank)
        t = time.perf_counter()
        for _ in range(count):
            model(idx, idx, neighbour=neighbour).backward()
        if neighbour is not None:
            neighbour.finish()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    slot(techniques, micro_batches)  # warm-up (and the SVDs, which are amortised over tau steps)
    ratios = []
    for _ in range(rounds):
        base = slot(Techniques(), 1)
        ratios.append(slot(techniques, micro_batches) / base)
    return statistics.median(ratios)


def memory_fit(name: str, act_bytes: int, batch: int) -> dict:
    """Bytes per rank under two stated layouts; activations counted in fp32 and halved for bf16.
    zero2_max_batch: the largest micro-batch (sequences, `batch` per act_bytes) that fits under ZeRO-2."""
    p = count_parameters(preset(name))
    act = act_bytes // 2
    replicated = 16 * p + act  # fp32 weights 4 + fp32 grads 4 + AdamW moments 8 bytes per parameter
    static = 4 * p + (4 + 8) * p // DP_RANKS  # gradients and AdamW moments sharded over the DP group
    return {"replicated_bytes": replicated, "replicated_fits": replicated <= A100_BYTES,
            "zero2_bytes": static + act, "zero2_fits": static + act <= A100_BYTES,
            "zero2_max_batch": max(0, (A100_BYTES - static) * batch // max(act, 1))}


def settings_for(quick: bool) -> dict:
    return {"presets": list(SHAPES), "shapes": SHAPES, "seq_len": SEQ_LEN, "r_values": [64] if quick else [32, 64, 128, 256],
            "wall_presets": ["tiny"] if quick else list(WALL_PRESETS), "rounds": 2 if quick else 5,
            "rows": list(ROWS), "version": 2}


def result_path(quick: bool):
    return measurement("ablation", "ablation", quick)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one r, wall time on tiny only, fewer rounds")
    args = parser.parse_args(argv)
    settings = settings_for(args.quick)
    r_values, wall_presets, rounds = settings["r_values"], settings["wall_presets"], settings["rounds"]
    path = result_path(args.quick)
    if path.exists() and json.loads(path.read_text()).get("settings_hash") == stable_hash(settings):
        print(f"reusing {path}")
        return 0
    records = []
    work = [(n, row, r) for n in SHAPES for row in ROWS for r in (r_values if "low_rank" in row else r_values[:1])]
    for name, row, r in tqdm(work, desc="ablation", disable=not sys.stderr.isatty()):
        techniques, micro = ROWS[row]
        cfg, (b, k) = preset(name), SHAPES[name]
        flops = step_flops(name, techniques, micro, r)
        per_micro_bytes = saved_activation_bytes(cfg, Shape(b, SEQ_LEN), techniques, r)
        together = saved_activation_bytes(cfg, Shape(micro * b, SEQ_LEN), techniques, r)
        rec = {"preset": name, "row": row, "techniques": techniques.names, "micro_batches": micro, "r": r,
               "ffn_r": [w for _, _, w in ffn_matrices(cfg, r)],
               "batch": b, "k": k, "tokens_per_step": k * b * SEQ_LEN, "flops": flops["flops"],
               "per_micro_batch_flops": flops["per_micro_batch"],
               "activation_bytes_together": together, "activation_bytes_sequential": per_micro_bytes,
               "memory_fit": memory_fit(name, together, b)}
        if "low_rank" in row:  # the SVD method LowRankWgrad(svd="auto") picks: exact up to min(m, n) = 1024
            rec["svd_flops_per_refresh"] = refresh_flops(cfg, r)
        if name in wall_presets:
            rec["wall_ratio"] = time_ratio(name, techniques, micro, r, rounds)
            rec["peak_memory"] = peak_memory(cfg, Shape(micro * b, SEQ_LEN), techniques, r=r)
        records.append(rec)
        print(f"{name:11s} {row:27s} r={r:<4} flops {rec['flops']:.3e} act {together / 2**20:9.1f} MiB"
              + (f" wall x{rec['wall_ratio']:.2f}" if "wall_ratio" in rec else ""), flush=True)
    result = {"settings": settings, "settings_hash": stable_hash(settings), "records": records, "a100_bytes": A100_BYTES, "dp_ranks": DP_RANKS,
              "git_commit": git_commit(), "packages": package_versions(), "threads": torch.get_num_threads()}
    atomic_write_json(path, result)
    print(f"ablation: {len(records)} rows -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

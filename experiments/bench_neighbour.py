"""Benchmark: a neighbour's time where Table 2 is decided. Blocks of the exact layer shapes of llama-350m, llama-1b
and llama-7b (width D, FFN width F, heads; T = 2048 tokens, one sequence), forward and backward from a fixed upstream
gradient, on this CPU: a normal micro-batch, and a failed one under each technique alone and the three together.

    python -m experiments.bench_neighbour [--quick | --full] [--heap retain|system]
            default: llama-350m's and llama-1b's layers; --full: and llama-7b's (~15 min more on 2 cores);
            --quick: the tiny and small presets' layers at T = 256, for CI

For each shape and technique set: the time ratio to the normal micro-batch (the median over rounds, the settings
alternating within each round), the FLOP ratio (mecefo.costs' closed forms: attention and FFN of a layer), their
quotient (1: the technique runs at its FLOP floor), and the activation bytes a block keeps for backward (saved
tensors once per storage, parameters excluded, as mecefo.costs counts them). Under low_rank_wgrad the per-step apply
(factor V1^T) is timed with the micro-batch, and the refresh of V1 (the three FFN matrices' SVDs, the method
mecefo.neighbour picks for the shape) once, amortised over tau = 50 steps: both in the time and in the FLOPs (the
SVD's by mecefo.costs.svd_flops' estimate). The host-overhead proxy: a block of width 8 and 4 tokens, where the time
is the host's, the neighbour's micro-batch against a normal one. cluster.neighbour_pass: a neighbour's own and failed
micro-batch (two sequences, the three techniques) as one pass against one pass each, at every shape and in the proxy.
Writes results/bench/neighbour-<profile>.json
(--heap system: neighbour-<profile>-system-heap.json), with c at Table 2's jobs by FLOPs and, where the layer shape
was measured, by time (paper_figures.neighbour shows both; experiments.throughput and the figures read the full
profile's file where it exists, else the default's: mecefo.results.neighbour_bench).

--heap retain (the default) keeps freed memory in the process (retain_heap), as a GPU's caching allocator does;
--heap system leaves glibc's default, under which every activation of these shapes is page-faulted anew each time.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time

import torch

from mecefo.costs import Shape, analytic_flops, refresh_flops
from mecefo.model import Block, ModelConfig, preset, rope_tables
from mecefo.neighbour import LowRankWgrad, Neighbour, Techniques, resolve_r
from mecefo.records import atomic_write_json, git_commit, package_versions

from .common import RESULTS, guarded

SETS = {"normal": "normal", "skip_attention": "skip_attention", "recompute_ffn": "recompute_ffn",
        "low_rank_wgrad": "low_rank_wgrad", "mecefo": "mecefo", "mecefo_before": "mecefo"}


class Before(Neighbour):
    """The FFN sublayer as MeCeFO's techniques ran before mecefo.neighbour.NeighbourFFN: torch's checkpoint of the
    whole sublayer (its recomputation reruns the down projection: a Python Function saves its inputs only once its
    forward returns, so the checkpoint cannot stop before it), each linear the low-rank Function. The same-run
    reference of the change."""

    def ffn(self, block, h):
        from torch.utils.checkpoint import checkpoint

        project = self.project if self.techniques.low_rank_wgrad else None
        if self.techniques.recompute_ffn:
            return checkpoint(block.ffn_sublayer, h, project, use_reentrant=False)
        return block.ffn_sublayer(h, project)


# (preset, tokens T, blocks, rounds, rounds of own + failed) of each profile
PROFILES = {"quick": [("tiny", 256, 2, 5, 3), ("small", 256, 2, 5, 3)],
            "default": [("llama-350m", 2048, 2, 9, 5), ("llama-1b", 2048, 1, 7, 3)]}
PROFILES["full"] = PROFILES["default"] + [("llama-7b", 2048, 1, 5, 3)]
TAU, R = 50, 0.125  # the V1 refresh interval and width of the paper's runs (Table 4: tau 50 steps; r D/8)


def layer_cfg(name: str, blocks: int) -> ModelConfig:
    cfg = preset(name)
    return ModelConfig(vocab_size=8, dim=cfg.dim, n_layers=blocks, n_heads=cfg.n_heads, ffn_dim=cfg.ffn_dim,
                       max_seq_len=max(cfg.max_seq_len, 2048))


class Stack(torch.nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.cfg = cfg

    def ffn_linears(self):
        return [getattr(b.ffn, n) for b in self.layers for n in ("gate_proj", "up_proj", "down_proj")]


def _step(stack: Stack, x: torch.Tensor, grad: torch.Tensor, cos, sin, neighbour, finish: bool = True) -> None:
    h = x
    for block in stack.layers:
        h = block(h, cos, sin, neighbour)
    h.backward(grad)
    if neighbour is not None and finish:
        neighbour.finish()


def own_and_failed(stack: Stack, x: torch.Tensor, grad: torch.Tensor, cos, sin, neighbour, fused: bool) -> None:
    """A neighbour's two micro-batches of one index (x: 2 sequences, its own and the failed rank's) under its
    techniques, as the engine runs them (cluster.neighbour_pass): one pass of both, or one pass each; the low-rank
    factors applied once after both, as once per step."""
    if fused:
        _step(stack, x, grad, cos, sin, neighbour)
        return
    for i in range(x.shape[0]):
        _step(stack, x[i:i + 1].detach().requires_grad_(), grad[i:i + 1], cos, sin, neighbour, finish=False)
    neighbour.finish()


def pair(stack: Stack, cos, sin, neighbour, tokens: int, rounds: int) -> dict:
    """Seconds per block of a neighbour's own + failed micro-batch: one pass each (sequential) against one pass of
    both (fused), the median over rounds alternating them."""
    x, grad = torch.randn(2, tokens, stack.cfg.dim, requires_grad=True), torch.randn(2, tokens, stack.cfg.dim)
    times = {"sequential": [], "fused": []}
    for rnd in range(rounds + 1):  # (the first a warm-up)
        for k in times:
            stack.zero_grad(set_to_none=True)
            t = time.perf_counter()
            own_and_failed(stack, x, grad, cos, sin, neighbour, fused=k == "fused")
            if rnd:
                times[k].append((time.perf_counter() - t) / stack.cfg.n_layers)
    seq, fused = statistics.median(times["sequential"]), statistics.median(times["fused"])
    return {"sequential_s": seq, "fused_s": fused, "fused_over_sequential": fused / seq,
            "rounds": {k: [round(v, 6) for v in ts] for k, ts in times.items()}}


def _saved_bytes(stack: Stack, x, cos, sin, neighbour) -> int:
    params = {p.untyped_storage()._cdata for p in stack.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s._cdata not in params:
            seen[s._cdata] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = x
        for block in stack.layers:
            h = block(h, cos, sin, neighbour)
    del h
    return sum(seen.values()) // stack.cfg.n_layers


def measure(name: str, tokens: int, blocks: int, rounds: int, pair_rounds: int = 0) -> dict:
    cfg = layer_cfg(name, blocks)
    torch.manual_seed(0)
    stack = Stack(cfg)
    lowrank = LowRankWgrad(r=R, tau=TAU, svd="auto").bind(stack)
    x = torch.randn(1, tokens, cfg.dim, requires_grad=True)
    grad = torch.randn(1, tokens, cfg.dim)
    cos, sin = (t[:tokens] for t in rope_tables(cfg.head_dim, tokens, cfg.rope_theta))
    neighbours = {k: None if v == "normal" else (Before if k.endswith("_before") else Neighbour)(Techniques.parse(v), lowrank)
                  for k, v in SETS.items()}
    t0 = time.perf_counter()
    lowrank.prepare(stack)  # V1 of every FFN matrix: what a refresh costs
    refresh_s = (time.perf_counter() - t0) / blocks
    times: dict[str, list[float]] = {k: [] for k in SETS}
    for nb in neighbours.values():  # warm-up: the allocator and first-call paths of every setting
        _step(stack, x, grad, cos, sin, nb)
    for _ in range(rounds):
        for k, nb in neighbours.items():
            stack.zero_grad(set_to_none=True)
            x.grad = None
            t = time.perf_counter()
            _step(stack, x, grad, cos, sin, nb)
            times[k].append((time.perf_counter() - t) / blocks)
    shape = Shape(1, tokens)
    flops, rows = {}, {}
    mats = [(m.weight.shape[0], m.weight.shape[1]) for m in stack.ffn_linears()[:3]]
    svd = refresh_flops(cfg, R, lowrank) // blocks
    for k, v in SETS.items():
        f = analytic_flops(cfg, shape, Techniques.parse(v), R)
        flops[k] = f["attention"] + f["ffn"] + f["wgrad_apply"] / cfg.n_layers
    # before: the recomputation reran the down projection and the three x V1 (mecefo.costs' closed form then)
    rerun = 2 * tokens * cfg.dim * cfg.ffn_dim + sum(2 * tokens * n * resolve_r(R, m, n) for m, n in mats)
    flops["mecefo_before"] = flops["mecefo"] + rerun
    normal_t = statistics.median(times["normal"])
    for k, v in SETS.items():
        low_rank = Techniques.parse(v).low_rank_wgrad
        t = statistics.median(times[k]) + (refresh_s / TAU if low_rank else 0.0)
        fl = flops[k] + (svd / TAU if low_rank else 0.0)
        rows[k] = {"seconds": statistics.median(times[k]), "seconds_with_refresh": t, "time_ratio": t / normal_t,
                   "flops": fl, "flop_ratio": fl / flops["normal"], "time_over_flop": (t / normal_t) / (fl / flops["normal"]),
                   "activation_bytes": _saved_bytes(stack, x, cos, sin, neighbours[k]),
                   "rounds": [round(s, 6) for s in times[k]]}
    return {"preset": name, "dim": cfg.dim, "ffn_dim": cfg.ffn_dim, "heads": cfg.n_heads, "tokens": tokens,
            "blocks": blocks, "refresh_s_per_block": refresh_s, "svd_flops_per_block": svd, "tau": TAU, "r": R,
            "svd_method": lowrank.method(*mats[0], resolve_r(R, *mats[0])), "sets": rows,
            "own_and_failed": pair(stack, cos, sin, neighbours["mecefo"], tokens, pair_rounds) if pair_rounds else None}


def host_overhead(rounds: int) -> dict:
    """The host-bound proxy: tiny tensors, so the time is Python's and the dispatcher's, not the arithmetic's."""
    cfg = ModelConfig(vocab_size=8, dim=8, n_layers=4, n_heads=2, ffn_dim=16, max_seq_len=4)
    torch.manual_seed(0)
    stack = Stack(cfg)
    lowrank = LowRankWgrad(r=R, tau=TAU).bind(stack)
    x, grad = torch.randn(1, 4, 8, requires_grad=True), torch.randn(1, 4, 8)
    cos, sin = rope_tables(cfg.head_dim, 4, cfg.rope_theta)
    nb = Neighbour(Techniques.parse("mecefo"), lowrank)
    lowrank.prepare(stack)
    x2, grad2 = torch.randn(2, 4, 8, requires_grad=True), torch.randn(2, 4, 8)
    runs = {"normal": lambda: _step(stack, x, grad, cos, sin, None), "mecefo": lambda: _step(stack, x, grad, cos, sin, nb),
            "sequential": lambda: own_and_failed(stack, x2, grad2, cos, sin, nb, fused=False),
            "fused": lambda: own_and_failed(stack, x2, grad2, cos, sin, nb, fused=True)}
    times = {k: [] for k in runs}
    for _ in range(rounds):
        for k, run in runs.items():
            t = time.perf_counter()
            for _ in range(20):
                stack.zero_grad(set_to_none=True)
                run()
            times[k].append((time.perf_counter() - t) / 20)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"normal_s": med["normal"], "mecefo_s": med["mecefo"], "ratio": med["mecefo"] / med["normal"],
            "own_and_failed": {"sequential_s": med["sequential"], "fused_s": med["fused"],
                               "fused_over_sequential": med["fused"] / med["sequential"]},
            "dim": 8, "tokens": 4, "blocks": 4}


def c_readings(measured: dict) -> dict:
    """Table 2's jobs (experiments.throughput.PAPER_JOBS): c, a neighbour's cost of a failed GPU's micro-batches
    relative to computing them normally (mecefo.simulator.CostModel.relative_cost, FLOPs by exact count), for each
    technique set; and, where this benchmark measured the model's layer shape, the time reading: c scaled by the
    measured time / FLOP quotient of the set (the blocks' time; the embedding and the head cost the same in both)."""
    from dataclasses import replace

    from mecefo.simulator import CostModel

    from .throughput import PAPER_JOBS

    found = {}
    for model, job in PAPER_JOBS.items():
        flop = {k: CostModel(replace(job, techniques=v)).relative_cost for k, v in SETS.items()
                if k not in ("normal", "mecefo_before")}
        row = {"flop": flop, "micro_batch": job.micro_batch, "seq_len": job.seq_len}
        if model in measured:
            q = {k: measured[model]["sets"][k]["time_over_flop"] for k in flop}
            row |= {"time_over_flop": q, "time": {k: flop[k] * q[k] for k in flop}}
        found[model] = row
    return found


def retain_heap() -> bool:
    """Keep freed memory in this process instead of handing it back to the kernel. glibc serves a block above its mmap
    threshold (at most 32 MiB under its own rule) with a fresh mapping and unmaps it on free, so each activation of
    these shapes (a 2048 x 11008 fp32 tensor is 86 MiB) is page-faulted and zeroed by the kernel anew, every time it is
    allocated. The faults cost a share of a step that depends on how an implementation allocates, not on its FLOPs
    (`--heap system` measures it; the README gives both readings). A GPU's caching allocator never returns memory
    within a step; this is its CPU counterpart (mallopt: M_MMAP_THRESHOLD 1 GiB, M_TRIM_THRESHOLD 2 GiB). False where
    the C library has no mallopt (not glibc)."""
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(-3, 1 << 30)) and bool(libc.mallopt(-1, (1 << 31) - 1))  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the CI-sized profile")
    size.add_argument("--full", action="store_true", help="llama-7b's layer too")
    parser.add_argument("--heap", choices=("retain", "system"), default="retain",
                        help="retain: freed memory stays in the process, as a GPU's caching allocator (default); "
                             "system: glibc's default")
    args = parser.parse_args(argv)
    quick = args.quick
    heap = "retain" if args.heap == "retain" and retain_heap() else "system"
    profile = "quick" if quick else "full" if args.full else "default"
    shapes = PROFILES[profile]
    results = []
    for name, tokens, blocks, rounds, pair_rounds in shapes:
        results.append(measure(name, tokens, blocks, rounds, pair_rounds))
        r, p = results[-1]["sets"], results[-1]["own_and_failed"]
        print(f"{name} (T = {tokens}): " + "; ".join(f"{k} time {v['time_ratio']:.3f} / FLOPs {v['flop_ratio']:.3f}"
                                                     for k, v in r.items() if k != "normal")
              + f"; own + failed fused / sequential {p['fused_over_sequential']:.3f}", flush=True)
    host = host_overhead(9 if quick else 21)
    readings = c_readings({r["preset"]: r for r in results})
    print(f"host overhead of a neighbour micro-batch (width 8, 4 tokens): {host['ratio']:.2f}x a normal one")
    path = RESULTS / "bench" / f"neighbour-{profile}{'' if args.heap == 'retain' else '-system-heap'}.json"
    atomic_write_json(path, {"shapes": results, "host_overhead": host, "c": readings, "threads": torch.get_num_threads(),
                             "heap": heap,
                             "git_commit": git_commit(), "packages": package_versions()})
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

"""The GPU check: what a user with one CUDA GPU runs to see that the paper-scale path works (under 10 minutes).

    python -m experiments.gpu_check            # on a CUDA machine; without CUDA it says so and exits 0
    python -m experiments.gpu_check --device cpu --quick   # the same checks, small, on the CPU (CI runs this)

Checks, each recorded in results/gpu_check.json (results/gpu_check-cpu.json for --device cpu):
1. bf16 training (autocast) with every policy under failures (nano, a trace with overlapping failures of two
   of four ranks): finite losses, the failure path taken.
2. the low-rank path on the device: randomized V1 of a llama-1b FFN-shaped Gaussian weight (the hardest
   spectrum) against the exact SVD, energy gap and times.
3. torchrun with one process (nccl on CUDA, gloo on the CPU), unsharded and FSDP2-sharded: the launch,
   the backend and the sharded code path on the device (with one rank there is no failure to cover; the
   multi-rank failure paths of both backends are covered by the gloo tests on the CPU).
4. torchft (mecefo.launch): two replicas with one killed and healed where there are two devices, one on a single
   GPU; on CUDA, one replica more than GPUs must be refused with one line (NCCL would refuse it at every restart).
5. throughput of llama-60m and llama-130m (bf16 autocast, fused AdamW, the loss in chunks as the trainer takes it,
   synthetic tokens), eager and with --compile (mecefo.model.compile_blocks): tokens/s of a normal step, MFU =
   counted FLOPs (mecefo.costs) x steps/s / the GPU's bf16 dense peak, the wall-time ratio of a MeCeFO neighbour
   step (two micro-batches with the three techniques) to a normal step measured alternately in the same run beside
   its FLOP ratio, and the measured peak memory against mecefo.costs.training_memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mecefo.costs import Shape, analytic_flops, training_memory
from mecefo.model import GPT, count_parameters, preset
from mecefo.neighbour import (MECEFO, LowRankWgrad, Neighbour, Techniques, exact_right_basis, randomized_right_basis,
                             resolve_r)
from mecefo.records import atomic_write_json, git_commit, package_versions

from .common import CONFIGS, RESULTS, ROOT, guarded

PEAK_BF16 = {"A100": 312e12, "H100": 989e12, "H200": 989e12, "H800": 989e12, "A800": 312e12, "L40S": 362e12,
             "A10": 125e12, "L4": 121e12, "V100": 125e12, "4090": 165e12}  # dense bf16 (V100: fp16) FLOP/s
TRACE = "0,add,node1\n0,add,node2\n0,add,node3\n0,add,node4\n2000,remove,node2\n4000,remove,node1\n6000,add,node2\n8000,add,node1\n"


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_policies(device: torch.device, tmp: Path, steps: int) -> dict:
    from mecefo.policies import trainer_policies
    from mecefo.train import main as train_main

    trace = tmp / "trace.csv"
    trace.write_text(TRACE)
    out = {}
    for policy in trainer_policies():
        run = tmp / f"policy-{policy}"
        t = time.perf_counter()
        rc = train_main(["--config", str(CONFIGS / "nano.toml"), "--steps", str(steps), "--ranks", "4",
                         "--failures", str(trace), "--seconds_per_step", "1", "--policy", policy, "--precision", "bf16",
                         "--device", device.type, "--restart_every", "3", "--eval_every", str(steps), "--quiet",
                         "--out", str(run)])
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][1:] if rc == 0 else []
        out[policy] = {"exit": rc, "seconds": time.perf_counter() - t,
                       "steps_with_failures": sum(bool(r["down"]) for r in rows),
                       "finite": bool(rows) and all(r["loss"] is not None and r["loss"] == r["loss"] for r in rows),
                       "final_val_loss": json.loads((run / "summary.json").read_text())["final_val_loss"] if rc == 0 else None}
    return out


def check_low_rank(device: torch.device, quick: bool) -> dict:
    cfg = preset("llama-60m" if quick else "llama-1b")
    m, n = cfg.ffn_dim, cfg.dim
    r = resolve_r(LowRankWgrad().r, m, n)
    w = torch.randn(m, n, generator=torch.Generator().manual_seed(0)).to(device)
    lr = LowRankWgrad()
    sync(device)
    t = time.perf_counter()
    exact = exact_right_basis(w, r)
    sync(device)
    t_exact = time.perf_counter() - t
    t = time.perf_counter()
    v1 = randomized_right_basis(w, r, lr.oversample_columns(r), lr.niter, torch.Generator(device=device).manual_seed(0))
    sync(device)
    t_rand = time.perf_counter() - t
    gap = 1 - (w @ v1).square().sum() / (w @ exact).square().sum()
    return {"shape": [m, n], "r": r, "energy_gap": float(gap), "exact_seconds": t_exact, "randomized_seconds": t_rand}


def child_env() -> dict:
    """The environment of a child python: this checkout first on the path, the caller's PYTHONPATH kept (where a
    package such as torchft lives outside site-packages; the GPU check once lost the lighthouse's so)."""
    inherited = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}" + (f":{inherited}" if inherited else "")}


def worker_error(stderr: str) -> str:
    """What a failed torchrun worker said: its traceback (or its one-line error), not torchrun's summary."""
    import re

    lines = [re.sub(r"^\[rank\d+\]:\s?", "", line) for line in stderr.splitlines()]  # (torchrun's prefix of a worker's lines)
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback") or line.startswith(("error:", "stopped:"))]
    shown = lines[starts[0]:starts[1] if len(starts) > 1 else None] if starts else lines  # (the worker's first)
    shown = [line for line in shown if not line.startswith(("W1", "E1"))][:60]
    return "\n".join(shown)[-4000:]


def check_torchrun(device: torch.device, tmp: Path, steps: int) -> dict:
    env = child_env()
    out = {}
    for shard in ("none", "fsdp"):
        run = tmp / f"torchrun-{shard}"
        t = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                                   "-m", "mecefo.train", "--config", str(CONFIGS / "nano.toml"), "--steps", str(steps),
                                   "--ranks", "1", "--backend", "torch", "--shard", shard, "--device", device.type,
                                   "--eval_every", str(steps), "--quiet", "--out", str(run)],
                                  capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
        except subprocess.TimeoutExpired as e:
            proc = subprocess.CompletedProcess(e.cmd, returncode=124, stderr=f"timed out after {e.timeout} s")
        out[shard] = {"exit": proc.returncode, "seconds": time.perf_counter() - t,
                      "backend": "nccl" if device.type == "cuda" else "gloo",
                      "final_val_loss": json.loads((run / "summary.json").read_text())["final_val_loss"]
                      if proc.returncode == 0 else None, "error": worker_error(proc.stderr) if proc.returncode else ""}
    return out


def check_torchft(device: torch.device, tmp: Path) -> dict:
    """Real failures on the device: mecefo.launch (torchft, NCCL on CUDA, each replica on a GPU of its own). Two
    replicas where the node has two devices (the CPU; CUDA with 2 GPUs), rank 1 SIGKILLed after step 6 and restarted
    at step 10, healing from rank 0; one replica on a single GPU (two would share it, which NCCL refuses: the
    launcher says so, checked here too)."""
    import shutil

    if shutil.which("torchft_lighthouse") is None and not Path(sys.executable).with_name("torchft_lighthouse").exists():
        return {"skipped": "torchft is not installed"}
    gpus = torch.cuda.device_count() if device.type == "cuda" else 2
    env = child_env()
    base = [sys.executable, "-m", "mecefo.launch", "--config", str(CONFIGS / "nano.toml"), "--steps", "20",
            "--eval_every", "20", "--device", device.type, "--quiet"]
    out = {}
    ranks = 2 if gpus >= 2 else 1
    run = tmp / "torchft"
    t = time.perf_counter()
    kill = ["--kill", "1:6:10", "--min_step_s", "0.2"] if ranks == 2 else []
    proc = subprocess.run([*base, "--ranks", str(ranks), *kill, "--out", str(run)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    summary = json.loads((run / "summary.json").read_text()) if proc.returncode == 0 else {}
    out["run"] = {"ranks": ranks, "exit": proc.returncode, "seconds": time.perf_counter() - t,
                  "kills": summary.get("backend", {}).get("kills"), "final_val_loss": summary.get("final_val_loss"),
                  "identical": summary.get("rank_agreement", {}).get("identical"), "timing": summary.get("timing"),
                  "error": worker_error(proc.stderr) if proc.returncode else ""}
    if device.type == "cuda":  # one more replica than GPUs: refused before anything starts
        proc = subprocess.run([*base, "--ranks", str(gpus + 1), "--out", str(tmp / "refused")], capture_output=True,
                              text=True, env=env, cwd=ROOT, timeout=120)
        out["refused"] = {"exit": proc.returncode, "line": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""}
    return out


def check_throughput(device: torch.device, name: str, micro_batch: int, seq_len: int, steps: int,
                     compile: bool = False) -> dict:
    """Normal and MeCeFO-neighbour steps alternated on one model (its blocks compiled if asked); returns tokens/s, MFU,
    the time ratio beside the FLOP ratio, memory."""
    from mecefo.config import TrainConfig
    from mecefo.model import compile_blocks

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = preset(name)
    model = GPT(cfg).to(device)
    model.loss_rows = TrainConfig(device=device.type).resolved_loss_rows()
    if compile:
        compile_blocks(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    lowrank = LowRankWgrad().bind(model)
    neighbour = Neighbour(MECEFO, lowrank)
    idx = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len), device=device)
    amp = torch.autocast(device.type, dtype=torch.bfloat16)

    def step(nb: Neighbour | None, micro_batches: int) -> float:
        sync(device)
        t = time.perf_counter()
        for _ in range(micro_batches):
            with amp:
                loss = model(idx, idx, neighbour=nb)
            loss.backward()
        if nb is not None:
            nb.finish()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        return time.perf_counter() - t

    lowrank.prepare(model)
    t0 = time.perf_counter()
    for _ in range(2):  # warm-up (kernels, allocator, V1; the compiler's graphs)
        step(None, 1), step(neighbour, 2)
    warm_up = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    normal, ratios = [], []
    for _ in range(steps):
        a = step(None, 1)
        b = step(neighbour, 2)
        normal.append(a)
        ratios.append(b / a)
    measured_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    shape = Shape(micro_batch, seq_len)
    flops = analytic_flops(cfg, shape, Techniques())["total"]
    nb = analytic_flops(cfg, shape, MECEFO)
    t = statistics.median(normal)
    peak = peak_flops(device)
    predicted = training_memory(cfg, shape, 1, "none", MECEFO)
    return {"preset": name, "parameters": count_parameters(cfg), "micro_batch": micro_batch, "seq_len": seq_len,
            "compiled": compile, "warm_up_seconds": warm_up,
            "tokens_per_s": shape.tokens / t, "step_seconds": t, "flops_per_step": flops,
            "mfu": flops / t / peak if peak else None, "peak_flops": peak,
            "neighbour_over_normal_time": statistics.median(ratios),
            "neighbour_over_normal_flops": (2 * (nb["total"] - nb["wgrad_apply"]) + nb["wgrad_apply"]) / flops,
            "measured_peak_bytes": measured_peak, "predicted_bytes": predicted,
            "measured_over_predicted": measured_peak / predicted["total"] if measured_peak else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="small shapes and few steps (the CPU dry run)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    path = RESULTS / ("gpu_check.json" if device.type == "cuda" else "gpu_check-cpu.json")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu check: no CUDA device here; skipped (use --device cpu --quick for the CPU dry run)")
        return 0
    quick = args.quick
    steps = 8 if quick else 20
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "quick": quick, "git_commit": git_commit(), "packages": package_versions()}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print("1/5 bf16 training with every policy under failures", flush=True)
        result["policies"] = check_policies(device, tmp, steps)
        print("2/5 randomized V1 against the exact SVD", flush=True)
        result["low_rank"] = check_low_rank(device, quick)
        print("3/5 torchrun with one process, unsharded and FSDP2", flush=True)
        result["torchrun"] = check_torchrun(device, tmp, steps)
        print("4/5 torchft: real failures (mecefo.launch)", flush=True)
        result["torchft"] = check_torchft(device, tmp)
    print("5/5 throughput, MFU, neighbour time ratio, peak memory", flush=True)
    sizes = [("nano", 4, 64, 3)] if quick else [("llama-60m", 32, 256, 10), ("llama-130m", 32, 256, 10)]
    result["throughput"] = [check_throughput(device, *s, compile=c) for s in sizes for c in (False, True)]
    result["seconds"] = time.perf_counter() - t0
    ok = (all(p["exit"] == 0 and p["finite"] and p["steps_with_failures"] > 0 for p in result["policies"].values())
          and all(t["exit"] == 0 for t in result["torchrun"].values()) and result["low_rank"]["energy_gap"] < 0.01
          and (result["torchft"].get("skipped") or (result["torchft"]["run"]["exit"] == 0
                                                    and result["torchft"]["run"]["identical"]
                                                    and result["torchft"].get("refused", {"exit": 2})["exit"] == 2)))
    result["ok"] = ok
    atomic_write_json(path, result)
    for t in result["throughput"]:
        mfu = f"MFU {100 * t['mfu']:.1f}%" if t["mfu"] else "MFU n/a (no known peak)"
        mem = (f", peak memory {t['measured_peak_bytes'] / 1e9:.2f} GB vs predicted {t['predicted_bytes']['total'] / 1e9:.2f} GB"
               if t["measured_peak_bytes"] else "")
        print(f"{t['preset']}{' compiled' if t['compiled'] else ''}: {t['tokens_per_s']:.0f} tokens/s, {mfu}, "
              f"neighbour/normal time {t['neighbour_over_normal_time']:.2f} (FLOPs "
              f"{t['neighbour_over_normal_flops']:.2f}){mem}")
    print(f"gpu check {'passed' if ok else 'FAILED'} in {result['seconds']:.0f} s -> {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(guarded(main))

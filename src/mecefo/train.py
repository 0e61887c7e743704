"""The training loop and its CLI:  python -m mecefo.train --config experiments/configs/tiny.toml [--steps 30 ...] --out DIR

DIR receives metrics.jsonl (one line per step; validation lines carry val_loss), checkpoint.pt (written
atomically every train.checkpoint_every steps and at the end) and summary.json (resolved config, final
validation loss and perplexity, commit, package versions). A rerun with the same config reuses a finished
DIR and resumes an interrupted one; bad input exits with status 2 before anything is written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from . import config as config_mod
from .config import Config
from .data import TokenData
from .errors import UsageError
from .model import GPT, count_parameters, preset
from .records import atomic_write_json, git_commit, package_versions


def lr_at(step: int, optim: config_mod.OptimConfig, total_steps: int) -> float:
    """Linear warmup then cosine decay, as a multiple of optim.lr, for the update that makes step+1:
        s < W:  (s + 1) / W
        s >= W: r + (1 - r) * (1 + cos(pi * (s - W) / max(1, S - W))) / 2,   r = min_lr_ratio, S = total steps.
    """
    w, r = optim.warmup_steps, optim.min_lr_ratio
    if step < w:
        return (step + 1) / w
    progress = min(1.0, (step - w) / max(1, total_steps - w))
    return r + (1 - r) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, optim: config_mod.OptimConfig) -> torch.optim.Optimizer:
    if optim.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=optim.lr, momentum=optim.momentum)
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": matrices, "weight_decay": optim.weight_decay}, {"params": vectors, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), fused=False, foreach=True)


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("train.device='cuda' but no CUDA device is available; use --device cpu or auto")
    return torch.device("cuda" if name == "auto" and torch.cuda.is_available() else ("cpu" if name == "auto" else name))


def autocast(device: torch.device, precision: str):
    """bf16 autocast on CUDA by default; plain fp32 on CPU unless bf16 is asked for."""
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def train_step(model: GPT, optimizer: torch.optim.Optimizer, batches, lr: float, grad_clip: float,
               device: torch.device, precision: str) -> tuple[float, float]:
    """One optimizer step on the mean loss of `batches` (the micro-batches of gradient accumulation).
    Returns (loss, gradient norm before clipping); grad_clip = 0 disables clipping."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = 0.0
    for x, y in batches:
        x, y = torch.as_tensor(x, device=device), torch.as_tensor(y, device=device)
        with autocast(device, precision):
            micro_loss = model(x, y) / len(batches)
        micro_loss.backward()
        loss += micro_loss.item()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm.item()


@torch.no_grad()
def evaluate(model: GPT, data: TokenData, split: str, device: torch.device, precision: str) -> float:
    """Mean next-token cross-entropy over the split's fixed evaluation windows."""
    was_training = model.training
    model.eval()
    total, rows = 0.0, 0
    for x, y in data.eval_batches(split):
        with autocast(device, precision):
            loss = model(torch.from_numpy(x).to(device), torch.from_numpy(y).to(device))
        total += loss.item() * len(x)
        rows += len(x)
    model.train(was_training)
    return total / rows


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save_checkpoint(path: Path, step: int, cfg: Config, model, optimizer, wall: float) -> None:
    """Model, optimizer, RNG states and the data position (the step: batches are a pure function of it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save({"step": step, "config_hash": cfg.hash(), "model": model.state_dict(),
                "optimizer": optimizer.state_dict(), "rng": _rng_state(), "wall_time_s": wall}, tmp)
    os.replace(tmp, path)


def _load_checkpoint(path: Path, cfg: Config) -> dict:
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise UsageError(f"checkpoint {path} cannot be read ({type(e).__name__}); delete it to start over") from None
    if ckpt.get("config_hash") != cfg.hash():
        raise UsageError(f"checkpoint {path} belongs to another config (hash {ckpt.get('config_hash')} != "
                         f"{cfg.hash()}); choose another --out")
    return ckpt


def _prepare_out(out: Path, cfg: Config, resume: bool) -> dict | None:
    """Decide what to do with an existing DIR: reuse a finished run, resume, or refuse to overwrite."""
    summary, ckpt = out / "summary.json", out / "checkpoint.pt"
    if summary.exists():
        done = json.loads(summary.read_text())
        if done.get("config_hash") == cfg.hash():
            return done
        raise UsageError(f"--out {out} holds a finished run of another config (hash {done.get('config_hash')}); "
                         "choose another --out")
    if resume and not ckpt.exists():
        raise UsageError(f"--resume given but {ckpt} does not exist")
    if ckpt.exists():
        _load_checkpoint(ckpt, cfg)  # refuses another config's checkpoint before anything is touched
    elif out.exists() and any(out.iterdir()):
        raise UsageError(f"--out {out} is not empty and holds no checkpoint of this config; choose another --out")
    return None


def run(cfg: Config, out: Path, resume: bool = False, stop_after: int | None = None, quiet: bool = False) -> dict:
    """Train cfg for cfg.train.steps steps (or until stop_after, leaving a checkpoint) and return the summary."""
    out = Path(out)
    finished = _prepare_out(out, cfg, resume)
    if finished is not None:
        return finished
    device = resolve_device(cfg.train.device)
    data = TokenData(cfg.data)
    model_cfg = preset(cfg.model.preset, vocab_size=data.vocab_size)
    torch.manual_seed(cfg.train.seed)
    model = GPT(model_cfg).to(device)
    optimizer = build_optimizer(model, cfg.optim)
    out.mkdir(parents=True, exist_ok=True)
    metrics_path, ckpt_path = out / "metrics.jsonl", out / "checkpoint.pt"
    start, wall_before = 0, 0.0
    if ckpt_path.exists():
        ckpt = _load_checkpoint(ckpt_path, cfg)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        _set_rng_state(ckpt["rng"])
        start, wall_before = ckpt["step"], ckpt["wall_time_s"]
        _truncate_metrics(metrics_path, start)
        _log(f"resuming {out} from step {start}", quiet)
    elif metrics_path.exists():
        metrics_path.unlink()

    tc, dc = cfg.train, cfg.data
    tokens_per_step = dc.micro_batch_size * dc.seq_len * dc.grad_accum
    end = min(tc.steps, stop_after) if stop_after is not None else tc.steps
    bar = tqdm(total=tc.steps, initial=start, desc=f"train {cfg.model.preset}", disable=quiet or not sys.stderr.isatty(),
               dynamic_ncols=True)
    t0 = time.perf_counter()
    with open(metrics_path, "a") as metrics:
        def record(row: dict) -> None:
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()

        if start == 0:
            record({"step": 0, "val_loss": evaluate(model, data, "val", device, tc.precision), "tokens_seen": 0})
        for step in range(start, end):
            t_step = time.perf_counter()
            scale = lr_at(step, cfg.optim, tc.steps)
            batches = [data.micro_batch(tc.seed, step, micro=m) for m in range(dc.grad_accum)]
            loss, grad_norm = train_step(model, optimizer, batches, cfg.optim.lr * scale, cfg.optim.grad_clip,
                                         device, tc.precision)
            n, dt = step + 1, time.perf_counter() - t_step
            row = {"step": n, "loss": loss, "lr": cfg.optim.lr * scale, "grad_norm": grad_norm,
                   "tokens_seen": n * tokens_per_step, "tokens_per_s": tokens_per_step / dt,
                   "wall_time_s": wall_before + time.perf_counter() - t0}
            if n % tc.eval_every == 0 or n == tc.steps:
                row["val_loss"] = evaluate(model, data, "val", device, tc.precision)
            record(row)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
            if bar.disable and not quiet and (n % tc.log_every == 0 or n == end):
                _log(f"step {n}/{tc.steps} loss {loss:.4f} lr {row['lr']:.2e} {row['tokens_per_s']:.0f} tok/s"
                     + (f" val_loss {row['val_loss']:.4f}" if "val_loss" in row else ""), quiet)
            if (tc.checkpoint_every and n % tc.checkpoint_every == 0) or n == end:
                save_checkpoint(ckpt_path, n, cfg, model, optimizer, wall_before + time.perf_counter() - t0)
    bar.close()
    if end < tc.steps:
        return {"stopped_at": end}
    val_loss = evaluate(model, data, "val", device, tc.precision)
    test_loss = evaluate(model, data, "test", device, tc.precision)
    summary = {
        "config": cfg.to_dict(), "config_hash": cfg.hash(), "seed": tc.seed, "steps": tc.steps,
        "final_train_loss": loss, "final_val_loss": val_loss, "final_val_ppl": math.exp(val_loss),
        "final_test_loss": test_loss, "final_test_ppl": math.exp(test_loss),
        "n_parameters": count_parameters(model_cfg), "model": model_cfg.__dict__, "tokens_seen": tc.steps * tokens_per_step,
        "wall_time_s": wall_before + time.perf_counter() - t0, "device": str(device),
        "git_commit": git_commit(), "packages": package_versions(),
    }
    atomic_write_json(out / "summary.json", summary)
    _log(f"done: val loss {val_loss:.4f} (ppl {math.exp(val_loss):.2f}) -> {out}", quiet)
    return summary


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines written after the checkpoint we resume from (they will be recomputed)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in keep))


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, flush=True)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, dict[str, str]]:
    parser = argparse.ArgumentParser(prog="python -m mecefo.train", description=__doc__.splitlines()[0],
                                     epilog="Any config field can be overridden: --steps 30 --lr 3e-4 --optim.warmup_steps 10")
    parser.add_argument("--config", help="TOML file (experiments/configs/*.toml); defaults apply without one")
    parser.add_argument("--out", help="output folder (default results/runs/<preset>-<config hash>)")
    parser.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint.pt (must exist)")
    parser.add_argument("--stop-after", type=int, help="stop after this step, leaving a checkpoint (simulates an interruption)")
    parser.add_argument("--quiet", action="store_true")
    args, rest = parser.parse_known_args(argv)
    overrides, i = {}, 0
    while i < len(rest):
        token = rest[i]
        if not token.startswith("--") or token == "--":
            raise UsageError(f"unexpected argument {token!r}; options look like --name value")
        key, eq, value = token[2:].partition("=")
        if not eq:
            if i + 1 >= len(rest) or rest[i + 1].startswith("--"):
                raise UsageError(f"option --{key} needs a value")
            value, i = rest[i + 1], i + 1
        overrides[key.replace("-", "_")] = value
        i += 1
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    try:
        args, overrides = parse_args(argv)
        cfg = config_mod.load(args.config, overrides)
        out = Path(args.out) if args.out else Path("results") / "runs" / f"{cfg.model.preset}-{cfg.hash()}"
        run(cfg, out, resume=args.resume, stop_after=args.stop_after, quiet=args.quiet)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The training loop and its CLI:  python -m mecefo.train --config experiments/configs/tiny.toml [--steps 30 ...] --out DIR

Data-parallel training under failures:  --ranks 8 --failures high --policy mecefo  (one process, simulated
ranks), or under torchrun:  torchrun --nproc_per_node 8 -m mecefo.train ... --ranks 8 --backend torch.

DIR receives config.json (the resolved config, written first), metrics.jsonl (one line per step; validation
lines carry val_loss), checkpoint (a link to the current checkpoint folder, mecefo.checkpoint: written
atomically every train.checkpoint_every steps and at the end) and summary.json (resolved config, final
validation loss and perplexity, commit, package versions). A rerun with the same config reuses a finished
DIR and resumes an interrupted one; bad input exits with status 2 before anything is written.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from . import checkpoint, failures, policies
from . import config as config_mod
from .cluster import BACKENDS, backend_parts
from .config import Config
from .costs import Shape, analytic_flops
from .data import TokenData
from .errors import TrainingStopped, UsageError, guarded
from .membership import REDO, STOP, LeftBehind
from .model import GPT, count_parameters, preset
from .neighbour import LowRankWgrad, Techniques
from .plan import rank_flops
from .records import atomic_write_json, atomic_write_text, git_commit, package_versions
from .runfiles import (CHECKPOINTING, EVALUATING, FINISHED, RunFiles, give_up, missing_folders, prepare_out, read_config,
                       truncate_metrics)
from .runfolder import release_lock, take_lock
from .timing import Clock


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
    fused = all(p.device.type == "cuda" for p in model.parameters())  # one kernel for the whole update on a GPU;
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), fused=fused,  # the CPU's
                             foreach=not fused)  # foreach path as before (its numerics unchanged)


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("train.device='cuda' but no CUDA device is available; use --device cpu or auto")
    return torch.device("cuda" if name == "auto" and torch.cuda.is_available() else ("cpu" if name == "auto" else name))


def autocast(device: torch.device, precision: str):
    """bf16 autocast on CUDA by default; plain fp32 on CPU unless bf16 is asked for."""
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def clip_gradients(model: GPT, grad_clip: float) -> float:
    """Clip the aggregated gradient to norm grad_clip (0: no clipping); returns the norm before clipping."""
    grads = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(grads, grad_clip if grad_clip > 0 else float("inf"))
    return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()


def model_config(cfg: Config, vocab_size: int):
    """The model's shape (mecefo.model.ModelConfig: the preset's, or a Hugging Face config's) and how exactly the
    cost accounting counts it ("exact", or what it leaves out)."""
    if cfg.model.hf_config:
        from .hf import model_config as hf_shape, read_config

        return hf_shape(read_config(cfg.model.hf_config), vocab_size)
    return preset(cfg.model.preset, vocab_size=vocab_size), "exact"


def check_memory(cfg: Config, model_cfg, device: torch.device, rows_per_pass: int, processes: int | None = None,
                 shards: int | None = None) -> None:
    """Refuse, before anything is allocated, a run whose step cannot fit: mecefo.costs.training_memory of one
    pass of rows_per_pass sequences (the local backend runs every rank's micro-batch i in one pass) against
    the device's memory (a CPU's shared by the processes started on it: torchrun's LOCAL_WORLD_SIZE unless
    `processes` says), the model split over `shards` processes under FSDP (default: the ranks). Under
    cluster.neighbour_pass 'fused' a neighbour's pass holds its own and one failed rank's micro-batch (a neighbour
    covering k failed ranks holds k + 1: checked for k = 1, the most any neighbour covers while at most half of the
    ranks are down)."""
    from .costs import training_memory

    cc, dc = cfg.cluster, cfg.data
    fused = cc.neighbour_pass == "fused" and cc.backend != "local"
    need = training_memory(model_cfg, Shape(rows_per_pass, dc.seq_len), shards or cc.ranks, cc.shard,
                           Techniques.parse(cc.techniques), cc.r,
                           neighbour_rows=2 * rows_per_pass if fused else None)["total"]
    if device.type == "cuda":
        have = torch.cuda.get_device_properties(device).total_memory
    else:
        processes = processes or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // processes
    if need > have:
        raise UsageError(f"a training step needs about {need / 2**30:.1f} GiB (mecefo.costs.training_memory: "
                         f"{rows_per_pass} sequences of {dc.seq_len} tokens in one pass, {cc.ranks} ranks, "
                         f"{model_cfg.dim}-wide model) but {device} has {have / 2**30:.1f} GiB; lower cluster.ranks "
                         "or data.micro_batch_size (data.grad_accum keeps the batch)")


EVAL_BATCH = 32


@torch.no_grad()
def evaluate(model: GPT, data: TokenData, split: str, device: torch.device, precision: str) -> float:
    """Mean next-token cross-entropy over the split's fixed evaluation windows (in batches of at least
    EVAL_BATCH windows, whatever the per-rank micro-batch)."""
    was_training = model.training
    model.eval()
    total, rows = 0.0, 0
    for x, y in data.eval_batches(split, max(EVAL_BATCH, data.cfg.micro_batch_size)):
        with autocast(device, precision):
            loss = model(torch.from_numpy(x).to(device), torch.from_numpy(y).to(device))
        total += loss.item() * len(x)
        rows += len(x)
    model.train(was_training)
    return total / rows


@dataclass
class Progress:
    """The run's counters, a checkpoint component."""

    wall_time_s: float = 0.0
    tokens_trained: int = 0
    skipped_steps: int = 0
    furthest: int = 0  # the furthest step reached (a policy may send the run back)
    last_loss: float | None = None

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


class Run:
    """One training run: built from a config, it owns the model, optimizer, data, failure schedule and policy,
    and composes the backend's three parts (mecefo.cluster's registry): its membership (mecefo.membership: who
    is alive at a step, whether the step counts), its step engine (mecefo.engine: how a planned step is
    computed and exchanged) and the run's files (mecefo.runfiles). Its loop (train, step) drives every backend:
    local, torch, FSDP and torchft. Each step it asks the membership for the quorum, the engine for the step,
    the membership whether it commits, the engine for the update, and tells the membership the step's row."""

    def __init__(self, cfg: Config, out: Path, device: torch.device, rank: int = 0, quiet: bool = False, data=None,
                 tensorboard: Path | None = None, **options):
        """data: the token data (default: the config's, mecefo.data.TokenData; the benches inject a fixed batch: any
        object with vocab_size, splits and micro_batch(seed, step, rank, micro, n_ranks)); options: the
        membership's own (mecefo.ft: the replica's lighthouse, pacing, rejoining, group)."""
        self.cfg, self.out, self.device, self.quiet = cfg, Path(out), device, quiet
        cc, tc = cfg.cluster, cfg.train
        membership, engine = backend_parts(cc)
        self.clock = Clock()  # where each step's time goes (mecefo.timing), given to the membership and the engine
        self.membership = membership(cfg, rank, device, clock=self.clock, **options)
        self.files = self.membership.files(self.out)
        self.board = None
        if tensorboard is not None and self.files.metrics_path() is not None:  # (the process that writes the rows)
            from .board import Board

            self.board = Board(tensorboard)
        self.data = data if data is not None else membership.open_data(cfg, rank == 0)
        self.model_cfg, self.cost_accounting = model_config(cfg, self.data.vocab_size)
        check_memory(cfg, self.model_cfg, device, engine.rows_per_pass(cfg), shards=membership.shards(cfg))
        if cfg.model.hf_config:  # a Hugging Face model (mecefo.hf), seeded as ours
            from .hf import HFCausalLM, read_config

            torch.manual_seed(tc.seed)
            self.model = HFCausalLM(read_config(cfg.model.hf_config)).to(device)
        else:
            self.model = engine.build_model(self.model_cfg, device, tc.seed, compile=tc.compile)
            self.model.loss_rows = tc.resolved_loss_rows()
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.schedule = failures.for_run(cfg)
        self.policy = policies.get(cc.policy, trainer=True)(cc)
        self.lowrank = LowRankWgrad(r=cc.r, tau=cc.low_rank_tau, svd=cc.low_rank_svd, seed=tc.seed).bind(self.model)
        self.engine = engine(self.model, self.data, tc.seed, device, self.lowrank, lambda: autocast(device, tc.precision),
                             n_ranks=cc.ranks, rank=rank, low_rank_refresh=cc.low_rank_refresh,
                             neighbour_pass=cc.neighbour_pass, clock=self.clock, **self.membership.engine_options(cc.shard))
        self.flops = _FlopModel(self.model_cfg, cfg.data, cc.r)
        self.progress = Progress()
        self.components = self.engine.components(self.optimizer) | {
            "rng": checkpoint.RNG(), "lowrank": self.lowrank, "policy": self.policy, "progress": self.progress}
        self.tokens_per_step = cfg.data.micro_batch_size * cfg.data.seq_len * cfg.data.grad_accum * cc.ranks
        self.metrics = None
        self.warm = None  # where the run started from another's warm start: its folder and step

    def start(self, resume: bool, warm: Path | None = None) -> int | None:
        """Resume from the run's checkpoint (rank 0 has decided that it exists), or start afresh (from the warm
        start `warm` if given: warm_start), and join the peers; returns the first step (None: the run finished
        before this process could join it)."""
        metrics_path, owner = self.files.metrics_path(), self.files.owns_out()
        start = 0
        if resume:
            start = self.engine.restore(self.files.checkpoint_path(), self.cfg.hash(), self.components, self.optimizer)
            if owner:
                truncate_metrics(metrics_path, start)
            _log(f"resuming {self.out} from step {start}", self.quiet)
        elif owner and metrics_path.exists():
            metrics_path.unlink()
        if warm is not None and not resume:
            start = self.warm_start(warm)
            _log(f"{self.out} starts at step {start}, the warm start {warm}", self.quiet)
        if owner:
            self.files.write_config(self.cfg)
        joined = self.membership.connect(self.components, start, self.engine)
        if joined is None:
            return None
        self.metrics = open(metrics_path, "a") if metrics_path else None
        _log(_schedule_line(self.cfg, self.schedule), self.quiet)
        if joined == 0:  # (a torchft replica that healed joined its peers' later step: no step-0 row)
            self.record({"step": 0, "val_loss": self.evaluate("val"), "tokens_seen": 0})
        return joined

    def warm_start(self, warm: Path) -> int:
        """Continue from the checkpoint of the run in folder `warm`, made by warm_config(cfg) and stopped at step W:
        the model, the optimizer, the generators, the low-rank state and the counters at W, and its metrics rows up
        to W. Equal to training steps 0 .. W - 1 here (tests/test_warm_start.py: bit for bit) where nothing that
        warm_config neutralises acts before W: this run's failures all fall at W or later (checked) and its policy
        holds no state at W (checked: checkpoint-restart's snapshot does). On the local backend (one process)."""
        if self.cfg.cluster.backend != "local":
            raise UsageError(f"a warm start is for the local backend, not cluster.backend={self.cfg.cluster.backend!r}")
        theirs = config_mod.build(read_config(warm, "a run stopped at its warm start"))
        if theirs.hash() != warm_config(self.cfg).hash():
            raise UsageError(f"{warm} is not this run's warm start: its config differs in more than the failures, the "
                             "policy, the techniques and the failable ranks")
        path = RunFiles(warm, True).checkpoint_path()
        ckpt = checkpoint.load(path, theirs.hash())
        if ckpt["policy"] or self.policy.state_dict():
            raise UsageError(f"cluster.policy={self.cfg.cluster.policy!r} holds state at a warm start: train from step 0")
        if any(self.schedule.failed[s] for s in range(min(ckpt["step"], len(self.schedule.failed)))):
            raise UsageError(f"the run's failures begin before its warm start's step {ckpt['step']}")
        checkpoint.load_tensors(path, self.model, self.optimizer)
        start = checkpoint.restore(ckpt, {k: c for k, c in self.components.items() if k != "policy"})
        self.warm = {"run": str(warm), "step": start}
        if self.files.owns_out():
            rows = [line for line in (warm / "metrics.jsonl").read_text().splitlines() if line and json.loads(line)["step"] <= start]
            atomic_write_text(self.files.metrics_path(), "".join(line + "\n" for line in rows))
        return start

    def record(self, row: dict) -> None:
        if self.metrics:
            self.metrics.write(json.dumps(row) + "\n")
            self.metrics.flush()
            if self.board is not None:
                self.board.row(row)

    def evaluate(self, split: str, plan=None) -> float | None:
        """The split's loss (None in processes that do not evaluate at this step, and for a split the data has
        not, e.g. C4's test)."""
        if split not in self.data.splits or not self.membership.io(plan):
            return None
        self.engine.sync_for_io(self.optimizer)
        if self.membership.writes(plan) or self.engine.evaluates_with_writer:
            self.files.status(f"{EVALUATING} {self.progress.furthest}")
            with self.clock("evaluate"):
                return evaluate(self.model, self.data, split, self.device, self.cfg.train.precision)
        return None

    def save(self, step: int, plan=None) -> None:
        if not self.membership.io(plan):
            return
        self.engine.sync_for_io(self.optimizer)
        if not self.engine.parameters_finite():  # a finite loss can still be followed by a non-finite update
            raise TrainingStopped(f"step {step}: the parameters are not finite after the update; the last checkpoint "
                                  f"in {self.out} is kept")
        self.files.status(f"{CHECKPOINTING} {step}")
        writer, collective = self.membership.writes(plan), self.engine.collective_checkpoint
        with self.clock("checkpoint"):
            tensors = self.engine.checkpoint_tensors(self.optimizer) if writer or collective else None
            self.files.write_checkpoint(step, self.cfg.hash(), checkpoint.gather(self.components), tensors, writer=writer,
                                        collective=collective, keep=self.cfg.train.keep_checkpoints)
        self.files.status(f"step {step}")

    def step(self, step: int, down: frozenset[int]) -> tuple[dict | None, object]:
        """Train step `step` (0-based) with the ranks `down` failed, under the policy; returns its metrics row
        (None: the step did not commit, torchft's peer died during it, and is redone) and its plan."""
        cc, dc = self.cfg.cluster, self.cfg.data
        t0 = time.perf_counter()
        plan = self.policy.plan(step, down, cc.ranks, dc.grad_accum, dc.micro_batch_size, cc.all_down)
        lr = self.cfg.optim.lr * lr_at(step, self.cfg.optim, self.cfg.train.steps)
        t_reference = time.perf_counter()
        exact = _failure_free_gradient(self.engine, plan, self.cfg, self.optimizer) \
            if cc.track_grad_error and plan.failed and not plan.skipped else None
        t0 += time.perf_counter() - t_reference  # tokens/s of the step itself, without the tracking
        with self.clock("compute"):
            result = self.engine.compute(plan, self.optimizer)
        rel_error = _relative_error(self.model, exact) if exact is not None else None
        loss = grad_norm = None
        if not plan.skipped:
            loss, grad_norm = result.loss, clip_gradients(self.model, self.cfg.optim.grad_clip)
        with self.clock("commit"):
            verdict = self.membership.finish(plan, plan.skipped or (math.isfinite(loss) and math.isfinite(grad_norm)))
        if verdict == STOP:
            raise TrainingStopped(f"step {step + 1}: non-finite training loss {loss} or gradient norm {grad_norm} "
                                  f"(lr {lr:.3g}); nothing written for this step, the last checkpoint in "
                                  f"{self.out} is kept")
        if verdict == REDO:  # torchft: a peer died during the step, which is redone
            self.model.zero_grad(set_to_none=True)
            return None, plan
        with self.clock("update"):
            self.engine.update(plan, self.optimizer, lr)
        p = self.progress
        p.last_loss = loss if loss is not None else p.last_loss
        p.tokens_trained += result.samples * dc.seq_len
        p.skipped_steps += plan.skipped
        per_rank = self.flops.per_rank(plan)
        row = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm,
               "tokens_seen": (step + 1) * self.tokens_per_step, "tokens_trained": p.tokens_trained,
               "samples": result.samples, "tokens_per_s": result.samples * dc.seq_len / (time.perf_counter() - t0),
               "down": sorted(down), "failed": sorted(plan.failed), "neighbours": {str(j): nb for j, nb in plan.neighbours.items()},
               "attention_ranks": plan.counts(1)["attention.0"] / dc.grad_accum, "skipped": plan.skipped,
               "busiest_rank_flops": max(per_rank.values(), default=0) / self.flops.normal_rank,
               "replayed_steps": self.policy.replayed_steps, "replay": step + 1 <= p.furthest, "grad_rel_error": rel_error,
               "backend": self.membership.extras()}
        p.furthest = max(p.furthest, step + 1)
        return row, plan

    def train(self, start: int, end: int) -> None:
        """Steps start .. end - 1, with evaluation, logging and checkpoints on their cadence."""
        tc = self.cfg.train
        bar = tqdm(total=tc.steps, initial=start, desc=f"train {self.cfg.model.preset}", dynamic_ncols=True,
                   disable=self.quiet or not sys.stderr.isatty())
        t_last, step, was_skipped = time.perf_counter(), start, False
        while True:
            quorum = self.membership.quorum(step, self.schedule, end)
            step = quorum.step
            if step >= end:
                break
            back = self.policy.before_step(step, self.schedule, self.model, self.optimizer)
            if back is not None:  # the policy sends the run back (checkpoint-restart's rollback)
                step = back
                continue
            row, plan = self.step(step, quorum.failed) if quorum.failed is not None else (None, None)
            if row is None:
                _log(f"step {step + 1} not committed (a peer failed during it); redoing it", self.quiet)
                self.membership.end_step(None)
                continue
            step += 1
            self.policy.after_step(step, self.model, self.optimizer)
            now = time.perf_counter()  # added to the counter (which a torchft heal replaces with its peer's)
            self.progress.wall_time_s += now - t_last
            row["wall_time_s"], t_last = self.progress.wall_time_s, now
            if step % tc.eval_every == 0 or step == tc.steps:
                val_loss = self.evaluate("val", plan)
                if val_loss is not None:
                    row["val_loss"] = val_loss
            row["timing"] = self.clock.row()
            self.record(row)
            self.membership.end_step(row)
            bar.update(1)
            bar.set_postfix(loss="skipped" if plan.skipped else f"{row['loss']:.3f}", failed=len(plan.failed))
            if plan.skipped and not was_skipped:
                _log(f"step {step}/{tc.steps}: all {self.cfg.cluster.ranks} ranks down, skipping steps until one "
                     "recovers", self.quiet)
            was_skipped = plan.skipped
            if bar.disable and (step % tc.log_every == 0 or step == end):
                what = "skipped (all ranks down)" if plan.skipped else f"loss {row['loss']:.4f}"
                _log(f"step {step}/{tc.steps} {what} lr {row['lr']:.2e} failed {len(plan.failed)} "
                     f"{row['tokens_per_s']:.0f} tok/s" + (f" val_loss {row['val_loss']:.4f}" if row.get("val_loss") else ""),
                     self.quiet)
            if (tc.checkpoint_every and step % tc.checkpoint_every == 0) or step == end:
                self.save(step, plan)
        bar.close()
        if self.metrics:
            self.metrics.close()
        if self.board is not None:
            self.board.close()

    def summary(self) -> dict:
        """Final evaluation; the process the backend names writes summary.json (torchft: each replica its own,
        which the launcher merges) and prints the last line."""
        tc, p = self.cfg.train, self.progress
        val_loss, test_loss = self.evaluate("val"), self.evaluate("test")
        agreement = self.engine.agreement()
        digest = agreement.pop("digest", None)
        path = self.files.summary_path()
        if path is None:
            return {}
        summary = {
            "config": self.cfg.to_dict(), "config_hash": self.cfg.hash(), "seed": tc.seed, "steps": tc.steps,
            "final_train_loss": p.last_loss, "final_val_loss": val_loss, "final_val_ppl": math.exp(val_loss),
            "final_test_loss": test_loss, "final_test_ppl": None if test_loss is None else math.exp(test_loss),
            "splits": self.data.splits,
            "n_parameters": sum(p.numel() for p in self.model.parameters()) if self.cfg.model.hf_config else
            count_parameters(self.model_cfg), "model": self.model_cfg.__dict__, "cost_accounting": self.cost_accounting,
            "tokens_seen": tc.steps * self.tokens_per_step, "tokens_trained": p.tokens_trained,
            "replayed_steps": self.policy.replayed_steps, "skipped_steps": p.skipped_steps,
            "skipped_fraction": p.skipped_steps / tc.steps, "rank_agreement": agreement,
            "failure_schedule": {"fraction_failed": self.schedule.fraction_failed(), "events": self.schedule.failure_events()},
            "wall_time_s": p.wall_time_s, "warm_start": self.warm,
            "timing": self.clock.summary(), "device": str(self.device), "git_commit": git_commit(),
            "packages": package_versions(), "backend": {"name": self.cfg.cluster.backend, **self.membership.summary_extras(digest)},
        }
        atomic_write_json(path, summary)
        warning = ""
        if p.skipped_steps > tc.steps / 2:
            warning = (f"; warning: {p.skipped_steps} of {tc.steps} steps ({100 * summary['skipped_fraction']:.0f}%) "
                       "were skipped with every rank down")
        _log(f"done: val loss {val_loss:.4f} (ppl {math.exp(val_loss):.2f}) -> {self.out}{warning}", self.quiet)
        return summary


def warm_config(cfg: Config) -> Config:
    """The config of cfg's warm start (cluster.failure_free_steps > 0: steps every policy of a seed trains alike):
    cfg without what acts only once failures begin (no failures, the default policy, techniques and failable ranks).
    Every cell of a sweep that differs only in those shares it (Run.warm_start)."""
    return config_mod.with_overrides(cfg, cluster={"failures": "none", "policy": "mecefo", "techniques": "mecefo", "failable": ""})


def run(cfg: Config, out: Path, resume: bool = False, stop_after: int | None = None, quiet: bool = False,
        tensorboard: Path | None = None, warm_start: Path | None = None, **options) -> dict:
    """Train cfg for cfg.train.steps steps (or until stop_after, leaving a checkpoint) and return the summary.
    warm_start: the folder of warm_config(cfg)'s run stopped at its warm start, to start from (Run.warm_start) where
    OUT holds no checkpoint of its own.
    Every process of the run calls run(): under the torch backend every rank (rank 0 alone writes files and prints),
    under torchft every process of every replica (mecefo.ft.replica; options: the replica's, for its membership).
    Returns {"joined": False} where a torchft replica found the run finished before it could join it, and
    {"left_behind": step} where it woke after the run had finished without it."""
    if stop_after is not None and stop_after < 1:
        raise UsageError(f"--stop-after {stop_after} must be at least 1 (the step after which to stop)")
    membership, _ = backend_parts(cfg.cluster)
    rank, device, main, options = membership.setup(cfg, resolve_device(cfg.train.device), **options)
    out, held = Path(out), []

    def prepare() -> dict:
        """Where OUT is decided for the run: OUT's lock, taken before OUT is read or written and held while this
        process trains into it (a second run on the same OUT is refused meanwhile), then what to do with OUT."""
        made = missing_folders(out)
        take_lock(out)
        held.append(out)
        try:
            return prepare_out(out, cfg, resume) | {"made": made}
        except BaseException:
            give_up(out, made)
            raise

    decision = membership.agree(prepare, device, options)
    made = decision.pop("made", [])
    if decision["finished"] is not None:
        if held:
            release_lock(out)
        return decision["finished"]
    try:
        training = Run(cfg, out, device, rank, quiet or not main, tensorboard=tensorboard, **options)
    except BaseException:
        if held:
            give_up(out, made)
        raise
    try:
        start = training.start(decision["resume"], warm_start)
        if start is None:  # (a torchft replica: the run finished before it could join)
            return {"joined": False}
        end = min(cfg.train.steps, stop_after) if stop_after is not None else cfg.train.steps
        training.train(start, end)
        if end < cfg.train.steps:
            return {"stopped_at": end}
        summary = training.summary()
        training.files.status(FINISHED)
        return summary
    except LeftBehind as e:
        training.membership.left_behind(e)
        return {"left_behind": e.step}
    finally:
        training.membership.close()
        if held:
            release_lock(out)


def _failure_free_gradient(engine, plan, cfg: Config, optimizer) -> list[torch.Tensor]:
    """The aggregated gradient the same step would have had without failures (same batches), computed by
    the ranks alive at this step: each failed rank's micro-batches exactly by its neighbour (ndb-exact's
    plan), so that no rank whose state was lost takes part."""
    reference = policies.plan_step("ndb-exact", plan.step, plan.failed, cfg.cluster.ranks, cfg.data.grad_accum,
                                   cfg.data.micro_batch_size)
    engine.compute(reference, optimizer)
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in engine.model.parameters()]


def _relative_error(model: GPT, exact: list[torch.Tensor]) -> float:
    """mecefo.stats.relative_error of the aggregated gradient against the failure-free one, all parameters."""
    from .stats import relative_error  # (here: scipy, which mecefo.stats imports, costs every replica's start ~1 s)

    return relative_error([p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()], exact)


def _schedule_line(cfg: Config, schedule: failures.Schedule) -> str:
    cc = cfg.cluster
    hours = cfg.train.steps * cc.seconds_per_step / 3600
    if cc.failures in failures.SCENARIOS or cc.failures.startswith("custom:"):
        sc = failures.scenario(cc.failures)
        expected = (f"expected: {100 * sc.expected_failed_fraction():.2f}% of ranks failed, "
                    f"{sc.expected_events(cc.ranks, hours):.1f} failure events")
    else:
        expected = "replayed trace"
    return (f"failures {cc.failures} on {cc.ranks} ranks over {hours:.1f} h ({cc.seconds_per_step:g} s/step): "
            f"{expected}; this schedule: {100 * schedule.fraction_failed():.2f}%, {schedule.failure_events()} events; "
            f"policy {cc.policy}")


class _FlopModel:
    """Per-rank FLOPs of a step from mecefo.costs' closed forms (equal to FlopCounterMode's counts)."""

    def __init__(self, model_cfg, dc, r: float):
        self.model_cfg, self.seq_len, self.r = model_cfg, dc.seq_len, r
        self.normal_rank = dc.grad_accum * self.piece(dc.micro_batch_size, Techniques())
        self.apply = analytic_flops(model_cfg, Shape(1, dc.seq_len), Techniques(low_rank_wgrad=True), r)["wgrad_apply"]

    @functools.lru_cache(maxsize=64)
    def piece(self, rows: int, techniques: Techniques) -> int:
        f = analytic_flops(self.model_cfg, Shape(rows, self.seq_len), techniques, self.r)
        return f["total"] - f["wgrad_apply"]

    def per_rank(self, plan) -> dict[int, int]:
        return rank_flops(plan, self.piece, self.apply)


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, flush=True)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, dict[str, str]]:
    parser = argparse.ArgumentParser(prog="python -m mecefo.train", description=__doc__.splitlines()[0], allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=config_mod.fields_help() + "\n\npolicies (--policy):\n" + "\n".join(
                                         f"  {n}: {c.summary}" for n, c in policies.registry().items() if c.trains)
                                     + "\n\nbackends (--backend):\n" + "\n".join(
                                         f"  {b.name}: {b.summary} (started by {b.started_by})" for b in BACKENDS.values()))
    parser.add_argument("--config", help="TOML file (experiments/configs/*.toml); defaults apply without one")
    parser.add_argument("--out", help="output folder (default results/runs/<preset>-<config hash>)")
    parser.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint (must exist)")
    config_mod.add_flag(parser, "stop-after", type=int, help="stop after this step, leaving a checkpoint (simulates an interruption)")
    parser.add_argument("--tensorboard", metavar="DIR", help="also write TensorBoard scalars to DIR (mecefo.board; "
                        "pip install -e .[tb])")
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


def _leave_process_group(wait: bool) -> None:
    """Under torchrun: leave together (a rank that exits while another is mid-collective aborts it)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if wait:
            dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    def train() -> int:
        try:
            args, overrides = parse_args(argv)
            cfg = config_mod.load(args.config, overrides)
            out = Path(args.out) if args.out else Path("results") / "runs" / f"{cfg.model.preset}-{cfg.hash()}"
            run(cfg, out, resume=args.resume, stop_after=args.stop_after, quiet=args.quiet,
                tensorboard=Path(args.tensorboard) if args.tensorboard else None)
            _leave_process_group(wait=True)
        finally:
            _leave_process_group(wait=False)
        return 0

    return guarded(train, "interrupted: the last checkpoint is kept; --resume continues from it")


def cli() -> None:
    """The console entry point (python -m mecefo.train, mecefo-train)."""
    code = main()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: skip interpreter teardown, where gloo's worker
        sys.stdout.flush()                    # threads can abort the process after a clean finish
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    cli()

"""Benchmark: tokens/s of our training step against a plain reference implementation of the same
architecture and shapes, written here from nn.Linear and F.scaled_dot_product_attention and nothing else.
Ours is the trainer's own step (mecefo.train.Run.step of `--ranks 1 --failures none --policy mecefo`: step
plan, the engine's step with the neighbour hooks in place, aggregation, clipping, the membership's commit,
AdamW, the metrics row) on the benchmark's batch, injected as the run's data: it must cost nothing extra
while no failure is active.

    python -m experiments.bench_train [--quick] [--preset tiny] [--rounds 7] [--steps 10]

Both models start from the same weights and train on the same batches with the same AdamW settings and
gradient clipping. Timing alternates ours / reference in each round (A B, then B A) so drift of the
machine hits both;
the reported ratio is the median over rounds of (our tokens/s) / (reference tokens/s). Target: >= 0.95.
Writes results/bench/train-<preset>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from mecefo import config as config_mod
from mecefo.model import ModelConfig, preset
from mecefo.records import atomic_write_json, git_commit, package_versions
from mecefo.train import Run

from .common import RESULTS, guarded


class PlainGPT(nn.Module):
    """The reference: one flat module, the LLaMA block written inline."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d, f = cfg.dim, cfg.ffn_dim
        self.emb = nn.Embedding(cfg.vocab_size, d)
        self.qkvo = nn.ModuleList(nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(4)) for _ in range(cfg.n_layers))
        self.ffn = nn.ModuleList(nn.ModuleList([nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False),
                                                nn.Linear(f, d, bias=False)]) for _ in range(cfg.n_layers))
        self.norms = nn.Parameter(torch.ones(2 * cfg.n_layers + 1, d))
        self.head = nn.Linear(d, cfg.vocab_size, bias=False)
        hd = cfg.head_dim
        ang = torch.outer(torch.arange(cfg.max_seq_len).float(), cfg.rope_theta ** (-torch.arange(0, hd, 2).float() / hd))
        ang = torch.cat([ang, ang], -1)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def norm(self, x, i):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps) * self.norms[i]

    def rope(self, x, t):
        h = x.shape[-1] // 2
        return x * self.cos[:t] + torch.cat([-x[..., h:], x[..., :h]], -1) * self.sin[:t]

    def forward(self, idx, targets):
        b, t = idx.shape
        nh, hd = self.cfg.n_heads, self.cfg.head_dim
        x = self.emb(idx)
        for i, ((q, k, v, o), (g, u, dn)) in enumerate(zip(self.qkvo, self.ffn)):
            h = self.norm(x, 2 * i)
            qh, kh, vh = (m(h).view(b, t, nh, hd).transpose(1, 2) for m in (q, k, v))
            a = F.scaled_dot_product_attention(self.rope(qh, t), self.rope(kh, t), vh, is_causal=True)
            x = x + o(a.transpose(1, 2).reshape(b, t, -1))
            h = self.norm(x, 2 * i + 1)
            x = x + dn(F.silu(g(h)) * u(h))
        logits = self.head(self.norm(x, 2 * self.cfg.n_layers))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    @torch.no_grad()
    def copy_from(self, ours) -> None:
        self.emb.weight.copy_(ours.embedding.weight)
        self.head.weight.copy_(ours.lm_head.weight)
        for i, blk in enumerate(ours.layers):
            a, f = blk.attention, blk.ffn
            for mine, theirs in zip(self.qkvo[i], (a.q_proj, a.k_proj, a.v_proj, a.o_proj)):
                mine.weight.copy_(theirs.weight)
            for mine, theirs in zip(self.ffn[i], (f.gate_proj, f.up_proj, f.down_proj)):
                mine.weight.copy_(theirs.weight)
            self.norms[2 * i].copy_(blk.attention_norm.weight)
            self.norms[2 * i + 1].copy_(blk.ffn_norm.weight)
        self.norms[-1].copy_(ours.norm.weight)


class FixedBatch:
    """The benchmark's one batch as the run's data (every step, every rank)."""

    splits = ("val",)

    def __init__(self, x, y, vocab_size: int):
        self.x, self.y, self.vocab_size = x.numpy(), y.numpy(), vocab_size

    def micro_batch(self, seed, step, rank=0, micro=0, n_ranks=1):
        return self.x, self.y


def trainer(preset_name: str, batch: FixedBatch, seq_len: int, lr: float, clip: float) -> Run:
    """The trainer of `--ranks 1 --failures none --policy mecefo` on the batch: AdamW at a constant lr (no
    warm-up, no decay), no weight decay, clipping at `clip`; nothing is written (no step is recorded)."""
    cfg = config_mod.load(None, {"preset": preset_name, "seq_len": str(seq_len), "micro_batch_size": str(len(batch.x)),
                                 "ranks": "1", "failures": "none", "policy": "mecefo", "lr": str(lr),
                                 "warmup_steps": "0", "min_lr_ratio": "1.0", "weight_decay": "0.0", "beta2": "0.95",
                                 "grad_clip": str(clip), "device": "cpu", "precision": "fp32"})
    return Run(cfg, RESULTS / "bench" / "unused", torch.device("cpu"), quiet=True, data=batch)


def our_step(training: Run, step: int) -> float:
    """The trainer's step (mecefo.train.Run.step) with no rank down."""
    row, _ = training.step(step, frozenset())
    return row["loss"]


def plain_step(model, opt, x, y, clip):
    loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps (CI)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round per implementation")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 6, 5
    torch.manual_seed(0)
    cfg = preset(args.preset, vocab_size=args.vocab_size)
    x = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len))
    y = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len))
    training = trainer(args.preset, FixedBatch(x, y, args.vocab_size), args.seq_len, lr=1e-3, clip=1.0)
    ours = training.model
    ref = PlainGPT(cfg)
    ref.copy_from(ours)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, foreach=True)
    first = (our_step(training, 0), plain_step(ref, opt_ref, x, y, 1.0))
    tokens = args.batch_size * args.seq_len * args.steps
    def time_ours():
        t = time.perf_counter()
        for i in range(args.steps):
            our_step(training, i)
        return time.perf_counter() - t

    def time_ref():
        t = time.perf_counter()
        for _ in range(args.steps):
            plain_step(ref, opt_ref, x, y, 1.0)
        return time.perf_counter() - t

    rounds = []
    for i in range(args.rounds):  # A B, then B A: neither goes first every time
        if i % 2 == 0:
            t_ours, t_ref = time_ours(), time_ref()
        else:
            t_ref, t_ours = time_ref(), time_ours()
        rounds.append({"ours_tokens_per_s": tokens / t_ours, "reference_tokens_per_s": tokens / t_ref,
                       "ratio": t_ref / t_ours})
    ratio = statistics.median(r["ratio"] for r in rounds)
    result = {"preset": args.preset, "model": cfg.__dict__, "batch_size": args.batch_size, "seq_len": args.seq_len,
              "steps_per_round": args.steps, "rounds": rounds, "median_ratio": ratio, "target": 0.95,
              "first_step_losses": {"ours": first[0], "reference": first[1]},
              "threads": torch.get_num_threads(), "git_commit": git_commit(), "packages": package_versions()}
    path = RESULTS / "bench" / f"train-{args.preset}.json"
    atomic_write_json(path, result)
    print(f"ours / plain reference tokens/s: median {ratio:.3f} over {args.rounds} rounds "
          f"(target >= 0.95; first-step losses {first[0]:.5f} vs {first[1]:.5f}) -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))

"""A LLaMA-style decoder: RMSNorm, rotary position embeddings, causal SDPA attention, SwiGLU FFN.

Shapes: B batch, T sequence, D model width (`dim`), H heads, hd = D / H head width, F FFN width, V vocab.
Each block is pre-norm:  h = x + Attention(RMSNorm(x));  out = h + FFN(RMSNorm(h)).
No biases anywhere; the LM head is not tied to the embedding.

`Block.attention` and `Block.ffn` are separate submodules with stable names: the MeCeFO neighbour
techniques (mecefo.neighbour) wrap the block's two sublayers per micro-batch, reusing their forward.

The model's structure is stated here once, for the aggregation rule, the neighbour, the cost accounting
and the analysis: `group_of` maps a parameter to its group (attention of layer l with its RMSNorm, FFN of
layer l with its RMSNorm, embedding, head, final norm) and `ffn_linears` lists the FFN matrices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .loss import chunked_cross_entropy


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    ffn_dim: int
    max_seq_len: int = 1024
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head width dim/n_heads={self.dim // self.n_heads} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# The paper's shapes are those of the GaLore lineage of LLaMA configs (see docs/paper.md);
# nano/tiny/small are ours, sized for tests, CPU experiments and a mid-size CPU check.
PRESETS: dict[str, ModelConfig] = {
    "nano": ModelConfig(vocab_size=512, dim=32, n_layers=2, n_heads=4, ffn_dim=96, max_seq_len=256),
    "tiny": ModelConfig(vocab_size=4096, dim=128, n_layers=4, n_heads=4, ffn_dim=352, max_seq_len=512),
    "small": ModelConfig(vocab_size=4096, dim=384, n_layers=10, n_heads=6, ffn_dim=1024, max_seq_len=512),
    "llama-60m": ModelConfig(vocab_size=32000, dim=512, n_layers=8, n_heads=8, ffn_dim=1376),
    "llama-130m": ModelConfig(vocab_size=32000, dim=768, n_layers=12, n_heads=12, ffn_dim=2048),
    "llama-350m": ModelConfig(vocab_size=32000, dim=1024, n_layers=24, n_heads=16, ffn_dim=2736),
    "llama-1b": ModelConfig(vocab_size=32000, dim=2048, n_layers=24, n_heads=32, ffn_dim=5461),
    "llama-7b": ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_dim=11008),
}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


def count_parameters(cfg: ModelConfig) -> int:
    """Closed form:  2 V D  (embedding + untied head)  +  L (4 D^2 + 3 D F + 2 D)  +  D  (final norm).

    Per layer: q, k, v, o projections (4 D^2), SwiGLU gate/up/down (3 D F), two RMSNorm weights (2 D).
    """
    v, d, f, n = cfg.vocab_size, cfg.dim, cfg.ffn_dim, cfg.n_layers
    return 2 * v * d + n * (4 * d * d + 3 * d * f + 2 * d) + d


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, statistics in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm's formula (the module's forward, and mecefo.neighbour.NeighbourFFN's recomputation)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y.type_as(x) * weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (max_seq_len, head_dim): angle(t, i) = t * theta^(-2i/hd), i < hd/2, repeated twice."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + hd/2) of x (B, H, T, hd) by angle(t, i):  x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).type_as(x)


class Attention(nn.Module):
    """Causal multi-head self-attention with RoPE on queries and keys."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.o_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    """SwiGLU:  down( silu(gate(x)) * up(x) ).  `project(linear, x)`, when given, computes each projection
    in place of linear(x) (the neighbour's low-rank weight gradient)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, project=None) -> torch.Tensor:
        if project is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return project(self.down_proj, F.silu(project(self.gate_proj, x)) * project(self.up_proj, x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def attention_sublayer(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.attention(self.attention_norm(x), cos, sin)

    def ffn_sublayer(self, h: torch.Tensor, project=None) -> torch.Tensor:
        return self.ffn(self.ffn_norm(h), project)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neighbour=None) -> torch.Tensor:
        if neighbour is None:
            h = x + self.attention(self.attention_norm(x), cos, sin)
            return h + self.ffn(self.ffn_norm(h))
        # a MeCeFO neighbour's micro-batch (mecefo.neighbour): the same sublayers, wrapped
        h = x + neighbour.attention(self.attention_sublayer, x, cos, sin)
        return h + neighbour.ffn(self, h)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.loss_rows = 0  # the loss in chunks of this many rows (mecefo.loss); 0: the whole logits at once
        self.reset_parameters()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the RoPE tables in place (after `to_empty`, which leaves buffers uninitialised)."""
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """N(0, 0.02) for embedding and projections; residual-output projections (o_proj, down_proj)
        scaled by 1/sqrt(2 L) as in GPT-2; norm weights 1. (Meta tensors, shapes without values, are left alone:
        torch's random init on the meta device imports its compiler, about a second of every process's start.)"""
        for name, p in self.named_parameters():
            if p.is_meta:
                continue
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            else:
                std = 0.02 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, neighbour=None):
        """idx (B, T) token ids -> logits (B, T, V); with targets (B, T), the mean next-token cross-entropy.
        neighbour: None for normal mode, or a mecefo.neighbour.Neighbour for this micro-batch."""
        t = idx.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len={self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.embedding(idx)
        for layer in self.layers:
            x = layer(x, cos, sin, neighbour)
        x = self.norm(x)
        if targets is not None and self.loss_rows and not (neighbour and neighbour.techniques.low_rank_head):
            return chunked_cross_entropy(x, self.lm_head.weight, targets, self.loss_rows)
        logits = self.lm_head(x) if neighbour is None else neighbour.head(self.lm_head, x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


COMPILE_BACKEND = "inductor"  # torch.compile's backend for compile_blocks (tests trace with "aot_eager": no codegen)


def compile_blocks(model: GPT) -> GPT:
    """torch.compile every block in place (each block's call: one graph per block shape, the blocks sharing it; a
    neighbour's Functions trace, mecefo.neighbour), as torchtitan compiles its transformer blocks: before FSDP2 wraps
    them. The parameters' names are unchanged and the config hash leaves `train.compile` out, so a run started eager
    resumes compiled and the other way round."""
    for block in model.layers:
        block.compile(backend=COMPILE_BACKEND)
    return model


GROUP_KINDS = ("attention", "ffn", "embedding", "head", "norm")
FFN_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def group_of(param_name: str) -> str:
    """The parameter group of a parameter of GPT, the unit of MeCeFO's aggregation rule:
    'attention.<l>' (q, k, v, o projections of layer l and its attention RMSNorm), 'ffn.<l>' (gate, up, down
    and the FFN RMSNorm), 'embedding', 'head' (the LM head) or 'norm' (the final RMSNorm)."""
    parts = param_name.split(".")
    if parts[0] == "layers":
        return f"{'attention' if parts[2].startswith('attention') else 'ffn'}.{parts[1]}"
    return {"embedding": "embedding", "lm_head": "head", "norm": "norm"}[parts[0]]


def group_kind(group: str) -> str:
    """'attention.3' -> 'attention'; one of GROUP_KINDS."""
    return group.split(".")[0]


def groups(n_layers: int) -> list[str]:
    """Every group of a model with n_layers layers, in parameter order."""
    return ["embedding"] + [f"{k}.{l}" for l in range(n_layers) for k in ("attention", "ffn")] + ["norm", "head"]


def ffn_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(m, n) of each FFN projection's weight (m x n), in FFN_PROJECTIONS order: gate, up (F x D), down (D x F)."""
    return [(cfg.ffn_dim, cfg.dim), (cfg.ffn_dim, cfg.dim), (cfg.dim, cfg.ffn_dim)]


def ffn_linears(model: nn.Module) -> list[nn.Linear]:
    """The FFN projections (gate, up, down) of every layer, in order: the matrices low_rank_wgrad applies to."""
    return [getattr(layer.ffn, name) for layer in model.layers for name in FFN_PROJECTIONS]

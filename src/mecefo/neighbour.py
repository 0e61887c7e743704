"""MeCeFO's neighbour computation: what a rank does differently while it also covers a failed rank.

A micro-batch runs in normal mode (`neighbour=None`, the plain model code, nothing added) or as a
neighbour with any subset of the techniques below; the switch is per micro-batch and needs no rebuilt
model and no copied weights:

- skip_attention: attention runs in the forward pass (the loss is unchanged) under no_grad, so no attention
  activation is kept and no gradient flows through it; the block input receives the residual path's
  gradient only, and the attention parameters (with their RMSNorm) receive none from this micro-batch.
- recompute_ffn: the FFN sublayer (its RMSNorm and SwiGLU) keeps only its input; the intermediates are
  recomputed in the backward pass (torch's non-reentrant checkpoint). Gradients equal normal mode.
- low_rank_wgrad: every FFN linear y = x W^T (W is m x n, x is b x n) saves x V1 (b x r) instead of x, with V1
  (n x r) the top-r right singular vectors of W. The input gradient is exact, G_x = G_y W; the weight gradient
  is the exact one projected on span(V1):
        G_W ~= G_y^T (x V1) V1^T  =  (G_y^T x) V1 V1^T,
  costing 2bnr (forward) + 2bmr (backward) + 2rmn instead of 2bmn. The r-column factor G_y^T (x V1) (m x r)
  is accumulated over the micro-batches of a step and multiplied by V1^T once, in `finish()`.
- skip_ffn: the FFN runs forward only (no gradient through it): the paper's Figure 3 comparison.

Parameters outside attention and FFN (embedding, LM head, final RMSNorm) get exact gradients on the
neighbour; `low_rank_head=True` applies the low-rank estimator to the LM head as well.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .model import ffn_linears

TECHNIQUES = ("skip_attention", "recompute_ffn", "low_rank_wgrad", "skip_ffn", "low_rank_head")


@dataclass(frozen=True)
class Techniques:
    skip_attention: bool = False
    recompute_ffn: bool = False
    low_rank_wgrad: bool = False
    skip_ffn: bool = False
    low_rank_head: bool = False

    @classmethod
    def parse(cls, spec: str) -> "Techniques":
        """'normal', 'mecefo' (the paper's three), or names joined by '+', e.g. 'skip_attention+recompute_ffn'."""
        if spec in ("", "normal", "none"):
            return cls()
        if spec == "mecefo":
            return MECEFO
        names = spec.split("+")
        unknown = [n for n in names if n not in TECHNIQUES]
        if unknown:
            raise ValueError(f"unknown technique {unknown[0]!r}; allowed: {', '.join(TECHNIQUES)}, mecefo, normal")
        return cls(**{n: True for n in names})

    def trains(self, kind: str) -> bool:
        """Whether a micro-batch under these techniques gives a group of this kind (mecefo.model.GROUP_KINDS)
        a gradient: attention not under skip_attention, FFN not under skip_ffn, everything else always."""
        return not ((kind == "attention" and self.skip_attention) or (kind == "ffn" and self.skip_ffn))

    @property
    def names(self) -> str:
        on = [f.name for f in fields(self) if getattr(self, f.name)]
        return "+".join(on) if on else "normal"


MECEFO = Techniques(skip_attention=True, recompute_ffn=True, low_rank_wgrad=True)


def resolve_r(r: float, m: int, n: int) -> int:
    """Width r of V1 for an m x n weight: r >= 1 is absolute, 0 < r < 1 a fraction of min(m, n); the result
    lies in [1, n] (r = n makes V1 square and the estimator exact; beyond min(m, n) the extra singular
    vectors have singular value 0)."""
    r = int(r) if r >= 1 else round(r * min(m, n))
    return max(1, min(n, r))


def randomized_right_basis(w: torch.Tensor, r: int, oversample: int, niter: int,
                           generator: torch.Generator) -> torch.Tensor:
    """Top-r right singular vectors (n x r) of w (m x n) by the randomized range finder (Halko, Martinsson
    and Tropp 2011, Alg. 4.4), with every random number drawn from `generator` (not the global RNG, so
    that all ranks that hold the same weight get the same V1 whatever else they have drawn):
        Omega ~ N(0, 1)^(m x q), q = min(r + oversample, m, n);   Q = orth(w^T Omega)          (n x q)
        niter times:  Q = orth(w^T orth(w Q))                                                 (power iterations)
        B = w Q (m x q);  B = U S Z^T;  V1 = (Q Z)[:, :r]
    """
    m, n = w.shape
    q = min(r + oversample, m, n)
    omega = torch.randn(m, q, generator=generator, device=w.device, dtype=w.dtype)
    basis = torch.linalg.qr(w.T @ omega).Q
    for _ in range(niter):
        basis = torch.linalg.qr(w.T @ torch.linalg.qr(w @ basis).Q).Q
    z = torch.linalg.svd(w @ basis, full_matrices=False)[2].T  # q x q right singular vectors of B
    return (basis @ z)[:, :r]


def exact_right_basis(w: torch.Tensor, r: int) -> torch.Tensor:
    """Top-r right singular vectors (n x r) of w (m x n) by a full SVD (r may exceed min(m, n))."""
    return torch.linalg.svd(w, full_matrices=r > min(w.shape))[2][:r].T


class LowRankWgrad:
    """Per-matrix subspace cache and pending r-column gradient factors, keyed by the FFN linear module.

    V1 of a weight is computed at its first use in each epoch of `tau` optimizer steps (train.py sets
    `steps`; `prepare(model)` computes all of a model's at once), or again after `refresh()`. `svd`:
    'exact' (torch.linalg.svd), 'randomized' (`randomized_right_basis` with max(8, oversample * r) extra
    columns and `niter` power iterations) or 'auto' (randomized when min(m, n) > `exact_limit`). The
    defaults (oversample 0.5, niter 8) are the cheapest setting measured by experiments/svd_accuracy.py to
    capture the exact top-r energy within 0.5% on trained, decaying-spectrum and Gaussian 1B-shaped weights. The randomized path
    draws from a generator seeded by (seed, epoch, the matrix's module name, known after `bind(model)`), so
    V1 is a function of the weight and that triple only: every rank holding the same weights holds the same
    subspaces (an unbound instance uses one name for every matrix: one draw per shape).
    Weights that are DTensors (FSDP2 shards) are gathered first (a collective: every rank calls prepare).
    """

    def __init__(self, r: float = 0.125, tau: int = 50, svd: str = "auto", oversample: float = 0.5,
                 niter: int = 8, exact_limit: int = 1024, seed: int = 0):
        if r <= 0:
            raise ValueError(f"low-rank r={r} must be positive")
        if tau < 1:
            raise ValueError(f"low-rank tau={tau} must be at least 1")
        if svd not in ("exact", "randomized", "auto"):
            raise ValueError(f"svd={svd!r}; allowed: 'exact', 'randomized', 'auto'")
        self.r, self.tau, self.svd = r, tau, svd
        self.oversample, self.niter, self.exact_limit, self.seed = oversample, niter, exact_limit, seed
        self.steps = 0
        self._basis: dict[torch.nn.Module, tuple[torch.Tensor, int]] = {}
        self._pending: dict[torch.nn.Module, torch.Tensor] = {}
        self._names: dict[torch.nn.Module, str] = {}
        self.svd_count = 0

    def bind(self, model: torch.nn.Module) -> "LowRankWgrad":
        """Learn the model's module names (the generator seeds and the state_dict keys)."""
        self._names = {m: name for name, m in model.named_modules()}
        return self

    def refresh(self) -> None:
        self._basis.clear()

    def oversample_columns(self, r: int) -> int:
        return max(8, math.ceil(self.oversample * r))

    def method(self, m: int, n: int, r: int) -> str:
        if self.svd == "exact" or r > min(m, n) or (self.svd == "auto" and min(m, n) <= self.exact_limit):
            return "exact"
        return "randomized"

    def generator(self, linear: torch.nn.Module, device: torch.device) -> torch.Generator:
        key = f"{self.seed}:{self.steps // self.tau}:{self._names.get(linear, '')}"
        return torch.Generator(device=device).manual_seed(zlib.crc32(key.encode()))

    @torch.no_grad()
    def basis(self, linear: torch.nn.Module) -> torch.Tensor:
        """V1 (n x r): the top-r right singular vectors of linear.weight (m x n), in fp32 or fp64."""
        cached = self._basis.get(linear)
        if cached is not None and cached[1] == self.steps // self.tau:
            return cached[0]
        w = linear.weight.detach()
        if hasattr(w, "full_tensor"):  # an FSDP2 shard (DTensor): gather the whole matrix
            w = w.full_tensor()
        w = w.float() if w.dtype in (torch.bfloat16, torch.float16) else w
        m, n = w.shape
        r = resolve_r(self.r, m, n)
        if self.method(m, n, r) == "exact":
            v1 = exact_right_basis(w, r)
        else:
            v1 = randomized_right_basis(w, r, self.oversample_columns(r), self.niter, self.generator(linear, w.device))
        v1 = v1.contiguous()
        self._basis[linear] = (v1, self.steps // self.tau)
        self.svd_count += 1
        return v1

    def prepare(self, model: torch.nn.Module, ffn: bool = True, head: bool = False) -> None:
        """Compute now every V1 a step will use (the FFN matrices, and the LM head under low_rank_head), so
        that all ranks refresh at the same step from the same weights."""
        for linear in self.matrices(model, ffn, head):
            self.basis(linear)

    @staticmethod
    def matrices(model: torch.nn.Module, ffn: bool = True, head: bool = False) -> list[torch.nn.Linear]:
        linears = model.ffn_linears() if hasattr(model, "ffn_linears") else ffn_linears(model)  # (mecefo.hf's)
        return (linears if ffn else []) + ([model.lm_head] if head else [])

    def state_dict(self) -> dict:
        """Step count and cached subspaces (with their epoch) by module name (bind() first)."""
        return {"steps": self.steps, "bases": {self._names[m]: (v.cpu(), e) for m, (v, e) in self._basis.items()}}

    def load_state_dict(self, state: dict) -> None:
        modules = {name: m for m, name in self._names.items()}
        self.steps = state["steps"]
        self._basis = {}
        for name, (v, e) in state["bases"].items():
            m = modules[name]
            self._basis[m] = (v.to(next(m.parameters()).device), e)

    def add(self, linear: torch.nn.Module, factor: torch.Tensor) -> None:
        pending = self._pending.get(linear)
        self._pending[linear] = factor if pending is None else pending + factor

    @property
    def pending(self) -> dict[torch.nn.Module, torch.Tensor]:
        return self._pending

    def gradient(self, linear: torch.nn.Module, factor: torch.Tensor) -> torch.Tensor:
        """factor V1^T (m x n), the low-rank weight gradient, in fp32 or better."""
        return factor @ self._basis[linear][0].T.to(factor.dtype)

    @torch.no_grad()
    def finish(self) -> None:
        """weight.grad += factor V1^T for every matrix with a pending factor (once per optimizer step)."""
        for linear, factor in self._pending.items():
            weight = linear.weight
            g = self.gradient(linear, factor).to(weight.dtype)
            weight.grad = g if weight.grad is None else weight.grad.add_(g)
        self._pending.clear()


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run a linear layer on x in, or None when autocast is off for x's device."""
    kind = x.device.type
    on = kind != "meta" and torch.is_autocast_enabled(kind)
    return torch.get_autocast_dtype(kind) if on else None


class _LowRankLinear(torch.autograd.Function):
    """y = x W^T, saving x V1; backward: G_x = G_y W exact, G_y^T (x V1) queued on the LowRankWgrad.
    Under autocast the products run in autocast's dtype (as nn.Linear's would) and the factor G_y^T (x V1)
    is accumulated in fp32; without autocast everything stays in the input's dtype (fp32 or fp64)."""

    @staticmethod
    def forward(ctx, x, weight, v1, linear, lowrank):
        dtype = _autocast_dtype(x)
        with torch.autocast(x.device.type, enabled=False) if dtype else contextlib.nullcontext():
            dtype = dtype or x.dtype
            xc, w = x.to(dtype), weight.to(dtype)
            ctx.save_for_backward(xc @ v1.to(dtype), w)
            y = F.linear(xc, w)
        ctx.x_dtype, ctx.linear, ctx.lowrank = x.dtype, linear, lowrank
        return y

    @staticmethod
    def backward(ctx, grad_y):
        xv, w = ctx.saved_tensors
        grad_y = grad_y.to(w.dtype)
        grad_x = (grad_y @ w).to(ctx.x_dtype)
        acc = torch.promote_types(w.dtype, torch.float32)  # the factor accumulates in fp32 at least
        factor = grad_y.reshape(-1, grad_y.shape[-1]).T.to(acc) @ xv.reshape(-1, xv.shape[-1]).to(acc)
        ctx.lowrank.add(ctx.linear, factor)
        return grad_x, None, None, None, None


def low_rank_linear(linear: torch.nn.Linear, x: torch.Tensor, lowrank: LowRankWgrad) -> torch.Tensor:
    return _LowRankLinear.apply(x, linear.weight, lowrank.basis(linear), linear, lowrank)


class Neighbour:
    """What the model consults per micro-batch: which techniques, and the low-rank state they need."""

    def __init__(self, techniques: Techniques, lowrank: LowRankWgrad | None = None):
        if (techniques.low_rank_wgrad or techniques.low_rank_head) and lowrank is None:
            lowrank = LowRankWgrad()
        self.techniques, self.lowrank = techniques, lowrank
        self.held: list[torch.Tensor] | None = None  # set by costs.py to see the tensors checkpoint keeps

    def project(self, linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """One FFN projection under low_rank_wgrad (FeedForward's `project` hook)."""
        return low_rank_linear(linear, x, self.lowrank)

    def attention(self, sublayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attention(RMSNorm(x)) of the block; under skip_attention forward only (no_grad)."""
        if self.techniques.skip_attention:
            with torch.no_grad():
                return sublayer(x, cos, sin)
        return sublayer(x, cos, sin)

    def ffn(self, sublayer, h: torch.Tensor) -> torch.Tensor:
        """FFN(RMSNorm(h)) of the block: low-rank projections, recomputed in backward, or forward only."""
        t = self.techniques
        project = self.project if t.low_rank_wgrad else None
        if t.skip_ffn:
            with torch.no_grad():
                return sublayer(h, project)
        if t.recompute_ffn and torch.is_grad_enabled():
            if self.held is not None:
                self.held.append(h)
            return checkpoint(sublayer, h, project, use_reentrant=False)
        return sublayer(h, project)

    def head(self, lm_head: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return low_rank_linear(lm_head, x, self.lowrank) if self.techniques.low_rank_head else lm_head(x)

    def finish(self) -> None:
        """Apply pending low-rank weight gradients; call once after the step's last backward."""
        if self.lowrank is not None:
            self.lowrank.finish()

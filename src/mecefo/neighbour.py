"""MeCeFO's neighbour computation: what a rank does differently while it also covers a failed rank.

A micro-batch runs in normal mode (`neighbour=None`, the plain model code, nothing added) or as a
neighbour with any subset of the techniques below; the switch is per micro-batch and needs no rebuilt
model and no copied weights:

- skip_attention: attention runs in the forward pass (the loss is unchanged) under no_grad, so no attention
  activation is kept and no gradient flows through it; the block input receives the residual path's
  gradient only, and the attention parameters (with their RMSNorm) receive none from this micro-batch.
- recompute_ffn: the FFN sublayer (its RMSNorm and SwiGLU) keeps only its input; the gate and up projections
  are recomputed in the backward pass (the down projection's output is not needed there and is not rerun).
  Gradients equal normal mode.
- low_rank_wgrad: every FFN linear y = x W^T (W is m x n, x is b x n) saves x V1 (b x r) instead of x, with V1
  (n x r) the top-r right singular vectors of W. The input gradient is exact, G_x = G_y W; the weight gradient
  is the exact one projected on span(V1):
        G_W ~= G_y^T (x V1) V1^T  =  (G_y^T x) V1 V1^T,
  costing 2bnr (forward) + 2bmr (backward) + 2rmn instead of 2bmn. The r-column factor G_y^T (x V1) (m x r)
  is computed in the compute dtype and accumulated in fp32, in place, into one buffer per matrix (allocated at
  its first use) over the micro-batches of a step, and multiplied by V1^T once, in `finish()`.
Under recompute_ffn and/or low_rank_wgrad the FFN sublayer is one autograd Function (`NeighbourFFN`): the
forward keeps the sublayer's input and, under low_rank_wgrad, the three products x V1; the backward recomputes
only what it needs (gate and up, or nothing when they were kept), so the techniques cost their FLOPs
(mecefo.costs) and no more.
- skip_ffn: the FFN runs forward only (no gradient through it): the paper's Figure 3 comparison.

Parameters outside attention and FFN (embedding, LM head, final RMSNorm) get exact gradients on the
neighbour; `low_rank_head=True` applies the low-rank estimator to the LM head as well.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .model import ffn_linears, rms_norm

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


def basis_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype V1 is computed and kept in for a weight of this dtype: fp32 for bf16/fp16 weights, else the weight's."""
    return torch.float32 if weight_dtype in (torch.bfloat16, torch.float16) else weight_dtype


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
        self._factors: dict[torch.nn.Module, torch.Tensor] = {}  # per matrix: its m x r buffer, allocated once
        self._used: dict[torch.nn.Module, None] = {}  # the matrices with a factor this step (ordered)
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
        w = w.to(basis_dtype(w.dtype))
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

    def stale(self, linears) -> list[torch.nn.Module]:
        """Those of the matrices whose V1 is missing or from an earlier tau-epoch (basis() would compute them)."""
        epoch = self.steps // self.tau
        return [m for m in linears if (m not in self._basis or self._basis[m][1] != epoch)]

    def empty_basis(self, linear: torch.nn.Module) -> torch.Tensor:
        """An uninitialised tensor of V1's shape (n x r), dtype and device for this matrix (a receive buffer)."""
        w = linear.weight
        m, n = w.shape
        return torch.empty(n, resolve_r(self.r, m, n), dtype=basis_dtype(w.dtype), device=w.device)

    def install(self, linear: torch.nn.Module, v1: torch.Tensor) -> None:
        """Take V1 of this matrix for the current tau-epoch as computed elsewhere (by another rank)."""
        self._basis[linear] = (v1, self.steps // self.tau)

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

    def accumulate(self, linear: torch.nn.Module, grad_y: torch.Tensor, xv: torch.Tensor) -> None:
        """factor(linear) += G_y^T (x V1) (m x r), G_y (N x m) and x V1 (N x r) in the compute dtype, the sum in fp32 at
        least, in place in the matrix's buffer (fp32 inputs: one addmm; bf16 on CUDA: one GEMM with fp32 output, no
        fp32 copy of G_y)."""
        acc = torch.promote_types(grad_y.dtype, torch.float32)
        buf = self._factors.get(linear)
        if buf is None or buf.dtype != acc or buf.shape != (grad_y.shape[1], xv.shape[1]) or buf.device != grad_y.device:
            buf = self._factors[linear] = torch.zeros(grad_y.shape[1], xv.shape[1], dtype=acc, device=grad_y.device)
        self._used[linear] = None
        if grad_y.dtype == acc:  # (addmm with out=: in place, and counted by FlopCounterMode, which addmm_ is not)
            torch.addmm(buf, grad_y.T, xv.to(acc), out=buf)
        elif grad_y.is_cuda:
            buf.add_(torch.ops.aten.mm.dtype(grad_y.T, xv, acc))
        else:  # (a CPU has no low-precision GEMM with fp32 output)
            torch.addmm(buf, grad_y.T.to(acc), xv.to(acc), out=buf)

    @property
    def pending(self) -> Mapping[torch.nn.Module, torch.Tensor]:
        """The factors of this step (linear -> its m x r buffer), in the order they were first added; read-only
        (the buffers are reused: `clear()` zeroes and forgets them once they were applied)."""
        return MappingProxyType({m: self._factors[m] for m in self._used})

    def clear(self, linears=None) -> None:
        """Zero the factors of these matrices (all: None) and forget them for this step (after they were applied)."""
        for m in list(self._used) if linears is None else [m for m in linears if m in self._used]:
            self._factors[m].zero_()
            del self._used[m]

    def gradient(self, linear: torch.nn.Module, factor: torch.Tensor) -> torch.Tensor:
        """factor V1^T (m x n), the low-rank weight gradient, in fp32 or better."""
        return factor @ self._basis[linear][0].T.to(factor.dtype)

    @torch.no_grad()
    def finish(self) -> None:
        """weight.grad += factor V1^T for every matrix with a factor this step (once per optimizer step)."""
        for linear, factor in self.pending.items():
            weight = linear.weight
            v1 = self._basis[linear][0]
            if weight.grad is not None and weight.grad.dtype == factor.dtype and not hasattr(weight.grad, "to_local"):
                torch.addmm(weight.grad, factor, v1.T.to(factor.dtype), out=weight.grad)
            else:
                g = self.gradient(linear, factor).to(weight.dtype)
                weight.grad = g if weight.grad is None else weight.grad.add_(g)
        self.clear()


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run a linear layer on x in, or None when autocast is off for x's device or leaves x
    alone (float64 is not autocast-eligible: nn.Linear stays in float64)."""
    kind = x.device.type
    on = kind != "meta" and torch.is_autocast_enabled(kind) and x.dtype != torch.float64
    return torch.get_autocast_dtype(kind) if on else None


def _autocast_off(x: torch.Tensor):
    """A region where autocast is off for x's device (nothing to turn off: a null context, as on the meta device)."""
    return torch.autocast(x.device.type, enabled=False) if _autocast_dtype(x) else contextlib.nullcontext()


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
        ctx.lowrank.accumulate(ctx.linear, grad_y.reshape(-1, grad_y.shape[-1]), xv.reshape(-1, xv.shape[-1]))
        return grad_x, None, None, None, None


class NeighbourFFN(torch.autograd.Function):
    """The FFN sublayer of a block under recompute_ffn and/or low_rank_wgrad, as one Function:
        n = norm(h)  (our GPT's RMSNorm; the identity where the norm sits outside the FFN module: Hugging Face's)
        g = n W_g^T,  u = n W_u^T,  a = act(g) u,  y = a W_d^T          (act: SiLU for SwiGLU)
    forward keeps h and, under low_rank_wgrad, n V1_g, n V1_u, a V1_d (N x r each); without recompute_ffn also g and u.
    backward, G_y given:
        recompute_ffn: g, u from h (4 N D F FLOPs; the down projection is not rerun)
        G_a = G_y W_d;  G_g, G_u = autograd's own backward of a = act(g) u;  G_n = G_g W_g + G_u W_u
        weight gradients: exact (G_y^T a, G_g^T n, G_u^T n) or, under low_rank_wgrad, G^T (x V1) accumulated in the
        LowRankWgrad's fp32 buffers (applied by finish());  G_h and the norm's weight through the norm's own backward.
    Under autocast the products run in autocast's dtype, as nn.Linear's would (the weights cast again in backward,
    never saved); without it in the input's dtype. The elementwise parts reuse the modules' own code (norm, act), so
    that the numerics are the plain model's."""

    @staticmethod
    def forward(ctx, h, norm_weight, w_gate, w_up, w_down, parts):
        eps, act, linears, lowrank, recompute = parts
        dtype = _autocast_dtype(h) or h.dtype
        with _autocast_off(h):
            n = rms_norm(h, norm_weight, eps) if norm_weight is not None else h
            nc = n.to(dtype)
            g, u = F.linear(nc, w_gate.to(dtype)), F.linear(nc, w_up.to(dtype))
            a = act(g) * u
            y = F.linear(a, w_down.to(dtype))
            saved = [h, norm_weight] + ([] if recompute else [g, u])
            if lowrank is not None:
                v = [lowrank.basis(m).to(dtype) for m in linears]
                saved += [nc @ v[0], nc @ v[1], a @ v[2]]
        ctx.save_for_backward(*saved)
        ctx.parts, ctx.dtype, ctx.n_dtype = parts, dtype, n.dtype
        return y

    @staticmethod
    def backward(ctx, grad_y):
        eps, act, linears, lowrank, recompute = ctx.parts
        saved, dtype = ctx.saved_tensors, ctx.dtype
        h, norm_weight = saved[0], saved[1]
        w_gate, w_up, w_down = (m.weight.to(dtype) for m in linears)
        with _autocast_off(h):
            with torch.enable_grad():  # (fresh leaves: the grads come back through this Function's outputs)
                h_ = h.detach().requires_grad_()
                w_ = norm_weight.detach().requires_grad_() if norm_weight is not None else None
                n = rms_norm(h_, w_, eps) if w_ is not None else h_
            nc = n.detach().to(dtype)
            if recompute:  # gate and up again; the down projection is not needed
                g, u = F.linear(nc, w_gate), F.linear(nc, w_up)
            else:
                g, u = saved[2], saved[3]
            with torch.enable_grad():
                g_, u_ = g.detach().requires_grad_(), u.detach().requires_grad_()
                a = act(g_) * u_
            grad_y = grad_y.to(dtype)
            grad_a = (grad_y @ w_down).to(a.dtype)
            grad_g, grad_u = torch.autograd.grad(a, (g_, u_), grad_a)
            grad_n = ((grad_g @ w_gate).to(ctx.n_dtype) + (grad_u @ w_up).to(ctx.n_dtype))
            flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
            grads = [None, None, None]
            if lowrank is not None:
                xv_g, xv_u, xv_d = saved[-3:]
                lowrank.accumulate(linears[2], flat(grad_y), flat(xv_d))
                lowrank.accumulate(linears[1], flat(grad_u), flat(xv_u))
                lowrank.accumulate(linears[0], flat(grad_g), flat(xv_g))
            else:  # exact: the plain model's weight gradients
                grads = [(flat(grad_g).T @ flat(nc)).to(w_gate.dtype), (flat(grad_u).T @ flat(nc)).to(w_up.dtype),
                         (flat(grad_y).T @ flat(a.detach())).to(w_down.dtype)]
                grads = [gr.to(m.weight.dtype) for gr, m in zip(grads, linears)]
            if w_ is not None:
                grad_h, grad_norm = torch.autograd.grad(n, (h_, w_), grad_n)
            else:
                grad_h, grad_norm = grad_n, None
        return grad_h, grad_norm, *grads, None


def neighbour_ffn(h: torch.Tensor, norm, linears: list[torch.nn.Linear], act, lowrank, recompute: bool) -> torch.Tensor:
    """The FFN sublayer y = down(act(gate(n)) * up(n)), n = norm(h) (norm None: n = h), as NeighbourFFN; lowrank: the
    LowRankWgrad under low_rank_wgrad, else None (exact weight gradients)."""
    gate, up, down = linears
    act = getattr(act, "forward", act)  # (a module's own forward: no module hooks run inside the backward)
    return NeighbourFFN.apply(h, norm.weight if norm is not None else None, gate.weight, up.weight, down.weight,
                              (norm.eps if norm is not None else None, act, tuple(linears), lowrank, recompute))


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

    def ffn(self, block, h: torch.Tensor) -> torch.Tensor:
        """FFN(RMSNorm(h)) of a block of our GPT: forward only (skip_ffn), or NeighbourFFN (recompute_ffn, low_rank_wgrad)."""
        t = self.techniques
        if t.skip_ffn or not torch.is_grad_enabled():
            with torch.no_grad():
                return block.ffn_sublayer(h)
        if t.recompute_ffn or t.low_rank_wgrad:
            ffn = block.ffn
            return neighbour_ffn(h, block.ffn_norm, [ffn.gate_proj, ffn.up_proj, ffn.down_proj], F.silu,
                                 self.lowrank if t.low_rank_wgrad else None, t.recompute_ffn)
        return block.ffn_sublayer(h)

    def head(self, lm_head: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return low_rank_linear(lm_head, x, self.lowrank) if self.techniques.low_rank_head else lm_head(x)

    def finish(self) -> None:
        """Apply pending low-rank weight gradients; call once after the step's last backward."""
        if self.lowrank is not None:
            self.lowrank.finish()

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
  is computed in the compute dtype with an fp32 (or wider) result, handed back by the Function as the gradient of
  the matrix's *factor carrier* (a zero-stride leaf, one per matrix), so that autograd accumulates it in place over
  the micro-batches of a step into the carrier's .grad, one buffer per matrix allocated with V1, and multiplied by
  V1^T once, in `finish()`. No Python state changes inside a forward or backward: torch.compile traces them.
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


_OPERANDS = "_mecefo_low_rank"  # a matrix's (LowRankWgrad, V1, factor carrier), a module attribute (LowRankWgrad._store)


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
        self._carriers: dict[torch.nn.Module, torch.Tensor] = {}  # per matrix: the leaf whose .grad is its factor
        self._used: dict[torch.nn.Module, None] = {}  # the matrices with a factor this step (ordered)
        self._names: dict[torch.nn.Module, str] = {}
        self.svd_count = 0

    def bind(self, model: torch.nn.Module) -> "LowRankWgrad":
        """Learn the model's module names (the generator seeds and the state_dict keys)."""
        self._names = {m: name for name, m in model.named_modules()}
        return self

    def refresh(self) -> None:
        """Forget every V1 (the next basis() or prepare() computes them again)."""
        for m in self._basis:
            if m.__dict__.get(_OPERANDS, (None,))[0] is self:
                del m.__dict__[_OPERANDS]
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
    def basis(self, linear: torch.nn.Module, whole: torch.Tensor | None = None) -> torch.Tensor:
        """V1 (n x r): the top-r right singular vectors of linear.weight (m x n), in fp32 or fp64; whole: the weight
        already gathered (an FSDP2 shard's whole matrix), else it is read (and gathered: a collective) here."""
        cached = self._basis.get(linear)
        if cached is not None and cached[1] == self.steps // self.tau:
            return cached[0]
        w = whole if whole is not None else linear.weight.detach()
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
        self._store(linear, v1, self.steps // self.tau)
        self.svd_count += 1
        return v1

    def _store(self, linear: torch.nn.Module, v1: torch.Tensor, epoch: int) -> None:
        """V1 of this matrix for this tau-epoch, and the matrix's factor carrier: a zero-stride m x r leaf of V1's
        dtype and device (no memory of its own) whose .grad, zeros of that shape allocated here once, autograd
        accumulates the factors into (in place); each accumulation marks the matrix as pending (a hook: autograd runs
        it outside any compiled graph, so no Python state is read or written inside one)."""
        self._basis[linear] = (v1, epoch)
        shape = (linear.weight.shape[0], v1.shape[1])
        c = self._carriers.get(linear)
        if c is None or c.shape != shape or c.dtype != v1.dtype or c.device != v1.device:
            c = torch.zeros((), dtype=v1.dtype, device=v1.device).expand(shape).requires_grad_()
            c.grad = torch.zeros(shape, dtype=v1.dtype, device=v1.device)
            c.register_post_accumulate_grad_hook(lambda _, m=linear: self._used.__setitem__(m, None))
            self._carriers[linear] = c
        linear.__dict__[_OPERANDS] = (self, v1, c)  # (what a compiled graph reads: an attribute, not a dict keyed by modules)

    def operands(self, linear: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(V1, factor carrier) of this matrix for a Function that runs it under low_rank_wgrad. Eager, V1 is computed
        here when stale (basis()); under torch.compile it is the one the step's prepare() computed (no staleness test:
        reading the step count would recompile every step)."""
        if torch.compiler.is_compiling():
            owner, v1, carrier = linear.__dict__.get(_OPERANDS, (None, None, None))
            if owner is not self:
                raise RuntimeError(f"{self._names.get(linear, linear)}: no V1 of this LowRankWgrad for a compiled pass "
                                   "(call prepare() before the step; a matrix runs under one LowRankWgrad at a time)")
            return v1, carrier
        return self.basis(linear), self._carriers[linear]

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
        self._store(linear, v1, self.steps // self.tau)

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
            self._store(m, v.to(next(m.parameters()).device), e)

    @property
    def pending(self) -> Mapping[torch.nn.Module, torch.Tensor]:
        """The factors of this step (linear -> its m x r buffer, its carrier's .grad), in the order they were first
        accumulated; read-only (the buffers are reused: `clear()` zeroes and forgets them once they were applied)."""
        return MappingProxyType({m: self._carriers[m].grad for m in self._used})

    def clear(self, linears=None) -> None:
        """Zero the factors of these matrices (all: None) and forget them for this step (after they were applied)."""
        for m in list(self._used) if linears is None else [m for m in linears if m in self._used]:
            self._carriers[m].grad.zero_()
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


def _vjp(f, *primals):
    """(f(*primals), the function of a cotangent that gives the primals' gradients): torch.func.vjp while torch.compile
    traces (dynamo traces it, not torch.autograd.grad), else autograd on fresh leaves (the same backward formulas, at a
    fraction of functorch's host cost per call)."""
    if torch.compiler.is_compiling():
        return torch.func.vjp(f, *primals)
    with torch.enable_grad():
        leaves = [p.detach().requires_grad_() for p in primals]
        out = f(*leaves)
    return out.detach(), lambda cotangent: torch.autograd.grad(out, leaves, cotangent)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def low_rank_factor(grad_y: torch.Tensor, xv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """G_y^T (x V1) (m x r) in `dtype` (the carrier's: fp32 or wider), G_y (N x m) and x V1 (N x r) in the compute
    dtype: one GEMM in that dtype where they are in it; on CUDA one low-precision GEMM with a `dtype` result (no fp32
    copy of G_y); on a CPU, which has no such GEMM, the inputs cast first."""
    if grad_y.dtype == dtype:
        return grad_y.T @ xv.to(dtype)
    if grad_y.is_cuda:
        return torch.ops.aten.mm.dtype(grad_y.T, xv.to(grad_y.dtype), dtype)
    return grad_y.T.to(dtype) @ xv.to(dtype)


class _LowRankLinear(torch.autograd.Function):
    """y = x W^T, saving x V1; backward: G_x = G_y W exact, and G_y^T (x V1) as the factor carrier's gradient.
    Under autocast the products run in autocast's dtype (as nn.Linear's would); without autocast everything stays
    in the input's dtype (fp32 or fp64)."""

    @staticmethod
    def forward(ctx, x, weight, v1, carrier):
        dtype = _autocast_dtype(x) or x.dtype
        with _autocast_off(x):
            xc, w = x.to(dtype), weight.to(dtype)
            ctx.save_for_backward(xc @ v1.to(dtype), w)
            y = F.linear(xc, w)
        ctx.x_dtype, ctx.acc = x.dtype, carrier.dtype
        return y

    @staticmethod
    def backward(ctx, grad_y):
        xv, w = ctx.saved_tensors
        grad_y = grad_y.to(w.dtype)
        grad_x = (grad_y @ w).to(ctx.x_dtype)
        return grad_x, None, None, low_rank_factor(_flat(grad_y), _flat(xv), ctx.acc)


class NeighbourFFN(torch.autograd.Function):
    """The FFN sublayer of a block under recompute_ffn and/or low_rank_wgrad, as one Function:
        n = norm(h)  (our GPT's RMSNorm; the identity where the norm sits outside the FFN module: Hugging Face's)
        g = n W_g^T,  u = n W_u^T,  a = act(g) u,  y = a W_d^T          (act: SiLU for SwiGLU)
    forward keeps h and, under low_rank_wgrad, n V1_g, n V1_u, a V1_d (N x r each); without recompute_ffn also g and u.
    backward, G_y given:
        recompute_ffn: g, u from h (4 N D F FLOPs; the down projection is not rerun)
        G_a = G_y W_d;  G_g, G_u = the vector-Jacobian product of a = act(g) u;  G_n = G_g W_g + G_u W_u
        weight gradients: exact (G_y^T a, G_g^T n, G_u^T n) or, under low_rank_wgrad, G^T (x V1) as the gradients of
        the three factor carriers (autograd accumulates them; finish() applies them);  G_h and the norm's weight
        through the norm's own vector-Jacobian product.
    Under autocast the products run in autocast's dtype, as nn.Linear's would (the weights cast again in backward,
    the copies never saved); without it in the input's dtype. The elementwise parts reuse the modules' own code (norm,
    act; their backward through _vjp), so that the numerics are the plain model's."""

    @staticmethod
    def forward(ctx, h, norm_weight, w_gate, w_up, w_down, c_gate, c_up, c_down, v_gate, v_up, v_down, parts):
        eps, act, recompute = parts
        dtype = _autocast_dtype(h) or h.dtype
        with _autocast_off(h):
            n = rms_norm(h, norm_weight, eps) if norm_weight is not None else h
            nc = n.to(dtype)
            g, u = F.linear(nc, w_gate.to(dtype)), F.linear(nc, w_up.to(dtype))
            a = act(g) * u
            y = F.linear(a, w_down.to(dtype))
            saved = [h, norm_weight, w_gate, w_up, w_down] + ([] if recompute else [g, u])
            if c_gate is not None:
                saved += [nc @ v_gate.to(dtype), nc @ v_up.to(dtype), a @ v_down.to(dtype)]
        ctx.save_for_backward(*saved)
        ctx.parts, ctx.dtype, ctx.n_dtype = parts, dtype, n.dtype
        ctx.acc = c_gate.dtype if c_gate is not None else None
        return y

    @staticmethod
    def backward(ctx, grad_y):
        eps, act, recompute = ctx.parts
        saved, dtype = ctx.saved_tensors, ctx.dtype
        h, norm_weight = saved[0], saved[1]
        w_gate, w_up, w_down = (w.to(dtype) for w in saved[2:5])
        with _autocast_off(h):
            if norm_weight is not None:
                n, norm_vjp = _vjp(lambda h, w: rms_norm(h, w, eps), h, norm_weight)
            else:
                n, norm_vjp = h, None
            nc = n.to(dtype)
            if recompute:  # gate and up again; the down projection is not needed
                g, u = F.linear(nc, w_gate), F.linear(nc, w_up)
            else:
                g, u = saved[5], saved[6]
            a, act_vjp = _vjp(lambda g, u: act(g) * u, g, u)
            grad_y = grad_y.to(dtype)
            grad_a = (grad_y @ w_down).to(a.dtype)
            grad_g, grad_u = act_vjp(grad_a)
            grad_n = ((grad_g @ w_gate).to(ctx.n_dtype) + (grad_u @ w_up).to(ctx.n_dtype))
            grads, factors = [None, None, None], [None, None, None]
            if ctx.acc is not None:
                xv_g, xv_u, xv_d = saved[-3:]
                factors = [low_rank_factor(_flat(grad_g), _flat(xv_g), ctx.acc),
                           low_rank_factor(_flat(grad_u), _flat(xv_u), ctx.acc),
                           low_rank_factor(_flat(grad_y), _flat(xv_d), ctx.acc)]
            else:  # exact: the plain model's weight gradients
                grads = [_flat(grad_g).T @ _flat(nc), _flat(grad_u).T @ _flat(nc), _flat(grad_y).T @ _flat(a)]
                grads = [gr.to(w.dtype) for gr, w in zip(grads, saved[2:5])]
            grad_h, grad_norm = norm_vjp(grad_n) if norm_vjp is not None else (grad_n, None)
        return grad_h, grad_norm, *grads, *factors, None, None, None, None


def neighbour_ffn(h: torch.Tensor, norm, linears: list[torch.nn.Linear], act, lowrank, recompute: bool) -> torch.Tensor:
    """The FFN sublayer y = down(act(gate(n)) * up(n)), n = norm(h) (norm None: n = h), as NeighbourFFN; lowrank: the
    LowRankWgrad under low_rank_wgrad, else None (exact weight gradients)."""
    gate, up, down = linears
    act = getattr(act, "forward", act)  # (a module's own forward: no module hooks run inside the backward)
    carriers, bases = [None] * 3, [None] * 3
    if lowrank is not None:
        bases, carriers = zip(*(lowrank.operands(m) for m in linears))
    return NeighbourFFN.apply(h, norm.weight if norm is not None else None, gate.weight, up.weight, down.weight,
                              *carriers, *bases, (norm.eps if norm is not None else None, act, recompute))


def low_rank_linear(linear: torch.nn.Linear, x: torch.Tensor, lowrank: LowRankWgrad) -> torch.Tensor:
    return _LowRankLinear.apply(x, linear.weight, *lowrank.operands(linear))


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

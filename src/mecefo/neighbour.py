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

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

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

    @property
    def names(self) -> str:
        on = [f.name for f in fields(self) if getattr(self, f.name)]
        return "+".join(on) if on else "normal"


MECEFO = Techniques(skip_attention=True, recompute_ffn=True, low_rank_wgrad=True)


def resolve_rank(rank: float, m: int, n: int) -> int:
    """Rank r of V1 for an m x n weight: r >= 1 is absolute, 0 < r < 1 a fraction of min(m, n); the result
    lies in [1, n] (r = n makes V1 square and the estimator exact; beyond min(m, n) the extra singular
    vectors have singular value 0)."""
    r = int(rank) if rank >= 1 else round(rank * min(m, n))
    return max(1, min(n, r))


class LowRankWgrad:
    """Per-matrix subspace cache and pending r-column gradient factors.

    V1 of a weight is computed at its first use in each epoch of `tau` optimizer steps (count them with
    `optimizer_step()`; `prepare()` computes all of a model's at once), or again after `refresh()`. `svd`: 'exact' (torch.linalg.svd), 'randomized'
    (torch.svd_lowrank with `oversample` extra columns and `niter` power iterations) or 'auto' (randomized
    when min(m, n) > `exact_limit`).
    """

    def __init__(self, rank: float = 0.125, tau: int = 50, svd: str = "auto", oversample: int = 8,
                 niter: int = 2, exact_limit: int = 1024):
        if rank <= 0:
            raise ValueError(f"low-rank rank={rank} must be positive")
        if tau < 1:
            raise ValueError(f"low-rank tau={tau} must be at least 1")
        if svd not in ("exact", "randomized", "auto"):
            raise ValueError(f"svd={svd!r}; allowed: 'exact', 'randomized', 'auto'")
        self.rank, self.tau, self.svd = rank, tau, svd
        self.oversample, self.niter, self.exact_limit = oversample, niter, exact_limit
        self.steps = 0
        self._basis: dict[torch.nn.Parameter, tuple[torch.Tensor, int]] = {}
        self._pending: dict[torch.nn.Parameter, torch.Tensor] = {}
        self.svd_count = 0

    def optimizer_step(self) -> None:
        self.steps += 1

    def refresh(self) -> None:
        self._basis.clear()

    @torch.no_grad()
    def basis(self, weight: torch.nn.Parameter) -> torch.Tensor:
        """V1 (n x r): the top-r right singular vectors of weight (m x n)."""
        cached = self._basis.get(weight)
        if cached is not None and cached[1] == self.steps // self.tau:
            return cached[0]
        m, n = weight.shape
        r = resolve_rank(self.rank, m, n)
        w = weight.detach()
        w = w.float() if w.dtype in (torch.bfloat16, torch.float16) else w
        if self.svd == "exact" or r > min(m, n) or (self.svd == "auto" and min(m, n) <= self.exact_limit):
            v1 = torch.linalg.svd(w, full_matrices=r > min(m, n))[2][:r].T
        else:
            v1 = torch.svd_lowrank(w, q=min(r + self.oversample, min(m, n)), niter=self.niter)[2][:, :r]
        v1 = v1.contiguous()
        self._basis[weight] = (v1, self.steps // self.tau)
        self.svd_count += 1
        return v1

    def prepare(self, weights) -> None:
        for w in weights:
            self.basis(w)

    def state_dict(self, model: torch.nn.Module) -> dict:
        """Step count and cached subspaces by parameter name (to hand to a recovering rank)."""
        names = {p: n for n, p in model.named_parameters()}
        return {"steps": self.steps, "bases": {names[w]: (v.cpu(), e) for w, (v, e) in self._basis.items()}}

    def load_state_dict(self, state: dict, model: torch.nn.Module) -> None:
        params = dict(model.named_parameters())
        self.steps = state["steps"]
        self._basis = {params[n]: (v.to(params[n].device), e) for n, (v, e) in state["bases"].items()}

    def add(self, weight: torch.nn.Parameter, factor: torch.Tensor) -> None:
        pending = self._pending.get(weight)
        self._pending[weight] = factor if pending is None else pending + factor

    @torch.no_grad()
    def finish(self) -> None:
        """weight.grad += factor V1^T for every matrix with a pending factor (once per optimizer step)."""
        for weight, factor in self._pending.items():
            v1 = self._basis[weight][0]
            g = (factor @ v1.T.to(factor.dtype)).to(weight.dtype)
            weight.grad = g if weight.grad is None else weight.grad.add_(g)
        self._pending.clear()

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)


class _LowRankLinear(torch.autograd.Function):
    """y = x W^T, saving x V1; backward: G_x = G_y W exact, G_y^T (x V1) queued on the LowRankWgrad."""

    @staticmethod
    def forward(ctx, x, weight, v1, lowrank):
        w = weight.to(x.dtype)
        ctx.save_for_backward(x @ v1.to(x.dtype), w)
        ctx.weight, ctx.lowrank = weight, lowrank
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, grad_y):
        xv, w = ctx.saved_tensors
        grad_x = grad_y @ w
        dtype = torch.float32 if grad_y.dtype in (torch.bfloat16, torch.float16) else grad_y.dtype  # accumulate >= fp32
        factor = grad_y.reshape(-1, grad_y.shape[-1]).T.to(dtype) @ xv.reshape(-1, xv.shape[-1]).to(dtype)
        ctx.lowrank.add(ctx.weight, factor)
        return grad_x, None, None, None


def low_rank_linear(linear: torch.nn.Linear, x: torch.Tensor, lowrank: LowRankWgrad) -> torch.Tensor:
    return _LowRankLinear.apply(x, linear.weight, lowrank.basis(linear.weight), lowrank)


class Neighbour:
    """What the model consults per micro-batch: which techniques, and the low-rank state they need."""

    def __init__(self, techniques: Techniques, lowrank: LowRankWgrad | None = None):
        if (techniques.low_rank_wgrad or techniques.low_rank_head) and lowrank is None:
            lowrank = LowRankWgrad()
        self.techniques, self.lowrank = techniques, lowrank
        self.held: list[torch.Tensor] | None = None  # set by costs.py to see the tensors checkpoint keeps

    def linear(self, linear: torch.nn.Linear, x: torch.Tensor, low_rank: bool) -> torch.Tensor:
        return low_rank_linear(linear, x, self.lowrank) if low_rank else linear(x)

    def ffn(self, block, h: torch.Tensor) -> torch.Tensor:
        """FFN(RMSNorm(h)), SwiGLU written out so that each projection can take the low-rank estimator."""
        x = block.ffn_norm(h)
        lr, ffn = self.techniques.low_rank_wgrad, block.ffn
        a = F.silu(self.linear(ffn.gate_proj, x, lr)) * self.linear(ffn.up_proj, x, lr)
        return self.linear(ffn.down_proj, a, lr)

    def block(self, block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = self.techniques
        if t.skip_attention:
            with torch.no_grad():
                a = block.attention(block.attention_norm(x), cos, sin)
            h = x + a
        else:
            h = x + block.attention(block.attention_norm(x), cos, sin)
        if t.skip_ffn:
            with torch.no_grad():
                f = self.ffn(block, h)
            return h + f
        if t.recompute_ffn and torch.is_grad_enabled():
            if self.held is not None:
                self.held.append(h)
            return h + checkpoint(self.ffn, block, h, use_reentrant=False)
        return h + self.ffn(block, h)

    def head(self, lm_head: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return self.linear(lm_head, x, self.techniques.low_rank_head)

    def finish(self) -> None:
        """Apply pending low-rank weight gradients; call once after the step's last backward."""
        if self.lowrank is not None:
            self.lowrank.finish()
